//! `pdctl scale ROLE=N` and `pdctl apply` (and `pdctl up` on a cluster that already runs):
//! the arguments, one change request to the running supervisor, and its progress printed
//! as it comes. The head's supervisor plans and carries the change out (`crate::ops`), so
//! it finishes even if this process is killed.

use super::ExitError;
use super::common::{ClusterArgs, Found, TopologyArgs, change, running, state_root};
use crate::control::operation::{ChangeOptions, ChangeRequest};
use crate::plan::source::scalable_role;
use clap::Args;
use std::process::ExitCode;

pub use crate::ops::DEFAULT_DRAIN_TIMEOUT_S;

/// Arguments of `pdctl scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// How many instances each role should have: `decode=2`, `prefill=3 decode=3`.
    #[arg(required = true, value_name = "ROLE=N")]
    pub targets: Vec<String>,
    /// Print what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds a removed instance's requests in flight get before it is stopped anyway.
    #[arg(long, default_value_t = DEFAULT_DRAIN_TIMEOUT_S)]
    pub timeout: u64,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Arguments of `pdctl apply`.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// The cluster to change (needed when several run under the state root).
    #[arg(long)]
    pub cluster: Option<String>,
    /// Print what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds a drained instance's requests in flight get before it is stopped anyway.
    #[arg(long, default_value_t = DEFAULT_DRAIN_TIMEOUT_S)]
    pub timeout: u64,
    /// When the change cannot be made live (connector, model, node layout...), take the
    /// cluster down and start it again from the file instead of refusing: requests in
    /// flight are cut.
    #[arg(long)]
    pub recreate: bool,
}

/// `pdctl scale ROLE=N...`.
pub fn scale(a: &ScaleArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let mut counts = Vec::new();
    for t in &a.targets {
        let parsed = t.split_once('=').and_then(|(r, n)| {
            Some((
                scalable_role(r.trim())?.as_str().to_string(),
                n.trim().parse::<u32>().ok()?,
            ))
        });
        match parsed {
            Some(c) => counts.push(c),
            None => {
                return Err(ExitError::usage(format!(
                    "`{t}` is not ROLE=N: write for example decode=2 (roles: prefill, decode)"
                )));
            }
        }
    }
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "scale")?;
    let how = ChangeOptions {
        dry_run: a.dry_run,
        drain_timeout_s: a.timeout,
        state_root: state_root(a.which.state_dir.as_deref())?,
    };
    let end = change(
        &found,
        ChangeRequest::Scale {
            counts,
            expect: None,
            how,
        },
        &rt,
    )?;
    Ok(ExitCode::from(end.code))
}

/// What `apply` came to: its exit code, or a refusal only a down and up would get past.
pub enum Applied {
    Code(ExitCode),
    NeedsRecreate(Found),
}

/// `pdctl apply [-f FILE | -p PROFILE]`, and `pdctl up` on a cluster that runs already.
pub fn apply(a: &ApplyArgs, rt: &tokio::runtime::Runtime) -> anyhow::Result<Applied> {
    // Read and planned here first, so a bad file is told at file:line:col before anything
    // is asked of the supervisor, which plans it again from the same text.
    let wanted = crate::plan::resolve::resolve(&a.topology.request())?;
    if let Some(v) = &wanted.version_note {
        return Err(anyhow::Error::new(v.refusal.clone()));
    }
    let Some(source) = wanted.source else {
        return Err(ExitError::usage(
            "apply takes a topology (-f FILE or -p PROFILE)",
        ));
    };
    let cluster = a.cluster.clone().or(Some(wanted.plan.cluster.clone()));
    let found = running(&a.topology.state_dir, cluster.as_deref(), "apply")?;
    let how = ChangeOptions {
        dry_run: a.dry_run,
        drain_timeout_s: a.timeout,
        state_root: state_root(a.topology.state_dir.as_deref())?,
    };
    // The secret values the new plan names only, where the supervisor reads them at each
    // start (on this node; a node elsewhere keeps what its `up` was given) and the change
    // fetches the model with; the ones before are put back when the change fails.
    let before = crate::control::hidden_env::kept(&found.dir)?;
    if !a.dry_run {
        crate::control::hidden_env::keep(&found.dir, &wanted.hidden_env)?;
    }
    let request = ChangeRequest::Apply {
        source: Box::new(source),
        how,
    };
    let end = change(&found, request, rt);
    if !a.dry_run && end.as_ref().is_ok_and(|e| e.code != 0) {
        crate::control::hidden_env::keep(&found.dir, &before)?;
    }
    let end = end?;
    if end.needs_recreate && a.recreate && !a.dry_run {
        return Ok(Applied::NeedsRecreate(found));
    }
    Ok(Applied::Code(ExitCode::from(end.code)))
}
