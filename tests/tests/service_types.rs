//! Every Service type through the socket-level datapath: a pod client reaches pod backends
//! through a NodePort on the node's own address (TCP and UDP on the same number at once), an
//! externalIP, a LoadBalancer ingress IP, and an `internalTrafficPolicy: Local` ClusterIP; the
//! session-affinity setting and the frontend kinds are visible in `ebpf-proxy dump`.
//!
//! The agent runs inside the node namespace (as a DaemonSet with host networking does), so the
//! node addresses it reads are the node's: 10.244.1.1 on br0. The externalIP and LoadBalancer IP
//! (10.96.x.y) are socket-level frontends only, never configured on any interface.

use std::process::Command;
use std::time::{Duration, Instant};

use e2e::agent::{Agent, AgentDir};
use e2e::probe::{self, Summary};
use e2e::scenario;
use e2e::topology::Topology;

const NODE_IP: &str = "10.244.1.1";
/// Added to br0 during the test, inside the node's own /24.
const ADDED_NODE_IP: &str = "10.244.1.250";
const NODE_PORT: u16 = 30090;
const EXTERNAL_IP: &str = "10.96.100.1";
const LB_IP: &str = "10.96.200.1";
const ITP_LOCAL_VIP: &str = "10.96.0.53";
const STICKY_VIP: &str = "10.96.0.54";

/// be1 and be2 as endpoints, with the nodeName given for each.
fn slice(service: &str, be1_node: &str, be2_node: &str) -> String {
    format!(
        r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {service}-1, namespace: demo, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
endpoints:
- {{addresses: [10.244.1.11], nodeName: {be1_node}}}
- {{addresses: [10.244.1.12], nodeName: {be2_node}}}
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
"#
    )
}

fn manifest() -> String {
    let services = format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: np, namespace: demo}}
spec:
  type: NodePort
  clusterIP: 10.96.0.50
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {NODE_PORT}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {NODE_PORT}}}
---
apiVersion: v1
kind: Service
metadata: {{name: ext, namespace: demo}}
spec:
  clusterIP: 10.96.0.51
  externalIPs: [{EXTERNAL_IP}]
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: v1
kind: Service
metadata: {{name: lb, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.52
  allocateLoadBalancerNodePorts: false
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
status:
  loadBalancer:
    ingress: [{{ip: {LB_IP}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: itp, namespace: demo}}
spec:
  clusterIP: {ITP_LOCAL_VIP}
  internalTrafficPolicy: Local
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: v1
kind: Service
metadata: {{name: sticky, namespace: demo}}
spec:
  clusterIP: {STICKY_VIP}
  sessionAffinity: ClientIP
  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 600}}}}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
"#
    );
    // The agent runs as node-1: be2 is on another node for `itp`.
    [services, slice("np", "node-1", "node-1"), slice("ext", "node-1", "node-1"), slice("lb", "node-1", "node-1"), slice("itp", "node-1", "node-2"), slice("sticky", "node-1", "node-1")]
        .concat()
}

struct Env {
    agent: Agent,
    _dir: AgentDir,
    _servers: Vec<probe::Server>,
    topo: Topology,
}

impl Env {
    fn new() -> Self {
        let (topo, servers) = scenario::client_and_two_backends();
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        dir.write_manifest(&manifest()).expect("manifest");
        let agent = Agent::start_file_in_node(&topo, &dir, &[]).expect("agent in the node namespace");
        Self { agent, _dir: dir, _servers: servers, topo }
    }

    fn probe(&self, kind: &str, to: &str, count: u32) -> Summary {
        probe::client(&self.topo, "client", kind, to, count).expect("probe")
    }

    /// The dump's entries for `ip:port/PROTO`, one per scope.
    fn entries(&self, ip: &str, port: u16, protocol: &str) -> Vec<serde_json::Value> {
        self.agent.entries(ip, port, protocol)
    }

