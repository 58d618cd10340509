//! The agent's main loop: load or re-open the datapath, wait for a complete view of the source,
//! then keep the maps equal to the desired state. It never sits on the packet path, and exiting
//! (SIGTERM, SIGKILL, crash) leaves the datapath attached and serving the last state.

use std::collections::BTreeSet;
use std::error::Error;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};

use crate::checkpoint;
use crate::desired::{self, NodeConfig};
use crate::healthcheck::{self, HealthCheckServers, ProxyHealth};
use crate::http::{self, Response};
use crate::kernel::{self, FlowMaps, MapCapacities};
use crate::metrics::{self, SyncMetrics};
use crate::reconcile::Reconciler;
use crate::source::{self, SourceHealth};
use crate::{AgentArgs, SourceKind};

mod sync;

pub use sync::Syncer;

/// What health and metrics report. Updated by the loop, read by the HTTP handlers.
#[derive(Default)]
pub struct Status {
    /// Unix time of the last successful sync, if any.
    last_synced: Option<f64>,
    /// Serving the checkpoint's state; the source has not confirmed it yet.
    restored_from_checkpoint: bool,
    /// When the source delivered the oldest change that no sync has fully programmed yet
    /// (kube-proxy's oldest queued update); `/healthz` fails once it is `--healthz-stale-after` old.
    oldest_unprogrammed_change: Option<Instant>,
    /// The first failure of the last sync, while the datapath lacks part of the desired state.
    datapath_error: Option<String>,
    /// Syncs that changed what the checkpoint should hold, and how many of them the file on
    /// disk reflects (`/healthz` says `checkpointCurrent` when they are equal).
    checkpoint_wanted: u64,
    checkpoint_written: u64,
    metrics: SyncMetrics,
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
    let interfaces = kernel::tc::resolve_interfaces(&args.interfaces).context("listing the node's interfaces")?;
    let cgroup = args.cgroup.clone().context("no cgroup")?;
    let caps = MapCapacities {
        services: args.map_size_services,
        backends: args.map_size_backends,
        rev_nat: args.map_size_rev_nat,
        rev_sock: args.map_size_rev_sock,
        ct: args.map_size_ct,
        affinity: args.map_size_affinity,
        rev_sock6: args.map_size_rev_sock6,
        ct6: args.map_size_ct6,
    };
    let _lock = if args.restore_only {
        match try_writer_lock(&args.state_dir)? {
            Some(lock) => lock,
            None => {
                tracing::info!("--restore-only: another agent holds the node lock and serves this node; nothing to restore");
                return Ok(());
            }
        }
    } else {
        take_writer_lock(&args.state_dir).await?
    };
    let object = match &args.bpf_object {
        Some(path) => Some(std::fs::read(path).with_context(|| format!("reading --bpf-object {}", path.display()))?),
        None => None,
    };
    let mut datapath =
        kernel::load(&args.bpffs, &cgroup, &caps, object.as_deref()).context("setting up the datapath")?;
    match kernel::carry_over_v1_conntrack(&args.bpffs) {
        Ok(0) => {}
        Ok(flows) => tracing::info!(entries = flows, "carried the tracked flows of the previous conntrack layout over"),
        Err(error) => tracing::warn!("cannot carry the previous layout's tracked flows over: {}", error_chain(&error)),
    }
    match kernel::carry_over_v1_affinity(&args.bpffs) {
        Ok(0) => {}
        Ok(entries) => tracing::info!(entries, "carried the session-affinity entries of the previous layout over"),
        Err(error) => tracing::warn!("cannot carry the previous layout's session-affinity entries over: {}", error_chain(&error)),
    }
    kernel::tc::attach(&mut datapath, &args.bpffs, &interfaces, args.tc_attach)
        .with_context(|| format!("attaching the packet-level programs to {interfaces:?}"))?;
    // Every program is loaded now (the socket hooks by `load`, the TC programs by `attach`).
    if let Err(error) = datapath.forward_kernel_log() {
        tracing::warn!("the kernel programs' failure log will not be shown: {}", error_chain(&error));
    }
    let flows = datapath.flows.clone();
    let attached_anew = datapath.attached_anew;
    configure_snat_ports(&args, &flows)?;
    for path in kernel::remove_obsolete_pins(&args.bpffs) {
        tracing::info!(pin = %path.display(), "unpinned a map of an earlier layout that no program uses any more");
    }
    let mut reconciler =
        Reconciler::adopt(datapath.maps).context("reading the pinned maps")?.with_algorithm(args.lb_algorithm);
    tracing::info!(
        bpffs = %args.bpffs.display(),
        cgroup = %cgroup.display(),
        frontends = reconciler.programmed_frontends(),
        backends = reconciler.programmed_backends(),
        "datapath ready; re-learned what the pinned maps hold, changing nothing until the source is read"
    );

