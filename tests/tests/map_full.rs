//! A map filled to capacity: the Service that does not fit is named in the log and left out,
//! every other Service keeps working, and nothing half-built is exposed.


use e2e::agent::{Agent, AgentDir};
use e2e::scenario::{client_and_two_backends, manifest, VIP};

#[test]
fn a_full_service_map_names_the_service_that_did_not_fit_and_keeps_the_others() {
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let base = manifest(&["10.244.1.11", "10.244.1.12"]);
    dir.write_manifest(&base).expect("manifest");
    // Every frontend has an internal and an external entry. web: 2 frontends x 2 scopes x
    // (slot 0 + 2 backends) = 12 entries, empty: 2 x slot 0 = 2; room for 1 more.
    let agent = Agent::start_file_with_args(&topo, &dir, &["--map-size-services=15"]).expect("agent");

    let big = r#"---
apiVersion: v1
kind: Service
metadata: {name: big, namespace: demo}
spec:
  clusterIP: 10.96.0.40
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: big-1
  namespace: demo
  labels: {kubernetes.io/service-name: big}
addressType: IPv4
endpoints: [{addresses: [10.244.1.11]}, {addresses: [10.244.1.12]}]
ports: [{name: http, port: 8080, protocol: TCP}]
"#;
    dir.write_manifest(&format!("{base}{big}")).expect("manifest with big");
    agent.wait_for_log("not programmed: Service demo/big:http");

    let log = agent.log_text();
    assert!(
        log.contains("not programmed: Service demo/big:http (10.96.0.40:80/TCP)") && log.contains("epx_svc4_v1 is full"),
        "the error must name the Service and the full map:\n{log}"
    );
    let dump = agent.dump().expect("dump");
    let services = dump["services"].as_array().expect("services");
    assert!(!services.iter().any(|s| s["ip"] == "10.96.0.40"), "a half-built Service must not be visible: {dump}");
    assert_eq!(services.len(), 6, "{dump}");
    let web = e2e::probe::tcp(&topo, "client", &format!("{VIP}:80"), 50).expect("probe");
    assert_eq!(web.failed, 0, "the Services that fit keep working: {web:?}");
    assert!(web.answered_by("be1") > 0 && web.answered_by("be2") > 0, "{web:?}");
}
