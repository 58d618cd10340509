//! `kube`: Services, EndpointSlices and the agent's own Node from the Kubernetes API.
//!
//! One kube-runtime watcher (with backoff) per kind, folded into a store owned here. The view is
//! published only once every kind has completed its initial list, and a relist replaces a kind's
//! objects atomically at `InitDone`: an object deleted while the watch was down disappears with
//! the next relist, and a partial list is never seen.
//!
//! After a watch error, or a failed probe of the API, the view counts as unconfirmed (health:
//! stale). A resumed watch that has nothing to report would never confirm it, and the watcher's
//! backoff may wait 30 s before it even retries, so the API is probed while something fails (after
//! 2 s, then backing off to one probe in 8 to 12 s while it does not answer; nothing is probed
//! while every watch is fine); as soon as it answers again, the failed watchers are recreated, which relists them at
//! once (this also gets past a `410 Gone` after an API server restart, and catches deletions a
//! reconnecting watch could have missed). Meanwhile the datapath keeps its last state.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Config, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::agent::error_chain;
use crate::desired::{self, Changes, ClusterState, ServiceInfo, ServiceKey, ServiceObjects, Slice};
use crate::metrics::ObjectChanges;
use crate::source::{Snapshot, SourceHandle, SourceHealth};

/// Server-side timeout of each watch call, drawn per watcher from this range as client-go does
/// (5 to 10 minutes): a watch call ends and is made again about every 7.5 minutes, spread over
/// time across nodes. A dead or black-holed connection is not waited out: see the PING below.
const WATCH_TIMEOUT_SECS: std::ops::Range<u32> = 300..600;
/// HTTP/2 PING on the API connection (negotiated by ALPN, as client-go does) this often, and the
/// connection is closed when no answer comes within the timeout: a black-holed or half-open
/// connection (kubernetes#56720) fails every watch on it within 10 s. PINGs are answered by the
/// API server's HTTP/2 layer: no request, no authentication, no etcd read.
const H2_PING_INTERVAL: Duration = Duration::from_secs(5);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keep-alive on the API connection (a dead peer on an HTTP/1.1 connection, e.g. through a
/// proxy that does not speak HTTP/2): first probe after this much silence, ...
const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// ... then every this often, and the connection is dropped after this many unanswered.
const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const TCP_KEEPALIVE_RETRIES: u32 = 3;
/// While a watch is failing, the API is probed (`GET /version`): first after this long, then
/// twice as long after each probe that found no answer, up to [`PROBE_INTERVAL_MAX`] (each wait
/// uniformly 1 to 1.5 times that, so that nodes that lost the API together do not probe and
/// relist in the same second). An answer recreates the failed watches at once instead of after
/// their backoff. Never sooner than 2 s: kube-runtime's watcher retries by itself first (after
/// 0.8 to 1.6 s), resuming where it was, and a probe that beat it would relist instead, hiding
/// what the resumed watch would have said (a `410 Gone`). Nothing is probed while every watch
/// is fine.
const PROBE_INTERVAL_FAILING: Duration = Duration::from_secs(2);
/// The longest wait between probes of an API that does not answer: 5 000 nodes send about
/// 500 probes a second to an API that is down (2 500 with a probe every 2 s), and each finds
/// it back within 12 s. (kube-proxy's informers, measured by the benchmark's fleet part, try
/// again about 4 times a second per node.)
const PROBE_INTERVAL_MAX: Duration = Duration::from_secs(8);
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

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
    tracing::info!(server = %config.cluster_url, "Kubernetes API source");
    build_client(config).context("building the Kubernetes client")
}

