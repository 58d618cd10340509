//! IPv6 and dual-stack through the socket-level datapath: a dual-stack node (br0 with
//! 10.244.1.1 and fd00:10:244:1::1), pods with both families, and a Service with a ClusterIP of
//! each family, served by EndpointSlices of each address type. The agent runs in the node
//! namespace, so the node's IPv6 address gets NodePorts too.

use std::time::{Duration, Instant};

use e2e::agent::{Agent, AgentDir};
use e2e::probe::{self, Server, Summary};
use e2e::topology::{ExternalClient, Topology, EXT_CLIENT_IP6, EXT_NODE_IP6, NODE_IP6};

const VIP4: &str = "10.96.0.10";
const VIP6: &str = "fd00:96::10";
const ONLY6_VIP: &str = "fd00:96::20";
const EMPTY6_VIP: &str = "fd00:96::30";
const STICKY6_VIP: &str = "fd00:96::40";
/// An externalIP and a LoadBalancer IP of `sticky6`, routed by the external client through
/// the node.
const EXTERNAL_IP6: &str = "fd00:192:168:241::10";
const LB_IP6: &str = "fd00:192:168:242::10";
const NODE_PORT: u16 = 30091;
const EMPTY_NODE_PORT: u16 = 30092;

fn slice(service: &str, name: &str, address_type: &str, addresses: &[&str]) -> String {
    let endpoints: String = addresses.iter().map(|ip| format!("\n- {{addresses: [\"{ip}\"], nodeName: node-1}}")).collect();
    format!(
        r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}, namespace: demo, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: {address_type}
endpoints:{endpoints}
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
"#
    )
}

/// `web`: dual-stack NodePort (IPv4 and IPv6 ClusterIPs); `only6`: single-stack IPv6;
/// `empty6`: IPv6 without endpoints. be1 and be2 behind each, in both families.
fn manifest(v6_backends: &[&str]) -> String {
    manifest_split(v6_backends, v6_backends)
}

/// [`manifest`] with `web`'s IPv6 endpoints apart from those of the other Services.
fn manifest_split(web_v6: &[&str], v6_backends: &[&str]) -> String {
    let services = format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: {VIP4}
  clusterIPs: [{VIP4}, "{VIP6}"]
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {NODE_PORT}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {NODE_PORT}}}
---
apiVersion: v1
kind: Service
metadata: {{name: only6, namespace: demo}}
spec:
  ipFamilies: [IPv6]
  clusterIP: "{ONLY6_VIP}"
  clusterIPs: ["{ONLY6_VIP}"]
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}
---
apiVersion: v1
kind: Service
metadata: {{name: empty6, namespace: demo}}
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: "{EMPTY6_VIP}"
  clusterIPs: ["{EMPTY6_VIP}"]
  ports:
  - {{name: http, port: 80, protocol: TCP, nodePort: {EMPTY_NODE_PORT}}}
  - {{name: dns, port: 53, protocol: UDP, nodePort: {EMPTY_NODE_PORT}}}
---
apiVersion: v1
kind: Service
metadata: {{name: sticky6, namespace: demo}}
spec:
  ipFamilies: [IPv6]
  clusterIP: "{STICKY6_VIP}"
  clusterIPs: ["{STICKY6_VIP}"]
  type: LoadBalancer
  allocateLoadBalancerNodePorts: false
  externalIPs: ["{EXTERNAL_IP6}"]
  sessionAffinity: ClientIP
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
status:
  loadBalancer:
    ingress: [{{ip: "{LB_IP6}"}}]
"#
    );
    [
        services,
        slice("web", "web-v4", "IPv4", &["10.244.1.11", "10.244.1.12"]),
        slice("web", "web-v6", "IPv6", web_v6),
        slice("only6", "only6-v6", "IPv6", v6_backends),
        slice("sticky6", "sticky6-v6", "IPv6", v6_backends),
    ]
    .concat()
}

const BE1_6: &str = "fd00:10:244:1::11";
const BE2_6: &str = "fd00:10:244:1::12";

struct Env {
    agent: Agent,
    dir: AgentDir,
    _servers: Vec<Server>,
    topo: Topology,
}

impl Env {
    fn new() -> Self {
        Self::with(|_| Vec::new())
    }

