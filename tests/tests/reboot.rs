//! A node that reboots while the API server is down: bpffs comes back empty, and the agent must
//! bring Service routing back from its own checkpoint.

use std::time::Duration;

use e2e::kube_scenario::{node_port_service, slice, KubeEnv, NODE_IP, OTHER_VIP, VIP};
use e2e::probe;

fn healthz(env: &KubeEnv) -> (u16, serde_json::Value) {
    let (status, body) = env.agent.get(false, "/healthz").expect("healthz");
    (status, serde_json::from_str(&body).expect("healthz json"))
}

/// Waits until `/healthz` says the checkpoint on disk holds what the datapath was given.
fn wait_for_checkpoint(env: &KubeEnv) {
    env.within(Duration::from_secs(5), "writing the checkpoint", |e| healthz(e).1["checkpointCurrent"] == true);
}

const NODE_PORT: u16 = 30080;

/// A NodePort Service with two endpoints programmed and checkpointed; then the API server goes
/// down and the node reboots (agent gone, bpffs empty). Returns the NodePort's `ip:port`.
fn reboot_during_an_outage_with_a_node_port(env: &mut KubeEnv) -> String {
    env.api
        .apply(&format!("{}---\n{}", node_port_service("np", OTHER_VIP, NODE_PORT), slice("np", &["10.244.1.11", "10.244.1.12"])))
        .expect("NodePort Service");
    let node_port = format!("{NODE_IP}:{NODE_PORT}");
    env.within(Duration::from_secs(2), "programming the NodePort", |e| e.frontends().contains(&format!("{node_port}/TCP")));
    // The checkpoint is written in the background after the sync that programmed it.
    wait_for_checkpoint(env);

    env.api.stop_apiserver().expect("API down");
    env.agent.simulate_reboot().expect("reboot");
    node_port
}

#[test]
fn reboot_during_an_api_outage_restores_services_from_the_checkpoint() {
    let mut env = KubeEnv::in_node();
    let node_port = reboot_during_an_outage_with_a_node_port(&mut env);
    let down = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 3).expect("probe");
    assert_eq!(down.ok, 0, "with an empty bpffs nothing translates the VIP: {down:?}");

    env.agent.spawn().expect("agent starts after the reboot");
    // One second after the agent process started, with no API server, the ClusterIP and the
    // NodePort must answer.
    std::thread::sleep(Duration::from_secs(1));
    let summary = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 50).expect("probe");
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(summary.answered_by("be1") > 0 && summary.answered_by("be2") > 0, "{summary:?}");
    let tcp = probe::tcp(&env.topo, "client", &node_port, 20).expect("NodePort TCP probe");
    let udp = probe::udp(&env.topo, "client", &format!("{NODE_IP}:{}", NODE_PORT + 1), 20).expect("NodePort UDP probe");
    assert_eq!((tcp.failed, udp.failed), (0, 0), "NodePort after the reboot: {tcp:?} {udp:?}");
    assert!(env.agent.log_text().contains("restored it from the checkpoint"), "{}", env.agent.log_text());
    let (status, body) = healthz(&env);
    assert_eq!((status, &body["restoredFromCheckpoint"]), (503, &serde_json::json!(true)), "{body}");

    // The API returns: its state replaces the checkpoint's.
    env.api.start_apiserver().expect("API back");
    env.agent.wait_healthy(Duration::from_secs(30)).expect("healthy once the API answers");
    assert_eq!(healthz(&env).1["restoredFromCheckpoint"], false);
}

#[test]
fn a_corrupt_checkpoint_is_reported_and_ignored_and_the_api_still_wins() {
    let mut env = KubeEnv::new();
    wait_for_checkpoint(&env);
    env.api.stop_apiserver().expect("API down");
    env.agent.simulate_reboot().expect("reboot");
    let checkpoint = env.agent.state_dir.join("checkpoint.v1");
    let mut bytes = std::fs::read(&checkpoint).expect("the agent wrote a checkpoint");
    let last = bytes.len() - 3;
    bytes[last] ^= 0x01;
    std::fs::write(&checkpoint, bytes).expect("corrupt it");

    env.agent.spawn().expect("agent");
    env.agent.wait_for_log("ignoring the checkpoint");
    let log = env.agent.log_text();
    assert!(log.contains("ignoring the checkpoint") && log.contains("is corrupt"), "{log}");
    let untrusted = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 3).expect("probe");
    assert_eq!(untrusted.ok, 0, "a corrupt checkpoint must not be used: {untrusted:?}");

    env.api.start_apiserver().expect("API back");
    env.agent.wait_healthy(Duration::from_secs(30)).expect("healthy once the API answers");
    let summary = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 20).expect("probe");
    assert_eq!(summary.failed, 0, "{summary:?}");
}

/// The boot path's first piece (issue 11 item 4): after a reboot with the API down, a one-shot
/// `agent --restore-only` (what a static pod would run before kubelet can reach the API) brings
/// Services back from the checkpoint and exits; the agent started once the API answers adopts
/// what it left and writes nothing.
#[test]
fn a_restore_only_run_brings_services_back_after_a_reboot_and_the_agent_adopts_them() {
    let mut env = KubeEnv::in_node();
    let node_port = reboot_during_an_outage_with_a_node_port(&mut env);
    let normal = env.agent.extra_args.clone();
    env.agent.extra_args.push("--restore-only".into());
    let status = env.agent.start_expecting_exit(Duration::from_secs(10)).expect("restore-only run");
    env.agent.extra_args = normal;
    assert!(status.success(), "{status}\n{}", env.agent.log_text());
    // Nothing runs now: the pinned datapath serves the checkpoint's state.
    let summary = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 50).expect("probe");
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(summary.answered_by("be1") > 0 && summary.answered_by("be2") > 0, "{summary:?}");
    let tcp = probe::tcp(&env.topo, "client", &node_port, 20).expect("NodePort TCP probe");
    assert_eq!(tcp.failed, 0, "NodePort after the restore: {tcp:?}");

    // The API returns and the agent starts: it adopts the restored maps and changes nothing.
    env.api.start_apiserver().expect("API back");
    let log_before = env.agent.log_text().len();
    env.agent.restart().expect("the agent after the API returned");
    let log = env.agent.log_text()[log_before..].to_owned();
    assert!(!log.contains("restored it from the checkpoint") && !log.contains("attached and pinned"), "{log}");
    assert_eq!(env.agent.map_writes().expect("metrics"), 0, "the adopting agent rewrote maps:\n{log}");
}

/// The static boot pod also starts when a node boots with the API server up, and again whenever
/// kubelet restarts it: its `--restore-only` must neither wait for nor disturb the agent that
/// serves the node. It finds the node lock held, says so and exits at once.
#[test]
fn a_restore_only_run_steps_aside_while_an_agent_serves_the_node() {
    let env = KubeEnv::new();
    let frontends = env.frontends();
    let mut boot = env.agent.second();
    boot.extra_args.push("--restore-only".into());
    let status = boot.start_expecting_exit(Duration::from_secs(10)).expect("restore-only run");
    assert!(status.success(), "{status}\n{}", boot.log_text());
    assert!(boot.log_text().contains("another agent holds the node lock"), "{}", boot.log_text());
    assert!(!boot.log_text().contains("attached and pinned"), "{}", boot.log_text());
    assert_eq!(env.frontends(), frontends);
    assert!(env.agent.is_healthy(), "the serving agent was disturbed:\n{}", env.agent.log_text());
    let summary = probe::tcp(&env.topo, "client", &format!("{VIP}:80"), 20).expect("probe");
    assert_eq!(summary.failed, 0, "{summary:?}");
}