/// kube's own client stack (rustls with the kubeconfig's credentials, connect and write
/// timeouts, base URI, authentication, impersonation headers) on a connection that offers
/// HTTP/2 by ALPN and checks it with PINGs, with TCP keep-alive under it. No read timeout: a
/// quiet watch is healthy, and a dead connection is found by the PINGs (HTTP/2) or keep-alive.
fn build_client(config: Config) -> anyhow::Result<Client> {
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt;

    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(TCP_KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(TCP_KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(TCP_KEEPALIVE_RETRIES));
    let mut tls = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config.rustls_client_config()?).https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = name.clone().try_into().with_context(|| format!("invalid tls-server-name {name:?}"))?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let mut connector = hyper_timeout::TimeoutConnector::new(tls.enable_http1().enable_http2().wrap_connector(http));
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_write_timeout(config.write_timeout);
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .http2_keep_alive_interval(H2_PING_INTERVAL)
        .http2_keep_alive_timeout(H2_PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(connector);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(client);
    Ok(Client::new(service, config.default_namespace))
}

/// The wait before the next probe after `unanswered` probes in a row found no answer.
fn probe_interval(unanswered: u32) -> Duration {
    PROBE_INTERVAL_FAILING.saturating_mul(1 << unanswered.min(8)).min(PROBE_INTERVAL_MAX)
}

/// `base` scaled by a uniform factor in [1, 1.5).
fn jittered(base: Duration) -> Duration {
    base.mul_f64(1.0 + 0.5 * fastrand::f64())
}

type ObjectKey = (String, String);

/// The objects of one kind as the last complete list plus later watch events say, and which
/// Services the changes since the agent's last read concern.
pub(crate) struct KindStore<K> {
    kind: &'static str,
    objects: BTreeMap<ObjectKey, Arc<K>>,
    /// Objects of a relist in progress; swapped in at `InitDone`.
    relist: Option<BTreeMap<ObjectKey, Arc<K>>>,
    listed: bool,
    failing: bool,
    /// A list (or streaming list) was requested and has neither ended nor failed: the probe
    /// leaves it running instead of starting it over. Not `relist.is_some()`: after an error
    /// inside a streaming list, kube-runtime's watcher goes on with the same list, whose
    /// objects so far `relist` keeps.
    listing: bool,
    /// An event came from the API server since the last probe.
    delivered: bool,
    belongs: Belongs<K>,
    /// Objects by the Service they belong to (`Belongs::To`), in key order: almost always one,
    /// so a sorted `Vec` (a `BTreeSet` allocates room for eleven keys: at 30 000 slices, that
    /// was 10 MiB of empty slots).
    by_service: BTreeMap<ServiceKey, Vec<ObjectKey>>,
    /// Services whose objects changed since the agent read them (none recorded while
    /// `all_dirty`: the agent recomputes everything then).
    dirty: BTreeSet<ServiceKey>,
    /// Objects that changed since the agent read them, for the changes counters (none
    /// recorded while `all_dirty`: the agent compares whole views then).
    changed_objects: BTreeSet<ObjectKey>,
    /// A change that concerns every Service happened since the agent read.
    all_dirty: bool,
}

/// Which Services a kind's changes concern.
pub(crate) enum Belongs<K> {
    /// Every Service (the Node).
    All,
    /// The object's own key, which is its Service's (a Service): no index needed.
    Itself,
    /// The Service this names (a slice's label).
    To(fn(&K) -> ServiceKey),
}

/// An object as a store keeps it (an EndpointSlice as a [`Slice`], the others as they come).
pub(crate) trait Stored: Clone + PartialEq + Send + 'static {
    fn object_key(&self) -> ObjectKey;

    /// When the change this object carries was made, if it says.
    fn change_time(&self) -> Option<std::time::SystemTime> {
        None
    }
}

impl Stored for ServiceInfo {
    /// Its Service key ([`Belongs::Itself`]).
    fn object_key(&self) -> ObjectKey {
        desired::service_key(self)
    }
}

impl Stored for Node {
    fn object_key(&self) -> ObjectKey {
        (self.namespace().unwrap_or_default(), self.name_any())
    }
}

impl Stored for Slice {
    fn object_key(&self) -> ObjectKey {
        (self.namespace.clone(), self.name.clone())
    }

    fn change_time(&self) -> Option<std::time::SystemTime> {
        crate::metrics::trigger_time(self)
    }
}

impl<K: Stored> KindStore<K> {
    pub(crate) fn new(kind: &'static str, belongs: Belongs<K>) -> Self {
        Self {
            kind,
            objects: BTreeMap::new(),
            relist: None,
            listed: false,
            failing: false,
            listing: false,
            delivered: false,
            belongs,
            by_service: BTreeMap::new(),
            dirty: BTreeSet::new(),
            changed_objects: BTreeSet::new(),
            all_dirty: false,
        }
    }

