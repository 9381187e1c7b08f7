//! The cluster's secret on the command line: where `up` takes it from (or makes it, on
//! the head), and `pdctl secret`, which prints it for the other nodes.

use super::ExitError;
use super::common::{ClusterArgs, running};
use crate::control::auth::{SECRET_ENV, SECRET_FILE, Secret};
use crate::plan::Plan;
use crate::supervisor::StateDir;
use clap::Args;
use std::path::Path;
use std::process::ExitCode;

/// Arguments of `pdctl secret`.
#[derive(Debug, Args)]
pub struct SecretArgs {
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// The secret a node of `plan` runs with, kept in its state dir (mode 0600) for its
/// supervisor: the one given (`--secret-file`, else `PDCTL_CLUSTER_SECRET`), else the one
/// kept from an earlier `up`, else — on the head only — a new random one. None for a
/// cluster on one node, which needs none.
pub fn for_up(
    plan: &Plan,
    node: &str,
    state: &StateDir,
    file: Option<&Path>,
) -> anyhow::Result<Option<Secret>> {
    if plan.control_port.is_none() {
        return Ok(None);
    }
    let kept = state.dir.join(SECRET_FILE);
    let given = match file {
        Some(f) => Some(Secret::read(f)?.ok_or_else(|| {
            ExitError::usage(format!("--secret-file {}: no such file", f.display()))
        })?),
        None => match std::env::var(SECRET_ENV) {
            Ok(text) => Some(Secret::from_text(&text, SECRET_ENV)?),
            Err(_) => None,
        },
    };
    let secret = match given {
        Some(s) => s,
        None => match Secret::read(&kept)? {
            Some(s) => s,
            None if node == plan.head_node => Secret::random(),
            None => {
                return Err(ExitError::usage(format!(
                    "node `{node}` of cluster {} needs the cluster's secret to talk to the other nodes' supervisors: on the head ({}) run `pdctl secret --cluster {}` and give it here as {SECRET_ENV}=... or with --secret-file FILE",
                    plan.cluster, plan.head_node, plan.cluster
                )));
            }
        },
    };
    if Secret::read(&kept)?.as_ref() != Some(&secret) {
        secret.write(&kept)?;
    }
    Ok(Some(secret))
}

/// The secret a detached supervisor reads from its state dir.
pub fn kept(state: &StateDir) -> anyhow::Result<Option<Secret>> {
    Ok(Secret::read(&state.dir.join(SECRET_FILE))?)
}

/// `pdctl secret`: prints the running cluster's secret, for the other nodes' `up`.
pub fn show(a: SecretArgs) -> anyhow::Result<ExitCode> {
    let found = running(
        &a.which.state_dir,
        a.which.cluster.as_deref(),
        "show the secret of",
    )?;
    match kept(&StateDir::new(&found.dir))? {
        Some(s) => {
            println!("{}", s.reveal());
            Ok(ExitCode::SUCCESS)
        }
        None => Err(ExitError::usage(format!(
            "cluster {} runs on one node and has no secret: only clusters over several nodes need one",
            found.cluster
        ))),
    }
}
