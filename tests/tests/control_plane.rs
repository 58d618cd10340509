//! The control-plane harness itself: real etcd + kube-apiserver in a pod, reached from the host's
//! loopback through the forwarder, with apply/delete, restarts, a black hole and token identities.

use std::time::{Duration, Instant};

use e2e::control_plane::{ControlPlane, KUBERNETES_SERVICE_IP};
use e2e::topology::Topology;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams};

const DEMO: &str = "
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
    protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: [10.244.1.10]
  conditions: {ready: true}
- addresses: [10.244.1.11]
  conditions: {ready: true}
";

const KEPT: &str = "
apiVersion: v1
kind: Service
metadata:
  name: kept
  namespace: demo
spec:
  ports:
  - port: 53
    protocol: UDP
";

const READER_RBAC: &str = "
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: epx-reader
rules:
- apiGroups: ['']
  resources: [services]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: epx-reader
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: epx-reader
subjects:
- kind: ServiceAccount
  name: reader
  namespace: kube-system
";

/// At most `secs` seconds for one API call, so a hanging call fails the assertion instead.
async fn within<T>(secs: u64, call: impl std::future::Future<Output = kube::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_secs(secs), call).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {secs} s")),
    }
}

#[test]
fn apply_read_delete_restart_blackhole_and_tokens_against_a_real_apiserver() {
    let mut topo = Topology::new().expect("topology");
    let started = Instant::now();
    let mut cp = ControlPlane::start(&mut topo).expect("control plane");
    eprintln!("etcd + kube-apiserver ready in {:.1?} at {}", started.elapsed(), cp.url);
    assert!(cp.url.starts_with("https://127.0.0.1:"), "{}", cp.url);

    let client = cp.client();
    let services: Api<Service> = Api::namespaced(client.clone(), "demo");
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "demo");

    // The apiserver's own Service, as every cluster has it.
    let kubernetes = cp
        .block_on(Api::<Service>::namespaced(client.clone(), "default").get("kubernetes"))
        .expect("Service default/kubernetes");
    assert_eq!(
        kubernetes.spec.and_then(|s| s.cluster_ip).as_deref(),
        Some(KUBERNETES_SERVICE_IP.to_string().as_str())
    );

    // Apply (namespace created on the way), read back, apply again changed, delete.
    cp.apply(DEMO).expect("apply Service + EndpointSlice");
    let web = cp.block_on(services.get("web")).expect("get Service web");
    let spec = web.spec.expect("Service spec");
    assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
    assert_eq!(spec.ports.expect("ports")[0].port, 80);
    let slice = cp.block_on(slices.get("web-1")).expect("get EndpointSlice web-1");
    assert_eq!(slice.endpoints.len(), 2);
    assert_eq!(
        slice.metadata.labels.as_ref().and_then(|l| l.get("kubernetes.io/service-name")).map(String::as_str),
        Some("web")
    );

    cp.apply(&DEMO.replace("- addresses: [10.244.1.11]\n  conditions: {ready: true}\n", ""))
        .expect("re-apply without one endpoint");
    let slice = cp.block_on(slices.get("web-1")).expect("get EndpointSlice web-1");
    assert_eq!(slice.endpoints.len(), 1, "apply replaces: {:?}", slice.endpoints);

    cp.delete("discovery.k8s.io/v1", "EndpointSlice", "demo", "web-1").expect("delete EndpointSlice");
    cp.delete("v1", "Service", "demo", "web").expect("delete Service");
    assert!(cp.block_on(services.get_opt("web")).expect("get_opt Service").is_none(), "Service web still there");
    assert!(cp.block_on(slices.get_opt("web-1")).expect("get_opt EndpointSlice").is_none(), "slice still there");
    assert!(cp.delete("v1", "Service", "demo", "web").is_err(), "deleting a missing object must fail");

    // Stop only kube-apiserver: requests fail; start it again: they work, and etcd kept the data.
    cp.apply(KEPT).expect("apply Service kept");
    cp.stop_apiserver().expect("stop kube-apiserver");
    let down = cp.block_on(within(10, services.list(&ListParams::default())));
    assert!(down.is_err(), "a request succeeded with kube-apiserver stopped: {down:?}");
    eprintln!("with kube-apiserver stopped: {}", down.err().unwrap_or_default());
    let restarted = Instant::now();
    cp.start_apiserver().expect("start kube-apiserver again");
    eprintln!("kube-apiserver restarted in {:.1?}", restarted.elapsed());
    let kept = cp.block_on(within(10, services.get("kept"))).expect("Service kept after the restart");
    assert_eq!(kept.metadata.namespace.as_deref(), Some("demo"));

    // Black hole: a request hangs (no refusal, no close); lifted, requests work again.
    cp.forwarder().set_blackhole(true);
    let held = cp.block_on(within(3, services.get("kept")));
    assert!(held.is_err(), "a request passed the black hole: {held:?}");
    assert!(held.err().unwrap_or_default().contains("no answer"), "black hole must hang, not fail");
    cp.forwarder().set_blackhole(false);
    cp.block_on(within(10, services.get("kept"))).expect("request after the black hole");

    // Another identity: a ServiceAccount token that may read Services and nothing else.
    cp.apply(READER_RBAC).expect("apply RBAC");
    let token = cp.service_account_token("kube-system", "reader").expect("token");
    let kubeconfig = cp.dir.join("reader.kubeconfig");
    cp.kubeconfig_for_token(&token, &kubeconfig).expect("kubeconfig");
    let reader = cp
        .block_on(async {
            let file = kube::config::Kubeconfig::read_from(&kubeconfig)?;
            let config = kube::Config::from_custom_kubeconfig(file, &Default::default()).await?;
            anyhow::Ok(kube::Client::try_from(config)?)
        })
        .expect("reader client");
    let reader_services: Api<Service> = Api::namespaced(reader.clone(), "demo");
    let listed = cp.block_on(within(10, reader_services.list(&ListParams::default()))).expect("reader lists Services");
    assert_eq!(listed.items.len(), 1);
    let denied = cp.block_on(within(10, reader_services.delete("kept", &DeleteParams::default())));
    assert!(denied.as_ref().is_err_and(|e| e.contains("forbidden")), "reader could delete: {denied:?}");
    let slices_denied = cp.block_on(within(10, Api::<EndpointSlice>::all(reader).list(&ListParams::default())));
    assert!(slices_denied.is_err(), "reader could list EndpointSlices");

    let dir = cp.dir.clone();
    drop(cp);
    assert!(!dir.exists(), "{} left behind", dir.display());
}
