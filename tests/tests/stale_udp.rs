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

/// `epx-probe udp-connected` in the client pod against the UDP ClusterIP for `duration_ms`.
fn connected_client(env: &Env, duration_ms: u32) -> std::process::Child {
    env.topo
        .command_in("client", &e2e::bin("epx-probe"))
        .expect("client command")
        .args(["udp-connected", "--to", &format!("{VIP}:53"), "--interval-ms", "20", "--duration-ms", &duration_ms.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the connected UDP client")
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
