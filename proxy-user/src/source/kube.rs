//! `kube`: Services, EndpointSlices and the agent's own Node from the Kubernetes API.
//!
//! One kube-runtime watcher (with backoff) per kind, folded into a store owned here. The view is
//! published only once every kind has completed its initial list, and a relist replaces a kind's
//! objects atomically at `InitDone`: an object deleted while the watch was down disappears with
//! the next relist, and a partial list is never seen.
//!
//! After a watch error, or a failed probe of the API, the view counts as unconfirmed (health:
//! stale). A resumed watch that has nothing to report would never confirm it, and the watcher's
//! backoff may wait 30 s before it even retries, so the API is probed (every 10 s, every 2 s while
//! failing); as soon as it answers again, the failed watchers are recreated, which relists them at
//! once (this also gets past a `410 Gone` after an API server restart, and catches deletions a
//! reconnecting watch could have missed). Meanwhile the datapath keeps its last state.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Config, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::agent::error_chain;
use crate::desired::ClusterState;
use crate::source::{Snapshot, SourceHandle, SourceHealth};

/// Server-side timeout of each watch call. kube-runtime treats a watch that stays silent for this
/// plus 5 s as dead and reconnects, so a black-holed or half-open API connection (kubernetes#56720)
/// is noticed within 35 s instead of hanging forever.
const WATCH_TIMEOUT_SECS: u32 = 30;
/// Bound on waiting for any response bytes (lists included); above the watch timeout so a quiet
/// but healthy watch is never cut.
const READ_TIMEOUT: Duration = Duration::from_secs(40);
/// The API is probed (`GET /version`) this often while all is well: a black-holed or half-open
/// connection is then reported within PROBE_INTERVAL + PROBE_TIMEOUT (15 s), not only when a watch
/// times out. One tiny request per node every 10 s is the price.
const PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// ... and this often while something is failing, to recover quickly.
const PROBE_INTERVAL_FAILING: Duration = Duration::from_secs(2);
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A client from `--kubeconfig`, else the in-cluster config, else `$KUBECONFIG`/~/.kube/config.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using --kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context("no in-cluster config and no kubeconfig found")?,
    };
    config.read_timeout = Some(READ_TIMEOUT);
    tracing::info!(server = %config.cluster_url, "Kubernetes API source");
    Client::try_from(config).context("building the Kubernetes client")
}

/// The objects of one kind as the last complete list plus later watch events say.
struct KindStore<K> {
    kind: &'static str,
    objects: BTreeMap<(String, String), Arc<K>>,
    /// Objects of a relist in progress; swapped in at `InitDone`.
    relist: Option<BTreeMap<(String, String), Arc<K>>>,
    listed: bool,
    failing: bool,
}

impl<K: Resource + Clone> KindStore<K> {
    fn new(kind: &'static str) -> Self {
        Self { kind, objects: BTreeMap::new(), relist: None, listed: false, failing: false }
    }

    /// Folds in one watcher event; returns whether the visible objects changed.
    fn apply(&mut self, event: watcher::Event<K>) -> bool {
        let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
        match event {
            watcher::Event::Apply(object) => {
                self.failing = false;
                self.objects.insert(key(&object), Arc::new(object));
                true
            }
            watcher::Event::Delete(object) => {
                self.failing = false;
                self.objects.remove(&key(&object)).is_some()
            }
            // `Init` is emitted before the list request is even sent, and a relist in progress
            // is not a confirmed view: the kind stays failing (stale) until `InitDone`.
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(object) => {
                self.relist.get_or_insert_with(BTreeMap::new).insert(key(&object), Arc::new(object));
                false
            }
            watcher::Event::InitDone => {
                self.failing = false;
                self.objects = self.relist.take().unwrap_or_default();
                self.listed = true;
                true
            }
        }
    }

    fn snapshot(&self) -> Vec<Arc<K>> {
        self.objects.values().cloned().collect()
    }
}

fn watch<K>(api: Api<K>, config: watcher::Config) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>
where
    K: Trim + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher(api, config.timeout(WATCH_TIMEOUT_SECS))
        .default_backoff()
        .modify(Trim::trim)
        .boxed()
}