    /// With more set-up of the topology before the agent starts; `setup` returns extra agent
    /// arguments.
    fn with(setup: impl FnOnce(&Topology) -> Vec<String>) -> Self {
        let mut topo = Topology::new().expect("topology");
        topo.enable_ipv6().expect("IPv6 on the node");
        topo.add_pod("client", 2).expect("client pod");
        topo.add_pod("be1", 11).expect("be1 pod");
        topo.add_pod("be2", 12).expect("be2 pod");
        assert_eq!(topo.pod("be1").ip6.as_deref(), Some(BE1_6));
        let servers = vec![
            probe::serve(&topo, "be1", "be1", &[8080], &[5353]).expect("be1 server"),
            probe::serve(&topo, "be2", "be2", &[8080], &[5353]).expect("be2 server"),
        ];
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        dir.write_manifest(&manifest(&[BE1_6, BE2_6])).expect("manifest");
        let args = setup(&topo);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = Agent::start_file_in_node(&topo, &dir, &args).expect("agent in the node namespace");
        Self { agent, dir, _servers: servers, topo }
    }

    fn probe(&self, kind: &str, to: &str, count: u32) -> Summary {
        probe::client(&self.topo, "client", kind, to, count).expect("probe")
    }

    /// The dump's entries for `ip:port/PROTO`, one per scope.
    fn entries(&self, ip: &str, port: u16, protocol: &str) -> Vec<serde_json::Value> {
        self.agent.entries(ip, port, protocol)
    }
}

fn assert_spread(summary: &Summary, count: u32) {
    assert_eq!((summary.ok, summary.failed), (count, 0), "{summary:?}");
    assert!(summary.answered_by("be1") >= count / 5 && summary.answered_by("be2") >= count / 5, "{summary:?}");
}

#[test]
fn a_dual_stack_service_serves_pods_over_both_families_tcp_and_udp() {
    let env = Env::new();
    for (ip, family) in [(VIP4, "IPv4"), (VIP6, "IPv6")] {
        let entries = env.entries(ip, 80, "TCP");
        assert_eq!(entries.len(), 2, "{family} ClusterIP, both scopes: {entries:#?}");
        let backends: Vec<&str> = entries[0]["backends"].as_array().unwrap().iter().map(|b| b["ip"].as_str().unwrap()).collect();
        let expected = if family == "IPv4" { ["10.244.1.11", "10.244.1.12"] } else { [BE1_6, BE2_6] };
        assert_eq!(backends.len(), 2, "{entries:#?}");
        assert!(expected.iter().all(|e| backends.contains(e)), "{family} endpoints only: {backends:?}");
    }
    // epx-probe fails any answer whose source (UDP) or getpeername (TCP) is not the Service.
    assert_spread(&env.probe("tcp", &format!("[{VIP6}]:80"), 60), 60);
    assert_spread(&env.probe("udp", &format!("[{VIP6}]:53"), 60), 60);
    assert_spread(&env.probe("tcp", &format!("{VIP4}:80"), 60), 60);
    assert_spread(&env.probe("udp", &format!("[{ONLY6_VIP}]:53"), 60), 60);
    assert_spread(&env.probe("tcp", &format!("[{ONLY6_VIP}]:80"), 60), 60);
    // An IPv6 frontend without endpoints refuses at once, as an IPv4 one does.
    let refused = env.probe("tcp", &format!("[{EMPTY6_VIP}]:80"), 5);
    assert_eq!(refused.errors_of("ECONNREFUSED"), 5, "{refused:?}");
    let dump = env.agent.dump().expect("dump");
    assert!(dump["counters"]["sock_xlate"].as_u64().unwrap_or(0) >= 300, "{:#}", dump["counters"]);
}

#[test]
fn an_ipv6_socket_reaching_an_ipv4_service_through_a_mapped_address_is_balanced() {
    let env = Env::new();
    // A dual-stack application (AF_INET6 socket) connecting to ::ffff:10.96.0.10.
    assert_spread(&env.probe("tcp", &format!("[::ffff:{VIP4}]:80"), 60), 60);
}

#[test]
fn the_node_ipv6_address_gets_node_ports_for_tcp_and_udp() {
    let env = Env::new();
    assert_eq!(env.entries(NODE_IP6, NODE_PORT, "TCP").len(), 2, "{:#}", env.agent.dump().unwrap()["services"]);
    assert!(env.entries(NODE_IP6, NODE_PORT, "TCP").iter().all(|e| e["kind"] == "NodePort"));
    assert_spread(&env.probe("tcp", &format!("[{NODE_IP6}]:{NODE_PORT}"), 60), 60);
    assert_spread(&env.probe("udp", &format!("[{NODE_IP6}]:{NODE_PORT}"), 60), 60);
}

