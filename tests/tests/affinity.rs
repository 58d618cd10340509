//! `sessionAffinity: ClientIP` through the socket hooks: a client keeps its backend while it
//! keeps coming back within the timeout, spreads again after it, and moves at once when its
//! backend is removed (the agent purges the entry).

use std::time::Duration;

use e2e::agent::{Agent, AgentDir};
use e2e::kube_scenario::{service, slice, with_affinity};
use e2e::probe::{self, Summary};
use e2e::scenario::client_and_two_backends;

const VIP: &str = "10.96.0.40";
const TIMEOUT_SECONDS: u32 = 1;

fn manifest(backends: &[&str]) -> String {
    format!("{}---\n{}", with_affinity(&service("sticky", VIP), TIMEOUT_SECONDS), slice("sticky", backends))
}

fn only_backend(summary: &Summary) -> String {
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert_eq!(summary.answers.len(), 1, "all answers must come from one backend: {summary:?}");
    summary.answers.keys().next().expect("one backend").clone()
}

#[test]
fn a_client_keeps_its_backend_within_the_timeout_spreads_after_it_and_moves_when_it_is_removed() {
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12"])).expect("manifest");
    let agent = Agent::start(&topo, &dir).expect("agent");
    let tcp = |count| probe::tcp(&topo, "client", &format!("{VIP}:80"), count).expect("tcp probe");

    // 15 identical answers in a row, TCP and UDP.
    only_backend(&tcp(15));
    only_backend(&probe::udp(&topo, "client", &format!("{VIP}:53"), 15).expect("udp probe"));
    let dump = agent.dump().expect("dump");
    let entries = dump["affinity"].as_array().expect("affinity in dump");
    assert!(
        entries.iter().any(|e| e["frontend"] == format!("{VIP}:80") && e["client"].as_str().unwrap_or("").starts_with("netns:")),
        "no affinity entry for the client: {entries:#?}"
    );

    // After the timeout each new connection may pick again: both backends appear. Each round is a
    // fair coin, so 30 rounds miss one backend with a chance of 2^-29; stop as soon as both showed.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(u64::from(TIMEOUT_SECONDS) * 1000 + 200));
        seen.insert(only_backend(&tcp(1)));
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen.len(), 2, "after the timeout connections must spread again: {seen:?}");

    // Stuck to a backend, which is then removed: the next connections go to the other one, and
    // no affinity entry points at the removed backend any more.
    let stuck = only_backend(&tcp(5));
    let (removed_ip, kept) = if stuck == "be1" { ("10.244.1.11", "10.244.1.12") } else { ("10.244.1.12", "10.244.1.11") };
    dir.write_manifest(&manifest(&[kept])).expect("remove the client's backend");
    std::thread::sleep(Duration::from_millis(600));
    let after = only_backend(&tcp(15));
    assert_ne!(after, stuck, "the client must leave its removed backend");
    let dump = agent.dump().expect("dump");
    let stale: Vec<_> = dump["affinity"]
        .as_array()
        .expect("affinity")
        .iter()
        .filter(|e| e["backend"].as_str().unwrap_or("").starts_with(&format!("{removed_ip}:")))
        .collect();
    assert!(stale.is_empty(), "affinity entries still point at the removed backend: {stale:#?}");
    assert!(agent.log_text().contains("purged flows of removed backends"), "{}", agent.log_text());
}

#[test]
fn an_upgrade_from_the_v1_affinity_layout_keeps_a_pod_on_its_backend() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_abi::{AffinityKey4, AffinityValue4};
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let hour = with_affinity(&service("sticky", VIP), 3600);
    dir.write_manifest(&format!("{hour}---\n{}", slice("sticky", &["10.244.1.11", "10.244.1.12"]))).expect("manifest");
    let mut agent = Agent::start(&topo, &dir).expect("agent");
    let tcp = |count| probe::tcp(&topo, "client", &format!("{VIP}:80"), count).expect("tcp probe");
    let stuck = only_backend(&tcp(5));

    // What the previous build would have left: the client's entry in an `epx_aff4_v1` map (the
    // client in 64 bits), none in the new one.
    agent.kill().expect("kill");
    let v2_path = agent.bpffs.join(proxy_abi::map_name::AFFINITY4);
    let mut v2: HashMap<MapData, AffinityKey4, AffinityValue4> =
        HashMap::try_from(Map::LruHashMap(MapData::from_pin(&v2_path).expect("v2 map"))).expect("layout");
    let entries: Vec<(AffinityKey4, AffinityValue4)> = v2.iter().filter_map(Result::ok).collect();
    assert_eq!(entries.len(), 1, "the client's entry: {entries:?}");
    let v1_path = agent.bpffs.join("epx_aff4_v1");
    e2e::agent::pin_lru_map(&v1_path, "epx_aff4_v1", 16, 16, 1024);
    let mut v1: HashMap<MapData, [u8; 16], AffinityValue4> =
        HashMap::try_from(Map::LruHashMap(MapData::from_pin(&v1_path).expect("v1 map"))).expect("layout");
    for (key, value) in &entries {
        let mut old = [0u8; 16];
        old[..8].copy_from_slice(&proxy_abi::affinity::netns_cookie(&key.client).to_ne_bytes());
        old[8..10].copy_from_slice(&key.rev_nat_id.to_ne_bytes());
        old[10] = key.kind;
        v1.insert(old, value, 0).expect("v1 entry");
        v2.remove(key).expect("v2 entry");
    }
    drop((v1, v2));

    agent.restart().expect("restart");
    agent.wait_for_log("carried the session-affinity entries of the previous layout over entries=1");
    assert_eq!(only_backend(&tcp(15)), stuck, "the upgrade moved the client to another backend");
    assert!(!v1_path.exists(), "the old map is unpinned once the new programs run");
}
