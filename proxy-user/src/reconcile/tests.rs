use std::collections::BTreeMap;

use super::*;
use crate::desired::{Backend, FrontendSpec, ServicePortName};
use crate::lbmap::FakeMaps;

fn frontend(last: u8, port: u16, proto: Proto) -> Frontend {
    Frontend { addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, last)), port, proto, scope: Scope::Internal }
}

fn backend(last: u8, port: u16, proto: Proto) -> BackendAddr {
    BackendAddr { addr: IpAddr::V4(Ipv4Addr::new(10, 244, 1, last)), port, proto }
}

fn spec(i: usize, backends: &[BackendAddr]) -> FrontendSpec {
    let mut backends: Vec<Backend> = backends.iter().map(|addr| Backend { addr: *addr, local: false }).collect();
    backends.sort();
    backends.dedup();
    FrontendSpec {
        service: ServicePortName { namespace: "ns".into(), name: format!("svc{i}"), port: String::new() },
        kind: FrontendKind::ClusterIp,
        local_only: false,
        affinity_timeout: None,
        backends,
    }
}

fn desired(entries: &[(Frontend, Vec<BackendAddr>)]) -> DesiredState {
    let mut state = DesiredState::default();
    for (i, (frontend, backends)) in entries.iter().enumerate() {
        state.frontends.insert(*frontend, spec(i, backends).into());
    }
    state
}

/// What the maps must hold for `desired`, independent of ids: frontend -> backend addresses.
fn observed(maps: &FakeMaps) -> BTreeMap<Frontend, Vec<BackendAddr>> {
    let mut out = BTreeMap::new();
    for (key, value) in maps.services.iter().filter(|(k, _)| k.slot() == 0) {
        let frontend = decode_frontend(key).unwrap();
        let mut backends = Vec::new();
        for slot in 1..=value.count {
            let id = maps.services[&key.with_slot(slot)].backend_id;
            backends.push(decode_backend(&maps.backends[&id]).unwrap());
        }
        backends.sort();
        let rev = maps.rev_nats[&value.rev_nat_id];
        assert_eq!(rev, rev_nat_value(&frontend));
        out.insert(frontend, backends);
    }
    out
}

fn expected(state: &DesiredState) -> BTreeMap<Frontend, Vec<BackendAddr>> {
    state.frontends.iter().map(|(f, s)| (*f, s.backends.iter().map(|b| b.addr).collect())).collect()
}

#[test]
fn programs_a_service_and_applies_only_the_difference() {
    let svc = frontend(10, 80, Proto::Tcp);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    let first = desired(&[(svc, vec![backend(1, 8080, Proto::Tcp), backend(2, 8080, Proto::Tcp)])]);
    let report = reconciler.reconcile(&first);
    assert!(report.failures.is_empty());
    // 2 backends + 2 slots + rev-NAT + slot 0.
    assert_eq!(report.writes, 6);
    assert_eq!(observed(reconciler.maps()), expected(&first));

    // Same state again: nothing to write.
    assert_eq!(reconciler.reconcile(&first).writes, 0);

    // Drop one backend: slot 1 rewritten (sorted order), slot 0 count, slot 2 trimmed, backend deleted.
    let second = desired(&[(svc, vec![backend(2, 8080, Proto::Tcp)])]);
    let report = reconciler.reconcile(&second);
    assert!(report.failures.is_empty());
    assert_eq!(report.writes, 4);
    assert_eq!(observed(reconciler.maps()), expected(&second));
    assert_eq!(reconciler.maps().backends.len(), 1);
    assert!(reconciler.maps().violations.is_empty(), "{:?}", reconciler.maps().violations);
}

#[test]
fn no_endpoints_programs_a_frontend_with_zero_count() {
    let svc = frontend(11, 80, Proto::Tcp);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    reconciler.reconcile(&desired(&[(svc, vec![])]));
    let slot0 = reconciler.maps().services[&service_key(&svc, 0)];
    assert_eq!(slot0.count, 0, "the kernel must find the frontend to refuse it");
}

