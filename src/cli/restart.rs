//! `pdctl restart SERVICE|ROLE...`: restarts services of the running cluster (with their
//! `restart_with` companions), as `docker compose restart` does; `--drain` and
//! `--rolling` one at a time without failing a request. The head's supervisor carries it
//! out on whichever node runs each service (`crate::ops`).

use super::cluster::RestartArgs;
use super::common::{change, running, state_root};
use crate::control::operation::{ChangeOptions, ChangeRequest};
use std::process::ExitCode;

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
            state_root: state_root(a.which.state_dir.as_deref()),
        },
    };
    let end = change(&found, request, &rt)?;
    Ok(ExitCode::from(end.code))
}