/// Only what the agent reads of an object is kept in its store: managedFields, kubectl's
/// last-applied copy, owner references and the like are most of a small object's size (at
/// 30 000 Services and slices, tens of MiB) and nothing the datapath needs.
trait Trim: Resource {
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.owner_references = None;
        meta.finalizers = None;
        meta.uid = None;
        meta.creation_timestamp = None;
        meta.generation = None;
        meta.generate_name = None;
        // The only annotation read: when the endpoints last changed (network programming latency).
        if let Some(annotations) = meta.annotations.as_mut() {
            annotations.retain(|key, _| key == crate::metrics::ANNOTATION_LAST_CHANGE_TRIGGER_TIME);
        }
        self.trim_kind();
    }

    fn trim_kind(&mut self) {}
}

impl Trim for Service {}

impl Trim for EndpointSlice {
    fn trim_kind(&mut self) {
        for endpoint in &mut self.endpoints {
            // The Pod behind each endpoint (kind, name, namespace, uid, resourceVersion).
            endpoint.target_ref = None;
            endpoint.deprecated_topology = None;
        }
    }
}

impl Trim for Node {
    fn trim_kind(&mut self) {
        if let Some(status) = self.status.as_mut() {
            // Addresses stay; the image list (often the largest part of a Node), conditions,
            // volumes and versions are not read.
            status.images = None;
            status.conditions = None;
            status.volumes_attached = None;
            status.volumes_in_use = None;
            status.node_info = None;
            status.capacity = None;
            status.allocatable = None;
        }
    }
}

struct Stores {
    services: KindStore<Service>,
    slices: KindStore<EndpointSlice>,
    nodes: KindStore<Node>,
    /// When the oldest change not read by the agent yet arrived.
    unread_change: Option<Instant>,
}

impl Stores {
    fn listed(&self) -> bool {
        self.services.listed && self.slices.listed && self.nodes.listed
    }
    fn failing(&self) -> bool {
        self.services.failing || self.slices.failing || self.nodes.failing
    }
}

/// Folds one event (or error) of a kind into its store; returns whether the view changed.
fn fold<K: Resource + Clone>(
    store: &mut KindStore<K>,
    event: Option<Result<watcher::Event<K>, watcher::Error>>,
    health: &SourceHealth,
) -> bool {
    match event {
        Some(Ok(event)) => store.apply(event),
        Some(Err(error)) => {
            store.failing = true;
            let error = error_chain(&error);
            tracing::warn!(kind = store.kind, "watch failed; the datapath keeps its last state: {error}");
            health.failed(format!("{}: {error}", store.kind));
            false
        }
        // kube-runtime watchers never end; treat it as a failure to be relisted.
        None => {
            store.failing = true;
            false
        }
    }
}

