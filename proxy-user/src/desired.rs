//! Desired datapath state as a pure function of the cluster objects.
//!
//! (Services, EndpointSlices, Node, config) -> frontends and their backends. No I/O and no map
//! knowledge: this module owns the Kubernetes semantics (which objects count, which endpoints are
//! usable, how ports resolve), and the reconciler turns its output into map writes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{Node, Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::ipparse::parse_ip_sloppy;

/// Label tying an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Services with this label are handled by another proxy (any value).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Services with this label are treated as headless.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn from_k8s(protocol: Option<&str>) -> Result<Self, String> {
        match protocol.unwrap_or("TCP") {
            "TCP" => Ok(Self::Tcp),
            "UDP" => Ok(Self::Udp),
            other => Err(format!("protocol {other} is not supported")),
        }
    }

    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => proxy_abi::IPPROTO_TCP,
            Self::Udp => proxy_abi::IPPROTO_UDP,
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        match number {
            proxy_abi::IPPROTO_TCP => Some(Self::Tcp),
            proxy_abi::IPPROTO_UDP => Some(Self::Udp),
            _ => None,
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
        })
    }
}

/// Which traffic a frontend entry serves. The socket hooks look up `Internal` entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    External,
    Internal,
}

impl Scope {
    pub fn number(self) -> u8 {
        match self {
            Self::External => proxy_abi::SCOPE_EXTERNAL,
            Self::Internal => proxy_abi::SCOPE_INTERNAL,
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        match number {
            proxy_abi::SCOPE_EXTERNAL => Some(Self::External),
            proxy_abi::SCOPE_INTERNAL => Some(Self::Internal),
            _ => None,
        }
    }
}

/// What a client addresses: (VIP, port, protocol) in a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Proto,
    pub scope: Scope,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto)
    }
}

/// Where a frontend's traffic goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Proto,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto)
    }
}

/// `namespace/name:port-name` of a Service port, as kube-proxy names it in logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        Ok(())
    }
}

/// One frontend's target state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendSpec {
    pub service: ServicePortName,
    /// Usable backends, sorted and without duplicates. Empty means "reject".
    pub backends: Vec<BackendAddr>,
}

/// An object (or part of one) that was not programmed, and why. Reported once per change.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rejection {
    /// `Service ns/name` or `EndpointSlice ns/name`.
    pub object: String,
    pub reason: String,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, FrontendSpec>,
    pub rejections: Vec<Rejection>,
}

/// Node-level settings that shape the desired state.
#[derive(Clone, Debug, Default)]
pub struct NodeConfig {
    // Read by node-local endpoint selection (traffic policies), next in line.
    #[allow(dead_code)]
    pub node_name: String,
}

/// The cluster objects one computation works from.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub node: Option<Node>,
}

#[derive(Clone, Copy, Debug, Default)]
struct EndpointConditions {
    ready: bool,
    serving: bool,
    terminating: bool,
}

/// One endpoint for one Service port after merging all slices.
#[derive(Clone, Copy, Debug)]
struct MergedEndpoint {
    conditions: EndpointConditions,
}

type PortKey = (String, Proto);

/// Computes what the datapath should hold. Pure: same input, same output.
pub fn compute(cluster: &ClusterState, _config: &NodeConfig) -> DesiredState {
    let mut state = DesiredState::default();
    let endpoints = merge_slices(&cluster.slices, &mut state.rejections);

    let mut services: Vec<&Service> = cluster.services.iter().collect();
    // Deterministic order, so the winner of a frontend collision does not depend on list order.
    services.sort_by(|a, b| object_name(&a.metadata).cmp(&object_name(&b.metadata)));

    for service in services {
        let (namespace, name) = object_name(&service.metadata);
        let object = format!("Service {namespace}/{name}");
        let Some(spec) = &service.spec else { continue };
        if is_ignored(service) {
            continue;
        }
        let vips = match cluster_ips(service) {
            Ok(vips) => vips,
            Err(reason) => {
                state.rejections.push(Rejection { object, reason });
                continue;
            }
        };
        let service_endpoints = endpoints.get(&(namespace.clone(), name.clone()));
        for port in spec.ports.iter().flatten() {
            let (port_key, frontend_port) = match service_port(port) {
                Ok(resolved) => resolved,
                Err(reason) => {
                    state.rejections.push(Rejection { object: object.clone(), reason });
                    continue;
                }
            };
            let backends =
                usable_backends(service_endpoints.and_then(|eps| eps.get(&port_key)), port_key.1);
            let service_port_name = ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port: port_key.0.clone(),
            };
            for vip in &vips {
                let frontend = Frontend {
                    addr: *vip,
                    port: frontend_port,
                    proto: port_key.1,
                    scope: Scope::Internal,
                };
                if let Some(owner) = state.frontends.get(&frontend) {
                    state.rejections.push(Rejection {
                        object: object.clone(),
                        reason: format!("{frontend} is already used by {}", owner.service),
                    });
                    continue;
                }
                state.frontends.insert(
                    frontend,
                    FrontendSpec { service: service_port_name.clone(), backends: backends.clone() },
                );
            }
        }
    }
    state.rejections.sort();
    state.rejections.dedup();
    state
}

