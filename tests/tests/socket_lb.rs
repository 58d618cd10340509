//! End to end, socket-level load balancing: real kernel, real namespaces, real sockets, the real
//! agent reading a manifest file.

use std::time::Duration;

use e2e::scenario::{manifest, Env, EMPTY_VIP, VIP};

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
    // web TCP, web UDP and empty, each with an internal and an external entry.
    assert_eq!(services.len(), 6, "{running}");
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

/// The backend each of `sockets` unconnected sockets got for all of its `datagrams` requests
/// to the UDP ClusterIP; panics if a socket's answers came from more than one backend.
fn one_backend_per_socket(env: &Env, sockets: u32, datagrams: u32) -> Vec<String> {
    (0..sockets)
        .map(|_| {
            let summary = e2e::probe::client_with_args(
                env.topo.command_in("client", &e2e::bin("epx-probe")).expect("client command"),
                "udp",
                &format!("{VIP}:53"),
                datagrams,
                &["--one-socket"],
            )
            .expect("udp probe");
            assert_eq!(summary.ok, datagrams, "{summary:?}");
            // kube-proxy keeps a UDP 5-tuple on its conntrack entry's backend: one socket, one
            // source port, one backend.
            assert_eq!(summary.answers.len(), 1, "one socket's datagrams went to several backends: {summary:?}");
            summary.sequence[0].clone()
        })
        .collect()
}

#[test]
fn an_unconnected_udp_socket_keeps_its_backend_while_new_sockets_spread() {
    let env = Env::new();
    let backends = one_backend_per_socket(&env, 20, 10);
    // 20 sockets all on one backend by chance: 2 in 2^20.
    assert!(backends.iter().any(|b| b == "be1") && backends.iter().any(|b| b == "be2"), "{backends:?}");
    assert!(env.counter("sock_flow_hit") >= 20 * 9, "the later datagrams followed the socket's entry");
}