#[test]
fn removal_deletes_frontend_slots_backends_and_rev_nat() {
    let svc = frontend(10, 53, Proto::Udp);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    reconciler.reconcile(&desired(&[(svc, vec![backend(1, 53, Proto::Udp)])]));
    let report = reconciler.reconcile(&DesiredState::default());
    assert!(report.failures.is_empty());
    let maps = reconciler.maps();
    assert!(maps.services.is_empty() && maps.backends.is_empty() && maps.rev_nats.is_empty());
}

#[test]
fn restart_keeps_ids_and_changes_nothing_that_is_already_right() {
    let a = frontend(10, 80, Proto::Tcp);
    let b = frontend(11, 53, Proto::Udp);
    let state = desired(&[(a, vec![backend(1, 80, Proto::Tcp)]), (b, vec![backend(2, 53, Proto::Udp)])]);
    let mut first = Reconciler::adopt(FakeMaps::default()).unwrap();
    first.reconcile(&state);
    let ids = (first.rev_nat_id(&a), first.rev_nat_id(&b));
    let maps_before = first.maps().clone();

    let mut second = Reconciler::adopt(maps_before.clone()).unwrap();
    assert_eq!((second.rev_nat_id(&a), second.rev_nat_id(&b)), ids);
    let report = second.reconcile(&state);
    assert_eq!(report.writes, 0, "a restart with unchanged state must write nothing");
    assert_eq!(second.maps().services, maps_before.services);
    assert_eq!(second.maps().backends, maps_before.backends);
}

#[test]
fn full_map_fails_only_the_service_that_does_not_fit() {
    // Room for 3 service entries: one frontend with 2 backends fills it.
    let mut reconciler = Reconciler::adopt(FakeMaps::with_capacity(3)).unwrap();
    let a = frontend(10, 80, Proto::Tcp);
    let b = frontend(20, 80, Proto::Tcp);
    let first = desired(&[(a, vec![backend(1, 80, Proto::Tcp), backend(2, 80, Proto::Tcp)])]);
    assert!(reconciler.reconcile(&first).failures.is_empty());

    let mut both = first.clone();
    both.frontends.extend(desired(&[(b, vec![backend(3, 80, Proto::Tcp)])]).frontends);
    let report = reconciler.reconcile(&both);
    assert_eq!(report.failures.len(), 1);
    let failure = &report.failures[0];
    assert!(failure.what.contains("10.96.0.20:80/TCP"), "{}", failure.what);
    assert!(matches!(failure.error, ReconcileError::Map(MapError::Full { .. })));
    // The one that fitted is intact and the maps are consistent.
    assert_eq!(observed(reconciler.maps()), expected(&first));
    assert!(reconciler.maps().violations.is_empty());
}

/// xorshift64*: deterministic, dependency-free randomness for model tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_state(rng: &mut Rng) -> DesiredState {
    let mut entries = Vec::new();
    for vip in 0..rng.below(6) as u8 {
        let proto = if rng.below(2) == 0 { Proto::Tcp } else { Proto::Udp };
        let backends = (0..rng.below(5)).map(|_| backend(rng.below(8) as u8, 8080, proto)).collect();
        let mut frontend = frontend(vip, 80 + rng.below(2) as u16, proto);
        if rng.below(3) == 0 {
            frontend.scope = Scope::External;
        }
        entries.push((frontend, backends));
    }
    entries.sort_by_key(|(f, _)| *f);
    entries.dedup_by_key(|(f, _)| *f);
    let mut state = desired(&entries);
    // Flags and backend locality change at random too: each is an in-place update.
    for spec in state.frontends.values_mut() {
        let spec = std::sync::Arc::make_mut(spec);
        spec.local_only = rng.below(2) == 0;
        spec.affinity_timeout = (rng.below(2) == 0).then_some(10_800);
        spec.kind = [FrontendKind::ClusterIp, FrontendKind::NodePort, FrontendKind::LoadBalancer][rng.below(3) as usize];
        for backend in &mut spec.backends {
            backend.local = backend.addr.addr == IpAddr::V4(Ipv4Addr::new(10, 244, 1, 1));
        }
    }
    state
}

