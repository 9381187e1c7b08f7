//! The cluster's secret and certificates on the command line: where `up` takes them from
//! (or makes them, on the head: the secret, the cluster's CA, each node's certificate),
//! the engine key that follows from the secret (or that the user sets), a join for a node
//! started by hand, `pdctl secret` (the secret or the engine key, for a person) and
//! `pdctl join-token` (what a node started by hand is given).

use super::ExitError;
use super::common::{ClusterArgs, running};
use crate::control::auth::{
    CLIENT_KEY_ENV, CLIENT_KEY_FILE, ClientKey, ClusterSecret, ENGINE_KEY_ENV, ENGINE_KEY_FILE,
    EngineKey, JOIN_TOKEN_ENV, SECRET_ENV, SECRET_FILE,
};
use crate::control::tls::{
    Book, CERT_LIFETIME_S, ClusterCa, DEFAULT_TOKEN_TTL_S, JoinToken, NodeCreds, PeerTls, TLS_DIR,
    TokenRecord, now_s,
};
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

/// The secret the head of `plan` runs with, kept in its state dir (mode 0600): the one
/// given (`--secret-file`, else `PDCTL_CLUSTER_SECRET`; at least 128 bits of randomness),
/// else the one kept from an earlier `up`, else a new random one. Every cluster has one,
/// also on one node: its engine key follows from it. The secret never leaves the head:
/// on another node None, a secret given there is refused, and one an older pdctl kept
/// there is removed.
pub fn for_up(
    plan: &Plan,
    node: &str,
    state: &StateDir,
    file: Option<&Path>,
) -> anyhow::Result<Option<ClusterSecret>> {
    let kept = state.dir.join(SECRET_FILE);
    let given_env = std::env::var(SECRET_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty());
    if node != plan.head_node {
        if file.is_some() || given_env.is_some() {
            return Err(ExitError::usage(format!(
                "node `{node}` is not the head of cluster {}: the cluster's secret stays on the head ({}); leave out --secret-file and {SECRET_ENV} here, and join with a token (`pdctl join-token --node {node}` on the head, given here as {JOIN_TOKEN_ENV}=... or --join-token-file FILE)",
                plan.cluster, plan.head_node
            )));
        }
        match std::fs::remove_file(&kept) {
            Ok(()) => println!(
                "pdctl: removed {}: the cluster's secret stays on the head now",
                kept.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot remove {}: {e}", kept.display()),
        }
        return Ok(None);
    }
    let weak = |e: crate::control::auth::SecretError| ExitError::usage(e.to_string());
    let given = match (file, given_env) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| ExitError::usage(format!("--secret-file {}: {e}", f.display())))?;
            Some(ClusterSecret::chosen(&text, &format!("in {}", f.display())).map_err(weak)?)
        }
        (None, Some(text)) => {
            Some(ClusterSecret::chosen(&text, &format!("in {SECRET_ENV}")).map_err(weak)?)
        }
        (None, None) => None,
    };
    let secret = match given {
        Some(s) => s,
        None => match ClusterSecret::read(&kept)? {
            Some(s) => s,
            None => ClusterSecret::random(),
        },
    };
    if ClusterSecret::read(&kept)?.as_ref() != Some(&secret) {
        secret.write(&kept)?;
    }
    Ok(Some(secret))
}

/// The engine key a node runs its cluster with: `PDCTL_ENGINE_API_KEY` when the user sets
/// one (kept in the state dir, mode 0600, for the detached supervisor and `pdctl secret
/// --engine-key`; every node must be given the same), else on the head the one derived
/// from the cluster's secret, on another node the one the head handed it when it joined
/// (kept in the state dir; None before it joined).
pub fn engine_key_for_up(
    state: &StateDir,
    secret: Option<&ClusterSecret>,
    head: bool,
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
        _ if !head => Ok(EngineKey::read(&file)?),
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
            Ok(secret.map(ClusterSecret::engine_key))
        }
    }
}

/// The proxy's client key `up` runs with: `PDCTL_API_KEY` of its environment, kept in the
/// state dir (mode 0600) for the detached supervisor and for the nodes the head hands it
/// to; none (and the kept one removed) when it is unset.
pub fn client_key_for_up(state: &StateDir) -> anyhow::Result<Option<ClientKey>> {
    let key = match std::env::var(CLIENT_KEY_ENV) {
        Ok(text) if !text.trim().is_empty() => Some(
            ClientKey::from_text(&text, CLIENT_KEY_ENV)
                .map_err(|e| ExitError::usage(e.to_string()))?,
        ),
        _ => None,
    };
    keep_client_key(state, key)
}