/// Starts the watchers and returns the handle the agent reads from.
pub fn start(client: Client, node_name: &str, health: Arc<SourceHealth>) -> SourceHandle {
    let (generation_tx, generation) = tokio::sync::watch::channel(0u64);
    let stores = Arc::new(Mutex::new(Stores {
        services: KindStore::new("Service"),
        slices: KindStore::new("EndpointSlice"),
        nodes: KindStore::new("Node"),
        unread_change: None,
    }));
    let shared = stores.clone();
    let node_fields = format!("metadata.name={node_name}");

    tokio::spawn(async move {
        let services_api = Api::<Service>::all(client.clone());
        let slices_api = Api::<EndpointSlice>::all(client.clone());
        let nodes_api = Api::<Node>::all(client.clone());
        let node_config = || watcher::Config::default().fields(&node_fields);
        let mut services = watch(services_api.clone(), watcher::Config::default());
        let mut slices = watch(slices_api.clone(), watcher::Config::default());
        let mut nodes = watch(nodes_api.clone(), node_config());
        let mut next_probe = tokio::time::Instant::now() + PROBE_INTERVAL;
        let mut probe_failed = false;
        let mut was_stale = false;

        loop {
            let changed = tokio::select! {
                e = services.next() => fold(&mut shared.lock().expect("stores lock").services, e, &health),
                e = slices.next() => fold(&mut shared.lock().expect("stores lock").slices, e, &health),
                e = nodes.next() => fold(&mut shared.lock().expect("stores lock").nodes, e, &health),
                _ = tokio::time::sleep_until(next_probe) => {
                    let answered = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
                        Ok(Ok(_)) => true,
                        Ok(Err(error)) => {
                            health.failed(format!("API probe: {}", error_chain(&error)));
                            false
                        }
                        Err(_) => {
                            health.failed(format!("API probe: no answer within {PROBE_TIMEOUT:?}"));
                            false
                        }
                    };
                    let mut st = shared.lock().expect("stores lock");
                    if answered && (probe_failed || st.failing()) {
                        // Recreated watchers relist at once, without the old backoff.
                        let all = probe_failed;
                        if all || st.services.failing { services = watch(services_api.clone(), watcher::Config::default()); }
                        if all || st.slices.failing { slices = watch(slices_api.clone(), watcher::Config::default()); }
                        if all || st.nodes.failing { nodes = watch(nodes_api.clone(), node_config()); }
                        // Confirmed only by the relists' InitDone.
                        st.services.failing |= all;
                        st.slices.failing |= all;
                        st.nodes.failing |= all;
                        tracing::info!("the Kubernetes API answers again; relisting what the failed watches missed");
                    } else if !answered && !probe_failed {
                        tracing::warn!("the Kubernetes API does not answer; the datapath keeps its last state");
                    }
                    probe_failed = !answered;
                    let failing = probe_failed || st.failing();
                    next_probe = tokio::time::Instant::now() + if failing { PROBE_INTERVAL_FAILING } else { PROBE_INTERVAL };
                    false
                }
            };
            let mut st = shared.lock().expect("stores lock");
            let stale = probe_failed || st.failing();
            if stale {
                next_probe = next_probe.min(tokio::time::Instant::now() + PROBE_INTERVAL_FAILING);
            } else if was_stale && health.succeeded() {
                tracing::info!("every watch is confirmed again; the datapath follows the API");
            }
            was_stale = stale;
            if changed && st.listed() {
                st.unread_change.get_or_insert_with(Instant::now);
                drop(st);
                generation_tx.send_modify(|g| *g += 1);
                if *generation_tx.borrow() == 1 {
                    tracing::info!("initial lists of Services, EndpointSlices and the Node received");
                }
            }
        }
    });

    let read = move || {
        let mut st = stores.lock().expect("stores lock");
        Snapshot {
            changed_at: st.unread_change.take(),
            cluster: ClusterState {
                services: st.services.snapshot(),
                slices: st.slices.snapshot(),
                node: st.nodes.objects.values().next().cloned(),
            },
            rejections: Vec::new(),
        }
    };
    SourceHandle { generation, read: Arc::new(read) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn svc(name: &str) -> Service {
        Service { metadata: ObjectMeta { name: Some(name.into()), namespace: Some("ns".into()), ..Default::default() }, ..Default::default() }
    }

    fn names(store: &KindStore<Service>) -> Vec<String> {
        store.objects.keys().map(|(_, n)| n.clone()).collect()
    }

    #[test]
    fn a_relist_replaces_the_objects_atomically_and_drops_what_was_not_listed() {
        let mut store = KindStore::new("Service");
        for event in [watcher::Event::Init, watcher::Event::InitApply(svc("a")), watcher::Event::InitApply(svc("b"))] {
            assert!(!store.apply(event));
        }
        assert!(!store.listed && store.objects.is_empty(), "nothing is visible before InitDone");
        assert!(store.apply(watcher::Event::InitDone));
        assert_eq!(names(&store), ["a", "b"]);

        // A watch error, then a relist that no longer has "a" (deleted during the outage).
        store.failing = true;
        store.apply(watcher::Event::Init);
        store.apply(watcher::Event::InitApply(svc("b")));
        assert_eq!(names(&store), ["a", "b"], "the old view stays until the relist is complete");
        assert!(store.failing, "a relist in progress is not a confirmed view (health stays stale)");
        assert!(store.apply(watcher::Event::InitDone));
        assert_eq!(names(&store), ["b"]);
        assert!(!store.failing);

        assert!(store.apply(watcher::Event::Apply(svc("c"))));
        assert!(store.apply(watcher::Event::Delete(svc("b"))));
        assert!(!store.apply(watcher::Event::Delete(svc("zz"))));
        assert_eq!(names(&store), ["c"]);
    }
}
