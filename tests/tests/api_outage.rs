//! What happens to Services when the master fails: the real kube-apiserver is stopped, then
//! black-holed, under steady traffic; and objects change while the agent is down.

use std::time::{Duration, Instant};

use e2e::agent::http_get;
use e2e::kube_scenario::{service, slice, KubeEnv, OTHER_VIP, VIP};
use e2e::probe::SteadyTraffic;

fn healthz(env: &KubeEnv) -> (u16, serde_json::Value) {
    let (status, body) = http_get(env.agent.healthz_port, "/healthz").expect("healthz");
    (status, serde_json::from_str(&body).expect("healthz json"))
}

/// Waits up to `limit` for /healthz to answer `status`; returns the body.
fn wait_healthz(env: &KubeEnv, status: u16, limit: Duration) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let (got, body) = healthz(env);
        if got == status {
            return body;
        }
        assert!(started.elapsed() < limit, "/healthz still {got} {body} after {limit:?}\n{}", env.agent.log_text());
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn api_server_stopped_then_black_holed_costs_no_connection() {
    let mut env = KubeEnv::new();
    let outage = Duration::from_secs(60);
    let traffic = SteadyTraffic::start(
        &env.topo,
        "client",
        &format!("{VIP}:80"),
        &format!("{VIP}:53"),
        20,
        2,
        outage * 2 + Duration::from_secs(25),
    )
    .expect("steady traffic");
    std::thread::sleep(Duration::from_secs(2));

    // 1. The API server process is gone for 60 s.
    env.api.stop_apiserver().expect("stop apiserver");
    let stale = wait_healthz(&env, 503, Duration::from_secs(15));
    assert_eq!(stale["stale"], true, "{stale}");
    assert_eq!(http_get(env.agent.healthz_port, "/livez").expect("livez").0, 200, "liveness must not fail");
    std::thread::sleep(outage.saturating_sub(Duration::from_secs(5)));
    env.api.start_apiserver().expect("start apiserver");
    wait_healthz(&env, 200, Duration::from_secs(30));

    // 2. The API server is there but its packets vanish (black hole / half-open connection):
    //    the agent notices within its stated 15 s (probe interval + timeout), reports stale, and
    //    keeps serving.
    env.api.forwarder().set_blackhole(true);
    let started = Instant::now();
    let stale = wait_healthz(&env, 503, Duration::from_secs(20));
    eprintln!("black hole detected after {:?}: {stale}", started.elapsed());
    std::thread::sleep(outage.saturating_sub(started.elapsed()));
    env.api.forwarder().set_blackhole(false);
    wait_healthz(&env, 200, Duration::from_secs(60));

    let seen = traffic.finish().expect("traffic");
    eprintln!("{seen:?}");
    assert_eq!(seen.failed(), 0, "connections failed while the API was down: {seen:?}");
    assert!(seen.tcp.ok > 1500 && seen.udp.ok > 1500, "traffic did not really run: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");
    // Both backends kept serving throughout: the last state was never emptied.
    assert!(seen.tcp.answered_by("be1") > 300 && seen.tcp.answered_by("be2") > 300, "{seen:?}");
}

#[test]
fn changes_made_while_the_agent_is_down_are_applied_when_it_returns() {
    let mut env = KubeEnv::new();
    env.api
        .apply(&format!("{}---\n{}", service("other", OTHER_VIP), slice("other", &["10.244.1.12"])))
        .expect("create other");
    env.within(Duration::from_secs(1), "creating Service other", |e| e.frontends().contains(&format!("{OTHER_VIP}:80/TCP")));

    env.agent.stop().expect("stop agent");
    env.api.apply(&slice("web", &["10.244.1.11"])).expect("remove be2 from web");
    env.api.delete("v1", "Service", "demo", "other").expect("delete other");
    // Nothing changes while no agent runs: the datapath still has both.
    assert!(env.frontends().contains(&format!("{OTHER_VIP}:80/TCP")));

    env.agent.restart().expect("agent back");
    assert!(!env.frontends().iter().any(|f| f.starts_with(OTHER_VIP)), "{:?}", env.frontends());
    let web = env.tcp(&format!("{VIP}:80"), 50);
    assert_eq!((web.failed, web.answered_by("be2")), (0, 0), "{web:?}");
}