    fn wait_for(&self, what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < limit, "{what} not within {limit:?}\n{}", self.agent.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn assert_spread(summary: &Summary, count: u32) {
    assert_eq!((summary.ok, summary.failed), (count, 0), "{summary:?}");
    // Uniform random over 2 backends: each expects count/2; a fifth is far outside chance.
    assert!(summary.answered_by("be1") >= count / 5 && summary.answered_by("be2") >= count / 5, "{summary:?}");
}

#[test]
fn node_port_on_the_node_address_serves_tcp_and_udp_on_the_same_number() {
    let env = Env::new();
    let tcp_entries = env.entries(NODE_IP, NODE_PORT, "TCP");
    let udp_entries = env.entries(NODE_IP, NODE_PORT, "UDP");
    assert_eq!((tcp_entries.len(), udp_entries.len()), (2, 2), "both scopes of both protocols: {tcp_entries:?} {udp_entries:?}");
    assert!(tcp_entries.iter().chain(&udp_entries).all(|e| e["kind"] == "NodePort"), "{tcp_entries:?} {udp_entries:?}");

    let to = format!("{NODE_IP}:{NODE_PORT}");
    assert_spread(&env.probe("tcp", &to, 100), 100);
    // epx-probe fails a UDP answer that does not come from the address it sent to.
    assert_spread(&env.probe("udp", &to, 100), 100);
}

#[test]
fn node_ports_follow_the_node_addresses_as_they_change() {
    let env = Env::new();
    assert!(env.entries(ADDED_NODE_IP, NODE_PORT, "TCP").is_empty());
    env.topo.node.exec(&["ip", "addr", "add", &format!("{ADDED_NODE_IP}/24"), "dev", "br0"]).expect("add address");
    env.wait_for("a NodePort on the added address", Duration::from_secs(5), || {
        env.entries(ADDED_NODE_IP, NODE_PORT, "TCP").len() == 2
    });
    let summary = env.probe("tcp", &format!("{ADDED_NODE_IP}:{NODE_PORT}"), 20);
    assert_eq!(summary.ok, 20, "{summary:?}");

    env.topo.node.exec(&["ip", "addr", "del", &format!("{ADDED_NODE_IP}/24"), "dev", "br0"]).expect("remove address");
    env.wait_for("the NodePort on the removed address gone", Duration::from_secs(5), || {
        env.entries(ADDED_NODE_IP, NODE_PORT, "TCP").is_empty()
    });
    assert_eq!(env.entries(NODE_IP, NODE_PORT, "TCP").len(), 2, "the other address keeps its NodePort");
}

#[test]
fn external_ip_and_load_balancer_ip_reach_the_backends() {
    let env = Env::new();
    for (ip, kind) in [(EXTERNAL_IP, "ExternalIP"), (LB_IP, "LoadBalancer")] {
        let entries = env.entries(ip, 80, "TCP");
        assert_eq!(entries.len(), 2, "{ip}: {entries:?}");
        assert!(entries.iter().all(|e| e["kind"] == kind), "{entries:?}");
        assert_spread(&env.probe("tcp", &format!("{ip}:80"), 100), 100);
    }
}

#[test]
fn internal_traffic_policy_local_sends_a_pod_only_to_the_local_endpoint() {
    let env = Env::new();
    let summary = env.probe("tcp", &format!("{ITP_LOCAL_VIP}:80"), 100);
    assert_eq!((summary.ok, summary.answered_by("be1")), (100, 100), "be2's nodeName is node-2: {summary:?}");
    // The same two endpoints behind a Cluster policy do spread (so be2 was reachable).
    assert_spread(&env.probe("tcp", "10.96.0.50:80", 100), 100);

    let entries = env.entries(ITP_LOCAL_VIP, 80, "TCP");
    assert_eq!(entries.len(), 2, "{entries:?}");
    for entry in &entries {
        assert_eq!(entry["localOnly"], true, "{entry}");
        let backends = entry["backends"].as_array().expect("backends");
        assert_eq!(backends.len(), 1, "{entry}");
        assert!(backends[0]["ip"] == "10.244.1.11" && backends[0]["local"] == true, "{entry}");
    }
}

#[test]
fn session_affinity_flag_and_timeout_are_in_the_dump() {
    let env = Env::new();
    let entries = env.entries(STICKY_VIP, 80, "TCP");
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(entries.iter().all(|e| e["affinityTimeoutSeconds"] == 600), "{entries:?}");
    assert!(env.entries("10.96.0.50", 80, "TCP").iter().all(|e| e["affinityTimeoutSeconds"].is_null()));

    let output = e2e::topology::run(Command::new(e2e::bin("ebpf-proxy")).arg("dump").arg("--bpffs").arg(&env.agent.bpffs))
        .expect("dump");
    let text = String::from_utf8_lossy(&output.stdout);
    let sticky: Vec<&str> = text.lines().filter(|l| l.starts_with(&format!("{STICKY_VIP}:80/TCP"))).collect();
    assert_eq!(sticky.len(), 2, "{text}");
    assert!(sticky.iter().all(|l| l.contains("ClusterIP") && l.contains("affinity=600s")), "{text}");
    let itp: Vec<&str> = text.lines().filter(|l| l.starts_with(&format!("{ITP_LOCAL_VIP}:80/TCP"))).collect();
    assert!(itp.iter().all(|l| l.contains("local-only") && l.contains("10.244.1.11:8080 (local)")), "{text}");
    assert!(text.lines().any(|l| l.starts_with(&format!("{NODE_IP}:{NODE_PORT}/UDP")) && l.contains("NodePort")), "{text}");

    // And the kernel serves the sticky Service (affinity itself is the packet-path's next step).
    assert_eq!(env.probe("tcp", &format!("{STICKY_VIP}:80"), 10).ok, 10);
}

#[test]
fn a_bad_nodeport_addresses_cidr_is_a_cli_error_naming_it() {
    // Harmless paths in case the flag were accepted: nothing of the host's may be touched.
    let dir = AgentDir::new(&e2e::unique_id()).expect("dir");
    let output = Command::new(e2e::bin("ebpf-proxy"))
        .args(["agent", "--source=file:/nonexistent", "--interfaces=none", "--nodeport-addresses=10.244.1.0/24,10.0.0.0/33"])
        .arg(format!("--cgroup={}", dir.dir.join("no-cgroup").display()))
        .arg(format!("--bpffs={}", dir.dir.join("no-bpffs").display()))
        .arg(format!("--state-dir={}", dir.dir.join("state").display()))
        .output()
        .expect("run ebpf-proxy");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("invalid CIDR \"10.0.0.0/33\""), "{stderr}");
}

#[test]
fn a_pod_reaches_itself_through_its_own_service_hairpin() {
    let env = Env::new();
    // be1 is one of the two endpoints behind each of these; from be1 some connections must come
    // back to be1 itself (and answers appear to come from the Service), the others reach be2.
    for (kind, to) in [
        ("tcp", "10.96.0.50:80".to_owned()),
        ("udp", "10.96.0.50:53".to_owned()),
        ("tcp", format!("{NODE_IP}:{NODE_PORT}")),
        ("udp", format!("{NODE_IP}:{NODE_PORT}")),
    ] {
        let summary = probe::client(&env.topo, "be1", kind, &to, 60).expect("probe from be1");
        assert_spread(&summary, 60);
    }
}

const TWO_NODE_VIP: &str = "10.96.0.56";
const CLUSTER_VIP: &str = "10.96.0.57";
const BE3_IP: &str = "10.244.2.10";

/// `local` (internalTrafficPolicy: Local) and `cluster` with the same endpoints: be1 on node-1
/// and, when `with_be3`, be3 on node-2.
fn two_node_manifest(with_be3: bool) -> String {
    let mut out = String::new();
    for (name, vip, policy) in [("local", TWO_NODE_VIP, "Local"), ("cluster", CLUSTER_VIP, "Cluster")] {
        let be3 = if with_be3 { format!("\n- {{addresses: [{BE3_IP}], nodeName: node-2}}") } else { String::new() };
        out.push_str(&format!(
            r#"---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  clusterIP: {vip}
  internalTrafficPolicy: {policy}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
endpoints:
- {{addresses: [10.244.1.11], nodeName: node-1}}{be3}
ports: [{{name: http, port: 8080, protocol: TCP}}]
"#
        ));
    }
    out
}

#[test]
fn internal_traffic_policy_local_keeps_the_clients_of_each_node_on_that_nodes_endpoints() {
    // Two nodes, each with its own agent: node-1 (the topology's node: client, be1, be2) and
    // node-2 (one namespace that is the node and its pod be3), each balancing its own pods'
    // sockets, from the same Services.
    let (mut topo, _servers) = scenario::client_and_two_backends();
    topo.add_remote_pod("be3", 10, &["10.244.1.0/24"]).expect("node-2 with be3");
    let _be3 = probe::serve(&topo, "be3", "be3", &[8080], &[]).expect("be3 server");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&two_node_manifest(true)).expect("manifest");
    let node1 = Agent::start_file_in_node(&topo, &dir, &[]).expect("node-1 agent");
    let node2_pods = e2e::topology::Cgroup::create(&format!("{}-{}-node-2", e2e::PREFIX, topo.id)).expect("cgroup");
    let node2 =
        Agent::start_other_node(&node1, "node-2", &node2_pods.path, &topo.pod("be3").netns.path(), &[]).expect("node-2 agent");
    let from_node1 = |to: &str, count| probe::client(&topo, "client", "tcp", to, count).expect("probe on node-1");
    let from_node2 = |to: &str, count| {
        let command = topo.command_in_cgroup("be3", &e2e::bin("epx-probe"), &node2_pods.path).expect("command");
        probe::client_with(command, "tcp", to, count).expect("probe on node-2")
    };
    let local = format!("{TWO_NODE_VIP}:80");

