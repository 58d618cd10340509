//! Prometheus metrics on `--metrics-bind`: a small writer for the text exposition format
//! (version 0.0.4), histograms with kube-proxy's buckets, and what the agent records per sync.
//!
//! No prometheus crate: the agent exports a dozen families, renders them on request, and every
//! line of the format it relies on is unit-tested here. This module only formats and counts; the
//! agent loop decides what to record, and `kernel::read_counters` supplies the datapath counters.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::SystemTime;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;

use crate::desired::{ClusterState, Rejection, ServicePortName};

/// `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Set by the EndpointSlice controller to when the Pod or Service change behind the slice
/// happened; kube-proxy measures network programming latency from it.
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// Writes metric families in the text exposition format: `# HELP`, `# TYPE`, then the samples.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// Starts a family. Its samples must follow before the next family starts.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let help = help.replace('\\', r"\\").replace('\n', r"\n");
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {}", kind.as_str());
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (label, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let value = value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n");
                let _ = write!(self.out, "{label}=\"{value}\"");
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_value(value));
    }

    /// A family with one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    /// A histogram family: cumulative `_bucket` samples ending with `le="+Inf"`, `_sum`, `_count`.
    pub fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        self.family(name, Kind::Histogram, help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, count) in histogram.bounds.iter().zip(&histogram.counts) {
            cumulative += count;
            self.sample(&bucket, &[("le", &format_value(*bound))], cumulative as f64);
        }
        self.sample(&bucket, &[("le", "+Inf")], histogram.count as f64);
        self.sample(&format!("{name}_sum"), &[], histogram.sum);
        self.sample(&format!("{name}_count"), &[], histogram.count as f64);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// Sample values as Prometheus parses them (`+Inf`, `-Inf`, `NaN`; Rust would print `inf`).
fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        value.to_string()
    }
}

/// A histogram with fixed upper bounds (`le`, inclusive), as Prometheus client libraries keep it.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    /// Observations per bucket (not cumulative); those above the last bound are only in `count`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: Vec<f64>) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bucket bounds must ascend");
        Self { counts: vec![0; bounds.len()], bounds, sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|bound| value <= *bound) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }
}

/// `count` bounds: start, start·factor, start·factor², ... (Prometheus `ExponentialBuckets`).
pub fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |b| Some(b * factor)).take(count).collect()
}

/// `count` bounds: start, start+width, ... (Prometheus `LinearBuckets`).
pub fn linear_buckets(start: f64, width: f64, count: usize) -> Vec<f64> {
    (0..count).map(|i| start + width * i as f64).collect()
}

/// kube-proxy's `sync_proxy_rules_duration_seconds` buckets: 1 ms to 16.4 s, doubling.
pub fn sync_duration_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's `network_programming_duration_seconds` buckets: 0.25 s, 0.5 s, 1..59 s by 1 s,
/// 60..115 s by 5 s, 2..5 min by 30 s.
pub fn network_programming_buckets() -> Vec<f64> {
    [linear_buckets(0.25, 0.25, 2), linear_buckets(1.0, 1.0, 59), linear_buckets(60.0, 5.0, 12), linear_buckets(120.0, 30.0, 7)]
        .concat()
}

/// What the agent loop records about its syncs; rendered by [`render`].
#[derive(Clone, Debug)]
pub struct SyncMetrics {
    pub sync_duration: Histogram,
    pub network_programming: Histogram,
    pub syncs: u64,
    pub sync_failures: u64,
    /// Unix time of the last sync that programmed everything.
    pub last_sync_timestamp: Option<f64>,
    pub services: usize,
    pub frontends: usize,
    pub backends: usize,
    /// Rejections in the last sync.
    pub rejected_now: usize,
    /// Rejections by (kind, reason class), each counted once when first reported.
    pub rejected_total: BTreeMap<(&'static str, &'static str), u64>,
    /// healthCheckNodePort listeners open.
    pub health_check_ports: usize,
}

impl Default for SyncMetrics {
    fn default() -> Self {
        Self {
            sync_duration: Histogram::new(sync_duration_buckets()),
            network_programming: Histogram::new(network_programming_buckets()),
            syncs: 0,
            sync_failures: 0,
            last_sync_timestamp: None,
            services: 0,
            frontends: 0,
            backends: 0,
            rejected_now: 0,
            rejected_total: BTreeMap::new(),
            health_check_ports: 0,
        }
    }
}

impl SyncMetrics {
    pub fn count_rejection(&mut self, rejection: &Rejection) {
        let key = (rejection_kind(&rejection.object), rejection_class(&rejection.reason));
        *self.rejected_total.entry(key).or_default() += 1;
    }
}

