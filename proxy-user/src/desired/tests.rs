//! The Service semantics as a table: each case is a description, the cluster objects (as
//! manifests), the node, and what must come out: frontend entries with their kind, flags and
//! backends, frontends that must not exist, and every rejection (each one expected, none extra).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::*;

const NODE: &str = "node-1";
/// The node's interface addresses unless a case says otherwise: IPv4 only.
const NODE_ADDRESSES: &[&str] = &["10.244.1.1", "192.168.0.10"];

#[derive(Clone, Copy, Debug)]
enum Scopes {
    Both,
    Internal,
    External,
}

struct Case {
    description: &'static str,
    objects: String,
    addresses: Vec<IpAddr>,
    nodeport_addresses: NodePortAddresses,
    /// (frontend `ip:port/PROTO`, scopes, `KIND [local-only] [affinity=N] -> backends`).
    frontends: Vec<(String, Scopes, String)>,
    absent: Vec<String>,
    /// Each a fragment of exactly one rejection (`Service demo/x: reason`).
    rejections: Vec<String>,
    check: Option<fn(&DesiredState)>,
}

fn case(description: &'static str, objects: impl IntoIterator<Item = String>) -> Case {
    Case {
        description,
        objects: objects.into_iter().collect(),
        addresses: NODE_ADDRESSES.iter().map(|a| a.parse().unwrap()).collect(),
        nodeport_addresses: NodePortAddresses::All,
        frontends: Vec::new(),
        absent: Vec::new(),
        rejections: Vec::new(),
        check: None,
    }
}

impl Case {
    fn expect(mut self, frontend: &str, scopes: Scopes, description: &str) -> Self {
        self.frontends.push((frontend.to_owned(), scopes, description.to_owned()));
        self
    }
    fn absent(mut self, frontend: &str) -> Self {
        self.absent.push(frontend.to_owned());
        self
    }
    fn rejects(mut self, fragment: &str) -> Self {
        self.rejections.push(fragment.to_owned());
        self
    }
    fn node_addresses(mut self, addresses: &[&str]) -> Self {
        self.addresses = addresses.iter().map(|a| a.parse().unwrap()).collect();
        self
    }
    fn nodeport_addresses(mut self, flag: &str) -> Self {
        self.nodeport_addresses = NodePortAddresses::parse(flag).expect("valid flag");
        self
    }
    fn check(mut self, check: fn(&DesiredState)) -> Self {
        self.check = Some(check);
        self
    }
}

fn service(name: &str, spec: &str) -> String {
    format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec: {spec}\n")
}

fn service_with_status(name: &str, spec: &str, status: &str) -> String {
    format!("{}status: {status}\n", service(name, spec))
}

/// An EndpointSlice of Service `service` (no label when empty) with the `http` TCP port 8080.
fn slice(name: &str, service: &str, address_type: &str, endpoints: &str) -> String {
    slice_with_ports(name, service, address_type, endpoints, "[{name: http, port: 8080, protocol: TCP}]")
}

fn slice_with_ports(name: &str, service: &str, address_type: &str, endpoints: &str, ports: &str) -> String {
    let labels = if service.is_empty() { String::new() } else { format!(", labels: {{kubernetes.io/service-name: {service}}}") };
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: demo{labels}}}\naddressType: {address_type}\nendpoints: {endpoints}\nports: {ports}\n"
    )
}

fn node(labels: &str, addresses: &str) -> String {
    format!("---\napiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}, labels: {labels}}}\nstatus: {{addresses: {addresses}}}\n")
}

const HTTP: &str = "ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]";

fn web(extra: &str) -> String {
    service("web", &format!("{{clusterIP: 10.96.0.10, {HTTP}{extra}}}"))
}

/// Two ready endpoints, one on this node (.2) and one on another (.3).
fn web_slice() -> String {
    slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1}, {addresses: [10.244.2.3], nodeName: node-2}]")
}

fn parse_frontend(text: &str, scope: Scope) -> Frontend {
    let (socket, proto) = text.rsplit_once('/').expect("ip:port/PROTO");
    let socket: SocketAddr = socket.parse().expect("socket address");
    let proto = match proto {
        "TCP" => Proto::Tcp,
        "UDP" => Proto::Udp,
        other => panic!("protocol {other}"),
    };
    Frontend { addr: socket.ip(), port: socket.port(), proto, scope }
}

fn describe(spec: &FrontendSpec) -> String {
    let mut text = match spec.kind {
        FrontendKind::ClusterIp => "ClusterIP",
        FrontendKind::NodePort => "NodePort",
        FrontendKind::ExternalIp => "ExternalIP",
        FrontendKind::LoadBalancer => "LoadBalancer",
    }
    .to_owned();
    if spec.local_only {
        text.push_str(" local-only");
    }
    if let Some(timeout) = spec.affinity_timeout {
        let _ = write!(text, " affinity={timeout}");
    }
    let backends: Vec<String> = spec
        .backends
        .iter()
        .map(|b| {
            let socket = SocketAddr::new(b.addr.addr, b.addr.port);
            if b.local { format!("{socket} local") } else { socket.to_string() }
        })
        .collect();
    let backends = if backends.is_empty() { "none".to_owned() } else { backends.join(", ") };
    format!("{text} -> {backends}")
}

