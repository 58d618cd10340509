//! NodePort from outside the node: a client in its own namespace, linked to the node by a veth,
//! connects to node-address:nodePort; the agent runs in the node namespace with the packet-level
//! programs on that link (`--interfaces ext0`). Real sockets, real answers from pod backends.

use std::time::Duration;

use aya::programs::{SchedClassifier, TcAttachType};
use e2e::agent::{Agent, AgentDir};
use e2e::kube_scenario::{node_port_service, slice, with_affinity};
use e2e::probe::{self, SteadyTraffic, Summary};
use e2e::scenario;
use e2e::topology::{in_netns, run, ExternalClient, Topology};

const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30081;
const EMPTY_NODE_PORT: u16 = 30082;

/// `web` (TCP 80 -> 8080 on nodePort 30080, UDP 53 -> 5353 on 30081) with be1 and be2 on
/// this node, and `empty`, a NodePort Service without endpoints.
fn manifest() -> String {
    manifest_with(&["10.244.1.11", "10.244.1.12"])
}

/// [`manifest`] with `web`'s endpoints `backends` (all on this node).
fn manifest_with(backends: &[&str]) -> String {
    let web = node_port_service("web", scenario::VIP, TCP_NODE_PORT);
    let slice = slice("web", backends);
    let empty = node_port_service("empty", scenario::EMPTY_VIP, EMPTY_NODE_PORT);
    format!("{web}---\n{slice}---\n{empty}")
}

fn probe_from(client: &ExternalClient, kind: &str, port: u16, count: u32) -> Summary {
    probe_to(client, kind, &client.node_ip, port, count)
}

fn probe_to(client: &ExternalClient, kind: &str, ip: &str, port: u16, count: u32) -> Summary {
    let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
    probe::client_with(command, kind, &format!("{ip}:{port}"), count).expect("probe")
}

/// Names of the tcx programs on the node's side of the client's link, (ingress, egress); `None`
/// on a kernel without tcx (before 6.6), where querying tcx fails with EINVAL.
fn tcx_programs_if_supported(topo: &Topology, client: &ExternalClient) -> Option<(Vec<String>, Vec<String>)> {
    let names = |attach_type| {
        let answer = in_netns(&topo.node.path(), || SchedClassifier::query_tcx(&client.node_interface, attach_type))
            .expect("entering the node namespace");
        match answer {
            Ok((_, programs)) => Some(programs.iter().map(|p| p.name_as_str().unwrap_or("?").to_owned()).collect::<Vec<_>>()),
            Err(error) if error.to_string().contains("Invalid argument") || format!("{error:?}").contains("22") => None,
            Err(error) => panic!("querying tcx: {error}"),
        }
    };
    Some((names(TcAttachType::Ingress)?, names(TcAttachType::Egress)?))
}

/// The tcx programs on the node's side of the client's link (none on a kernel without tcx).
fn tcx_programs(topo: &Topology, client: &ExternalClient) -> (Vec<String>, Vec<String>) {
    tcx_programs_if_supported(topo, client).unwrap_or_default()
}

/// Our programs on the node's side of the client's link, (ingress, egress): the tcx ones where
/// the kernel has tcx, else the classic clsact filters (the fallback `auto` takes there).
fn attached_programs(topo: &Topology, client: &ExternalClient) -> (Vec<String>, Vec<String>) {
    tcx_programs_if_supported(topo, client)
        .unwrap_or_else(|| (classic_programs(topo, client, "ingress"), classic_programs(topo, client, "egress")))
}

/// The node with be1 and be2 serving, an external client, and the agent in the node namespace
/// with the packet-level programs on the client's link. Field order is drop order.
struct Env {
    agent: Agent,
    _dir: AgentDir,
    client: ExternalClient,
    _servers: Vec<probe::Server>,
    topo: Topology,
}

fn start(manifest: &str, extra_args: &[&str]) -> Env {
    let (topo, servers) = scenario::client_and_two_backends();
    let client = topo.add_external_client("ext").expect("external client");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(manifest).expect("manifest");
    let interfaces = format!("--interfaces={}", client.node_interface);
    let args: Vec<&str> = [interfaces.as_str()].into_iter().chain(extra_args.iter().copied()).collect();
    let agent = Agent::start_file_in_node(&topo, &dir, &args).expect("agent");
    Env { agent, _dir: dir, client, _servers: servers, topo }
}

