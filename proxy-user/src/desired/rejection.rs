//! Why an object (or part of one) was not programmed, as data: which object, and a reason whose
//! variant is its class. The log shows the `Display` text; `/metrics` counts by
//! [`RejectedObject::kind_label`] and [`RejectReason::class`], so the label set stays bounded
//! without reading the text back.
//!
//! The texts are part of the agent's interface (operators grep logs for them, tests assert on
//! them): a variant's `Display` must keep its wording.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use super::{Family, Frontend, FrontendKind, ServicePortName, DEFAULT_AFFINITY_TIMEOUT, LABEL_SERVICE_NAME, MAX_AFFINITY_TIMEOUT};

/// An object (or part of one) that was not programmed, and why. Reported once per change. A
/// rejection tied to one frontend (a collision) names it in its reason,
/// [`Conflict::FrontendTaken`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rejection {
    pub object: RejectedObject,
    pub reason: RejectReason,
}

impl Rejection {
    pub fn new(object: RejectedObject, reason: RejectReason) -> Self {
        Self { object, reason }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

/// The kinds of API object the agent reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    Node,
}

impl ObjectKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
        }
    }
}

/// What was rejected.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RejectedObject {
    /// An API object: `Service ns/name`, `EndpointSlice ns/name`.
    Object { kind: ObjectKind, namespace: String, name: String },
    /// A manifest document (file source) that did not become an object: `FILE document N`,
    /// `item M` for each level of `List` nesting, and the kind it declared when it declared one
    /// the agent reads.
    Document { path: PathBuf, document: usize, items: Vec<usize>, kind: Option<ObjectKind> },
}

impl RejectedObject {
    pub fn service(namespace: &str, name: &str) -> Self {
        Self::Object { kind: ObjectKind::Service, namespace: namespace.to_owned(), name: name.to_owned() }
    }

    pub fn endpoint_slice(namespace: &str, name: &str) -> Self {
        Self::Object { kind: ObjectKind::EndpointSlice, namespace: namespace.to_owned(), name: name.to_owned() }
    }

    /// The `kind` label of `ebpf_proxy_rejected_objects_total`: the object's kind, or
    /// `unknown` for a document that named none the agent reads.
    pub fn kind_label(&self) -> &'static str {
        match self {
            Self::Object { kind, .. } | Self::Document { kind: Some(kind), .. } => kind.name(),
            Self::Document { kind: None, .. } => "unknown",
        }
    }
}

impl fmt::Display for RejectedObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Object { kind, namespace, name } => write!(f, "{} {namespace}/{name}", kind.name()),
            Self::Document { path, document, items, kind } => {
                write!(f, "{} document {document}", path.display())?;
                for item in items {
                    write!(f, " item {item}")?;
                }
                if let Some(kind) = kind {
                    write!(f, " ({})", kind.name())?;
                }
                Ok(())
            }
        }
    }
}

/// Why something was rejected; one variant per class (the `reason` label of
/// `ebpf_proxy_rejected_objects_total`), the details in its fields.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RejectReason {
    /// The address is taken: by another Service, or by this node.
    Conflict(Conflict),
    /// An address of a family this node or the Service does not serve.
    UnsupportedFamily { kind: FrontendKind, addr: IpAddr, missing_on: FamilyMissingOn },
    /// A protocol other than TCP and UDP (SCTP).
    UnsupportedProtocol { protocol: String },
    /// An EndpointSlice `addressType` other than IPv4, IPv6 and FQDN.
    UnsupportedAddressType { address_type: String },
    /// `sessionAffinityConfig.clientIP.timeoutSeconds` outside what the API allows; the default
    /// is used instead.
    InvalidSessionAffinity { timeout_seconds: i32 },
    InvalidPort(InvalidPort),
    InvalidAddress(InvalidAddress),
    /// An EndpointSlice without the label naming its Service.
    MissingServiceLabel,
    /// An EndpointSlice whose Service does not exist.
    MissingService { namespace: String, name: String },
    /// A manifest document that is not a readable object; `detail` is the parser's message.
    Malformed(Malformed),
}

