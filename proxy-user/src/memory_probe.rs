//! Where the agent's memory goes at scale: live heap bytes (a counting allocator, tests only)
//! after the cluster objects as the kube source keeps them, the desired state, and the
//! reconciler's record of the maps. A measurement, not a check (ignored; run with
//! `cargo test --release -p proxy-user -- --ignored --nocapture memory`); the benchmark report
//! quotes it next to the agent's peak RSS.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::desired::{Changes, ClusterState, Incremental, NodeConfig, ServiceInfo, Slice};
use crate::lbmap::FakeMaps;
use crate::reconcile::Reconciler;
use crate::source::kube::{Belongs, KindStore, Trim};
use kube::runtime::watcher::Event;

/// The system allocator, counting the bytes live.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The most bytes live at once since [`peak_reset`].
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(by: isize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn mib(bytes: isize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn live_mib() -> f64 {
    mib(LIVE.load(Ordering::Relaxed))
}

/// Starts a new peak at what is live now.
fn peak_reset() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The most live at once since [`peak_reset`], above what was live then (`base`, MiB).
fn peak_above(base: f64) -> f64 {
    mib(PEAK.load(Ordering::Relaxed)) - base
}

/// A Service as the API serves it, trimmed and converted as the kube source does.
fn service(i: usize) -> ServiceInfo {
    let ip = format!("10.{}.{}.{}", 96 + i / 65_536, (i / 256) % 256, i % 256);
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("svc-{i}"), "namespace": "bench", "resourceVersion": format!("{}", 100_000 + i)},
        "spec": {
            "type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack", "internalTrafficPolicy": "Cluster", "sessionAffinity": "None",
            "selector": {"app": format!("app-{i}")},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
        "status": {"loadBalancer": {}},
    }))
    .map(|mut service: Service| {
        service.trim();
        service.into()
    })
    .expect("service")
}

/// An EndpointSlice of `endpoints` endpoints as the API serves it, trimmed and converted as the
/// kube source does.
fn slice(i: usize, endpoints: usize) -> Slice {
    let endpoints: Vec<_> = (0..endpoints)
        .map(|e| {
            let n = i * endpoints + e;
            serde_json::json!({
                "addresses": [format!("10.{}.{}.{}", 128 + n / 65_536, (n / 256) % 256, n % 256)],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": format!("node-{}", n % 100),
            })
        })
        .collect();
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("svc-{i}-abcde"), "namespace": "bench", "resourceVersion": format!("{}", 200_000 + i),
            "labels": {"kubernetes.io/service-name": format!("svc-{i}"), "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-04T00:00:00Z"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }))
    .expect("slice");
    let mut slice = slice;
    slice.trim();
    slice.into()
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn memory_at_30000_services_of_10_endpoints() {
    const SERVICES: usize = 30_000;
    const ENDPOINTS: usize = 10;
    let start = live_mib();
    // Folded into the kube source's stores one object at a time, as a streaming list delivers
    // them (the objects, their keys, the index by Service); the agent reads a snapshot of them.
    let mut service_store = KindStore::new("Service", Belongs::Itself);
    service_store.apply(Event::Init);
    (0..SERVICES).for_each(|i| _ = service_store.apply(Event::InitApply(service(i))));
    service_store.apply(Event::InitDone);
    let service_objects = live_mib();
    let mut slice_store = KindStore::new("EndpointSlice", Belongs::To(crate::desired::slice_service_key));
    slice_store.apply(Event::Init);
    (0..SERVICES).for_each(|i| _ = slice_store.apply(Event::InitApply(slice(i, ENDPOINTS))));
    slice_store.apply(Event::InitDone);
    let cluster = ClusterState { services: service_store.snapshot(), slices: slice_store.snapshot(), node: None };
    let objects = live_mib();
    let config = NodeConfig { node_name: "node-0".into(), interface_addresses: vec!["192.168.0.10".parse().unwrap()], ..Default::default() };
    let mut desired = Incremental::default();
    peak_reset();
    desired.update(&cluster, &config, &Changes::All);
    let state = live_mib();
    let update_peak = peak_above(objects);
    let mut reconciler = Reconciler::adopt(FakeMaps { checked: false, ..FakeMaps::default() }).expect("adopt");
    peak_reset();
    let report = reconciler.reconcile(desired.state());
    assert!(report.failures.is_empty());
    let reconciled = live_mib();
    let reconcile_peak = peak_above(state);
    let maps = reconciler.maps().clone();
    let fake_maps = live_mib() - reconciled;
    drop(maps);
    eprintln!(
        "{SERVICES} Services x {ENDPOINTS} endpoints, live heap MiB: the source's stores and a snapshot {:.1} (Services {:.1}), desired state {:.1}, reconciler {:.1} \
         (its fake maps, the kernel's share in the agent, {:.1} of it): total without the maps {:.1}",
        objects - start,
        service_objects - start,
        state - objects,
        reconciled - state,
        fake_maps,
        reconciled - start - fake_maps,
    );
    eprintln!(
        "transient peaks above what was live before, MiB: the first full update of the desired state {update_peak:.1}, \
         the first reconcile {reconcile_peak:.1} (the fake maps included)"
    );
    eprintln!("the reconciler's parts, MiB: {:?}", reconciler.drop_measured(live_mib).iter().map(|(name, mib)| format!("{name} {mib:.1}")).collect::<Vec<_>>());
}

