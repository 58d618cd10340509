//! Prometheus metrics on `--metrics-bind`: a prometheus-client [`Registry`] holding what the agent
//! records per sync, under our `ebpf_proxy_*` names and under the `kubeproxy_*` names that
//! kube-proxy dashboards and alerts query (with kube-proxy's buckets and help texts), and
//! collectors that read at scrape time what lives elsewhere: the datapath's per-CPU counters and
//! whether the source is connected.
//!
//! This module only defines, counts and renders; the agent loop decides what to record.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::jiff::Timestamp;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

use crate::desired::{ClusterState, Rejection, ServicePortName, Slice};
use crate::kernel::DatapathError;
use crate::source::SourceHealth;

/// `Content-Type` of the text exposition format (0.0.4), which is what kube-proxy serves too.
pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Set by the EndpointSlice controller to when the Pod or Service change behind the slice
/// happened; kube-proxy measures network programming latency from it.
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// kube-proxy's `sync_proxy_rules_duration_seconds` buckets: 1 ms to 16.4 s, doubling
/// (`ExponentialBuckets(0.001, 2, 15)`, pkg/proxy/metrics/metrics.go).
pub fn sync_duration_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15).collect()
}

/// The positive bounds of kube-proxy's `network_programming_duration_seconds`: 0.25 s, 0.5 s,
/// 1..59 s by 1 s, 60..115 s by 5 s, 2..5 min by 30 s.
pub fn network_programming_buckets() -> Vec<f64> {
    [linear_buckets(0.25, 0.25, 2), linear_buckets(1.0, 1.0, 59), linear_buckets(60.0, 5.0, 12), linear_buckets(120.0, 30.0, 7)]
        .into_iter()
        .flatten()
        .collect()
}

/// kube-proxy's exact `network_programming_duration_seconds` layout: component-base's
/// `MergeBuckets` starts from a one-element slice, so a `le="0"` bucket precedes the positive
/// bounds. Kept, so a dashboard's `le` selectors find the same series on both proxies.
pub fn kube_proxy_network_programming_buckets() -> Vec<f64> {
    std::iter::once(0.0).chain(network_programming_buckets()).collect()
}

/// `kind` and `reason` of `ebpf_proxy_rejected_objects_total`; both come from the rejection's
/// type, so the label set is bounded.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectionLabels {
    kind: &'static str,
    reason: &'static str,
}

/// What the agent loop records. Each metric is a handle on what the registry renders (clones
/// share their value), so recording needs no registry and scraping needs no lock of the loop's.
#[derive(Clone, Debug)]
pub struct SyncMetrics {
    pub sync_duration: Histogram,
    pub network_programming: Histogram,
    pub syncs: Counter,
    pub sync_failures: Counter,
    /// Map entries written or deleted by syncs since the agent started.
    pub map_writes: Counter,
    /// Unix time of the last sync that programmed everything (0: none yet).
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub services: Gauge,
    pub frontends: Gauge,
    pub backends: Gauge,
    /// Rejections in the last sync.
    pub rejected_now: Gauge,
    /// Rejections by (kind, reason class), each counted once when first reported.
    rejected_total: Family<RejectionLabels, Counter>,
    /// healthCheckNodePort listeners open.
    pub health_check_ports: Gauge,
    /// Frontends the pinned maps held when the agent started (set once).
    pub adopted_frontends: Gauge,
    /// Programs the agent attached anew when it started (set once).
    pub attached_anew: Gauge,
    service_changes: Counter,
    endpoint_changes: Counter,
    service_changes_pending: Gauge,
    endpoint_changes_pending: Gauge,
    /// Objects changed since the last sync that programmed everything (the pending gauges).
    pending: ObjectChanges,
}

impl Default for SyncMetrics {
    fn default() -> Self {
        Self {
            sync_duration: Histogram::new(sync_duration_buckets()),
            network_programming: Histogram::new(kube_proxy_network_programming_buckets()),
            syncs: Counter::default(),
            sync_failures: Counter::default(),
            map_writes: Counter::default(),
            last_sync_timestamp: Gauge::default(),
            services: Gauge::default(),
            frontends: Gauge::default(),
            backends: Gauge::default(),
            rejected_now: Gauge::default(),
            rejected_total: Family::default(),
            health_check_ports: Gauge::default(),
            adopted_frontends: Gauge::default(),
            attached_anew: Gauge::default(),
            service_changes: Counter::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            endpoint_changes_pending: Gauge::default(),
            pending: ObjectChanges::default(),
        }
    }
}

