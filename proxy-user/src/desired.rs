//! Desired datapath state as a pure function of the cluster objects.
//!
//! (Services, EndpointSlices, Node, config) -> frontends and their backends. No I/O and no map
//! knowledge: this module owns the Kubernetes semantics (which objects count, which endpoints are
//! usable for which traffic, how ports resolve, which frontend wins a collision), and the
//! reconciler turns its output into map writes.
//!
//! Every frontend address gets two entries: `Scope::Internal`, used for traffic from this node's
//! own sockets (pods and the node itself, through the socket hooks), and `Scope::External`, for
//! traffic arriving from outside the node (the packet-level programs). They differ only when a
//! traffic policy makes them differ.

mod endpoints;
mod incremental;
mod rejection;
mod service;
mod slice;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::ipparse::{parse_cidr_sloppy, parse_ip_sloppy, special_address, Cidr};
use endpoints::{categorize, Categorized, NodeView, ServiceEndpoints};
#[cfg(test)]
pub use incremental::group;
pub use incremental::{service_key, slice_service_key, Changes, Incremental, ServiceKey, ServiceObjects};
pub use service::{default_namespace, PortInfo, ServiceInfo, ServiceType};
pub use slice::{EndpointAddress, Slice};
pub use rejection::{
    AddressField, Conflict, FamilyMissingOn, InvalidAddress, InvalidPort, Malformed, ObjectKind, RejectReason, RejectedObject,
    Rejection,
};

/// Label tying an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Services with this label are handled by another proxy (any value).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Services with this label are treated as headless.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// The Node label topology hints are matched against.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// `sessionAffinityConfig.clientIP.timeoutSeconds` when unset (the API's default), and its maximum.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn from_k8s(protocol: Option<&str>) -> Result<Self, RejectReason> {
        match protocol.unwrap_or("TCP") {
            "TCP" => Ok(Self::Tcp),
            "UDP" => Ok(Self::Udp),
            other => Err(RejectReason::UnsupportedProtocol { protocol: other.to_owned() }),
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

/// IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(addr: IpAddr) -> Self {
        if addr.is_ipv4() {
            Self::V4
        } else {
            Self::V6
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
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

    pub fn name(self) -> &'static str {
        match self {
            Self::External => "external",
            Self::Internal => "internal",
        }
    }
}

/// What a client addresses: (address, port, protocol) in a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
    pub scope: Scope,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", SocketText(self.addr, self.port), self.proto)
    }
}

/// `a.b.c.d:port` or `[v6]:port`.
struct SocketText(IpAddr, u16);

impl fmt::Display for SocketText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::SocketAddr::new(self.0, self.1))
    }
}

/// Where a frontend's traffic goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", SocketText(self.addr, self.port), self.proto)
    }
}

/// A backend of one frontend, and whether its endpoint runs on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend {
    pub addr: BackendAddr,
    /// The endpoint's `nodeName` is this node.
    pub local: bool,
}

/// What made an address a frontend of a Service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum FrontendKind {
    #[default]
    #[serde(rename = "ClusterIP")]
    ClusterIp,
    /// `nodePort` on one of the node's addresses.
    NodePort,
    /// One of `spec.externalIPs`.
    #[serde(rename = "ExternalIP")]
    ExternalIp,
    /// One of `status.loadBalancer.ingress[].ip` (VIP mode).
    LoadBalancer,
}

impl FrontendKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::ClusterIp => "clusterIP",
            Self::NodePort => "nodePort",
            Self::ExternalIp => "externalIP",
            Self::LoadBalancer => "loadBalancer IP",
        }
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

/// One frontend entry's target state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendSpec {
    pub service: ServicePortName,
    pub kind: FrontendKind,
    /// A `Local` traffic policy limits this entry to node-local endpoints.
    pub local_only: bool,
    /// `sessionAffinity: ClientIP` with this timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// Usable backends, sorted and without duplicates. Empty means "reject" (or, with
    /// `local_only`, "drop": kube-proxy drops traffic for a Local policy without local endpoints).
    pub backends: Vec<Backend>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Shared (`Arc`): a Service's internal and external entries are usually the same, and a
    /// copy for the checkpoint writer costs pointers, not specs.
    pub frontends: BTreeMap<Frontend, Arc<FrontendSpec>>,
    pub rejections: Vec<Rejection>,
}

/// `--nodeport-addresses`: which node addresses get NodePort frontends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every address of the node's interfaces (kube-proxy's iptables and ipvs default).
    #[default]
    All,
    /// The node's addresses inside one of these networks.
    Cidrs(Vec<Cidr>),
    /// The Node object's primary addresses (first InternalIP, else ExternalIP, of each family)
    /// that are also on an interface: kube-proxy's `primary`, the nftables mode's default.
    Primary,
}

