//! What every step of a change shares: the engine's state ([`Inner`]: the nodes, the
//! state dir, the plan it started with, the change in progress) and where a change says
//! how it goes ([`Progress`]). Below the engine, the change and the recovery, which all
//! use it, so none of them imports another round a loop.

use super::nodes::Nodes;
use crate::control::Response;
use crate::control::operation::OperationReport;
use crate::plan::Plan;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The engine's state, shared by the task carrying a change out and `status`.
pub(super) struct Inner {
    pub nodes: Nodes,
    /// The cluster's state dir on this node (plan.json, topology.json, journal.json).
    pub state_dir: PathBuf,
    /// The plan this supervisor was started with (what `up` planned).
    pub started_with: Plan,
    pub(super) current: Mutex<Option<OperationReport>>,
}

impl Inner {
    /// The change in progress or the last one (a poisoned lock is taken as it is).
    pub(super) fn current(&self) -> std::sync::MutexGuard<'_, Option<OperationReport>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where a change says how it goes: the client (while it listens), the supervisor's log,
/// and the step `status` shows.
pub struct Progress {
    pub(super) out: mpsc::UnboundedSender<Response>,
    pub(super) inner: Arc<Inner>,
}

impl Progress {
    /// A line the client prints on stdout.
    pub fn line(&self, line: &str) {
        tracing::info!("change: {line}");
        let _ = self.out.send(Response::Progress {
            line: line.to_string(),
            error: false,
        });
    }

    /// A line the client prints on stderr.
    pub fn warn(&self, line: &str) {
        tracing::warn!("change: {line}");
        let _ = self.out.send(Response::Progress {
            line: line.to_string(),
            error: true,
        });
    }

    /// The step the change is on now, for `status`.
    pub fn step(&self, step: &str) {
        if let Some(r) = self.inner.current().as_mut() {
            r.step = step.to_string();
        }
    }
}
