//! End to end, socket-level load balancing: real kernel, real namespaces, real sockets, the real
//! agent reading a manifest file.

use std::time::Duration;

use e2e::agent::{Agent, AgentDir};
use e2e::probe::{self, Server};
use e2e::topology::Topology;

const VIP: &str = "10.96.0.10";
const EMPTY_VIP: &str = "10.96.0.20";

/// The Service manifest: `web` (TCP 80 -> 8080, UDP 53 -> 5353) with the given backend IPs, and
/// `empty`, a Service without endpoints.
fn manifest(backends: &[&str]) -> String {
    let endpoints: String = backends.iter().map(|ip| format!("\n- addresses: [{ip}]\n  conditions: {{ready: true}}")).collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
  clusterIP: {VIP}
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: demo
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:{endpoints}
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: demo}}
spec:
  clusterIP: {EMPTY_VIP}
  ports: [{{name: http, port: 80, protocol: TCP}}]
"#
    )
}

/// A client pod, two backend pods answering "be1"/"be2", and the agent.
struct Env {
    agent: Agent,
    _servers: Vec<Server>,
    dir: AgentDir,
    topo: Topology,
}

impl Env {
    fn new() -> Self {
        let mut topo = Topology::new().expect("topology");
        topo.add_pod("client", 2).expect("client pod");
        topo.add_pod("be1", 11).expect("be1 pod");
        topo.add_pod("be2", 12).expect("be2 pod");
        let servers = vec![
            probe::serve(&topo, "be1", "be1", &[8080], &[5353]).expect("be1 server"),
            probe::serve(&topo, "be2", "be2", &[8080], &[5353]).expect("be2 server"),
        ];
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12"])).expect("manifest");
        let agent = Agent::start(&topo, &dir).expect("agent");
        Self { agent, _servers: servers, dir, topo }
    }

    fn tcp(&self, to: &str, count: u32) -> probe::Summary {
        probe::tcp(&self.topo, "client", to, count).expect("tcp probe")
    }

    fn udp(&self, to: &str, count: u32) -> probe::Summary {
        probe::udp(&self.topo, "client", to, count).expect("udp probe")
    }

    fn counter(&self, name: &str) -> u64 {
        self.agent.dump().expect("dump")["counters"][name].as_u64().expect("counter")
    }
}

#[test]
fn tcp_cluster_ip_spreads_over_both_backends() {
    let env = Env::new();
    let summary = env.tcp(&format!("{VIP}:80"), 200);
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert_eq!(summary.ok, 200);
    // Uniform random over 2 backends: each expects 100 (σ ≈ 7); 40 is far outside chance.
    assert!(summary.answered_by("be1") >= 40 && summary.answered_by("be2") >= 40, "{summary:?}");
}

#[test]
fn udp_cluster_ip_answers_from_the_service_address_and_spreads() {
    let env = Env::new();
    // epx-probe fails a request whose reply does not come from VIP:53, so ok == 200 also proves
    // the reverse translation on recvmsg.
    let summary = env.udp(&format!("{VIP}:53"), 200);
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(summary.answered_by("be1") >= 40 && summary.answered_by("be2") >= 40, "{summary:?}");
}

#[test]
fn removed_endpoint_gets_no_new_connections_within_one_second() {
    let env = Env::new();
    let before = env.tcp(&format!("{VIP}:80"), 50);
    assert!(before.answered_by("be2") > 0, "{before:?}");

    env.dir.write_manifest(&manifest(&["10.244.1.11"])).expect("manifest");
    std::thread::sleep(Duration::from_secs(1));

    let after = env.tcp(&format!("{VIP}:80"), 100);
    assert_eq!(after.failed, 0, "{after:?}");
    assert_eq!(after.answered_by("be2"), 0, "be2 was removed more than 1 s ago: {after:?}");
    assert_eq!(after.answered_by("be1"), 100);
    let udp = env.udp(&format!("{VIP}:53"), 50);
    assert_eq!((udp.failed, udp.answered_by("be2")), (0, 0), "{udp:?}");
}

#[test]
fn service_without_endpoints_refuses_at_once() {
    let env = Env::new();
    let summary = env.tcp(&format!("{EMPTY_VIP}:80"), 20);
    assert_eq!(summary.errors_of("ECONNREFUSED"), 20, "{summary:?}");
    // Refused by the connect hook, not after a timeout.
    assert!(summary.elapsed_ms < 1000, "{summary:?}");
    assert!(env.counter("sock_no_backend") >= 20);
}

#[test]
fn destinations_that_are_not_services_are_untouched() {
    let env = Env::new();
    let translated_before = env.counter("sock_xlate");
    // A pod IP directly, and the VIP on a port that is not a Service port.
    let direct = env.tcp("10.244.1.12:8080", 20);
    assert_eq!((direct.ok, direct.answered_by("be2")), (20, 20), "{direct:?}");
    let other_port = env.tcp(&format!("{VIP}:81"), 3);
    assert_eq!(other_port.ok, 0, "{other_port:?}");
    assert_eq!(other_port.errors_of("ECONNREFUSED"), 0, "not ours to refuse: {other_port:?}");
    assert_eq!(env.counter("sock_xlate"), translated_before, "nothing may have been translated");
}

#[test]
fn dump_shows_the_same_state_with_the_agent_stopped_and_traffic_still_flows() {
    let mut env = Env::new();
    let running = env.agent.dump().expect("dump");
    let services = running["services"].as_array().expect("services").clone();
    assert_eq!(services.len(), 3, "{running}");
    let web_tcp = services.iter().find(|s| s["ip"] == VIP && s["protocol"] == "TCP").expect("web tcp");
    let backends: Vec<&str> = web_tcp["backends"].as_array().unwrap().iter().map(|b| b["ip"].as_str().unwrap()).collect();
    assert_eq!(backends, ["10.244.1.11", "10.244.1.12"]);

    env.agent.stop().expect("stop agent");
    let stopped = env.agent.dump().expect("dump without agent");
    assert_eq!(stopped["services"], running["services"]);

    // The pinned programs and maps keep serving without any agent.
    let summary = env.tcp(&format!("{VIP}:80"), 50);
    assert_eq!(summary.failed, 0, "{summary:?}");
}