    // Each node's clients reach only that node's endpoint.
    let summary = from_node1(&local, 40);
    assert_eq!((summary.ok, summary.answered_by("be1")), (40, 40), "node-1's client: {summary:?}");
    let summary = from_node2(&local, 40);
    assert_eq!((summary.ok, summary.answered_by("be3")), (40, 40), "node-2's client: {summary:?}");
    // With the Cluster policy both nodes' clients reach both endpoints (be1 is reachable from node-2).
    let cluster = format!("{CLUSTER_VIP}:80");
    for summary in [from_node1(&cluster, 60), from_node2(&cluster, 60)] {
        assert_eq!(summary.ok, 60, "{summary:?}");
        assert!(summary.answered_by("be1") >= 12 && summary.answered_by("be3") >= 12, "{summary:?}");
    }

    // be3 goes: node-2 has no local endpoint left, so its clients are refused (never sent to
    // node-1's be1), while node-1's clients are unaffected.
    dir.write_manifest(&two_node_manifest(false)).expect("manifest");
    let started = Instant::now();
    loop {
        let backends = node2.dump().expect("dump")["services"]
            .as_array()
            .expect("services")
            .iter()
            .filter(|s| s["ip"] == TWO_NODE_VIP)
            .all(|s| s["backends"].as_array().is_some_and(Vec::is_empty));
        if backends {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "node-2 still has a local endpoint\n{}", node2.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let summary = from_node2(&local, 10);
    assert_eq!((summary.ok, summary.errors_of("ECONNREFUSED")), (0, 10), "node-2's client: {summary:?}");
    let summary = from_node1(&local, 20);
    assert_eq!((summary.ok, summary.answered_by("be1")), (20, 20), "node-1's client: {summary:?}");
}