fn object_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".to_owned()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Services kube-proxy does not program: ExternalName (even with a stale clusterIP), headless,
/// and those labelled for another proxy or as headless.
fn is_ignored(service: &Service) -> bool {
    let labels = service.metadata.labels.as_ref();
    let has_label = |label: &str| labels.is_some_and(|l| l.contains_key(label));
    if has_label(LABEL_SERVICE_PROXY_NAME) || has_label(LABEL_HEADLESS) {
        return true;
    }
    let Some(spec) = &service.spec else { return true };
    if spec.type_.as_deref() == Some("ExternalName") {
        return true;
    }
    matches!(spec.cluster_ip.as_deref(), None | Some("") | Some("None"))
}

/// The Service's IPv4 cluster IPs (`clusterIPs`, falling back to `clusterIP`).
fn cluster_ips(service: &Service) -> Result<Vec<Ipv4Addr>, String> {
    let spec = service.spec.as_ref().ok_or("no spec")?;
    let texts: Vec<&str> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec.cluster_ip.iter().map(String::as_str).collect(),
    };
    let mut vips = Vec::new();
    for text in texts {
        match parse_ip_sloppy(text) {
            Some(IpAddr::V4(ip)) => vips.push(ip),
            // IPv6 frontends arrive with the IPv6 datapath; a dual-stack Service keeps its IPv4 side.
            Some(IpAddr::V6(_)) => {}
            None => return Err(format!("invalid clusterIP {text:?}")),
        }
    }
    Ok(vips)
}

fn service_port(port: &ServicePort) -> Result<(PortKey, u16), String> {
    let proto = Proto::from_k8s(port.protocol.as_deref())?;
    let number = u16::try_from(port.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("invalid port {}", port.port))?;
    Ok(((port.name.clone().unwrap_or_default(), proto), number))
}

/// Merges all slices into (namespace, service) -> (port name, protocol) -> endpoint -> conditions.
///
/// As kube-proxy's endpointslice cache: slices are tied to Services by label, several slices
/// union, a duplicate endpoint merges with "ready wins", nil ports are ignored, FQDN slices too.
fn merge_slices(
    slices: &[EndpointSlice],
    rejections: &mut Vec<Rejection>,
) -> BTreeMap<(String, String), BTreeMap<PortKey, BTreeMap<(Ipv4Addr, u16), MergedEndpoint>>> {
    let mut merged: BTreeMap<_, BTreeMap<_, BTreeMap<_, MergedEndpoint>>> = BTreeMap::new();
    for slice in slices {
        let (namespace, name) = object_name(&slice.metadata);
        let object = format!("EndpointSlice {namespace}/{name}");
        if slice.address_type != "IPv4" {
            // FQDN is ignored by kube-proxy; IPv6 arrives with the IPv6 datapath.
            continue;
        }
        let Some(service) = slice.metadata.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME)) else {
            rejections.push(Rejection { object, reason: format!("no {LABEL_SERVICE_NAME} label") });
            continue;
        };
        let per_port = merged.entry((namespace, service.clone())).or_default();
        for port in slice.ports.iter().flatten() {
            let Some(number) = port.port else { continue };
            let Ok(number) = u16::try_from(number) else {
                rejections.push(Rejection { object: object.clone(), reason: format!("invalid port {number}") });
                continue;
            };
            if number == 0 {
                continue;
            }
            let proto = match Proto::from_k8s(port.protocol.as_deref()) {
                Ok(proto) => proto,
                Err(_) => continue,
            };
            let endpoints = per_port.entry((port.name.clone().unwrap_or_default(), proto)).or_default();
            for endpoint in &slice.endpoints {
                // kube-proxy uses the first address of an endpoint.
                let Some(text) = endpoint.addresses.first() else { continue };
                let addr = match parse_ip_sloppy(text) {
                    Some(IpAddr::V4(addr)) => addr,
                    _ => {
                        rejections.push(Rejection {
                            object: object.clone(),
                            reason: format!("invalid IPv4 endpoint address {text:?}"),
                        });
                        continue;
                    }
                };
                let conditions = conditions(endpoint.conditions.as_ref());
                endpoints
                    .entry((addr, number))
                    .and_modify(|existing| {
                        // Duplicates across slices happen during slice rebalancing: ready wins.
                        existing.conditions.ready |= conditions.ready;
                        existing.conditions.serving |= conditions.serving;
                        existing.conditions.terminating &= conditions.terminating;
                    })
                    .or_insert(MergedEndpoint { conditions });
            }
        }
    }
    merged
}

