//! `kube`: Services, EndpointSlices and the agent's own Node from the Kubernetes API.
//!
//! One watcher with backoff per kind, each reflected into a store. The view is published only
//! once every store has completed its initial list, and kube-runtime's store swaps in a relist
//! atomically at `InitDone`, so an object deleted while the watch was down disappears on the next
//! relist and a partial list is never seen. Watch errors are retried with backoff forever; the
//! datapath keeps its last state meanwhile.

use std::path::Path;
use std::pin::pin;
use std::sync::Arc;

use anyhow::Context;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Config};

use crate::agent::error_chain;
use crate::desired::ClusterState;
use crate::source::{Snapshot, SourceHandle, SourceHealth};

/// Server-side timeout of each watch call. kube-runtime treats a watch that stays silent for this
/// plus 5 s as dead and reconnects, so a black-holed or half-open API connection (kubernetes#56720)
/// is noticed within 35 s instead of hanging forever.
const WATCH_TIMEOUT_SECS: u32 = 30;
/// Bound on waiting for any response bytes (lists included); above the watch timeout so a quiet
/// but healthy watch is never cut.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(40);

/// A client from `--kubeconfig`, else the in-cluster config, else `$KUBECONFIG`/~/.kube/config.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using --kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context("no in-cluster config and no kubeconfig found")?,
    };
    let mut config = config;
    config.read_timeout = Some(READ_TIMEOUT);
    tracing::info!(server = %config.cluster_url, "Kubernetes API source");
    Client::try_from(config).context("building the Kubernetes client")
}

/// Starts the watchers and returns the handle the agent reads from.
pub fn start(client: Client, node_name: &str, health: Arc<SourceHealth>) -> SourceHandle {
    let (generation_tx, generation) = tokio::sync::watch::channel(0u64);
    let (services, services_writer) = reflector::store::<Service>();
    let (slices, slices_writer) = reflector::store::<EndpointSlice>();
    let (nodes, nodes_writer) = reflector::store::<Node>();

    let service_events = watcher(Api::<Service>::all(client.clone()), watch_config())
        .default_backoff()
        .reflect(services_writer);
    let slice_events = watcher(Api::<EndpointSlice>::all(client.clone()), watch_config())
        .default_backoff()
        .reflect(slices_writer);
    let node_events = watcher(
        Api::<Node>::all(client),
        watch_config().fields(&format!("metadata.name={node_name}")),
    )
    .default_backoff()
    .reflect(nodes_writer);

    let source_health = health;
    tokio::spawn(async move {
        let mut service_events = pin!(service_events);
        let mut slice_events = pin!(slice_events);
        let mut node_events = pin!(node_events);
        // Initial list complete, per kind: services, slices, node.
        let mut listed = [false; 3];
        loop {
            let (kind, event) = tokio::select! {
                e = next(&mut service_events) => (0, e),
                e = next(&mut slice_events) => (1, e),
                e = next(&mut node_events) => (2, e),
            };
            match event {
                Some(Ok(init_done)) => {
                    listed[kind] |= init_done;
                    if source_health.succeeded() {
                        tracing::info!("the Kubernetes API answers again; catching up");
                    }
                }
                Some(Err(error)) => {
                    source_health.failed(error_chain(&error));
                    tracing::warn!(
                        kind = ["Service", "EndpointSlice", "Node"][kind],
                        "watch failed, retrying with backoff; the datapath keeps its last state: {}",
                        error_chain(&error)
                    );
                    continue;
                }
                None => return,
            }
            if listed.iter().all(|l| *l) {
                generation_tx.send_modify(|g| *g += 1);
                if *generation_tx.borrow() == 1 {
                    tracing::info!("initial lists of Services, EndpointSlices and the Node received");
                }
            }
        }
    });

    let read = move || Snapshot {
        cluster: ClusterState {
            services: cloned(&services),
            slices: cloned(&slices),
            node: nodes.state().first().map(|n| (**n).clone()),
        },
        rejections: Vec::new(),
    };
    SourceHandle { generation, read: Arc::new(read) }
}

fn watch_config() -> watcher::Config {
    watcher::Config::default().timeout(WATCH_TIMEOUT_SECS)
}

/// The next event of a reflected watch: Ok(true) when it completed a (re)list.
async fn next<K, S>(events: &mut S) -> Option<Result<bool, watcher::Error>>
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Unpin,
{
    events.next().await.map(|event| event.map(|e| matches!(e, watcher::Event::InitDone)))
}

fn cloned<K: Clone + kube::Resource + 'static>(store: &Store<K>) -> Vec<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store.state().iter().map(|object| (**object).clone()).collect()
}