#[test]
fn nodeport_from_an_external_client_reaches_pods_over_tcp_and_udp_and_refuses_without_endpoints() {
    let Env { agent, _dir, client, _servers, topo } = start(&manifest(), &[]);
    agent.wait_for_external_frontend(&client.node_ip, TCP_NODE_PORT);

    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 60);
    assert_eq!(tcp.ok, 60, "TCP to the NodePort from outside: {tcp:?}");
    assert!(tcp.answered_by("be1") > 0 && tcp.answered_by("be2") > 0, "both backends must serve: {tcp:?}");

    // Replies must come from node-address:nodePort (the probe checks the source of each answer).
    let udp = probe_from(&client, "udp", UDP_NODE_PORT, 60);
    assert_eq!(udp.ok, 60, "UDP to the NodePort from outside: {udp:?}");
    assert!(udp.answered_by("be1") > 0 && udp.answered_by("be2") > 0, "both backends must serve: {udp:?}");

    let refused = probe_from(&client, "tcp", EMPTY_NODE_PORT, 5);
    assert_eq!(refused.errors_of("ECONNREFUSED"), 5, "a NodePort without endpoints must refuse at once: {refused:?}");
    assert!(refused.elapsed_ms < 2000, "refusals must not wait for a timeout: {refused:?}");

    // The flows are tracked and visible, and the counters say what happened.
    let dump = agent.dump().expect("dump");
    let flows = dump["conntrack"].as_array().expect("conntrack in dump");
    let frontend = format!("{}:{TCP_NODE_PORT}", client.node_ip);
    assert!(
        flows.iter().any(|f| f["frontend"] == frontend.as_str() && f["client"].as_str().unwrap_or("").starts_with(&client.ip)),
        "no tracked flow from the client to {frontend}: {flows:#?}"
    );
    let counter = |name: &str| e2e::agent::counter(&dump, name);
    assert!(counter("tc_dnat") >= 120, "{:#}", dump["counters"]);
    assert!(counter("tc_rev_nat") >= 120, "{:#}", dump["counters"]);
    assert_eq!(counter("tc_no_backend_reject"), 5, "{:#}", dump["counters"]);

    // Once per direction, pinned: an agent crash keeps serving, a restart swaps the program in
    // place instead of attaching a second copy.
    let attached = (vec!["epx_tc_ingress".to_owned()], vec!["epx_tc_egress".to_owned()]);
    assert_eq!(attached_programs(&topo, &client), attached);
    let mut agent = agent;
    agent.kill().expect("kill");
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 20);
    assert_eq!(tcp.ok, 20, "with the agent dead: {tcp:?}");
    agent.restart().expect("restart");
    assert_eq!(attached_programs(&topo, &client), attached, "a restart must not attach twice");
    let udp = probe_from(&client, "udp", UDP_NODE_PORT, 20);
    assert_eq!(udp.ok, 20, "after the restart: {udp:?}");

    // `cleanup` detaches them: nothing translates the NodePort any more (the node itself has no
    // listener there, so its kernel refuses).
    agent.kill().expect("kill");
    // It runs where the agent runs: a clsact filter (kernels without tcx) is found by interface name.
    let mut cleanup = std::process::Command::new(e2e::bin("ebpf-proxy"));
    e2e::topology::enter_netns_on_exec(&mut cleanup, &topo.node.path()).expect("netns");
    run(cleanup.arg("cleanup").arg("--bpffs").arg(&agent.bpffs)).expect("cleanup");
    assert_eq!(attached_programs(&topo, &client), (Vec::new(), Vec::new()));
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 3);
    assert_eq!((tcp.ok, tcp.errors_of("ECONNREFUSED")), (0, 3), "after cleanup: {tcp:?}");
}

const EXTERNAL_IP: &str = "192.168.241.10";
const LB_IP: &str = "192.168.242.10";

