//! kube-proxy's configuration file (`agent --config FILE`): a `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`), such as the `config.conf` of the `kube-proxy`
//! ConfigMap that kubeadm writes, so a node can switch from kube-proxy without rewriting it.
//!
//! This module owns reading and checking the file and turning it into the settings it gives the
//! agent; `main.rs` decides which of them a flag overrides. It never touches the node.
//!
//! Every field kube-proxy v1.29-v1.36 knows is accepted; an unknown one is an error naming its
//! path (kube-proxy's strict decoding does the same). kubeadm writes every field, most as their
//! zero value (`""`, `0s`, `null`), which kube-proxy reads as "use the default": so do we.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::desired::NodePortAddresses;
use crate::ipparse::{parse_cidr_sloppy, parse_ip_sloppy, Cidr};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's ports, used when an address is given without one (`bindAddress` decides the
/// family of the defaults, as in kube-proxy's `SetDefaults_KubeProxyConfiguration`).
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Unknown field, wrong type, broken YAML: `field` is the path (`clientConnection.qps`).
    #[error("{}: field `{field}`", path.display())]
    Decode {
        path: PathBuf,
        field: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{}: apiVersion is {found:?}, expected {API_VERSION:?}", path.display())]
    ApiVersion { path: PathBuf, found: String },
    #[error("{}: kind is {found:?}, expected {KIND:?}", path.display())]
    Kind { path: PathBuf, found: String },
    #[error("{}: field `{field}`: {value:?} is not {expected}", path.display())]
    Invalid { path: PathBuf, field: String, value: String, expected: &'static str },
}

/// What the file says that means something to ebpf-proxy. `None`: the file leaves it to the
/// default (absent, or kube-proxy's "unset" zero value).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    /// `hostnameOverride`, trimmed and lower-cased as kube-proxy does (`nodeutil.GetHostname`).
    pub node_name: Option<String>,
    /// `clientConnection.kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `healthzBindAddress`, else `[::]:10256` when `bindAddress` is IPv6.
    pub healthz_bind: Option<SocketAddr>,
    /// `metricsBindAddress`, else `[::1]:10249` when `bindAddress` is IPv6.
    pub metrics_bind: Option<SocketAddr>,
    /// `nodePortAddresses`.
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// `bindAddress` (kube-proxy's idea of the node's primary IP; here only the family of the
    /// default health and metrics addresses).
    pub bind_address: Option<IpAddr>,
    /// `configSyncPeriod`: checked, but the watches deliver every change; nothing resyncs on a timer.
    pub config_sync_period: Option<Duration>,
    /// `clusterCIDR`: checked. Pod traffic is recognised here by its cgroup (socket hooks), not
    /// by its source range, so it changes nothing.
    pub cluster_cidrs: Vec<Cidr>,
    /// Fields set to something other than their zero value that have no effect on ebpf-proxy
    /// (the iptables/IPVS/nftables/winkernel modes' settings, kube-proxy's process settings),
    /// by path, for one warning.
    pub ignored: Vec<String>,
}

/// Reads and checks `path`.
pub fn load(path: &Path) -> Result<FileSettings, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
    parse(path, &text)
}