#[test]
fn ipv6_services_survive_an_agent_crash_and_follow_endpoint_changes_after_the_restart() {
    let mut env = Env::new();
    let vip = format!("[{VIP6}]:80");
    // The first start programmed both families.
    assert!(env.agent.map_writes().expect("metrics") > 0);
    env.agent.kill().expect("kill");
    // Pinned links and maps: the kernel keeps serving without the agent.
    assert_spread(&env.probe("tcp", &vip, 40), 40);
    env.agent.restart().expect("restart");
    // The restart found both families programmed and wrote nothing.
    assert_eq!(env.agent.map_writes().expect("metrics"), 0, "{}", env.agent.log_text());
    // be2 leaves the IPv6 slices: new connections go to be1 only.
    env.dir.write_manifest(&manifest(&[BE1_6])).expect("manifest");
    let started = Instant::now();
    while env.entries(VIP6, 80, "TCP").iter().any(|e| e["backends"].as_array().map_or(0, Vec::len) != 1) {
        assert!(started.elapsed() < Duration::from_secs(5), "endpoint change not applied:\n{}", env.agent.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let summary = env.probe("tcp", &vip, 40);
    assert_eq!((summary.ok, summary.answered_by("be1")), (40, 40), "{summary:?}");
    // The IPv4 side of the same Service still has both.
    assert_spread(&env.probe("tcp", &format!("{VIP4}:80"), 40), 40);
}

/// [`Env`] plus an external client with IPv6 on its link to the node, whose link carries the
/// packet-level programs.
fn with_external_client() -> (Env, ExternalClient) {
    let mut client = None;
    let env = Env::with(|topo| {
        let ext = topo.add_external_client("ext").expect("external client");
        topo.enable_external_ipv6(&ext).expect("IPv6 on the client's link");
        let interfaces = format!("--interfaces={}", ext.node_interface);
        client = Some(ext);
        vec![interfaces]
    });
    (env, client.expect("client"))
}

#[test]
fn an_external_ipv6_client_sticks_to_one_backend_of_an_external_ip_and_a_load_balancer_ip() {
    let (env, client) = with_external_client();
    for (ip, cidr) in [(EXTERNAL_IP6, "fd00:192:168:241::/64"), (LB_IP6, "fd00:192:168:242::/64")] {
        client.netns.exec(&["ip", "-6", "route", "add", cidr, "via", EXT_NODE_IP6]).expect("route");
        env.agent.wait_for_external_frontend(ip, 80);
        // sessionAffinity: ClientIP, by the client's IPv6 address on the packet path.
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        let summary = probe::client_with(command, "tcp", &format!("[{ip}]:80"), 15).expect("probe");
        assert_eq!(summary.ok, 15, "{summary:?}");
        assert!(summary.answered_by("be1") == 15 || summary.answered_by("be2") == 15, "15 identical answers: {summary:?}");
        let dump = env.agent.dump().expect("dump");
        let affinity = dump["affinity"].as_array().expect("affinity");
        assert!(
            affinity.iter().any(|a| a["client"] == EXT_CLIENT_IP6 && a["frontend"] == format!("[{ip}]:80").as_str()),
            "an affinity entry for the IPv6 client: {affinity:#?}"
        );
    }
}

#[test]
fn two_ipv6_clients_whose_addresses_fold_alike_get_independent_affinity() {
    // EXT_CLIENT_IP6 with the same 64 bits XORed into both halves: the affinity key of layout v1
    // (the address's halves XORed) was the same for both clients, so the second one was sent to
    // the first one's backend as if it were the same client.
    const CLIENT_B: &str = "fd00:192:168:2b0::f2";
    let (env, client) = with_external_client();
    client.netns.exec(&["ip", "-6", "addr", "add", &format!("{CLIENT_B}/64"), "dev", "eth0", "nodad"]).expect("address B");
    env.topo.node.exec(&["ip", "-6", "route", "add", "fd00:192:168:2b0::/64", "dev", &client.node_interface]).expect("route to B");
    env.agent.wait_for_external_frontend(LB_IP6, 80);
    let connections_from = |source: &str| {
        let route = format!("{LB_IP6}/128");
        client.netns.exec(&["ip", "-6", "route", "replace", &route, "via", EXT_NODE_IP6, "src", source]).expect("route");
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        let summary = probe::client_with(command, "tcp", &format!("[{LB_IP6}]:80"), 10).expect("probe");
        assert_eq!((summary.ok, summary.answers.len()), (10, 1), "10 answers from one backend: {summary:?}");
        summary
    };
    let hits = || e2e::agent::counter(&env.agent.dump().expect("dump"), "affinity_hit");

    connections_from(EXT_CLIENT_IP6);
    let hits_before_b = hits();
    connections_from(CLIENT_B);
    // B's first connection is a pick of its own, not a hit on A's entry; its nine others hit B's.
    assert_eq!(hits() - hits_before_b, 9, "client B was taken for client A");
    let dump = env.agent.dump().expect("dump");
    let clients: Vec<&str> = dump["affinity"]
        .as_array()
        .expect("affinity")
        .iter()
        .filter(|a| a["frontend"] == format!("[{LB_IP6}]:80").as_str())
        .filter_map(|a| a["client"].as_str())
        .collect();
    assert!(clients.contains(&EXT_CLIENT_IP6) && clients.contains(&CLIENT_B), "an entry per client: {clients:?}");
}

#[test]
fn an_external_ipv6_client_reaches_a_node_port_over_tcp_and_udp_and_is_refused_without_endpoints() {
    let (env, client) = with_external_client();
    env.agent.wait_for_external_frontend(EXT_NODE_IP6, NODE_PORT);
    let from_client = |kind: &str, port: u16, count: u32| {
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        probe::client_with(command, kind, &format!("[{EXT_NODE_IP6}]:{port}"), count).expect("probe")
    };
    // Translated by the TC programs on ext0 (the client is in no load-balanced cgroup); the
    // probe fails any answer that does not come from the NodePort address.
    assert_spread(&from_client("tcp", NODE_PORT, 60), 60);
    assert_spread(&from_client("udp", NODE_PORT, 60), 60);
    // A NodePort without endpoints answers ICMPv6 port unreachable. A connected UDP socket
    // gets ECONNREFUSED from it. (A TCP connect() here would not show it: client and node share
    // one kernel, so the error arrives while connect() still holds the socket's lock, and Linux
    // drops it as LockDroppedIcmps; across a real link it fails the connect at once. The
    // packet test checks the reply itself.)
    let mut command = client.command(&e2e::bin("epx-probe")).expect("probe command");
    let to = format!("[{EXT_NODE_IP6}]:{EMPTY_NODE_PORT}");
    let output = command
        .args(["udp-connected", "--to", &to, "--interval-ms", "50", "--duration-ms", "500"])
        .output()
        .expect("connected UDP client");
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("client JSON");
    assert!(result["answers"].as_array().is_some_and(Vec::is_empty), "{result}");
    assert!(result["errors"]["ECONNREFUSED"].as_u64().unwrap_or(0) >= 3, "{result}");

    let dump = env.agent.dump().expect("dump");
    let counter = |name: &str| e2e::agent::counter(&dump, name);
    assert!(counter("tc_dnat") >= 120 && counter("tc_rev_nat") >= 120, "{:#}", dump["counters"]);
    assert!(counter("tc_no_backend_reject") >= 3, "{:#}", dump["counters"]);
    let flows = dump["conntrack"].as_array().expect("conntrack");
    let client_prefix = format!("[{EXT_CLIENT_IP6}]:");
    assert!(
        flows.iter().any(|f| f["client"].as_str().unwrap_or("").starts_with(&client_prefix)
            && f["frontend"] == format!("[{EXT_NODE_IP6}]:{NODE_PORT}").as_str()),
        "no tracked IPv6 flow: {flows:#?}"
    );
}

const FAR6_VIP: &str = "fd00:96::50";
const FAR_NODE_PORT: u16 = 30093;
/// An externalIP of `far6`: SNATed to the IPv6 address of the interface it arrives on.
const FAR_EXTERNAL_IP6: &str = "fd00:192:168:241::20";

#[test]
fn an_ipv6_node_port_and_external_ip_to_a_backend_on_another_node_are_snated_and_the_answers_reach_the_client() {
    let mut topo = Topology::new().expect("topology");
    topo.enable_ipv6().expect("IPv6 on the node");
    let client = topo.add_external_client("ext").expect("external client");
    topo.enable_external_ipv6(&client).expect("IPv6 on the client's link");
    // The other node routes back to this node's NodePort address only, not to the client: an
    // answer reaches the client only if the request came from the node (SNAT).
    let far = topo.add_remote_pod("far", 10, &[&format!("{EXT_NODE_IP6}/128")]).expect("remote pod");
    let far_ip = far.ip6.clone().expect("IPv6 on the other node");
    let _server = probe::serve(&topo, "far", "far", &[8080], &[5353]).expect("server on the other node");
    let service = format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: far6, namespace: demo}}
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: "{FAR6_VIP}"
  clusterIPs: ["{FAR6_VIP}"]
  externalIPs: ["{FAR_EXTERNAL_IP6}"]
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {FAR_NODE_PORT}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {FAR_NODE_PORT}}}
"#
    );
    let endpoints = slice("far6", "far6-v6", "IPv6", &[&far_ip]).replace("nodeName: node-1", "nodeName: node-2");
    assert!(endpoints.contains("nodeName: node-2"), "{endpoints}");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&format!("{service}{endpoints}")).expect("manifest");
    // Replies from the other node arrive on n2: the programs go there too.
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    agent.wait_for_external_frontend(EXT_NODE_IP6, FAR_NODE_PORT);
    agent.wait_for_external_frontend(FAR_EXTERNAL_IP6, 80);
    client.netns.exec(&["ip", "-6", "route", "add", "fd00:192:168:241::/64", "via", EXT_NODE_IP6]).expect("route");
    // The NodePort's flows come from the NodePort address; the externalIP's from the address of
    // the interface they arrived on (recorded by the agent when it attached), the same one here.
    let targets = [
        ("tcp", format!("[{EXT_NODE_IP6}]:{FAR_NODE_PORT}")),
        ("udp", format!("[{EXT_NODE_IP6}]:{FAR_NODE_PORT}")),
        ("tcp", format!("[{FAR_EXTERNAL_IP6}]:80")),
        ("udp", format!("[{FAR_EXTERNAL_IP6}]:53")),
    ];
    for (kind, to) in &targets {
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        let summary = probe::client_with(command, kind, to, 30).expect("probe");
        assert_eq!((summary.ok, summary.answered_by("far")), (30, 30), "{kind} to {to} on the other node: {summary:?}");
    }
    e2e::agent::assert_snated(&agent.dump().expect("dump"), 120);
}