/// A count as a gauge value (gauges are i64; no count of objects reaches i64::MAX).
pub fn gauge_count(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

impl SyncMetrics {
    pub fn count_rejection(&mut self, rejection: &Rejection) {
        let labels = RejectionLabels { kind: rejection.object.kind_label(), reason: rejection.reason.class() };
        self.rejected_total.get_or_create(&labels).inc();
    }

    /// A new view of the cluster was read: counts the Services and EndpointSlices that differ
    /// from the previous view (kube-proxy's `*_changes_total`) and holds them as pending until
    /// a sync programs everything.
    pub fn changes_seen(&mut self, changes: ObjectChanges) {
        self.service_changes.inc_by(changes.services.len() as u64);
        self.endpoint_changes.inc_by(changes.slices.len() as u64);
        self.pending.services.extend(changes.services);
        self.pending.slices.extend(changes.slices);
        self.service_changes_pending.set(gauge_count(self.pending.services.len()));
        self.endpoint_changes_pending.set(gauge_count(self.pending.slices.len()));
    }

    /// A sync programmed everything: nothing is pending any more.
    pub fn changes_programmed(&mut self) {
        self.pending = ObjectChanges::default();
        self.service_changes_pending.set(0);
        self.endpoint_changes_pending.set(0);
    }

    /// Syncs that programmed everything so far.
    pub fn successful_syncs(&self) -> u64 {
        self.syncs.get()
    }
}

/// Help texts of our families. The registry appends a period to each, so none ends with one.
mod help {
    pub const SYNC_DURATION: &str = "Duration of one sync of the datapath maps with the desired state (as kube-proxy's sync_proxy_rules_duration_seconds)";
    pub const NETWORK_PROGRAMMING: &str = "Time from an API change (an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time, else when the agent received it) to the datapath programmed";
    pub const SYNCS: &str = "Syncs that programmed everything";
    pub const SYNC_FAILURES: &str = "Syncs with a frontend that could not be programmed (retried every second)";
    pub const MAP_WRITES: &str = "Map entries written or deleted by syncs since the agent started (an agent that adopted a datapath already as the source wants it writes none)";
    pub const LAST_SYNC: &str = "Unix time of the last sync that programmed everything (0: none yet)";
    pub const SERVICES: &str = "Services (namespace/name) whose frontends are all in the datapath";
    pub const FRONTENDS: &str = "Frontends (address, port, protocol, scope) in the datapath";
    pub const BACKENDS: &str = "Backends (address, port, protocol) in the datapath";
    pub const REJECTED_NOW: &str = "Objects or parts of objects rejected in the last sync";
    pub const REJECTED_TOTAL: &str = "Rejected objects by kind and reason class, counted once when first reported";
    pub const ADOPTED_FRONTENDS: &str = "Frontends the pinned maps already held when the agent started, re-learned without a write (0 on a fresh node or after a reboot)";
    pub const ATTACHED_ANEW: &str = "Programs the agent attached through a new link when it started (0: it swapped its programs into the pinned links of a running datapath, so no packet went untranslated)";
    pub const HEALTH_CHECK_PORTS: &str = "healthCheckNodePort listeners open (externalTrafficPolicy: Local LoadBalancer Services)";
    /// Collectors write their help as it is, period included.
    pub const SOURCE_CONNECTED: &str = "1 while the source (API server or manifest file) answers and confirms its view, 0 during an outage.";
    pub const DATAPATH_EVENTS: &str = "Datapath events by kind, summed over CPUs.";
}

/// Builds the registry of everything `/metrics` shows. `metrics` are the handles the agent
/// records into; `datapath_counters` reads the per-CPU stats map summed over CPUs, in
/// `proxy_abi::stat` order, at each scrape.
pub fn registry(
    metrics: &SyncMetrics,
    source: Arc<SourceHealth>,
    datapath_counters: impl Fn() -> Result<Vec<u64>, DatapathError> + Send + Sync + 'static,
) -> Registry {
    let mut registry = Registry::default();
    let m = metrics;
    registry.register("ebpf_proxy_sync_duration_seconds", help::SYNC_DURATION, m.sync_duration.clone());
    registry.register("ebpf_proxy_network_programming_duration_seconds", help::NETWORK_PROGRAMMING, m.network_programming.clone());
    // Counters are registered without `_total`: the encoder appends it.
    registry.register("ebpf_proxy_sync", help::SYNCS, m.syncs.clone());
    registry.register("ebpf_proxy_sync_failures", help::SYNC_FAILURES, m.sync_failures.clone());
    registry.register("ebpf_proxy_sync_map_writes", help::MAP_WRITES, m.map_writes.clone());
    registry.register("ebpf_proxy_last_sync_timestamp_seconds", help::LAST_SYNC, m.last_sync_timestamp.clone());
    registry.register("ebpf_proxy_services_programmed", help::SERVICES, m.services.clone());
    registry.register("ebpf_proxy_frontends_programmed", help::FRONTENDS, m.frontends.clone());
    registry.register("ebpf_proxy_backends_programmed", help::BACKENDS, m.backends.clone());
    registry.register("ebpf_proxy_rejected_objects", help::REJECTED_NOW, m.rejected_now.clone());
    registry.register("ebpf_proxy_rejected_objects", help::REJECTED_TOTAL, m.rejected_total.clone());
    registry.register("ebpf_proxy_health_check_node_ports", help::HEALTH_CHECK_PORTS, m.health_check_ports.clone());
    registry.register("ebpf_proxy_adopted_frontends", help::ADOPTED_FRONTENDS, m.adopted_frontends.clone());
    registry.register("ebpf_proxy_programs_attached_anew", help::ATTACHED_ANEW, m.attached_anew.clone());
    registry.register_collector(Box::new(SourceConnected(source)));
    registry.register_collector(Box::new(DatapathEvents { read: Box::new(datapath_counters) }));

    // kube-proxy's names (pkg/proxy/metrics/metrics.go), on the same values where the meaning is
    // the same. Left out: `sync_full_proxy_rules_duration_seconds` and `sync_partial_...`, since
    // every sync here is the same diff of the whole desired state against the maps (no full
    // versus partial resync to tell apart); `sync_proxy_rules_last_queued_timestamp_seconds`,
    // since a change is only seen by the loop when it is about to sync it, so the gauge could
    // never show the stalled loop it exists to reveal; and the iptables/nftables rule counts.
    let kube_proxy: [(&'static str, &'static str, Box<dyn Metric>); 7] = [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", Box::new(m.sync_duration.clone())),
        ("kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds", Box::new(m.network_programming.clone())),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced", Box::new(m.last_sync_timestamp.clone())),
        ("kubeproxy_sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", Box::new(m.endpoint_changes.clone())),
        ("kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", Box::new(m.service_changes.clone())),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes", Box::new(m.endpoint_changes_pending.clone())),
        ("kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", Box::new(m.service_changes_pending.clone())),
    ];
    for (name, help, metric) in kube_proxy {
        registry.register_collector(Box::new(KubeProxyName { name, help, metric }));
    }
    registry
}

/// The registry in the text exposition format.
pub fn render(registry: &Registry) -> Result<String, fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, registry)?;
    Ok(text)
}

