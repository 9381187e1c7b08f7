//! The operations engine the head's supervisor runs: one change at a time, in a task of
//! its own (so the client may go), its progress relayed to whoever asked and kept for
//! `status`.

use super::nodes::Nodes;
use crate::control::client::Endpoint;
use crate::control::operation::{ChangeRequest, OperationReport, Outcome, now_ms};
use crate::control::tls::PeerTls;
use crate::control::{Request, Response};
use crate::plan::Plan;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Carries out changes to a cluster from its head node's supervisor.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub nodes: Nodes,
    /// The cluster's state dir on this node (plan.json, topology.json).
    pub state_dir: PathBuf,
    current: Mutex<Option<OperationReport>>,
}

impl Engine {
    /// The engine of `plan`'s cluster on `node`, whose supervisor listens on `socket`;
    /// other nodes are reached at their address and the plan's control port over `tls`.
    pub fn new(
        plan: &Plan,
        node: &str,
        socket: PathBuf,
        state_dir: PathBuf,
        tls: Option<Arc<PeerTls>>,
    ) -> Engine {
        let mut others = BTreeMap::new();
        if let (Some(port), Some(tls)) = (plan.control_port, tls) {
            for (name, addr) in plan.nodes.iter().filter(|(n, _)| n.as_str() != node) {
                let endpoint = Endpoint::peer(format!("{addr}:{port}"), name, &tls);
                others.insert(name.clone(), endpoint);
            }
        }
        Engine {
            inner: Arc::new(Inner {
                nodes: Nodes::new(node.to_string(), Endpoint::Unix(socket), others),
                state_dir,
                current: Mutex::new(None),
            }),
        }
    }
}

impl Inner {
    fn current(&self) -> std::sync::MutexGuard<'_, Option<OperationReport>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where a change says how it goes: the client (while it listens), the supervisor's log,
/// and the step `status` shows.
pub struct Progress {
    out: mpsc::UnboundedSender<Response>,
    inner: Arc<Inner>,
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

impl crate::supervisor::Operations for Engine {
    fn begin(
        &self,
        change: ChangeRequest,
        out: mpsc::UnboundedSender<Response>,
    ) -> Result<(), String> {
        let what = change.describe();
        {
            let mut current = self.inner.current();
            if let Some(running) = current.as_ref().filter(|r| r.running()) {
                return Err(format!(
                    "another change is running: {} (started {} s ago, at {}); wait for it to finish (`pdctl status` shows it), then try again",
                    running.what,
                    now_ms().saturating_sub(running.started_ms) / 1000,
                    running.step
                ));
            }
            *current = Some(OperationReport {
                what: what.clone(),
                started_ms: now_ms(),
                step: "planning".into(),
                outcome: None,
            });
        }
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let progress = Progress {
                out: out.clone(),
                inner: inner.clone(),
            };
            tracing::info!("change started: {what}");
            let (code, message, needs_recreate) =
                match super::change::carry_out(&inner, change, &progress).await {
                    Ok(end) => (end.code, end.message, end.needs_recreate),
                    Err(e) => (
                        1,
                        format!("the change stopped: {e:#}\n`pdctl status` shows what runs now"),
                        false,
                    ),
                };
            tracing::info!("change ended ({code}): {what}: {message}");
            if let Some(r) = inner.current().as_mut() {
                r.outcome = Some(Outcome {
                    code,
                    message: message.lines().next().unwrap_or_default().to_string(),
                    ended_ms: now_ms(),
                });
            }
            let _ = out.send(Response::Finished {
                code,
                message,
                needs_recreate,
            });
        });
        Ok(())
    }

    fn report(&self) -> Option<OperationReport> {
        self.inner.current().clone()
    }

    fn down_others(
        &self,
        timeout_s: u64,
    ) -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>> {
        Box::pin(async move {
            let nodes = &self.inner.nodes;
            // Waves of services each get the timeout; allow for a few waves and the kill.
            let patience = Duration::from_secs(timeout_s.saturating_mul(6) + 30);
            let mut lines = Vec::new();
            for node in nodes.others() {
                let line = match nodes.ask(node, Request::Down { timeout_s }, patience).await {
                    Ok(message) => format!("node {node}: {message}"),
                    Err(e) => format!("could not take node {node} down: {e:#}"),
                };
                lines.push(line);
            }
            lines
        })
    }
}
