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
use crate::kernel::{self, MapCapacities};
use crate::metrics::{self, SyncMetrics};
use crate::reconcile::Reconciler;
use crate::source::{self, SourceHealth};
use crate::{AgentArgs, SourceKind};

/// What health and metrics report. Updated by the loop, read by the HTTP handlers.
#[derive(Default)]
struct Status {
    /// Unix time of the last successful sync, if any.
    last_synced: Option<f64>,
    /// Serving the checkpoint's state; the source has not confirmed it yet.
    restored_from_checkpoint: bool,
    /// When the source delivered the oldest change that no sync has fully programmed yet
    /// (kube-proxy's oldest queued update); `/healthz` fails once it is `--healthz-stale-after` old.
    oldest_unprogrammed_change: Option<Instant>,
    /// The first failure of the last sync, while the datapath lacks part of the desired state.
    datapath_error: Option<String>,
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
    let _lock = take_writer_lock(&args.state_dir).await?;
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
    kernel::tc::attach(&mut datapath, &args.bpffs, &interfaces, args.tc_attach)
        .with_context(|| format!("attaching the packet-level programs to {interfaces:?}"))?;
    configure_snat_ports(&args)?;
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
    if reconciler.programmed_frontends() == 0 {
        restore_checkpoint(&args.state_dir, &mut reconciler, &status);
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
        let bpffs = args.bpffs.clone();
        let registry = metrics::registry(&status.lock().expect("status lock").metrics, source_health.clone(), move || {
            kernel::read_counters(&bpffs)
        });
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
    let agent_started = SystemTime::now();
    // The view read last, to tell which objects changed (network programming latency), and the
    // times of changes not programmed yet.
    let mut last_view = desired::ClusterState::default();
    let mut unprogrammed_changes: Vec<SystemTime> = Vec::new();

    let mut config = NodeConfig {
        node_name: args.node_name.clone(),
        interface_addresses: Vec::new(),
        nodeport_addresses: args.nodeport_addresses.clone(),
    };
    // The node's addresses are polled too: a change alone (DHCP, a new interface) must move the
    // NodePorts even when no Kubernetes object changes.
    let mut address_poll = tokio::time::interval(std::time::Duration::from_secs(2));
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
    let mut reported: BTreeSet<String> = BTreeSet::new();
    let mut checkpointed: Option<desired::DesiredState> = None;
    tracing::info!("waiting for a complete view from the source before changing anything");

    // UDP backends of the last computation: a connected UDP socket to one that disappears is
    // aborted. Seeded from the maps as adopted (or restored), so that a backend removed while
    // the agent was down is noticed at its first sync too.
    let mut udp_backends: BTreeSet<std::net::SocketAddr> = reconciler
        .programmed_backend_addrs()
        .filter(|b| b.proto == desired::Proto::Udp)
        .map(|b| std::net::SocketAddr::new(b.addr, b.port))
        .collect();
    loop {
        tokio::select! {
            changed = source.generation.changed() => if changed.is_err() { anyhow::bail!("the source stopped") },
            _ = retry.tick(), if failing => {}
            _ = address_poll.tick() => if crate::netif::node_addresses().ok().as_ref() == Some(&config.interface_addresses) { continue },
            _ = conntrack_gc.tick() => {
                remove_expired_flows(&args.bpffs);
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
        if let Some(changed_at) = snapshot.changed_at {
            let received = SystemTime::now().checked_sub(changed_at.elapsed()).unwrap_or(agent_started);
            unprogrammed_changes.extend(metrics::change_times(&last_view, &snapshot.cluster, received, agent_started));
            let mut st = status.lock().expect("status lock");
            st.oldest_unprogrammed_change.get_or_insert(changed_at);
            st.metrics.changes_seen(&last_view, &snapshot.cluster);
        }
        match crate::netif::node_addresses() {
            Ok(addresses) if addresses != config.interface_addresses => {
                // The SNAT source of each interface follows too (only what changed is written).
                if let Err(error) = kernel::tc::record_interface_addresses(&args.bpffs, &interfaces) {
                    tracing::warn!("cannot record the interfaces' new addresses: {}", error_chain(&error));
                }
                config.interface_addresses = addresses;
            }
            Ok(_) => {}
            Err(error) => tracing::warn!("cannot read the node's addresses, keeping the last ones: {error}"),
        }
        let desired = desired::compute(&snapshot.cluster, &config);
        let rejections: Vec<_> = snapshot.rejections.iter().chain(&desired.rejections).collect();
        let report = reconciler.reconcile(&desired);
        let elapsed = started.elapsed();
        abort_udp_sockets_to_gone_backends(&cgroup, &mut udp_backends, &desired);
        if report.writes > 0 {
            // Affinity and UDP flows that point at a backend their frontend no longer has.
            match kernel::purge_stale_flows(&args.bpffs) {
                Ok(purged) if purged != kernel::PurgedFlows::default() => {
                    tracing::info!(affinity = purged.affinity, udp_conntrack = purged.udp_conntrack, "purged flows of removed backends");
                }
                Ok(_) => {}
                Err(error) => tracing::warn!("cannot purge flows of removed backends: {}", error_chain(&error)),
            }
        }

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
        let new_rejections: Vec<_> =
            rejections.iter().filter(|r| !reported.contains(&format!("rejected {r}"))).copied().collect();
        reported = current;
        failing = !report.failures.is_empty();

        health_checks.sync(&healthcheck::health_checks(&snapshot.cluster, &args.node_name)).await;
        last_view = snapshot.cluster;

        let mut st = status.lock().expect("status lock");
        for rejection in new_rejections {
            st.metrics.count_rejection(rejection);
        }
        st.metrics.frontends.set(metrics::gauge_count(reconciler.programmed_frontends()));
        st.metrics.backends.set(metrics::gauge_count(reconciler.programmed_backends()));
        st.metrics.services.set(metrics::gauge_count(metrics::programmed_services(
            desired.frontends.values().map(|spec| &spec.service),
            report.failures.iter().map(|f| f.what.as_str()),
        )));
        st.metrics.rejected_now.set(metrics::gauge_count(rejections.len()));
        st.metrics.health_check_ports.set(metrics::gauge_count(health_checks.open_ports()));
        st.metrics.sync_duration.observe(elapsed.as_secs_f64());
        st.datapath_error =
            report.failures.first().map(|f| format!("not programmed: {}: {}", f.what, error_chain(&f.error)));
        if failing {
            st.metrics.sync_failures.inc();
            // A failed sync leaves the datapath behind even when no source change caused it (the
            // node's addresses changed): it counts as pending from now on.
            st.oldest_unprogrammed_change.get_or_insert(started);
        } else {
            let now = SystemTime::now();
            st.metrics.syncs.inc();
            let synced_at = now_unix();
            st.last_synced = Some(synced_at);
            st.metrics.last_sync_timestamp.set(synced_at);
            st.metrics.changes_programmed();
            st.restored_from_checkpoint = false;
            st.oldest_unprogrammed_change = None;
            for changed in unprogrammed_changes.drain(..) {
                let latency = now.duration_since(changed).unwrap_or_default();
                st.metrics.network_programming.observe(latency.as_secs_f64());
            }
            if checkpointed.as_ref().map(|c| &c.frontends) != Some(&desired.frontends) {
                match checkpoint::save(&args.state_dir, &desired) {
                    Ok(()) => checkpointed = Some(desired.clone()),
                    Err(error) => tracing::warn!("cannot write the checkpoint: {}", error_chain(&error)),
                }
            }
        }
        if report.writes > 0 || failing || st.metrics.successful_syncs() == 1 {
            tracing::info!(
                frontends = reconciler.programmed_frontends(),
                backends = reconciler.programmed_backends(),
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

/// Tells the kernel programs which SNAT ports they may use: `--snat-port-range` without the
/// node's ephemeral range.
fn configure_snat_ports(args: &AgentArgs) -> anyhow::Result<()> {
    let ephemeral = crate::snat_ports::ephemeral_range().context("reading net.ipv4.ip_local_port_range")?;
    let (config, ports) = crate::snat_ports::datapath_config(args.snat_port_range, ephemeral).map_err(anyhow::Error::msg)?;
    kernel::write_config(&args.bpffs, &config).context("writing the datapath settings")?;
    tracing::info!(
        range = %args.snat_port_range,
        ephemeral = %ephemeral,
        ports,
        "SNAT source ports: the range without the node's ephemeral ports"
    );
    Ok(())
}

/// Deletes conntrack entries past their timeout, off the async workers.
fn remove_expired_flows(bpffs: &std::path::Path) {
    let bpffs = bpffs.to_owned();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        match kernel::remove_expired_flows(&bpffs) {
            Ok(gc) if gc.removed == 0 => {}
            Ok(gc) => tracing::debug!(
                removed = gc.removed,
                scanned = gc.scanned,
                took_ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
                "removed expired conntrack entries"
            ),
            Err(error) => tracing::warn!("cannot remove expired conntrack entries: {}", error_chain(&error)),
        }
    });
}

/// Local clients' connected UDP sockets were translated once, at connect(); those whose backend
/// left the desired state are aborted (in the background) so the clients reconnect to a live one.
fn abort_udp_sockets_to_gone_backends(
    cgroup: &std::path::Path,
    previous: &mut BTreeSet<std::net::SocketAddr>,
    desired: &desired::DesiredState,
) {
    let current: BTreeSet<std::net::SocketAddr> = desired
        .frontends
        .values()
        .flat_map(|spec| &spec.backends)
        .map(|b| b.addr)
        .filter(|b| b.proto == desired::Proto::Udp)
        .map(|b| std::net::SocketAddr::new(b.addr, b.port))
        .collect();
    let gone: BTreeSet<_> = previous.difference(&current).copied().collect();
    *previous = current;
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
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating --state-dir {}", state_dir.display()))?;
    let path = state_dir.join("agent.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // flock(2) underneath: released by the kernel when the holder dies, even on SIGKILL.
    match file.try_lock() {
        Ok(()) => return Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(error)) => return Err(error).with_context(|| format!("locking {}", path.display())),
    }
    tracing::warn!(lock = %path.display(), "another agent is writing this node's datapath; waiting for it to exit");
    tokio::task::spawn_blocking(move || {
        file.lock().context("waiting for the agent lock")?;
        tracing::info!("took over the agent lock");
        Ok(file)
    })
    .await?
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
