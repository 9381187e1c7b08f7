//! Which run of its engine an instance is: what outlives a run (a NIXL handshake, made
//! lazily and kept by the two processes) is valid only while both engines keep the run
//! it was made with. An instance that leaves rotation and comes back has not always
//! restarted: a busy engine whose probes timed out, or a leg whose connect timed out in a
//! freeze, is the same process afterwards. So the run changes on evidence of a new
//! process only: the supervisor reports another pid or restart count, or a connection was
//! refused (nothing listens: the process is gone).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts the changes to what routing chooses from: an engine's new run, an instance
/// going in or out of rotation, an instance joining or leaving, a pair's warm-up state.
/// The ready-pair index (`warmup::ReadyIndex`) is rebuilt when it moves, so a request
/// reads a prepared list instead of looking every pair over. One count for the process:
/// a change anywhere only costs the other proxies of the process a rebuild.
static ROUTING_EPOCH: AtomicU64 = AtomicU64::new(0);

/// Says that what routing chooses from changed (after the change is stored).
pub fn routing_changed() {
    ROUTING_EPOCH.fetch_add(1, Ordering::Release);
}

/// The current count of [`routing_changed`] calls: a list built after reading it holds
/// at least every change counted so far.
pub fn routing_epoch() -> u64 {
    ROUTING_EPOCH.load(Ordering::Acquire)
}

/// An instance's engine run, as a number that changes with each new run seen.
#[derive(Debug, Default)]
pub struct EngineRun {
    generation: AtomicU64,
    /// The last (pid, restarts) a supervisor reported, once it reported a pid.
    reported: Mutex<Option<(u32, u32)>>,
}

impl EngineRun {
    /// The current run's number (0 until a new run is seen).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Follows a supervisor's report of the service: a pid or restart count other than the
    /// last reported is a new run (true). No pid (not running now) says nothing: the next
    /// run's pid will.
    pub fn follow_report(&self, pid: Option<u32>, restarts: u32) -> bool {
        let Some(pid) = pid else {
            return false;
        };
        let mut last = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        let changed = last.is_some_and(|seen| seen != (pid, restarts));
        *last = Some((pid, restarts));
        if changed {
            self.generation.fetch_add(1, Ordering::Relaxed);
            routing_changed();
        }
        changed
    }

    /// Records that the engine's process is gone (it refused a connection): whatever
    /// answers there next is a new run.
    pub fn ended(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
        routing_changed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_pid_or_restart_is_a_new_run_and_a_pause_in_reports_is_not() {
        let run = EngineRun::default();
        assert!(
            !run.follow_report(Some(100), 0),
            "the first report is the run"
        );
        assert!(!run.follow_report(None, 0), "not running now says nothing");
        assert!(!run.follow_report(Some(100), 0));
        assert_eq!(run.generation(), 0);
        assert!(run.follow_report(Some(200), 1));
        assert_eq!(run.generation(), 1);
        assert!(run.follow_report(Some(200), 2), "same pid, counted restart");
        run.ended();
        assert_eq!(run.generation(), 3);
    }
}
