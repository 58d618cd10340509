//! The loop's step against in-memory maps: what one pass programs, what it leaves for the agent
//! (UDP sockets to abort, flows to purge, health-check ports), and what health and metrics say.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use super::*;
use crate::lbmap::FakeMaps;

const NODE: &str = "node-1";

/// A DNS-like Service (UDP and TCP 53) with `endpoints` (on this node), a NodePort Service with
/// a healthCheckNodePort, and `extra` manifests.
fn view(endpoints: &[&str], extra: &str) -> ClusterState {
    let endpoints: Vec<String> = endpoints.iter().map(|a| format!("{{addresses: [{a}], nodeName: {NODE}}}")).collect();
    let manifests = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: kube-system}}\n\
         spec: {{clusterIP: 10.96.0.10, ports: [{{name: dns, port: 53, protocol: UDP}}, {{name: dns-tcp, port: 53, protocol: TCP}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: dns-a, namespace: kube-system, labels: {{kubernetes.io/service-name: dns}}}}\n\
         addressType: IPv4\nendpoints: [{}]\n\
         ports: [{{name: dns, port: 53, protocol: UDP}}, {{name: dns-tcp, port: 53, protocol: TCP}}]\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo}}\n\
         spec: {{type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000, clusterIP: 10.96.0.20, \
         ports: [{{port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}]}}\n{extra}",
        endpoints.join(", ")
    );
    let (cluster, unreadable) =
        crate::source::file::parse_manifests(&BTreeMap::from([(PathBuf::from("view.yaml"), manifests.into_bytes())]));
    assert!(unreadable.is_empty(), "{unreadable:?}");
    cluster
}

fn snapshot(cluster: ClusterState, changed: bool) -> Snapshot {
    Snapshot { cluster, changed_at: changed.then(Instant::now), ..Snapshot::default() }
}

/// `cluster` as the kube source hands it out when only the Services `changed` (by name, with
/// their objects in `cluster`, or none: deleted) changed since the view before.
fn changes_of(cluster: ClusterState, changed: &[(&str, &str)]) -> Snapshot {
    let groups = crate::desired::group(&cluster);
    let changes = changed
        .iter()
        .map(|(namespace, name)| {
            let key = (namespace.to_string(), name.to_string());
            let objects = groups.get(&key).cloned().unwrap_or_default();
            (key, objects)
        })
        .collect();
    Snapshot { changes: crate::desired::Changes::Services(changes), ..snapshot(cluster, true) }
}

fn config() -> NodeConfig {
    NodeConfig { node_name: NODE.into(), interface_addresses: vec!["192.168.0.10".parse().unwrap()], ..NodeConfig::default() }
}

fn syncer(maps: FakeMaps) -> Syncer<FakeMaps> {
    Syncer::new(Reconciler::adopt(maps).expect("adopt"), PortRange { min: 30000, max: 32767 })
}

/// The backends (`ip:port`) the maps hold for frontend `ip:port/PROTO`.
fn backends_of(syncer: &Syncer<FakeMaps>, frontend: &str) -> Vec<String> {
    let maps = syncer.reconciler().maps();
    let (key, value) = maps
        .services
        .iter()
        .find(|(key, _)| key.slot() == 0 && crate::reconcile::decode_frontend(key).is_some_and(|f| f.to_string() == frontend))
        .unwrap_or_else(|| panic!("no frontend {frontend}"));
    let mut backends: Vec<String> = (1..=value.count)
        .map(|slot| {
            let backend = crate::reconcile::decode_backend(&maps.backends[&maps.services[&key.with_slot(slot)].backend_id]).unwrap();
            SocketAddr::new(backend.addr, backend.port).to_string()
        })
        .collect();
    backends.sort();
    backends
}

/// `/metrics` as the agent serves it from `st`.
fn rendered(st: &Status) -> String {
    let registry = crate::metrics::registry(&st.metrics, std::sync::Arc::default(), || Ok(Vec::new()));
    crate::metrics::render(&registry).unwrap()
}

#[test]
fn a_pass_programs_the_view_and_says_what_is_left_to_do_outside_the_maps() {
    let status = Mutex::new(Status::default());
    let mut syncer = syncer(FakeMaps::default());

    let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2", "10.244.1.3"], ""), true), &config(), &status);
    assert!(synced.wrote() && !synced.failing && synced.gone_udp.is_empty(), "{synced:?}");
    assert_eq!(backends_of(&syncer, "10.96.0.10:53/UDP"), ["10.244.1.2:53", "10.244.1.3:53"]);
    assert_eq!(backends_of(&syncer, "10.96.0.10:53/TCP"), ["10.244.1.2:53", "10.244.1.3:53"]);
    let checks: Vec<_> = synced.health_checks.iter().map(|(name, check)| (name.name.as_str(), check.port)).collect();
    assert_eq!(checks, [("web", 32000)]);
    {
        let st = status.lock().unwrap();
        assert!(st.last_synced.is_some() && st.oldest_unprogrammed_change.is_none() && st.datapath_error.is_none());
        assert_eq!(
            (st.checkpoint_wanted, st.metrics.syncs.get(), st.metrics.frontends.get()),
            (1, 1, syncer.reconciler().programmed_frontends() as i64)
        );
        let count =
            rendered(&st).lines().find_map(|l| l.strip_prefix("ebpf_proxy_network_programming_duration_seconds_count ")).map(str::to_owned);
        assert_eq!(count.as_deref(), Some("1"), "the first view is one change programmed");
    }

    // One UDP backend leaves: its connected client sockets are to be aborted (the TCP one's
    // connections go on, as with kube-proxy), and the flows of removed backends purged.
    let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2"], ""), true), &config(), &status);
    assert!(synced.wrote() && !synced.failing, "{synced:?}");
    assert_eq!(synced.gone_udp.into_iter().collect::<Vec<_>>(), ["10.244.1.3:53".parse().unwrap()]);
    assert_eq!(backends_of(&syncer, "10.96.0.10:53/UDP"), ["10.244.1.2:53"]);
    assert_eq!(status.lock().unwrap().checkpoint_wanted, 2);

    // The same view again writes nothing and asks for no new checkpoint.
    let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2"], ""), false), &config(), &status);
    assert!(!synced.wrote() && synced.gone_udp.is_empty(), "{synced:?}");
    let st = status.lock().unwrap();
    assert_eq!((st.checkpoint_wanted, st.metrics.syncs.get()), (2, 3));
}

