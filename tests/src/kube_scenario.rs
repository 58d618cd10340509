//! A ready-made scenario on the real control plane: a client pod, two backend pods ("be1",
//! "be2"), etcd + kube-apiserver, Service `web` (TCP 80 -> 8080, UDP 53 -> 5353) with both
//! backends in an EndpointSlice, and the agent watching the API.

use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentDir};
use crate::control_plane::ControlPlane;
use crate::forward::Forwarder;
use crate::probe::{self, Server};
use crate::topology::Topology;

pub const VIP: &str = "10.96.0.10";
pub const OTHER_VIP: &str = "10.96.0.30";

/// The node's address in the topology, where NodePorts are served.
pub const NODE_IP: &str = "10.244.1.1";

/// A Service `name` of type NodePort: TCP 80 -> 8080 on `node_port`, UDP 53 -> 5353 on
/// `node_port + 1` (kube-apiserver allocates a node port once, whatever the protocol); its
/// EndpointSlice is [`slice`]`(name, ...)`.
pub fn node_port_service(name: &str, vip: &str, node_port: u16) -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  type: NodePort
  clusterIP: {vip}
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {node_port}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {udp_node_port}}}
"#,
        udp_node_port = node_port + 1
    )
}

/// `service` (YAML of one Service) with `sessionAffinity: ClientIP` and the given timeout.
pub fn with_affinity(service: &str, timeout_seconds: u32) -> String {
    assert!(service.contains("\nspec:\n"), "not a Service manifest: {service}");
    service.replacen(
        "\nspec:\n",
        &format!("\nspec:\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {timeout_seconds}}}}}\n"),
        1,
    )
}

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

/// How the scenario's agent reaches the API server.
enum AgentAccess {
    /// Through the control plane's forwarder, from the test's namespace.
    Shared,
    /// Through a forwarder of its own, from the test's namespace.
    Own,
    /// From the node namespace, at the API server's own address.
    InNode,
}

pub struct KubeEnv {
    /// The agent's own way to the API server when built with [`KubeEnv::with_agent_access`].
    pub agent_access: Option<Forwarder>,
    pub agent: Agent,
    _dir: AgentDir,
    pub api: ControlPlane,
    _servers: Vec<Server>,
    pub topo: Topology,
}

impl KubeEnv {
    pub fn new() -> Self {
        Self::build(AgentAccess::Shared, &[])
    }

    /// As [`KubeEnv::new`], with extra kube-apiserver flags.
    pub fn with_apiserver_args(apiserver_args: &[&str]) -> Self {
        Self::build(AgentAccess::Shared, apiserver_args)
    }

    /// As [`KubeEnv::new`], but the agent reaches the API through a forwarder of its own
    /// ([`KubeEnv::agent_access`]): black-holing it cuts off the agent while the test's own
    /// client keeps changing objects.
    pub fn with_agent_access() -> Self {
        Self::build(AgentAccess::Own, &[])
    }

    /// As [`KubeEnv::with_agent_access`], with extra kube-apiserver flags.
    pub fn with_agent_access_and_apiserver_args(apiserver_args: &[&str]) -> Self {
        Self::build(AgentAccess::Own, apiserver_args)
    }

    /// As [`KubeEnv::new`], but the agent runs in the node namespace and talks to the API server
    /// at its own address, as on a real node: NodePorts exist on the node address 10.244.1.1.
    pub fn in_node() -> Self {
        Self::build(AgentAccess::InNode, &[])
    }

    fn build(access: AgentAccess, apiserver_args: &[&str]) -> Self {
        let (mut topo, servers) = crate::scenario::client_and_two_backends();
        let api = ControlPlane::start_with(&mut topo, apiserver_args).expect("control plane");
        api.apply(&format!("{}---\n{}", service("web", VIP), slice("web", &["10.244.1.11", "10.244.1.12"])))
            .expect("apply web");
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        let (agent_access, agent) = match access {
            AgentAccess::Shared => (None, Agent::start_kube(&topo, &dir, &api.admin_kubeconfig)),
            AgentAccess::Own => {
                let (forwarder, kubeconfig) = api.extra_access("agent").expect("agent's access");
                (Some(forwarder), Agent::start_kube(&topo, &dir, &kubeconfig))
            }
            AgentAccess::InNode => {
                let kubeconfig = api.direct_kubeconfig("agent").expect("agent kubeconfig");
                (None, Agent::start_kube_in_node(&topo, &dir, &kubeconfig))
            }
        };
        let agent = agent.expect("agent");
        Self { agent_access, agent, _dir: dir, api, _servers: servers, topo }
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

    /// The backends (`ip:port`) the datapath holds for frontend `ip:port` (socket-LB scope).
    pub fn backends_of(&self, frontend: &str) -> Vec<String> {
        let dump = self.agent.dump().expect("dump");
        dump["services"]
            .as_array()
            .expect("services")
            .iter()
            .filter(|s| format!("{}:{}", s["ip"].as_str().unwrap_or(""), s["port"]) == frontend)
            .filter(|s| s["scope"] == "internal")
            .flat_map(|s| s["backends"].as_array().cloned().unwrap_or_default())
            .map(|b| format!("{}:{}", b["ip"].as_str().unwrap_or(""), b["port"]))
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