/// Nil conditions are read as the API documents them: ready and serving unless said otherwise.
fn conditions(conditions: Option<&k8s_openapi::api::discovery::v1::EndpointConditions>) -> EndpointConditions {
    let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
    EndpointConditions {
        ready,
        serving: conditions.and_then(|c| c.serving).unwrap_or(ready),
        terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
    }
}

/// Ready endpoints; if none, serving-and-terminating ones (kube-proxy `CategorizeEndpoints`).
fn usable_backends(
    endpoints: Option<&BTreeMap<(Ipv4Addr, u16), MergedEndpoint>>,
    proto: Proto,
) -> Vec<BackendAddr> {
    let Some(endpoints) = endpoints else { return Vec::new() };
    let pick = |want: fn(&EndpointConditions) -> bool| -> BTreeSet<(Ipv4Addr, u16)> {
        endpoints.iter().filter(|(_, e)| want(&e.conditions)).map(|(k, _)| *k).collect()
    };
    let mut chosen = pick(|c| c.ready);
    if chosen.is_empty() {
        chosen = pick(|c| c.serving && c.terminating);
    }
    chosen.into_iter().map(|(addr, port)| BackendAddr { addr, port, proto }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).expect("test Service")
    }

    fn slice(yaml: &str) -> EndpointSlice {
        serde_yaml::from_str(yaml).expect("test EndpointSlice")
    }

    const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: web, protocol: TCP}
  - {name: metrics, port: 9090, targetPort: 9090, protocol: TCP}
"#;

    fn compute_for(services: &[&str], slices: &[&str]) -> DesiredState {
        let cluster = ClusterState {
            services: services.iter().map(|s| service(s)).collect(),
            slices: slices.iter().map(|s| slice(s)).collect(),
            node: None,
        };
        compute(&cluster, &NodeConfig::default())
    }

    fn fe(ip: &str, port: u16, proto: Proto) -> Frontend {
        Frontend { addr: ip.parse().unwrap(), port, proto, scope: Scope::Internal }
    }

    fn backends(state: &DesiredState, frontend: Frontend) -> Vec<String> {
        state.frontends[&frontend].backends.iter().map(|b| format!("{}:{}", b.addr, b.port)).collect()
    }

    #[test]
    fn ports_resolve_by_service_port_name_whether_target_port_is_a_name_or_a_number() {
        // The slice carries the resolved target port under the Service port's name.
        let state = compute_for(
            &[WEB],
            &[r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.1.2]}, {addresses: [10.244.1.3]}]
ports: [{name: http, port: 8080, protocol: TCP}, {name: metrics, port: 9090, protocol: TCP}]
"#],
        );
        assert!(state.rejections.is_empty(), "{:?}", state.rejections);
        assert_eq!(backends(&state, fe("10.96.0.10", 80, Proto::Tcp)), ["10.244.1.2:8080", "10.244.1.3:8080"]);
        assert_eq!(backends(&state, fe("10.96.0.10", 9090, Proto::Tcp)), ["10.244.1.2:9090", "10.244.1.3:9090"]);
    }

    #[test]
    fn several_slices_merge_and_a_duplicate_is_ready_if_any_copy_is() {
        let state = compute_for(
            &[WEB],
            &[
                r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.1.2]}, {addresses: [10.244.1.4], conditions: {ready: false}}]
ports: [{name: http, port: 8080, protocol: TCP}]
"#,
                r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-b, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.2.7]}, {addresses: [10.244.1.4], conditions: {ready: true}}]
ports: [{name: http, port: 8080, protocol: TCP}]
"#,
            ],
        );
        assert_eq!(
            backends(&state, fe("10.96.0.10", 80, Proto::Tcp)),
            ["10.244.1.2:8080", "10.244.1.4:8080", "10.244.2.7:8080"]
        );
        // No slice port named "metrics": the frontend exists and rejects.
        assert!(backends(&state, fe("10.96.0.10", 9090, Proto::Tcp)).is_empty());
    }

    #[test]
    fn not_ready_endpoints_are_excluded_and_terminating_ones_are_a_fallback() {
        let only_not_ready = compute_for(
            &[WEB],
            &[r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.2], conditions: {ready: false}}
- {addresses: [10.244.1.3], conditions: {ready: true}}
ports: [{name: http, port: 8080, protocol: TCP}]
"#],
        );
        assert_eq!(backends(&only_not_ready, fe("10.96.0.10", 80, Proto::Tcp)), ["10.244.1.3:8080"]);

        let terminating = compute_for(
            &[WEB],
            &[r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.2], conditions: {ready: false, serving: true, terminating: true}}