/// Renders every family. `datapath_counters` are the per-CPU stats summed over CPUs, in
/// `proxy_abi::stat` order (none if the stats map cannot be read).
pub fn render(metrics: &SyncMetrics, source_connected: bool, datapath_counters: Option<&[u64]>) -> String {
    let mut out = Exposition::default();
    out.histogram(
        "ebpf_proxy_sync_duration_seconds",
        "Duration of one sync of the datapath maps with the desired state (as kube-proxy's sync_proxy_rules_duration_seconds).",
        &metrics.sync_duration,
    );
    out.histogram(
        "ebpf_proxy_network_programming_duration_seconds",
        "Time from an API change (an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time, else when the agent received it) to the datapath programmed.",
        &metrics.network_programming,
    );
    out.single("ebpf_proxy_sync_total", Kind::Counter, "Syncs that programmed everything.", metrics.syncs as f64);
    out.single(
        "ebpf_proxy_sync_failures_total",
        Kind::Counter,
        "Syncs with a frontend that could not be programmed (retried every second).",
        metrics.sync_failures as f64,
    );
    out.single(
        "ebpf_proxy_last_sync_timestamp_seconds",
        Kind::Gauge,
        "Unix time of the last sync that programmed everything (0: none yet).",
        metrics.last_sync_timestamp.unwrap_or(0.0),
    );
    out.single(
        "ebpf_proxy_services_programmed",
        Kind::Gauge,
        "Services (namespace/name) whose frontends are all in the datapath.",
        metrics.services as f64,
    );
    out.single(
        "ebpf_proxy_frontends_programmed",
        Kind::Gauge,
        "Frontends (address, port, protocol, scope) in the datapath.",
        metrics.frontends as f64,
    );
    out.single("ebpf_proxy_backends_programmed", Kind::Gauge, "Backends (address, port, protocol) in the datapath.", metrics.backends as f64);
    out.single(
        "ebpf_proxy_rejected_objects",
        Kind::Gauge,
        "Objects or parts of objects rejected in the last sync.",
        metrics.rejected_now as f64,
    );
    out.family(
        "ebpf_proxy_rejected_objects_total",
        Kind::Counter,
        "Rejected objects by kind and reason class, counted once when first reported.",
    );
    for ((kind, reason), count) in &metrics.rejected_total {
        out.sample("ebpf_proxy_rejected_objects_total", &[("kind", kind), ("reason", reason)], *count as f64);
    }
    out.single(
        "ebpf_proxy_source_connected",
        Kind::Gauge,
        "1 while the source (API server or manifest file) answers and confirms its view, 0 during an outage.",
        if source_connected { 1.0 } else { 0.0 },
    );
    out.single(
        "ebpf_proxy_health_check_node_ports",
        Kind::Gauge,
        "healthCheckNodePort listeners open (externalTrafficPolicy: Local LoadBalancer Services).",
        metrics.health_check_ports as f64,
    );
    if let Some(counters) = datapath_counters {
        out.family("ebpf_proxy_datapath_events_total", Kind::Counter, "Datapath events by kind, summed over CPUs.");
        for (value, name) in counters.iter().zip(proxy_abi::stat::NAMES) {
            out.sample("ebpf_proxy_datapath_events_total", &[("event", name)], *value as f64);
        }
    }
    out.finish()
}

/// The kind of a rejected object, from `Rejection::object` (`Service ns/name`,
/// `EndpointSlice ns/name`, or `FILE document N (Kind)` for a manifest document). Bounded.
pub fn rejection_kind(object: &str) -> &'static str {
    const KINDS: [&str; 4] = ["Service", "EndpointSlice", "Node", "List"];
    let named = object.split_whitespace().next().unwrap_or_default();
    let in_parens = object.rsplit_once('(').and_then(|(_, k)| k.strip_suffix(')')).unwrap_or_default();
    KINDS.into_iter().find(|k| *k == named || *k == in_parens).unwrap_or("unknown")
}