/// One of our metrics under a kube-proxy name. A collector rather than `Registry::register`,
/// because the registry appends a period to the help text, and kube-proxy's reads
/// `[ALPHA] <help>` (component-base annotates every metric with its stability level).
#[derive(Debug)]
struct KubeProxyName {
    name: &'static str,
    help: &'static str,
    metric: Box<dyn Metric>,
}

impl Collector for KubeProxyName {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let help = format!("[ALPHA] {}", self.help);
        let metric_encoder = encoder.encode_descriptor(self.name, &help, None, self.metric.metric_type())?;
        self.metric.encode(metric_encoder)
    }
}

/// `ebpf_proxy_source_connected`, read from the source's health at each scrape.
#[derive(Debug)]
struct SourceConnected(Arc<SourceHealth>);

impl Collector for SourceConnected {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let gauge = ConstGauge::new(i64::from(self.0.failing().is_none()));
        let metric_encoder = encoder.encode_descriptor("ebpf_proxy_source_connected", help::SOURCE_CONNECTED, None, gauge.metric_type())?;
        gauge.encode(metric_encoder)
    }
}

/// `ebpf_proxy_datapath_events_total{event}`: the kernel's per-CPU counters, summed over CPUs
/// at each scrape. Left out of the scrape (logged at debug level) when the map cannot be read.
struct DatapathEvents {
    read: Box<dyn Fn() -> Result<Vec<u64>, DatapathError> + Send + Sync>,
}

