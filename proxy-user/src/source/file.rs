//! `file:PATH`: ordinary Kubernetes manifests (a multi-document YAML or JSON file, or a directory
//! of them), re-read on an interval and published when their content changed.
//!
//! A document that cannot be read is reported with its file and position and skipped; it never
//! stops the other documents from being used. An unreadable file keeps the last view: an
//! unreadable source is never an empty one.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize;

use crate::agent::error_chain;
use crate::desired::{ClusterState, Malformed, ObjectKind, RejectReason, RejectedObject, Rejection};
use crate::source::{Snapshot, SourceHandle, SourceHealth};

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot read manifests from {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The raw bytes of every manifest file, keyed by path.
#[cfg(test)]
pub type ManifestSnapshot = BTreeMap<PathBuf, Vec<u8>>;

/// The manifest files: `path` itself, or every `*.yaml`, `*.yml` and `*.json` file of it if it
/// is a directory, with what identifies their content without reading it.
fn list_manifests(path: &Path) -> Result<BTreeMap<PathBuf, Stamp>, SourceError> {
    let err = |source| SourceError::Read { path: path.to_owned(), source };
    let mut files = BTreeMap::new();
    if path.is_dir() {
        for entry in fs::read_dir(path).map_err(err)? {
            let file = entry.map_err(err)?.path();
            let is_manifest = file
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if is_manifest && file.is_file() {
                let stamp = Stamp::of(&file).map_err(|source| SourceError::Read { path: file.clone(), source })?;
                files.insert(file, stamp);
            }
        }
    } else {
        files.insert(path.to_owned(), Stamp::of(path).map_err(err)?);
    }
    Ok(files)
}

/// What tells a file's content changed without reading it: length, modification time and inode
/// (editors and kubelet's ConfigMap volumes replace a file rather than write it in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        // Through symlinks, as a read would go.
        let meta = fs::metadata(path)?;
        Ok(Self { len: meta.len(), modified: meta.modified().ok(), inode: meta.ino() })
    }
}

/// One manifest file as last read: only its content's hash is kept, not its bytes (at 30 000
/// Services a manifest is tens of MiB).
struct FileView {
    stamp: Stamp,
    hash: u64,
    cluster: ClusterState,
    rejections: Vec<Rejection>,
}

/// The manifests as last read, file by file: a change re-reads only the files whose stamp
/// changed and re-parses only those whose content did.
#[derive(Default)]
struct Manifests {
    files: BTreeMap<PathBuf, FileView>,
}

impl Manifests {
    /// Brings the view up to date with the files; true if anything they hold changed. Files
    /// are re-read when their stamp changed or a watch event named them (a rewrite within the
    /// filesystem's time granularity keeps length and time). An unreadable file or directory
    /// leaves the view as it was.
    fn refresh(&mut self, path: &Path, named: &BTreeSet<PathBuf>) -> Result<bool, SourceError> {
        let listed = list_manifests(path)?;
        let mut changed = self.files.keys().any(|file| !listed.contains_key(file));
        let mut files = BTreeMap::new();
        for (file, stamp) in listed {
            match self.files.remove(&file) {
                Some(view) if view.stamp == stamp && !is_named(named, &file) => {
                    files.insert(file, view);
                }
                old => {
                    let bytes = fs::read(&file).map_err(|source| SourceError::Read { path: file.clone(), source })?;
                    let hash = content_hash(&bytes);
                    let view = match old {
                        Some(view) if view.hash == hash => FileView { stamp, ..view },
                        _ => {
                            changed = true;
                            let (cluster, rejections) = parse_file(&file, &bytes);
                            FileView { stamp, hash, cluster, rejections }
                        }
                    };
                    files.insert(file, view);
                }
            }
        }
        self.files = files;
        Ok(changed)
    }