#[test]
fn an_external_ipv6_udp_flow_leaves_a_backend_its_service_dropped_while_another_service_keeps_it() {
    let (env, client) = with_external_client();
    env.agent.wait_for_external_frontend(EXT_NODE_IP6, NODE_PORT);
    let to = format!("[{EXT_NODE_IP6}]:{NODE_PORT}");
    let answer = || probe::udp_flow_answer(client.command(&e2e::bin("epx-probe")).expect("probe command"), &to, 42000).expect("answer");
    let first = answer();
    for _ in 0..5 {
        assert_eq!(answer(), first, "conntrack keeps a UDP flow on its backend");
    }
    let (gone, stays, stays_name) = if first == "be1" { (BE1_6, BE2_6, "be2") } else { (BE2_6, BE1_6, "be1") };
    // `web` drops the flow's backend; `only6` keeps it, so the backend itself stays in the maps
    // and only the agent's purge of the flow's conntrack entry can move the flow.
    env.dir.write_manifest(&manifest_split(&[stays], &[BE1_6, BE2_6])).expect("manifest");
    env.agent.wait_for_log("purged flows of removed backends");
    for _ in 0..5 {
        assert_eq!(answer(), stays_name, "the flow must move off {gone}, which web no longer has");
    }
    let only6 = env.entries(ONLY6_VIP, 53, "UDP");
    assert!(
        only6.iter().all(|e| e["backends"].as_array().is_some_and(|b| b.len() == 2)),
        "only6 keeps both backends: {only6:#?}"
    );
}

