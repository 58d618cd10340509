//! The agent's main loop: load or re-open the datapath, wait for a complete view of the source,
//! then keep the maps equal to the desired state. It never sits on the packet path, and exiting
//! (SIGTERM, SIGKILL, crash) leaves the datapath attached and serving the last state.

use std::collections::BTreeSet;
use std::error::Error;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};

use crate::checkpoint;
use crate::desired::{self, NodeConfig};
use crate::http::{self, Response};
use crate::kernel::{self, MapCapacities};
use crate::reconcile::Reconciler;
use crate::source::{self, SourceHealth};
use crate::{AgentArgs, SourceKind};

/// What health and metrics report. Updated by the loop, read by the HTTP handlers.
#[derive(Default)]
struct Status {
    /// Unix time of the last successful sync, if any.
    last_synced: Option<f64>,
    syncs: u64,
    sync_failures: u64,
    last_sync_seconds: f64,
    frontends: usize,
    backends: usize,
    rejected_objects: usize,
    /// Serving the checkpoint's state; the source has not confirmed it yet.
    restored_from_checkpoint: bool,
}

fn now_unix() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}

/// Formats an error with its causes: `outer: inner: innermost`.
pub fn error_chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    if !args.interfaces.is_empty() {
        tracing::warn!(interfaces = ?args.interfaces, "--interfaces is for the packet-level datapath (NodePort), which this build does not have yet; ignored");
    }
    let cgroup = args.cgroup.clone().context("no cgroup")?;
    let caps = MapCapacities {
        services: args.map_size_services,
        backends: args.map_size_backends,
        rev_nat: args.map_size_rev_nat,
        rev_sock: args.map_size_rev_sock,
    };
    let _lock = take_writer_lock(&args.state_dir).await?;
    let datapath = kernel::load(&args.bpffs, &cgroup, &caps).context("setting up the datapath")?;
    let mut reconciler = Reconciler::adopt(datapath.maps).context("reading the pinned maps")?;
    tracing::info!(
        bpffs = %args.bpffs.display(),
        cgroup = %cgroup.display(),
        frontends = reconciler.programmed_frontends(),
        backends = reconciler.programmed_backends(),
        "datapath ready; re-learned what the pinned maps hold, changing nothing until the source is read"
    );

    let status = Arc::new(Mutex::new(Status::default()));
    if reconciler.programmed_frontends() == 0 {
        restore_checkpoint(&args.state_dir, &mut reconciler, &status);
    }
    let source_health = Arc::new(SourceHealth::default());
    let _healthz = {
        let status = status.clone();
        let source_health = source_health.clone();
        http::serve(args.healthz_bind, move |path| healthz(&status, &source_health, path))
            .await
            .with_context(|| format!("binding --healthz-bind {}", args.healthz_bind))?
    };
    let _metrics = {
        let status = status.clone();
        let bpffs = args.bpffs.clone();
        let source_health = source_health.clone();
        http::serve(args.metrics_bind, move |path| metrics(&status, &source_health, &bpffs, path))
            .await
            .with_context(|| format!("binding --metrics-bind {}", args.metrics_bind))?
    };

    let config = NodeConfig { node_name: args.node_name.clone() };
    let mut source = match &args.source {
        SourceKind::File(path) => source::file::start(path.clone(), args.poll_interval, source_health),
        SourceKind::Kube => {
            let client = source::kube::client(args.kubeconfig.as_deref()).await?;
            source::kube::start(client, &args.node_name, source_health)
        }
    };
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // Frontends that did not fit (e.g. a full map) are retried on this tick.
    let mut retry = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut failing = false;
    let mut reported: BTreeSet<String> = BTreeSet::new();
    let mut checkpointed: Option<desired::DesiredState> = None;
    tracing::info!("waiting for a complete view from the source before changing anything");

    loop {
        tokio::select! {
            changed = source.generation.changed() => if changed.is_err() { anyhow::bail!("the source stopped") },
            _ = retry.tick(), if failing => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if *source.generation.borrow_and_update() == 0 {
            continue;
        }

        let started = Instant::now();
        let snapshot = (source.read)();
        let desired = desired::compute(&snapshot.cluster, &config);
        let rejections: Vec<_> = snapshot.rejections.iter().chain(&desired.rejections).collect();
        let report = reconciler.reconcile(&desired);
        let elapsed = started.elapsed();

        // Each problem is logged once while it persists, not on every retry.
        let mut current = BTreeSet::new();
        for rejection in &rejections {
            current.insert(format!("rejected {rejection}"));
        }
        for failure in &report.failures {
            current.insert(format!("not programmed: {}: {}", failure.what, error_chain(&failure.error)));
        }
        for problem in current.difference(&reported) {
            tracing::warn!("{problem}");
        }
        reported = current;
        failing = !report.failures.is_empty();

        let mut st = status.lock().expect("status lock");
        st.frontends = reconciler.programmed_frontends();
        st.backends = reconciler.programmed_backends();
        st.rejected_objects = rejections.len();
        st.last_sync_seconds = elapsed.as_secs_f64();
        if failing {
            st.sync_failures += 1;
        } else {
            st.syncs += 1;
            st.last_synced = Some(now_unix());
            st.restored_from_checkpoint = false;
            if checkpointed.as_ref().map(|c| &c.frontends) != Some(&desired.frontends) {
                match checkpoint::save(&args.state_dir, &desired) {
                    Ok(()) => checkpointed = Some(desired.clone()),
                    Err(error) => tracing::warn!("cannot write the checkpoint: {}", error_chain(&error)),
                }
            }
        }
        if report.writes > 0 || failing || st.syncs == 1 {
            tracing::info!(
                frontends = st.frontends,
                backends = st.backends,
                writes = report.writes,
                failures = report.failures.len(),
                took_ms = format!("{:.2}", elapsed.as_secs_f64() * 1e3),
                "synced"
            );
        }
    }
    tracing::info!("stopping; the datapath stays attached and keeps serving the last state (`ebpf-proxy cleanup` removes it)");
    Ok(())
}