/// Keeps `key` as the node's client key (mode 0600), or removes the kept one when None.
pub fn keep_client_key(
    state: &StateDir,
    key: Option<ClientKey>,
) -> anyhow::Result<Option<ClientKey>> {
    let file = state.dir.join(CLIENT_KEY_FILE);
    match &key {
        Some(k) => {
            if ClientKey::read(&file)?.as_ref() != Some(k) {
                k.write(&file)?;
            }
        }
        None => match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(anyhow::anyhow!(
                    "cannot remove the client key {} kept from an earlier `up`: {e}",
                    file.display()
                ));
            }
        },
    }
    Ok(key)
}

/// The client key kept in a node's state dir, for its detached supervisor.
pub fn kept_client_key(state: &StateDir) -> anyhow::Result<Option<ClientKey>> {
    Ok(ClientKey::read(&state.dir.join(CLIENT_KEY_FILE))?)
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
    secret: Option<&ClusterSecret>,
    join: Join,
) -> anyhow::Result<Option<Arc<PeerTls>>> {
    let Some(port) = plan.control_port else {
        return Ok(None);
    };
    let dir = state.dir.join(TLS_DIR);
    let nodes: Vec<String> = plan.nodes.keys().cloned().collect();
    if node == plan.head_node {
        if secret.is_none() {
            anyhow::bail!("the head has no cluster secret in {}", state.dir.display());
        }
        let ca = ClusterCa::load_or_make(&dir, &plan.cluster)?;
        let at_up = crate::control::tls::head_creds_at_up(&ca, node)?;
        if let Some(note) = &at_up.note {
            println!("pdctl: {note}");
        }
        let tls = PeerTls::new(
            &plan.cluster,
            &plan.head_node,
            nodes,
            &at_up.creds,
            Some(ca),
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
                let joined = join_head(plan, node, port, &t)?;
                joined.creds.write(&dir)?;
                let (y, m, d) = crate::control::tls::ymd(now_s() + CERT_LIFETIME_S);
                println!(
                    "pdctl: joined cluster {} as node {node}; its certificate expires on {y:04}-{m:02}-{d:02} (UTC) and is renewed at every `up` of the head while this node runs",
                    plan.cluster
                );
                if let Some(k) = &joined.engine_key {
                    k.write(&state.dir.join(ENGINE_KEY_FILE))?;
                }
                joined.creds
            }
        },
        Join::Kept => kept.ok_or_else(|| {
            anyhow::Error::from(crate::supervisor::SupervisorError::NoSecret {
                node: node.to_string(),
            })
        })?,
    };
    // A renewed certificate is kept where this one came from.
    let tls = PeerTls::new(&plan.cluster, &plan.head_node, nodes, &creds, None)?.keeping_in(&dir);
    Ok(Some(Arc::new(tls)))
}

/// How long a node started by hand keeps trying to reach the head to join.
const JOIN_WITHIN: Duration = Duration::from_secs(120);

/// Joins the head for `node`'s certificate, trying again while the head's supervisor is
/// not up yet (up to [`JOIN_WITHIN`]); a refusal ends it at once.
fn join_head(
    plan: &Plan,
    node: &str,
    port: u16,
    token: &JoinToken,
) -> anyhow::Result<crate::control::client::Joined> {
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
    /// The node the token lets join (once); may be left out when the cluster has one node
    /// besides the head.
    #[arg(long, value_name = "NODE", conflicts_with_all = ["list", "revoke"])]
    pub node: Option<String>,
    /// How long the token is good for: `90s`, `30m`, `1h`, `2d` (default 1h).
    #[arg(long, value_name = "DURATION", value_parser = parse_ttl, conflicts_with_all = ["list", "revoke"])]
    pub ttl: Option<u64>,
    /// List the join tokens (id, node, state, expiry; never their secret) and each node's
    /// certificate (serial, how it came by it, when it was issued and expires).
    #[arg(long)]
    pub list: bool,
    /// Revoke a join token (its id, as `--list` shows it), or a node's certificate (the
    /// node's name: the head refuses it from then on; the node joins again with a new
    /// token, or the head's `up` starts it again over ssh).
    #[arg(long, value_name = "ID|NODE", conflicts_with = "list")]
    pub revoke: Option<String>,
    /// Rotate the head's certificate: a new one is staged, signed by the one of now, taken
    /// by every node at its next poll, and put to use at the head's next `up`; from then
    /// on the nodes refuse the old one and its key (docs/security.md).
    #[arg(long, conflicts_with_all = ["node", "ttl", "list", "revoke"])]
    pub rotate_head: bool,
}