#[test]
fn an_ipv4_only_nodeport_addresses_flag_keeps_the_node_ports_of_every_ipv6_address() {
    // kube-proxy filters per family: a family without a CIDR in the flag keeps all its addresses.
    let mut client = None;
    let env = Env::with(|topo| {
        let ext = topo.add_external_client("ext").expect("external client");
        topo.enable_external_ipv6(&ext).expect("IPv6 on the client's link");
        let args = vec![format!("--interfaces={}", ext.node_interface), "--nodeport-addresses=192.168.240.0/24".to_owned()];
        client = Some(ext);
        args
    });
    let client = client.expect("client");
    env.agent.wait_for_external_frontend(EXT_NODE_IP6, NODE_PORT);
    assert_eq!(env.entries("192.168.240.1", NODE_PORT, "TCP").len(), 2, "inside the flag's IPv4 CIDR");
    assert!(env.entries("10.244.1.1", NODE_PORT, "TCP").is_empty(), "outside the flag's IPv4 CIDR: no NodePort");
    assert_eq!(env.entries(NODE_IP6, NODE_PORT, "TCP").len(), 2, "every IPv6 address keeps its NodePort");
    let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
    let summary = probe::client_with(command, "tcp", &format!("[{EXT_NODE_IP6}]:{NODE_PORT}"), 20).expect("probe");
    assert_spread(&summary, 20);
}
