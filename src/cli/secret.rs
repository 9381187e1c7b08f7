//! The cluster's secret and certificates on the command line: where `up` takes them from
//! (or makes them, on the head: the secret, the cluster's CA, each node's certificate),
//! the engine key that follows from the secret (or that the user sets), a join for a node
//! started by hand, `pdctl secret` (the secret or the engine key, for a person) and
//! `pdctl join-token` (what a node started by hand is given).

use super::ExitError;
use super::common::{ClusterArgs, running};
use crate::control::auth::{
    ENGINE_KEY_ENV, ENGINE_KEY_FILE, EngineKey, JOIN_TOKEN_ENV, SECRET_ENV, SECRET_FILE, Secret,
};
use crate::control::tls::{ClusterCa, JoinToken, NodeCreds, PeerTls, TLS_DIR};
use crate::plan::Plan;
use crate::supervisor::StateDir;
use clap::Args;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    token: Option<&JoinToken>,
) -> anyhow::Result<Option<Secret>> {
    let needed = node == plan.head_node
        || plan.control_port.is_some()
        || plan.local_services(node).any(|s| !s.secret_env.is_empty());
    let kept = state.dir.join(SECRET_FILE);
    let given = match (token, file) {
        (Some(t), _) => Some(t.secret.clone()),
        (None, Some(f)) => Some(Secret::read(f)?.ok_or_else(|| {
            ExitError::usage(format!("--secret-file {}: no such file", f.display()))
        })?),
        (None, None) => match std::env::var(SECRET_ENV) {
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
                    "node `{node}` of cluster {} needs to join it: give it `ssh` in [nodes] and run `pdctl up` on the head ({}), or on the head run `pdctl join-token --cluster {}` and give it here as {JOIN_TOKEN_ENV}=... or with --join-token-file FILE",
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

/// How a node other than the head comes by its certificate at `up`.
#[derive(Debug, Clone, Default)]
pub enum Join {
    /// The one kept from an earlier join (a detached supervisor; a node started again).
    #[default]
    Kept,
    /// Join the head with this token (unless the kept certificate is of the CA it pins).
    Token(JoinToken),
    /// Given by the head over SSH.
    Given(NodeCreds),
}

/// The join token `up` was given on a node started by hand: `--join-token-file`, else
/// `PDCTL_JOIN_TOKEN`; None when neither.
pub fn token_for_up(file: Option<&Path>) -> anyhow::Result<Option<JoinToken>> {
    let (text, origin) = match file {
        Some(f) => (
            std::fs::read_to_string(f)
                .map_err(|e| ExitError::usage(format!("--join-token-file {}: {e}", f.display())))?,
            format!("--join-token-file {}", f.display()),
        ),
        None => match std::env::var(JOIN_TOKEN_ENV) {
            Ok(t) if !t.trim().is_empty() => (t, JOIN_TOKEN_ENV.to_string()),
            _ => return Ok(None),
        },
    };
    JoinToken::parse(&text)
        .map(Some)
        .map_err(|e| ExitError::usage(format!("{origin}: {e}")))
}

/// This node's side of the channel between the supervisors, None on a cluster of one
/// node. The head keeps (or makes) the cluster's CA and issues itself a certificate; any
/// other node uses the one it was given (`join`), kept, or joins the head for one.
pub fn channel(
    plan: &Plan,
    node: &str,
    state: &StateDir,
    secret: Option<&Secret>,
    join: Join,
) -> anyhow::Result<Option<Arc<PeerTls>>> {
    let Some(port) = plan.control_port else {
        return Ok(None);
    };
    let dir = state.dir.join(TLS_DIR);
    let nodes: Vec<String> = plan.nodes.keys().cloned().collect();
    if node == plan.head_node {
        let secret = secret.cloned().ok_or_else(|| {
            anyhow::anyhow!("the head has no cluster secret in {}", state.dir.display())
        })?;
        let ca = ClusterCa::load_or_make(&dir, &plan.cluster)?;
        let creds = match NodeCreds::read(&dir)? {
            Some(c) if c.node == node && c.ca_hash() == ca.hash() => c,
            _ => {
                let c = ca.issue(node)?;
                c.write(&dir)?;
                c
            }
        };
        let tls = PeerTls::new(
            &plan.cluster,
            &plan.head_node,
            nodes,
            &creds,
            Some((ca, secret)),
        )?;
        return Ok(Some(Arc::new(tls)));
    }
    let kept = NodeCreds::read(&dir)?.filter(|c| c.node == node);
    let creds = match join {
        Join::Given(c) => {
            c.write(&dir)?;
            c
        }
        Join::Token(t) => match kept {
            Some(c) if c.ca_hash() == t.ca_hash => c,
            _ => {
                let c = join_head(plan, node, port, &t)?;
                c.write(&dir)?;
                c
            }
        },
        Join::Kept => kept.ok_or_else(|| {
            anyhow::Error::from(crate::supervisor::SupervisorError::NoSecret {
                node: node.to_string(),
            })
        })?,
    };
    let tls = PeerTls::new(&plan.cluster, &plan.head_node, nodes, &creds, None)?;
    Ok(Some(Arc::new(tls)))
}

/// How long a node started by hand keeps trying to reach the head to join.
const JOIN_WITHIN: Duration = Duration::from_secs(120);

/// Joins the head for `node`'s certificate, trying again while the head's supervisor is
/// not up yet (up to [`JOIN_WITHIN`]); a refusal ends it at once.
fn join_head(plan: &Plan, node: &str, port: u16, token: &JoinToken) -> anyhow::Result<NodeCreds> {
    use crate::control::client::{ControlError, join};
    let head = &plan.head_node;
    let addr = format!("{}:{port}", plan.nodes[head]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let start = Instant::now();
    let mut said = false;
    loop {
        match rt.block_on(join(&addr, head, node, token, Duration::from_secs(10))) {
            Ok(c) => return Ok(c),
            Err(e @ (ControlError::Refused { .. } | ControlError::Auth { .. })) => {
                return Err(ExitError::usage(format!(
                    "joining cluster {} as node {node}: {e}",
                    plan.cluster
                )));
            }
            Err(e) if start.elapsed() < JOIN_WITHIN => {
                if !said {
                    println!("pdctl: waiting for the head's supervisor at {addr} to join ({e})");
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => {
                return Err(anyhow::anyhow!(
                    "joining cluster {} as node {node}: the head did not answer within {} s: {e}",
                    plan.cluster,
                    JOIN_WITHIN.as_secs()
                ));
            }
        }
    }
}

/// Arguments of `pdctl join-token`.
#[derive(Debug, Args)]
pub struct JoinTokenArgs {
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl join-token`: on the head, what a node started by hand is given to join
/// (`PDCTL_JOIN_TOKEN` or `up --join-token-file`): the CA's hash and the secret.
pub fn join_token(a: JoinTokenArgs) -> anyhow::Result<ExitCode> {
    let found = running(
        &a.which.state_dir,
        a.which.cluster.as_deref(),
        "print a join token of",
    )?;
    let state = StateDir::new(&found.dir);
    let dir = state.dir.join(TLS_DIR);
    let secret = kept(&state)?;
    let ca = ClusterCa::load(&dir, &found.cluster)?;
    match (secret, ca) {
        (Some(secret), Some(ca)) => {
            let token = JoinToken {
                ca_hash: ca.hash(),
                secret,
            };
            println!("{}", token.reveal());
            Ok(ExitCode::SUCCESS)
        }
        _ => Err(ExitError::usage(format!(
            "cluster {} has no CA in {}: join tokens are printed on the head of a cluster over several nodes",
            found.cluster,
            dir.display()
        ))),
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
            "cluster {} has no secret in {}: a node the head started over ssh holds none (ask the head), and a pdctl of old made none (take it down and up again)",
            found.cluster,
            found.dir.display()
        ))),
    }
}