/// A bounded class for a rejection's free-text reason, so the metric's label set stays small.
/// The texts come from `desired` and the sources; an unknown text counts as `other`.
pub fn rejection_class(reason: &str) -> &'static str {
    let reason = reason.to_ascii_lowercase();
    let has = |words: &[&str]| words.iter().any(|w| reason.contains(w));
    if has(&["already used", "hijack", "collide", "conflict"]) {
        "conflict"
    } else if has(&["family"]) {
        "unsupported_family"
    } else if has(&["protocol"]) {
        "unsupported_protocol"
    } else if has(&["addresstype"]) {
        "unsupported_address_type"
    } else if has(&["sessionaffinity"]) {
        "invalid_session_affinity"
    } else if has(&["invalid port", "invalid nodeport", "invalid targetport"]) {
        "invalid_port"
    } else if has(&["invalid"]) && has(&["ip", "address", "cidr"]) {
        "invalid_address"
    } else if has(&["label"]) {
        "missing_service_label"
    } else if has(&["does not exist"]) {
        "missing_service"
    } else if has(&["too many", "exceed"]) {
        "too_large"
    } else if has(&["yaml", "not a kubernetes object", "invalid type", "missing field", "unknown field", "unknown variant"]) {
        "malformed"
    } else {
        "other"
    }
}

