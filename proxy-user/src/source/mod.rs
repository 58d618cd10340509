//! Where cluster objects come from: manifest files (`file:PATH`) or the Kubernetes API (`kube`).
//!
//! A source runs as a task and exposes two things: a generation counter that moves whenever its
//! view changed (0 means "no complete view yet": the datapath must not be touched), and a way to
//! read the current complete view. The agent reads the view only when it is about to reconcile,
//! so a burst of watch events costs one reconcile, not one per event.

pub mod file;
pub mod kube;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;

use crate::desired::{Changes, ClusterState, Rejection};

/// One complete view of the cluster, plus objects the source could not read.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub cluster: ClusterState,
    pub rejections: Vec<Rejection>,
    /// When the source received the oldest change not in the view read before this one (none:
    /// the same view again). Health and network-programming latency are measured from it.
    pub changed_at: Option<Instant>,
    /// What changed since the view read before (`All` unless the source tracks it).
    pub changes: Changes,
    /// When each change in this view was made, if the source recorded it (kube-proxy's network
    /// programming latency: an EndpointSlice's trigger-time annotation, else its arrival);
    /// `None`: the agent works it out by comparing views.
    pub change_times: Option<Vec<std::time::SystemTime>>,
    /// The Services and EndpointSlices that changed since the view read before, if the source
    /// tracked them (kube-proxy's `*_changes_total`); `None`: the agent compares the views.
    pub object_changes: Option<crate::metrics::ObjectChanges>,
}

/// The agent's side of a running source.
pub struct SourceHandle {
    /// Increments on every change of a complete view; 0 until the first complete view.
    pub generation: watch::Receiver<u64>,
    /// Reads the current complete view.
    pub read: Arc<dyn Fn() -> Snapshot + Send + Sync>,
}

/// Whether the source can currently confirm that its view is up to date.
#[derive(Debug, Default)]
pub struct SourceHealth {
    /// Set when the source failed and has not recovered since; cleared by the next success.
    failing_since: Mutex<Option<(Instant, String)>>,
}

impl SourceHealth {
    pub fn failed(&self, error: String) {
        let mut failing = self.failing_since.lock().expect("source health lock");
        match failing.as_mut() {
            Some((_, last)) => *last = error,
            None => *failing = Some((Instant::now(), error)),
        }
    }

    /// Returns true when this ends an outage.
    pub fn succeeded(&self) -> bool {
        self.failing_since.lock().expect("source health lock").take().is_some()
    }

    /// Since when, and the latest error, if the source is failing now.
    pub fn failing(&self) -> Option<(Instant, String)> {
        self.failing_since.lock().expect("source health lock").clone()
    }
}