/// Checks `text` (the file at `path`, named in errors) and returns what it sets.
pub fn parse(path: &Path, text: &str) -> Result<FileSettings, ConfigError> {
    let decode_error = |field: String, source| ConfigError::Decode { path: path.to_owned(), field, source };
    let config: KubeProxyConfiguration = serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(text))
        .map_err(|error| decode_error(error.path().to_string(), error.into_inner()))?;
    match config.api_version.as_deref() {
        Some(API_VERSION) => {}
        other => return Err(ConfigError::ApiVersion { path: path.to_owned(), found: other.unwrap_or_default().to_owned() }),
    }
    match config.kind.as_deref() {
        Some(KIND) => {}
        other => return Err(ConfigError::Kind { path: path.to_owned(), found: other.unwrap_or_default().to_owned() }),
    }
    let invalid = |field: &str, value: &str, expected: &'static str| ConfigError::Invalid {
        path: path.to_owned(),
        field: field.to_owned(),
        value: value.to_owned(),
        expected,
    };

    let mut settings = FileSettings::default();
    if let Some(name) = set(&config.hostname_override) {
        settings.node_name = Some(name.trim().to_lowercase());
    }
    if let Some(kubeconfig) = config.client_connection.as_ref().and_then(|c| set(&c.kubeconfig)) {
        settings.kubeconfig = Some(PathBuf::from(kubeconfig));
    }
    if let Some(text) = set(&config.bind_address) {
        let addr = parse_ip_sloppy(text).ok_or_else(|| invalid("bindAddress", text, "an IP address"))?;
        settings.bind_address = Some(addr);
        if !addr.is_unspecified() {
            settings.ignored.push("bindAddress".to_owned());
        }
    }
    let ipv6 = settings.bind_address.is_some_and(|addr| addr.is_ipv6());
    settings.healthz_bind = match set(&config.healthz_bind_address) {
        Some(text) => Some(bind_address(text).ok_or_else(|| invalid("healthzBindAddress", text, "an IP:port address"))?),
        None if ipv6 => Some(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), HEALTHZ_PORT)),
        None => None,
    };
    settings.metrics_bind = match set(&config.metrics_bind_address) {
        Some(text) => Some(bind_address(text).ok_or_else(|| invalid("metricsBindAddress", text, "an IP:port address"))?),
        None if ipv6 => Some(SocketAddr::new(Ipv6Addr::LOCALHOST.into(), METRICS_PORT)),
        None => None,
    };
    if let Some(list) = config.node_port_addresses.as_ref().filter(|list| !list.is_empty()) {
        settings.nodeport_addresses = Some(nodeport_addresses(list).map_err(|(index, item, expected)| {
            invalid(&format!("nodePortAddresses[{index}]"), &item, expected)
        })?);
    }
    if let Some(text) = set(&config.config_sync_period) {
        let period = go_duration(text).ok_or_else(|| invalid("configSyncPeriod", text, "a duration such as 15m0s"))?;
        settings.config_sync_period = (!period.is_zero()).then_some(period);
    }
    if let Some(text) = set(&config.cluster_cidr) {
        // kube-proxy: one CIDR, or a comma-separated dual-stack pair.
        for item in text.split(',') {
            let cidr = parse_cidr_sloppy(item.trim()).ok_or_else(|| invalid("clusterCIDR", text, "a CIDR or a comma-separated pair of CIDRs"))?;
            settings.cluster_cidrs.push(cidr);
        }
    }
    if let Some(mode) = set(&config.detect_local_mode) {
        const MODES: [&str; 4] = ["ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix"];
        if !MODES.contains(&mode) {
            return Err(invalid("detectLocalMode", mode, "ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"));
        }
    }
    // The type-checked document again as a tree, for the paths of the fields that are set.
    let tree: serde_yaml::Value = serde_yaml::from_str(text).map_err(|source| decode_error(".".to_owned(), source))?;
    for key in NO_EFFECT {
        if let Some(value) = tree.get(*key) {
            non_zero_leaves(key, value, &mut settings.ignored);
        }
    }
    if let Some(client) = tree.get("clientConnection") {
        for key in ["acceptContentTypes", "contentType", "qps", "burst"] {
            if let Some(value) = client.get(key) {
                non_zero_leaves(&format!("clientConnection.{key}"), value, &mut settings.ignored);
            }
        }
    }
    Ok(settings)
}

/// Top-level fields that only configure kube-proxy's own data paths or process: accepted, and
/// named in a warning when they are set to something.
const NO_EFFECT: &[&str] = &[
    "mode",
    "iptables",
    "ipvs",
    "nftables",
    "winkernel",
    "conntrack",
    "detectLocalMode",
    "detectLocal",
    "clusterCIDR",
    "configSyncPeriod",
    "featureGates",
    "logging",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "oomScoreAdj",
    "portRange",
    "windowsRunAsService",
];

/// A string field that is set: kube-proxy reads `""` as unset.
fn set(field: &Option<String>) -> Option<&str> {
    field.as_deref().filter(|text| !text.trim().is_empty())
}

/// `IP:port`, or `:port` for every address (Go's `net.Listen` form).
fn bind_address(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    if let Some(port) = text.strip_prefix(':') {
        return Some(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port.parse().ok()?));
    }
    text.parse().ok()
}

/// kube-proxy's list: CIDRs and the keywords `primary` and `all`; the error has the index and
/// item that is wrong.
fn nodeport_addresses(list: &[String]) -> Result<NodePortAddresses, (usize, String, &'static str)> {
    let items: Vec<&str> = list.iter().map(|item| item.trim()).collect();
    if items.contains(&"all") {
        return Ok(NodePortAddresses::All);
    }
    if items == ["primary"] {
        return Ok(NodePortAddresses::Primary);
    }
    for (index, item) in items.iter().enumerate() {
        match *item {
            "primary" => return Err((index, item.to_string(), "allowed with CIDRs (ebpf-proxy takes `primary` alone)")),
            // kube-proxy serves loopback NodePorts only in iptables mode (and nftables behind a
            // feature gate); the packet programs here never see loopback traffic.
            "localhost" => return Err((index, item.to_string(), "supported by ebpf-proxy (NodePorts on loopback)")),
            _ if parse_cidr_sloppy(item).is_none() => return Err((index, item.to_string(), "a CIDR, `primary` or `all`")),
            _ => {}
        }
    }
    NodePortAddresses::parse(&items.join(",")).map_err(|_| (0, items.join(","), "a list of CIDRs"))
}