/// Services (namespace/name) of the desired frontends (one `ServicePortName` per frontend) none
/// of whose frontends failed. A failure names its frontend `Service ns/name:port (...)`
/// (`reconcile::Failure::what`).
pub fn programmed_services<'a>(
    frontends: impl IntoIterator<Item = &'a ServicePortName>,
    failures: impl IntoIterator<Item = &'a str>,
) -> usize {
    let failed: BTreeSet<&str> =
        failures.into_iter().filter_map(|what| what.strip_prefix("Service ")?.split(" (").next()).collect();
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
    let key = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
    };
    let before: BTreeMap<_, &EndpointSlice> = previous.slices.iter().map(|s| (key(&s.metadata), &**s)).collect();
    let after: BTreeMap<_, &EndpointSlice> = current.slices.iter().map(|s| (key(&s.metadata), &**s)).collect();

    let mut times = Vec::new();
    let mut without_time = before.keys().any(|k| !after.contains_key(k));
    for (name, slice) in &after {
        if before.get(name) == Some(slice) {
            continue;
        }
        match trigger_time(slice) {
            Some(time) if time > agent_started => times.push(time),
            Some(_) => {}
            None => without_time = true,
        }
    }
    fn by_name(state: &ClusterState) -> BTreeMap<(Option<&String>, Option<&String>), &k8s_openapi::api::core::v1::Service> {
        state.services.iter().map(|s| ((s.metadata.namespace.as_ref(), s.metadata.name.as_ref()), &**s)).collect()
    }
    if by_name(previous) != by_name(current) || previous.node != current.node {
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

pub fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let text = slice.metadata.annotations.as_ref()?.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME)?;
    let timestamp: Timestamp = text.parse().ok()?;
    Some(SystemTime::from(timestamp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn families_have_help_and_type_lines_and_escaped_labels() {
        let mut out = Exposition::default();
        out.single("a_total", Kind::Counter, "Line one\nline two \\ end.", 3.0);
        out.family("b", Kind::Gauge, "B.");
        out.sample("b", &[("x", "q\"uo\\te\nnl"), ("y", "2")], 0.5);
        out.sample("b", &[], f64::INFINITY);
        out.sample("b", &[], f64::NEG_INFINITY);
        out.sample("b", &[], f64::NAN);
        assert_eq!(
            out.finish(),
            "# HELP a_total Line one\\nline two \\\\ end.\n# TYPE a_total counter\na_total 3\n\
             # HELP b B.\n# TYPE b gauge\nb{x=\"q\\\"uo\\\\te\\nnl\",y=\"2\"} 0.5\nb +Inf\nb -Inf\nb NaN\n"
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_with_inf_sum_and_count() {
        let mut histogram = Histogram::new(vec![0.5, 1.0, 2.5]);
        for value in [0.1, 0.5, 0.7, 3.0, 2.5] {
            histogram.observe(value);
        }
        let mut out = Exposition::default();
        out.histogram("h_seconds", "H.", &histogram);
        assert_eq!(
            out.finish(),
            "# HELP h_seconds H.\n# TYPE h_seconds histogram\n\
             h_seconds_bucket{le=\"0.5\"} 2\nh_seconds_bucket{le=\"1\"} 3\nh_seconds_bucket{le=\"2.5\"} 4\n\
             h_seconds_bucket{le=\"+Inf\"} 5\nh_seconds_sum 6.8\nh_seconds_count 5\n"
        );
    }

    #[test]
    fn bucket_layouts_are_kube_proxys() {
        let sync = sync_duration_buckets();
        assert_eq!(sync.len(), 15);
        assert_eq!(sync.iter().map(|b| format_value(*b)).collect::<Vec<_>>()[..4], ["0.001", "0.002", "0.004", "0.008"]);
        assert_eq!(format_value(sync[14]), "16.384");
        let programming = network_programming_buckets();
        assert_eq!(programming.len(), 2 + 59 + 12 + 7);
        assert_eq!(programming[..4], [0.25, 0.5, 1.0, 2.0]);
        assert_eq!(programming[60..63], [59.0, 60.0, 65.0]);
        assert_eq!(programming[programming.len() - 1], 300.0);
        assert!(programming.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn render_has_every_family_once_and_the_datapath_counters_by_event() {
        let mut metrics = SyncMetrics::default();
        metrics.sync_duration.observe(0.003);
        metrics.backends = 4;
        metrics.count_rejection(&Rejection { object: "Service demo/bad".into(), reason: "invalid clusterIP \"10.96.0.999\"".into() });
        metrics.count_rejection(&Rejection { object: "Service demo/bad2".into(), reason: "invalid clusterIP \"x\"".into() });
        let counters: Vec<u64> = (0..proxy_abi::stat::NAMES.len() as u64).map(|i| i * 10).collect();
        let text = render(&metrics, true, Some(&counters));
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
        assert!(!render(&metrics, false, None).contains("datapath_events"));
    }

    #[test]
    fn rejections_fall_into_a_bounded_set_of_kinds_and_classes() {
        // The reasons as `desired` and the file source word them.
        let cases = [
            ("Service demo/a", "invalid clusterIP \"10.96.0.300\"", "Service", "invalid_address"),
            ("Service demo/a", "invalid externalIP \"1.2.3.4/32\"", "Service", "invalid_address"),
            ("Service demo/a", "invalid loadBalancer IP \"not-an-ip\"", "Service", "invalid_address"),
            ("Service demo/a", "externalIP 10.96.0.10:80/TCP of port \"http\" is already used by Service demo/web:http as its clusterIP", "Service", "conflict"),
            ("Service demo/a", "externalIP 10.244.1.1 would hijack an address of this node", "Service", "conflict"),
            ("Service demo/a", "clusterIP fd00::10 skipped: this node has no address of family IPv6", "Service", "unsupported_family"),
            ("Service demo/a", "protocol SCTP is not supported", "Service", "unsupported_protocol"),
            ("Service demo/a", "invalid port 70000", "Service", "invalid_port"),
            ("Service demo/a", "port \"zero\": invalid nodePort 0 for type NodePort", "Service", "invalid_port"),
            ("Service demo/a", "sessionAffinityConfig.clientIP.timeoutSeconds 0 is outside 1..=86400", "Service", "invalid_session_affinity"),
            ("EndpointSlice demo/s", "no kubernetes.io/service-name label", "EndpointSlice", "missing_service_label"),
            ("EndpointSlice demo/s", "its Service demo/ghost does not exist", "EndpointSlice", "missing_service"),
            ("EndpointSlice demo/s", "invalid IPv6 endpoint address \"x\"", "EndpointSlice", "invalid_address"),
            ("EndpointSlice demo/s", "unsupported addressType \"IPv5\"", "EndpointSlice", "unsupported_address_type"),
            ("m.yaml document 3 (Service)", "invalid type: string \"x\", expected a sequence", "Service", "malformed"),
            ("m.yaml document 4", "not valid YAML: mapping values are not allowed", "unknown", "malformed"),
            ("Mystery x", "something new", "unknown", "other"),
        ];
        for (object, reason, kind, class) in cases {
            assert_eq!((rejection_kind(object), rejection_class(reason)), (kind, class), "{object}: {reason}");
        }
    }

    #[test]
    fn a_service_counts_as_programmed_only_when_none_of_its_frontends_failed() {
        let port = |name: &str, port: &str| ServicePortName { namespace: "demo".into(), name: name.into(), port: port.into() };
        let frontends = [port("web", "http"), port("web", "dns"), port("big", "http"), port("big", "http")];
        assert_eq!(programmed_services(&frontends, []), 2);
        assert_eq!(programmed_services(&frontends, ["Service demo/big:http (10.96.0.40:80/TCP)"]), 1);
        assert_eq!(programmed_services(&frontends, ["Service demo/web:dns (10.96.0.10:53/UDP)", "removed frontend 10.96.0.9:80/TCP"]), 1);
    }

    fn slice(name: &str, ip: &str, trigger: Option<&str>) -> EndpointSlice {
        let annotations = trigger.map(|t| format!("annotations: {{{ANNOTATION_LAST_CHANGE_TRIGGER_TIME}: \"{t}\"}}")).unwrap_or_default();
        serde_yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: demo, {annotations}}}\naddressType: IPv4\nendpoints: [{{addresses: [{ip}]}}]"
        ))
        .expect("slice")
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
