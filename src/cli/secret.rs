//! The cluster's secret on the command line: where `up` takes it from (or makes it, on
//! the head), the engine key that follows from it (or that the user sets), and
//! `pdctl secret`, which prints either for the other nodes and for a person.

use super::ExitError;
use super::common::{ClusterArgs, running};
use crate::control::auth::{
    ENGINE_KEY_ENV, ENGINE_KEY_FILE, EngineKey, SECRET_ENV, SECRET_FILE, Secret,
};
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
    /// Print the key the cluster's engines require (for a request straight to an engine:
    /// `Authorization: Bearer KEY`) instead of the cluster's secret.
    #[arg(long)]
    pub engine_key: bool,
}

/// The secret a node of `plan` runs with, kept in its state dir (mode 0600) for its
/// supervisor: the one given (`--secret-file`, else `PDCTL_CLUSTER_SECRET`), else the one
/// kept from an earlier `up`, else — on the head only — a new random one. Every cluster
/// has one, also on one node: its engine key follows from it. None only on another node
/// that needs none (no control channel, no service there takes the engine key).
pub fn for_up(
    plan: &Plan,
    node: &str,
    state: &StateDir,
    file: Option<&Path>,
) -> anyhow::Result<Option<Secret>> {
    let needed = node == plan.head_node
        || plan.control_port.is_some()
        || plan.local_services(node).any(|s| !s.secret_env.is_empty());
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
            None if !needed => return Ok(None),
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

/// The engine key a node runs its cluster with: `PDCTL_ENGINE_API_KEY` when the user sets
/// one (kept in the state dir, mode 0600, for the detached supervisor and `pdctl secret
/// --engine-key`; every node must be given the same), else the one derived from the
/// cluster's secret (so every node that has the secret has the key).
pub fn engine_key_for_up(
    state: &StateDir,
    secret: Option<&Secret>,
) -> anyhow::Result<Option<EngineKey>> {
    let file = state.dir.join(ENGINE_KEY_FILE);
    match std::env::var(ENGINE_KEY_ENV) {
        Ok(text) if !text.trim().is_empty() => {
            let key = EngineKey::from_text(&text, ENGINE_KEY_ENV)
                .map_err(|e| ExitError::usage(e.to_string()))?;
            if EngineKey::read(&file)?.as_ref() != Some(&key) {
                key.write(&file)?;
            }
            Ok(Some(key))
        }
        _ => {
            match std::fs::remove_file(&file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(anyhow::anyhow!(
                        "cannot remove the engine key {} kept from an earlier `up`: {e}",
                        file.display()
                    ));
                }
            }
            Ok(secret.map(Secret::engine_key))
        }
    }
}

/// The secret a detached supervisor reads from its state dir.
pub fn kept(state: &StateDir) -> anyhow::Result<Option<Secret>> {
    Ok(Secret::read(&state.dir.join(SECRET_FILE))?)
}

/// The engine key of the cluster whose state dir this is (see
/// [`crate::control::auth::kept_engine_key`]).
pub fn kept_engine_key(state: &StateDir) -> anyhow::Result<Option<EngineKey>> {
    Ok(crate::control::auth::kept_engine_key(&state.dir)?)
}

/// `pdctl secret`: prints the running cluster's secret, for the other nodes' `up`, or with
/// `--engine-key` the key its engines require.
pub fn show(a: SecretArgs) -> anyhow::Result<ExitCode> {
    let found = running(
        &a.which.state_dir,
        a.which.cluster.as_deref(),
        "show the secret of",
    )?;
    let state = StateDir::new(&found.dir);
    let text = if a.engine_key {
        kept_engine_key(&state)?.map(|k| k.reveal().to_string())
    } else {
        kept(&state)?.map(|s| s.reveal().to_string())
    };
    match text {
        Some(t) => {
            println!("{t}");
            Ok(ExitCode::SUCCESS)
        }
        None => Err(ExitError::usage(format!(
            "cluster {} has no secret in {}: it was started by a pdctl that made none; take it down and up again",
            found.cluster,
            found.dir.display()
        ))),
    }
}