    let status = Arc::new(Mutex::new(Status::default()));
    {
        let metrics = &status.lock().expect("status lock").metrics;
        metrics.adopted_frontends.set(metrics::gauge_count(reconciler.programmed_frontends()));
        metrics.attached_anew.set(metrics::gauge_count(attached_anew));
    }
    if reconciler.programmed_frontends() == 0 {
        restore_checkpoint(&args.state_dir, &mut reconciler, &status);
    }
    if args.restore_only {
        tracing::info!(
            frontends = reconciler.programmed_frontends(),
            backends = reconciler.programmed_backends(),
            "--restore-only: the datapath is attached and programmed; exiting, leaving it to the next agent"
        );
        return Ok(());
    }
    let source_health = Arc::new(SourceHealth::default());
    let stale_after = args.healthz_stale_after;
    let _healthz = {
        let status = status.clone();
        let source_health = source_health.clone();
        http::serve(args.healthz_bind, move |path| healthz(&status, &source_health, stale_after, path))
            .await
            .with_context(|| format!("binding --healthz-bind {}", args.healthz_bind))?
    };
    let _metrics = {
        let flows = flows.clone();
        let registry = metrics::registry(
            &status.lock().expect("status lock").metrics,
            source_health.clone(),
            move || flows.counters(),
        );
        http::serve(args.metrics_bind, move |path| metrics(&registry, path))
            .await
            .with_context(|| format!("binding --metrics-bind {}", args.metrics_bind))?
    };
    let mut health_checks = {
        let status = status.clone();
        let source_health = source_health.clone();
        HealthCheckServers::new(Arc::new(move || {
            proxy_health(&status.lock().expect("status lock"), &source_health, stale_after).healthy
        }))
    };
    let mut config = NodeConfig {
        node_name: args.node_name.clone(),
        interface_addresses: Vec::new(),
        nodeport_addresses: args.nodeport_addresses.clone(),
    };
    // An address change alone (DHCP, a new interface) must move the NodePorts and SNAT sources
    // even when no Kubernetes object changes: the kernel announces each one (rtnetlink). They
    // are also re-read every minute, in case an announcement was lost (a netlink socket whose
    // buffer overflowed), and every 2 s if the announcements cannot be had at all.
    let mut address_changes = match crate::netif::AddressChanges::subscribe() {
        Ok(changes) => Some(changes),
        Err(error) => {
            tracing::warn!("cannot subscribe to the kernel's address announcements ({error}): reading the node's addresses every 2 s");
            None
        }
    };
    let mut address_poll = tokio::time::interval(if address_changes.is_some() { ADDRESS_REREAD } else { ADDRESS_POLL });
    let mut source = match &args.source {
        SourceKind::File(path) => source::file::start(path.clone(), args.poll_interval, source_health),
        SourceKind::Kube => {
            let client = source::kube::client(args.kubeconfig.as_deref()).await?;
            source::kube::start(client, &args.node_name, source_health)
        }
    };
    let mut conntrack_gc = tokio::time::interval(args.conntrack_gc_interval);
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // Frontends that did not fit (e.g. a full map) are retried on this tick.
    let mut retry = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut failing = false;
    // The checkpoint is written off the loop, at most once per tick: at 30 000 Services writing
    // it takes longer than programming a change, and a burst of changes needs one write.
    let mut checkpoint_tick = tokio::time::interval(CHECKPOINT_INTERVAL);
    checkpoint_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checkpoint_writer = CheckpointWriter::default();
    let flows_purge = Arc::new(BackgroundJob::default());
    let mut syncer = Syncer::new(reconciler, args.service_node_port_range);
    tracing::info!("waiting for a complete view from the source before changing anything");

