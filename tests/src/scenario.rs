//! A ready-made scenario: a client pod, two backend pods ("be1", "be2") behind Service `web`
//! (TCP 80 -> 8080, UDP 53 -> 5353), Service `empty` without endpoints, and the agent.

use crate::agent::{Agent, AgentDir};
use crate::probe::{self, Server};
use crate::topology::Topology;

pub const VIP: &str = "10.96.0.10";
pub const EMPTY_VIP: &str = "10.96.0.20";

/// The Service manifest: `web` (TCP 80 -> 8080, UDP 53 -> 5353) with the given backend IPs, and
/// `empty`, a Service without endpoints.
pub fn manifest(backends: &[&str]) -> String {
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

/// A node with a client pod (10.244.1.2) and backend pods be1 (.11) and be2 (.12), each backend
/// answering with its name on TCP 8080 and UDP 5353.
pub fn client_and_two_backends() -> (Topology, Vec<Server>) {
    let mut topo = Topology::new().expect("topology");
    topo.add_pod("client", 2).expect("client pod");
    topo.add_pod("be1", 11).expect("be1 pod");
    topo.add_pod("be2", 12).expect("be2 pod");
    let servers = vec![
        probe::serve(&topo, "be1", "be1", &[8080], &[5353]).expect("be1 server"),
        probe::serve(&topo, "be2", "be2", &[8080], &[5353]).expect("be2 server"),
    ];
    (topo, servers)
}

/// A client pod, two backend pods answering "be1"/"be2", and the agent.
pub struct Env {
    pub agent: Agent,
    _servers: Vec<Server>,
    pub dir: AgentDir,
    pub topo: Topology,
}

impl Env {
    pub fn new() -> Self {
        let (topo, servers) = client_and_two_backends();
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12"])).expect("manifest");
        let agent = Agent::start(&topo, &dir).expect("agent");
        Self { agent, _servers: servers, dir, topo }
    }

    pub fn tcp(&self, to: &str, count: u32) -> probe::Summary {
        probe::tcp(&self.topo, "client", to, count).expect("tcp probe")
    }

    pub fn udp(&self, to: &str, count: u32) -> probe::Summary {
        probe::udp(&self.topo, "client", to, count).expect("udp probe")
    }

    pub fn counter(&self, name: &str) -> u64 {
        self.agent.dump().expect("dump")["counters"][name].as_u64().expect("counter")
    }
}

