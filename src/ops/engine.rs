//! The operations engine the head's supervisor runs: one change at a time, in a task of
//! its own (so the client may go), its progress relayed to whoever asked and kept for
//! `status`.

use super::context::{Inner, Progress};
use super::journal::Journal;
use super::nodes::Nodes;
use crate::control::client::ChangeEnd;
use crate::control::client::Endpoint;
use crate::control::operation::{
    ChangeRequest, Interrupted, OperationReport, Outcome, Recovered, now_ms,
};
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
    /// The rebalancer: it judges while the kept topology has a `[rebalance]` table (one
    /// `apply` adds is taken in place); its loop starts with [`recover`].
    ///
    /// [`recover`]: crate::supervisor::Operations::recover
    rebalancer: Arc<super::rebalance::Rebalancer>,
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
        let split = crate::vocab::Split {
            prefill: plan.by_role(crate::vocab::Role::Prefill).count() as u32,
            decode: plan.by_role(crate::vocab::Role::Decode).count() as u32,
        };
        let rebalancer = Arc::new(super::rebalance::Rebalancer::new(
            plan.rebalance.clone(),
            split,
            state_dir.clone(),
        ));
        Engine {
            rebalancer,
            inner: Arc::new(Inner {
                nodes: Nodes::new(node.to_string(), Endpoint::Unix(socket), others),
                state_dir,
                started_with: plan.clone(),
                current: Mutex::new(None),
            }),
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
        // A journal that could not be read was set aside: nothing is changed (nothing
        // overwrites what may be left half done) until the user says they saw it.
        if let Some(notice) = super::journal::unacknowledged(&self.inner.state_dir) {
            return Err(format!("`{what}` refused: {notice}"));
        }
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
                interrupted: None,
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

    fn recover(&self) {
        let ops: Arc<dyn crate::supervisor::Operations> = Arc::new(self.clone());
        tokio::spawn(super::rebalance::run(ops, self.rebalancer.clone()));
        let Some(journal) = self.read_journal() else {
            return;
        };
        let aside = super::journal::unacknowledged(&self.inner.state_dir);
        if journal.is_none() && aside.is_none() && self.inner.nodes.others().next().is_none() {
            return;
        }
        *self.inner.current() = Some(OperationReport {
            what: match (&journal, &aside) {
                (Some(j), _) => j.what.clone(),
                (None, Some(_)) => JOURNAL_SET_ASIDE.to_string(),
                (None, None) => "reconcile the other nodes with the plan".to_string(),
            },
            started_ms: now_ms(),
            step: "starting".into(),
            outcome: None,
            interrupted: journal.as_ref().map(|j| Interrupted {
                what: j.what.clone(),
                step: j.step.clone(),
                recovered: None,
            }),
        });
        tokio::spawn(recover_in_background(self.inner.clone(), journal, aside));
    }

    fn report(&self) -> Option<OperationReport> {
        let mut report = self.inner.current().clone();
        if let Some(r) = report.as_mut().filter(|r| r.what == JOURNAL_SET_ASIDE)
            && let Some(o) = r.outcome.as_mut()
            && super::journal::unacknowledged(&self.inner.state_dir).is_none()
        {
            o.message = format!("acknowledged, changes run again: {}", o.message);
        }
        report
    }

    fn rebalance(&self) -> Option<crate::vocab::RebalanceReport> {
        self.rebalancer.report()
    }

    fn set_rebalance(&self, mode: crate::vocab::RebalanceMode) -> Result<String, String> {
        self.rebalancer.set_mode(mode)
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

/// What `status` names the start-up recovery after a journal that could not be read.
const JOURNAL_SET_ASIDE: &str = "take up the change journal";

/// The start-up recovery: the journal's change taken up, then the other nodes
/// reconciled; how it ended, what became of the change, how many things reconciling did.
async fn recover_all(
    inner: &Inner,
    journal: Option<Journal>,
    progress: &Progress,
) -> (ChangeEnd, Option<Recovered>, usize) {
    let failed = |e: anyhow::Error| ChangeEnd {
        code: 1,
        message: format!("{e:#}"),
        needs_recreate: false,
    };
    let (mut end, recovered) = match journal {
        None => (
            ChangeEnd {
                code: 0,
                message: String::new(),
                needs_recreate: false,
            },
            None,
        ),
        Some(j) => match super::recover::take_up(inner, j, progress).await {
            Ok((end, verdict)) => (end, Some(verdict)),
            Err(e) => (failed(e), None),
        },
    };
    let lines = match super::recover::reconcile(inner, progress).await {
        Ok(lines) => lines,
        Err(e) => {
            let e = failed(e);
            end.code = end.code.max(1);
            vec![format!("reconciling the other nodes failed: {}", e.message)]
        }
    };
    if end.message.is_empty() {
        end.message = if lines.is_empty() {
            "every node runs what the plan lists".to_string()
        } else {
            lines.join("; ")
        };
    } else if !lines.is_empty() {
        end.message = format!("{}; {}", end.message, lines.join("; "));
    }
    (end, recovered, lines.len())
}

impl Engine {
    /// The change journal a start-up takes up (None inside when there is none); one that
    /// cannot be read is moved aside (the nodes are still reconciled with the plan,
    /// `status` says so, and changes wait for `pdctl ack-journal`). None when it can be
    /// neither read nor moved: `status` says why until it is.
    fn read_journal(&self) -> Option<Option<Journal>> {
        let dir = &self.inner.state_dir;
        let read: Result<Option<Journal>, super::journal::JournalError> = Journal::read(dir)
            .or_else(|e| {
                let aside = super::journal::set_aside(dir, &e)?;
                tracing::error!("{}", aside.notice);
                Ok(None)
            });
        match read {
            Ok(j) => Some(j),
            Err(e) => {
                tracing::error!("{e}");
                *self.inner.current() = Some(OperationReport {
                    what: "take up the change journal".into(),
                    started_ms: now_ms(),
                    step: "reading it".into(),
                    outcome: Some(Outcome {
                        code: 1,
                        message: e.to_string(),
                        ended_ms: now_ms(),
                    }),
                    interrupted: None,
                });
                None
            }
        }
    }
}

/// The start-up recovery (the `journal`'s change taken up, the nodes reconciled with the
/// plan), its end kept as the current report; a journal set `aside` makes it fail.
async fn recover_in_background(inner: Arc<Inner>, journal: Option<Journal>, aside: Option<String>) {
    // Nobody listens: the lines go to the supervisor's log and `status`.
    let (out, _) = mpsc::unbounded_channel();
    let progress = Progress {
        out,
        inner: inner.clone(),
    };
    let had_journal = journal.is_some();
    let (mut end, recovered, lines) = recover_all(&inner, journal, &progress).await;
    tracing::info!("start-up recovery ended ({}): {}", end.code, end.message);
    if let Some(notice) = aside {
        end.code = end.code.max(1);
        end.message = format!("{notice} ({})", end.message);
    }
    let mut current = inner.current();
    if !had_journal && lines == 0 && end.code == 0 {
        // Nothing was cut short, nothing was out of line: no change to show.
        *current = None;
        return;
    }
    if let Some(r) = current.as_mut() {
        if let (Some(i), Some(v)) = (r.interrupted.as_mut(), recovered) {
            i.recovered = Some(v);
        }
        r.outcome = Some(Outcome {
            code: end.code,
            message: end.message.lines().next().unwrap_or_default().to_string(),
            ended_ms: now_ms(),
        });
    }
}
