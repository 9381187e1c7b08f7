//! `pdctl up / down / status / logs` and the hidden `supervise`: argument parsing and
//! turning outcomes into exit codes (0 ok, 1 failure, 2 bad input, 3 nothing running).

use super::ExitError;
use super::common::{ClusterArgs, TopologyArgs, read_plan, state_root};
use super::detach::{self, LogSettings};
use super::{logs_cmd, view};
use crate::control::client;
use crate::plan::Plan;
use crate::plan::resolve::{LoadedPlan, Machine};
use crate::plan::source::ClusterSource;
use crate::supervisor::{self, ClusterLock, DEFAULT_KEEP, DEFAULT_MAX_BYTES, RunOptions, StateDir};
use crate::supervisor::{SupervisorError, select};
use crate::vocab::VersionSource;
use anyhow::Context;
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `pdctl up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Return once every service is healthy, leaving the supervisor running.
    #[arg(short = 'd', long)]
    pub detach: bool,
    /// Run this plan (JSON, as `pdctl plan --json` prints it) instead of a topology.
    #[arg(long, hide = true, conflicts_with_all = ["file", "profile"])]
    pub plan: Option<PathBuf>,
    /// Rotate a service's log file when it reaches this many bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_BYTES)]
    pub log_max_bytes: u64,
    /// Rotated log files kept per service.
    #[arg(long, default_value_t = DEFAULT_KEEP)]
    pub log_keep: u32,
    /// The cluster's secret (else `PDCTL_CLUSTER_SECRET`; the head makes one at its first
    /// `up`, and `pdctl secret` on the head prints it).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// On a node started by hand: the join token `pdctl join-token` on the head prints
    /// (else `PDCTL_JOIN_TOKEN`). Nodes with `ssh` in [nodes] need none: `pdctl up` on the
    /// head starts them.
    #[arg(long, value_name = "FILE")]
    pub join_token_file: Option<PathBuf>,
    /// What the head handed this node over SSH (`pdctl node-up`); never a flag.
    #[arg(skip)]
    pub handed: Option<Handed>,
}

/// The credentials the head hands a node it starts over SSH.
#[derive(Debug, Clone)]
pub struct Handed {
    pub creds: crate::control::tls::NodeCreds,
    pub engine_key: crate::control::auth::EngineKey,
    /// The proxy's client key, when the head's `up` has one.
    pub client_key: Option<crate::control::auth::ClientKey>,
    /// The values of the plan's secret variables (hub tokens), kept in the state dir.
    pub hidden_env: crate::vocab::HiddenEnv,
}

/// Arguments of `pdctl status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON: {"cluster", "services": [{"name", "role", "node", "pid", "state", ...}]}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Arguments of `pdctl ack-journal`.
#[derive(Debug, Args)]
pub struct AckJournalArgs {
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl ack-journal`: the user has seen that the head's change journal could not be read
/// (it was moved aside, the nodes reconciled with the plan): changes run again.
pub fn ack_journal(a: AckJournalArgs) -> anyhow::Result<ExitCode> {
    let found = super::common::running(
        &a.which.state_dir,
        a.which.cluster.as_deref(),
        "acknowledge a journal of",
    )?;
    match crate::ops::acknowledge_journal(&found.dir)? {
        Some(notice) => {
            println!("pdctl: acknowledged: {notice}");
            println!("pdctl: changes to cluster {} run again", found.cluster);
        }
        None => println!(
            "pdctl: cluster {} has no change journal set aside: nothing to acknowledge",
            found.cluster
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// Restarts services of the running cluster.
pub fn restart(a: super::restart::RestartArgs) -> anyhow::Result<ExitCode> {
    super::restart::run(&a, runtime()?)
}

/// Arguments of `pdctl logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// A role (`prefill`: every prefill instance) or one service (`prefill-2`); all
    /// services when left out.
    pub target: Option<String>,
    /// Keep printing new lines (across log rotation and restarts) until the cluster stops.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only the last N lines of each service.
    #[arg(short = 'n', long = "lines")]
    pub lines: Option<usize>,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Arguments of the hidden `pdctl supervise` (what `up -d` leaves running).
#[derive(Debug, Args)]
pub struct SuperviseArgs {
    /// The cluster's state dir, holding plan.json.
    #[arg(long, required_unless_present = "watchdog")]
    pub cluster_dir: Option<PathBuf>,
    #[arg(long)]
    pub node: Option<String>,
    /// Descriptor of the cluster lock inherited from `up -d`.
    #[arg(long)]
    pub lock_fd: Option<i32>,
    #[arg(long, default_value_t = DEFAULT_MAX_BYTES)]
    pub log_max_bytes: u64,
    #[arg(long, default_value_t = DEFAULT_KEEP)]
    pub log_keep: u32,
    /// Run as the watchdog of the run with this id (see the supervisor's process/watchdog.rs).
    #[arg(long)]
    pub watchdog: Option<String>,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// `up --plan FILE` (a node run from a plan: over SSH from the head, or by hand): the plan
/// read with its programs found here, its state dir locked, then the model it names
/// fetched where this node's engines lack it (the token comes with what the head handed,
/// else from an earlier `up`). A plan for an assumed vLLM can be read, not run.
fn from_plan_file(a: &UpArgs, path: &std::path::Path) -> anyhow::Result<crate::ops::up::Ready> {
    let mut plan = read_plan(path)?;
    let missing = crate::plan::resolve::resolve_programs(&mut plan);
    let node = a
        .topology
        .node
        .clone()
        .unwrap_or_else(|| plan.head_node.clone());
    refuse_assumed(&plan)?;
    runs_here(a, &mut plan, &node)?;
    let state = StateDir::new(&plan.state_dir);
    state.create()?;
    let lock = state.lock()?;
    let hidden = match &a.handed {
        Some(h) => h.hidden_env.clone(),
        None => crate::control::hidden_env::kept(&state.dir)?,
    };
    super::pull::fetch_planned(&plan, &node, &hidden, Some(shown(a, &plan.cluster, &state)))?;
    let loaded = LoadedPlan {
        plan,
        source_note: format!("using plan file {}", path.display()),
        missing,
        node,
        version_note: None,
        machine: Machine::new(a.topology.gpus.clone()),
        source: None,
        hidden_env: Default::default(),
    };
    Ok(crate::ops::up::Ready {
        loaded,
        state,
        lock,
    })
}

/// Refuses a plan made for a vLLM assumed because none was found.
fn refuse_assumed(plan: &Plan) -> anyhow::Result<()> {
    if plan.vllm_version_source == Some(VersionSource::Assumed) {
        return Err(ExitError::usage(format!(
            "the plan assumes vLLM {} because none was found when it was made; make it again where vLLM is installed, or with engine.vllm_version pinned",
            plan.vllm_version.as_deref().unwrap_or("?")
        )));
    }
    Ok(())
}

/// Where `up` keeps the model fetch's progress for `status` (and whether it hands it to
/// the head: a node the head started over SSH).
fn shown<'a>(a: &UpArgs, cluster: &'a str, state: &'a StateDir) -> super::pull::Shown<'a> {
    super::pull::Shown {
        cluster,
        state_dir: &state.dir,
        to_head: a.handed.is_some(),
    }
}

/// What `up` of a topology prints on its way, and its `apply` of a cluster running
/// already.
struct UpShell<'a>(&'a UpArgs);

impl crate::ops::up::UpSteps for UpShell<'_> {
    fn apply_to_running(&mut self, cluster: &str) -> anyhow::Result<ExitCode> {
        println!("pdctl: cluster {cluster} is running already: applying the topology to it");
        let apply = super::live::ApplyArgs {
            topology: self.0.topology.clone(),
            cluster: Some(cluster.to_string()),
            dry_run: false,
            timeout: super::live::DEFAULT_DRAIN_TIMEOUT_S,
            recreate: false,
        };
        Ok(match super::live::apply(&apply, &runtime()?)? {
            super::live::Applied::Code(code) => code,
            super::live::Applied::NeedsRecreate(_) => ExitCode::from(2),
        })
    }

