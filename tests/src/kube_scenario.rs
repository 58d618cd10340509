//! A ready-made scenario on the real control plane: a client pod, two backend pods ("be1",
//! "be2"), etcd + kube-apiserver, Service `web` (TCP 80 -> 8080, UDP 53 -> 5353) with both
//! backends in an EndpointSlice, and the agent watching the API.

use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentDir};
use crate::control_plane::ControlPlane;
use crate::probe::{self, Server};
use crate::topology::Topology;

pub const VIP: &str = "10.96.0.10";
pub const OTHER_VIP: &str = "10.96.0.30";

pub fn service(name: &str, vip: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  clusterIP: {vip}
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}
"#
    )
}

pub fn slice(service: &str, backends: &[&str]) -> String {
    let endpoints: String =
        backends.iter().map(|ip| format!("\n- addresses: [{ip}]\n  conditions: {{ready: true}}\n  nodeName: node-1")).collect();
    format!(
        r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {service}-abc
  namespace: demo
  labels: {{kubernetes.io/service-name: {service}}}
addressType: IPv4
endpoints:{endpoints}
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
"#
    )
}

pub struct KubeEnv {
    pub agent: Agent,
    _dir: AgentDir,
    pub api: ControlPlane,
    _servers: Vec<Server>,
    pub topo: Topology,
}

impl KubeEnv {
    pub fn new() -> Self {
        let (mut topo, servers) = crate::scenario::client_and_two_backends();
        let api = ControlPlane::start(&mut topo).expect("control plane");
        api.apply(&format!("{}---\n{}", service("web", VIP), slice("web", &["10.244.1.11", "10.244.1.12"])))
            .expect("apply web");
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        let agent = Agent::start_kube(&topo, &dir, &api.admin_kubeconfig).expect("agent");
        Self { agent, _dir: dir, api, _servers: servers, topo }
    }

    pub fn tcp(&self, to: &str, count: u32) -> probe::Summary {
        probe::tcp(&self.topo, "client", to, count).expect("tcp probe")
    }

    pub fn frontends(&self) -> Vec<String> {
        let dump = self.agent.dump().expect("dump");
        dump["services"]
            .as_array()
            .expect("services")
            .iter()
            .map(|s| format!("{}:{}/{}", s["ip"].as_str().unwrap_or(""), s["port"], s["protocol"].as_str().unwrap_or("")))
            .collect()
    }

    /// Polls `done` every 20 ms; returns how long it took, failing after `limit`.
    pub fn within(&self, limit: Duration, what: &str, mut done: impl FnMut(&Self) -> bool) -> Duration {
        let started = Instant::now();
        while !done(self) {
            assert!(started.elapsed() < limit, "{what} did not happen within {limit:?}\n{}", self.agent.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        started.elapsed()
    }
}

