//! EndpointSlices merged per Service port, and the choice of usable endpoints per traffic policy.
//!
//! Follows kube-proxy: `pkg/proxy/endpointslicecache.go` for merging (slices tied to Services by
//! label, several slices union, a duplicate endpoint is replaced by a ready copy, nil ports and
//! FQDN slices ignored, nil conditions read as ready/serving/not terminating) and
//! `pkg/proxy/topology.go` `CategorizeEndpoints` for which endpoints a frontend uses.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::{
    AddressField, Backend, BackendAddr, Family, InvalidAddress, InvalidPort, PortKey, Proto, RejectReason, RejectedObject,
    Rejection, Slice,
};
use super::slice::EndpointAddress;
use crate::ipparse::{parse_ip_sloppy, special_address};

/// One endpoint of one Service port after merging all slices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<Arc<str>>,
    pub zone_hints: BTreeSet<String>,
    pub node_hints: BTreeSet<String>,
}

/// (port name, protocol) -> (address, port) -> endpoint.
pub(super) type ServiceEndpoints = BTreeMap<PortKey, BTreeMap<(IpAddr, u16), Endpoint>>;

/// Every slice's endpoints, keyed by the (namespace, name) of the Service its label names.
pub(super) struct MergedSlices {
    pub by_service: BTreeMap<(String, String), ServiceEndpoints>,
    /// The slices that named each Service, to report slices whose Service does not exist.
    pub slice_names: BTreeMap<(String, String), Vec<String>>,
}

/// Merges `slices`, in the order given (the caller sorts them by name, so which copy of a
/// duplicate endpoint is kept does not depend on list order).
pub(super) fn merge_slices<'a>(
    slices: impl IntoIterator<Item = &'a Slice>,
    rejections: &mut Vec<Rejection>,
) -> MergedSlices {
    let mut merged = MergedSlices { by_service: BTreeMap::new(), slice_names: BTreeMap::new() };
    for slice in slices {
        let (namespace, name) = slice.object_name();
        let object = RejectedObject::endpoint_slice(&namespace, &name);
        let family = match slice.address_type.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            // kube-proxy ignores FQDN slices; they have no addresses to balance to.
            "FQDN" => continue,
            other => {
                rejections.push(Rejection::new(object, RejectReason::UnsupportedAddressType { address_type: other.to_owned() }));
                continue;
            }
        };
        let Some(service) = slice.service_name.as_ref() else {
            rejections.push(Rejection::new(object, RejectReason::MissingServiceLabel));
            continue;
        };
        let key = (namespace, service.clone());
        merged.slice_names.entry(key.clone()).or_default().push(name.clone());
        let per_port = merged.by_service.entry(key).or_default();
        for port in slice.ports.iter().flatten() {
            // A nil or zero port means "all ports" in the API; kube-proxy ignores it.
            let Some(number) = port.port.filter(|p| *p != 0) else { continue };
            let Ok(number) = u16::try_from(number) else {
                rejections.push(Rejection::new(object.clone(), RejectReason::InvalidPort(InvalidPort::Port { port: number })));
                continue;
            };
            let Ok(proto) = Proto::from_k8s(port.protocol.as_deref()) else { continue };
            let endpoints = per_port.entry((port.name.clone().unwrap_or_default(), proto)).or_default();
            for endpoint in &slice.endpoints {
                // kube-proxy uses the first address of an endpoint.
                let Some(address) = endpoint.address.as_ref() else { continue };
                let parsed = match address {
                    EndpointAddress::Ip(ip) => Some(*ip),
                    EndpointAddress::Text(text) => parse_ip_sloppy(text),
                };
                let addr = match parsed {
                    Some(addr) if special_address(addr).is_some() => {
                        let class = special_address(addr).unwrap_or_default();
                        let field = AddressField::Endpoint(family);
                        let reason = RejectReason::InvalidAddress(InvalidAddress::Special { field, addr, class });
                        rejections.push(Rejection::new(object.clone(), reason));
                        continue;
                    }
                    Some(addr) if Family::of(addr) == family => addr,
                    _ => {
                        let field = AddressField::Endpoint(family);
                        let reason = RejectReason::InvalidAddress(InvalidAddress::Unparsable { field, text: address.to_string() });
                        rejections.push(Rejection::new(object.clone(), reason));
                        continue;
                    }
                };
                let conditions = endpoint.conditions.as_ref();
                let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
                let hints = endpoint.hints.as_deref();
                let candidate = Endpoint {
                    addr,
                    port: number,
                    ready,
                    serving: conditions.and_then(|c| c.serving).unwrap_or(true),
                    terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
                    node_name: endpoint.node_name.clone(),
                    zone_hints: hints.and_then(|h| h.for_zones.as_ref()).into_iter().flatten().map(|z| z.name.clone()).collect(),
                    node_hints: hints.and_then(|h| h.for_nodes.as_ref()).into_iter().flatten().map(|n| n.name.clone()).collect(),
                };
                // Duplicates across slices happen while slices are rebalanced: a ready copy wins.
                match endpoints.get(&(addr, number)) {
                    Some(existing) if existing.ready || !ready => {}
                    _ => {
                        endpoints.insert((addr, number), candidate);
                    }
                }
            }
        }
    }
    merged
}