    /// Every file's objects (shared, not copied) and rejections, in path order.
    fn view(&self) -> (ClusterState, Vec<Rejection>) {
        let mut cluster = ClusterState::default();
        let mut rejections = Vec::new();
        for view in self.files.values() {
            cluster.services.extend(view.cluster.services.iter().cloned());
            cluster.slices.extend(view.cluster.slices.iter().cloned());
            if view.cluster.node.is_some() {
                cluster.node.clone_from(&view.cluster.node);
            }
            rejections.extend(view.rejections.iter().cloned());
        }
        (cluster, rejections)
    }
}

/// Whether a watch event named `file` (events name absolute paths).
fn is_named(named: &BTreeSet<PathBuf>, file: &Path) -> bool {
    !named.is_empty() && std::path::absolute(file).is_ok_and(|file| named.contains(&file))
}

fn content_hash(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// Watches `path` (inotify, through the `notify` crate) and re-reads it when it changes;
/// every `interval` its files' stamps are also compared, for changes a watch cannot see
/// (a network filesystem, a watch that could not be set up).
pub fn start(path: PathBuf, interval: std::time::Duration, health: std::sync::Arc<SourceHealth>) -> SourceHandle {
    let (generation_tx, generation) = tokio::sync::watch::channel(0u64);
    let current = std::sync::Arc::new(std::sync::Mutex::new(Snapshot::default()));
    let shared = current.clone();
    let source_health = health;
    let (event_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let watcher = watch(&path, move |paths| {
        let _ = event_tx.send(paths);
    });
    tokio::spawn(async move {
        // Dropping the watcher ends the watch: it lives as long as this task.
        let _watcher = watcher;
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut manifests = Manifests::default();
        let mut read_error_reported = false;
        let mut first = true;
        let mut named = BTreeSet::new();
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                Some(paths) = events.recv() => {
                    named.extend(paths);
                    while let Ok(paths) = events.try_recv() {
                        named.extend(paths);
                    }
                }
            }
            // The change was seen now: network programming latency counts from here.
            let seen = std::time::Instant::now();
            let refreshed = manifests.refresh(&path, &named);
            named.clear();
            let changed = match refreshed {
                Ok(changed) => {
                    read_error_reported = false;
                    source_health.succeeded();
                    changed
                }
                Err(error) => {
                    source_health.failed(error_chain(&error));
                    if !read_error_reported {
                        tracing::warn!("{}; keeping the last programmed state", error_chain(&error));
                        read_error_reported = true;
                    }
                    continue;
                }
            };
            if !changed && !first {
                continue;
            }
            first = false;
            let (cluster, rejections) = manifests.view();
            let mut view = shared.lock().expect("snapshot lock");
            // A change not read yet keeps its (earlier) time.
            let changed_at = view.changed_at.or(Some(seen));
            *view = Snapshot { cluster, rejections, changed_at, changes: Default::default(), change_times: None, object_changes: None };
            drop(view);
            generation_tx.send_modify(|g| *g += 1);
        }
    });
    SourceHandle {
        generation,
        read: std::sync::Arc::new(move || {
            let mut view = current.lock().expect("snapshot lock");
            let snapshot = view.clone();
            view.changed_at = None;
            snapshot
        }),
    }
}

/// An inotify watch on `path`'s directory (a file's own watch would end when an editor or a
/// ConfigMap update replaces the file); `changed` is called with the paths of every event.
/// None, with a warning, if the watch cannot be set up: the interval's checks still notice
/// changes.
fn watch(path: &Path, changed: impl Fn(Vec<PathBuf>) + Send + 'static) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new("/")).to_owned() };
    let watched = dir.clone();
    let setup = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        match event {
            Ok(event) if !event.kind.is_access() => changed(event.paths),
            Ok(_) => {}
            // Events were lost (the queue overflowed): every file is checked by its stamp.
            Err(_) => changed(Vec::new()),
        }
    })
    .and_then(|mut watcher| watcher.watch(&watched, notify::RecursiveMode::NonRecursive).map(|()| watcher));
    match setup {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot watch the manifests for changes; checking them on the poll interval only");
            None
        }
    }
}