fn run(case: &Case) -> DesiredState {
    let manifests = BTreeMap::from([(PathBuf::from("case.yaml"), case.objects.clone().into_bytes())]);
    let (cluster, unreadable) = crate::source::file::parse_manifests(&manifests);
    assert!(unreadable.is_empty(), "{}: the case's manifests do not parse: {unreadable:?}", case.description);
    let config = NodeConfig {
        node_name: NODE.to_owned(),
        interface_addresses: case.addresses.clone(),
        nodeport_addresses: case.nodeport_addresses.clone(),
    };
    let state = compute(&cluster, &config);
    assert_eq!(compute(&cluster, &config), state, "{}: not deterministic", case.description);
    state
}

fn verify(case: &Case) -> Result<(), String> {
    let state = run(case);
    let mut problems = Vec::new();
    for (text, scopes, expected) in &case.frontends {
        let scopes: &[Scope] = match scopes {
            Scopes::Both => &[Scope::Internal, Scope::External],
            Scopes::Internal => &[Scope::Internal],
            Scopes::External => &[Scope::External],
        };
        for scope in scopes {
            match state.frontends.get(&parse_frontend(text, *scope)) {
                Some(spec) if describe(spec) == *expected => {}
                Some(spec) => problems.push(format!("{text} {scope:?}: {:?}, expected {expected:?}", describe(spec))),
                None => problems.push(format!("{text} {scope:?}: missing, expected {expected:?}")),
            }
        }
    }
    for text in &case.absent {
        for scope in [Scope::Internal, Scope::External] {
            if let Some(spec) = state.frontends.get(&parse_frontend(text, scope)) {
                problems.push(format!("{text} {scope:?} must not exist: {}", describe(spec)));
            }
        }
    }
    let rejections: Vec<String> = state.rejections.iter().map(ToString::to_string).collect();
    for rejection in &rejections {
        let matching = case.rejections.iter().filter(|fragment| rejection.contains(fragment.as_str())).count();
        if matching != 1 {
            problems.push(format!("rejection {rejection:?} matches {matching} expected fragments"));
        }
    }
    for fragment in &case.rejections {
        if !rejections.iter().any(|r| r.contains(fragment.as_str())) {
            problems.push(format!("no rejection contains {fragment:?}"));
        }
    }
    if let Some(check) = case.check {
        if let Err(panic) = std::panic::catch_unwind(|| check(&state)) {
            problems.push(format!("check failed: {:?}", panic.downcast_ref::<String>()));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("{}:\n  {}", case.description, problems.join("\n  ")))
    }
}