    loop {
        tokio::select! {
            changed = source.generation.changed() => if changed.is_err() { anyhow::bail!("the source stopped") },
            _ = retry.tick(), if failing => {}
            () = async { address_changes.as_mut().expect("guarded").next().await }, if address_changes.is_some() => {
                if crate::netif::node_addresses().ok().as_ref() == Some(&config.interface_addresses) { continue }
            }
            _ = address_poll.tick() => if crate::netif::node_addresses().ok().as_ref() == Some(&config.interface_addresses) { continue },
            _ = conntrack_gc.tick() => {
                remove_expired_flows(&flows);
                continue;
            }
            _ = checkpoint_tick.tick() => {
                checkpoint_writer.write(&args.state_dir, syncer.desired(), &status, false);
                continue;
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if *source.generation.borrow_and_update() == 0 {
            continue;
        }

        let started = Instant::now();
        let snapshot = (source.read)();
        match crate::netif::node_addresses() {
            Ok(addresses) if addresses != config.interface_addresses => {
                // The SNAT source of each interface follows too (only what changed is written).
                if let Err(error) = flows.record_interface_addresses(&interfaces) {
                    tracing::warn!(
                        "cannot record the interfaces' new addresses: {}",
                        error_chain(&error)
                    );
                }
                config.interface_addresses = addresses;
            }
            Ok(_) => {}
            Err(error) => tracing::warn!("cannot read the node's addresses, keeping the last ones: {error}"),
        }
        let mut synced = syncer.sync(started, snapshot, &config, &status);
        failing = synced.failing;
        abort_udp_sockets(&cgroup, std::mem::take(&mut synced.gone_udp));
        if synced.wrote() {
            purge_stale_flows(&flows, &flows_purge);
        }
        if synced.writes >= LARGE_PASS_WRITES {
            release_freed_memory();
        }
        health_checks.sync(&synced.health_checks).await;
        status
            .lock()
            .expect("status lock")
            .metrics
            .health_check_ports
            .set(metrics::gauge_count(health_checks.open_ports()));
    }
    // What the last syncs programmed reaches the checkpoint before the agent goes (an upgrade
    // or a reboot right after a change must not restore an older state).
    checkpoint_writer.finish().await;
    checkpoint_writer.write(&args.state_dir, syncer.desired(), &status, true);
    checkpoint_writer.finish().await;
    tracing::info!("stopping; the datapath stays attached and keeps serving the last state (`ebpf-proxy cleanup` removes it)");
    Ok(())
}

/// How often the checkpoint may be written while changes keep coming.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);
/// How often the node's addresses are re-read although the kernel announces their changes.
const ADDRESS_REREAD: Duration = Duration::from_secs(60);
/// How often they are read when the announcements cannot be subscribed to.
const ADDRESS_POLL: Duration = Duration::from_secs(2);

/// Writes the checkpoint off the loop, one write at a time; the copy handed over shares the
/// specs (`Arc`), so it costs the loop little. Writes are spaced so that they take at most a
/// `CHECKPOINT_SHARE`th of a core: at 30 000 Services one is 25 MiB of JSON, fsynced, about
/// 90 ms, and under steady churn a write every `CHECKPOINT_INTERVAL` took more CPU than the
/// syncs themselves. A reboot then restores a state a little older at most; the agent's exit
/// still writes the last one.
#[derive(Default)]
struct CheckpointWriter {
    /// The write under way, and when it started.
    running: Option<(tokio::task::JoinHandle<Duration>, Instant)>,
    /// No write starts before this (unless forced).
    not_before: Option<Instant>,
}

const CHECKPOINT_SHARE: u32 = 20;

impl CheckpointWriter {
    /// Starts writing what `desired` holds if a sync asked for it since the last write, none
    /// is under way, and (unless `forced`) the spacing after the last one has passed.
    fn write(&mut self, state_dir: &std::path::Path, desired: &desired::DesiredState, status: &Arc<Mutex<Status>>, forced: bool) {
        match self.running.take() {
            Some((writer, started)) if writer.is_finished() => {
                if let Some(Ok(took)) = futures::FutureExt::now_or_never(writer) {
                    self.ended(started, took);
                }
            }
            Some(running) => {
                self.running = Some(running);
                return;
            }
            None => {}
        }
        if !forced && self.not_before.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let wanted = {
            let st = status.lock().expect("status lock");
            if st.checkpoint_wanted == st.checkpoint_written {
                return;
            }
            st.checkpoint_wanted
        };
        let started = Instant::now();
        let state = desired::DesiredState { frontends: desired.frontends.clone(), rejections: Vec::new() };
        let (state_dir, status) = (state_dir.to_owned(), status.clone());
        let writer = tokio::task::spawn_blocking(move || {
            match checkpoint::save(&state_dir, &state) {
                Ok(()) => status.lock().expect("status lock").checkpoint_written = wanted,
                Err(error) => tracing::warn!("cannot write the checkpoint: {}", error_chain(&error)),
            }
            started.elapsed()
        });
        self.running = Some((writer, started));
    }

    /// Waits for the write under way, if any.
    async fn finish(&mut self) {
        if let Some((writer, started)) = self.running.take() {
            if let Ok(took) = writer.await {
                self.ended(started, took);
            }
        }
    }

    fn ended(&mut self, started: Instant, took: Duration) {
        self.not_before = Some(started + (took * CHECKPOINT_SHARE).max(CHECKPOINT_INTERVAL));
    }
}

/// A pass that wrote this many entries (a cold start, a relist at scale) freed most of what it
/// allocated along the way.
const LARGE_PASS_WRITES: usize = 10_000;

/// Hands the heap's free pages back to the kernel. glibc keeps what a large pass freed (at
/// 30 000 Services, tens of MiB of transients), and the agent's RSS would stay at its peak.
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free memory of the allocator's own heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A blocking job that runs at most once at a time; asked again while it runs, it runs once
/// more afterwards (so the last request is always served).
#[derive(Default)]
struct BackgroundJob {
    running: std::sync::atomic::AtomicBool,
    again: std::sync::atomic::AtomicBool,
}

impl BackgroundJob {
    fn request(self: &Arc<Self>, job: impl Fn() + Send + 'static) {
        use std::sync::atomic::Ordering::SeqCst;
        self.again.store(true, SeqCst);
        if self.running.swap(true, SeqCst) {
            return;
        }
        let this = self.clone();
        tokio::task::spawn_blocking(move || loop {
            while this.again.swap(false, SeqCst) {
                job();
            }
            this.running.store(false, SeqCst);
            // A request that came between the last run and the store above.
            if !this.again.load(SeqCst) || this.running.swap(true, SeqCst) {
                break;
            }
        });
    }
}

/// Deletes affinity entries and UDP conntrack entries that point at a backend their frontend
/// no longer has, off the loop (it scans the flow tables).
fn purge_stale_flows(flows: &Arc<FlowMaps>, job: &Arc<BackgroundJob>) {
    let flows = flows.clone();
    job.request(move || match flows.purge_stale_flows() {
        Ok(purged) if purged != kernel::flows::PurgedFlows::default() => {
            tracing::info!(
                affinity = purged.affinity,
                udp_conntrack = purged.udp_conntrack,
                udp_sockets = purged.udp_sockets,
                "purged flows of removed backends"
            );
        }
        Ok(_) => {}
        Err(error) => tracing::warn!("cannot purge flows of removed backends: {}", error_chain(&error)),
    });
}

/// Tells the kernel programs which SNAT ports they may use: `--snat-port-range` without the
/// node's ephemeral range and the NodePort range.
fn configure_snat_ports(args: &AgentArgs, flows: &FlowMaps) -> anyhow::Result<()> {
    use crate::snat_ports::{datapath_config, ephemeral_range, Excluded};
    let ephemeral = ephemeral_range().context("reading net.ipv4.ip_local_port_range")?;
    let excluded = [
        Excluded { ports: ephemeral, what: "the node's ephemeral range (net.ipv4.ip_local_port_range)" },
        Excluded { ports: args.service_node_port_range, what: "the NodePort range (--service-node-port-range)" },
    ];
    let (config, ports) =
        datapath_config(args.snat_port_range, &excluded).map_err(anyhow::Error::msg)?;
    flows
        .write_config(&config)
        .context("writing the datapath settings")?;
    tracing::info!(
        range = %args.snat_port_range,
        ephemeral = %ephemeral,
        node_ports = %args.service_node_port_range,
        ports,
        "SNAT source ports: the range without the node's ephemeral ports and the NodePort range"
    );
    Ok(())
}

/// Deletes conntrack entries past their timeout, off the async workers.
fn remove_expired_flows(flows: &Arc<FlowMaps>) {
    let flows = flows.clone();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let gc = flows.remove_expired_flows();
        if gc.removed > 0 {
            tracing::debug!(
                removed = gc.removed,
                scanned = gc.scanned,
                took_ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
                "removed expired conntrack entries"
            );
        }
    });
}