/// Long random sequences of desired states, with a write failure injected at a random point of
/// every other pass: the kernel-visible state is consistent after every single write, and one
/// clean pass always converges to exactly the desired state (nothing stale left behind).
#[test]
fn random_sequences_with_injected_failures_stay_consistent_and_converge() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    for round in 0..400 {
        let state = random_state(&mut rng);
        if round % 2 == 0 {
            reconciler.maps.writes_until_failure = Some(rng.below(12) as usize);
            reconciler.reconcile(&state);
            reconciler.maps.writes_until_failure = None;
        }
        if round % 7 == 0 {
            // An agent restart in the middle of it all.
            let maps = reconciler.maps.clone();
            reconciler = Reconciler::adopt(maps).unwrap();
        }
        let report = reconciler.reconcile(&state);
        assert!(report.failures.is_empty(), "round {round}: {:?}", report.failures);
        assert_eq!(observed(&reconciler.maps), expected(&state), "round {round}");
        let referenced: BTreeSet<_> =
            reconciler.maps.services.values().map(|v| v.backend_id).filter(|id| *id != 0).collect();
        assert!(reconciler.maps.backends.keys().all(|id| referenced.contains(id)), "round {round}: leaked backend");
        for value in reconciler.maps.backends.values() {
            let local = decode_backend(value).unwrap().addr == IpAddr::V4(Ipv4Addr::new(10, 244, 1, 1));
            assert_eq!(backend_flags_of(value), if local { backend_flags::LOCAL } else { 0 }, "round {round}: backend flags");
        }
        for (frontend, spec) in &state.frontends {
            let value = reconciler.maps.services[&service_key(frontend, 0)];
            assert_eq!(value, slot0_value(spec, value.count, value.rev_nat_id, false), "round {round}: slot 0 of {frontend}");
        }
        let addresses: BTreeSet<_> = state.frontends.keys().map(|f| (f.addr, f.port, f.proto)).collect();
        assert_eq!(reconciler.maps.rev_nats.len(), addresses.len(), "round {round}: leaked rev-NAT");
        assert!(reconciler.maps.violations.is_empty(), "round {round}: {:?}", reconciler.maps.violations);
    }
}

fn slot0(maps: &FakeMaps, frontend: &Frontend) -> ServiceValue4 {
    maps.services[&service_key(frontend, 0)]
}

