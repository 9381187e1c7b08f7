//! `pdctl rebalance off|advise|act`: switches what the head's rebalancer does while the
//! cluster runs (a local request to the supervisor; the topology's `mode` holds again
//! when the supervisor restarts).

use super::common::{ClusterArgs, running};
use crate::control::{Request, Response, client};
use crate::vocab::RebalanceMode;
use clap::Args;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `pdctl rebalance`.
#[derive(Debug, Args)]
pub struct RebalanceArgs {
    /// off: judge nothing; advise: say what would move and why; act: move instances.
    #[arg(value_enum)]
    pub mode: RebalanceMode,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Sends the mode to the running cluster's supervisor and prints its answer.
pub fn rebalance(a: &RebalanceArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "rebalance")?;
    let request = Request::Rebalance { mode: a.mode };
    let answer = rt.block_on(client::send(
        &found.socket,
        &request,
        Duration::from_secs(10),
    ));
    match answer {
        Ok(Response::Done { message }) => {
            println!("pdctl: {message}");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Response::Error { message }) => anyhow::bail!(
            "the supervisor of cluster {} refused: {message}",
            found.cluster
        ),
        Ok(other) => anyhow::bail!("the supervisor answered {other:?}"),
        Err(e) => anyhow::bail!(
            "the supervisor of cluster {} does not answer: {e}",
            found.cluster
        ),
    }
}