/// On an empty datapath (a reboot emptied bpffs, or a first start) the last checkpoint is
/// programmed at once, before the source answers, so Services (cluster DNS first of all) work
/// even when the API server is unreachable. The source's first complete view replaces it.
fn restore_checkpoint<M: crate::lbmap::LbMaps>(state_dir: &std::path::Path, reconciler: &mut Reconciler<M>, status: &Mutex<Status>) {
    match checkpoint::load(state_dir) {
        Ok(None) => {}
        Ok(Some(state)) => {
            let report = reconciler.reconcile(&state);
            for failure in &report.failures {
                tracing::warn!("checkpoint entry not restored: {}: {}", failure.what, error_chain(&failure.error));
            }
            status.lock().expect("status lock").restored_from_checkpoint = true;
            tracing::warn!(
                frontends = reconciler.programmed_frontends(),
                backends = reconciler.programmed_backends(),
                "datapath was empty: restored it from the checkpoint {}; serving that until the source answers",
                checkpoint::path(state_dir).display()
            );
        }
        Err(error) => tracing::error!("ignoring the checkpoint, it is not trustworthy: {}", error_chain(&error)),
    }
}

/// One writer per node: the agent holds an exclusive lock on `<state-dir>/agent.lock` for its
/// lifetime. A second agent (e.g. a rolling update that overlaps) waits here, before touching
/// the datapath, until the first one exits; the kernel releases the lock even on SIGKILL.
async fn take_writer_lock(state_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating --state-dir {}", state_dir.display()))?;
    let path = state_dir.join("agent.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock(2) on a file descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(file);
    }
    tracing::warn!(lock = %path.display(), "another agent is writing this node's datapath; waiting for it to exit");
    tokio::task::spawn_blocking(move || {
        // SAFETY: as above; blocks until the other holder's descriptor is closed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error()).context("waiting for the agent lock");
        }
        tracing::info!("took over the agent lock");
        Ok(file)
    })
    .await?
}

/// `/livez`: the process runs (the datapath does not depend on it anyway).
/// `/healthz`: 200 once the datapath was programmed from a complete view and the source can
/// confirm that view is current; 503 before the first sync and while the source is failing
/// (`"stale": true`: the datapath serves the last known state).
fn healthz(status: &Mutex<Status>, source: &SourceHealth, path: &str) -> Response {
    let st = status.lock().expect("status lock");
    match path {
        "/livez" => Response::text(200, "ok"),
        "/healthz" => {
            let failing = source.failing();
            let body = serde_json::json!({
                "lastUpdated": st.last_synced,
                "currentTime": now_unix(),
                "stale": failing.is_some(),
                "staleSeconds": failing.as_ref().map(|(since, _)| since.elapsed().as_secs_f64()),
                "sourceError": failing.as_ref().map(|(_, error)| error.clone()),
                "restoredFromCheckpoint": st.restored_from_checkpoint,
            });
            let healthy = st.last_synced.is_some() && failing.is_none();
            Response::json(if healthy { 200 } else { 503 }, body.to_string())
        }
        _ => Response::text(404, "not found"),
    }
}

fn metrics(status: &Mutex<Status>, source: &SourceHealth, bpffs: &std::path::Path, path: &str) -> Response {
    if path != "/metrics" {
        return Response::text(404, "not found");
    }
    let mut out = String::new();
    {
        let st = status.lock().expect("status lock");
        let mut gauge = |name: &str, help: &str, kind: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        gauge("ebpf_proxy_sync_total", "Successful syncs of the datapath.", "counter", st.syncs as f64);
        gauge("ebpf_proxy_sync_failures_total", "Syncs with a frontend that could not be programmed.", "counter", st.sync_failures as f64);
        gauge("ebpf_proxy_last_sync_duration_seconds", "Duration of the last sync.", "gauge", st.last_sync_seconds);
        gauge("ebpf_proxy_last_sync_timestamp_seconds", "Unix time of the last successful sync.", "gauge", st.last_synced.unwrap_or(0.0));
        gauge("ebpf_proxy_frontends_programmed", "Frontends (VIP, port, protocol) in the datapath.", "gauge", st.frontends as f64);
        gauge("ebpf_proxy_backends_programmed", "Backends in the datapath.", "gauge", st.backends as f64);
        gauge("ebpf_proxy_source_up", "1 while the source (API or file) answers, 0 during an outage.", "gauge", if source.failing().is_some() { 0.0 } else { 1.0 });
        gauge("ebpf_proxy_rejected_objects", "Objects or parts of objects rejected in the last sync.", "gauge", st.rejected_objects as f64);
    }
    if let Ok(counters) = kernel::read_counters(bpffs) {
        let _ = writeln!(out, "# HELP ebpf_proxy_datapath_events_total Datapath verdicts by kind.\n# TYPE ebpf_proxy_datapath_events_total counter");
        for (value, name) in counters.into_iter().zip(proxy_abi::stat::NAMES) {
            let _ = writeln!(out, "ebpf_proxy_datapath_events_total{{kind=\"{name}\"}} {value}");
        }
    }
    Response { status: 200, content_type: "text/plain; version=0.0.4", body: out }
}