/// A Go duration (`15m0s`, `1h30m`, `500ms`, `0s`, `0`).
fn go_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if text == "0" {
        return Some(Duration::ZERO);
    }
    humantime::parse_duration(text).ok()
}

/// Appends the path of every leaf under `value` that is not its type's zero value.
fn non_zero_leaves(path: &str, value: &serde_yaml::Value, out: &mut Vec<String>) {
    use serde_yaml::Value;
    match value {
        Value::Null => {}
        Value::Bool(b) => {
            if *b {
                out.push(path.to_owned());
            }
        }
        Value::Number(n) => {
            if n.as_f64() != Some(0.0) {
                out.push(path.to_owned());
            }
        }
        Value::String(s) => {
            if !matches!(s.trim(), "" | "0" | "0s") {
                out.push(path.to_owned());
            }
        }
        Value::Sequence(items) => {
            if !items.is_empty() {
                out.push(path.to_owned());
            }
        }
        Value::Mapping(map) => {
            for (key, value) in map {
                let key = key.as_str().map(str::to_owned).unwrap_or_else(|| format!("{key:?}"));
                non_zero_leaves(&format!("{path}.{key}"), value, out);
            }
        }
        Value::Tagged(tagged) => non_zero_leaves(path, &tagged.value, out),
    }
}

// The schema, field for field (k8s.io/kube-proxy/config/v1alpha1 types.go and the
// component-base types it embeds). Every struct denies unknown fields, so a misspelt field is
// an error with its path instead of a silently ignored setting.

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)] // read for checking; only some fields have an effect here
struct KubeProxyConfiguration {
    api_version: Option<String>,
    kind: Option<String>,
    feature_gates: Option<BTreeMap<String, bool>>,
    client_connection: Option<ClientConnection>,
    logging: Option<Logging>,
    hostname_override: Option<String>,
    bind_address: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    bind_address_hard_fail: Option<bool>,
    enable_profiling: Option<bool>,
    show_hidden_metrics_for_version: Option<String>,
    mode: Option<String>,
    iptables: Option<IptablesMode>,
    ipvs: Option<IpvsMode>,
    nftables: Option<NftablesMode>,
    winkernel: Option<WinkernelMode>,
    detect_local_mode: Option<String>,
    detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    oom_score_adj: Option<i32>,
    conntrack: Option<Conntrack>,
    config_sync_period: Option<String>,
    port_range: Option<String>,
    windows_run_as_service: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct ClientConnection {
    kubeconfig: Option<String>,
    accept_content_types: Option<String>,
    content_type: Option<String>,
    qps: Option<f64>,
    burst: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct Logging {
    format: Option<String>,
    /// Nanoseconds or a duration string.
    flush_frequency: Option<serde_yaml::Value>,
    verbosity: Option<u32>,
    vmodule: Option<Vec<VModuleItem>>,
    options: Option<LoggingOptions>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct VModuleItem {
    file_pattern: Option<String>,
    verbosity: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct LoggingOptions {
    json: Option<LogFormatOptions>,
    text: Option<LogFormatOptions>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct LogFormatOptions {
    split_stream: Option<bool>,
    /// A quantity (`"0"`, `64Ki`) or a number.
    info_buffer_size: Option<serde_yaml::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct IptablesMode {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    localhost_node_ports: Option<bool>,
    #[serde(rename = "snatNodeInternalIP")]
    snat_node_internal_ip: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct IpvsMode {
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<bool>,
    tcp_timeout: Option<String>,
    tcp_fin_timeout: Option<String>,
    udp_timeout: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct NftablesMode {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct WinkernelMode {
    network_name: Option<String>,
    source_vip: Option<String>,
    #[serde(rename = "enableDSR")]
    enable_dsr: Option<bool>,
    root_hns_endpoint_name: Option<String>,
    forward_health_check_vip: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct DetectLocal {
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct Conntrack {
    max_per_core: Option<i32>,
    min: Option<i32>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
}

#[cfg(test)]
mod tests;