#[test]
fn flags_and_the_affinity_timeout_are_written_to_slot_0_and_a_flag_change_is_one_update() {
    let svc = frontend(10, 80, Proto::Tcp);
    let mut state = desired(&[(svc, vec![backend(1, 8080, Proto::Tcp), backend(2, 8080, Proto::Tcp)])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    reconciler.reconcile(&state);
    assert_eq!(slot0(reconciler.maps(), &svc).flags, 0);

    let spec = std::sync::Arc::make_mut(state.frontends.get_mut(&svc).unwrap());
    spec.kind = FrontendKind::NodePort;
    spec.local_only = true;
    spec.affinity_timeout = Some(600);
    let report = reconciler.reconcile(&state);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.writes, 1, "only slot 0 changes");
    let value = slot0(reconciler.maps(), &svc);
    assert_eq!(value.flags, svc_flags::NODE_PORT | svc_flags::LOCAL_ONLY | svc_flags::AFFINITY);
    assert_eq!((value.backend_id, value.count), (600, 2));

    // Affinity off again: the timeout goes with the flag.
    std::sync::Arc::make_mut(state.frontends.get_mut(&svc).unwrap()).affinity_timeout = None;
    assert_eq!(reconciler.reconcile(&state).writes, 1);
    assert_eq!(slot0(reconciler.maps(), &svc).backend_id, 0);
    assert!(reconciler.maps().violations.is_empty(), "{:?}", reconciler.maps().violations);
}

#[test]
fn a_backend_local_for_one_service_and_remote_for_another_gets_an_entry_for_each() {
    let a = frontend(10, 80, Proto::Tcp);
    let b = frontend(11, 80, Proto::Tcp);
    let be = backend(1, 8080, Proto::Tcp);
    let mut state = desired(&[(a, vec![be]), (b, vec![be])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    reconciler.reconcile(&state);
    let ids: Vec<BackendId> = reconciler.maps().backends.keys().copied().collect();
    assert_eq!(ids.len(), 1, "one backend entry shared by both frontends");

    // Another Service's slice says the same address is local (issue 12: any namespace can write
    // such a slice): `a` gets a local entry of its own, `b` keeps its remote one untouched.
    std::sync::Arc::make_mut(state.frontends.get_mut(&a).unwrap()).backends[0].local = true;
    let report = reconciler.reconcile(&state);
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(reconciler.maps().backends.len(), 2, "{:?}", reconciler.maps().backends);
    let flags_of = |f: &Frontend| {
        let id = reconciler.maps().services[&service_key(f, 1)].backend_id;
        backend_flags_of(&reconciler.maps().backends[&id])
    };
    assert_eq!((flags_of(&a), flags_of(&b)), (backend_flags::LOCAL, 0));
    assert_eq!(reconciler.maps().services[&service_key(&b, 1)].backend_id, ids[0], "b's entry and slot are untouched");
    assert_eq!(reconciler.reconcile(&state).writes, 0, "stable");
    // And after a restart, each is adopted by its own key.
    let mut restarted = Reconciler::adopt(reconciler.maps().clone()).unwrap();
    assert_eq!(restarted.reconcile(&state).writes, 0, "a restart rewrites nothing");

    // When no frontend uses the remote copy any more, it is collected.
    std::sync::Arc::make_mut(state.frontends.get_mut(&b).unwrap()).backends[0].local = true;
    restarted.reconcile(&state);
    assert_eq!(restarted.maps().backends.len(), 1);
    assert!(restarted.maps().violations.is_empty(), "{:?}", restarted.maps().violations);
}

#[test]
fn both_scopes_of_a_frontend_share_one_reverse_nat_id() {
    let internal = frontend(10, 80, Proto::Tcp);
    let external = Frontend { scope: Scope::External, ..internal };
    let state = desired(&[(internal, vec![backend(1, 8080, Proto::Tcp)]), (external, vec![])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    assert!(reconciler.reconcile(&state).failures.is_empty());
    assert_eq!(reconciler.rev_nat_id(&internal), reconciler.rev_nat_id(&external));
    assert_eq!(reconciler.maps().rev_nats.len(), 1);
    // After a restart too.
    let restarted = Reconciler::adopt(reconciler.maps().clone()).unwrap();
    assert_eq!(restarted.rev_nat_id(&internal), reconciler.rev_nat_id(&external));
}

#[test]
fn ipv6_frontends_go_to_the_ipv6_maps_sharing_the_id_spaces_with_ipv4() {
    let v4 = frontend(10, 80, Proto::Tcp);
    let v6 = Frontend { addr: "fd00::10".parse().unwrap(), ..v4 };
    let v6_backend = BackendAddr { addr: "fd00:10:244::5".parse().unwrap(), port: 8080, proto: Proto::Tcp };
    let state = desired(&[(v4, vec![backend(1, 8080, Proto::Tcp)]), (v6, vec![v6_backend])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    let report = reconciler.reconcile(&state);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.writes, 8, "both frontends: backend, slot, rev-NAT, slot 0 each");
    assert!(reconciler.maps().violations.is_empty(), "{:?}", reconciler.maps().violations);
    assert_eq!(observed(reconciler.maps()), expected(&state));
    let SvcKey::V6(key) = service_key(&v6, 0) else { panic!("an IPv6 frontend must have an IPv6 key") };
    assert_eq!(key.addr, ipv6_words("fd00::10".parse().unwrap()));
    assert_ne!(reconciler.rev_nat_id(&v4), reconciler.rev_nat_id(&v6), "one id space");
    assert_eq!(reconciler.reconcile(&state).writes, 0);

    // A restart re-learns both families; removing the IPv6 frontend deletes from the IPv6 maps.
    let mut restarted = Reconciler::adopt(reconciler.maps().clone()).unwrap();
    assert_eq!(restarted.reconcile(&state).writes, 0);
    let only_v4 = desired(&[(v4, vec![backend(1, 8080, Proto::Tcp)])]);
    assert!(restarted.reconcile(&only_v4).failures.is_empty());
    let maps = restarted.maps();
    assert!(maps.backends.values().all(|b| !b.is_ipv6()) && maps.rev_nats.values().all(|r| !r.is_ipv6()), "{maps:?}");
    assert_eq!(observed(maps), expected(&only_v4));
}

#[test]
fn a_backend_of_the_other_family_fails_only_its_frontend() {
    let v4 = frontend(10, 80, Proto::Tcp);
    let good = frontend(11, 80, Proto::Tcp);
    let v6_backend = BackendAddr { addr: "fd00:10:244::5".parse().unwrap(), port: 8080, proto: Proto::Tcp };
    let state = desired(&[(v4, vec![v6_backend]), (good, vec![backend(1, 8080, Proto::Tcp)])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
    let report = reconciler.reconcile(&state);
    assert_eq!(report.failures.len(), 1, "{:?}", report.failures);
    assert!(matches!(report.failures[0].error, ReconcileError::FamilyMismatch { .. }), "{:?}", report.failures);
    assert!(report.failures[0].what.contains("10.96.0.10"), "{:?}", report.failures);
    assert_eq!(observed(reconciler.maps()).len(), 1);
}

/// The Maglev table of an external frontend, as backend addresses.
fn maglev_by_addr(maps: &FakeMaps, frontend: &Frontend) -> Vec<BackendAddr> {
    let slot0 = maps.services[&service_key(frontend, 0)];
    assert_ne!(slot0.flags & svc_flags::MAGLEV, 0, "{frontend} is not marked for Maglev");
    maps.maglev[&slot0.rev_nat_id].iter().map(|id| decode_backend(&maps.backends[id]).unwrap()).collect()
}

#[test]
fn maglev_tables_go_to_external_frontends_and_name_only_their_backends() {
    let internal = frontend(10, 80, Proto::Tcp);
    let external = Frontend { scope: Scope::External, ..internal };
    let empty = Frontend { scope: Scope::External, ..frontend(11, 80, Proto::Tcp) };
    let three: Vec<_> = (1..=3).map(|i| backend(i, 8080, Proto::Tcp)).collect();
    let state = desired(&[(internal, three.clone()), (external, three.clone()), (empty, vec![])]);
    let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    let report = reconciler.reconcile(&state);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let maps = reconciler.maps();
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
    assert_eq!(maps.maglev.len(), 1, "one table: the external frontend with backends");
    let internal_slot0 = maps.services[&service_key(&internal, 0)];
    assert_eq!(internal_slot0.flags & svc_flags::MAGLEV, 0, "socket hooks pick at random");
    let table = maglev_by_addr(maps, &external);
    assert_eq!(table.len(), proxy_abi::maglev::TABLE_SIZE as usize);
    for backend in &three {
        let share = table.iter().filter(|b| *b == backend).count();
        assert!(share.abs_diff(table.len() / 3) <= 1, "{backend}: {share} slots");
    }
    assert_eq!(reconciler.reconcile(&state).writes, 0, "an unchanged table is not rewritten");

    // One backend goes: its slots move, the others' stay.
    let before = table;
    let two = desired(&[(internal, three[..2].to_vec()), (external, three[..2].to_vec()), (empty, vec![])]);
    assert!(reconciler.reconcile(&two).failures.is_empty());
    let after = maglev_by_addr(reconciler.maps(), &external);
    let moved = before.iter().zip(&after).filter(|(b, a)| **b != three[2] && b != a).count();
    assert!(moved < before.len() * 3 / 100, "{moved} slots of remaining backends moved");
    assert!(after.iter().all(|b| *b != three[2]));
    assert!(reconciler.maps().violations.is_empty(), "{:?}", reconciler.maps().violations);
}

#[test]
fn maglev_tables_are_the_same_on_nodes_whose_backend_ids_differ() {
    let external = Frontend { scope: Scope::External, ..frontend(10, 80, Proto::Tcp) };
    let backends: Vec<_> = (1..=5).map(|i| backend(i, 8080, Proto::Tcp)).collect();
    let state = desired(&[(external, backends.clone())]);
    // Node A programs the Service directly; node B had other Services first, so its ids differ.
    let mut a = Reconciler::adopt(FakeMaps::default()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    a.reconcile(&state);
    let mut b = Reconciler::adopt(FakeMaps::default()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    let other = frontend(99, 443, Proto::Tcp);
    b.reconcile(&desired(&[(other, (20..30).map(|i| backend(i, 443, Proto::Tcp)).collect())]));
    b.reconcile(&state);
    assert_ne!(a.maps().backends.keys().collect::<Vec<_>>(), b.maps().backends.keys().collect::<Vec<_>>());
    assert_eq!(maglev_by_addr(a.maps(), &external), maglev_by_addr(b.maps(), &external));
}

#[test]
fn switching_algorithms_keeps_the_frontend_and_drops_or_rebuilds_its_table() {
    let external = Frontend { scope: Scope::External, ..frontend(10, 80, Proto::Tcp) };
    let state = desired(&[(external, vec![backend(1, 8080, Proto::Tcp), backend(2, 8080, Proto::Tcp)])]);
    let mut maglev = Reconciler::adopt(FakeMaps::default()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    maglev.reconcile(&state);
    let maps = maglev.maps().clone();

    // A restart with the same algorithm re-learns the table and writes nothing.
    let mut same = Reconciler::adopt(maps.clone()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    assert_eq!(same.reconcile(&state).writes, 0);

    // A restart with `random`: slot 0 loses the mark first, then the table goes.
    let mut random = Reconciler::adopt(maps).unwrap();
    let report = random.reconcile(&state);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.writes, 2, "slot 0 and the table");
    let slot0 = random.maps().services[&service_key(&external, 0)];
    assert_eq!(slot0.flags & svc_flags::MAGLEV, 0);
    assert!(random.maps().maglev.is_empty());
    assert!(random.maps().violations.is_empty(), "{:?}", random.maps().violations);

    // And back: the table is written before slot 0 is marked (checked after every write).
    let mut back = Reconciler::adopt(random.maps().clone()).unwrap().with_algorithm(LbAlgorithm::Maglev);
    assert_eq!(back.reconcile(&state).writes, 2);
    assert!(back.maps().violations.is_empty(), "{:?}", back.maps().violations);
    assert_eq!(maglev_by_addr(back.maps(), &external), maglev_by_addr(maglev.maps(), &external));
}

/// The agent's path (an incremental desired state, then only the changed frontends written)
/// against the model (everything computed from scratch): over long random sequences of Service
/// and EndpointSlice changes, with colliding addresses and node address changes, the maps hold
/// exactly what a full computation says, with no garbage left behind.
#[test]
fn incremental_sync_matches_a_full_computation_over_random_changes() {
    use crate::desired::{self, Changes, ClusterState, Incremental, NodeConfig, ServiceObjects};
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use std::sync::Arc;

    fn service(rng: &mut Rng, i: u64) -> desired::ServiceInfo {
        let ty = ["ClusterIP", "NodePort", "LoadBalancer"][rng.below(3) as usize];
        let mut spec = serde_json::json!({
            "type": ty,
            // A small pool: Services collide on ClusterIPs, NodePorts and external IPs.
            "clusterIP": format!("10.96.0.{}", 1 + rng.below(6)),
            "ports": [{"name": "p", "port": 80 + rng.below(2), "protocol": (["TCP", "UDP"][rng.below(2) as usize])}],
            "externalTrafficPolicy": (["Cluster", "Local"][rng.below(2) as usize]),
        });
        if ty != "ClusterIP" {
            spec["ports"][0]["nodePort"] = serde_json::json!(30000 + rng.below(3));
        }
        if rng.below(3) == 0 {
            spec["externalIPs"] = serde_json::json!([format!("10.96.0.{}", 1 + rng.below(6))]);
        }
        serde_json::from_value(serde_json::json!({"metadata": {"name": format!("s{i}"), "namespace": "ns"}, "spec": spec}))
            .map(|service: Service| service.into())
            .unwrap()
    }
    fn slice(rng: &mut Rng, i: u64, of: u64) -> desired::Slice {
        let endpoints: Vec<_> = (0..rng.below(4))
            .map(|_| serde_json::json!({
                "addresses": [format!("10.244.1.{}", 1 + rng.below(5))],
                "conditions": {"ready": rng.below(4) != 0},
                "nodeName": (["node-1", "node-2"][rng.below(2) as usize]),
            }))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("e{i}"), "namespace": "ns", "labels": {"kubernetes.io/service-name": format!("s{of}")}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 8080 + rng.below(2), "protocol": (["TCP", "UDP"][rng.below(2) as usize])}],
            "endpoints": endpoints,
        }))
        .map(|slice: EndpointSlice| slice.into())
        .unwrap()
    }

    // The Services that own frontends: the programmed-Services gauge is counted again only
    // when an update says they may have changed.
    let owners = |state: &desired::DesiredState| -> BTreeSet<(String, String)> {
        state.frontends.values().map(|spec| (spec.service.namespace.clone(), spec.service.name.clone())).collect()
    };
    let mut owners_kept = 0;
    for seed in 1..=12u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut services: BTreeMap<u64, Arc<desired::ServiceInfo>> = BTreeMap::new();
        let mut slices: BTreeMap<u64, Arc<desired::Slice>> = BTreeMap::new();
        let mut config = NodeConfig { node_name: "node-1".into(), interface_addresses: vec!["192.168.0.10".parse().unwrap()], ..Default::default() };
        let mut state = Incremental::default();
        let mut reconciler = Reconciler::adopt(FakeMaps::default()).unwrap();
        for step in 0..150 {
            let mut touched = BTreeSet::new();
            let mut all = false;
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(8);
                match rng.below(10) {
                    0..=2 => {
                        touched.insert(i);
                        services.insert(i, Arc::new(service(&mut rng, i)));
                    }
                    3 => {
                        touched.insert(i);
                        services.remove(&i);
                    }
                    4..=7 => {
                        let of = rng.below(8);
                        if let Some(old) = slices.insert(i, Arc::new(slice(&mut rng, i, of))) {
                            touched.insert(desired::slice_service_key(&old).1[1..].parse().unwrap());
                        }
                        touched.insert(of);
                    }
                    8 => {
                        if let Some(old) = slices.remove(&i) {
                            touched.insert(desired::slice_service_key(&old).1[1..].parse().unwrap());
                        }
                    }
                    _ => {
                        all = true;
                        config.interface_addresses = vec![format!("192.168.0.{}", 10 + rng.below(2)).parse().unwrap()];
                    }
                }
            }
            let cluster = ClusterState {
                services: services.values().cloned().collect(),
                slices: slices.values().cloned().collect(),
                node: None,
            };
            let groups = desired::group(&cluster);
            let changes = if all && rng.below(2) == 0 {
                Changes::All
            } else {
                Changes::Services(
                    touched
                        .iter()
                        .map(|i| {
                            let key = ("ns".to_owned(), format!("s{i}"));
                            let objects: ServiceObjects = groups.get(&key).cloned().unwrap_or_default();
                            (key, objects)
                        })
                        .collect(),
                )
            };
            let owners_before = owners(state.state());
            let changed = state.update(&cluster, &config, &changes);
            if !state.owners_changed() {
                owners_kept += 1;
                assert_eq!(owners(state.state()), owners_before, "seed {seed} step {step}: the owners changed unannounced");
            }
            let full = desired::compute(&cluster, &config);
            assert_eq!(state.state(), &full, "seed {seed} step {step}: incremental desired state differs");
            let report = reconciler.reconcile_changed(state.state(), &changed);
            assert!(report.failures.is_empty(), "seed {seed} step {step}: {:?}", report.failures);
            let maps = reconciler.maps();
            assert_eq!(observed(maps), expected(&full), "seed {seed} step {step}: the maps differ");
            assert!(maps.violations.is_empty(), "seed {seed} step {step}: {:?}", maps.violations);
            // No garbage: every backend is named by a slot, every reverse-NAT entry is owned.
            let named: BTreeSet<BackendId> = maps.services.iter().filter(|(k, _)| k.slot() != 0).map(|(_, v)| v.backend_id).collect();
            assert_eq!(named, maps.backends.keys().copied().collect(), "seed {seed} step {step}: unused backends left");
            let owned: BTreeSet<RevNatId> = maps.services.iter().filter(|(k, _)| k.slot() == 0).map(|(_, v)| v.rev_nat_id).collect();
            assert_eq!(owned, maps.rev_nats.keys().copied().collect(), "seed {seed} step {step}: unowned reverse NAT left");
        }
    }
    // Endpoint changes leave the owners as they were, and most updates here are those.
    assert!(owners_kept > 300, "only {owners_kept} of 1 800 updates said the owners stayed");
}
