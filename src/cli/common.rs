//! Arguments shared by the commands that read a topology (`plan`, `up`); the path from them
//! to a plan is `plan::resolve`.

use crate::plan::resolve::Request;
pub use crate::plan::resolve::state_root;
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

impl TopologyArgs {
    /// The same arguments as the plan side's request.
    pub fn request(&self) -> Request {
        Request {
            file: self.file.clone(),
            profile: self.profile.clone(),
            node: self.node.clone(),
            gpus: self.gpus.clone(),
            state_dir: self.state_dir.clone(),
        }
    }
}