/// Why a `--ttl` was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TtlError {
    #[error("`{text}` is no duration ({why}): write 90s, 30m, 1h, 2d or 1h30m")]
    NoDuration { text: String, why: String },
    #[error("`{0}` is under a second: a token good for 0 s joins nothing")]
    Zero(String),
}

/// A token's lifetime in whole seconds from `90s`, `30m`, `1h`, `2d`, `1h30m` (any span
/// humantime reads) or a bare number of seconds.
fn parse_ttl(text: &str) -> Result<u64, TtlError> {
    let t = text.trim();
    let secs = if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        t.parse::<u64>().map_err(|e| TtlError::NoDuration {
            text: text.into(),
            why: e.to_string(),
        })?
    } else {
        humantime::parse_duration(t)
            .map_err(|e| TtlError::NoDuration {
                text: text.into(),
                why: e.to_string(),
            })?
            .as_secs()
    };
    match secs {
        0 => Err(TtlError::Zero(text.into())),
        s => Ok(s),
    }
}

/// `pdctl join-token`: on the head, a token that lets one node started by hand join
/// once, within its time (`PDCTL_JOIN_TOKEN` or `up --join-token-file` there); with
/// `--list` the tokens and certificates, with `--revoke` one of them withdrawn.
pub fn join_token(a: JoinTokenArgs) -> anyhow::Result<ExitCode> {
    crate::supervisor::private_umask();
    let found = running(
        &a.which.state_dir,
        a.which.cluster.as_deref(),
        "make a join token of",
    )?;
    let state = StateDir::new(&found.dir);
    let dir = state.dir.join(TLS_DIR);
    let plan = super::common::read_plan(&state.plan_path())?;
    let Some(ca) = ClusterCa::load(&dir, &found.cluster)?.filter(|_| found.node == plan.head_node)
    else {
        return Err(ExitError::usage(format!(
            "cluster {} has no CA in {}: join tokens are made on the head ({}) of a cluster over several nodes",
            found.cluster,
            dir.display(),
            plan.head_node
        )));
    };
    if a.list {
        print_book(&Book::read(&dir)?);
        return Ok(ExitCode::SUCCESS);
    }
    if a.rotate_head {
        return super::rotate_head::rotate(&dir, &ca, &plan.head_node);
    }
    if let Some(what) = &a.revoke {
        return revoke(&dir, what);
    }
    let node = token_node(a.node.as_ref(), &plan)?;
    let token = JoinToken::new(&ca.hash());
    let now = now_s();
    let record = TokenRecord {
        id: token.id.clone(),
        node: node.clone(),
        verifier: token.verifier(),
        hash: None,
        created_s: now,
        expires_s: now + a.ttl.unwrap_or(DEFAULT_TOKEN_TTL_S),
        used_s: None,
        handed: None,
        revoked: false,
    };
    Book::update(&dir, |b| {
        // Tokens past their time are forgotten a day after.
        b.tokens.retain(|t| t.expires_s + 86_400 > now);
        b.tokens.push(record);
        Ok(())
    })?
    .map_err(ExitError::usage)?;
    println!("{}", token.reveal());
    Ok(ExitCode::SUCCESS)
}

/// `pdctl join-token --revoke WHAT`: a join token (by its id) or a node's certificate
/// (by the node's name) withdrawn.
fn revoke(dir: &Path, what: &str) -> anyhow::Result<ExitCode> {
    let what = what.to_string();
    let said = Book::update(dir, move |b| {
        if let Some(t) = b.tokens.iter_mut().find(|t| t.id == what) {
            t.revoked = true;
            return Ok(format!("join token {what} (node {}) revoked", t.node));
        }
        match b.issued.remove(&what) {
            Some(i) => Ok(format!(
                "the certificate of node {what} (serial {}) revoked: the head refuses it from now on",
                i.serial
            )),
            None => Err(format!(
                "no join token and no node certificate is named `{what}` (`pdctl join-token --list` shows them)"
            )),
        }
    })?
    .map_err(ExitError::usage)?;
    println!("pdctl: {said}");
    Ok(ExitCode::SUCCESS)
}