#[test]
fn an_external_ip_and_a_load_balancer_ip_serve_tcp_and_udp_from_outside() {
    let manifest = manifest().replacen(
        &format!("  type: NodePort\n  clusterIP: {}\n", scenario::VIP),
        &format!("  type: LoadBalancer\n  clusterIP: {}\n  externalIPs: [{EXTERNAL_IP}]\n", scenario::VIP),
        1,
    );
    let manifest = manifest.replacen(
        "---\napiVersion: discovery.k8s.io/v1",
        &format!("status: {{loadBalancer: {{ingress: [{{ip: {LB_IP}}}]}}}}\n---\napiVersion: discovery.k8s.io/v1"),
        1,
    );
    assert!(manifest.contains(EXTERNAL_IP) && manifest.contains(LB_IP), "{manifest}");
    let env = start(&manifest, &[]);
    // The client reaches those addresses through the node, as through a router or a cloud LB.
    env.client.route_via_node("192.168.241.0/24").expect("route");
    env.client.route_via_node("192.168.242.0/24").expect("route");
    for ip in [EXTERNAL_IP, LB_IP] {
        env.agent.wait_for_external_frontend(ip, 80);
        let tcp = probe_to(&env.client, "tcp", ip, 80, 40);
        assert_eq!(tcp.ok, 40, "TCP to {ip}:80 from outside: {tcp:?}");
        assert!(tcp.answered_by("be1") > 0 && tcp.answered_by("be2") > 0, "both backends must serve: {tcp:?}");
        let udp = probe_to(&env.client, "udp", ip, 53, 40);
        assert_eq!(udp.ok, 40, "UDP to {ip}:53 from outside: {udp:?}");
        // A port the Service does not have is not translated (nothing answers there).
        let other = probe_to(&env.client, "tcp", ip, 81, 1);
        assert_eq!(other.ok, 0, "{ip}:81 is no frontend: {other:?}");
    }
}

const FAR_EXTERNAL_IP: &str = "192.168.241.20";

#[test]
fn nodeport_and_external_ip_to_a_backend_on_another_node_are_snated_and_the_answers_reach_the_client() {
    let mut topo = Topology::new().expect("topology");
    let client = topo.add_external_client("ext").expect("external client");
    // The other node knows the way back to this node's address only, not to the client: an
    // answer reaches the client only if the request came from the node (SNAT).
    let endpoint = topo.add_remote_pod("far", 10, &[&format!("{}/32", client.node_ip)]).expect("remote pod").ip.clone();
    let _server = probe::serve(&topo, "far", "far", &[8080], &[5353]).expect("server on the other node");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    // `far`: NodePorts 30090 (TCP) and 30091 (UDP) and an externalIP, its only endpoint on the
    // other node.
    let far = node_port_service("far", "10.96.0.30", 30090)
        .replacen("  clusterIP: 10.96.0.30\n", &format!("  clusterIP: 10.96.0.30\n  externalIPs: [{FAR_EXTERNAL_IP}]\n"), 1);
    assert!(far.contains(FAR_EXTERNAL_IP), "{far}");
    let far_slice = slice("far", &[&endpoint]).replace("nodeName: node-1", "nodeName: node-2");
    assert!(far_slice.contains("nodeName: node-2"), "{far_slice}");
    dir.write_manifest(&format!("{far}---\n{far_slice}")).expect("manifest");
    // Replies from the other node arrive on n2: the programs go there too.
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    agent.wait_for_external_frontend(&client.node_ip, 30090);

    let tcp = probe_from(&client, "tcp", 30090, 30);
    assert_eq!((tcp.ok, tcp.answered_by("far")), (30, 30), "TCP via the NodePort to the other node: {tcp:?}");
    let udp = probe_from(&client, "udp", 30091, 30);
    assert_eq!((udp.ok, udp.answered_by("far")), (30, 30), "UDP via the NodePort to the other node: {udp:?}");
    // The externalIP is no node address: its traffic is SNATed to the address of the interface
    // it arrived on (ext0's), which the other node can answer.
    client.route_via_node("192.168.241.0/24").expect("route");
    agent.wait_for_external_frontend(FAR_EXTERNAL_IP, 80);
    let tcp = probe_to(&client, "tcp", FAR_EXTERNAL_IP, 80, 30);
    assert_eq!((tcp.ok, tcp.answered_by("far")), (30, 30), "TCP via the externalIP to the other node: {tcp:?}");
    let udp = probe_to(&client, "udp", FAR_EXTERNAL_IP, 53, 30);
    assert_eq!((udp.ok, udp.answered_by("far")), (30, 30), "UDP via the externalIP to the other node: {udp:?}");

    e2e::agent::assert_snated(&agent.dump().expect("dump"), 120);
}