impl NodePortAddresses {
    /// Parses the flag's value: comma-separated CIDRs, or `primary` alone (as kube-proxy's
    /// validation demands). The error names the item that is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let items: Vec<&str> = text.split(',').map(str::trim).filter(|item| !item.is_empty()).collect();
        match items.as_slice() {
            [] => Ok(Self::All),
            ["primary"] => Ok(Self::Primary),
            _ => items
                .iter()
                .map(|item| match *item {
                    "primary" => Err("\"primary\" cannot be combined with CIDRs".to_owned()),
                    _ => parse_cidr_sloppy(item).ok_or_else(|| format!("invalid CIDR {item:?}")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Self::Cidrs),
        }
    }
}

/// Node-level settings that shape the desired state.
#[derive(Clone, Debug, Default)]
pub struct NodeConfig {
    /// Endpoints whose `nodeName` equals it are local.
    pub node_name: String,
    /// Addresses of the node's interfaces (loopback and IPv6 link-local left out), as read just
    /// before this computation: NodePorts live on them, and their families are the ones this
    /// node can serve.
    pub interface_addresses: Vec<IpAddr>,
    pub nodeport_addresses: NodePortAddresses,
}

/// The cluster objects one computation works from. Shared with the source's store (`Arc`):
/// a snapshot copies pointers, not objects (at 30 000 Services, each copy was ~100 MiB).
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    pub services: Vec<Arc<ServiceInfo>>,
    pub slices: Vec<Arc<Slice>>,
    pub node: Option<Arc<Node>>,
}

type PortKey = (String, Proto);

/// One frontend address of one Service port, before collisions are settled.
struct Candidate {
    addr: IpAddr,
    port: u16,
    proto: Proto,
    kind: FrontendKind,
    service: ServicePortName,
    affinity_timeout: Option<u32>,
    /// (backends, local_only) for the internal and the external entry.
    internal: (Vec<Backend>, bool),
    external: (Vec<Backend>, bool),
}

impl Candidate {
    /// Settling order: ClusterIPs and NodePorts first, so an externalIP or LoadBalancer IP can
    /// never take over a ClusterIP or a NodePort (CVE-2020-8554), whatever the Services' names.
    fn phase(&self) -> u8 {
        match self.kind {
            FrontendKind::ClusterIp | FrontendKind::NodePort => 0,
            FrontendKind::ExternalIp | FrontendKind::LoadBalancer => 1,
        }
    }
}

/// Computes what the datapath should hold. Pure: same input, same output. The agent keeps an
/// [`Incremental`] instead and feeds it only what changed; this is the same code fed everything
/// (the tests' reference).
#[cfg(test)]
pub fn compute(cluster: &ClusterState, config: &NodeConfig) -> DesiredState {
    let mut state = Incremental::default();
    state.update(cluster, config, &Changes::All);
    state.into_state()
}

/// What this node is, as the computation needs it.
struct ThisNode<'a> {
    name: &'a str,
    zone: Option<&'a str>,
    /// Every interface address: decides the families this node has, and which addresses a
    /// Service may never take as an external or LoadBalancer IP.
    addresses: &'a [IpAddr],
    /// The subset that gets NodePorts.
    nodeport_addresses: Vec<IpAddr>,
}

impl ThisNode<'_> {
    /// Whether the node has an address of `family`. With no address known at all (none could be
    /// read, or a namespace without any) no family is skipped: dropping every Service for want
    /// of an address would be worse than programming a family the node may not use.
    fn has_family(&self, family: Family) -> bool {
        self.addresses.is_empty() || self.addresses.iter().any(|a| Family::of(*a) == family)
    }
}

/// kube-proxy `NodePortAddresses.GetNodeIPs` (pkg/proxy/util/nodeport_addresses.go): the
/// interface addresses inside the configured CIDRs, per family — a family without a CIDR in the
/// list keeps all its addresses (`NewNodePortAddresses` matches all when it has none of its
/// family); `primary` is turned into the node IPs' /32 and /128 first (cmd/kube-proxy/app/server.go).
fn nodeport_addresses(config: &NodeConfig, node: Option<&Node>) -> Vec<IpAddr> {
    let on_interfaces = |wanted: &dyn Fn(IpAddr) -> bool| -> Vec<IpAddr> {
        let mut addrs: Vec<IpAddr> = config.interface_addresses.iter().copied().filter(|a| wanted(*a)).collect();
        addrs.sort();
        addrs.dedup();
        addrs
    };
    match &config.nodeport_addresses {
        NodePortAddresses::All => on_interfaces(&|_| true),
        NodePortAddresses::Cidrs(cidrs) => on_interfaces(&|a| {
            let mut of_family = cidrs.iter().filter(|c| c.addr().is_ipv6() == a.is_ipv6()).peekable();
            of_family.peek().is_none() || of_family.any(|c| c.contains(&a))
        }),
        NodePortAddresses::Primary => {
            let primary = primary_node_ips(node);
            on_interfaces(&|a| primary.contains(&a))
        }
    }
}

