//! The agent against the real kube-apiserver (and etcd): Services and EndpointSlices created,
//! changed and deleted through the API change real traffic within a second.

use std::time::{Duration, Instant};

use e2e::agent::{Agent, AgentDir};
use e2e::control_plane::ControlPlane;
use e2e::probe::{self, Server};
use e2e::topology::Topology;

const VIP: &str = "10.96.0.10";
const OTHER_VIP: &str = "10.96.0.30";

fn service(name: &str, vip: &str) -> String {
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

fn slice(service: &str, backends: &[&str]) -> String {
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

struct Cluster {
    agent: Agent,
    _dir: AgentDir,
    api: ControlPlane,
    _servers: Vec<Server>,
    topo: Topology,
}

impl Cluster {
    fn new() -> Self {
        let mut topo = Topology::new().expect("topology");
        topo.add_pod("client", 2).expect("client");
        topo.add_pod("be1", 11).expect("be1");
        topo.add_pod("be2", 12).expect("be2");
        let servers = vec![
            probe::serve(&topo, "be1", "be1", &[8080], &[5353]).expect("be1 server"),
            probe::serve(&topo, "be2", "be2", &[8080], &[5353]).expect("be2 server"),
        ];
        let api = ControlPlane::start(&mut topo).expect("control plane");
        api.apply(&format!("{}---\n{}", service("web", VIP), slice("web", &["10.244.1.11", "10.244.1.12"])))
            .expect("apply web");
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        let agent = Agent::start_kube(&topo, &dir, &api.admin_kubeconfig).expect("agent");
        Self { agent, _dir: dir, api, _servers: servers, topo }
    }

    fn tcp(&self, to: &str, count: u32) -> probe::Summary {
        probe::tcp(&self.topo, "client", to, count).expect("tcp probe")
    }

    fn frontends(&self) -> Vec<String> {
        let dump = self.agent.dump().expect("dump");
        dump["services"]
            .as_array()
            .expect("services")
            .iter()
            .map(|s| format!("{}:{}/{}", s["ip"].as_str().unwrap_or(""), s["port"], s["protocol"].as_str().unwrap_or("")))
            .collect()
    }

    /// Polls `done` every 20 ms; returns how long it took, failing after `limit`.
    fn within(&self, limit: Duration, what: &str, mut done: impl FnMut(&Self) -> bool) -> Duration {
        let started = Instant::now();
        while !done(self) {
            assert!(started.elapsed() < limit, "{what} did not happen within {limit:?}\n{}", self.agent.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        started.elapsed()
    }
}

#[test]
fn services_and_slices_from_the_api_server_steer_real_traffic() {
    let cluster = Cluster::new();
    let summary = cluster.tcp(&format!("{VIP}:80"), 100);
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(summary.answered_by("be1") >= 20 && summary.answered_by("be2") >= 20, "{summary:?}");
    let udp = probe::udp(&cluster.topo, "client", &format!("{VIP}:53"), 50).expect("udp");
    assert_eq!(udp.failed, 0, "{udp:?}");
    // The API server's own `kubernetes` Service is programmed too.
    assert!(cluster.frontends().contains(&"10.96.0.1:443/TCP".to_owned()), "{:?}", cluster.frontends());
}

#[test]
fn api_changes_reach_the_datapath_within_one_second() {
    let cluster = Cluster::new();

    // An endpoint removed through the API.
    cluster.api.apply(&slice("web", &["10.244.1.11"])).expect("shrink slice");
    let took = cluster.within(Duration::from_secs(1), "removing be2", |c| {
        c.agent.dump().expect("dump")["services"]
            .as_array()
            .expect("services")
            .iter()
            .filter(|s| s["ip"] == VIP)
            .all(|s| s["backends"].as_array().is_some_and(|b| b.len() == 1))
    });
    eprintln!("endpoint removal programmed after {took:?}");
    let after = cluster.tcp(&format!("{VIP}:80"), 50);
    assert_eq!((after.failed, after.answered_by("be2")), (0, 0), "{after:?}");

    // A new Service created through the API.
    cluster
        .api
        .apply(&format!("{}---\n{}", service("other", OTHER_VIP), slice("other", &["10.244.1.12"])))
        .expect("create other");
    let took = cluster.within(Duration::from_secs(1), "creating Service other", |c| {
        c.frontends().contains(&format!("{OTHER_VIP}:80/TCP"))
    });
    eprintln!("Service creation programmed after {took:?}");
    let other = cluster.tcp(&format!("{OTHER_VIP}:80"), 20);
    assert_eq!((other.ok, other.answered_by("be2")), (20, 20), "{other:?}");

    // A Service deleted through the API.
    cluster.api.delete("v1", "Service", "demo", "other").expect("delete other");
    let took = cluster.within(Duration::from_secs(1), "deleting Service other", |c| {
        !c.frontends().iter().any(|f| f.starts_with(OTHER_VIP))
    });
    eprintln!("Service deletion programmed after {took:?}");
    // web is untouched by all of this.
    let web = cluster.tcp(&format!("{VIP}:80"), 20);
    assert_eq!(web.failed, 0, "{web:?}");
}