impl RejectReason {
    /// The `reason` label: bounded, one value per variant.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Conflict(_) => "conflict",
            Self::UnsupportedFamily { .. } => "unsupported_family",
            Self::UnsupportedProtocol { .. } => "unsupported_protocol",
            Self::UnsupportedAddressType { .. } => "unsupported_address_type",
            Self::InvalidSessionAffinity { .. } => "invalid_session_affinity",
            Self::InvalidPort(_) => "invalid_port",
            Self::InvalidAddress(_) => "invalid_address",
            Self::MissingServiceLabel => "missing_service_label",
            Self::MissingService { .. } => "missing_service",
            Self::Malformed(_) => "malformed",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Conflict(conflict) => conflict.fmt(f),
            Self::UnsupportedFamily { kind, addr, missing_on } => {
                let family = Family::of(*addr).name();
                match missing_on {
                    FamilyMissingOn::Node => write!(f, "{} {addr} skipped: this node has no address of family {family}", kind.name()),
                    FamilyMissingOn::Service => {
                        write!(f, "{} {addr} skipped: the Service has no clusterIP of family {family}", kind.name())
                    }
                }
            }
            Self::UnsupportedProtocol { protocol } => write!(f, "protocol {protocol} is not supported"),
            Self::UnsupportedAddressType { address_type } => write!(f, "unsupported addressType {address_type:?}"),
            Self::InvalidSessionAffinity { timeout_seconds } => write!(
                f,
                "sessionAffinityConfig.clientIP.timeoutSeconds {timeout_seconds} is outside 1..={MAX_AFFINITY_TIMEOUT}; using {DEFAULT_AFFINITY_TIMEOUT}"
            ),
            Self::InvalidPort(port) => port.fmt(f),
            Self::InvalidAddress(address) => address.fmt(f),
            Self::MissingServiceLabel => write!(f, "no {LABEL_SERVICE_NAME} label"),
            Self::MissingService { namespace, name } => write!(f, "its Service {namespace}/{name} does not exist"),
            Self::Malformed(malformed) => malformed.fmt(f),
        }
    }
}

/// Where an address's family is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FamilyMissingOn {
    /// The node has no interface address of the family.
    Node,
    /// The Service has no clusterIP of the family (an external or LoadBalancer IP).
    Service,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Conflict {
    /// Another Service's frontend holds the address, port and protocol.
    FrontendTaken { kind: FrontendKind, frontend: Frontend, port_name: String, owner: ServicePortName, owner_kind: FrontendKind },
    /// An external or LoadBalancer IP that is one of this node's addresses.
    NodeAddress { kind: FrontendKind, addr: IpAddr },
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FrontendTaken { kind, frontend, port_name, owner, owner_kind } => write!(
                f,
                "{} {frontend} of port {port_name:?} is already used by Service {owner} as its {}",
                kind.name(),
                owner_kind.name()
            ),
            Self::NodeAddress { kind, addr } => write!(
                f,
                "{} {addr} would hijack an address of this node; node addresses are never given to a Service",
                kind.name()
            ),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum InvalidPort {
    /// A Service or EndpointSlice port outside 1..=65535.
    Port { port: i32 },
    /// A NodePort Service port without a nodePort (only possible outside the API server).
    MissingNodePort { port_name: String },
    /// A nodePort outside 1..=65535.
    NodePort { port_name: String, node_port: i32 },
}

impl fmt::Display for InvalidPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Port { port } => write!(f, "invalid port {port}"),
            Self::MissingNodePort { port_name } => write!(f, "port {port_name:?}: invalid nodePort 0 for type NodePort"),
            Self::NodePort { port_name, node_port } => write!(f, "port {port_name:?}: invalid nodePort {node_port}"),
        }
    }
}