/// `GetNodeHostIPs`: InternalIPs before ExternalIPs; the first address, plus the first of the
/// other family.
fn primary_node_ips(node: Option<&Node>) -> Vec<IpAddr> {
    let addresses = node.and_then(|n| n.status.as_ref()).and_then(|s| s.addresses.as_ref());
    let of_type = |kind: &'static str| {
        addresses.into_iter().flatten().filter(move |a| a.type_ == kind).filter_map(|a| parse_ip_sloppy(&a.address))
    };
    let mut all = of_type("InternalIP").chain(of_type("ExternalIP"));
    let Some(first) = all.next() else { return Vec::new() };
    let mut ips = vec![first];
    ips.extend(all.find(|ip| Family::of(*ip) != Family::of(first)));
    ips
}

/// Appends the frontend candidates of one Service; problems are pushed as reasons.
fn service_candidates(
    service: &ServiceInfo,
    endpoints: Option<&ServiceEndpoints>,
    node: &ThisNode<'_>,
    candidates: &mut Vec<Candidate>,
    problems: &mut Vec<RejectReason>,
) {
    if service.is_ignored() {
        return;
    }
    let (namespace, name) = service.object_name();

    let mut families = Vec::new();
    for text in &service.cluster_ips {
        match parse_ip_sloppy(text) {
            Some(ip) if special_address(ip).is_some() => {
                let class = special_address(ip).unwrap_or_default();
                let field = AddressField::Frontend(FrontendKind::ClusterIp);
                problems.push(RejectReason::InvalidAddress(InvalidAddress::Special { field, addr: ip, class }));
                return;
            }
            Some(ip) if node.has_family(Family::of(ip)) => families.push((Family::of(ip), ip)),
            Some(ip) => problems.push(RejectReason::UnsupportedFamily {
                kind: FrontendKind::ClusterIp,
                addr: ip,
                missing_on: FamilyMissingOn::Node,
            }),
            None => {
                let field = AddressField::Frontend(FrontendKind::ClusterIp);
                problems.push(RejectReason::InvalidAddress(InvalidAddress::Unparsable { field, text: text.to_owned() }));
                return;
            }
        }
    }

    let external_ips = external_addresses(
        service.external_ips.iter().map(String::as_str),
        FrontendKind::ExternalIp,
        &families,
        node,
        problems,
    );
    let lb_ips = external_addresses(
        service.load_balancer_ips.iter().map(String::as_str),
        FrontendKind::LoadBalancer,
        &families,
        node,
        problems,
    );

    let affinity_timeout = affinity_timeout(service.client_ip_affinity, problems);
    let (internal_local, external_local) = (service.internal_local, service.external_local);
    let node_view = NodeView { node_name: node.name, zone: node.zone };

    for port in &service.ports {
        let (port_key, frontend_port) = match service_port(port) {
            Ok(resolved) => resolved,
            Err(reason) => {
                problems.push(reason);
                continue;
            }
        };
        let node_port = match node_port(service.type_, port) {
            Ok(node_port) => node_port,
            Err(reason) => {
                problems.push(reason);
                None
            }
        };
        let service_port_name = ServicePortName { namespace: namespace.clone(), name: name.clone(), port: port_key.0.clone() };
        let port_endpoints = endpoints.and_then(|eps| eps.get(&port_key));
        for (family, cluster_ip) in &families {
            let Categorized { cluster, local } = categorize(
                port_endpoints.into_iter().flat_map(|eps| eps.values()).filter(|e| Family::of(e.addr) == *family),
                port_key.1,
                &node_view,
            );
            let internal_set = if internal_local { (local.clone(), true) } else { (cluster.clone(), false) };
            // Traffic from pods and from the node itself to an external frontend goes to every
            // endpoint even with `externalTrafficPolicy: Local`: kube-proxy's iptables proxier
            // sends it to the cluster chain ("pod traffic for ... external destinations" and
            // "route LOCAL traffic for ... external destinations" rules, pkg/proxy/iptables/proxier.go),
            // as does nftables. Only traffic from outside the node is held to local endpoints.
            let external_set = if external_local { (local, true) } else { (cluster.clone(), false) };
            let mut add = |addr: IpAddr, port: u16, kind: FrontendKind| {
                let (internal, external) = match kind {
                    FrontendKind::ClusterIp => (internal_set.clone(), internal_set.clone()),
                    _ => ((cluster.clone(), false), external_set.clone()),
                };
                candidates.push(Candidate {
                    addr,
                    port,
                    proto: port_key.1,
                    kind,
                    service: service_port_name.clone(),
                    affinity_timeout,
                    internal,
                    external,
                });
            };
            add(*cluster_ip, frontend_port, FrontendKind::ClusterIp);
            if let Some(node_port) = node_port {
                for addr in node.nodeport_addresses.iter().filter(|a| Family::of(**a) == *family) {
                    add(*addr, node_port, FrontendKind::NodePort);
                }
            }
            for (addr, kind) in external_ips.iter().chain(&lb_ips).filter(|(a, _)| Family::of(*a) == *family) {
                add(*addr, frontend_port, *kind);
            }
        }
    }
}

