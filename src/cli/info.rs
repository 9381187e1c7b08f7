//! `pdctl plan`, `pdctl gpus`, `pdctl profiles`: commands that only look.

use super::common::TopologyArgs;
use clap::Args;
use std::process::ExitCode;

/// Arguments of `pdctl plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `pdctl gpus`.
#[derive(Debug, Args)]
pub struct GpusArgs {
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `pdctl profiles`.
#[derive(Debug, Args)]
pub struct ProfilesArgs {}

pub fn plan(_a: PlanArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn gpus(_a: GpusArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn profiles(_a: ProfilesArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