/// Which field an address came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddressField {
    /// A frontend address: clusterIP, externalIP or LoadBalancer ingress IP.
    Frontend(FrontendKind),
    /// An endpoint of an EndpointSlice of this `addressType`.
    Endpoint(Family),
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum InvalidAddress {
    /// Not an address (of the slice's family, for an endpoint).
    Unparsable { field: AddressField, text: String },
    /// A loopback, link-local, unspecified, multicast or broadcast address (`class`), which
    /// the API server's validation refuses or never allocates.
    Special { field: AddressField, addr: IpAddr, class: &'static str },
}

impl fmt::Display for InvalidAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unparsable { field: AddressField::Frontend(kind), text } => write!(f, "invalid {} {text:?}", kind.name()),
            Self::Unparsable { field: AddressField::Endpoint(family), text } => {
                write!(f, "invalid {} endpoint address {text:?}", family.name())
            }
            Self::Special { field: AddressField::Frontend(FrontendKind::ClusterIp), addr, class } => {
                write!(f, "clusterIP {addr} is a {class} address, which the API server never allocates")
            }
            Self::Special { field: AddressField::Frontend(kind), addr, class } => {
                write!(f, "{} {addr} is a {class} address, which the API server's validation refuses", kind.name())
            }
            Self::Special { field: AddressField::Endpoint(_), addr, class } => {
                write!(f, "endpoint address {addr} is a {class} address, which the API server's validation refuses")
            }
        }
    }
}

