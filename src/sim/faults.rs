//! Fault injection, so the supervisor's and the proxy's tests can make an engine crash,
//! exit with a chosen status (0 too, as a vLLM API server whose engine core died does),
//! fail, hang, stall a stream, lose a KV handoff or look unhealthy on demand
//! (`POST /sim/fault`), or exit after a number of requests (`--fault-exit-after`).

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const NONE: u64 = u64::MAX;

/// The body of `POST /sim/fault`: every field is optional; several may be combined.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// Exit now with status 1 (after answering this request).
    #[serde(default)]
    pub crash: bool,
    /// Exit now with this status (after answering this request), logging an error line
    /// first. `0` plays a vLLM API server whose engine core died: it exits 0.
    pub exit: Option<u8>,
    /// The next N completion requests answer 500 with a JSON error.
    pub fail_next: Option<u64>,
    /// The next N completion requests never answer (until the client gives up).
    pub hang_next: Option<u64>,
    /// `/health` answers 503 for this many milliseconds from now.
    pub unhealthy_ms: Option<u64>,
    /// The next streaming request sends this many tokens, then stops sending without
    /// closing the stream.
    pub stall_stream_after: Option<u64>,
    /// The next N KV handoffs this decode expects are lost, as when a transfer fails on
    /// real hardware: the decode answers normally but recomputes the prompt, which only its
    /// counters and usage show (what silent-recompute detection must catch).
    pub fail_handoff_next: Option<u64>,
    /// `/metrics` answers this many milliseconds late, every time, until set to 0 or
    /// cleared (a scrape that times out, as an engine under a stall does).
    pub slow_metrics_ms: Option<u64>,
    /// From now on `/health` answers 200 only after this many milliseconds (0: at once),
    /// as a saturated vLLM's API server does, while requests are served as before.
    pub health_delay_ms: Option<u64>,
    /// The engine core dies now, as vLLM's does: every stream in flight gets vLLM's
    /// `EngineDeadError` as an error event at its next token, then `[DONE]`, and the API
    /// server exits (status 1) half a second later, as vLLM's watchdog makes it.
    #[serde(default)]
    pub engine_dead: bool,
    /// Forget every pending fault first.
    #[serde(default)]
    pub clear: bool,
}

/// What a completion request must suffer, decided when it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFault {
    None,
    Fail,
    Hang,
}

/// Pending faults, shared by all requests.
pub struct Faults {
    fail_next: AtomicU64,
    hang_next: AtomicU64,
    unhealthy_until_ms: AtomicU64,
    stall_stream_after: AtomicU64,
    fail_handoff_next: AtomicU64,
    slow_metrics_ms: AtomicU64,
    health_delay_ms: AtomicU64,
    exit_after: Option<u64>,
    served: AtomicU64,
    engine_dead: std::sync::atomic::AtomicBool,
}

/// Takes one from `a` if it is above zero.
fn take_one(a: &AtomicU64) -> bool {
    a.load(Relaxed) > 0
        && a.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_ok()
}

impl Faults {
    /// No faults pending; exit after `exit_after` served requests if set.
    pub fn new(exit_after: Option<u64>) -> Faults {
        Faults {
            fail_next: AtomicU64::new(0),
            hang_next: AtomicU64::new(0),
            unhealthy_until_ms: AtomicU64::new(0),
            stall_stream_after: AtomicU64::new(NONE),
            fail_handoff_next: AtomicU64::new(0),
            slow_metrics_ms: AtomicU64::new(0),
            health_delay_ms: AtomicU64::new(0),
            exit_after,
            served: AtomicU64::new(0),
            engine_dead: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Applies a fault request; `now_ms` is the time since start. Returns the status the
    /// process must exit with, if it must (`exit` when given, else 1 for `crash`).
    pub fn apply(&self, req: &FaultRequest, now_ms: u64) -> Option<i32> {
        if req.clear {
            self.fail_next.store(0, Relaxed);
            self.hang_next.store(0, Relaxed);
            self.unhealthy_until_ms.store(0, Relaxed);
            self.stall_stream_after.store(NONE, Relaxed);
            self.fail_handoff_next.store(0, Relaxed);
            self.slow_metrics_ms.store(0, Relaxed);
        }
        if let Some(ms) = req.slow_metrics_ms {
            self.slow_metrics_ms.store(ms, Relaxed);
            self.health_delay_ms.store(0, Relaxed);
        }
        if let Some(ms) = req.health_delay_ms {
            self.health_delay_ms.store(ms, Relaxed);
        }
        if let Some(n) = req.fail_next {
            self.fail_next.store(n, Relaxed);
        }
        if let Some(n) = req.hang_next {
            self.hang_next.store(n, Relaxed);
        }
        if let Some(ms) = req.unhealthy_ms {
            self.unhealthy_until_ms
                .store(now_ms.saturating_add(ms), Relaxed);
        }
        if let Some(n) = req.fail_handoff_next {
            self.fail_handoff_next.store(n, Relaxed);
        }
        if let Some(k) = req.stall_stream_after {
            self.stall_stream_after.store(k.min(NONE - 1), Relaxed);
        }
        if req.engine_dead {
            self.engine_dead.store(true, Relaxed);
        }
        req.exit.map(i32::from).or(req.crash.then_some(1))
    }

    /// Whether an `engine_dead` fault killed the (simulated) engine core.
    pub fn engine_dead(&self) -> bool {
        self.engine_dead.load(Relaxed)
    }

    /// The fault, if any, the next completion request gets (fail before hang).
    pub fn take_request_fault(&self) -> RequestFault {
        if take_one(&self.fail_next) {
            RequestFault::Fail
        } else if take_one(&self.hang_next) {
            RequestFault::Hang
        } else {
            RequestFault::None
        }
    }

    /// For a streaming request: after how many tokens it must stall, if it must.
    pub fn take_stall(&self) -> Option<u64> {
        if self.stall_stream_after.load(Relaxed) == NONE {
            return None;
        }
        match self.stall_stream_after.swap(NONE, Relaxed) {
            NONE => None,
            k => Some(k),
        }
    }

    /// Whether the KV handoff a decode is about to take must be lost (`fail_handoff_next`).
    pub fn take_handoff_fault(&self) -> bool {
        take_one(&self.fail_handoff_next)
    }

    /// How long `/metrics` waits before answering (`slow_metrics_ms`).
    pub fn metrics_delay(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.slow_metrics_ms.load(Relaxed))
    }

    /// False while an `unhealthy_ms` fault lasts.
    pub fn healthy(&self, now_ms: u64) -> bool {
        now_ms >= self.unhealthy_until_ms.load(Relaxed)
    }

    /// How long `/health` waits before it answers (`health_delay_ms`).
    pub fn health_delay(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.health_delay_ms.load(Relaxed))
    }