#[test]
fn the_external_ip_snat_source_follows_an_address_change_on_the_interface() {
    let mut topo = Topology::new().expect("topology");
    let client = topo.add_external_client("ext").expect("external client");
    // ext0 gets a second address; once the first is removed, the second becomes ext0's only
    // (and so its SNAT source). The other node answers only that second address.
    const SECOND: &str = "192.168.240.3";
    topo.node.exec(&["sysctl", "-qw", &format!("net.ipv4.conf.{}.promote_secondaries=1", client.node_interface)]).expect("sysctl");
    topo.node.exec(&["ip", "addr", "add", &format!("{SECOND}/24"), "dev", &client.node_interface]).expect("second address");
    let endpoint = topo.add_remote_pod("far", 10, &[&format!("{SECOND}/32")]).expect("remote pod").ip.clone();
    let _server = probe::serve(&topo, "far", "far", &[8080], &[5353]).expect("server on the other node");
    let far = node_port_service("far", "10.96.0.30", 30090)
        .replacen("  clusterIP: 10.96.0.30\n", &format!("  clusterIP: 10.96.0.30\n  externalIPs: [{FAR_EXTERNAL_IP}]\n"), 1);
    let far_slice = slice("far", &[&endpoint]).replace("nodeName: node-1", "nodeName: node-2");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&format!("{far}---\n{far_slice}")).expect("manifest");
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    client.netns.exec(&["ip", "route", "add", "192.168.241.0/24", "via", SECOND]).expect("route");
    agent.wait_for_external_frontend(FAR_EXTERNAL_IP, 80);

    // Every UDP request comes from a client port of its own: a flow SNATed to the old address
    // stays tracked, with that address, until it times out.
    let udp_from = |port: u16, count: u32| {
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        let to = format!("{FAR_EXTERNAL_IP}:53");
        probe::client_with_args(command, "udp", &to, count, &["--source-port", &port.to_string()]).expect("probe")
    };
    // SNAT to the lowest address, the first one: the other node cannot answer it.
    let before = udp_from(44000, 2);
    assert_eq!(before.ok, 0, "SNATed to {}, which the other node does not answer: {before:?}", client.node_ip);

    topo.node.exec(&["ip", "addr", "del", &format!("{}/24", client.node_ip), "dev", &client.node_interface]).expect("del");
    // The kernel announces the change to the agent (rtnetlink); its backstop re-read is a
    // minute away, past this wait.
    let started = std::time::Instant::now();
    let mut port = 44100;
    while udp_from(port, 1).ok == 0 {
        assert!(started.elapsed() < Duration::from_secs(6), "still no answer 6 s after the change:\n{}", agent.log_text());
        port += 1;
    }
    assert!(agent.log_text().contains(&format!("addr={SECOND}")), "the new SNAT source is logged:\n{}", agent.log_text());
    let tcp = probe_to(&client, "tcp", FAR_EXTERNAL_IP, 80, 20);
    assert_eq!((tcp.ok, tcp.answered_by("far")), (20, 20), "TCP SNATed to the new address: {tcp:?}");
    let udp = udp_from(45000, 20);
    assert_eq!((udp.ok, udp.answered_by("far")), (20, 20), "UDP SNATed to the new address: {udp:?}");
}

/// Our classic tc filters on the node's side of the client's link in `direction` (`ingress` or
/// `egress`), by program name.
fn classic_programs(topo: &Topology, client: &ExternalClient, direction: &str) -> Vec<String> {
    let output = topo.node.exec(&["tc", "filter", "show", "dev", &client.node_interface, direction]).expect("tc filter show");
    // One line per filter: `filter protocol all pref 49152 bpf chain 0 handle 0x1 epx_tc_ingress ...`.
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.contains(" bpf "))
        .filter_map(|line| line.split_whitespace().find(|word| word.starts_with("epx_tc_")))
        .map(|name| name.split(':').next().unwrap_or(name).to_owned())
        .collect()
}

/// How many of our classic tc filters there are in `direction`.
fn classic_filters(topo: &Topology, client: &ExternalClient, direction: &str) -> usize {
    classic_programs(topo, client, direction).len()
}

#[test]
fn without_tcx_the_programs_go_on_a_clsact_qdisc_and_cleanup_removes_them() {
    // `legacy` takes the path kernels before 6.6 get, on this kernel.
    let Env { mut agent, _dir, client, _servers, topo } = start(&manifest(), &["--tc-attach=legacy"]);
    agent.wait_for_external_frontend(&client.node_ip, TCP_NODE_PORT);
    assert_eq!(tcx_programs(&topo, &client), (Vec::new(), Vec::new()), "no tcx link in legacy mode");
    assert_eq!((classic_filters(&topo, &client, "ingress"), classic_filters(&topo, &client, "egress")), (1, 1));
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 20);
    assert_eq!(tcp.ok, 20, "{tcp:?}");

    // The filters outlive the agent; a restart replaces them instead of adding more.
    agent.kill().expect("kill");
    let udp = probe_from(&client, "udp", UDP_NODE_PORT, 20);
    assert_eq!(udp.ok, 20, "with the agent dead: {udp:?}");
    agent.restart().expect("restart");
    assert_eq!((classic_filters(&topo, &client, "ingress"), classic_filters(&topo, &client, "egress")), (1, 1));
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 20);
    assert_eq!(tcp.ok, 20, "after the restart: {tcp:?}");

    // `cleanup` (where the agent runs: the filters are found by interface name) removes them.
    agent.kill().expect("kill");
    let mut cleanup = std::process::Command::new(e2e::bin("ebpf-proxy"));
    e2e::topology::enter_netns_on_exec(&mut cleanup, &topo.node.path()).expect("netns");
    run(cleanup.arg("cleanup").arg("--bpffs").arg(&agent.bpffs)).expect("cleanup");
    assert_eq!((classic_filters(&topo, &client, "ingress"), classic_filters(&topo, &client, "egress")), (0, 0));
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 3);
    assert_eq!((tcp.ok, tcp.errors_of("ECONNREFUSED")), (0, 3), "after cleanup: {tcp:?}");
}