#[test]
fn a_full_map_fails_the_pass_naming_the_service_and_keeps_the_change_pending() {
    let status = Mutex::new(Status::default());
    // Room for a few entries, not for the three Services' frontends and their slots.
    let mut syncer = syncer(FakeMaps::with_capacity(4));
    let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2"], ""), true), &config(), &status);
    assert!(synced.failing, "{synced:?}");
    let st = status.lock().unwrap();
    let error = st.datapath_error.clone().expect("the failure is reported");
    assert!(error.starts_with("not programmed: Service ") && error.ends_with("is full"), "{error}");
    assert!(st.last_synced.is_none() && st.oldest_unprogrammed_change.is_some());
    assert_eq!((st.metrics.sync_failures.get(), st.metrics.syncs.get(), st.checkpoint_wanted), (1, 0, 0));
}

#[test]
fn a_rejected_object_is_counted_once_while_it_stays() {
    let status = Mutex::new(Status::default());
    let mut syncer = syncer(FakeMaps::default());
    let bad = "---\napiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: demo}\n\
               spec: {clusterIP: 10.96.0.300, ports: [{port: 80, protocol: TCP}]}\n";
    for changed in [true, false, true] {
        let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2"], bad), changed), &config(), &status);
        assert!(!synced.failing, "a rejection is not a datapath failure: {synced:?}");
    }
    let st = status.lock().unwrap();
    assert_eq!(st.metrics.rejected_now.get(), 1);
    let rendered = rendered(&st);
    let counted: Vec<&str> = rendered.lines().filter(|l| l.starts_with("ebpf_proxy_rejected_objects_total{")).collect();
    assert_eq!(counted.len(), 1, "{rendered}");
    assert!(counted[0].ends_with(" 1"), "counted once, not per pass: {}", counted[0]);
}

/// The programmed-Services gauge follows Services that gain or lose their frontends and a pass
/// that recovers from a failure, though it is not counted again after every endpoint change.
#[test]
fn the_programmed_services_gauge_follows_services_added_removed_and_recovered() {
    let status = Mutex::new(Status::default());
    let services = |status: &Mutex<Status>| status.lock().unwrap().metrics.services.get();
    let (dns, web, extra) = (("kube-system", "dns"), ("demo", "web"), ("demo", "extra"));
    let extra_service = "---\napiVersion: v1\nkind: Service\nmetadata: {name: extra, namespace: demo}\n\
                         spec: {clusterIP: 10.96.0.30, ports: [{port: 80, protocol: TCP}]}\n";
    let mut syncer = syncer(FakeMaps::default());
    let synced = syncer.sync(Instant::now(), snapshot(view(&["10.244.1.2"], ""), true), &config(), &status);
    assert!(!synced.failing, "{synced:?}");
    assert_eq!(services(&status), 2);

    let synced = syncer.sync(Instant::now(), changes_of(view(&["10.244.1.2", "10.244.1.3"], ""), &[dns]), &config(), &status);
    assert!(synced.wrote() && !syncer.desired.owners_changed(), "an endpoint change gives or takes no frontend");
    assert_eq!(services(&status), 2);

    // The maps are full: a new Service is not programmed, and not counted.
    let full = syncer.reconciler().maps().services.len();
    syncer.reconciler_mut().maps_mut().capacity = full;
    let synced = syncer.sync(Instant::now(), changes_of(view(&["10.244.1.2", "10.244.1.3"], extra_service), &[extra]), &config(), &status);
    assert!(synced.failing, "{synced:?}");
    assert_eq!(services(&status), 2);
    // Room again: a pass that changes nothing retries the failed frontend, and counts it.
    syncer.reconciler_mut().maps_mut().capacity = usize::MAX;
    let synced = syncer.sync(Instant::now(), changes_of(view(&["10.244.1.2", "10.244.1.3"], extra_service), &[]), &config(), &status);
    assert!(!synced.failing, "{synced:?}");
    assert_eq!(services(&status), 3);

    let mut without_web = view(&["10.244.1.2", "10.244.1.3"], extra_service);
    without_web.services.retain(|service| service.name != "web");
    syncer.sync(Instant::now(), changes_of(without_web, &[web]), &config(), &status);
    assert_eq!(services(&status), 2, "web was deleted");
    syncer.sync(Instant::now(), changes_of(view(&["10.244.1.2", "10.244.1.3"], extra_service), &[web]), &config(), &status);
    assert_eq!(services(&status), 3, "web is back");
}
