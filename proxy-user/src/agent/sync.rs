//! One pass of the agent loop, between reading the source's view and the side effects that
//! need the kernel or the network (aborting sockets, purging flows, health-check listeners):
//! the desired state is updated with what changed, the maps are made equal to it, and the
//! status, metrics and problem log are brought up to date. Generic over the maps, so the step
//! is tested against [`FakeMaps`](crate::lbmap::FakeMaps).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use super::{error_chain, now_unix, Status};
use crate::desired::{self, ClusterState, NodeConfig};
use crate::healthcheck::{self, HealthCheck, ServiceName};
use crate::lbmap::LbMaps;
use crate::metrics;
use crate::reconcile::Reconciler;
use crate::snat_ports::PortRange;
use crate::source::Snapshot;

/// The loop's memory between passes.
pub struct Syncer<M: LbMaps> {
    reconciler: Reconciler<M>,
    /// The desired state, updated with what each view changed; the first pass compares it with
    /// everything the maps hold (adopted or restored), later ones only what changed.
    desired: desired::Incremental,
    first_pass: bool,
    /// The view read last, to tell which objects changed (network programming latency).
    last_view: ClusterState,
    /// When each change not programmed yet was made.
    unprogrammed_changes: Vec<SystemTime>,
    /// Problems logged and still present (each is logged once while it persists).
    reported: BTreeSet<String>,
    /// NodePorts seen outside --service-node-port-range (each warned about once).
    stray_node_ports: BTreeSet<u16>,
    node_port_range: PortRange,
    agent_started: SystemTime,
    /// The programmed-Services gauge was counted while some frontend failed.
    services_counted_with_failures: bool,
}

/// What a pass leaves for the agent to do outside the maps.
#[derive(Debug)]
pub struct Synced {
    /// Local clients' connected UDP sockets were translated once, at connect(): those to a
    /// backend that left every Service are to be aborted so the clients reconnect to a live one.
    pub gone_udp: BTreeSet<SocketAddr>,
    /// Map entries the pass wrote or deleted.
    pub writes: usize,
    /// Part of the desired state is not programmed (retried every second).
    pub failing: bool,
    /// The healthCheckNodePorts this node serves, with their local endpoint counts.
    pub health_checks: BTreeMap<ServiceName, HealthCheck>,
}

impl<M: LbMaps> Syncer<M> {
    pub fn new(reconciler: Reconciler<M>, node_port_range: PortRange) -> Self {
        Self {
            reconciler,
            desired: desired::Incremental::default(),
            first_pass: true,
            last_view: ClusterState::default(),
            unprogrammed_changes: Vec::new(),
            reported: BTreeSet::new(),
            stray_node_ports: BTreeSet::new(),
            node_port_range,
            agent_started: SystemTime::now(),
            services_counted_with_failures: false,
        }
    }

    #[cfg(test)]
    pub fn reconciler(&self) -> &Reconciler<M> {
        &self.reconciler
    }

    #[cfg(test)]
    pub fn reconciler_mut(&mut self) -> &mut Reconciler<M> {
        &mut self.reconciler
    }

    /// What the checkpoint should hold.
    pub fn desired(&self) -> &desired::DesiredState {
        self.desired.state()
    }