/// The node a new join token is for: `--node`, or the one node besides the head.
fn token_node(given: Option<&String>, plan: &Plan) -> anyhow::Result<String> {
    let others: Vec<&String> = plan
        .nodes
        .keys()
        .filter(|n| **n != plan.head_node)
        .collect();
    match (given, others.as_slice()) {
        (Some(n), _) if others.contains(&n) => Ok(n.clone()),
        (None, [only]) => Ok((*only).clone()),
        (given, _) => {
            let names: Vec<&str> = others.iter().map(|n| n.as_str()).collect();
            Err(ExitError::usage(format!(
                "{}; name the node the token is for with --node ({})",
                match given {
                    Some(n) => format!("`{n}` is no node of cluster {} but the head", plan.cluster),
                    None => format!(
                        "cluster {} has several nodes besides the head",
                        plan.cluster
                    ),
                },
                names.join(", ")
            )))
        }
    }
}

/// `pdctl join-token --list`.
fn print_book(book: &Book) {
    let now = now_s();
    let date = |s: u64| {
        let (y, m, d) = crate::control::tls::ymd(s);
        format!("{y:04}-{m:02}-{d:02}")
    };
    println!("join tokens:");
    if book.tokens.is_empty() {
        println!("  none");
    }
    for t in &book.tokens {
        println!(
            "  {}  node {}  {}  expires {} (UTC)",
            t.id,
            t.node,
            t.state(now),
            date(t.expires_s)
        );
    }
    println!(
        "node certificates (the head accepts only these; `join` and `renew` ones are renewed at every `up` of the head, every node's within 30 days of its expiry, while the node runs):"
    );
    for (node, i) in &book.issued {
        println!(
            "  {node}  serial {}  from {}  issued {}  expires {} (UTC)",
            i.serial,
            i.how,
            date(i.issued_s),
            date(i.not_after_s)
        );
    }
    if let Some(next) = &book.head_next {
        println!(
            "the head's next certificate (staged, put to use at the head's next `up`): serial {}  expires {} (UTC)",
            next.serial,
            date(next.not_after_s)
        );
    }
}

/// The secret a detached supervisor reads from its state dir.
pub fn kept(state: &StateDir) -> anyhow::Result<Option<ClusterSecret>> {
    Ok(ClusterSecret::read(&state.dir.join(SECRET_FILE))?)
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
    let head = super::common::read_plan(&state.plan_path())
        .map(|p| p.head_node)
        .unwrap_or_default();
    if !a.engine_key && found.node != head && !head.is_empty() {
        return Err(ExitError::usage(format!(
            "node {} of cluster {} holds no cluster secret: it lives on the head ({head}); run `pdctl secret` there (`pdctl secret --engine-key` here prints the engines' key)",
            found.node, found.cluster
        )));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ttl_reads_units_spans_and_bare_seconds() {
        assert_eq!(parse_ttl("90s"), Ok(90));
        assert_eq!(parse_ttl("30m"), Ok(1800));
        assert_eq!(parse_ttl("1h"), Ok(3600));
        assert_eq!(parse_ttl("2d"), Ok(172_800));
        assert_eq!(parse_ttl("1h30m"), Ok(5400));
        assert_eq!(parse_ttl(" 600 "), Ok(600));
    }

    #[test]
    fn a_bad_ttl_says_what_to_write() {
        for bad in ["", "soon", "5x", "-3s", "99999999999999999999999"] {
            let e = parse_ttl(bad).unwrap_err();
            assert!(matches!(e, TtlError::NoDuration { .. }), "{bad}: {e:?}");
            assert!(e.to_string().contains("write 90s, 30m, 1h"), "{e}");
        }
        assert_eq!(parse_ttl("0"), Err(TtlError::Zero("0".into())));
        assert_eq!(parse_ttl("500ms"), Err(TtlError::Zero("500ms".into())));
    }
}
