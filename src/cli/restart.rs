//! `pdctl restart SERVICE|ROLE...`: restarts services of the running cluster (with their
//! `restart_with` companions), as `docker compose restart` does; `--drain` and
//! `--rolling` one at a time without failing a request. The head's supervisor carries it
//! out on whichever node runs each service (`crate::ops`).

use super::common::{ClusterArgs, change, running, state_root};
use crate::control::operation::{ChangeOptions, ChangeRequest};
use clap::Args;
use std::process::ExitCode;

/// Arguments of `pdctl restart`.
#[derive(Debug, Args)]
pub struct RestartArgs {
    /// Services (`decode-1`) or roles (`prefill`: every prefill instance) to restart; their
    /// `restart_with` companions are restarted with them.
    #[arg(required = true)]
    pub targets: Vec<String>,
    /// One at a time: take the service out of the proxy's routing, let its requests in
    /// flight finish (up to --timeout), restart it, and wait until it is healthy again
    /// before the next. New requests go to the other instances, or wait in the proxy
    /// while the only one restarts.
    #[arg(long)]
    pub drain: bool,
    /// `--drain` over every instance of one ROLE, one after another.
    #[arg(long, conflicts_with = "drain")]
    pub rolling: bool,
    /// Seconds a draining service's requests in flight get before it is restarted anyway.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Asks the running supervisor to restart each target; exit 1 when one was not, 2 when
/// the request was refused.
pub fn run(a: &RestartArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "restart")?;
    let request = ChangeRequest::Restart {
        targets: a.targets.clone(),
        drained: a.drain || a.rolling,
        rolling: a.rolling,
        how: ChangeOptions {
            dry_run: false,
            drain_timeout_s: a.timeout,
            state_root: state_root(a.which.state_dir.as_deref())?,
        },
    };
    let end = change(&found, request, &rt)?;
    Ok(ExitCode::from(end.code))
}
