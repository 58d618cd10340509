//! Stale flows: a local client's connected UDP socket was translated once, at connect(). When
//! its backend is removed, the agent aborts the socket so the client reconnects to a live backend
//! instead of talking to a removed one forever.

use std::time::Duration;

use e2e::scenario::{manifest, Env, VIP};

fn wait_backends(env: &Env, count: usize) {
    for _ in 0..100 {
        let dump = env.agent.dump().expect("dump");
        let web = dump["services"].as_array().expect("services").iter().find(|s| {
            s["ip"] == VIP && s["port"] == 53 && s["scope"] == "internal"
        }).cloned();
        if web.is_some_and(|w| w["backends"].as_array().map(Vec::len) == Some(count)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("web did not get {count} backends\n{}", env.agent.log_text());
}

/// `epx-probe` with `args` in the client pod against the UDP ClusterIP, a request every 20 ms.
fn client(env: &Env, args: &[&str]) -> std::process::Child {
    env.topo
        .command_in("client", &e2e::bin("epx-probe"))
        .expect("client command")
        .args(args)
        .args(["--to", &format!("{VIP}:53"), "--interval-ms", "20"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the UDP client")
}

/// `epx-probe udp-connected` for `duration_ms`: one connected socket.
fn connected_client(env: &Env, duration_ms: u32) -> std::process::Child {
    client(env, &["udp-connected", "--duration-ms", &duration_ms.to_string()])
}

/// What the connected client reported: its JSON, and the answers in order.
fn client_result(client: std::process::Child) -> (serde_json::Value, Vec<String>) {
    let output = client.wait_with_output().expect("client result");
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("client JSON");
    let answers = result["answers"].as_array().expect("answers").iter().filter_map(|a| a.as_str().map(str::to_owned)).collect();
    (result, answers)
}

#[test]
fn a_connected_udp_client_moves_to_a_live_backend_when_its_backend_is_removed() {
    let env = Env::new();
    // Only be1 at first, so the client's socket is connected to be1.
    env.dir.write_manifest(&manifest(&["10.244.1.11"])).expect("only be1");
    wait_backends(&env, 1);
    let client = connected_client(&env, 4000);

    // A new backend does not disturb the socket.
    std::thread::sleep(Duration::from_millis(1000));
    env.dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12"])).expect("add be2");
    wait_backends(&env, 2);
    // be1 is removed, but its server keeps running: a stale socket would still get answers from
    // it, which is exactly what must not happen.
    std::thread::sleep(Duration::from_millis(1000));
    env.dir.write_manifest(&manifest(&["10.244.1.12"])).expect("remove be1");
    let (result, answers) = client_result(client);
    eprintln!("errors {} reconnects {}", result["errors"], result["reconnects"]);
    assert!(answers.len() > 100, "the client did not really run: {result}");
    let switched = answers.iter().position(|a| *a == "be2").expect("the client must reach be2 after be1 is removed");
    // ~2 s on be1 (before and after be2 was added), then be2 only, soon after the removal.
    assert!(switched > 60, "the socket left be1 before it was removed: {answers:?}");
    assert!(answers[switched..].iter().all(|a| *a == "be2"), "back on the removed backend: {answers:?}");
    assert!(answers.len() - switched > 40, "the switch took too long: {answers:?}");
    assert_eq!(result["reconnects"].as_u64(), Some(1), "exactly one abort, of the stale socket: {result}");
    assert!(env.agent.log_text().contains("aborted connected UDP sockets of removed backends"));
}

#[test]
fn a_connected_udp_socket_to_a_backend_removed_while_the_agent_was_down_is_aborted_when_it_returns() {
    let mut env = Env::new();
    env.dir.write_manifest(&manifest(&["10.244.1.11"])).expect("only be1");
    wait_backends(&env, 1);
    let client = connected_client(&env, 5000);
    std::thread::sleep(Duration::from_millis(1000));
    // be1 goes while nobody watches: the restarted agent must still abort the socket to it.
    env.agent.kill().expect("kill");
    env.dir.write_manifest(&manifest(&["10.244.1.12"])).expect("only be2");
    env.agent.restart().expect("restart");
    wait_backends(&env, 1);
    let (result, answers) = client_result(client);
    assert!(answers.len() > 100, "the client did not really run: {result}");
    let switched = answers.iter().position(|a| *a == "be2").expect("the client must reach be2 after the restart");
    assert!(answers[switched..].iter().all(|a| *a == "be2"), "back on the removed backend: {answers:?}");
    assert!(answers.len() - switched > 40, "the switch took too long: {answers:?}");
    assert_eq!(result["reconnects"].as_u64(), Some(1), "exactly one abort, of the stale socket: {result}");
}

/// `epx-probe udp --one-socket`: `count` requests from one unconnected socket.
fn unconnected_client(env: &Env, count: u32) -> std::process::Child {
    client(env, &["udp", "--one-socket", "--count", &count.to_string(), "--timeout-ms", "300"])
}

#[test]
fn an_unconnected_udp_socket_stays_on_its_backend_and_moves_when_it_is_removed() {
    let env = Env::new();
    env.dir.write_manifest(&manifest(&["10.244.1.11"])).expect("only be1");
    wait_backends(&env, 1);
    let client = unconnected_client(&env, 200);

    // A new backend does not move the socket's datagrams (they stay on be1 as a conntrack entry
    // would keep them)...
    std::thread::sleep(Duration::from_millis(1000));
    env.dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12"])).expect("add be2");
    wait_backends(&env, 2);
    std::thread::sleep(Duration::from_millis(1000));
    // ... but the removal of be1 (its server still answering) does, at once and for good.
    env.dir.write_manifest(&manifest(&["10.244.1.12"])).expect("remove be1");
    let output = client.wait_with_output().expect("client result");
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("client JSON");
    let answers: Vec<&str> = summary["sequence"].as_array().expect("sequence").iter().filter_map(|a| a.as_str()).collect();
    let switched = answers.iter().position(|a| *a == "be2").expect("the socket must reach be2 after be1 is removed");
    assert!(switched > 80, "the socket left be1 before it was removed: {answers:?}");
    assert!(answers[..switched].iter().all(|a| *a == "be1"), "{answers:?}");
    assert!(answers[switched..].iter().all(|a| *a == "be2"), "back on the removed backend: {answers:?}");
    assert!(answers.len() - switched > 40, "the switch took too long: {answers:?}");
}