/// Aborts (in the background) local clients' connected UDP sockets to `gone` backends.
fn abort_udp_sockets(cgroup: &std::path::Path, gone: BTreeSet<std::net::SocketAddr>) {
    if gone.is_empty() {
        return;
    }
    let cgroup = cgroup.to_owned();
    tokio::task::spawn_blocking(move || match crate::sockdestroy::destroy_udp_connected_to(&cgroup, &gone) {
        Ok(0) => {}
        Ok(count) => tracing::info!(sockets = count, backends = ?gone, "aborted connected UDP sockets of removed backends"),
        Err(error) => tracing::warn!("cannot abort UDP sockets connected to removed backends: {}", error_chain(&error)),
    });
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
    let file = open_lock_file(state_dir)?;
    if try_lock(&file, state_dir)? {
        return Ok(file);
    }
    tracing::warn!(lock = %state_dir.join(LOCK_FILE).display(), "another agent is writing this node's datapath; waiting for it to exit");
    tokio::task::spawn_blocking(move || {
        file.lock().context("waiting for the agent lock")?;
        tracing::info!("took over the agent lock");
        Ok(file)
    })
    .await?
}

const LOCK_FILE: &str = "agent.lock";

/// The node lock if no other agent holds it (flock(2) underneath: released by the kernel when
/// the holder dies, even on SIGKILL).
fn try_writer_lock(state_dir: &std::path::Path) -> anyhow::Result<Option<std::fs::File>> {
    let file = open_lock_file(state_dir)?;
    Ok(try_lock(&file, state_dir)?.then_some(file))
}