    /// Records that `key` went from `old` to `new` (either may be absent).
    fn changed(&mut self, key: &ObjectKey, old: Option<&K>, new: Option<&K>) {
        if !self.all_dirty {
            self.changed_objects.insert(key.clone());
        }
        let service_of = match self.belongs {
            Belongs::All => {
                self.all_dirty = true;
                return;
            }
            Belongs::Itself => {
                if !self.all_dirty {
                    self.dirty.insert(key.clone());
                }
                return;
            }
            Belongs::To(service_of) => service_of,
        };
        if let Some(service) = old.map(service_of) {
            if let Some(members) = self.by_service.get_mut(&service) {
                if let Ok(at) = members.binary_search(key) {
                    members.remove(at);
                }
                if members.is_empty() {
                    self.by_service.remove(&service);
                }
            }
            if !self.all_dirty {
                self.dirty.insert(service);
            }
        }
        if let Some(service) = new.map(service_of) {
            if !self.all_dirty {
                self.dirty.insert(service.clone());
            }
            let members = self.by_service.entry(service).or_default();
            if let Err(at) = members.binary_search(key) {
                members.insert(at, key.clone());
            }
        }
    }

    /// Folds in one watcher event; returns whether the visible objects changed.
    pub(crate) fn apply(&mut self, event: watcher::Event<K>) -> bool {
        let key = K::object_key;
        // `Init` comes before the request is even sent.
        self.delivered |= !matches!(event, watcher::Event::Init);
        match event {
            watcher::Event::Apply(object) => {
                self.failing = false;
                let key = key(&object);
                let object = Arc::new(object);
                let old = self.objects.insert(key.clone(), object.clone());
                if old.as_deref() == Some(&*object) {
                    return false;
                }
                self.changed(&key, old.as_deref(), Some(&object));
                true
            }
            watcher::Event::Delete(object) => {
                self.failing = false;
                let key = key(&object);
                let Some(old) = self.objects.remove(&key) else { return false };
                self.changed(&key, Some(&old), None);
                true
            }
            // `Init` is emitted before the list request is even sent, and a relist in progress
            // is not a confirmed view: the kind stays failing (stale) until `InitDone`.
            watcher::Event::Init => {
                self.listing = true;
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(object) => {
                self.relist.get_or_insert_with(BTreeMap::new).insert(key(&object), Arc::new(object));
                false
            }
            watcher::Event::InitDone => {
                self.failing = false;
                self.listing = false;
                let objects = self.relist.take().unwrap_or_default();
                let old = std::mem::take(&mut self.objects);
                // The first list concerns every Service (and the agent's first read is of
                // everything anyway): no Service is recorded one by one.
                self.all_dirty |= !self.listed;
                self.listed = true;
                // Only what the relist changed concerns the datapath: after an API outage that
                // is usually nothing, whatever the number of Services.
                for (key, new) in &objects {
                    let before = old.get(key).map(|o| &**o);
                    if before != Some(&**new) {
                        self.changed(key, before, Some(new));
                    }
                }
                for (key, before) in old.iter().filter(|(key, _)| !objects.contains_key(*key)) {
                    self.changed(key, Some(before), None);
                }
                self.objects = objects;
                // A complete list counts as a new view even when it changed nothing: the first
                // one (of an empty kind, too) is what the agent waits for.
                true
            }
        }
    }

    /// Whether a probe that found the API answering starts this kind's watch over: after the
    /// API was lost (`lost`: a watch may hang on a dead connection), or when it failed and
    /// waits out its backoff. A list under way is left to finish: under a relist herd a
    /// streaming list takes longer than the probe's 2-3 s, and starting it over at each probe
    /// meant none ever ended (100 agents after a 60 s outage: none converged in 5 min, and
    /// the API server spent a core on lists they dropped).
    fn restart_wanted(&self, lost: bool) -> bool {
        lost || (self.failing && !self.listing)
    }

    /// Its watch was started over: a list is requested (its `Init` comes only with the answer's
    /// headers, which on a slow server can take longer than the next probe), and the kind is
    /// confirmed only by the list's `InitDone`.
    fn restarted(&mut self) {
        self.failing = true;
        self.listing = true;
    }

    /// The objects that belong to `service`.
    fn of_service(&self, service: &ServiceKey) -> Vec<Arc<K>> {
        if let Belongs::Itself = self.belongs {
            return self.objects.get(service).cloned().into_iter().collect();
        }
        let members = self.by_service.get(service).into_iter().flatten();
        members.filter_map(|key| self.objects.get(key).cloned()).collect()
    }

    pub(crate) fn snapshot(&self) -> Vec<Arc<K>> {
        self.objects.values().cloned().collect()
    }
}

/// How each kind's objects are fetched at start and after a watch failed.
///
/// A streaming list: one watch per kind with `sendInitialEvents=true` from `resourceVersion=0`,
/// which the API server answers from its watch cache, one object per event, closed by a
/// bookmark; the watch then goes on. The agent never holds a whole list's response, nor all of a
/// list's objects before they are trimmed (at 30 000 Services, their slices' list alone is tens
/// of MiB of JSON, and more again decoded), and each kind costs one request where a list and its
/// watch are two.
///
/// An API server that refuses it with `422` (the `WatchList` feature gate is off: the default of
/// Kubernetes 1.33, and of 1.27 to 1.31) is listed instead, every kind from then on, as
/// kube-proxy's informers do: `resourceVersion=0` without a page size, one response from the
/// watch cache. (kube-rs' default is a consistent read paged by 500, and kube-core leaves
/// `resourceVersion=0` out of any list that has a page size, so both settings are needed.)
///
/// A restarted API server whose cache is not filled yet answers a streaming list, or a list, with
/// `429` and Retry-After; the watcher's backoff and the probe below retry it (`api_outage` counts
/// the requests).
#[derive(Clone, Default)]
struct InitialLists {
    /// The API server refused a streaming list.
    refused: Arc<AtomicBool>,
}

type Events<V> = BoxStream<'static, Result<watcher::Event<V>, watcher::Error>>;

impl InitialLists {
    fn watch<K, V>(&self, api: Api<K>, config: watcher::Config) -> Events<V>
    where
        K: Trim + Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Into<V> + 'static,
        V: Stored,
    {
        let config = config.timeout(fastrand::u32(WATCH_TIMEOUT_SECS));
        let listing = watcher::Config { page_size: None, ..config.clone().any_semantic() };
        if self.refused.load(Ordering::Relaxed) {
            return events(api, listing);
        }
        let streaming = events(api.clone(), config.streaming_lists());
        let refused = self.refused.clone();
        futures::stream::unfold((streaming, Some((api, listing))), move |(mut stream, mut fallback)| {
            let refused = refused.clone();
            async move {
                loop {
                    let event = stream.next().await?;
                    if let (Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))), Some(_)) = (&event, &fallback) {
                        if status.code == 422 {
                            let (api, listing) = fallback.take().expect("checked");
                            tracing::info!(
                                kind = K::kind(&()).as_ref(),
                                "the API server refuses streaming lists ({}); listing instead",
                                status.message
                            );
                            refused.store(true, Ordering::Relaxed);
                            stream = events(api, listing);
                            continue;
                        }
                    }
                    return Some((event, (stream, fallback)));
                }
            }
        })
        .boxed()
    }
}