    fn fetch(
        &mut self,
        source: &crate::model_fetch::Source,
        node: &str,
        cluster: &str,
        state: &StateDir,
    ) -> anyhow::Result<()> {
        super::pull::run_fetch(source, node, Some(shown(self.0, cluster, state)))
    }
}

/// Fails unless `node` is a node of the plan that runs some of its services; a plan file
/// run with `--state-dir` keeps its state under that root.
fn runs_here(a: &UpArgs, plan: &mut Plan, node: &str) -> anyhow::Result<()> {
    // A plan file (or one handed over ssh) skipped the topology's checks: its node names
    // become directory and certificate names, so they are checked again.
    for name in plan.nodes.keys() {
        if let Some(why) = crate::topology::node_name_problem(name) {
            return Err(ExitError::usage(format!(
                "the plan's node `{name}` cannot name a node: {why}; {}",
                crate::topology::NODE_NAME_RULE
            )));
        }
    }
    if !plan.nodes.contains_key(node) && !plan.services.iter().any(|s| s.node == node) {
        let known: Vec<&str> = plan.nodes.keys().map(String::as_str).collect();
        return Err(anyhow::Error::from(SupervisorError::UnknownNode {
            node: node.to_string(),
            known: known.join(", "),
        }));
    }
    if a.plan.is_some() {
        if let Some(root) = &a.topology.state_dir {
            plan.state_dir =
                crate::plan::build::state_dir_of(&plan.cluster, plan.nodes.len() > 1, root, node);
        }
    }
    if plan.local_services(node).next().is_none() {
        return Err(ExitError::usage(format!(
            "node `{node}` runs no service of cluster {}; the services are on {}",
            plan.cluster,
            plan.services
                .iter()
                .map(|s| s.node.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

/// `pdctl up`: the plan (a topology's made in one pass by [`crate::ops::up`], or a plan
/// file's), pre-flight, then supervise in the foreground or detached.
pub fn up(a: UpArgs) -> anyhow::Result<ExitCode> {
    supervisor::private_umask();
    let ready = match &a.plan {
        Some(path) => from_plan_file(&a, path)?,
        None => match crate::ops::up::prepare(&a.topology.request(), &mut UpShell(&a))? {
            crate::ops::up::Up::Applied(code) => return Ok(code),
            crate::ops::up::Up::Ready(mut ready) => {
                refuse_assumed(&ready.loaded.plan)?;
                runs_here(&a, &mut ready.loaded.plan, &ready.loaded.node)?;
                *ready
            }
        },
    };
    start(&a, ready)
}

/// `up` of a plan ready to run: its secret values kept, pre-flight, the plan written, the
/// nodes the head starts over SSH started, then this node's supervisor.
fn start(a: &UpArgs, ready: crate::ops::up::Ready) -> anyhow::Result<ExitCode> {
    let crate::ops::up::Ready {
        loaded,
        state,
        lock,
    } = ready;
    let LoadedPlan {
        plan,
        source_note: note,
        node,
        missing,
        machine,
        source,
        hidden_env,
        ..
    } = loaded;
    // The secret values the plan names only: from the topology, else from the head; a
    // plan file run by hand leaves what an earlier `up` kept.
    match (&a.plan, &a.handed) {
        (None, _) => crate::control::hidden_env::keep(&state.dir, &hidden_env)?,
        (Some(_), Some(h)) => crate::control::hidden_env::keep(&state.dir, &h.hidden_env)?,
        (Some(_), None) => {}
    }
    let mut out = std::io::stdout();
    if let Some(cleaned) = supervisor::clean_if_stale(&state) {
        let _ = writeln!(out, "pdctl: {cleaned}");
    }
    let problems = supervisor::preflight_check(&plan, &node, &missing, &machine, &state);
    if !problems.is_empty() {
        return Err(anyhow::Error::from(SupervisorError::Preflight(problems)));
    }
    // The head makes what others join with; a token means something elsewhere only.
    let creds = credentials(a, &plan, &node, &state)?;
    let ssh_of = match (&source, node == plan.head_node && a.handed.is_none()) {
        (Some(src), true) => src.topology()?.spec.ssh,
        _ => Default::default(),
    };
    let local = plan.local_services(&node).count();
    let _ = writeln!(
        out,
        "pdctl: cluster {} ({note}): {local} service(s) on node {node}, {} on other nodes; state in {}",
        plan.cluster,
        plan.services.len() - local,
        state.dir.display()
    );
    for w in &plan.warnings {
        let _ = writeln!(out, "pdctl: warning: {w}");
    }
    write_plan(&state, &plan, source)?;
    let logs = LogSettings {
        max_bytes: a.log_max_bytes,
        keep: a.log_keep,
    };
    let remote = std::sync::Arc::new(start_ssh_nodes(
        &plan,
        &state,
        &ssh_of,
        (creds.engine_key.as_ref(), creds.client_key.as_ref()),
        &hidden_env,
        logs,
    )?);
    let kept = (!remote.is_empty()).then(|| plan.clone());
    let code = launch(a, plan, node, state, lock, logs, creds, remote.clone());
    // A failed `up` leaves nothing running: the nodes it started over ssh go down too.
    if let Some(plan) = kept
        && !matches!(code, Ok(0))
    {
        for line in remote.take_down(&plan, Duration::from_secs(60)) {
            eprintln!("pdctl: {line}");
        }
    }
    code.map(ExitCode::from)
}

/// Writes the plan `up` runs into the state dir, and the topology it came from beside it
/// (what `scale` plans again from; a cluster started from a plan file has none).
fn write_plan(state: &StateDir, plan: &Plan, source: Option<ClusterSource>) -> anyhow::Result<()> {
    let json = serde_json::to_vec_pretty(plan).expect("plans serialize");
    supervisor::write_atomic(&state.plan_path(), &json)
        .with_context(|| format!("writing {}", state.plan_path().display()))?;
    let source_path = state.dir.join(crate::plan::source::SOURCE_FILE);
    let _ = std::fs::remove_file(&source_path);
    if let Some(source) = source {
        source.write(&state.dir)?;
    }
    Ok(())
}

/// What a node runs its cluster with (the secret stays in its state dir, where there is
/// one: a node the head started over SSH has none, it is handed the engines' key).
struct Credentials {
    engine_key: Option<crate::control::auth::EngineKey>,
    client_key: Option<crate::control::auth::ClientKey>,
    /// Its side of the channel between the supervisors (several nodes only).
    channel: Option<std::sync::Arc<crate::control::tls::PeerTls>>,
}

/// The secret, engine key and channel credentials `up` runs with: made or kept on the
/// head; handed over SSH, joined for with a token, or kept elsewhere.
fn credentials(
    a: &UpArgs,
    plan: &Plan,
    node: &str,
    state: &StateDir,
) -> anyhow::Result<Credentials> {
    use super::secret::Join;
    // The head makes what others join with; a token means something elsewhere only.
    let token = match node == plan.head_node {
        true => None,
        false => super::secret::token_for_up(a.join_token_file.as_deref())?,
    };
    // The secret stays on the head; a node elsewhere joins (or is handed what it needs)
    // before it has the engines' key.
    let secret = super::secret::for_up(plan, node, state, a.secret_file.as_deref())?;
    let join = match (a.handed.clone(), token) {
        (Some(h), _) => Join::Given(h.creds),
        (None, Some(t)) => Join::Token(t),
        (None, None) => Join::Kept,
    };
    let channel = super::secret::channel(plan, node, state, secret.as_ref(), join)?;
    let engine_key = match a.handed.as_ref().map(|h| h.engine_key.clone()) {
        Some(key) => {
            key.write(&state.dir.join(crate::control::auth::ENGINE_KEY_FILE))?;
            Some(key)
        }
        None => super::secret::engine_key_for_up(state, secret.as_ref(), node == plan.head_node)?,
    };
    let client_key = match &a.handed {
        Some(h) => super::secret::keep_client_key(state, h.client_key.clone())?,
        None => super::secret::client_key_for_up(state)?,
    };
    Ok(Credentials {
        engine_key,
        client_key,
        channel,
    })
}

/// Runs the supervisor, detached (returning once the start is decided, here and on the
/// nodes started over SSH) or in the foreground (taking those nodes down when it ends).
#[allow(clippy::too_many_arguments)]
fn launch(
    a: &UpArgs,
    plan: Plan,
    node: String,
    state: StateDir,
    lock: ClusterLock,
    logs: LogSettings,
    creds: Credentials,
    remote: std::sync::Arc<super::remote_up::RemoteNodes>,
) -> anyhow::Result<u8> {
    if a.detach {
        let mut child = detach::spawn_supervisor(&state, &node, lock, logs)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let failed = || remote.failure();
        let code = rt.block_on(detach::wait_for_start(&mut child, &state, &plan, &failed));
        let limit = if code == 0 { 60 } else { 2 };
        remote.finish(Duration::from_secs(limit));
        return Ok(code);
    }
    if !remote.is_empty() {
        let watch = remote.clone();
        std::thread::spawn(move || watch.finish(Duration::from_secs(3600)));
    }
    let ops = operations(&plan, &node, &state, creds.channel.clone());
    let opts = RunOptions {
        operations: ops.clone(),
        node,
        foreground: true,
        log_max_bytes: logs.max_bytes,
        log_keep: logs.keep,
        healthy_text: Some(view::healthy_text),
        channel: creds.channel,
        engine_key: creds.engine_key,
        client_key: creds.client_key,
    };
    let rt = runtime()?;
    let key = (opts.client_key.as_ref(), opts.engine_key.as_ref());
    if let Some(line) = super::dashboard::start(&rt, &plan, &opts.node, &state, key.0, key.1) {
        super::dashboard::keep_foreground_line(line);
    }
    let code = rt.block_on(supervisor::run(plan, state, lock, opts))?;
    // The nodes this `up` started go down with it.
    if let (false, Some(ops)) = (remote.is_empty(), ops) {
        for line in rt.block_on(ops.down_others(30)) {
            println!("pdctl: {line}");
        }
    }
    Ok(code)
}

/// On the head: starts the nodes `[nodes]` gives `ssh` (none elsewhere).
fn start_ssh_nodes(
    plan: &Plan,
    state: &StateDir,
    ssh_of: &std::collections::BTreeMap<String, String>,
    (engine_key, client_key): (
        Option<&crate::control::auth::EngineKey>,
        Option<&crate::control::auth::ClientKey>,
    ),
    hidden_env: &crate::vocab::HiddenEnv,
    logs: LogSettings,
) -> anyhow::Result<super::remote_up::RemoteNodes> {
    use crate::control::tls::{ClusterCa, TLS_DIR};
    let (Some(engine_key), false) = (engine_key, ssh_of.is_empty()) else {
        return Ok(Default::default());
    };
    let Some(ca) = ClusterCa::load(&state.dir.join(TLS_DIR), &plan.cluster)? else {
        return Ok(Default::default());
    };
    let handout = super::remote_up::Handout {
        plan,
        state_dir: &state.dir,
        ca: &ca,
        engine_key,
        client_key,
        log_max_bytes: logs.max_bytes,
        log_keep: logs.keep,
        hidden_env,
    };
    super::remote_up::RemoteNodes::start(ssh_of, &handout)
}

/// `pdctl node-up`: what `pdctl up` on the head runs on a node over SSH. Reads the plan,
/// the node's certificate and key and the engines' key from stdin, keeps them in the
/// node's state dir (mode 0600), then does what `up -d --node NODE` does.
pub fn node_up() -> anyhow::Result<ExitCode> {
    use crate::control::auth::EngineKey;
    supervisor::private_umask();
    let b = super::remote_up::read_bundle(std::io::stdin().lock())?;
    if let Some(why) = crate::topology::node_name_problem(&b.node) {
        return Err(ExitError::usage(format!(
            "node-up: `{}` cannot name a node: {why}",
            b.node
        )));
    }
    let given = std::env::var_os("PDCTL_STATE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let root = state_root(given.as_deref())?;
    let dir =
        crate::plan::build::state_dir_of(&b.plan.cluster, b.plan.nodes.len() > 1, &root, &b.node);
    let state = StateDir::new(&dir);
    state.create()?;
    let engine_key =
        EngineKey::from_text(&b.engine_key, "the head").map_err(|e| anyhow::anyhow!("{e}"))?;
    let client_key = match &b.client_key {
        Some(k) => Some(
            crate::control::auth::ClientKey::from_text(k, "the head")
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        ),
        None => None,
    };
    let plan_file = state.dir.join("plan.handed.json");
    let json = serde_json::to_vec_pretty(&b.plan).expect("plans serialize");
    supervisor::write_atomic(&plan_file, &json)
        .with_context(|| format!("writing {}", plan_file.display()))?;
    up(UpArgs {
        topology: super::common::TopologyArgs {
            node: Some(b.node.clone()),
            state_dir: Some(root),
            ..Default::default()
        },
        detach: true,
        plan: Some(plan_file),
        log_max_bytes: b.log_max_bytes,
        log_keep: b.log_keep,
        secret_file: None,
        join_token_file: None,
        handed: Some(Handed {
            creds: b.creds,
            engine_key,
            client_key,
            hidden_env: b.hidden_env,
        }),
    })
}

/// `pdctl apply`: the change made live by the running supervisor; with `--recreate`, one
/// that cannot be made live is made by taking the cluster down and up again.
pub fn apply(a: super::live::ApplyArgs) -> anyhow::Result<ExitCode> {
    let rt = runtime()?;
    let found = match super::live::apply(&a, &rt)? {
        super::live::Applied::Code(code) => return Ok(code),
        super::live::Applied::NeedsRecreate(found) => found,
    };
    println!(
        "pdctl: --recreate: taking cluster {} down and starting it again from the topology (requests in flight are cut)",
        found.cluster
    );
    let down = super::down::DownArgs {
        timeout: 30,
        which: ClusterArgs {
            cluster: Some(found.cluster.clone()),
            state_dir: a.topology.state_dir.clone(),
        },
    };
    let code = super::down::run(&down, rt)?;
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    up(UpArgs {
        topology: a.topology.clone(),
        detach: true,
        plan: None,
        log_max_bytes: crate::supervisor::DEFAULT_MAX_BYTES,
        log_keep: crate::supervisor::DEFAULT_KEEP,
        secret_file: None,
        join_token_file: None,
        handed: None,
    })
}

/// `pdctl down`: stop the running cluster, or clean up after a dead supervisor.
pub fn down(a: super::down::DownArgs) -> anyhow::Result<ExitCode> {
    super::down::run(&a, runtime()?)
}

/// `pdctl status`: the table or JSON; exit 0 all healthy, 1 otherwise, 3 nothing runs.
pub fn status(a: StatusArgs) -> anyhow::Result<ExitCode> {
    let root = state_root(a.which.state_dir.as_deref())?;
    let Some(found) = select::running(&root, a.which.cluster.as_deref())? else {
        return nothing_running(&a, &root);
    };
    let rt = runtime()?;
    let socket = found.state.socket_path();
    let report = rt
        .block_on(client::status(&socket, Duration::from_secs(5)))
        .with_context(|| format!("asking the supervisor of {} for its status", found.label()))?;
    let mut out = std::io::stdout();
    // Other nodes' model fetches the head's `up` relays (their services wait for them).
    let fetches = super::pull::nodes_fetching(&found.state.dir);
    if a.json {
        let mut doc = serde_json::to_value(&report).expect("reports serialize");
        if !fetches.is_empty() {
            doc["fetching"] = serde_json::to_value(&fetches).expect("fetch states serialize");
        }
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).expect("reports serialize")
        );
    } else {
        let plan = read_plan(&found.state.plan_path()).ok();
        let line = match &plan {
            Some(p) if report.node == p.head_node => rt.block_on(super::dashboard::line(p)),
            _ => None,
        };
        let table = view::status_table(&report);
        let _ = write!(
            out,
            "{}",
            super::dashboard::after_table(&table, line.as_deref())
        );
        for f in &fetches {
            let _ = writeln!(
                out,
                "node {}: {} ({}); its services start once it is there",
                f.node, f.text, f.model
            );
        }
        if let Some(url) = &report.proxy_url {
            if let Some(figures) = rt.block_on(view::scrape_proxy(url)) {
                let _ = writeln!(out, "{figures}");
            }
        }
    }
    Ok(if report.all_healthy() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `status` where no supervisor runs: the fetch an `up` is making before it starts one
/// (exit code 1), else what is not running and what a dead supervisor left behind.
fn nothing_running(a: &StatusArgs, root: &std::path::Path) -> anyhow::Result<ExitCode> {
    // No supervisor yet: an `up` may be fetching the model before starting one.
    if let Some(f) = super::pull::fetching(root, a.which.cluster.as_deref()) {
        let mut out = std::io::stdout();
        if a.json {
            let doc = serde_json::json!({
                "cluster": f.cluster,
                "step": f,
                "services": [],
            });
            let _ = writeln!(out, "{}", serde_json::to_string_pretty(&doc).expect("json"));
        } else {
            let _ = writeln!(
                out,
                "cluster {} (node {}): {} ({}); no service started yet (pdctl up, pid {})",
                f.cluster, f.node, f.text, f.model, f.pid
            );
        }
        return Ok(ExitCode::from(1));
    }
    let mut msg = match a.which.cluster.as_deref() {
        Some(c) => format!("cluster {c} is not running under {}", root.display()),
        None => format!("no cluster is running under {}", root.display()),
    };
    for f in select::stale(root, a.which.cluster.as_deref()) {
        msg.push_str(&format!(
            "\n  {} was left behind by a supervisor that died; `pdctl down` or `pdctl up` cleans it up",
            f.label()
        ));
    }
    Err(ExitError::nothing_running(msg))
}

/// The services of other nodes whose logs can be read here: on the head of a running
/// cluster only (only the head may ask a node for its logs, through the channel).
fn remote_services(found: &select::Found, rt: &tokio::runtime::Runtime) -> Vec<String> {
    let head = read_plan(&found.state.plan_path())
        .map(|p| p.head_node)
        .ok();
    if !found.running {
        return Vec::new();
    }
    rt.block_on(client::status(
        &found.state.socket_path(),
        Duration::from_secs(5),
    ))
    .ok()
    .filter(|r| head.as_deref() == Some(r.node.as_str()))
    .map(|r| {
        r.services
            .into_iter()
            .filter(|s| s.remote)
            .map(|s| s.name)
            .collect()
    })
    .unwrap_or_default()
}

/// `pdctl logs`: history of one service or a role's instances, optionally followed.
pub fn logs(a: LogsArgs) -> anyhow::Result<ExitCode> {
    let root = state_root(a.which.state_dir.as_deref())?;
    let Some(found) = select::with_logs(&root, a.which.cluster.as_deref())? else {
        return Err(ExitError::nothing_running(format!(
            "no cluster has logs under {}",
            root.display()
        )));
    };
    let mut names = logs_cmd::services_with_logs(&found.state.logs_dir());
    // On the head, services of other nodes: their logs are there, read through the
    // channel (only the head may ask a node for its logs).
    let socket = found.state.socket_path();
    let rt = runtime()?;
    let remote = remote_services(&found, &rt);
    names.extend(
        remote
            .iter()
            .filter(|r| !names.contains(r))
            .cloned()
            .collect::<Vec<_>>(),
    );
    names.sort();
    let chosen = logs_cmd::resolve(&names, a.target.as_deref())
        .map_err(|e| ExitError::usage(format!("{e} (cluster {})", found.label())))?;
    let by_name = a
        .target
        .as_deref()
        .is_some_and(|t| names.iter().any(|n| n == t));
    let printer = logs_cmd::Printer::new(&chosen, by_name);
    let (far, near): (Vec<&String>, Vec<&String>) = chosen.iter().partition(|n| remote.contains(n));
    if a.follow && found.running && far.is_empty() {
        let targets: Vec<(String, PathBuf)> = near
            .iter()
            .map(|n| (n.to_string(), found.state.log_path(n)))
            .collect();
        let record = found
            .record
            .clone()
            .expect("running clusters have a record");
        logs_cmd::follow(&targets, a.lines, &printer, || record.supervisor_alive());
        return Ok(ExitCode::SUCCESS);
    }
    if a.follow && !far.is_empty() {
        eprintln!(
            "pdctl: -f follows the logs of this node's services only; the lines of {} so far:",
            far.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut stdout = std::io::stdout();
    for (i, name) in chosen.iter().enumerate() {
        let lines = if remote.contains(name) {
            let n = a.lines.unwrap_or(REMOTE_LOG_LINES);
            let to = client::Endpoint::Unix(socket.clone());
            rt.block_on(client::logs_at(&to, name, n, Duration::from_secs(15)))
                .unwrap_or_else(|e| vec![format!("[pdctl] {e}")])
        } else {
            logs_cmd::history(&found.state.log_path(name), a.lines)
        };
        if !printer.print(&mut stdout, i, name, &lines) {
            break;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Lines of a service on another node shown when `-n` is not given.
const REMOTE_LOG_LINES: usize = 1000;

/// The operations engine of the head node's supervisor (changes to the whole cluster are
/// carried out there); None on the other nodes.
fn operations(
    plan: &Plan,
    node: &str,
    state: &StateDir,
    channel: Option<std::sync::Arc<crate::control::tls::PeerTls>>,
) -> Option<std::sync::Arc<dyn supervisor::Operations>> {
    (node == plan.head_node).then(|| {
        let engine =
            crate::ops::Engine::new(plan, node, state.socket_path(), state.dir.clone(), channel);
        std::sync::Arc::new(engine) as std::sync::Arc<dyn supervisor::Operations>
    })
}

/// `pdctl supervise`: the detached supervisor (or, with --watchdog, its watchdog).
pub fn supervise(a: SuperviseArgs) -> anyhow::Result<ExitCode> {
    if let Some(run_id) = &a.watchdog {
        return Ok(supervisor::run_watchdog(run_id));
    }
    supervisor::private_umask();
    let dir = a.cluster_dir.clone().context("--cluster-dir is required")?;
    let state = StateDir::new(dir);
    let plan = read_plan(&state.plan_path())?;
    let lock = match a.lock_fd {
        // SAFETY: `up -d` passes the descriptor of the lock it holds, for us to own.
        Some(fd) => unsafe { ClusterLock::adopt(fd, state.lock_path()) }?,
        None => state.lock()?,
    };
    let node = a.node.clone().unwrap_or_else(|| plan.head_node.clone());
    let secret = super::secret::kept(&state)?;
    let engine_key = super::secret::kept_engine_key(&state)?;
    let client_key = super::secret::kept_client_key(&state)?;
    let channel = super::secret::channel(
        &plan,
        &node,
        &state,
        secret.as_ref(),
        super::secret::Join::Kept,
    )?;
    let opts = RunOptions {
        operations: operations(&plan, &node, &state, channel.clone()),
        node,
        foreground: false,
        log_max_bytes: a.log_max_bytes,
        log_keep: a.log_keep,
        healthy_text: None,
        channel,
        engine_key,
        client_key,
    };
    let rt = runtime()?;
    let keys = (opts.client_key.as_ref(), opts.engine_key.as_ref());
    if let Some(line) = super::dashboard::start(&rt, &plan, &opts.node, &state, keys.0, keys.1) {
        // The detached supervisor's output is its log: the line says where, or why not.
        println!("pdctl: {line}");
    }
    let code = rt.block_on(supervisor::run(plan, state, lock, opts))?;
    Ok(ExitCode::from(code))
}