- {addresses: [10.244.1.3], conditions: {ready: false, serving: false, terminating: true}}
ports: [{name: http, port: 8080, protocol: TCP}]
"#],
        );
        assert_eq!(backends(&terminating, fe("10.96.0.10", 80, Proto::Tcp)), ["10.244.1.2:8080"]);
    }

    #[test]
    fn headless_external_name_and_labelled_services_are_ignored() {
        let state = compute_for(
            &[
                r#"{apiVersion: v1, kind: Service, metadata: {name: headless, namespace: a}, spec: {clusterIP: None, ports: [{port: 80}]}}"#,
                r#"{apiVersion: v1, kind: Service, metadata: {name: ext, namespace: a}, spec: {type: ExternalName, externalName: example.com, clusterIP: 10.96.0.20, ports: [{port: 80}]}}"#,
                r#"{apiVersion: v1, kind: Service, metadata: {name: other, namespace: a, labels: {service.kubernetes.io/service-proxy-name: foo}}, spec: {clusterIP: 10.96.0.21, ports: [{port: 80}]}}"#,
                r#"{apiVersion: v1, kind: Service, metadata: {name: hl, namespace: a, labels: {service.kubernetes.io/headless: ""}}, spec: {clusterIP: 10.96.0.22, ports: [{port: 80}]}}"#,
            ],
            &[],
        );
        assert!(state.frontends.is_empty(), "{:?}", state.frontends.keys());
        assert!(state.rejections.is_empty());
    }

    #[test]
    fn tcp_and_udp_on_the_same_port_are_separate_frontends() {
        let state = compute_for(
            &[r#"{apiVersion: v1, kind: Service, metadata: {name: dns, namespace: kube-system}, spec: {clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]}}"#],
            &[r#"{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: dns-a, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}, addressType: IPv4, endpoints: [{addresses: [10.244.1.5]}], ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5354, protocol: TCP}]}"#],
        );
        assert_eq!(backends(&state, fe("10.96.0.10", 53, Proto::Udp)), ["10.244.1.5:5353"]);
        assert_eq!(backends(&state, fe("10.96.0.10", 53, Proto::Tcp)), ["10.244.1.5:5354"]);
        assert_eq!(state.frontends[&fe("10.96.0.10", 53, Proto::Udp)].backends[0].proto, Proto::Udp);
    }

    #[test]
    fn bad_input_is_rejected_by_name_and_the_rest_still_programs() {
        let state = compute_for(
            &[
                WEB,
                r#"{apiVersion: v1, kind: Service, metadata: {name: badip, namespace: demo}, spec: {clusterIP: "10.96.0.300", ports: [{port: 80}]}}"#,
                r#"{apiVersion: v1, kind: Service, metadata: {name: zeros, namespace: demo}, spec: {clusterIP: "010.096.000.011", ports: [{port: 80}]}}"#,
                r#"{apiVersion: v1, kind: Service, metadata: {name: sctp, namespace: demo}, spec: {clusterIP: "10.96.0.12", ports: [{port: 80, protocol: SCTP}]}}"#,
            ],
            &[
                r#"{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: orphan, namespace: demo}, addressType: IPv4, endpoints: [{addresses: [10.244.1.2]}], ports: [{port: 80}]}"#,
                r#"{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-x, namespace: demo, labels: {kubernetes.io/service-name: web}}, addressType: IPv4, endpoints: [{addresses: [not-an-ip]}, {addresses: [10.244.1.9]}], ports: [{name: http, port: 8080}, {name: http, port: null}]}"#,
            ],
        );
        let rejected: Vec<String> = state.rejections.iter().map(ToString::to_string).collect();
        assert!(rejected.iter().any(|r| r.starts_with("Service demo/badip: invalid clusterIP")), "{rejected:?}");
        assert!(rejected.iter().any(|r| r.starts_with("Service demo/sctp: protocol SCTP")), "{rejected:?}");
        assert!(rejected.iter().any(|r| r.starts_with("EndpointSlice demo/orphan: no kubernetes.io/service-name")), "{rejected:?}");
        assert!(rejected.iter().any(|r| r.contains("EndpointSlice demo/web-x") && r.contains("not-an-ip")), "{rejected:?}");
        // Leading zeros read as decimal (CVE-2021-29923), not octal and not rejected.
        assert!(state.frontends.contains_key(&fe("10.96.0.11", 80, Proto::Tcp)));
        assert_eq!(backends(&state, fe("10.96.0.10", 80, Proto::Tcp)), ["10.244.1.9:8080"]);
    }
}
