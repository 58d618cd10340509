//! What the agent keeps of an EndpointSlice: the fields kube-proxy reads, in a form about a
//! quarter of the API type's size. At 30 000 Services × 10 endpoints the API's `Endpoint`
//! (352 bytes inline, a `Vec` of address strings, a Pod reference) held about 130 MiB; this
//! holds the same answers in about 30.

use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, LazyLock, Mutex};

use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointHints, EndpointPort, EndpointSlice};

use super::LABEL_SERVICE_NAME;
use crate::metrics::ANNOTATION_LAST_CHANGE_TRIGGER_TIME;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slice {
    /// As the object says ("" when it names none).
    pub namespace: String,
    pub name: String,
    /// Its `kubernetes.io/service-name` label: the Service it belongs to.
    pub service_name: Option<String>,
    /// Its `endpoints.kubernetes.io/last-change-trigger-time` annotation (network programming
    /// latency), as written.
    pub trigger_time: Option<String>,
    pub address_type: String,
    pub ports: Option<Vec<EndpointPort>>,
    pub endpoints: Vec<SliceEndpoint>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SliceEndpoint {
    /// The first of the endpoint's addresses: kube-proxy reads no other (the API's own words:
    /// "no semantics are defined for additional addresses beyond the first").
    pub address: Option<EndpointAddress>,
    pub conditions: Option<EndpointConditions>,
    /// Shared by every endpoint on the same node ([`node_name`]).
    pub node_name: Option<Arc<str>>,
    /// Topology hints (rare: boxed, so an endpoint without them pays one pointer).
    pub hints: Option<Box<EndpointHints>>,
}

/// An endpoint address: parsed when the object wrote it the way Rust prints it back (almost
/// always), else the text as written, so that a rejection quotes exactly what the object says.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EndpointAddress {
    Ip(IpAddr),
    Text(Box<str>),
}

impl EndpointAddress {
    fn new(text: String) -> Self {
        match text.parse::<IpAddr>() {
            Ok(ip) if ip.to_string() == text => Self::Ip(ip),
            _ => Self::Text(text.into_boxed_str()),
        }
    }
}

impl fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => ip.fmt(f),
            Self::Text(text) => f.write_str(text),
        }
    }
}

/// The one shared copy of a node name. Every endpoint names its node, and a cluster has far
/// fewer nodes than endpoints: at 300 000 endpoints, a `String` each was 300 000 allocations.
/// Names no endpoint holds any more are dropped when the table has doubled since the last sweep.
pub fn node_name(name: String) -> Arc<str> {
    static NAMES: LazyLock<Mutex<(HashSet<Arc<str>>, usize)>> = LazyLock::new(Default::default);
    let mut guard = NAMES.lock().expect("node names lock");
    let (names, swept_at) = &mut *guard;
    if let Some(shared) = names.get(name.as_str()) {
        return shared.clone();
    }
    if names.len() >= 2 * (*swept_at).max(64) {
        names.retain(|name| Arc::strong_count(name) > 1);
        *swept_at = names.len();
    }
    let shared: Arc<str> = name.into();
    names.insert(shared.clone());
    shared
}

impl From<EndpointSlice> for Slice {
    fn from(slice: EndpointSlice) -> Self {
        // A new Vec, not `collect()`: that would reuse the API Vec's allocation in place and
        // keep its 352 bytes per endpoint (measured: 5.5 KiB per slice of 10 instead of 2).
        let mut endpoints = Vec::with_capacity(slice.endpoints.len());
        endpoints.extend(slice.endpoints.into_iter().map(|endpoint| SliceEndpoint {
            address: endpoint.addresses.into_iter().next().map(EndpointAddress::new),
            conditions: endpoint.conditions,
            node_name: endpoint.node_name.map(node_name),
            hints: endpoint.hints.map(Box::new),
        }));
        let mut meta = slice.metadata;
        Self {
            namespace: meta.namespace.unwrap_or_default(),
            name: meta.name.unwrap_or_default(),
            service_name: meta.labels.as_mut().and_then(|l| l.remove(LABEL_SERVICE_NAME)),
            trigger_time: meta.annotations.as_mut().and_then(|a| a.remove(ANNOTATION_LAST_CHANGE_TRIGGER_TIME)),
            address_type: slice.address_type,
            ports: slice.ports,
            endpoints,
        }
    }
}

impl Slice {
    /// (namespace, name), the namespace `default` when the object names none (as a manifest
    /// applied without one would be).
    pub fn object_name(&self) -> (String, String) {
        super::service::object_name(&self.namespace, &self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_what_kube_proxy_reads_and_only_the_first_address() {
        let slice: EndpointSlice = serde_yaml::from_str(
            "metadata: {name: s, namespace: demo, labels: {kubernetes.io/service-name: web, other: x}}\n\
             addressType: IPv4\n\
             ports: [{name: http, port: 8080, protocol: TCP}]\n\
             endpoints:\n\
             - {addresses: [10.0.0.1, 10.0.0.9], conditions: {ready: false, serving: true}, nodeName: n1, \
                hints: {forZones: [{name: z1}]}, targetRef: {kind: Pod, name: p}}\n\
             - {addresses: []}\n",
        )
        .unwrap();
        let slim = Slice::from(slice.clone());
        assert_eq!((slim.object_name(), slim.service_name.as_deref()), (("demo".into(), "s".into()), Some("web")));
        assert_eq!((slim.address_type, slim.ports), (slice.address_type, slice.ports));
        assert_eq!(slim.endpoints.len(), 2);
        let first = &slim.endpoints[0];
        assert_eq!(first.address, Some(EndpointAddress::Ip("10.0.0.1".parse().unwrap())));
        assert_eq!(first.conditions.as_ref().and_then(|c| c.ready), Some(false));
        assert_eq!(first.node_name.as_deref(), Some("n1"));
        assert_eq!(first.hints.as_ref().and_then(|h| h.for_zones.as_ref()).map(Vec::len), Some(1));
        assert_eq!(slim.endpoints[1], SliceEndpoint::default());
        assert!(size_of::<SliceEndpoint>() <= 56, "{}", size_of::<SliceEndpoint>());
    }

    #[test]
    fn an_address_not_written_as_rust_prints_it_stays_text_and_node_names_are_shared() {
        for (text, parsed) in [("10.0.0.1", true), ("fd00::1", true), ("010.0.0.1", false), ("FD00::1", false), ("x", false)] {
            let address = EndpointAddress::new(text.to_owned());
            assert_eq!((address.to_string().as_str(), matches!(address, EndpointAddress::Ip(_))), (text, parsed));
        }
        let (a, b) = (node_name("node-a".to_owned()), node_name("node-a".to_owned()));
        assert!(Arc::ptr_eq(&a, &b));
    }
}
