//! The agent against the real kube-apiserver (and etcd): Services and EndpointSlices created,
//! changed and deleted through the API change real traffic within a second.

use std::time::Duration;

use e2e::kube_scenario::{service, slice, KubeEnv, OTHER_VIP, VIP};
use e2e::probe;

#[test]
fn services_and_slices_from_the_api_server_steer_real_traffic() {
    let cluster = KubeEnv::new();
    let summary = cluster.tcp(&format!("{VIP}:80"), 100);
    assert_eq!(summary.failed, 0, "{summary:?}");
    assert!(summary.answered_by("be1") >= 20 && summary.answered_by("be2") >= 20, "{summary:?}");
    let udp = probe::udp(&cluster.topo, "client", &format!("{VIP}:53"), 50).expect("udp");
    assert_eq!(udp.failed, 0, "{udp:?}");
    // The API server's own `kubernetes` Service is programmed too.
    assert!(cluster.frontends().contains(&"10.96.0.1:443/TCP".to_owned()), "{:?}", cluster.frontends());
}

#[test]
fn api_changes_reach_the_datapath_within_one_second() {
    let cluster = KubeEnv::new();

    // An endpoint removed through the API.
    cluster.api.apply(&slice("web", &["10.244.1.11"])).expect("shrink slice");
    let took = cluster.within(Duration::from_secs(1), "removing be2", |c| {
        c.agent.dump().expect("dump")["services"]
            .as_array()
            .expect("services")
            .iter()
            .filter(|s| s["ip"] == VIP)
            .all(|s| s["backends"].as_array().is_some_and(|b| b.len() == 1))
    });
    eprintln!("endpoint removal programmed after {took:?}");
    let after = cluster.tcp(&format!("{VIP}:80"), 50);
    assert_eq!((after.failed, after.answered_by("be2")), (0, 0), "{after:?}");

    // A new Service created through the API.
    cluster
        .api
        .apply(&format!("{}---\n{}", service("other", OTHER_VIP), slice("other", &["10.244.1.12"])))
        .expect("create other");
    let took = cluster.within(Duration::from_secs(1), "creating Service other", |c| {
        c.frontends().contains(&format!("{OTHER_VIP}:80/TCP"))
    });
    eprintln!("Service creation programmed after {took:?}");
    let other = cluster.tcp(&format!("{OTHER_VIP}:80"), 20);
    assert_eq!((other.ok, other.answered_by("be2")), (20, 20), "{other:?}");

    // A Service deleted through the API.
    cluster.api.delete("v1", "Service", "demo", "other").expect("delete other");
    let took = cluster.within(Duration::from_secs(1), "deleting Service other", |c| {
        !c.frontends().iter().any(|f| f.starts_with(OTHER_VIP))
    });
    eprintln!("Service deletion programmed after {took:?}");
    // web is untouched by all of this.
    let web = cluster.tcp(&format!("{VIP}:80"), 20);
    assert_eq!(web.failed, 0, "{web:?}");
}