    /// Counts one served request; true when `--fault-exit-after` is reached by it.
    pub fn count_served(&self) -> bool {
        let Some(limit) = self.exit_after else {
            return false;
        };
        self.served.fetch_add(1, Relaxed) + 1 == limit
    }

    /// The faults pending now, for `GET /sim/fault`.
    pub fn pending(&self, now_ms: u64) -> serde_json::Value {
        let stall = self.stall_stream_after.load(Relaxed);
        serde_json::json!({
            "fail_next": self.fail_next.load(Relaxed),
            "hang_next": self.hang_next.load(Relaxed),
            "unhealthy_ms": self.unhealthy_until_ms.load(Relaxed).saturating_sub(now_ms),
            "stall_stream_after": (stall != NONE).then_some(stall),
            "fail_handoff_next": self.fail_handoff_next.load(Relaxed),
            "slow_metrics_ms": self.slow_metrics_ms.load(Relaxed),
            "health_delay_ms": self.health_delay_ms.load(Relaxed),
            "exit_after": self.exit_after,
            "served": self.served.load(Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_and_hang_are_counted_down() {
        let f = Faults::new(None);
        f.apply(
            &FaultRequest {
                fail_next: Some(1),
                hang_next: Some(1),
                ..Default::default()
            },
            0,
        );
        assert_eq!(f.take_request_fault(), RequestFault::Fail);
        assert_eq!(f.take_request_fault(), RequestFault::Hang);
        assert_eq!(f.take_request_fault(), RequestFault::None);
    }

    #[test]
    fn unhealthy_window_and_stall_once() {
        let f = Faults::new(None);
        f.apply(
            &FaultRequest {
                unhealthy_ms: Some(100),
                stall_stream_after: Some(3),
                ..Default::default()
            },
            1000,
        );
        assert!(!f.healthy(1050));
        assert!(f.healthy(1100));
        assert_eq!(f.take_stall(), Some(3));
        assert_eq!(f.take_stall(), None);
        f.apply(
            &FaultRequest {
                unhealthy_ms: Some(100),
                clear: true,
                ..Default::default()
            },
            0,
        );
        assert!(!f.healthy(50));
    }

    #[test]
    fn exit_and_crash_name_the_exit_status() {
        let f = Faults::new(None);
        assert_eq!(f.apply(&FaultRequest::default(), 0), None);
        let crash = FaultRequest {
            crash: true,
            ..Default::default()
        };
        assert_eq!(f.apply(&crash, 0), Some(1));
        let exit0 = FaultRequest {
            exit: Some(0),
            ..Default::default()
        };
        assert_eq!(f.apply(&exit0, 0), Some(0));
        let both = FaultRequest {
            exit: Some(3),
            crash: true,
            ..Default::default()
        };
        assert_eq!(f.apply(&both, 0), Some(3));
    }

    #[test]
    fn lost_handoffs_are_counted_down_and_cleared() {
        let f = Faults::new(None);
        assert!(!f.take_handoff_fault());
        f.apply(
            &FaultRequest {
                fail_handoff_next: Some(2),
                ..Default::default()
            },
            0,
        );
        assert_eq!(f.pending(0)["fail_handoff_next"], 2);
        assert!(f.take_handoff_fault());
        assert!(f.take_handoff_fault());
        assert!(!f.take_handoff_fault());
        f.apply(
            &FaultRequest {
                fail_handoff_next: Some(5),
                ..Default::default()
            },
            0,
        );
        f.apply(
            &FaultRequest {
                clear: true,
                ..Default::default()
            },
            0,
        );
        assert!(!f.take_handoff_fault());
    }

    #[test]
    fn exit_after_fires_once_at_the_limit() {
        let f = Faults::new(Some(2));
        assert!(!f.count_served());
        assert!(f.count_served());
        assert!(!f.count_served());
        assert!(!Faults::new(None).count_served());
    }

    #[test]
    fn slow_metrics_lasts_until_set_to_0() {
        let f = Faults::new(None);
        let slow = |ms| FaultRequest {
            slow_metrics_ms: Some(ms),
            ..Default::default()
        };
        f.apply(&slow(3000), 0);
        assert_eq!(f.metrics_delay(), std::time::Duration::from_secs(3));
        assert_eq!(f.metrics_delay(), std::time::Duration::from_secs(3));
        f.apply(&slow(0), 0);
        assert_eq!(f.metrics_delay(), std::time::Duration::ZERO);
    }
}