/// Parses external or LoadBalancer IPs; drops (and reports) invalid ones, ones of a family the
/// Service does not serve here, and node addresses (never taken over by a Service).
fn external_addresses<'a>(
    texts: impl Iterator<Item = &'a str>,
    kind: FrontendKind,
    families: &[(Family, IpAddr)],
    node: &ThisNode<'_>,
    problems: &mut Vec<RejectReason>,
) -> Vec<(IpAddr, FrontendKind)> {
    let mut addrs = Vec::new();
    let field = AddressField::Frontend(kind);
    for text in texts {
        let Some(addr) = parse_ip_sloppy(text) else {
            problems.push(RejectReason::InvalidAddress(InvalidAddress::Unparsable { field, text: text.to_owned() }));
            continue;
        };
        let family = Family::of(addr);
        if let Some(class) = special_address(addr) {
            problems.push(RejectReason::InvalidAddress(InvalidAddress::Special { field, addr, class }));
        } else if node.addresses.contains(&addr) {
            problems.push(RejectReason::Conflict(Conflict::NodeAddress { kind, addr }));
        } else if !node.has_family(family) {
            problems.push(RejectReason::UnsupportedFamily { kind, addr, missing_on: FamilyMissingOn::Node });
        } else if !families.iter().any(|(f, _)| *f == family) {
            problems.push(RejectReason::UnsupportedFamily { kind, addr, missing_on: FamilyMissingOn::Service });
        } else if !addrs.contains(&(addr, kind)) {
            addrs.push((addr, kind));
        }
    }
    addrs
}

fn service_port(port: &PortInfo) -> Result<(PortKey, u16), RejectReason> {
    let proto = Proto::from_k8s(port.protocol.as_deref())?;
    let number = u16::try_from(port.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(RejectReason::InvalidPort(InvalidPort::Port { port: port.port }))?;
    Ok(((port.name.clone(), proto), number))
}

/// The port's NodePort, if it has one. kube-proxy programs any non-zero `nodePort`; a NodePort
/// Service without one (only possible outside the API server, which allocates it) is reported.
fn node_port(service_type: ServiceType, port: &PortInfo) -> Result<Option<u16>, RejectReason> {
    let port_name = port.name.clone();
    match port.node_port {
        0 if service_type == ServiceType::NodePort => Err(RejectReason::InvalidPort(InvalidPort::MissingNodePort { port_name })),
        0 => Ok(None),
        number => u16::try_from(number)
            .map(Some)
            .map_err(|_| RejectReason::InvalidPort(InvalidPort::NodePort { port_name, node_port: number })),
    }
}

/// `sessionAffinity: ClientIP`: the timeout in seconds (the API allows 1..=86400, default 10800).
fn affinity_timeout(client_ip_affinity: Option<Option<i32>>, problems: &mut Vec<RejectReason>) -> Option<u32> {
    match client_ip_affinity? {
        None => Some(DEFAULT_AFFINITY_TIMEOUT),
        Some(seconds) => match u32::try_from(seconds).ok().filter(|s| (1..=MAX_AFFINITY_TIMEOUT).contains(s)) {
            Some(seconds) => Some(seconds),
            None => {
                problems.push(RejectReason::InvalidSessionAffinity { timeout_seconds: seconds });
                Some(DEFAULT_AFFINITY_TIMEOUT)
            }
        },
    }
}
