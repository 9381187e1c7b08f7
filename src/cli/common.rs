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
    /// State dir (default: $XDG_STATE_HOME/pdctl/<cluster> or ~/.local/state/pdctl/<cluster>).
    #[arg(long, env = "PDCTL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
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
