//! `file:PATH`: ordinary Kubernetes manifests (a multi-document YAML or JSON file, or a directory
//! of them), re-read on an interval and published when their content changed.
//!
//! A document that cannot be read is reported with its file and position and skipped; it never
//! stops the other documents from being used. An unreadable file keeps the last view: an
//! unreadable source is never an empty one.

use std::collections::BTreeMap;
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

/// The raw bytes of every manifest file, keyed by path: compared between polls to notice changes.
pub type ManifestSnapshot = BTreeMap<PathBuf, Vec<u8>>;

/// Reads the manifest file, or every `*.yaml`, `*.yml` and `*.json` file of a directory.
pub fn read_manifests(path: &Path) -> Result<ManifestSnapshot, SourceError> {
    let err = |source| SourceError::Read { path: path.to_owned(), source };
    let mut snapshot = BTreeMap::new();
    if path.is_dir() {
        for entry in fs::read_dir(path).map_err(err)? {
            let file = entry.map_err(err)?.path();
            let is_manifest = file
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if is_manifest && file.is_file() {
                let bytes = fs::read(&file).map_err(|source| SourceError::Read { path: file.clone(), source })?;
                snapshot.insert(file, bytes);
            }
        }
    } else {
        snapshot.insert(path.to_owned(), fs::read(path).map_err(err)?);
    }
    Ok(snapshot)
}

/// Starts polling `path` every `interval`.
pub fn start(path: PathBuf, interval: std::time::Duration, health: std::sync::Arc<SourceHealth>) -> SourceHandle {
    let (generation_tx, generation) = tokio::sync::watch::channel(0u64);
    let current = std::sync::Arc::new(std::sync::Mutex::new(Snapshot::default()));
    let shared = current.clone();
    let source_health = health;
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<ManifestSnapshot> = None;
        let mut read_error_reported = false;
        loop {
            ticker.tick().await;
            let files = match read_manifests(&path) {
                Ok(files) => {
                    read_error_reported = false;
                    source_health.succeeded();
                    files
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
            if last.as_ref() == Some(&files) {
                continue;
            }
            let (cluster, rejections) = parse_manifests(&files);
            let mut view = shared.lock().expect("snapshot lock");
            // A change not read yet keeps its (earlier) time.
            let changed_at = view.changed_at.or(Some(std::time::Instant::now()));
            *view = Snapshot { cluster, rejections, changed_at, changes: Default::default(), change_times: None };
            drop(view);
            last = Some(files);
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

#[derive(Deserialize)]
struct TypeMeta {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

/// Parses every document. Objects of other kinds are ignored; broken ones become rejections.
pub fn parse_manifests(snapshot: &ManifestSnapshot) -> (ClusterState, Vec<Rejection>) {
    let mut state = ClusterState::default();
    let mut rejections = Vec::new();
    for (path, bytes) in snapshot {
        let text = String::from_utf8_lossy(bytes);
        for (index, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let object = RejectedObject::Document { path: path.clone(), document: index + 1, items: Vec::new(), kind: None };
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
            Ok(service) => state.services.push(service.into()),
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
}