#[test]
fn long_lived_streams_from_outside_keep_their_backend_while_the_backend_set_changes() {
    // Each stream picks one of two backends at random: with 24 of them, the chance that none runs
    // on be2 (and the test proves nothing about be2's streams) is 2^-24. With 8 it was 1 in 256,
    // and it happened in CI.
    const STREAMS: u32 = 24;
    let env = start(&manifest(), &[]);
    env.agent.wait_for_external_frontend(&env.client.node_ip, TCP_NODE_PORT);
    let node = &env.client.node_ip;
    let traffic = SteadyTraffic::start_with(
        env.client.command(&e2e::bin("epx-probe")).expect("probe command"),
        &format!("{node}:{TCP_NODE_PORT}"),
        &format!("{node}:{UDP_NODE_PORT}"),
        20,
        STREAMS,
        Duration::from_secs(4),
    )
    .expect("steady traffic");
    // be2 leaves the Service (its pod keeps running, as a terminating one would), then returns;
    // each change is waited for until the datapath shows it, while the traffic runs.
    let backends = |env: &Env| -> usize {
        let entries = env.agent.entries(node, TCP_NODE_PORT, "TCP");
        entries.iter().find(|e| e["scope"] == "external").and_then(|e| e["backends"].as_array().map(Vec::len)).unwrap_or(0)
    };
    let wait_backends = |env: &Env, count: usize| {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while backends(env) != count {
            assert!(std::time::Instant::now() < deadline, "the NodePort never had {count} backends");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    std::thread::sleep(Duration::from_secs(1));
    env._dir.write_manifest(&manifest_with(&["10.244.1.11"])).expect("manifest without be2");
    wait_backends(&env, 1);
    std::thread::sleep(Duration::from_secs(1));
    env._dir.write_manifest(&manifest()).expect("manifest with be2 again");
    wait_backends(&env, 2);
    let seen = traffic.finish().expect("steady result");
    assert_eq!(seen.failed(), 0, "no request, connection or stream may fail: {seen:?}");
    assert_eq!(seen.streams.ok, STREAMS, "{seen:?}");
    assert!(seen.streams.answered_by("be2") > 0, "some stream must have run on be2 through the change: {seen:?}");
}

#[test]
fn session_affinity_keeps_an_external_client_on_one_backend() {
    let sticky = with_affinity(&node_port_service("web", scenario::VIP, TCP_NODE_PORT), 600);
    let manifest = format!("{sticky}---\n{}", slice("web", &["10.244.1.11", "10.244.1.12"]));
    let Env { agent, _dir, client, _servers, topo: _topo } = start(&manifest, &[]);
    agent.wait_for_external_frontend(&client.node_ip, TCP_NODE_PORT);

    // Each connection is a new flow (new source port): only affinity keeps the backend.
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 15);
    assert_eq!((tcp.ok, tcp.answers.len()), (15, 1), "15 identical answers in a row: {tcp:?}");
    let udp = probe_from(&client, "udp", UDP_NODE_PORT, 15);
    assert_eq!((udp.ok, udp.answers.len()), (15, 1), "15 identical answers in a row: {udp:?}");
    let dump = agent.dump().expect("dump");
    let entries = dump["affinity"].as_array().expect("affinity in dump");
    assert!(
        entries.iter().any(|e| e["client"] == client.ip.as_str() && e["frontend"] == format!("{}:{TCP_NODE_PORT}", client.node_ip)),
        "no affinity entry keyed by the client's address: {entries:#?}"
    );
    assert!(dump["counters"]["affinity_hit"].as_u64() >= Some(28), "{:#}", dump["counters"]);
}

#[test]
fn the_same_node_port_number_serves_tcp_and_udp_at_once_from_outside() {
    // As kube-apiserver allows it: one Service port number (53) on both protocols shares one
    // nodePort.
    let service = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: dns, namespace: demo}}
