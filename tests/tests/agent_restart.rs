//! The agent is not on the packet path: killing, restarting and doubling it must not cost a
//! single connection. Steady traffic runs throughout and every failure is counted.

use std::time::Duration;

use e2e::probe::SteadyTraffic;
use e2e::scenario::{Env, VIP};

/// 50 short TCP connections and UDP requests per second plus 2 streams to the web Service, for
/// `duration`; returns once the traffic has been running for half a second.
fn steady_traffic(env: &Env, duration: Duration) -> SteadyTraffic {
    let traffic = SteadyTraffic::start(&env.topo, "client", &format!("{VIP}:80"), &format!("{VIP}:53"), 50, 2, duration)
        .expect("steady traffic");
    std::thread::sleep(Duration::from_millis(500));
    traffic
}

#[test]
fn sigkill_and_restart_ten_times_fails_no_connection_and_rewrites_nothing() {
    let mut env = Env::new();
    // The first start programs everything; each restart finds the maps right and writes nothing.
    assert!(env.agent.map_writes().expect("metrics") > 0);
    let traffic = steady_traffic(&env, Duration::from_secs(8));
    let mut restart_writes = Vec::new();
    for _ in 0..10 {
        env.agent.kill().expect("SIGKILL");
        std::thread::sleep(Duration::from_millis(100));
        // Restart: re-open pins, swap programs in the pinned links, re-learn, sync.
        env.agent.restart().expect("restart");
        restart_writes.push(env.agent.map_writes().expect("metrics"));
        std::thread::sleep(Duration::from_millis(200));
    }
    let seen = traffic.finish().expect("traffic result");
    eprintln!("{seen:?}");
    assert_eq!(seen.failed(), 0, "failed connections during 10 SIGKILL/restart cycles: {seen:?}");
    assert!(seen.tcp.ok >= 300 && seen.udp.ok >= 300, "traffic did not really run: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");
    assert_eq!(restart_writes, [0; 10], "map entries written by each restart's first sync");
}

/// `program=NAME old_tag=... new_tag=...` of every "upgraded the program" log line.
fn upgrades(log: &str) -> Vec<(String, String, String)> {
    let field = |line: &str, name: &str| {
        line.split(&format!("{name}=")).nth(1).and_then(|rest| rest.split_whitespace().next()).unwrap_or("").trim_matches('"').to_owned()
    };
    log.lines()
        .filter(|l| l.contains("upgraded the program inside the pinned link"))
        .map(|l| (field(l, "program"), field(l, "old_tag"), field(l, "new_tag")))
        .collect()
}

#[test]
fn an_upgrade_to_changed_programs_and_back_fails_no_connection() {
    let mut env = Env::new();
    let traffic = steady_traffic(&env, Duration::from_secs(6));

    // Upgrade as a DaemonSet rollout does it: the old agent gets SIGTERM, the new one starts with
    // other program code and swaps it into the pinned links.
    env.agent.stop().expect("SIGTERM old agent");
    env.agent.extra_args = vec!["--bpf-object".into(), e2e::upgrade_object().display().to_string()];
    env.agent.restart().expect("upgraded agent");
    let mut start_writes = vec![env.agent.map_writes().expect("metrics")];
    let upgraded = upgrades(&env.agent.log_text());
    std::thread::sleep(Duration::from_secs(2));
    // Roll back to the built-in programs.
    env.agent.stop().expect("SIGTERM upgraded agent");
    env.agent.extra_args.clear();
    env.agent.restart().expect("rolled-back agent");
    start_writes.push(env.agent.map_writes().expect("metrics"));
    let seen = traffic.finish().expect("traffic result");
    eprintln!("{seen:?}");

    assert!(
        upgraded.iter().any(|(program, old, new)| program == "epx_connect4" && old != new && old != "unknown"),
        "the connect program must have been replaced by different code: {upgraded:?}\n{}",
        env.agent.log_text()
    );
    let all = upgrades(&env.agent.log_text());
    assert!(all.len() > upgraded.len(), "the rollback must swap the programs back: {all:?}");
    assert_eq!(seen.failed(), 0, "failed connections during upgrade and rollback: {seen:?}");
    assert!(seen.tcp.ok >= 200 && seen.udp.ok >= 200, "traffic did not really run: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");
    // The maps were kept: neither start rewrote anything.
    assert_eq!(start_writes, [0, 0]);
}

#[test]
fn a_second_agent_waits_for_the_first_and_takes_over_when_it_dies() {
    let mut env = Env::new();
    let mut second = env.agent.spawn_second().expect("second agent");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!second.is_healthy(), "the second agent must not run while the first holds the lock");
    assert!(second.log_text().contains("another agent is writing"), "{}", second.log_text());

    env.agent.kill().expect("kill first");
    second.wait_healthy(Duration::from_secs(10)).expect("second agent takes over");
    // It changed nothing: the first agent's state was already right.
    assert_eq!(second.map_writes().expect("metrics"), 0);
    let summary = env.tcp(&format!("{VIP}:80"), 50);
    assert_eq!(summary.failed, 0, "{summary:?}");
}

#[test]
fn a_pinned_map_with_another_layout_is_refused_by_name_and_keeps_serving() {
    let mut env = Env::new();
    env.agent.kill().expect("kill");
    // Same pins, but this start wants a service map of another capacity.
    env.agent.extra_args = vec!["--map-size-services=1024".into()];
    let status = env.agent.start_expecting_exit(Duration::from_secs(10)).expect("refused start");
    assert!(!status.success());
    let log = env.agent.log_text();
    assert!(
        log.contains("pinned map") && log.contains("epx_svc4_v1") && log.contains("1024 entries"),
        "the refusal must name the map and both layouts:\n{log}"
    );
    // Nothing was reused wrongly or torn down: the old datapath still serves.
    let summary = env.tcp(&format!("{VIP}:80"), 20);
    assert_eq!(summary.failed, 0, "{summary:?}");
    env.agent.extra_args.clear();
    env.agent.restart().expect("a compatible start works again");
}
