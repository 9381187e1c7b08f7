//! Whether and when a service that stopped on its own is started again: the plan's
//! restart mode, exponential backoff with a cap, and the crash-loop limit after which a
//! service is `failed` (and the proxy stops sending it requests).
//!
//! Every service pdctl runs is a long-running server, so any end pdctl did not ask for is
//! a failure, whatever the exit status: a vLLM API server whose engine core died can exit
//! with status 0, and a cluster that took that for a clean finish would serve 503s for
//! good.

use crate::vocab::{RestartMode, RestartPolicy};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A run healthy for at least this long was serving, not crashing: it does not count
/// toward the crash-loop limit, and the backoff after it starts again from its first step
/// (as Kubernetes forgets a crash after a stable run). So an engine killed from outside
/// every few seconds (an OOM killer, a driver reset, a person) is restarted every time,
/// while one that dies before it is healthy, or right after, still ends `failed`.
pub const SERVING_RUN: Duration = Duration::from_secs(2);

/// What to do after a service's process ended without being asked to.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Start it again after this delay.
    Restart { delay: Duration },
    /// Give up on it: its policy is `never`, or it is in a crash loop.
    Fail { reason: String },
}

/// Restart history of one service.
#[derive(Debug, Clone)]
pub struct RestartTracker {
    policy: RestartPolicy,
    /// When each automatic restart within the window happened.
    recent: VecDeque<Instant>,
    /// Restarts since the service last served ([`SERVING_RUN`]); sets the backoff.
    consecutive: u32,
}

impl RestartTracker {
    /// No restarts yet.
    pub fn new(policy: RestartPolicy) -> RestartTracker {
        RestartTracker {
            policy,
            recent: VecDeque::new(),
            consecutive: 0,
        }
    }

    /// Decides after an end nobody asked for: an exit with any status (0 included), a
    /// signal, failed liveness probes. `healthy_for` is how long the run was healthy: a
    /// run that served ([`SERVING_RUN`]) is restarted after the first backoff step and is
    /// not counted toward the crash-loop limit.
    pub fn after_exit(&mut self, now: Instant, healthy_for: Duration) -> Verdict {
        let p = &self.policy;
        match p.mode {
            RestartMode::Never => {
                return Verdict::Fail {
                    reason: "restart policy is `never`".into(),
                };
            }
            RestartMode::OnFailure | RestartMode::Always => {}
        }
        if healthy_for >= SERVING_RUN {
            self.consecutive = 1;
            return Verdict::Restart {
                delay: Duration::from_millis(p.backoff_initial_ms),
            };
        }
        let window = Duration::from_secs(p.window_s);
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > window)
        {
            self.recent.pop_front();
        }
        if self.recent.len() as u32 >= p.max_restarts {
            return Verdict::Fail {
                reason: format!(
                    "crash loop: {} restarts within {} s (limit {})",
                    self.recent.len(),
                    p.window_s,
                    p.max_restarts
                ),
            };
        }
        let backoff = crate::backoff::Backoff::new(
            Duration::from_millis(p.backoff_initial_ms),
            Duration::from_millis(p.backoff_max_ms),
        );
        self.consecutive += 1;
        self.recent.push_back(now);
        Verdict::Restart {
            delay: backoff.after(self.consecutive),
        }
    }

    /// Forgets the history (a restart asked for by a person starts afresh).
    pub fn reset(&mut self) {
        self.recent.clear();
        self.consecutive = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(mode: RestartMode) -> RestartPolicy {
        RestartPolicy {
            mode,
            backoff_initial_ms: 100,
            backoff_max_ms: 350,
            max_restarts: 4,
            window_s: 60,
            liveness_failures: 3,
        }
    }

    fn delay(v: Verdict) -> u64 {
        match v {
            Verdict::Restart { delay } => delay.as_millis() as u64,
            other => panic!("expected a restart, got {other:?}"),
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_then_the_crash_loop_fails_it() {
        let mut t = RestartTracker::new(policy(RestartMode::OnFailure));
        let now = Instant::now();
        let z = Duration::ZERO;
        let delays: Vec<u64> = (0..4).map(|_| delay(t.after_exit(now, z))).collect();
        assert_eq!(delays, vec![100, 200, 350, 350]);
        match t.after_exit(now, z) {
            Verdict::Fail { reason } => assert!(reason.contains("crash loop: 4 restarts")),
            other => panic!("expected failure, got {other:?}"),
        }
    }

    #[test]
    fn restarts_outside_the_window_do_not_count() {
        let mut t = RestartTracker::new(policy(RestartMode::Always));
        let start = Instant::now();
        for _ in 0..4 {
            delay(t.after_exit(start, Duration::ZERO));
        }
        let later = start + Duration::from_secs(61);
        assert_eq!(delay(t.after_exit(later, Duration::ZERO)), 350);
        // A run that served resets the backoff to its first step.
        assert_eq!(delay(t.after_exit(later, SERVING_RUN)), 100);
        assert_eq!(delay(t.after_exit(later, Duration::ZERO)), 200);
    }

    #[test]
    fn an_unrequested_end_restarts_unless_the_mode_is_never() {
        let now = Instant::now();
        let z = Duration::ZERO;
        let mut on_failure = RestartTracker::new(policy(RestartMode::OnFailure));
        assert_eq!(delay(on_failure.after_exit(now, z)), 100);
        let mut always = RestartTracker::new(policy(RestartMode::Always));
        assert_eq!(delay(always.after_exit(now, z)), 100);
        let mut never = RestartTracker::new(policy(RestartMode::Never));
        match never.after_exit(now, z) {
            Verdict::Fail { reason } => assert!(reason.contains("`never`"), "{reason}"),
            other => panic!("expected failure, got {other:?}"),
        }
    }

    #[test]
    fn an_engine_killed_while_serving_is_restarted_every_time() {
        let mut t = RestartTracker::new(policy(RestartMode::OnFailure));
        let start = Instant::now();
        // Killed every 5 s after 4 s of serving, far more often than the limit of 4.
        for i in 0..20 {
            let now = start + Duration::from_secs(5 * i);
            assert_eq!(
                delay(t.after_exit(now, Duration::from_secs(4))),
                100,
                "kill {i}"
            );
        }
        // One that dies before it is healthy still counts.
        for _ in 0..4 {
            delay(t.after_exit(start + Duration::from_secs(101), Duration::ZERO));
        }
        assert!(matches!(
            t.after_exit(start + Duration::from_secs(101), Duration::ZERO),
            Verdict::Fail { .. }
        ));
    }

    #[test]
    fn reset_forgets_the_crash_loop() {
        let mut t = RestartTracker::new(policy(RestartMode::OnFailure));
        let now = Instant::now();
        for _ in 0..4 {
            delay(t.after_exit(now, Duration::ZERO));
        }
        t.reset();
        assert_eq!(delay(t.after_exit(now, Duration::ZERO)), 100);
    }
}
