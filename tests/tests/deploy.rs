//! The manifests in `deploy/` against the real kube-apiserver: they apply cleanly, and the agent
//! running with the DaemonSet's ServiceAccount can do all it needs and nothing more.

use std::path::PathBuf;

use e2e::agent::{Agent, AgentDir};
use e2e::kube_scenario::{service, slice, VIP};
use e2e::control_plane::ControlPlane;
use e2e::probe;
use e2e::topology::Topology;

fn deploy_file(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn deploy_manifests_pass_a_server_side_dry_run() {
    let mut topo = Topology::new().expect("topology");
    // As any standard cluster (kubeadm's default): the bpffs init container is privileged.
    let api = ControlPlane::start_with(&mut topo, &["--allow-privileged=true"]).expect("control plane");
    // The namespace must exist for the namespaced objects to be admitted, even in a dry run.
    api.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: ebpf-proxy}\n").expect("namespace");
    for file in ["rbac.yaml", "daemonset.yaml", "uninstall.yaml"] {
        api.apply_dry_run(&deploy_file(file)).unwrap_or_else(|e| panic!("deploy/{file} rejected: {e:#}"));
    }
}

#[test]
fn the_agent_runs_with_the_daemonsets_service_account_and_cannot_write() {
    let mut topo = Topology::new().expect("topology");
    topo.add_pod("client", 2).expect("client");
    topo.add_pod("be1", 11).expect("be1");
    let _server = probe::serve(&topo, "be1", "be1", &[8080], &[5353]).expect("server");
    let api = ControlPlane::start(&mut topo).expect("control plane");
    api.apply(&deploy_file("rbac.yaml")).expect("rbac");
    api.apply(&format!("{}---\n{}", service("web", VIP), slice("web", &["10.244.1.11"]))).expect("web");

    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let token = api.service_account_token("ebpf-proxy", "ebpf-proxy").expect("token");
    let kubeconfig = dir.dir.join("agent.kubeconfig");
    api.kubeconfig_for_token(&token, &kubeconfig).expect("kubeconfig");

    // Everything the agent needs: list/watch Services, EndpointSlices and its Node.
    let agent = Agent::start_kube(&topo, &dir, &kubeconfig).expect("agent with the DaemonSet's identity");
    let summary = probe::tcp(&topo, "client", &format!("{VIP}:80"), 20).expect("probe");
    assert_eq!((summary.ok, summary.answered_by("be1")), (20, 20), "{summary:?}");
    assert!(!agent.log_text().contains("Forbidden"), "{}", agent.log_text());

    // And nothing more: a write with the same identity is refused.
    let restricted = api.client_for_kubeconfig(&kubeconfig).expect("restricted client");
    let refused = api.block_on(async {
        let services: kube::Api<k8s_openapi::api::core::v1::Service> = kube::Api::namespaced(restricted, "demo");
        services.delete("web", &Default::default()).await
    });
    match refused {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("a write with the agent's identity must be forbidden, got {other:?}"),
    }
}