spec:
  type: NodePort
  clusterIP: {}
  ports:
  - {{name: http, port: 53, targetPort: 8080, protocol: TCP, nodePort: {TCP_NODE_PORT}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {TCP_NODE_PORT}}}
"#,
        scenario::VIP
    );
    let dns = format!("{service}---\n{}", slice("dns", &["10.244.1.11", "10.244.1.12"]));
    let Env { agent, _dir, client, _servers, topo: _topo } = start(&dns, &[]);
    agent.wait_for_external_frontend(&client.node_ip, TCP_NODE_PORT);
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 30);
    let udp = probe_from(&client, "udp", TCP_NODE_PORT, 30);
    assert_eq!((tcp.ok, udp.ok), (30, 30), "TCP and UDP on one nodePort: {tcp:?} {udp:?}");
}

#[test]
fn external_traffic_policy_local_serves_only_local_endpoints_and_keeps_the_client_address() {
    let mut topo = Topology::new().expect("topology");
    topo.add_pod("be1", 11).expect("be1 pod");
    let client = topo.add_external_client("ext").expect("external client");
    // The other node answers only to this node's address: without SNAT it could not answer.
    let far = topo.add_remote_pod("far", 10, &[&format!("{}/32", client.node_ip)]).expect("remote pod").ip.clone();
    let _servers = [
        probe::serve_with_peer(&topo, "be1", "be1", &[], &[], &[8081]).expect("be1 server"),
        probe::serve_with_peer(&topo, "far", "far", &[], &[], &[8081]).expect("far server"),
    ];
    let service = |name: &str, vip: &str, node_port: u16, policy: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  type: NodePort\n  \
             externalTrafficPolicy: {policy}\n  clusterIP: {vip}\n  ports:\n  - {{name: http, port: 80, targetPort: 8081, \
             protocol: TCP, nodePort: {node_port}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
             name: {name}-abc\n  namespace: demo\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\n\
             endpoints:\n- {{addresses: [10.244.1.11], conditions: {{ready: true}}, nodeName: node-1}}\n\
             - {{addresses: [{far}], conditions: {{ready: true}}, nodeName: node-2}}\nports:\n- {{name: http, port: 8081, protocol: TCP}}\n"
        )
    };
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&format!(
        "{}---\n{}",
        service("local", "10.96.0.60", 30100, "Local"),
        service("cluster", "10.96.0.61", 30101, "Cluster")
    ))
    .expect("manifest");
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    agent.wait_for_external_frontend(&client.node_ip, 30100);
    agent.wait_for_external_frontend(&client.node_ip, 30101);

    // Local: only the endpoint on this node, and it sees the client's own address.
    let local = probe_from(&client, "tcp", 30100, 30);
    assert_eq!(local.ok, 30, "{local:?}");
    assert_eq!(local.answered_by(&format!("be1 from {}", client.ip)), 30, "only be1, seeing the client's address: {local:?}");

    // Cluster: both endpoints; the one on the other node sees this node's address (SNAT), the
    // local one the client's.
    let cluster = probe_from(&client, "tcp", 30101, 60);
    assert_eq!(cluster.ok, 60, "{cluster:?}");
    let far_answers = cluster.answered_by(&format!("far from {}", client.node_ip));
    let local_answers = cluster.answered_by(&format!("be1 from {}", client.ip));
    assert!(far_answers > 0 && local_answers > 0 && far_answers + local_answers == 60, "{cluster:?}");
}

/// The Maglev table the agent pinned for the frontend with `rev_nat_id` (slot -> backend id).
fn pinned_maglev_table(agent: &Agent, rev_nat_id: u16) -> Vec<u32> {
    use aya::maps::{HashMap, Map, MapData};
    let data = MapData::from_pin(agent.bpffs.join(proxy_abi::map_name::MAGLEV4)).expect("pinned Maglev map");
    let map: HashMap<MapData, u32, proxy_abi::MaglevTable4> =
        HashMap::try_from(Map::from_map_data(data).expect("map")).expect("typed");
    map.get(&u32::from(rev_nat_id), 0).expect("the frontend's table").backend_ids.to_vec()
}

