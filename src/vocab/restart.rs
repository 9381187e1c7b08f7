//! When a service that ended is started again. Lives in `vocab` because a topology's
//! `[restart]` table is written in it, the planner copies it into every service and the
//! supervisor acts on it.

use serde::{Deserialize, Serialize};

/// When a service that ended without being asked to is started again.
///
/// Every service pdctl runs is a long-running server, so an end pdctl did not ask for is
/// a failure whatever the exit status: a vLLM API server whose engine core died exits
/// with status 0 and serves nothing. `on-failure` and `always` therefore behave the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartMode {
    /// Restart after an unrequested exit (status 0 included), a signal, or failed
    /// liveness probes, within the crash-loop limit (the default).
    OnFailure,
    /// The same as `on-failure` for pdctl's services: any unrequested end restarts.
    Always,
    /// Never restart: an unrequested end marks the service `failed`.
    Never,
}

/// Restart policy with exponential backoff and a crash-loop limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestartPolicy {
    pub mode: RestartMode,
    /// First backoff delay; doubled after each failed start, capped at `backoff_max_ms`.
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// More than this many restarts within `window_s` marks the service `failed`.
    pub max_restarts: u32,
    pub window_s: u64,
    /// Consecutive failed liveness probes after which a running service is restarted.
    pub liveness_failures: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            mode: RestartMode::OnFailure,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
            max_restarts: 5,
            window_s: 300,
            liveness_failures: 3,
        }
    }
}
