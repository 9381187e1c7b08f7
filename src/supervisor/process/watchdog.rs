//! The watchdog: one small `pdctl supervise --watchdog RUN_ID` process per supervisor
//! that outlives it on purpose, so a SIGKILLed supervisor leaves no orphans.
//!
//! `PR_SET_PDEATHSIG` only reaches a service's own process; vLLM forks engine processes
//! that would be re-parented and live on, holding GPUs. The watchdog reads a pipe whose
//! write end only the supervisor holds: end-of-file means the supervisor is gone, and the
//! watchdog then stops every process carrying the run marker in its environment (SIGTERM,
//! SIGKILL after a short grace). After a clean `down` it finds nothing and just exits.
//! One process per cluster rather than a shim per service keeps the services' pids real.

use crate::supervisor::process::procfs;
use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Grace between SIGTERM and SIGKILL after the supervisor died (the 2 s budget for "no
/// orphans" includes noticing and reaping).
pub const GRACE: Duration = Duration::from_millis(1000);

/// The supervisor's end of the watchdog: dropping it (or dying) releases the watchdog.
#[derive(Debug)]
pub struct Watchdog {
    _alive: OwnedFd,
}

impl Watchdog {
    /// Starts `pdctl supervise --watchdog RUN_ID` in its own process group (terminal
    /// signals meant for the supervisor must not reach it).
    pub fn spawn(run_id: &str) -> std::io::Result<Watchdog> {
        use std::os::unix::process::CommandExt;
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let exe = std::env::current_exe()?;
        // Not waited for: it outlives this process when that dies, which is its purpose.
        Command::new(exe)
            .args(["supervise", "--watchdog", run_id])
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_remove(procfs::RUN_MARKER_ENV)
            .process_group(0)
            .spawn()?;
        Ok(Watchdog { _alive: write })
    }
}

/// The watchdog process: waits for end-of-file on stdin, then stops the run's processes.
pub fn watch(run_id: &str) -> std::process::ExitCode {
    // A detached supervisor leads its own session, which this process shares: then the
    // session's members are the run's processes too (also those whose environment, and so
    // the run marker, was overwritten).
    let supervisor = nix::unistd::getppid().as_raw();
    let session = nix::unistd::getsid(None).map(|s| s.as_raw()).ok();
    let own_session = (session == Some(supervisor)).then_some(supervisor);
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin();
    // Nothing is ever written; read returns 0 when the supervisor's end closes.
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    stop_marked(run_id, own_session, GRACE);
    std::process::ExitCode::SUCCESS
}

/// The run's live processes: those marked with `run_id`, and the members of the dead
/// supervisor's own session when it had one.
fn run_processes(run_id: &str, session: Option<i32>) -> Vec<i32> {
    let mut pids = procfs::marked_processes(run_id);
    if let Some(leader) = session {
        for p in procfs::session_members(leader) {
            if !pids.contains(&p) {
                pids.push(p);
            }
        }
    }
    pids
}

/// SIGTERM to every process of the run (see [`run_processes`]), SIGKILL to those left
/// after `grace`. Returns how many were found.
pub fn stop_marked(run_id: &str, session: Option<i32>, grace: Duration) -> usize {
    let victims = run_processes(run_id, session);
    for &p in &victims {
        let _ = kill(Pid::from_raw(p), Signal::SIGTERM);
    }
    let end = Instant::now() + grace;
    while Instant::now() < end && !run_processes(run_id, session).is_empty() {
        std::thread::sleep(Duration::from_millis(25));
    }
    for p in run_processes(run_id, session) {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
    victims.len()
}