/// The agent loop's pass for one endpoint change at 30 000 Services (the benchmark's "one
/// endpoint removed" figure minus the watch), with the parts that scale with the cluster timed
/// on their own. A measurement, not a check: run with `--ignored --nocapture pass_time`.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn pass_time_of_one_endpoint_change_at_30000_services() {
    use std::time::Instant;

    use crate::agent::{Status, Syncer};
    use crate::desired::{slice_service_key, ServiceObjects};
    use crate::source::Snapshot;

    const SERVICES: usize = 30_000;
    const ENDPOINTS: usize = 10;
    let services: Vec<_> = (0..SERVICES).map(|i| Arc::new(service(i))).collect();
    let slices: Vec<_> = (0..SERVICES)
        .map(|i| Arc::new(slice(i, ENDPOINTS)))
        .collect();
    let cluster = ClusterState {
        services,
        slices,
        node: None,
    };
    let config = NodeConfig {
        node_name: "node-0".into(),
        interface_addresses: vec!["192.168.0.10".parse().unwrap()],
        ..Default::default()
    };
    // The first pass's two parts on their own.
    let part = Instant::now();
    let mut alone = crate::desired::Incremental::default();
    alone.update(&cluster, &config, &Changes::All);
    let computed = part.elapsed();
    let part = Instant::now();
    let mut maps = Reconciler::adopt(FakeMaps { checked: false, ..FakeMaps::default() }).expect("adopt");
    let report = maps.reconcile(alone.state());
    eprintln!(
        "first pass's parts: the desired state {:.0} ms, the reconcile into in-memory maps {:.0} ms ({} writes)",
        computed.as_secs_f64() * 1e3,
        part.elapsed().as_secs_f64() * 1e3,
        report.writes
    );
    drop((alone, maps));
    let status = std::sync::Mutex::new(Status::default());
    let reconciler = Reconciler::adopt(FakeMaps {
        checked: false,
        ..FakeMaps::default()
    })
    .expect("adopt");
    let mut syncer = Syncer::new(
        reconciler,
        crate::snat_ports::PortRange {
            min: 30000,
            max: 32767,
        },
    );
    let started = Instant::now();
    let first = Snapshot {
        cluster: cluster.clone(),
        changed_at: Some(started),
        ..Snapshot::default()
    };
    assert!(!syncer.sync(started, first, &config, &status).failing);
    eprintln!(
        "first pass (everything): {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );

    let mut passes = Vec::new();
    let mut current = cluster;
    for round in 0..10 {
        // The newest Service's slice loses (or gets back) its last endpoint.
        let i = SERVICES - 1;
        let changed = Arc::new(slice(
            i,
            if round % 2 == 0 {
                ENDPOINTS - 1
            } else {
                ENDPOINTS
            },
        ));
        current.slices[i] = changed.clone();
        let key = slice_service_key(&changed);
        let objects = ServiceObjects {
            services: vec![current.services[i].clone()],
            slices: vec![changed],
        };
        // What the kube source's read does: a view sharing every unchanged object.
        let read = Instant::now();
        let view = ClusterState {
            services: current.services.clone(),
            slices: current.slices.clone(),
            node: None,
        };
        let read = read.elapsed();
        let snapshot = Snapshot {
            cluster: view,
            changed_at: Some(Instant::now()),
            change_times: Some(vec![std::time::SystemTime::now()]),
            changes: Changes::Services([(key, objects)].into()),
            // As the kube source says it: the one slice changed.
            object_changes: Some(crate::metrics::ObjectChanges {
                services: Default::default(),
                slices: [(current.slices[i].namespace.clone(), current.slices[i].name.clone())].into(),
            }),
            ..Snapshot::default()
        };
        let started = Instant::now();
        let synced = syncer.sync(started, snapshot, &config, &status);
        assert!(synced.wrote() && !synced.failing);
        passes.push((read, started.elapsed()));
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let mut times: Vec<f64> = passes.iter().map(|(_, pass)| ms(*pass)).collect();
    times.sort_by(f64::total_cmp);
    eprintln!(
        "{SERVICES} Services x {ENDPOINTS} endpoints, one endpoint change: the pass takes {:.2} ms median, {:.2} ms max; the source's read {:.2} ms",
        times[times.len() / 2],
        times[times.len() - 1],
        passes.iter().map(|(read, _)| ms(*read)).fold(0.0, f64::max),
    );
    let view = ClusterState {
        services: current.services.clone(),
        slices: current.slices.clone(),
        node: None,
    };
    let state_dir = std::env::temp_dir().join(format!("epx-probe-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&state_dir).expect("state dir");
    let parts: [(&str, &dyn Fn()); 4] = [
        ("the checkpoint's write (off the loop)", &|| {
            crate::checkpoint::save(&state_dir, syncer.desired()).expect("checkpoint");
        }),
        ("health checks", &|| {
            drop(crate::healthcheck::health_checks(&view, "node-0"))
        }),
        ("changed objects by comparing views (metrics, file source only)", &|| {
            drop(crate::metrics::ObjectChanges::between(&view, &current))
        }),
        ("programmed services (metrics, when a Service gains or loses a frontend)", &|| {
            let _ = crate::metrics::programmed_services(
                syncer.desired().frontends.values().map(|s| &s.service),
                std::iter::empty(),
            );
        }),
    ];
    for (name, part) in parts {
        let started = Instant::now();
        part();
        eprintln!("  of which {name}: {:.2} ms", ms(started.elapsed()));
    }
    let size = std::fs::metadata(crate::checkpoint::path(&state_dir)).map(|m| m.len()).unwrap_or(0);
    eprintln!("  the checkpoint: {:.1} MiB", size as f64 / 1048576.0);
    std::fs::remove_dir_all(&state_dir).expect("removing the probe's state dir");
}