/// The events of one kind's watcher, each object trimmed and converted to what the store keeps.
fn events<K, V>(api: Api<K>, config: watcher::Config) -> Events<V>
where
    K: Trim + Clone + DeserializeOwned + Debug + Send + Into<V> + 'static,
    V: Stored,
{
    watcher(api, config)
        .default_backoff()
        .modify(Trim::trim)
        .map_ok(|event| match event {
            watcher::Event::Apply(object) => watcher::Event::Apply(object.into()),
            watcher::Event::Delete(object) => watcher::Event::Delete(object.into()),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitApply(object) => watcher::Event::InitApply(object.into()),
            watcher::Event::InitDone => watcher::Event::InitDone,
        })
        .boxed()
}

/// Only what the agent reads of an object is kept in its store: managedFields, kubectl's
/// last-applied copy, owner references and the like are most of a small object's size (at
/// 30 000 Services and slices, tens of MiB) and nothing the datapath needs.
pub(crate) trait Trim: Resource {
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.owner_references = None;
        meta.finalizers = None;
        meta.uid = None;
        meta.creation_timestamp = None;
        meta.generation = None;
        meta.generate_name = None;
        // The watcher has taken it already; without it, an update that changes nothing the
        // agent reads compares equal to the stored object and costs no sync.
        meta.resource_version = None;
        // The only annotation read: when the endpoints last changed (network programming latency).
        if let Some(annotations) = meta.annotations.as_mut() {
            annotations.retain(|key, _| key == crate::metrics::ANNOTATION_LAST_CHANGE_TRIGGER_TIME);
        }
        // An empty map still holds a node of eleven slots once it has had an entry.
        if meta.annotations.as_ref().is_some_and(|a| a.is_empty()) {
            meta.annotations = None;
        }
        self.trim_kind();
    }

    fn trim_kind(&mut self) {}
}