impl fmt::Debug for DatapathEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatapathEvents").finish_non_exhaustive()
    }
}

impl Collector for DatapathEvents {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let counters = match (self.read)() {
            Ok(counters) => counters,
            Err(error) => {
                tracing::debug!("datapath counters left out of /metrics: {}", crate::agent::error_chain(&error));
                return Ok(());
            }
        };
        let mut family = encoder.encode_descriptor("ebpf_proxy_datapath_events", help::DATAPATH_EVENTS, None, MetricType::Counter)?;
        for (value, event) in counters.iter().zip(proxy_abi::stat::NAMES) {
            ConstCounter::new(*value).encode(family.encode_family(&[("event", event)])?)?;
        }
        Ok(())
    }
}

/// Services and EndpointSlices, by (namespace, name), that were added, changed or removed
/// between two views.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectChanges {
    pub services: BTreeSet<(String, String)>,
    pub slices: BTreeSet<(String, String)>,
}

impl ObjectChanges {
    pub fn between(previous: &ClusterState, current: &ClusterState) -> Self {
        let owned = |(namespace, name): (&str, &str)| (namespace.to_owned(), name.to_owned());
        Self {
            services: differing(&previous.services, &current.services, |s| {
                (&s.namespace, &s.name)
            })
            .map(|d| owned(d.name()))
            .collect(),
            slices: differing(&previous.slices, &current.slices, |s| {
                (&s.namespace, &s.name)
            })
            .map(|d| owned(d.name()))
            .collect(),
        }
    }
}

/// An object that differs between two views.
enum Difference<'a, T> {
    Removed(&'a str, &'a str),
    /// Added or changed: the current object.
    Current(&'a str, &'a str, &'a T),
}

impl<T> Difference<'_, T> {
    fn name(&self) -> (&str, &str) {
        match self {
            Difference::Removed(namespace, name) | Difference::Current(namespace, name, _) => {
                (namespace, name)
            }
        }
    }
}

/// The objects, by (namespace, name), that differ between two views: a merge of both in name
/// order, copying no name. The sources hand out views in name order and share unchanged
/// objects between them, so at 30 000 Services this is a pointer comparison per object, not a
/// map of every name built twice per change (which took 130 ms).
fn differing<'a, T: PartialEq>(
    before: &'a [Arc<T>],
    after: &'a [Arc<T>],
    name: fn(&T) -> (&str, &str),
) -> impl Iterator<Item = Difference<'a, T>> {
    let sorted = |objects: &'a [Arc<T>]| {
        let mut named: Vec<((&'a str, &'a str), &'a Arc<T>)> =
            objects.iter().map(|o| (name(o), o)).collect();
        if !named.is_sorted_by(|a, b| a.0 <= b.0) {
            named.sort_by(|a, b| a.0.cmp(&b.0));
        }
        named.into_iter().peekable()
    };
    let (mut before, mut after) = (sorted(before), sorted(after));
    std::iter::from_fn(move || loop {
        use std::cmp::Ordering::*;
        let order = match (before.peek(), after.peek()) {
            (None, None) => return None,
            (Some(_), None) => Less,
            (None, Some(_)) => Greater,
            (Some(b), Some(a)) => b.0.cmp(&a.0),
        };
        match order {
            Less => {
                let ((namespace, name), _) = before.next().expect("peeked");
                return Some(Difference::Removed(namespace, name));
            }
            Greater => {
                let ((namespace, name), object) = after.next().expect("peeked");
                return Some(Difference::Current(namespace, name, &**object));
            }
            Equal => {
                let (_, old) = before.next().expect("peeked");
                let ((namespace, name), new) = after.next().expect("peeked");
                if !Arc::ptr_eq(old, new) && old != new {
                    return Some(Difference::Current(namespace, name, &**new));
                }
            }
        }
    })
}

