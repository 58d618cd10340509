//! Where cluster objects come from: manifest files (`file:PATH`) or the Kubernetes API (`kube`).
//!
//! A source runs as a task and exposes two things: a generation counter that moves whenever its
//! view changed (0 means "no complete view yet": the datapath must not be touched), and a way to
//! read the current complete view. The agent reads the view only when it is about to reconcile,
//! so a burst of watch events costs one reconcile, not one per event.

pub mod file;
pub mod kube;

use std::sync::Arc;

use tokio::sync::watch;

use crate::desired::{ClusterState, Rejection};

/// One complete view of the cluster, plus objects the source could not read.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub cluster: ClusterState,
    pub rejections: Vec<Rejection>,
}

/// The agent's side of a running source.
pub struct SourceHandle {
    /// Increments on every change of a complete view; 0 until the first complete view.
    pub generation: watch::Receiver<u64>,
    /// Reads the current complete view.
    pub read: Arc<dyn Fn() -> Snapshot + Send + Sync>,
}