/// Nothing beyond the common trim: the conversion to [`ServiceInfo`] keeps only what is read.
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
    services: KindStore<ServiceInfo>,
    slices: KindStore<Slice>,
    nodes: KindStore<Node>,
    /// When the oldest change not read by the agent yet arrived.
    unread_change: Option<Instant>,
    /// When each change not read yet was made (network programming latency).
    change_times: Vec<std::time::SystemTime>,
    /// The agent has read a view before (the first read is always `Changes::All`).
    read_once: bool,
}

impl Stores {
    fn new() -> Self {
        Self {
            services: KindStore::new("Service", Belongs::Itself),
            slices: KindStore::new("EndpointSlice", Belongs::To(desired::slice_service_key)),
            nodes: KindStore::new("Node", Belongs::All),
            unread_change: None,
            change_times: Vec::new(),
            read_once: false,
        }
    }

    /// What changed since the last read, with the changed Services' current objects, and which
    /// Services and EndpointSlices changed (`None`: compare the views, as after `Changes::All`).
    fn take_changes(&mut self) -> (Changes, Option<ObjectChanges>) {
        let mut dirty = std::mem::take(&mut self.services.dirty);
        dirty.append(&mut self.slices.dirty);
        let objects = ObjectChanges {
            services: std::mem::take(&mut self.services.changed_objects),
            slices: std::mem::take(&mut self.slices.changed_objects),
        };
        self.nodes.changed_objects.clear();
        let all = !self.read_once || self.services.all_dirty || self.slices.all_dirty || self.nodes.all_dirty;
        self.read_once = true;
        self.services.all_dirty = false;
        self.slices.all_dirty = false;
        self.nodes.all_dirty = false;
        if all {
            return (Changes::All, None);
        }
        let changed = dirty
            .into_iter()
            .map(|service| {
                let objects =
                    ServiceObjects { services: self.services.of_service(&service), slices: self.slices.of_service(&service) };
                (service, objects)
            })
            .collect();
        (Changes::Services(changed), Some(objects))
    }

    fn listed(&self) -> bool {
        self.services.listed && self.slices.listed && self.nodes.listed
    }

    /// Whether any watch heard from the API server since the last call. Such an event shows
    /// that the API answers, whatever a probe found: on a slow link or an overloaded server,
    /// a probe can wait more than its 5 s behind a long list on the same HTTP/2 connection.
    fn heard_since_probe(&mut self) -> bool {
        let heard = self.services.delivered || self.slices.delivered || self.nodes.delivered;
        self.services.delivered = false;
        self.slices.delivered = false;
        self.nodes.delivered = false;
        heard
    }

    fn failing(&self) -> bool {
        self.services.failing || self.slices.failing || self.nodes.failing
    }
}

/// Folds one event (or error) of a kind into its store; returns when the change was made if
/// the view changed (an EndpointSlice's trigger time, else now).
fn fold<K: Stored>(
    store: &mut KindStore<K>,
    event: Option<Result<watcher::Event<K>, watcher::Error>>,
    health: &SourceHealth,
) -> Option<std::time::SystemTime> {
    match event {
        Some(Ok(event)) => {
            let made = match &event {
                watcher::Event::Apply(object) => object.change_time(),
                _ => None,
            };
            store.apply(event).then(|| made.unwrap_or_else(std::time::SystemTime::now))
        }
        Some(Err(error)) => {
            store.failing = true;
            store.listing = false;
            let error = error_chain(&error);
            tracing::warn!(kind = store.kind, "watch failed; the datapath keeps its last state: {error}");
            health.failed(format!("{}: {error}", store.kind));
            None
        }
        // kube-runtime watchers never end; treat it as a failure to be relisted.
        None => {
            store.failing = true;
            store.listing = false;
            None
        }
    }
}