/// A manifest document the file source could not read; `detail` is the YAML or serde message.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Malformed {
    /// Not YAML at all (the rest of the file cannot be read either).
    Yaml { detail: String },
    /// YAML without a usable `apiVersion`/`kind`.
    NotAnObject { detail: String },
    /// A Service, EndpointSlice or Node whose fields do not match the API's types.
    Fields { detail: String },
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Yaml { detail } => write!(f, "not valid YAML: {detail}"),
            Self::NotAnObject { detail } => write!(f, "not a Kubernetes object: {detail}"),
            Self::Fields { detail } => f.write_str(detail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each class as `desired` and the file source word it: the text stays what it was when it
    /// was free text, and the labels come from the type.
    #[test]
    fn every_reason_keeps_its_text_and_has_a_bounded_kind_and_class() {
        let service = RejectedObject::service("demo", "a");
        let slice = RejectedObject::endpoint_slice("demo", "s");
        let document = |items: Vec<usize>, kind| RejectedObject::Document { path: "m.yaml".into(), document: 3, items, kind };
        let ip = |text: &str| text.parse::<IpAddr>().expect("address");
        let web = ServicePortName { namespace: "demo".into(), name: "web".into(), port: "http".into() };
        let frontend = Frontend { addr: ip("10.96.0.10"), port: 80, proto: super::super::Proto::Tcp, scope: super::super::Scope::Internal };
        let cases = [
            (
                service.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Unparsable { field: AddressField::Frontend(FrontendKind::ClusterIp), text: "10.96.0.300".into() }),
                "Service demo/a: invalid clusterIP \"10.96.0.300\"",
                "Service",
                "invalid_address",
            ),
            (
                service.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Unparsable { field: AddressField::Frontend(FrontendKind::LoadBalancer), text: "not-an-ip".into() }),
                "Service demo/a: invalid loadBalancer IP \"not-an-ip\"",
                "Service",
                "invalid_address",
            ),
            (
                service.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Special { field: AddressField::Frontend(FrontendKind::ClusterIp), addr: ip("127.0.0.1"), class: "loopback" }),
                "Service demo/a: clusterIP 127.0.0.1 is a loopback address, which the API server never allocates",
                "Service",
                "invalid_address",
            ),
            (
                service.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Special { field: AddressField::Frontend(FrontendKind::ExternalIp), addr: ip("127.0.0.1"), class: "loopback" }),
                "Service demo/a: externalIP 127.0.0.1 is a loopback address, which the API server's validation refuses",
                "Service",
                "invalid_address",
            ),
            (
                service.clone(),
                RejectReason::Conflict(Conflict::FrontendTaken { kind: FrontendKind::ExternalIp, frontend, port_name: "http".into(), owner: web, owner_kind: FrontendKind::ClusterIp }),
                "Service demo/a: externalIP 10.96.0.10:80/TCP of port \"http\" is already used by Service demo/web:http as its clusterIP",
                "Service",
                "conflict",
            ),
            (
                service.clone(),
                RejectReason::Conflict(Conflict::NodeAddress { kind: FrontendKind::ExternalIp, addr: ip("10.244.1.1") }),
                "Service demo/a: externalIP 10.244.1.1 would hijack an address of this node; node addresses are never given to a Service",
                "Service",
                "conflict",
            ),
            (
                service.clone(),
                RejectReason::UnsupportedFamily { kind: FrontendKind::ClusterIp, addr: ip("fd00::10"), missing_on: FamilyMissingOn::Node },
                "Service demo/a: clusterIP fd00::10 skipped: this node has no address of family IPv6",
                "Service",
                "unsupported_family",
            ),
            (
                service.clone(),
                RejectReason::UnsupportedFamily { kind: FrontendKind::LoadBalancer, addr: ip("fd00::10"), missing_on: FamilyMissingOn::Service },
                "Service demo/a: loadBalancer IP fd00::10 skipped: the Service has no clusterIP of family IPv6",
                "Service",
                "unsupported_family",
            ),
            (service.clone(), RejectReason::UnsupportedProtocol { protocol: "SCTP".into() }, "Service demo/a: protocol SCTP is not supported", "Service", "unsupported_protocol"),
            (service.clone(), RejectReason::InvalidPort(InvalidPort::Port { port: 70000 }), "Service demo/a: invalid port 70000", "Service", "invalid_port"),
            (
                service.clone(),
                RejectReason::InvalidPort(InvalidPort::MissingNodePort { port_name: "zero".into() }),
                "Service demo/a: port \"zero\": invalid nodePort 0 for type NodePort",
                "Service",
                "invalid_port",
            ),
            (
                service.clone(),
                RejectReason::InvalidPort(InvalidPort::NodePort { port_name: "big".into(), node_port: 70000 }),
                "Service demo/a: port \"big\": invalid nodePort 70000",
                "Service",
                "invalid_port",
            ),
            (
                service,
                RejectReason::InvalidSessionAffinity { timeout_seconds: 0 },
                "Service demo/a: sessionAffinityConfig.clientIP.timeoutSeconds 0 is outside 1..=86400; using 10800",
                "Service",
                "invalid_session_affinity",
            ),
            (slice.clone(), RejectReason::MissingServiceLabel, "EndpointSlice demo/s: no kubernetes.io/service-name label", "EndpointSlice", "missing_service_label"),
            (
                slice.clone(),
                RejectReason::MissingService { namespace: "demo".into(), name: "ghost".into() },
                "EndpointSlice demo/s: its Service demo/ghost does not exist",
                "EndpointSlice",
                "missing_service",
            ),
            (
                slice.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Unparsable { field: AddressField::Endpoint(Family::V6), text: "x".into() }),
                "EndpointSlice demo/s: invalid IPv6 endpoint address \"x\"",
                "EndpointSlice",
                "invalid_address",
            ),
            (
                slice.clone(),
                RejectReason::InvalidAddress(InvalidAddress::Special { field: AddressField::Endpoint(Family::V4), addr: ip("224.0.0.1"), class: "multicast" }),
                "EndpointSlice demo/s: endpoint address 224.0.0.1 is a multicast address, which the API server's validation refuses",
                "EndpointSlice",
                "invalid_address",
            ),
            (
                slice,
                RejectReason::UnsupportedAddressType { address_type: "IPv5".into() },
                "EndpointSlice demo/s: unsupported addressType \"IPv5\"",
                "EndpointSlice",
                "unsupported_address_type",
            ),
            (
                document(vec![], Some(ObjectKind::Service)),
                RejectReason::Malformed(Malformed::Fields { detail: "invalid type: string \"x\", expected a sequence".into() }),
                "m.yaml document 3 (Service): invalid type: string \"x\", expected a sequence",
                "Service",
                "malformed",
            ),
            (
                document(vec![2, 1], Some(ObjectKind::EndpointSlice)),
                RejectReason::Malformed(Malformed::Fields { detail: "missing field `addressType`".into() }),
                "m.yaml document 3 item 2 item 1 (EndpointSlice): missing field `addressType`",
                "EndpointSlice",
                "malformed",
            ),
            (
                document(vec![], None),
                RejectReason::Malformed(Malformed::Yaml { detail: "mapping values are not allowed".into() }),
                "m.yaml document 3: not valid YAML: mapping values are not allowed",
                "unknown",
                "malformed",
            ),
        ];
        for (object, reason, text, kind, class) in cases {
            let rejection = Rejection::new(object, reason);
            assert_eq!(rejection.to_string(), text);
            assert_eq!((rejection.object.kind_label(), rejection.reason.class()), (kind, class), "{text}");
        }
    }
}
