//! Cleaning up after a supervisor that died without taking its cluster down (SIGKILL,
//! OOM, power to the terminal cut): kill whatever it left running, remove its runtime files.

use crate::supervisor::process::procfs;
use crate::supervisor::state_dir::state::{RunRecord, StateDir, read_record};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// What a stale-state cleanup found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleCleanup {
    /// The dead supervisor's pid.
    pub supervisor_pid: i32,
    /// Processes of that run still alive and killed now.
    pub killed: Vec<i32>,
}

impl std::fmt::Display for StaleCleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cleaned up after a supervisor (pid {}) that died without `pdctl down`",
            self.supervisor_pid
        )?;
        if self.killed.is_empty() {
            write!(f, "; none of its processes were left")
        } else {
            write!(
                f,
                "; killed {} leftover process(es): {}",
                self.killed.len(),
                self.killed
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    }
}

/// If the state dir holds the record of a supervisor that is gone, kills its leftovers
/// and removes the runtime files. `None` when there is no record or its supervisor lives
/// (callers hold the cluster lock, so a live one means a race they report themselves).
pub fn clean_if_stale(state: &StateDir) -> Option<StaleCleanup> {
    let record = match read_record(state) {
        Ok(Some(r)) => r,
        Ok(None) => return None,
        Err(e) => {
            // An unreadable record cannot name processes; the marker scan cannot run either.
            tracing::warn!("{e}; removing it");
            state.remove_runtime();
            return None;
        }
    };
    if record.supervisor_alive() {
        return None;
    }
    let killed = kill_leftovers(&record);
    state.remove_runtime();
    Some(StaleCleanup {
        supervisor_pid: record.supervisor_pid,
        killed,
    })
}

/// Kills (SIGKILL: their supervisor is dead, nobody is waiting for a graceful exit) every
/// process of `record`'s run: the recorded process groups whose leader is still the same
/// process, and every process carrying the run marker (children that left their group
/// too). Returns the pids that were alive. Waits (at most 2 s) until they are gone.
pub fn kill_leftovers(record: &RunRecord) -> Vec<i32> {
    let victims = leftover_pids(record);
    if victims.is_empty() {
        return victims;
    }
    signal_all(&victims, Signal::SIGKILL);
    wait_gone(&victims, Duration::from_secs(2));
    victims
}

/// Pids still alive that belong to the run described by `record`.
pub fn leftover_pids(record: &RunRecord) -> Vec<i32> {
    let mut pids = procfs::marked_processes(&record.run_id);
    // A detached supervisor led its own session; with it dead, what is left in that
    // session is the run's (also processes that overwrote their environment).
    for p in procfs::session_members(record.supervisor_pid) {
        if !pids.contains(&p) {
            pids.push(p);
        }
    }
    for child in record.children.values() {
        if procfs::is_same_process_alive(child.pid, child.start_ticks) && !pids.contains(&child.pid)
        {
            pids.push(child.pid);
        }
    }
    pids.sort_unstable();
    pids
}

fn signal_all(pids: &[i32], sig: Signal) {
    for &pid in pids {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// Waits until none of `pids` is a live process, or `limit` passes.
fn wait_gone(pids: &[i32], limit: Duration) {
    let end = Instant::now() + limit;
    loop {
        let alive = pids
            .iter()
            .any(|&p| procfs::process(p).is_some_and(|i| !i.is_zombie()));
        if !alive || Instant::now() >= end {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::state_dir::state::RecordWriter;

    /// A state directory of its own, created, removed with the returned guard.
    fn fresh_state() -> (tempfile::TempDir, StateDir) {
        let dir = tempfile::Builder::new()
            .prefix("pdctl-stale-")
            .tempdir()
            .unwrap();
        let state = StateDir::new(dir.path());
        state.create().unwrap();
        (dir, state)
    }

    #[test]
    fn a_dead_supervisors_marked_processes_are_killed_and_files_removed() {
        let (_dir, state) = fresh_state();
        let mut rec = RunRecord::new_for_this_process("c", "main");
        // A supervisor pid that cannot be alive with this start time.
        rec.supervisor_start_ticks += 12345;
        let mut orphan = std::process::Command::new("sleep")
            .arg("30")
            .env(procfs::RUN_MARKER_ENV, &rec.run_id)
            .spawn()
            .unwrap();
        let w = RecordWriter::create(&state, rec).unwrap();
        w.child_started("engine", orphan.id() as i32);
        std::fs::write(state.socket_path(), "").unwrap();

        let done = clean_if_stale(&state).expect("stale state found");
        let status = orphan.wait().unwrap();
        assert_eq!(done.killed, vec![orphan.id() as i32]);
        assert!(!status.success());
        assert!(!state.record_path().exists() && !state.socket_path().exists());
        assert!(done.to_string().contains("killed 1 leftover"));
    }

    #[test]
    fn a_live_supervisor_is_not_stale() {
        let (_dir, state) = fresh_state();
        let _w = RecordWriter::create(&state, RunRecord::new_for_this_process("c", "n")).unwrap();
        assert_eq!(clean_if_stale(&state), None);
        assert!(state.record_path().exists());
    }
}
