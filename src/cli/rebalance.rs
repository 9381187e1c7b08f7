//! `pdctl rebalance off|advise|act`: switches what the head's rebalancer does while the
//! cluster runs (a local request to the supervisor; the topology's `mode` holds again
//! when the supervisor restarts). `pdctl rebalance history` shows what it saw and did,
//! read from the state dir ([`super::rebalance_history`]).

use super::ExitError;
use super::common::{ClusterArgs, running};
use super::rebalance_history::{HistoryArgs, history};
use crate::control::{Request, Response, client};
use crate::vocab::RebalanceMode;
use clap::Args;
use std::process::ExitCode;
use std::time::Duration;

/// What `pdctl rebalance` is asked: a mode for the running rebalancer, or its history.
/// (Here and not in [`RebalanceMode`], which the topology and the control protocol carry:
/// `history` is no mode.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Verb {
    /// Judge nothing, say nothing.
    Off,
    /// Say what would move and why (supervisor log, `pdctl status`), change nothing.
    Advise,
    /// Move instances between the roles, as `pdctl scale` would.
    Act,
    /// Show the figures of each look and the moves, from the state dir (also after `down`).
    History,
}

impl Verb {
    /// The mode it switches to; None for `history`.
    fn mode(self) -> Option<RebalanceMode> {
        match self {
            Verb::Off => Some(RebalanceMode::Off),
            Verb::Advise => Some(RebalanceMode::Advise),
            Verb::Act => Some(RebalanceMode::Act),
            Verb::History => None,
        }
    }
}

/// Arguments of `pdctl rebalance`.
#[derive(Debug, Args)]
pub struct RebalanceArgs {
    /// off: judge nothing; advise: say what would move and why; act: move instances;
    /// history: the figures over time and the moves.
    #[arg(value_enum)]
    pub verb: Verb,
    #[command(flatten)]
    pub which: ClusterArgs,
    #[command(flatten)]
    pub history: HistoryArgs,
}

/// Sends the mode to the running cluster's supervisor and prints its answer, or shows
/// the history.
pub fn rebalance(a: &RebalanceArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let Some(mode) = a.verb.mode() else {
        return history(&a.which, &a.history);
    };
    if let Some(flag) = a.history.given() {
        return Err(ExitError::usage(format!(
            "{flag} goes with `pdctl rebalance history`, not with `pdctl rebalance {}`",
            mode.as_str()
        )));
    }
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "rebalance")?;
    let request = Request::Rebalance { mode };
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
