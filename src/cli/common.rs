//! What several commands share: the arguments of those that read a topology (`plan`,
//! `up`; the path from them to a plan is `plan::resolve`) and of those that act on a
//! running cluster, and finding that cluster.

use crate::plan::resolve::Request;
pub use crate::plan::resolve::state_root;
use clap::Args;
use std::path::PathBuf;

/// `--state-dir` / `PDCTL_STATE_DIR` made absolute where it is read: the supervisor,
/// the plans it makes again (`scale`, `apply`) and the services it starts (each in its
/// own working directory) all name files by it, so a relative one would mean something
/// else to each.
pub fn absolute_dir(given: &str) -> Result<PathBuf, String> {
    if given.is_empty() {
        return Err("an empty path is no state directory".into());
    }
    std::path::absolute(given).map_err(|e| format!("cannot make {given} an absolute path: {e}"))
}

/// Which cluster a command acts on.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// The cluster to act on (needed when several run under the state root).
    #[arg(long)]
    pub cluster: Option<String>,
    /// State root holding one directory per cluster.
    #[arg(long, env = "PDCTL_STATE_DIR", value_parser = absolute_dir)]
    pub state_dir: Option<PathBuf>,
}

/// The running cluster a command acts on.
pub struct Found {
    pub cluster: String,
    pub node: String,
    pub dir: PathBuf,
    pub socket: PathBuf,
}

/// The cluster running under the state root (`cluster` names it when several run); exit
/// 3 with `nothing to VERB` when none does.
pub fn running(
    state_dir: &Option<PathBuf>,
    cluster: Option<&str>,
    verb: &str,
) -> anyhow::Result<Found> {
    let root = state_root(state_dir.as_deref())?;
    let Some(found) = crate::supervisor::select::running(&root, cluster)? else {
        return Err(super::ExitError::nothing_running(format!(
            "no cluster{} is running under {}; nothing to {verb} (`pdctl up` starts one)",
            cluster.map(|c| format!(" {c}")).unwrap_or_default(),
            root.display()
        )));
    };
    let record = found
        .record
        .clone()
        .expect("running clusters have a record");
    Ok(Found {
        cluster: record.cluster.clone(),
        node: record.node.clone(),
        dir: found.state.dir.clone(),
        socket: found.state.socket_path(),
    })
}

/// Sends `change` to the supervisor of `found` and prints its progress as it comes (the
/// change goes on if this process is killed); the exit code it ended with, and whether
/// it was refused for want of a down and up.
pub fn change(
    found: &Found,
    change: crate::control::operation::ChangeRequest,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<crate::control::client::ChangeEnd> {
    let end = rt.block_on(crate::ops::request(&found.socket, change, |line, error| {
        if error {
            eprintln!("pdctl: {line}");
        } else if line.starts_with("  ") {
            println!("{line}");
        } else {
            println!("pdctl: {line}");
        }
    }))?;
    for (i, line) in end.message.lines().enumerate() {
        let prefix = if i == 0 { "pdctl: " } else { "" };
        if end.code == 0 {
            println!("{prefix}{line}");
        } else {
            eprintln!("{prefix}{line}");
        }
    }
    Ok(end)
}

/// Where the topology comes from and what this machine contributes to it.
#[derive(Debug, Clone, Default, Args)]
pub struct TopologyArgs {
    /// Topology file (default: ./pdctl.toml if present, else a built-in profile).
    #[arg(short = 'f', long = "file", conflicts_with = "profile")]
    pub file: Option<PathBuf>,
    /// Built-in profile name (`pdctl profiles` lists them).
    #[arg(short = 'p', long = "profile")]
    pub profile: Option<String>,
    /// Only this node's services (for clusters spread over machines).
    #[arg(long)]
    pub node: Option<String>,
    /// GPUs to plan with, instead of asking NVML (e.g. 0,1,2,3); `0:80GiB` also gives the
    /// memory to plan with (engines sharing that GPU get their KV cache size from it).
    #[arg(long, env = "PDCTL_GPUS", value_delimiter = ',')]
    pub gpus: Option<Vec<crate::gpu::Declared>>,
    /// State root holding one directory per running cluster
    /// (default: $XDG_STATE_HOME/pdctl, else ~/.local/state/pdctl).
    #[arg(long, env = "PDCTL_STATE_DIR", value_parser = absolute_dir)]
    pub state_dir: Option<PathBuf>,
}

impl TopologyArgs {
    /// The same arguments as the plan side's request.
    pub fn request(&self) -> Request {
        Request {
            file: self.file.clone(),
            profile: self.profile.clone(),
            node: self.node.clone(),
            gpus: self.gpus.clone(),
            state_dir: self.state_dir.clone(),
            held: Default::default(),
        }
    }
}

/// Reads a plan written as JSON (`--plan`, or plan.json in a state dir).
pub(super) fn read_plan(path: &std::path::Path) -> anyhow::Result<crate::plan::Plan> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        super::exit::ExitError::usage(format!("cannot read plan {}: {e}", path.display()))
    })?;
    serde_json::from_str(&text).map_err(|e| {
        super::exit::ExitError::usage(format!("plan {} is not a valid plan: {e}", path.display()))
    })
}
