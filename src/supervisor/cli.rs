//! `pdctl up / down / status / logs` and the hidden `supervise`.

use clap::Args;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub topology: crate::cli::common::TopologyArgs,
}
#[derive(Debug, Args)]
pub struct DownArgs {}
#[derive(Debug, Args)]
pub struct StatusArgs {}
#[derive(Debug, Args)]
pub struct LogsArgs {}
#[derive(Debug, Args)]
pub struct SuperviseArgs {}

pub fn up(_a: UpArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn down(_a: DownArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn status(_a: StatusArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn logs(_a: LogsArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn supervise(_a: SuperviseArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