/// Starts the watchers and returns the handle the agent reads from.
pub fn start(client: Client, node_name: &str, health: Arc<SourceHealth>) -> SourceHandle {
    let (generation_tx, generation) = tokio::sync::watch::channel(0u64);
    let stores = Arc::new(Mutex::new(Stores::new()));
    let shared = stores.clone();
    let node_fields = format!("metadata.name={node_name}");

    tokio::spawn(async move {
        let services_api = Api::<Service>::all(client.clone());
        let slices_api = Api::<EndpointSlice>::all(client.clone());
        let nodes_api = Api::<Node>::all(client.clone());
        let node_config = || watcher::Config::default().fields(&node_fields);
        let lists = InitialLists::default();
        let mut services = lists.watch(services_api.clone(), watcher::Config::default());
        let mut slices = lists.watch::<EndpointSlice, Slice>(slices_api.clone(), watcher::Config::default());
        let mut nodes = lists.watch(nodes_api.clone(), node_config());
        // Set only while something fails: a healthy agent sends no request of its own.
        let mut next_probe: Option<tokio::time::Instant> = None;
        let mut probe_failed = false;
        // Probes in a row that found no answer: the wait before the next grows with them.
        let mut unanswered = 0;
        let mut was_stale = false;

        loop {
            let changed = tokio::select! {
                e = services.next() => fold(&mut shared.lock().expect("stores lock").services, e, &health),
                e = slices.next() => fold(&mut shared.lock().expect("stores lock").slices, e, &health),
                e = nodes.next() => fold(&mut shared.lock().expect("stores lock").nodes, e, &health),
                _ = tokio::time::sleep_until(next_probe.unwrap_or_else(tokio::time::Instant::now)), if next_probe.is_some() => {
                    let probe = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(error)) => Err(format!("API probe: {}", error_chain(&error))),
                        Err(_) => Err(format!("API probe: no answer within {PROBE_TIMEOUT:?}")),
                    };
                    let mut st = shared.lock().expect("stores lock");
                    let heard = st.heard_since_probe();
                    let answered = match probe {
                        Ok(()) => true,
                        Err(error) if heard => {
                            tracing::debug!("{error}; the watches hear from the API meanwhile");
                            true
                        }
                        Err(error) => {
                            health.failed(error);
                            false
                        }
                    };
                    // The API was lost when the last probe found no answer and no watch heard
                    // from it since: every watch is started over then.
                    let all = probe_failed && !heard;
                    let restart = [st.services.restart_wanted(all), st.slices.restart_wanted(all), st.nodes.restart_wanted(all)];
                    tracing::debug!(
                        answered, heard, lost = all, ?restart,
                        failing = ?[st.services.failing, st.slices.failing, st.nodes.failing],
                        listing = ?[st.services.listing, st.slices.listing, st.nodes.listing],
                        "probe (Services, EndpointSlices, Node)"
                    );
                    if answered && restart.contains(&true) {
                        // Recreated watchers relist at once, without the old backoff.
                        if restart[0] {
                            services = lists.watch(services_api.clone(), watcher::Config::default());
                            st.services.restarted();
                        }
                        if restart[1] {
                            slices = lists.watch(slices_api.clone(), watcher::Config::default());
                            st.slices.restarted();
                        }
                        if restart[2] {
                            nodes = lists.watch(nodes_api.clone(), node_config());
                            st.nodes.restarted();
                        }
                        tracing::info!("the Kubernetes API answers again; relisting what the failed watches missed");
                    } else if !answered && !probe_failed {
                        tracing::warn!("the Kubernetes API does not answer; the datapath keeps its last state");
                    }
                    probe_failed = !answered;
                    unanswered = if answered { 0 } else { unanswered + 1 };
                    let failing = probe_failed || st.failing();
                    next_probe = failing.then(|| tokio::time::Instant::now() + jittered(probe_interval(unanswered)));
                    None
                }
            };
            let mut st = shared.lock().expect("stores lock");
            let stale = probe_failed || st.failing();
            if stale {
                if next_probe.is_none() {
                    // A failure begins: the first probe asks about the time since.
                    st.heard_since_probe();
                }
                let soon = tokio::time::Instant::now() + jittered(probe_interval(unanswered));
                next_probe = Some(next_probe.map_or(soon, |at| at.min(soon)));
            } else if was_stale && health.succeeded() {
                tracing::info!("every watch is confirmed again; the datapath follows the API");
            }
            was_stale = stale;
            if let Some(made) = changed.filter(|_| st.listed()) {
                st.unread_change.get_or_insert_with(Instant::now);
                st.change_times.push(made);
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
        let (changes, object_changes) = st.take_changes();
        Snapshot {
            changed_at: st.unread_change.take(),
            change_times: Some(std::mem::take(&mut st.change_times)),
            cluster: ClusterState {
                services: st.services.snapshot(),
                slices: st.slices.snapshot(),
                node: st.nodes.objects.values().next().cloned(),
            },
            rejections: Vec::new(),
            changes,
            object_changes,
        }
    };
    SourceHandle { generation, read: Arc::new(read) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str) -> ServiceInfo {
        ServiceInfo { name: name.into(), namespace: "ns".into(), ..Default::default() }
    }

    fn names(store: &KindStore<ServiceInfo>) -> Vec<String> {
        store.objects.keys().map(|(_, n)| n.clone()).collect()
    }

    #[test]
    fn probes_of_an_api_that_does_not_answer_back_off_to_the_cap() {
        let waits: Vec<u64> = (0..7).map(|unanswered| probe_interval(unanswered).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 8, 8, 8, 8]);
        assert_eq!(probe_interval(u32::MAX), PROBE_INTERVAL_MAX, "no overflow after a very long outage");
    }

    fn list<K: Stored>(store: &mut KindStore<K>, objects: impl IntoIterator<Item = K>) {
        store.apply(watcher::Event::Init);
        objects.into_iter().for_each(|object| _ = store.apply(watcher::Event::InitApply(object)));
        assert!(store.apply(watcher::Event::InitDone));
    }

    #[test]
    fn a_relist_concerns_only_the_services_whose_objects_it_changed() {
        let slice = |name: &str, service: &str| Slice {
            namespace: "ns".into(),
            name: name.into(),
            service_name: Some(service.into()),
            ..Default::default()
        };
        let key = |service: &str| ("ns".to_owned(), service.to_owned());
        let mut slices = KindStore::new("EndpointSlice", Belongs::To(desired::slice_service_key));
        list(&mut slices, [slice("a-1", "a"), slice("b-1", "b")]);
        assert!(slices.all_dirty && slices.dirty.is_empty(), "the first list concerns every Service at once");
        slices.all_dirty = false;

        // b-1 was deleted and a-2 created while the watch was down; a-1 did not change.
        list(&mut slices, [slice("a-1", "a"), slice("a-2", "a")]);
        assert!(!slices.all_dirty);
        assert_eq!(slices.dirty, [key("a"), key("b")].into());
        let names = |objects: Vec<Arc<Slice>>| objects.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(slices.of_service(&key("a"))), ["a-1", "a-2"]);
        assert!(slices.of_service(&key("b")).is_empty() && !slices.by_service.contains_key(&key("b")));

        slices.dirty.clear();
        list(&mut slices, [slice("a-1", "a"), slice("a-2", "a")]);
        assert!(slices.dirty.is_empty(), "a relist that changed nothing concerns no Service");

        // A Service is its own key: no index.
        let mut services = KindStore::new("Service", Belongs::Itself);
        list(&mut services, [svc("a")]);
        services.all_dirty = false;
        assert!(services.apply(watcher::Event::Apply(ServiceInfo { cluster_ips: vec!["10.96.0.1".into()], ..svc("a") })));
        assert_eq!(services.dirty, [key("a")].into());
        assert_eq!(services.of_service(&key("a")).len(), 1);
        assert!(services.by_service.is_empty());
    }

    /// The changes counters (kube-proxy's `*_changes_total`) come from what the stores saw
    /// change, not from comparing every object of two views at each read.
    #[test]
    fn a_read_names_the_objects_that_changed_since_the_last_read() {
        let slice = |name: &str, service: &str, ip: &str| Slice {
            namespace: "ns".into(),
            name: name.into(),
            service_name: Some(service.into()),
            // Any field that makes it another object.
            address_type: ip.into(),
            ..Default::default()
        };
        let object = |name: &str| ("ns".to_owned(), name.to_owned());
        let mut stores = Stores::new();
        list(&mut stores.services, [svc("a"), svc("b")]);
        list(&mut stores.slices, [slice("a-1", "a", "10.0.0.1"), slice("b-1", "b", "10.0.0.2")]);
        list(&mut stores.nodes, []);
        let (changes, objects) = stores.take_changes();
        assert!(matches!(changes, Changes::All) && objects.is_none(), "the first read compares whole views");

        // a-1 moves to Service b with a new endpoint, b-1 is applied unchanged, Service a changes.
        assert!(stores.slices.apply(watcher::Event::Apply(slice("a-1", "b", "10.0.0.3"))));
        assert!(!stores.slices.apply(watcher::Event::Apply(slice("b-1", "b", "10.0.0.2"))));
        assert!(stores.services.apply(watcher::Event::Apply(ServiceInfo { cluster_ips: vec!["10.96.0.1".into()], ..svc("a") })));
        let (changes, objects) = stores.take_changes();
        let Changes::Services(changed) = changes else { panic!("a change of two Services' objects is not everything") };
        assert_eq!(changed.keys().cloned().collect::<Vec<_>>(), [object("a"), object("b")]);
        let objects = objects.expect("the stores tracked the changed objects");
        assert_eq!(objects.services, [object("a")].into());
        assert_eq!(objects.slices, [object("a-1")].into());

        // Read again: nothing changed since. A deletion counts.
        assert_eq!(stores.take_changes().1, Some(ObjectChanges::default()));
        assert!(stores.slices.apply(watcher::Event::Delete(slice("b-1", "b", "10.0.0.2"))));
        assert_eq!(stores.take_changes().1.expect("tracked").slices, [object("b-1")].into());

        // The Node concerns every Service: the next read compares whole views again.
        assert!(stores.slices.apply(watcher::Event::Apply(slice("a-1", "b", "10.0.0.4"))));
        assert!(stores.nodes.apply(watcher::Event::Apply(Node::default())));
        assert!(matches!(stores.take_changes(), (Changes::All, None)));
        assert_eq!(stores.take_changes().1, Some(ObjectChanges::default()), "nothing left over from before the Node");
    }

    #[test]
    fn a_relist_replaces_the_objects_atomically_and_drops_what_was_not_listed() {
        let mut store = KindStore::new("Service", Belongs::Itself);
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

    #[test]
    fn a_probe_starts_over_only_watches_that_failed_or_may_hang() {
        let mut store = KindStore::new("Service", Belongs::Itself);
        assert!(!store.restart_wanted(false), "a healthy watch is left alone");
        assert!(store.restart_wanted(true), "after the API was lost, a quiet watch may hang on a dead connection");
        store.failing = true;
        assert!(store.restart_wanted(false), "a failed watch starts over without its backoff");
        store.restarted();
        assert!(!store.restart_wanted(false), "a list requested is left to answer (its Init comes with the answer)");
        store.apply(watcher::Event::Init);
        store.apply(watcher::Event::InitApply(svc("a")));
        assert!(!store.restart_wanted(false), "a list under way is left to finish");
        store.apply(watcher::Event::InitDone);
        assert!(!store.failing && !store.restart_wanted(false));
    }

    #[test]
    fn any_event_since_the_last_probe_shows_that_the_api_answers() {
        let mut stores = Stores::new();
        assert!(!stores.heard_since_probe());
        stores.services.apply(watcher::Event::Init);
        assert!(!stores.heard_since_probe(), "Init comes before the request is sent");
        stores.services.apply(watcher::Event::InitApply(svc("a")));
        assert!(stores.heard_since_probe());
        assert!(!stores.heard_since_probe(), "each probe asks about the time since the last one");
        stores.services.apply(watcher::Event::InitDone);
        assert!(stores.heard_since_probe());
    }
}