/// Services (namespace/name) of the desired frontends (one `ServicePortName` per frontend) none
/// of whose frontends failed. A failure names its frontend `Service ns/name:port (...)`
/// (`reconcile::Failure::what`).
pub fn programmed_services<'a>(
    frontends: impl IntoIterator<Item = &'a ServicePortName>,
    failures: impl IntoIterator<Item = &'a str>,
) -> usize {
    let failed: BTreeSet<&str> = failures
        .into_iter()
        .filter_map(|what| what.strip_prefix("Service ")?.split(" (").next())
        .collect();
    if failed.is_empty() {
        // The usual case, after every endpoint change: no name is formatted (at 30 000
        // Services that took 44 ms).
        let services: std::collections::HashSet<(&str, &str)> = frontends
            .into_iter()
            .map(|s| (s.namespace.as_str(), s.name.as_str()))
            .collect();
        return services.len();
    }
    let mut services: BTreeMap<(&str, &str), bool> = BTreeMap::new();
    for service in frontends {
        let ok = !failed.contains(service.to_string().as_str());
        *services.entry((&service.namespace, &service.name)).or_insert(true) &= ok;
    }
    services.values().filter(|ok| **ok).count()
}

/// When the changes between two views of the cluster happened, for the network programming
/// latency: each new or changed EndpointSlice's `last-change-trigger-time` annotation, and
/// `received` (when the source got the change) for changes without one (Services, deletions,
/// slices without the annotation). As kube-proxy, annotations older than the agent's start are
/// ignored: they describe changes made before the agent could have programmed them.
pub fn change_times(
    previous: &ClusterState,
    current: &ClusterState,
    received: SystemTime,
    agent_started: SystemTime,
) -> Vec<SystemTime> {
    let mut times = Vec::new();
    let mut without_time = false;
    for difference in differing(&previous.slices, &current.slices, |s| {
        (&s.namespace, &s.name)
    }) {
        match difference {
            Difference::Removed(..) => without_time = true,
            Difference::Current(_, _, slice) => match trigger_time(slice) {
                Some(time) if time > agent_started => times.push(time),
                Some(_) => {}
                None => without_time = true,
            },
        }
    }
    let services_differ = differing(&previous.services, &current.services, |s| {
        (&s.namespace, &s.name)
    })
    .next()
    .is_some();
    if services_differ || previous.node != current.node {
        without_time = true;
    }
    // A new view always counts at least once, even if it only carried old annotations.
    if without_time || times.is_empty() {
        times.push(received);
    }
    times
}

/// [`change_times`] for a source that recorded when each change was made.
pub fn recorded_change_times(recorded: &[SystemTime], received: SystemTime, agent_started: SystemTime) -> Vec<SystemTime> {
    let mut times: Vec<SystemTime> = recorded.iter().copied().filter(|t| *t > agent_started).collect();
    // A new view always counts at least once, even if it only carried old annotations.
    if times.is_empty() {
        times.push(received);
    }
    times
}