/// Whether the lock was taken (false: another agent holds it).
fn try_lock(file: &std::fs::File, state_dir: &std::path::Path) -> anyhow::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(error)) => Err(error).with_context(|| format!("locking {}", state_dir.join(LOCK_FILE).display())),
    }
}

fn open_lock_file(state_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating --state-dir {}", state_dir.display()))?;
    let path = state_dir.join(LOCK_FILE);
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))
}

/// The `/healthz` verdict (also `serviceProxyHealthy` of the healthCheckNodePort answers).
fn proxy_health(st: &Status, source: &SourceHealth, stale_after: Duration) -> ProxyHealth {
    let behind = healthcheck::behind_api(st.oldest_unprogrammed_change, Instant::now(), stale_after);
    healthcheck::proxy_health(st.last_synced.is_some(), source.failing().map(|(since, _)| since.elapsed()), behind)
}

/// `/livez`: the process runs (the datapath does not depend on it anyway).
/// `/healthz`: 200 once the datapath was programmed from a complete view and the source can
/// confirm that view is current; 503 before the first sync, while the source is failing, and
/// when an API change has not reached the datapath within `--healthz-stale-after` (e.g. a full
/// map); `"stale": true` says the datapath serves an older state than the API's.
fn healthz(status: &Mutex<Status>, source: &SourceHealth, stale_after: Duration, path: &str) -> Response {
    match path {
        "/livez" => Response::text(200, "ok"),
        "/healthz" => {
            let st = status.lock().expect("status lock");
            let health = proxy_health(&st, source, stale_after);
            let body = serde_json::json!({
                "lastUpdated": st.last_synced,
                "currentTime": now_unix(),
                "stale": health.stale,
                "staleSeconds": health.stale_for.map(|d| d.as_secs_f64()),
                "sourceError": source.failing().map(|(_, error)| error),
                "pendingChangeSeconds": st.oldest_unprogrammed_change.map(|t| t.elapsed().as_secs_f64()),
                "staleAfterSeconds": stale_after.as_secs_f64(),
                "datapathError": st.datapath_error,
                "restoredFromCheckpoint": st.restored_from_checkpoint,
                "checkpointCurrent": st.checkpoint_wanted == st.checkpoint_written,
            });
            Response::json(if health.healthy { 200 } else { 503 }, body.to_string())
        }
        _ => Response::text(404, "not found"),
    }
}