#[derive(Deserialize)]
struct TypeMeta {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

/// Parses every document of every file. Objects of other kinds are ignored; broken ones become
/// rejections.
#[cfg(test)]
pub fn parse_manifests(snapshot: &ManifestSnapshot) -> (ClusterState, Vec<Rejection>) {
    let mut manifests = Manifests::default();
    for (path, bytes) in snapshot {
        let (cluster, rejections) = parse_file(path, bytes);
        let stamp = Stamp { len: 0, modified: None, inode: 0 };
        manifests.files.insert(path.clone(), FileView { stamp, hash: 0, cluster, rejections });
    }
    manifests.view()
}

/// Parses every document of one file.
fn parse_file(path: &Path, bytes: &[u8]) -> (ClusterState, Vec<Rejection>) {
    let mut state = ClusterState::default();
    let mut rejections = Vec::new();
    let text = String::from_utf8_lossy(bytes);
    for (index, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let object = RejectedObject::Document { path: path.to_owned(), document: index + 1, items: Vec::new(), kind: None };
        match serde_yaml::Value::deserialize(document) {
            Ok(serde_yaml::Value::Null) => {}
            Ok(value) => add_object(value, &object, &mut state, &mut rejections),
            Err(error) => {
                let reason = RejectReason::Malformed(Malformed::Yaml { detail: error.to_string() });
                rejections.push(Rejection::new(object, reason));
                // The YAML stream cannot be resynchronised after a syntax error.
                break;
            }
        }
    }
    (state, rejections)
}

/// `object` is the document's place in the manifests (a `RejectedObject::Document` without a kind).
fn add_object(value: serde_yaml::Value, object: &RejectedObject, state: &mut ClusterState, rejections: &mut Vec<Rejection>) {
    let meta: TypeMeta = match serde_yaml::from_value(value.clone()) {
        Ok(meta) => meta,
        Err(error) => {
            let reason = RejectReason::Malformed(Malformed::NotAnObject { detail: error.to_string() });
            rejections.push(Rejection::new(object.clone(), reason));
            return;
        }
    };
    let mut reject = |kind: ObjectKind, error: serde_yaml::Error| {
        let mut object = object.clone();
        if let RejectedObject::Document { kind: declared, .. } = &mut object {
            *declared = Some(kind);
        }
        rejections.push(Rejection::new(object, RejectReason::Malformed(Malformed::Fields { detail: error.to_string() })));
    };
    match (meta.api_version.as_str(), meta.kind.as_str()) {
        ("v1", "List") => {
            let items = value.get("items").and_then(|i| i.as_sequence()).cloned().unwrap_or_default();
            for (i, item) in items.into_iter().enumerate() {
                let mut item_object = object.clone();
                if let RejectedObject::Document { items, .. } = &mut item_object {
                    items.push(i + 1);
                }
                add_object(item, &item_object, state, rejections);
            }
        }
        ("v1", "Service") => match serde_yaml::from_value::<Service>(value) {
            Ok(service) => state.services.push(std::sync::Arc::new(service.into())),
            Err(error) => reject(ObjectKind::Service, error),
        },
        ("discovery.k8s.io/v1", "EndpointSlice") => match serde_yaml::from_value::<EndpointSlice>(value) {
            Ok(slice) => state.slices.push(std::sync::Arc::new(slice.into())),
            Err(error) => reject(ObjectKind::EndpointSlice, error),
        },
        ("v1", "Node") => match serde_yaml::from_value::<Node>(value) {
            Ok(node) => state.node = Some(node.into()),
            Err(error) => reject(ObjectKind::Node, error),
        },
        _ => tracing::debug!(%object, kind = meta.kind, "ignoring object of another kind"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_services_and_slices_and_reports_broken_documents() {
        let manifest = br#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, protocol: TCP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.1.2]}]
ports: [{port: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: broken}
spec: {ports: "not a list"}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: other}
"#;
        let snapshot = BTreeMap::from([(PathBuf::from("m.yaml"), manifest.to_vec())]);
        let (state, rejections) = parse_manifests(&snapshot);
        assert_eq!(state.services.len(), 1);
        assert_eq!(state.slices.len(), 1);
        assert_eq!(rejections.len(), 1, "{rejections:?}");
        assert!(rejections[0].object.to_string().starts_with("m.yaml document 3 (Service)"), "{}", rejections[0]);
    }

    fn manifest(endpoint: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}\n\
             addressType: IPv4\nendpoints: [{{addresses: [{endpoint}]}}]\nports: [{{port: 8080}}]\n"
        )
    }

    fn endpoint_of(snapshot: &Snapshot) -> Option<String> {
        snapshot.cluster.slices.first()?.endpoints.first()?.address.as_ref().map(ToString::to_string)
    }

    /// The watch, not the interval, brings a change: with an hour between checks, rewrites of
    /// the same length in quick succession (a stamp may not tell them apart) are each seen.
    #[tokio::test]
    async fn a_change_is_seen_by_the_watch_without_waiting_for_the_interval() {
        let dir = std::env::temp_dir().join(format!("epx-file-source-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.yaml");
        fs::write(&file, manifest("10.244.1.2")).unwrap();
        let health = std::sync::Arc::new(SourceHealth::default());
        let mut handle = start(file.clone(), std::time::Duration::from_secs(3600), health);
        let wait_for = |handle: &mut SourceHandle, generation: u64| {
            let mut receiver = handle.generation.clone();
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(10), receiver.wait_for(|g| *g >= generation))
                    .await
                    .expect("the source published no new view within 10 s")
                    .map(|_| ())
            }
        };
        wait_for(&mut handle, 1).await.unwrap();
        assert_eq!(endpoint_of(&(handle.read)()).as_deref(), Some("10.244.1.2"));

        for (generation, endpoint) in [(2, "10.244.1.3"), (3, "10.244.1.4"), (4, "10.244.1.5")] {
            fs::write(&file, manifest(endpoint)).unwrap();
            wait_for(&mut handle, generation).await.unwrap();
            assert_eq!(endpoint_of(&(handle.read)()).as_deref(), Some(endpoint));
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_refresh_reparses_only_changed_files_and_notices_removed_ones() {
        let dir = std::env::temp_dir().join(format!("epx-file-refresh-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("a.yaml"), manifest("10.244.1.2")).unwrap();
        fs::write(dir.join("b.yaml"), manifest("10.244.1.3").replace("web", "api")).unwrap();
        fs::write(dir.join("notes.txt"), "ignored").unwrap();
        let mut manifests = Manifests::default();
        assert!(manifests.refresh(&dir, &BTreeSet::new()).unwrap());
        assert_eq!(manifests.view().0.services.len(), 2);
        let b_before = manifests.files[&dir.join("b.yaml")].cluster.services[0].clone();

        // Named by an event but unchanged: read, hashed, not re-parsed.
        let named = BTreeSet::from([std::path::absolute(dir.join("a.yaml")).unwrap()]);
        assert!(!manifests.refresh(&dir, &named).unwrap());

        fs::write(dir.join("a.yaml"), manifest("10.244.1.9")).unwrap();
        assert!(manifests.refresh(&dir, &named).unwrap());
        let b_after = &manifests.files[&dir.join("b.yaml")].cluster.services[0];
        assert!(std::sync::Arc::ptr_eq(&b_before, b_after), "an unchanged file was parsed again");

        fs::remove_file(dir.join("b.yaml")).unwrap();
        assert!(manifests.refresh(&dir, &BTreeSet::new()).unwrap());
        assert_eq!(manifests.view().0.services.len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
