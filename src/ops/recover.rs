//! What the head's supervisor does at its start, before it takes any change: the change
//! its last run left cut short (the journal) is finished or undone, and every other node
//! is asked what it runs and brought in line with the plan — an instance the plan lacks
//! is stopped, one it lacks is added. The rule, as docs/operations.md states it:
//!
//! - `scale` / `apply`: finished (carried on to the plan it was making: the steps it had
//!   taken are found done — an instance already running with the same spec is adopted);
//!   undone (back to the plan before it) when it was being undone or a step of finishing
//!   fails; set aside when `up` was given a topology that is neither plan.
//! - `restart`: finished: the instances it had not restarted yet are restarted.

use super::change::{Change, read_plan, restart};
use super::context::{Inner, Progress};
use super::journal::{Journal, JournalKind};
use crate::control::Request;
use crate::control::client::ChangeEnd;
use crate::control::operation::Recovered;
use crate::plan::Plan;
use crate::plan::diff::diff;
use crate::plan::source::ClusterSource;
use std::time::Duration;

/// How long a node's supervisor gets to answer at the head's start (it may be starting
/// too, or its link coming back).
const NODE_PATIENCE: Duration = Duration::from_secs(30);

/// Takes up `journal`'s change; how that ended and what became of it.
pub async fn take_up(
    inner: &Inner,
    journal: Journal,
    progress: &Progress,
) -> anyhow::Result<(ChangeEnd, Recovered)> {
    match journal.kind.clone() {
        JournalKind::Plans {
            from,
            wanted,
            from_source,
            wanted_source,
        } => {
            let plans = (*from, *wanted);
            let sources = (from_source.map(|s| *s), wanted_source.map(|s| *s));
            take_up_plans(inner, journal, plans, sources, progress).await
        }
        JournalKind::Restart { services, drained } => {
            take_up_restart(inner, journal, services, drained, progress).await
        }
    }
}

/// A `scale` or `apply` cut short: finished, undone or set aside (the module's rule).
async fn take_up_plans(
    inner: &Inner,
    journal: Journal,
    (from, wanted): (Plan, Plan),
    (from_source, wanted_source): (Option<ClusterSource>, Option<ClusterSource>),
    progress: &Progress,
) -> anyhow::Result<(ChangeEnd, Recovered)> {
    let dir = &inner.state_dir;
    let what = journal.what.clone();
    let end = |code: u8, message: String| ChangeEnd {
        code,
        message,
        needs_recreate: false,
    };
    let started = &inner.started_with;
    if !diff(started, &from).is_empty() && !diff(started, &wanted).is_empty() {
        Journal::clear(dir)?;
        progress.warn(&format!(
            "`{what}` was cut short, but this node was started from a topology that is neither the plan before it nor the one it was making: it is set aside, and the other nodes follow what runs here"
        ));
        let message = format!("`{what}` set aside; the cluster runs the topology `up` was given");
        return Ok((end(0, message), Recovered::SetAside));
    }
    let (run, want, sources, verdict) = if journal.undoing {
        (
            wanted,
            from,
            (wanted_source, from_source),
            Recovered::Undone,
        )
    } else {
        (
            from,
            wanted,
            (from_source, wanted_source),
            Recovered::Finished,
        )
    };
    let cluster = run.cluster.clone();
    progress.line(&format!(
        "taking up `{what}`, cut short at `{}`: {}",
        journal.step,
        if verdict == Recovered::Undone {
            "undoing it"
        } else {
            "finishing it"
        }
    ));
    let how = journal.how.clone();
    let change = Change::between(inner, run, want, sources, &how, progress);
    change.set_journal(journal);
    match change.make().await {
        Ok(()) => {
            let message = format!(
                "`{what}` {} at the head's start: cluster {cluster} runs its plan",
                verdict.as_str()
            );
            Ok((end(0, message), verdict))
        }
        Err(e) if verdict == Recovered::Finished => {
            Ok((change.undo_after(e).await, Recovered::Undone))
        }
        Err(e) => {
            Journal::clear(dir)?;
            let message = format!(
                "undoing `{what}` at the head's start failed: {e:#}\n`pdctl status` shows what runs now"
            );
            Ok((end(1, message), Recovered::Undone))
        }
    }
}

/// A `restart` cut short: the instances it had not restarted yet are restarted.
async fn take_up_restart(
    inner: &Inner,
    mut journal: Journal,
    services: Vec<String>,
    drained: bool,
    progress: &Progress,
) -> anyhow::Result<(ChangeEnd, Recovered)> {
    let dir = &inner.state_dir;
    progress.line(&format!(
        "taking up `{}`, cut short at `{}`: restarting what it had not restarted yet",
        journal.what, journal.step
    ));
    let running = read_plan(dir)?;
    let how = journal.how.clone();
    let services: Vec<String> = services
        .into_iter()
        .filter(|s| running.service(s).is_some())
        .collect();
    let end = restart(
        inner,
        &running,
        &services,
        drained,
        &how,
        progress,
        &mut journal,
    )
    .await;
    Journal::clear(dir)?;
    Ok((end?, Recovered::Finished))
}

/// Asks every other node what it runs and brings it in line with the plan this node
/// runs now: an instance a node runs that the plan lacks (or places elsewhere) is
/// stopped and forgotten there; one the plan places there that it lacks is added. One
/// line per thing done; a node that does not answer is said and left.
pub async fn reconcile(inner: &Inner, progress: &Progress) -> anyhow::Result<Vec<String>> {
    let plan = read_plan(&inner.state_dir)?;
    let timeout_s = super::DEFAULT_DRAIN_TIMEOUT_S;
    let mut lines = Vec::new();
    let others: Vec<String> = inner.nodes.others().cloned().collect();
    for node in others {
        if inner.nodes.never_joined(&node) {
            // It takes the plan from the head when it joins: nothing to bring in line, and
            // nothing done to show.
            tracing::info!("node {node} has not joined the cluster: nothing to reconcile there");
            continue;
        }
        progress.step(&format!("reconciling node {node}"));
        let report = match inner.nodes.status(&node, NODE_PATIENCE).await {
            Ok(r) => r,
            Err(e) => {
                let line = format!(
                    "node {node} does not answer ({e:#}); what it runs is checked at the head's next start"
                );
                progress.warn(&line);
                lines.push(line);
                continue;
            }
        };
        for row in &report.services {
            let planned_here = plan.service(&row.name).is_some_and(|s| s.node == row.node);
            if planned_here {
                continue;
            }
            let wait = Duration::from_secs(timeout_s + 60);
            let req = Request::Remove {
                service: row.name.clone(),
                timeout_s,
            };
            inner
                .nodes
                .ask_retrying(&node, &req, wait, NODE_PATIENCE)
                .await?;
            if !row.remote {
                let line = format!(
                    "{}: ran on node {node} but not in the plan (left by a change cut short): stopped",
                    row.name
                );
                progress.line(&line);
                lines.push(line);
            }
        }
        for svc in &plan.services {
            if report.services.iter().any(|r| r.name == svc.name) {
                continue;
            }
            let req = Request::Add {
                service: Box::new(svc.clone()),
                settings: plan.settings_of(&svc.name).cloned().map(Box::new),
            };
            inner
                .nodes
                .ask_retrying(&node, &req, Duration::from_secs(10), NODE_PATIENCE)
                .await?;
            if svc.node == node {
                let line = format!(
                    "{}: in the plan but not known to node {node}: started there",
                    svc.name
                );
                progress.line(&line);
                lines.push(line);
            }
        }
    }
    Ok(lines)
}