    /// Programs `snapshot` (read at `started`, when the pass began) for a node of `config`.
    pub fn sync(&mut self, started: Instant, snapshot: Snapshot, config: &NodeConfig, status: &Mutex<Status>) -> Synced {
        if let Some(changed_at) = snapshot.changed_at {
            let received = SystemTime::now().checked_sub(changed_at.elapsed()).unwrap_or(self.agent_started);
            let times = match &snapshot.change_times {
                Some(times) => metrics::recorded_change_times(times, received, self.agent_started),
                None => metrics::change_times(&self.last_view, &snapshot.cluster, received, self.agent_started),
            };
            self.unprogrammed_changes.extend(times);
            status.lock().expect("status lock").oldest_unprogrammed_change.get_or_insert(changed_at);
        }
        let changed = self.desired.update(&snapshot.cluster, config, &snapshot.changes);
        let desired = self.desired.state();
        warn_of_stray_node_ports(desired, &changed, self.node_port_range, &mut self.stray_node_ports);
        let rejections: Vec<_> = snapshot.rejections.iter().chain(&desired.rejections).collect();
        let report =
            if self.first_pass { self.reconciler.reconcile(desired) } else { self.reconciler.reconcile_changed(desired, &changed) };
        self.first_pass = false;
        let elapsed = started.elapsed();
        let gone_udp = report
            .removed_backends
            .iter()
            .filter(|b| b.proto == desired::Proto::Udp && !self.reconciler.has_backend(b))
            .map(|b| SocketAddr::new(b.addr, b.port))
            .collect();

        // Each problem is logged once while it persists, not on every retry.
        let mut current = BTreeSet::new();
        for rejection in &rejections {
            current.insert(format!("rejected {rejection}"));
        }
        for failure in &report.failures {
            current.insert(format!("not programmed: {}: {}", failure.what, error_chain(&failure.error)));
        }
        for problem in current.difference(&self.reported) {
            tracing::warn!("{problem}");
        }
        let new_rejections: Vec<_> = rejections.iter().filter(|r| !self.reported.contains(&format!("rejected {r}"))).copied().collect();
        self.reported = current;
        let failing = !report.failures.is_empty();
        let health_checks = healthcheck::health_checks(&snapshot.cluster, &config.node_name);

        let mut st = status.lock().expect("status lock");
        // Counted after the maps are written: comparing whole views takes a while at scale (12 ms
        // at 30 000 Services), so only when the source did not say what changed.
        if snapshot.changed_at.is_some() {
            let changes = match snapshot.object_changes {
                Some(changes) => changes,
                None => metrics::ObjectChanges::between(&self.last_view, &snapshot.cluster),
            };
            st.metrics.changes_seen(changes);
        }
        self.last_view = snapshot.cluster;
        for rejection in new_rejections {
            st.metrics.count_rejection(rejection);
        }
        st.metrics.frontends.set(metrics::gauge_count(self.reconciler.programmed_frontends()));
        st.metrics.backends.set(metrics::gauge_count(self.reconciler.programmed_backends()));
        // Counting the Services of every frontend takes 10 ms at 30 000: only when the count can
        // have changed (frontends given or taken, failures now or in the count before).
        if self.desired.owners_changed() || failing || self.services_counted_with_failures || st.metrics.successful_syncs() == 0 {
            st.metrics.services.set(metrics::gauge_count(metrics::programmed_services(
                desired.frontends.values().map(|spec| &spec.service),
                report.failures.iter().map(|f| f.what.as_str()),
            )));
            self.services_counted_with_failures = failing;
        }
        st.metrics.rejected_now.set(metrics::gauge_count(rejections.len()));
        st.metrics.sync_duration.observe(elapsed.as_secs_f64());
        st.metrics.map_writes.inc_by(report.writes as u64);
        st.datapath_error = report.failures.first().map(|f| format!("not programmed: {}: {}", f.what, error_chain(&f.error)));
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
            for changed in self.unprogrammed_changes.drain(..) {
                let latency = now.duration_since(changed).unwrap_or_default();
                st.metrics.network_programming.observe(latency.as_secs_f64());
            }
            if report.writes > 0 || st.metrics.successful_syncs() == 1 {
                st.checkpoint_wanted += 1;
            }
        }
        if report.writes > 0 || failing || st.metrics.successful_syncs() == 1 {
            tracing::info!(
                frontends = self.reconciler.programmed_frontends(),
                backends = self.reconciler.programmed_backends(),
                writes = report.writes,
                failures = report.failures.len(),
                took_ms = format!("{:.2}", elapsed.as_secs_f64() * 1e3),
                "synced"
            );
        }
        Synced { gone_udp, writes: report.writes, failing, health_checks }
    }
}

impl Synced {
    /// The pass wrote the maps: affinity and UDP flows may point at a backend their frontend
    /// no longer has.
    pub fn wrote(&self) -> bool {
        self.writes > 0
    }
}

/// Warns (once per port) of a NodePort outside `--service-node-port-range`: the SNAT ports
/// are drawn from outside that range only, so it must be the kube-apiserver's.
fn warn_of_stray_node_ports(
    desired: &desired::DesiredState,
    changed: &BTreeSet<desired::Frontend>,
    range: PortRange,
    warned: &mut BTreeSet<u16>,
) {
    for frontend in changed {
        let Some(spec) = desired.frontends.get(frontend) else {
            continue;
        };
        let port = frontend.port;
        if spec.kind == desired::FrontendKind::NodePort && !(range.min..=range.max).contains(&port) && warned.insert(port) {
            tracing::warn!(
                service = %spec.service,
                "nodePort {port} lies outside --service-node-port-range {range}: set that flag to the \
                 kube-apiserver's --service-node-port-range, or SNATed flows may leave from this port \
                 and their answers be taken for connections to the NodePort"
            );
        }
    }
}

#[cfg(test)]
mod tests;
