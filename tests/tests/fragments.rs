//! UDP datagrams larger than the MTU (3,000 and 9,000 bytes over 1,500-byte links, so 3 and 7
//! fragments each way) through NodePorts from an external client: to a backend on this node
//! (DNAT on ingress, reverse NAT on egress) and to one on another node (DNAT and SNAT, sent on
//! by the program; the answers come back to the node and are sent on to the client). Every later
//! fragment must get its first fragment's translation, in both directions, in both families.

use e2e::agent::{counter, Agent, AgentDir};
use e2e::probe;
use e2e::topology::{ExternalClient, Topology, EXT_NODE_IP6};

/// `local` (UDP nodePort 30081 -> be1 on this node) and `far` (30091 -> the pod on the other
/// node), of one family.
fn manifest(family: &str, cluster_ips: [&str; 2], local_backend: &str, far_backend: &str) -> String {
    let service = |name: &str, vip: &str, node_port: u16| {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  type: NodePort\n  ipFamilies: [{family}]\n  clusterIP: \"{vip}\"\n  ports:\n  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {node_port}}}\n"
        )
    };
    let slice = |name: &str, ip: &str, node: &str| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-a, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: {family}\nendpoints: [{{addresses: [\"{ip}\"], nodeName: {node}}}]\nports: [{{name: dns, port: 5353, protocol: UDP}}]\n"
        )
    };
    [
        service("local", cluster_ips[0], 30081),
        slice("local", local_backend, "node-1"),
        service("far", cluster_ips[1], 30091),
        slice("far", far_backend, "node-2"),
    ]
    .concat()
}

fn large_datagrams_are_served(client: &ExternalClient, agent: &Agent, node_ip: &str) {
    let host = if node_ip.contains(':') { format!("[{node_ip}]") } else { node_ip.to_owned() };
    for (port, backend) in [(30081, "be1"), (30091, "far")] {
        for size in [3000, 9000] {
            let command = client.command(&e2e::bin("epx-probe")).expect("probe command");
            let to = format!("{host}:{port}");
            let summary = probe::client_with_args(command, "udp", &to, 20, &["--size", &size.to_string()]).expect("probe");
            assert_eq!((summary.ok, summary.answered_by(backend)), (20, 20), "{size}-byte datagrams to {to}: {summary:?}");
        }
    }
    let dump = agent.dump().expect("dump");
    // 3,000 bytes: 2 later fragments each way; 9,000: 6. Per port 20 × 8 × 2 directions.
    assert!(counter(&dump, "tc_fragment_xlate") >= 2 * 20 * 8 * 2, "{:#}", dump["counters"]);
    assert_eq!(counter(&dump, "tc_fragment"), 0, "no fragment went untranslated: {:#}", dump["counters"]);
}

#[test]
fn udp_datagrams_of_3000_and_9000_bytes_are_served_through_node_ports_both_ways_over_ipv4() {
    let mut topo = Topology::new().expect("topology");
    topo.add_pod("be1", 11).expect("pod");
    let _local = probe::serve(&topo, "be1", "be1", &[], &[5353]).expect("server");
    let client = topo.add_external_client("ext").expect("external client");
    let far = topo.add_remote_pod("far", 10, &[&format!("{}/32", client.node_ip)]).expect("remote pod").ip.clone();
    let _far = probe::serve(&topo, "far", "far", &[], &[5353]).expect("server on the other node");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&manifest("IPv4", ["10.96.0.40", "10.96.0.41"], "10.244.1.11", &far)).expect("manifest");
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    agent.wait_for_external_frontend(&client.node_ip, 30091);
    large_datagrams_are_served(&client, &agent, &client.node_ip);
}

#[test]
fn udp_datagrams_of_3000_and_9000_bytes_are_served_through_node_ports_both_ways_over_ipv6() {
    let mut topo = Topology::new().expect("topology");
    topo.enable_ipv6().expect("IPv6 on the node");
    let be1 = topo.add_pod("be1", 11).expect("pod").ip6.clone().expect("IPv6 pod");
    let _local = probe::serve(&topo, "be1", "be1", &[], &[5353]).expect("server");
    let client = topo.add_external_client("ext").expect("external client");
    topo.enable_external_ipv6(&client).expect("IPv6 on the client's link");
    let far = topo.add_remote_pod("far", 10, &[&format!("{EXT_NODE_IP6}/128")]).expect("remote pod").ip6.clone().expect("IPv6");
    let _far = probe::serve(&topo, "far", "far", &[], &[5353]).expect("server on the other node");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&manifest("IPv6", ["fd00:96::40", "fd00:96::41"], &be1, &far)).expect("manifest");
    let interfaces = format!("--interfaces={},n2", client.node_interface);
    let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
    agent.wait_for_external_frontend(EXT_NODE_IP6, 30091);
    large_datagrams_are_served(&client, &agent, EXT_NODE_IP6);
}