/// `/metrics`: the registry in the text format. It takes no lock of the agent loop's: the
/// metrics are atomics shared with the loop, and the stats map is read by its collector.
fn metrics(registry: &prometheus_client::registry::Registry, path: &str) -> Response {
    if path != "/metrics" {
        return Response::text(404, "not found");
    }
    match metrics::render(registry) {
        Ok(body) => Response { status: 200, content_type: metrics::CONTENT_TYPE, body },
        // Only a failing `fmt::Write` can fail rendering, and a String never fails: kept as a
        // 500 rather than a panic in the HTTP task.
        Err(_) => Response::text(500, "cannot render the metrics"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One write at a time, and the next not before the spacing after the last (a forced one,
    /// the agent's last before it exits, at once).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn checkpoint_writes_are_spaced_and_the_last_is_forced() {
        let dir = std::env::temp_dir().join(format!("epx-checkpoint-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = Arc::new(Mutex::new(Status::default()));
        let desired = desired::DesiredState::default();
        let written = |status: &Mutex<Status>| status.lock().unwrap().checkpoint_written;
        let mut writer = CheckpointWriter::default();

        status.lock().unwrap().checkpoint_wanted = 1;
        writer.write(&dir, &desired, &status, false);
        writer.finish().await;
        assert_eq!(written(&status), 1);
        let not_before = writer.not_before.expect("spaced after a write");
        assert!(not_before >= Instant::now() + CHECKPOINT_INTERVAL / 2, "the next write waits");

        status.lock().unwrap().checkpoint_wanted = 2;
        writer.write(&dir, &desired, &status, false);
        assert!(writer.running.is_none(), "a write started before the spacing passed");
        tokio::time::sleep_until(not_before.into()).await;
        writer.write(&dir, &desired, &status, false);
        writer.finish().await;
        assert_eq!(written(&status), 2);

        status.lock().unwrap().checkpoint_wanted = 3;
        writer.write(&dir, &desired, &status, true);
        writer.finish().await;
        assert_eq!(written(&status), 3, "the agent's last write waits for nothing");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