#[test]
fn with_maglev_each_external_flow_goes_to_the_backend_the_table_names_for_its_hash() {
    let Env { agent, _dir, client, _servers, topo: _topo } = start(&manifest(), &["--lb-algorithm=maglev"]);
    agent.wait_for_external_frontend(&client.node_ip, UDP_NODE_PORT);
    let dump = agent.dump().expect("dump");
    let services = dump["services"].as_array().expect("services");
    let frontend = services
        .iter()
        .find(|s| s["ip"] == client.node_ip.as_str() && s["port"] == UDP_NODE_PORT && s["scope"] == "external")
        .expect("the external UDP NodePort frontend");
    // Two backends share the 4093 slots evenly.
    let shares = &frontend["maglevSlots"];
    let (a, b) = (shares["10.244.1.11:5353"].as_u64(), shares["10.244.1.12:5353"].as_u64());
    assert!(matches!((a, b), (Some(a), Some(b)) if a + b == 4093 && a.abs_diff(b) <= 1), "{frontend:#}");
    // Socket-level entries (the node's own clients) keep picking at random.
    let internal = services
        .iter()
        .find(|s| s["ip"] == client.node_ip.as_str() && s["port"] == UDP_NODE_PORT && s["scope"] == "internal")
        .expect("the internal entry");
    assert!(internal["maglevSlots"].is_null(), "{internal:#}");

    let rev_nat_id = frontend["revNatId"].as_u64().expect("revNatId") as u16;
    let table = pinned_maglev_table(&agent, rev_nat_id);
    let name_of = |id: u32| {
        let backend = frontend["backends"].as_array().unwrap().iter().find(|b| b["id"] == id).expect("a listed backend");
        match backend["ip"].as_str() {
            Some("10.244.1.11") => "be1",
            Some("10.244.1.12") => "be2",
            other => panic!("unexpected backend {other:?}"),
        }
    };
    // 40 flows, each from a known source port: every answer comes from the predicted backend.
    let first_port = 41_000u16;
    let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
    let to = format!("{}:{UDP_NODE_PORT}", client.node_ip);
    let udp = probe::client_with_args(command, "udp", &to, 40, &["--source-port", &first_port.to_string()]).expect("probe");
    assert_eq!((udp.ok, udp.sequence.len()), (40, 40), "{udp:?}");
    let client_ip: std::net::Ipv4Addr = client.ip.parse().expect("client IP");
    for (i, answer) in udp.sequence.iter().enumerate() {
        let port = first_port + i as u16;
        let hash = proxy_abi::maglev::flow_hash(
            u32::from_ne_bytes(client_ip.octets()),
            port.to_be(),
            UDP_NODE_PORT.to_be(),
            proxy_abi::IPPROTO_UDP,
        );
        let expected = name_of(table[proxy_abi::maglev::slot(hash)]);
        assert_eq!(answer, expected, "flow from source port {port}");
    }
    assert!(udp.answered_by("be1") > 0 && udp.answered_by("be2") > 0, "{udp:?}");
    let dump = agent.dump().expect("dump");
    assert!(dump["counters"]["tc_maglev_pick"].as_u64().unwrap_or(0) >= 40, "{:#}", dump["counters"]);
    assert_eq!(dump["counters"]["tc_maglev_miss"].as_u64(), Some(0), "{:#}", dump["counters"]);

    // TCP to the same Service spreads over both backends too.
    let tcp = probe_from(&client, "tcp", TCP_NODE_PORT, 40);
    assert_eq!(tcp.ok, 40, "{tcp:?}");
    assert!(tcp.answered_by("be1") > 0 && tcp.answered_by("be2") > 0, "{tcp:?}");
}

#[test]
fn an_external_udp_flow_leaves_a_backend_its_service_dropped_while_another_service_keeps_it() {
    // `twin` has the same endpoints as `web`: its backends are the same entries in the maps.
    let twin = |backends: &[&str]| {
        let service = node_port_service("twin", "10.96.0.30", 30110);
        format!("---\n{service}---\n{}", slice("twin", backends))
    };
    let both = ["10.244.1.11", "10.244.1.12"];
    let env = start(&format!("{}{}", manifest(), twin(&both)), &[]);
    env.agent.wait_for_external_frontend(&env.client.node_ip, UDP_NODE_PORT);
    let to = format!("{}:{UDP_NODE_PORT}", env.client.node_ip);
    let answer = || probe::udp_flow_answer(env.client.command(&e2e::bin("epx-probe")).expect("probe command"), &to, 42000).expect("answer");
    let first = answer();
    for _ in 0..5 {
        assert_eq!(answer(), first, "conntrack keeps a UDP flow on its backend");
    }
    let (stays, stays_name) = if first == "be1" { (both[1], "be2") } else { (both[0], "be1") };
    // `web` drops the flow's backend, `twin` keeps it: only the agent's purge of the flow's
    // conntrack entry can move the flow.
    env._dir.write_manifest(&format!("{}{}", manifest_with(&[stays]), twin(&both))).expect("manifest");
    env.agent.wait_for_log("purged flows of removed backends");
    for _ in 0..5 {
        assert_eq!(answer(), stays_name, "the flow must move off {first}, which web no longer has");
    }
    let twin_entries = env.agent.entries("10.96.0.30", 53, "UDP");
    assert!(
        !twin_entries.is_empty() && twin_entries.iter().all(|e| e["backends"].as_array().is_some_and(|b| b.len() == 2)),
        "twin keeps both backends: {twin_entries:#?}"
    );
}