/// Who is asking: decides which endpoints are local and which topology hints apply.
pub(super) struct NodeView<'a> {
    pub node_name: &'a str,
    /// The own Node's `topology.kubernetes.io/zone` label.
    pub zone: Option<&'a str>,
}

impl NodeView<'_> {
    fn is_local(&self, endpoint: &Endpoint) -> bool {
        !self.node_name.is_empty() && endpoint.node_name.as_deref() == Some(self.node_name)
    }
}

/// The usable endpoints of one Service port in one family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Categorized {
    /// For `Cluster` traffic policy: ready endpoints (topology applied), else serving-and-terminating.
    pub cluster: Vec<Backend>,
    /// For `Local` traffic policy: local ready endpoints, else local serving-and-terminating.
    pub local: Vec<Backend>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum TopologyMode {
    None,
    SameNode,
    SameZone,
}

/// kube-proxy `CategorizeEndpoints` (pkg/proxy/topology.go): the terminating fallback is decided
/// separately for the cluster and the local set; topology hints narrow only the cluster set.
pub(super) fn categorize<'a>(
    endpoints: impl Iterator<Item = &'a Endpoint> + Clone,
    proto: Proto,
    node: &NodeView<'_>,
) -> Categorized {
    let to_backends = |chosen: Vec<&Endpoint>| -> Vec<Backend> {
        let mut backends: Vec<Backend> = chosen
            .into_iter()
            .map(|e| Backend { addr: BackendAddr { addr: e.addr, port: e.port, proto }, local: node.is_local(e) })
            .collect();
        backends.sort();
        backends.dedup();
        backends
    };
    let mode = topology_mode(endpoints.clone(), node);
    let available = |e: &Endpoint| match mode {
        TopologyMode::None => true,
        TopologyMode::SameNode => e.node_hints.contains(node.node_name),
        TopologyMode::SameZone => node.zone.is_some_and(|zone| e.zone_hints.contains(zone)),
    };
    let mut cluster: Vec<&Endpoint> = endpoints.clone().filter(|e| e.ready && available(e)).collect();
    if cluster.is_empty() {
        // No ready endpoint anywhere (topology falls back on its own when the node's zone has
        // none): terminating endpoints that still serve, regardless of topology.
        cluster = endpoints.clone().filter(|e| e.serving && e.terminating).collect();
    }
    let local_ready: Vec<&Endpoint> = endpoints.clone().filter(|e| node.is_local(e) && e.ready).collect();
    let local = if local_ready.is_empty() {
        endpoints.filter(|e| node.is_local(e) && e.serving && e.terminating).collect()
    } else {
        local_ready
    };
    Categorized { cluster: to_backends(cluster), local: to_backends(local) }
}

/// kube-proxy `topologyModeFromHints`: same-node hints if every ready endpoint has one and one
/// names this node (feature PreferSameTrafficDistribution, on by default since 1.34); else
/// same-zone hints if every ready endpoint has one and one names this node's zone; else none.
/// The EndpointSlice controller writes these hints for `trafficDistribution: PreferClose` (and
/// PreferSameZone/PreferSameNode) and for the `service.kubernetes.io/topology-mode: Auto`
/// annotation; kube-proxy, and so this agent, only reads the hints.
fn topology_mode<'a>(endpoints: impl Iterator<Item = &'a Endpoint>, node: &NodeView<'_>) -> TopologyMode {
    let ready: Vec<&Endpoint> = endpoints.filter(|e| e.ready).collect();
    if ready.is_empty() {
        return TopologyMode::None;
    }
    let all_have_node_hints = ready.iter().all(|e| !e.node_hints.is_empty());
    if all_have_node_hints && ready.iter().any(|e| e.node_hints.contains(node.node_name)) {
        return TopologyMode::SameNode;
    }
    let all_have_zone_hints = ready.iter().all(|e| !e.zone_hints.is_empty());
    if all_have_zone_hints && node.zone.is_some_and(|zone| ready.iter().any(|e| e.zone_hints.contains(zone))) {
        return TopologyMode::SameZone;
    }
    TopologyMode::None
}