pub fn trigger_time(slice: &Slice) -> Option<SystemTime> {
    let text = slice.trigger_time.as_ref()?;
    let timestamp: Timestamp = text.parse().ok()?;
    Some(SystemTime::from(timestamp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::{AddressField, FrontendKind, InvalidAddress, RejectReason, RejectedObject};
    use std::time::Duration;

    /// A registry over `metrics`, with the source connected or not and the datapath counters
    /// `0, 10, 20, ...` or unreadable.
    fn rendered(metrics: &SyncMetrics, source_connected: bool, counters: bool) -> String {
        let source = Arc::new(SourceHealth::default());
        if !source_connected {
            source.failed("down".into());
        }
        let read = move || match counters {
            true => Ok((0..proxy_abi::stat::NAMES.len() as u64).map(|i| i * 10).collect()),
            false => Err(DatapathError::NoObject),
        };
        render(&registry(metrics, source, read)).expect("render")
    }

    fn invalid_cluster_ip(name: &str, text: &str) -> Rejection {
        let field = AddressField::Frontend(FrontendKind::ClusterIp);
        Rejection::new(RejectedObject::service("demo", name), RejectReason::InvalidAddress(InvalidAddress::Unparsable { field, text: text.into() }))
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_with_inf_sum_and_count() {
        let metrics = SyncMetrics::default();
        for value in [0.0005, 0.003, 0.004, 0.5, 20.0] {
            metrics.sync_duration.observe(value);
        }
        let text = rendered(&metrics, true, true);
        for line in [
            "ebpf_proxy_sync_duration_seconds_bucket{le=\"0.001\"} 1\n",
            "ebpf_proxy_sync_duration_seconds_bucket{le=\"0.004\"} 3\n",
            "ebpf_proxy_sync_duration_seconds_bucket{le=\"0.512\"} 4\n",
            "ebpf_proxy_sync_duration_seconds_bucket{le=\"16.384\"} 4\n",
            "ebpf_proxy_sync_duration_seconds_bucket{le=\"+Inf\"} 5\n",
            "ebpf_proxy_sync_duration_seconds_sum 20.5075\n",
            "ebpf_proxy_sync_duration_seconds_count 5\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
    }

    #[test]
    fn bucket_layouts_are_kube_proxys() {
        let sync = sync_duration_buckets();
        assert_eq!(sync.len(), 15);
        assert_eq!(sync[..4], [0.001, 0.002, 0.004, 0.008]);
        assert_eq!(sync[14], 16.384);
        let programming = network_programming_buckets();
        assert_eq!(programming.len(), 2 + 59 + 12 + 7);
        assert_eq!(programming[..4], [0.25, 0.5, 1.0, 2.0]);
        assert_eq!(programming[60..63], [59.0, 60.0, 65.0]);
        assert_eq!(programming[programming.len() - 1], 300.0);
        assert!(programming.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(kube_proxy_network_programming_buckets()[..2], [0.0, 0.25]);

        // The bounds as kube-proxy (Go's shortest float format) writes them.
        let text = rendered(&SyncMetrics::default(), true, true);
        let bounds = |family: &str| -> Vec<String> {
            let prefix = format!("{family}_bucket{{le=\"");
            text.lines().filter_map(|l| Some(l.strip_prefix(&prefix)?.split('"').next()?.to_owned())).collect()
        };
        let sync = bounds("kubeproxy_sync_proxy_rules_duration_seconds");
        assert_eq!(sync.len(), 16);
        assert_eq!(sync[..4], ["0.001", "0.002", "0.004", "0.008"]);
        assert_eq!(sync[14..], ["16.384", "+Inf"]);
        let programming = bounds("kubeproxy_network_programming_duration_seconds");
        assert_eq!(programming.len(), 1 + 80 + 1);
        assert_eq!(programming[..5], ["0", "0.25", "0.5", "1", "2"]);
        assert_eq!(programming[79..], ["270", "300", "+Inf"]);
        assert_eq!(bounds("ebpf_proxy_network_programming_duration_seconds"), programming, "one histogram, two names");
    }

    #[test]
    fn render_has_every_family_once_and_the_datapath_counters_by_event() {
        let mut metrics = SyncMetrics::default();
        metrics.sync_duration.observe(0.003);
        metrics.backends.set(4);
        metrics.count_rejection(&invalid_cluster_ip("bad", "10.96.0.999"));
        metrics.count_rejection(&invalid_cluster_ip("bad2", "x"));
        let text = rendered(&metrics, true, true);
        for family in [
            "ebpf_proxy_sync_duration_seconds",
            "ebpf_proxy_network_programming_duration_seconds",
            "ebpf_proxy_services_programmed",
            "ebpf_proxy_backends_programmed",
            "ebpf_proxy_rejected_objects_total",
            "ebpf_proxy_source_connected",
            "ebpf_proxy_last_sync_timestamp_seconds",
            "ebpf_proxy_datapath_events_total",
        ] {
            assert_eq!(text.matches(&format!("# TYPE {family} ")).count(), 1, "{family}:\n{text}");
        }
        assert!(text.contains("ebpf_proxy_sync_duration_seconds_bucket{le=\"0.004\"} 1\n"), "{text}");
        assert!(text.contains("ebpf_proxy_backends_programmed 4\n"));
        assert!(text.contains("ebpf_proxy_rejected_objects_total{kind=\"Service\",reason=\"invalid_address\"} 2\n"), "{text}");
        assert!(text.contains("ebpf_proxy_source_connected 1\n"));
        assert!(text.contains(&format!("ebpf_proxy_datapath_events_total{{event=\"{}\"}} 10\n", proxy_abi::stat::NAMES[1])));
        assert!(!rendered(&metrics, false, false).contains("datapath_events"));
        assert!(rendered(&metrics, false, false).contains("ebpf_proxy_source_connected 0\n"));
    }

    /// Our help texts as they were written by hand before the registry, and kube-proxy's as its
    /// /metrics shows them.
    #[test]
    fn help_and_type_lines_are_ours_and_kube_proxys_verbatim() {
        let text = rendered(&SyncMetrics::default(), true, true);
        for lines in [
            "# HELP ebpf_proxy_sync_total Syncs that programmed everything.\n# TYPE ebpf_proxy_sync_total counter\nebpf_proxy_sync_total 0\n",
            "# HELP ebpf_proxy_rejected_objects Objects or parts of objects rejected in the last sync.\n# TYPE ebpf_proxy_rejected_objects gauge\n",
            "# HELP ebpf_proxy_datapath_events_total Datapath events by kind, summed over CPUs.\n# TYPE ebpf_proxy_datapath_events_total counter\n",
            "# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds\n\
             # TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n",
            "# HELP kubeproxy_network_programming_duration_seconds [ALPHA] In Cluster Network Programming Latency in seconds\n",
            "# HELP kubeproxy_sync_proxy_rules_last_timestamp_seconds [ALPHA] The last time proxy rules were successfully synced\n\
             # TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\nkubeproxy_sync_proxy_rules_last_timestamp_seconds 0.0\n",
            "# HELP kubeproxy_sync_proxy_rules_endpoint_changes_total [ALPHA] Cumulative proxy rules Endpoint changes\n\
             # TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter\n",
            "# HELP kubeproxy_sync_proxy_rules_service_changes_pending [ALPHA] Pending proxy rules Service changes\n\
             # TYPE kubeproxy_sync_proxy_rules_service_changes_pending gauge\n",
        ] {
            assert!(text.contains(lines), "{lines}\nnot in\n{text}");
        }
    }

    #[test]
    fn both_names_show_the_same_sync_and_change_counts() {
        let mut metrics = SyncMetrics::default();
        metrics.sync_duration.observe(0.02);
        metrics.last_sync_timestamp.set(1_700_000_000.5);
        let before = ClusterState { slices: vec![slice("a", "10.0.0.1", None).into(), slice("b", "10.0.0.2", None).into()], ..Default::default() };
        let mut after = before.clone();
        after.slices[0] = slice("a", "10.0.0.3", None).into();
        after.slices.remove(1);
        after.slices.push(slice("c", "10.0.0.4", None).into());
        metrics.changes_seen(ObjectChanges::between(&ClusterState::default(), &before));
        metrics.changes_seen(ObjectChanges::between(&before, &after));
        let text = rendered(&metrics, true, true);
        for line in [
            "ebpf_proxy_sync_duration_seconds_count 1\n",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1\n",
            "ebpf_proxy_last_sync_timestamp_seconds 1700000000.5\n",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000.5\n",
            // 2 added, then a changed, b removed, c added.
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 5\n",
            "kubeproxy_sync_proxy_rules_service_changes_total 0\n",
            // a, b and c have not been programmed yet.
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 3\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        metrics.changes_programmed();
        assert!(rendered(&metrics, true, true).contains("kubeproxy_sync_proxy_rules_endpoint_changes_pending 0\n"));
        // The same view again changes nothing.
        assert_eq!(ObjectChanges::between(&after, &after.clone()), ObjectChanges::default());
    }

    /// Every metric the shipped Grafana dashboard queries is one the agent exports.
    #[test]
    fn the_dashboard_queries_only_metrics_the_agent_exports() {
        let mut metrics = SyncMetrics::default();
        metrics.count_rejection(&invalid_cluster_ip("bad", "x"));
        let text = rendered(&metrics, true, true);
        let exported: BTreeSet<&str> =
            text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../deploy/grafana-dashboard.json")).expect("dashboard JSON");
        let queried = dashboard_metric_names(&dashboard);
        assert!(queried.iter().any(|m| m.starts_with("kubeproxy_")) && queried.iter().any(|m| m.starts_with("ebpf_proxy_")));
        let missing: Vec<_> = queried.iter().filter(|name| !exported.contains(name.as_str())).collect();
        assert!(missing.is_empty(), "the dashboard queries {missing:?}, which /metrics lacks");
    }

    /// The `ebpf_proxy_*` and `kubeproxy_*` names in every `expr` of a dashboard.
    fn dashboard_metric_names(value: &serde_json::Value) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        match value {
            serde_json::Value::Object(fields) => {
                for (key, field) in fields {
                    match (key.as_str(), field) {
                        ("expr", serde_json::Value::String(expr)) => names.extend(
                            expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                                .filter(|t| t.starts_with("ebpf_proxy_") || t.starts_with("kubeproxy_"))
                                .map(str::to_owned),
                        ),
                        _ => names.extend(dashboard_metric_names(field)),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|item| names.extend(dashboard_metric_names(item))),
            _ => {}
        }
        names
    }

    #[test]
    fn a_service_counts_as_programmed_only_when_none_of_its_frontends_failed() {
        let port = |name: &str, port: &str| ServicePortName { namespace: "demo".into(), name: name.into(), port: port.into() };
        let frontends = [port("web", "http"), port("web", "dns"), port("big", "http"), port("big", "http")];
        assert_eq!(programmed_services(&frontends, []), 2);
        assert_eq!(programmed_services(&frontends, ["Service demo/big:http (10.96.0.40:80/TCP)"]), 1);
        assert_eq!(programmed_services(&frontends, ["Service demo/web:dns (10.96.0.10:53/UDP)", "removed frontend 10.96.0.9:80/TCP"]), 1);
    }

    fn slice(name: &str, ip: &str, trigger: Option<&str>) -> Slice {
        let annotations = trigger.map(|t| format!("annotations: {{{ANNOTATION_LAST_CHANGE_TRIGGER_TIME}: \"{t}\"}}")).unwrap_or_default();
        serde_yaml::from_str::<k8s_openapi::api::discovery::v1::EndpointSlice>(&format!(
            "metadata: {{name: {name}, namespace: demo, {annotations}}}\naddressType: IPv4\nendpoints: [{{addresses: [{ip}]}}]"
        ))
        .expect("slice")
        .into()
    }

    #[test]
    fn change_times_use_the_trigger_annotation_when_present_and_the_arrival_otherwise() {
        let at = |text: &str| SystemTime::from(text.parse::<Timestamp>().unwrap());
        let started = at("2026-01-01T00:00:00Z");
        let received = at("2026-01-01T00:10:00Z");
        let base = ClusterState { slices: vec![slice("a", "10.0.0.1", None).into()], ..Default::default() };

        // Nothing changed (a retry): only the arrival (the caller passes it only for new views).
        assert_eq!(change_times(&base, &base, received, started), [received]);

        // A changed slice with the annotation: its time, not the arrival.
        let mut annotated = base.clone();
        annotated.slices[0] = slice("a", "10.0.0.2", Some("2026-01-01T00:09:57Z")).into();
        assert_eq!(change_times(&base, &annotated, received, started), [at("2026-01-01T00:09:57Z")]);

        // An annotation from before the agent started is ignored; the arrival counts instead.
        let mut old = base.clone();
        old.slices[0] = slice("a", "10.0.0.2", Some("2025-12-31T23:00:00Z")).into();
        assert_eq!(change_times(&base, &old, received, started), [received]);

        // A new annotated slice plus a deleted one: both times.
        let mut both = ClusterState::default();
        both.slices.push(slice("b", "10.0.0.3", Some("2026-01-01T00:09:59.5Z")).into());
        assert_eq!(change_times(&base, &both, received, started), [at("2026-01-01T00:09:59.5Z"), received]);
        assert!(received.duration_since(at("2026-01-01T00:09:59.5Z")).unwrap() == Duration::from_millis(500));
    }
}