/// backend address -> backend id of the external UDP NodePort frontend on `ip`, as `agent` has it.
fn backend_ids(agent: &Agent, ip: &str) -> std::collections::BTreeMap<String, u64> {
    let entries = agent.entries(ip, UDP_NODE_PORT, "UDP");
    let external = entries.iter().find(|e| e["scope"] == "external").expect("the external UDP NodePort frontend");
    let backends = external["backends"].as_array().expect("backends");
    backends.iter().map(|b| (b["ip"].as_str().unwrap_or("?").to_owned(), b["id"].as_u64().unwrap_or(0))).collect()
}

#[test]
fn with_maglev_two_nodes_whose_agents_numbered_the_backends_differently_send_each_flow_to_the_same_backend() {
    // node-1 first knows be2 alone, then be1 joins: its backend ids differ from those of
    // node-2, whose agent starts when both are there.
    let Env { agent: node1, _dir: dir, client, _servers, mut topo } =
        start(&manifest_with(&["10.244.1.12"]), &["--lb-algorithm=maglev"]);
    node1.wait_for_external_frontend(&client.node_ip, UDP_NODE_PORT);
    dir.write_manifest(&manifest()).expect("manifest with be1");
    let started = std::time::Instant::now();
    while backend_ids(&node1, &client.node_ip).len() != 2 {
        assert!(started.elapsed() < Duration::from_secs(5), "be1 not added:\n{}", node1.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    // node-2: one namespace on the far side of n2 (192.168.250.2), routing back through node-1
    // to the pods there and to the client, with its own agent, TC programs on its link, and
    // Maglev. For node-2 both endpoints are remote: its flows are SNATed.
    topo.add_remote_pod("node2", 10, &["10.244.1.0/24", "192.168.240.0/24"]).expect("node-2");
    let node2_netns = topo.pod("node2").netns.path();
    topo.pod("node2").netns.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]).expect("forwarding on node-2");
    let node2_pods = e2e::topology::Cgroup::create(&format!("{}-{}-node-2", e2e::PREFIX, topo.id)).expect("cgroup");
    let node2 = Agent::start_other_node(&node1, "node-2", &node2_pods.path, &node2_netns, &["--interfaces=eth0", "--lb-algorithm=maglev"])
        .expect("node-2 agent");
    const NODE2_IP: &str = "192.168.250.2";
    node2.wait_for_external_frontend(NODE2_IP, UDP_NODE_PORT);
    client.route_via_node("192.168.250.0/24").expect("route to node-2");
    let (ids1, ids2) = (backend_ids(&node1, &client.node_ip), backend_ids(&node2, NODE2_IP));
    assert_eq!(ids1.keys().collect::<Vec<_>>(), ids2.keys().collect::<Vec<_>>(), "the same backends");
    assert_ne!(ids1, ids2, "the agents must have numbered the backends differently for this test");

    // The same 30 flows (client address and ports) through either node reach the same backends.
    let flows = |to: &str| {
        let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
        let summary = probe::client_with_args(command, "udp", to, 30, &["--source-port", "43000"]).expect("probe");
        assert_eq!((summary.ok, summary.sequence.len()), (30, 30), "through {to}: {summary:?}");
        summary.sequence
    };
    let via_node1 = flows(&format!("{}:{UDP_NODE_PORT}", client.node_ip));
    let via_node2 = flows(&format!("{NODE2_IP}:{UDP_NODE_PORT}"));
    assert_eq!(via_node1, via_node2, "each flow must reach the same backend through either node");
    assert!(via_node1.iter().any(|b| b == "be1") && via_node1.iter().any(|b| b == "be2"), "{via_node1:?}");
    let counter = |agent: &Agent, name: &str| e2e::agent::counter(&agent.dump().expect("dump"), name);
    assert!(counter(&node1, "tc_maglev_pick") >= 30 && counter(&node2, "tc_maglev_pick") >= 30);
    assert!(counter(&node2, "tc_snat") >= 30, "node-2's flows go to node-1's pods through SNAT");
}