fn cases() -> Vec<Case> {
    use Scopes::{Both, External, Internal};
    let hundred_ports: String = (1..=100).map(|p| format!("{{name: p{p}, port: {p}, protocol: TCP}}")).collect::<Vec<_>>().join(", ");
    let hundred_slice_ports: String =
        (1..=100).map(|p| format!("{{name: p{p}, port: {}, protocol: TCP}}", 8000 + p)).collect::<Vec<_>>().join(", ");
    let thousand_endpoints: String = (0..1000)
        .map(|i| format!("{{addresses: [10.245.{}.{}]}}", i / 250, i % 250 + 1))
        .collect::<Vec<_>>()
        .join(", ");
    vec![
        // --- ClusterIP basics ---
        case("targetPort by name resolves through the slice's port names; nil conditions are ready", [
            service("web", "{clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: web, protocol: TCP}, {name: metrics, port: 9090, protocol: TCP}]}"),
            slice_with_ports("web-a", "web", "IPv4", "[{addresses: [10.244.1.2]}, {addresses: [10.244.1.3], conditions: {}}]",
                "[{name: http, port: 8080, protocol: TCP}, {name: metrics, port: 9090, protocol: TCP}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080, 10.244.1.3:8080")
        .expect("10.96.0.10:9090/TCP", Both, "ClusterIP -> 10.244.1.2:9090, 10.244.1.3:9090"),
        case("several slices merge; a duplicate endpoint is ready if a ready copy exists", [
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2]}, {addresses: [10.244.1.4], conditions: {ready: false}}]"),
            slice("web-b", "web", "IPv4", "[{addresses: [10.244.2.7]}, {addresses: [10.244.1.4], conditions: {ready: true}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080, 10.244.1.4:8080, 10.244.2.7:8080"),
        case("a slice port no Service port names: the frontend exists and rejects", [
            web(""),
            slice_with_ports("web-a", "web", "IPv4", "[{addresses: [10.244.1.2]}]", "[{name: other, port: 8080, protocol: TCP}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> none"),
        case("not-ready endpoints are left out", [
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], conditions: {ready: false}}, {addresses: [10.244.1.3], conditions: {ready: true}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.3:8080"),
        case("no ready endpoint: serving-and-terminating ones are used, not-serving ones never", [
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.244.1.3], conditions: {ready: false, serving: false, terminating: true}}, {addresses: [10.244.1.4], conditions: {ready: false, terminating: true}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080, 10.244.1.4:8080"),
        case("a ready endpoint anywhere keeps terminating ones out", [
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.244.2.3]}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080"),
        case("headless, ExternalName (with a stale clusterIP) and labelled Services are ignored without complaint", [
            service("headless", "{clusterIP: None, ports: [{port: 80}]}"),
            service("ext", "{type: ExternalName, externalName: example.com, clusterIP: 10.96.0.20, ports: [{port: 80}]}"),
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: other, namespace: demo, labels: {service.kubernetes.io/service-proxy-name: foo}}\nspec: {clusterIP: 10.96.0.21, ports: [{port: 80}]}\n".to_owned(),
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: hl, namespace: demo, labels: {service.kubernetes.io/headless: \"\"}}\nspec: {clusterIP: 10.96.0.22, ports: [{port: 80}]}\n".to_owned(),
            slice("headless-a", "headless", "IPv4", "[{addresses: [10.244.1.2]}]"),
            slice("fqdn", "web", "FQDN", "[{addresses: [example.com]}]"),
            web(""),
        ])
        .absent("10.96.0.20:80/TCP")
        .absent("10.96.0.21:80/TCP")
        .absent("10.96.0.22:80/TCP")
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> none"),
        case("TCP and UDP on the same port are separate frontends", [
            service("dns", "{clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]}"),
            slice_with_ports("dns-a", "dns", "IPv4", "[{addresses: [10.244.1.5]}]", "[{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5354, protocol: TCP}]"),
        ])
        .expect("10.96.0.10:53/UDP", Both, "ClusterIP -> 10.244.1.5:5353")
        .expect("10.96.0.10:53/TCP", Both, "ClusterIP -> 10.244.1.5:5354"),
        // --- traffic policies and node-local endpoints ---
        case("backends on this node are flagged local; Cluster policies use every endpoint", [web(""), web_slice()])
            .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local, 10.244.2.3:8080"),
        case("internalTrafficPolicy Local: both ClusterIP entries hold only this node's endpoints", [
            web(", internalTrafficPolicy: Local"),
            web_slice(),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP local-only -> 10.244.1.2:8080 local"),
        case("internalTrafficPolicy Local without a local endpoint: empty and local-only (kube-proxy drops)", [
            web(", internalTrafficPolicy: Local"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], nodeName: node-2}, {addresses: [10.244.2.4]}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP local-only -> none"),
        case("terminating fallback per scope: local set falls back on its own while the cluster set has a ready endpoint", [
            web(", internalTrafficPolicy: Local"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1, conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.244.2.3], nodeName: node-2}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP local-only -> 10.244.1.2:8080 local"),
        case("externalTrafficPolicy Local: only outside traffic to external frontends is held to local endpoints", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, externalIPs: [10.96.100.1], ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("10.244.1.1:30080/TCP", Internal, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("10.244.1.1:30080/TCP", External, "NodePort local-only -> 10.244.1.2:8080 local")
        .expect("10.96.100.1:80/TCP", Internal, "ExternalIP -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("10.96.100.1:80/TCP", External, "ExternalIP local-only -> 10.244.1.2:8080 local"),
        case("externalTrafficPolicy Local: the local set uses a local terminating endpoint when no local one is ready", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1, conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.244.2.3], nodeName: node-2}]"),
        ])
        .expect("10.244.1.1:30080/TCP", Internal, "NodePort -> 10.244.2.3:8080")
        .expect("10.244.1.1:30080/TCP", External, "NodePort local-only -> 10.244.1.2:8080 local"),
        // --- NodePort, externalIPs, LoadBalancer ---
        case("NodePort on every node address, TCP and UDP with the same number", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}, {name: dns, port: 53, nodePort: 30080, protocol: UDP}]}"),
            slice_with_ports("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1}]", "[{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]"),
        ])
        .expect("10.244.1.1:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local")
        .expect("192.168.0.10:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local")
        .expect("10.244.1.1:30080/UDP", Both, "NodePort -> 10.244.1.2:5353 local")
        .expect("192.168.0.10:30080/UDP", Both, "NodePort -> 10.244.1.2:5353 local")
        .expect("10.96.0.10:53/UDP", Both, "ClusterIP -> 10.244.1.2:5353 local")
        .check(|state| assert_eq!(state.frontends.len(), 12, "2 ClusterIP + 4 NodePort, 2 scopes each")),
        case("--nodeport-addresses CIDRs: only node addresses inside them get NodePorts", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
        ])
        .nodeport_addresses("192.168.0.0/16, 172.16.0.0/12")
        .expect("192.168.0.10:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .absent("10.244.1.1:30080/TCP"),
        case("--nodeport-addresses with IPv4 CIDRs only keeps every IPv6 address's NodePorts (per family, as kube-proxy)", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, \"fd00::10\"], ipFamilies: [IPv4, IPv6], ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
            slice("web-v6", "web", "IPv6", "[{addresses: [\"fd00:10:244:1::2\"], nodeName: node-1}]"),
        ])
        .node_addresses(&["10.244.1.1", "192.168.0.10", "fd00:1::1", "fd00:2::1"])
        .nodeport_addresses("192.168.0.0/16")
        .expect("192.168.0.10:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("[fd00:1::1]:30080/TCP", Both, "NodePort -> [fd00:10:244:1::2]:8080 local")
        .expect("[fd00:2::1]:30080/TCP", Both, "NodePort -> [fd00:10:244:1::2]:8080 local")
        .absent("10.244.1.1:30080/TCP"),
        case("--nodeport-addresses with a CIDR of each family filters each family", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, \"fd00::10\"], ipFamilies: [IPv4, IPv6], ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
            slice("web-v6", "web", "IPv6", "[{addresses: [\"fd00:10:244:1::2\"], nodeName: node-1}]"),
        ])
        .node_addresses(&["10.244.1.1", "192.168.0.10", "fd00:1::1", "fd00:2::1"])
        .nodeport_addresses("192.168.0.0/16,fd00:2::/64")
        .expect("192.168.0.10:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("[fd00:2::1]:30080/TCP", Both, "NodePort -> [fd00:10:244:1::2]:8080 local")
        .absent("[fd00:1::1]:30080/TCP")
        .absent("10.244.1.1:30080/TCP"),
        case("--nodeport-addresses primary: the Node's first InternalIP, if it is on an interface", [
            node("{}", "[{type: Hostname, address: node-1}, {type: InternalIP, address: 192.168.0.10}, {type: InternalIP, address: 10.244.1.1}]"),
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
        ])
        .nodeport_addresses("primary")
        .expect("192.168.0.10:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .absent("10.244.1.1:30080/TCP"),
        case("a LoadBalancer without allocated NodePorts has none; its VIP-mode ingress IPs are frontends", [
            service_with_status("lb", "{type: LoadBalancer, clusterIP: 10.96.0.10, allocateLoadBalancerNodePorts: false, ports: [{name: http, port: 80, protocol: TCP}]}",
                "{loadBalancer: {ingress: [{ip: 10.96.200.1}, {ip: 10.96.200.2, ipMode: VIP}, {ip: 10.96.200.3, ipMode: Proxy}, {hostname: lb.example.com}]}}"),
            slice("lb-a", "lb", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1}]"),
        ])
        .expect("10.96.200.1:80/TCP", Both, "LoadBalancer -> 10.244.1.2:8080 local")
        .expect("10.96.200.2:80/TCP", Both, "LoadBalancer -> 10.244.1.2:8080 local")
        .absent("10.96.200.3:80/TCP")
        .check(|state| assert_eq!(state.frontends.len(), 6, "ClusterIP + 2 ingress IPs, no NodePort")),
        // --- session affinity ---
        case("sessionAffinity ClientIP: default timeout 10800 on every frontend of the Service", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, sessionAffinity: ClientIP, ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
        ])
        .nodeport_addresses("10.244.1.1/32")
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP affinity=10800 -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("10.244.1.1:30080/TCP", Both, "NodePort affinity=10800 -> 10.244.1.2:8080 local, 10.244.2.3:8080"),
        case("sessionAffinity ClientIP with a timeout; affinity None ignores a leftover config", [
            web(", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}"),
            service("other", "{clusterIP: 10.96.0.11, sessionAffinity: None, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}, ports: [{port: 80}]}"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP affinity=60 -> none")
        .expect("10.96.0.11:80/TCP", Both, "ClusterIP -> none"),
        case("an affinity timeout outside 1..=86400 is reported and the default used", [
            web(", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}"),
            service("long", "{clusterIP: 10.96.0.11, sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}, ports: [{port: 80}]}"),
            service("max", "{clusterIP: 10.96.0.12, sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86400}}, ports: [{port: 80}]}"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP affinity=10800 -> none")
        .expect("10.96.0.11:80/TCP", Both, "ClusterIP affinity=10800 -> none")
        .expect("10.96.0.12:80/TCP", Both, "ClusterIP affinity=86400 -> none")
        .rejects("Service demo/web: sessionAffinityConfig.clientIP.timeoutSeconds 0 is outside")
        .rejects("Service demo/long: sessionAffinityConfig.clientIP.timeoutSeconds 86401 is outside"),
        // --- topology ---
        case("zone hints: only endpoints hinted for this node's zone", [
            node("{topology.kubernetes.io/zone: zone-a}", "[]"),
            web(", trafficDistribution: PreferClose"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], nodeName: node-2, hints: {forZones: [{name: zone-a}]}}, {addresses: [10.244.3.4], nodeName: node-3, hints: {forZones: [{name: zone-b}]}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080"),
        case("zone hints: no endpoint for this zone -> all endpoints", [
            node("{topology.kubernetes.io/zone: zone-c}", "[]"),
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.244.3.4], hints: {forZones: [{name: zone-b}]}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080, 10.244.3.4:8080"),
        case("zone hints: one ready endpoint without hints -> all endpoints", [
            node("{topology.kubernetes.io/zone: zone-a}", "[]"),
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.244.3.4]}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080, 10.244.3.4:8080"),
        case("zone hints: a not-ready endpoint without hints does not disable them", [
            node("{topology.kubernetes.io/zone: zone-a}", "[]"),
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.244.3.4], hints: {forZones: [{name: zone-b}]}}, {addresses: [10.244.3.5], conditions: {ready: false}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080"),
        case("zone hints: the node has no zone label (or no Node object) -> all endpoints", [
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.244.3.4], hints: {forZones: [{name: zone-b}]}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080, 10.244.3.4:8080"),
        case("zone hints narrow the cluster set only; the terminating fallback ignores them", [
            node("{topology.kubernetes.io/zone: zone-a}", "[]"),
            web(""),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], conditions: {ready: false, serving: true, terminating: true}, hints: {forZones: [{name: zone-b}]}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080"),
        case("node hints (PreferSameNode) win over zone hints", [
            node("{topology.kubernetes.io/zone: zone-a}", "[]"),
            web(", trafficDistribution: PreferSameNode"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.1.2], nodeName: node-1, hints: {forNodes: [{name: node-1}], forZones: [{name: zone-a}]}}, {addresses: [10.244.2.3], nodeName: node-2, hints: {forNodes: [{name: node-2}], forZones: [{name: zone-a}]}}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local"),
        // --- dual stack ---
        case("dual stack on a dual-stack node: each family's frontends get that family's endpoints and node addresses", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, \"fd00::10\"], ipFamilies: [IPv4, IPv6], ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
            web_slice(),
            slice("web-v6", "web", "IPv6", "[{addresses: [\"fd00:10:244:1::2\"], nodeName: node-1}]"),
        ])
        .node_addresses(&["10.244.1.1", "fd00:1::1"])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("[fd00::10]:80/TCP", Both, "ClusterIP -> [fd00:10:244:1::2]:8080 local")
        .expect("10.244.1.1:30080/TCP", Both, "NodePort -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("[fd00:1::1]:30080/TCP", Both, "NodePort -> [fd00:10:244:1::2]:8080 local"),
        case("a family the node lacks is skipped and reported; the other family still programs", [
            service("web", "{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, \"fd00::10\"], ports: [{name: http, port: 80, protocol: TCP}]}"),
            service("v6only", "{clusterIP: \"fd00::11\", externalIPs: [\"fd00::99\"], ports: [{port: 80}]}"),
            web_slice(),
            slice("web-v6", "web", "IPv6", "[{addresses: [\"fd00:10:244:1::2\"]}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .absent("[fd00::10]:80/TCP")
        .absent("[fd00::11]:80/TCP")
        .rejects("Service demo/web: clusterIP fd00::10 skipped: this node has no address of family IPv6")
        .rejects("Service demo/v6only: clusterIP fd00::11 skipped: this node has no address of family IPv6")
        .rejects("Service demo/v6only: externalIP fd00::99 skipped: this node has no address of family IPv6"),
        case("no node address known: no family is skipped (and there is nothing for NodePorts)", [
            service("web", "{type: NodePort, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, \"fd00::10\"], ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]}"),
        ])
        .node_addresses(&[])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> none")
        .expect("[fd00::10]:80/TCP", Both, "ClusterIP -> none")
        .check(|state| assert_eq!(state.frontends.len(), 4)),
        // --- bad input ---
        case("a clusterIP with leading zeros is decimal (CVE-2021-29923), not octal and not rejected", [
            service("zeros", "{clusterIP: \"010.096.000.011\", ports: [{port: 80}]}"),
        ])
        .expect("10.96.0.11:80/TCP", Both, "ClusterIP -> none")
        .absent("8.78.0.9:80/TCP"),
        case("an invalid clusterIP rejects the Service; the others still program", [
            service("badip", "{clusterIP: \"10.96.0.300\", ports: [{port: 80}]}"),
            service("garbage", "{clusterIP: \" 10.96.0.12\", ports: [{port: 80}]}"),
            web(""),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> none")
        .rejects("Service demo/badip: invalid clusterIP \"10.96.0.300\"")
        .rejects("Service demo/garbage: invalid clusterIP \" 10.96.0.12\""),
        case("invalid externalIPs and ingress IPs are reported one by one; valid ones program", [
            service_with_status("web", "{type: LoadBalancer, clusterIP: 10.96.0.10, externalIPs: [10.96.100.1, \"10.96.100.\", \"1.2.3.4/32\"], ports: [{name: http, port: 80, protocol: TCP}]}",
                "{loadBalancer: {ingress: [{ip: \"not-an-ip\"}, {ip: 10.96.200.1}]}}"),
        ])
        .expect("10.96.100.1:80/TCP", Both, "ExternalIP -> none")
        .expect("10.96.200.1:80/TCP", Both, "LoadBalancer -> none")
        .rejects("invalid externalIP \"10.96.100.\"")
        .rejects("invalid externalIP \"1.2.3.4/32\"")
        .rejects("invalid loadBalancer IP \"not-an-ip\""),
        case("an externalIP equal to another Service's clusterIP loses, whatever the names' order", [
            service("aaa", "{clusterIP: 10.96.0.20, externalIPs: [10.96.0.10], ports: [{name: http, port: 80, protocol: TCP}]}"),
            web(""),
            web_slice(),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080 local, 10.244.2.3:8080")
        .expect("10.96.0.20:80/TCP", Both, "ClusterIP -> none")
        .rejects("Service demo/aaa: externalIP 10.96.0.10:80/TCP of port \"http\" is already used by Service demo/web:http as its clusterIP"),
        case("the same LoadBalancer IP on two Services: the first by namespace/name wins, the other is reported naming it", [
            service_with_status("zzz", "{type: LoadBalancer, clusterIP: 10.96.0.30, allocateLoadBalancerNodePorts: false, ports: [{name: http, port: 80, protocol: TCP}]}", "{loadBalancer: {ingress: [{ip: 10.96.200.1}]}}"),
            service_with_status("bbb", "{type: LoadBalancer, clusterIP: 10.96.0.20, allocateLoadBalancerNodePorts: false, ports: [{name: http, port: 80, protocol: TCP}]}", "{loadBalancer: {ingress: [{ip: 10.96.200.1}]}}"),
            slice("bbb-a", "bbb", "IPv4", "[{addresses: [10.244.1.2]}]"),
        ])
        .expect("10.96.200.1:80/TCP", Both, "LoadBalancer -> 10.244.1.2:8080")
        .rejects("Service demo/zzz: loadBalancer IP 10.96.200.1:80/TCP of port \"http\" is already used by Service demo/bbb:http as its loadBalancer IP"),
        case("an externalIP or ingress IP that is a node address is never taken over", [
            service_with_status("hijack", "{type: LoadBalancer, clusterIP: 10.96.0.10, allocateLoadBalancerNodePorts: false, externalIPs: [10.244.1.1], ports: [{name: ssh, port: 22, protocol: TCP}]}", "{loadBalancer: {ingress: [{ip: 192.168.0.10}]}}"),
        ])
        .absent("10.244.1.1:22/TCP")
        .absent("192.168.0.10:22/TCP")
        .expect("10.96.0.10:22/TCP", Both, "ClusterIP -> none")
        .rejects("Service demo/hijack: externalIP 10.244.1.1 would hijack an address of this node")
        .rejects("Service demo/hijack: loadBalancer IP 192.168.0.10 would hijack an address of this node"),
        case("loopback, link-local, unspecified, multicast and broadcast addresses are refused from every field", [
            service_with_status("special", "{type: LoadBalancer, clusterIP: 10.96.0.10, allocateLoadBalancerNodePorts: false, externalIPs: [127.0.0.1, 169.254.169.254, 0.0.0.0, 224.0.0.251, 255.255.255.255, \"::ffff:127.0.0.1\", 10.96.200.9], ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]}",
                "{loadBalancer: {ingress: [{ip: 127.0.0.2}, {ip: 10.96.200.8}]}}"),
            slice("special-a", "special", "IPv4", "[{addresses: [127.0.0.1]}, {addresses: [169.254.0.5]}, {addresses: [0.0.0.0]}, {addresses: [239.1.1.1]}, {addresses: [10.244.1.2]}]"),
            service("loop", "{clusterIP: 127.0.0.53, ports: [{port: 53, protocol: UDP}]}"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080")
        .expect("10.96.200.9:80/TCP", Both, "ExternalIP -> 10.244.1.2:8080")
        .expect("10.96.200.8:80/TCP", Both, "LoadBalancer -> 10.244.1.2:8080")
        .absent("127.0.0.1:80/TCP")
        .absent("127.0.0.2:80/TCP")
        .absent("127.0.0.53:53/UDP")
        .rejects("Service demo/special: externalIP 127.0.0.1 is a loopback address")
        .rejects("Service demo/special: externalIP 169.254.169.254 is a link-local address")
        .rejects("Service demo/special: externalIP 0.0.0.0 is a unspecified address")
        .rejects("Service demo/special: externalIP 224.0.0.251 is a multicast address")
        .rejects("Service demo/special: externalIP 255.255.255.255 is a broadcast address")
        .rejects("Service demo/special: externalIP ::ffff:127.0.0.1 is a loopback address")
        .rejects("Service demo/special: loadBalancer IP 127.0.0.2 is a loopback address")
        .rejects("EndpointSlice demo/special-a: endpoint address 127.0.0.1 is a loopback address")
        .rejects("EndpointSlice demo/special-a: endpoint address 169.254.0.5 is a link-local address")
        .rejects("EndpointSlice demo/special-a: endpoint address 0.0.0.0 is a unspecified address")
        .rejects("EndpointSlice demo/special-a: endpoint address 239.1.1.1 is a multicast address")
        .rejects("Service demo/loop: clusterIP 127.0.0.53 is a loopback address"),
        case("IPv6 link-local and loopback endpoints and external IPs are refused too", [
            service("web", "{clusterIP: \"fd00::10\", ipFamilies: [IPv6], externalIPs: [\"::1\", \"fe80::1\", \"ff02::1\", \"fd00::99\"], ports: [{name: http, port: 80, protocol: TCP}]}"),
            slice("web-v6", "web", "IPv6", "[{addresses: [\"fe80::2\"]}, {addresses: [\"::1\"]}, {addresses: [\"fd00:10:244:1::2\"]}]"),
        ])
        .node_addresses(&["10.244.1.1", "fd00:1::1"])
        .expect("[fd00::10]:80/TCP", Both, "ClusterIP -> [fd00:10:244:1::2]:8080")
        .expect("[fd00::99]:80/TCP", Both, "ExternalIP -> [fd00:10:244:1::2]:8080")
        .rejects("Service demo/web: externalIP ::1 is a loopback address")
        .rejects("Service demo/web: externalIP fe80::1 is a link-local address")
        .rejects("Service demo/web: externalIP ff02::1 is a multicast address")
        .rejects("EndpointSlice demo/web-v6: endpoint address fe80::2 is a link-local address")
        .rejects("EndpointSlice demo/web-v6: endpoint address ::1 is a loopback address"),
        case("a slice in another namespace naming a remote pod's address with this node's name changes nothing of another Service", [
            service("web", "{clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]}"),
            slice("web-a", "web", "IPv4", "[{addresses: [10.244.2.3], nodeName: node-2}]"),
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: decoy, namespace: other}\nspec: {clusterIP: 10.96.0.99, ports: [{name: http, port: 80, protocol: TCP}]}\n".to_owned(),
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: decoy-a, namespace: other, labels: {kubernetes.io/service-name: decoy}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.2.3], nodeName: node-1}]\nports: [{name: http, port: 8080, protocol: TCP}]\n".to_owned(),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080")
        .expect("10.96.0.99:80/TCP", Both, "ClusterIP -> 10.244.2.3:8080 local"),
        case("slices without the service-name label, for a missing Service, with a bad address type or addresses", [
            web(""),
            slice("orphan", "", "IPv4", "[{addresses: [10.244.1.2]}]"),
            slice("ghost-a", "ghost", "IPv4", "[{addresses: [10.244.1.2]}]"),
            slice("web-x", "web", "IPv4", "[{addresses: [not-an-ip]}, {addresses: [\"fd00::5\"]}, {addresses: [10.244.1.9]}, {addresses: []}]"),
            slice("web-y", "web", "IPv5", "[{addresses: [10.244.1.10]}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.9:8080")
        .rejects("EndpointSlice demo/orphan: no kubernetes.io/service-name label")
        .rejects("EndpointSlice demo/ghost-a: its Service demo/ghost does not exist")
        .rejects("EndpointSlice demo/web-x: invalid IPv4 endpoint address \"not-an-ip\"")
        .rejects("EndpointSlice demo/web-x: invalid IPv4 endpoint address \"fd00::5\"")
        .rejects("EndpointSlice demo/web-y: unsupported addressType \"IPv5\""),
        case("nil and zero slice ports are ignored; nil conditions mean ready", [
            web(""),
            slice_with_ports("web-a", "web", "IPv4", "[{addresses: [10.244.1.2]}]", "[{name: http, port: null}, {name: http, port: 0}, {name: http, port: 8080}]"),
        ])
        .expect("10.96.0.10:80/TCP", Both, "ClusterIP -> 10.244.1.2:8080"),
        case("unsupported protocols and invalid Service ports are rejected by port; other ports program", [
            service("mixed", "{clusterIP: 10.96.0.12, ports: [{name: sctp, port: 80, protocol: SCTP}, {name: big, port: 70000}, {name: http, port: 81}]}"),
        ])
        .expect("10.96.0.12:81/TCP", Both, "ClusterIP -> none")
        .rejects("Service demo/mixed: protocol SCTP is not supported")
        .rejects("Service demo/mixed: invalid port 70000"),
        case("nodePort 0 on a NodePort Service, and out of range, are reported; the ClusterIP stays", [
            service("np", "{type: NodePort, clusterIP: 10.96.0.12, ports: [{name: zero, port: 80, protocol: TCP}, {name: big, port: 81, nodePort: 70000}, {name: neg, port: 82, nodePort: -1}, {name: ok, port: 83, nodePort: 30083}]}"),
        ])
        .nodeport_addresses("10.244.1.0/24")
        .expect("10.96.0.12:80/TCP", Both, "ClusterIP -> none")
        .expect("10.96.0.12:81/TCP", Both, "ClusterIP -> none")
        .expect("10.244.1.1:30083/TCP", Both, "NodePort -> none")
        .rejects("Service demo/np: port \"zero\": invalid nodePort 0 for type NodePort")
        .rejects("Service demo/np: port \"big\": invalid nodePort 70000")
        .rejects("Service demo/np: port \"neg\": invalid nodePort -1")
        .check(|state| assert_eq!(state.frontends.len(), 10, "4 ClusterIP ports + 1 NodePort, 2 scopes each")),
        case("duplicate Service ports and nodePorts: the second is reported naming the first", [
            service("dup", "{type: NodePort, clusterIP: 10.96.0.12, ports: [{name: a, port: 80, nodePort: 30080}, {name: b, port: 80, nodePort: 30081}, {name: c, port: 81, nodePort: 30080}]}"),
        ])
        .nodeport_addresses("10.244.1.1/32")
        .expect("10.244.1.1:30081/TCP", Both, "NodePort -> none")
        .rejects("clusterIP 10.96.0.12:80/TCP of port \"b\" is already used by Service demo/dup:a as its clusterIP")
        .rejects("nodePort 10.244.1.1:30080/TCP of port \"c\" is already used by Service demo/dup:a as its nodePort"),
        case("a Service with 100 ports programs 100 frontends", [
            service("many", &format!("{{clusterIP: 10.96.0.13, ports: [{hundred_ports}]}}")),
            slice_with_ports("many-a", "many", "IPv4", "[{addresses: [10.244.1.2]}]", &format!("[{hundred_slice_ports}]")),
        ])
        .expect("10.96.0.13:1/TCP", Both, "ClusterIP -> 10.244.1.2:8001")
        .expect("10.96.0.13:100/TCP", Both, "ClusterIP -> 10.244.1.2:8100")
        .check(|state| assert_eq!(state.frontends.len(), 200)),
        case("a slice with 1000 endpoints (the API's maximum) gives 1000 backends", [
            web(""),
            slice("web-big", "web", "IPv4", &format!("[{thousand_endpoints}]")),
        ])
        .check(|state| {
            let frontend = parse_frontend("10.96.0.10:80/TCP", Scope::Internal);
            assert_eq!(state.frontends[&frontend].backends.len(), 1000);
        }),
    ]
}

#[test]
fn service_semantics_table() {
    let failures: Vec<String> = cases().iter().filter_map(|case| verify(case).err()).collect();
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_case_of_the_table_can_fail() {
    // The table compares whole descriptions: a wrong expectation must be caught.
    let wrong = case("wrong on purpose", [web(""), web_slice()]).expect("10.96.0.10:80/TCP", Scopes::Both, "ClusterIP -> none");
    assert!(verify(&wrong).is_err());
    let unexpected = case("an unexpected rejection", [service("badip", "{clusterIP: x, ports: [{port: 80}]}")]);
    assert!(verify(&unexpected).is_err());
}

#[test]
fn nodeport_addresses_flag_names_the_bad_cidr() {
    assert_eq!(NodePortAddresses::parse(""), Ok(NodePortAddresses::All));
    assert_eq!(NodePortAddresses::parse("primary"), Ok(NodePortAddresses::Primary));
    assert!(matches!(NodePortAddresses::parse("10.0.0.0/8,fd00::/64"), Ok(NodePortAddresses::Cidrs(c)) if c.len() == 2));
    assert_eq!(NodePortAddresses::parse("10.0.0.0/8,10.1.0.0/33"), Err("invalid CIDR \"10.1.0.0/33\"".to_owned()));
    assert_eq!(NodePortAddresses::parse("10.0.0.1"), Err("invalid CIDR \"10.0.0.1\"".to_owned()));
    assert!(NodePortAddresses::parse("primary,10.0.0.0/8").unwrap_err().contains("primary"));
}
