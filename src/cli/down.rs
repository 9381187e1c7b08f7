//! `pdctl down`: asks the running supervisor to stop everything and waits until it has
//! exited; a supervisor that does not answer is signalled, and a dead one's leftovers are
//! cleaned up.

use super::common::{ClusterArgs, state_root};
use crate::control::{Request, Response, client};
use crate::supervisor::{RunRecord, clean_if_stale, select};
use clap::Args;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Arguments of `pdctl down`.
#[derive(Debug, Args)]
pub struct DownArgs {
    /// Seconds each service gets to exit after its stop signal before SIGKILL.
    #[arg(short = 't', long = "timeout", default_value_t = 30)]
    pub timeout: u64,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl down`: stops the running cluster, or cleans up after a dead supervisor.
pub fn run(a: &DownArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let root = state_root(a.which.state_dir.as_deref())?;
    let cluster = a.which.cluster.as_deref();
    let mut out = std::io::stdout();
    let Some(found) = select::running(&root, cluster)? else {
        let mut cleaned_any = false;
        for f in select::stale(&root, cluster) {
            // Holding the lock proves no supervisor is about to use the dir.
            if let Ok(_lock) = f.state.lock() {
                // The cluster is down: a change its head left cut short is not taken up.
                let _ = std::fs::remove_file(f.state.journal_path());
                if let Some(c) = clean_if_stale(&f.state) {
                    let _ = writeln!(out, "pdctl: {}: {c}", f.label());
                    cleaned_any = true;
                }
            }
        }
        if !cleaned_any {
            let named = cluster.map(|c| format!(" named {c}")).unwrap_or_default();
            let _ = writeln!(
                out,
                "pdctl: no cluster{named} is running under {}; nothing to stop",
                root.display()
            );
        }
        return Ok(ExitCode::SUCCESS);
    };
    let record = found
        .record
        .clone()
        .expect("running clusters have a record");
    let request = Request::Down {
        timeout_s: a.timeout,
    };
    // Waves of services each get the timeout; allow for a few waves and the kill.
    let patience = Duration::from_secs(a.timeout.saturating_mul(6) + 30);
    let answer = rt.block_on(client::send(&found.state.socket_path(), &request, patience));
    match answer {
        Ok(Response::Done { message }) => {
            wait_exit(&record, Duration::from_secs(5));
            let _ = writeln!(out, "pdctl: {message}");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Response::Error { message }) => anyhow::bail!(
            "the supervisor of {} refused the down: {message}",
            found.label()
        ),
        Ok(other) => anyhow::bail!(
            "the supervisor of {} answered {other:?} instead of stopping",
            found.label()
        ),
        Err(e) => {
            let _ = writeln!(
                out,
                "pdctl: the supervisor (pid {}) does not answer ({e}); sending it SIGTERM",
                record.supervisor_pid
            );
            force_down(&found, &record, a.timeout);
            let _ = writeln!(out, "pdctl: cluster {} stopped", found.label());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Waits until the supervisor process of `record` has exited.
fn wait_exit(record: &RunRecord, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while record.supervisor_alive() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// A supervisor that does not answer on its socket: SIGTERM (it takes the cluster down
/// on that), SIGKILL if it is still there after the timeout, then clean its leftovers.
fn force_down(found: &select::Found, record: &RunRecord, timeout_s: u64) {
    use nix::sys::signal::{Signal, kill};
    let pid = nix::unistd::Pid::from_raw(record.supervisor_pid);
    let _ = kill(pid, Signal::SIGTERM);
    if !wait_exit(record, Duration::from_secs(timeout_s + 10)) {
        let _ = kill(pid, Signal::SIGKILL);
        wait_exit(record, Duration::from_secs(2));
    }
    if let Ok(_lock) = found.state.lock() {
        clean_if_stale(&found.state);
    }
}
