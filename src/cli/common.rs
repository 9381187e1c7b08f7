//! Arguments shared by the commands that read a topology (`plan`, `up`), and the one
//! path from those arguments to a plan.

use clap::Args;
use std::path::PathBuf;

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
    /// GPU indices to plan with, instead of asking NVML (e.g. 0,1,2,3).
    #[arg(long, env = "PDCTL_GPUS", value_delimiter = ',')]
    pub gpus: Option<Vec<u32>>,
    /// State root holding one directory per running cluster
    /// (default: $XDG_STATE_HOME/pdctl, else ~/.local/state/pdctl).
    #[arg(long, env = "PDCTL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
}

/// The state root: the given one, else `$XDG_STATE_HOME/pdctl`, else `~/.local/state/pdctl`.
/// A cluster's own state dir is `<root>/<cluster>` (`<root>/<cluster>-<node>` when the
/// topology spans several nodes, so two nodes on one host never share a lock).
pub fn state_root(given: Option<&std::path::Path>) -> PathBuf {
    if let Some(p) = given {
        return p.to_path_buf();
    }
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("pdctl");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".local/state/pdctl")
}

/// A plan ready to run, with a sentence saying where its topology came from.
#[derive(Debug, Clone)]
pub struct LoadedPlan {
    pub plan: crate::plan::Plan,
    /// e.g. "using profile sim-1p1d: no ./pdctl.toml and no GPU found".
    pub source_note: String,
}

/// Topology args -> topology -> GPU inventory and vLLM version -> plan, tools resolved.
pub fn load_plan(_args: &TopologyArgs) -> anyhow::Result<LoadedPlan> {
    anyhow::bail!("planning is not built yet")
}
