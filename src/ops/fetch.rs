//! The model fetch before a change starts new engines (`scale`, `apply`): on a node whose
//! cache lacks the plan's model ([`crate::plan::Plan::model_fetch`]) it is fetched first,
//! as `up` fetches it, with the same lines, so no second of the download is counted in
//! the new engine's `startup_timeout_s`. Also what a node run from a plan fetches.

use super::context::Progress;
use crate::model_fetch::{FetchError, Source};
use crate::plan::Plan;
use crate::vocab::{HUB_TOKEN_VARS, HiddenEnv, Role};
use std::path::PathBuf;
use std::time::Duration;

/// Seconds between two progress lines, as `up` prints them.
pub const EVERY: Duration = Duration::from_secs(2);

/// The fetch `node` needs before its engines of `plan` (all of them, or only those named
/// in `only`) start, made runnable here with the token of those engines (`hidden`, the
/// values kept for them); None when it runs no such engine, the plan serves no hub model,
/// or the cache holds it.
pub fn planned_source(
    plan: &Plan,
    node: &str,
    only: Option<&[String]>,
    hidden: &HiddenEnv,
) -> Option<Source> {
    let planned = plan.model_fetch.as_ref()?;
    let engines: Vec<Role> = plan
        .local_services(node)
        .filter(|s| s.role.is_engine() && only.is_none_or(|o| o.contains(&s.name)))
        .map(|s| s.role)
        .collect();
    if engines.is_empty() || !planned.missing() {
        return None;
    }
    let tokens = HUB_TOKEN_VARS.iter().filter_map(|var| {
        let value = engines.iter().find_map(|r| hidden.get(*r, var))?;
        Some((*var, value))
    });
    Some(planned.runnable(tokens))
}

/// Fetches `source` for `node` on a thread of its own, each line said to `progress` as it
/// comes (the client of the change prints them).
pub async fn fetch_here(
    source: Source,
    node: &str,
    progress: &Progress,
) -> Result<PathBuf, FetchError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let model = source.model.clone();
    let node = node.to_string();
    let worker = std::thread::spawn(move || {
        let mut say = |line: String| {
            let _ = tx.send(line);
        };
        source.fetch_saying(&node, EVERY, &mut say, &mut |_| {})
    });
    while let Some(line) = rx.recv().await {
        progress.line(&line);
    }
    // The sender is gone: the thread has returned (or is returning) its result.
    worker.join().unwrap_or_else(|_| {
        Err(FetchError::Failed {
            model,
            why: "the fetching thread panicked".into(),
        })
    })
}
