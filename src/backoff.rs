//! The one exponential backoff: the wait before trying again after failures in a row,
//! doubling from a first step up to a cap. Restarting a service (the supervisor), asking a
//! node's supervisor again (`ops`) and resuming a model's download all wait by it; each
//! keeps its own count of failures, since each decides differently when the count starts
//! again (a run that served, a byte that moved).
//!
//! A plain value rather than a retry crate: the supervisor computes a restart's delay
//! without sleeping (its task sleeps in a `select!` with the shutdown), the fetch sleeps
//! on a thread, and the `ops` loops check their deadline before each wait; what they share
//! is the arithmetic, not the loop.

use std::time::Duration;

/// Waits that start at `first` and double after each failure, never past `max` (nor
/// below `first`, when `max` is set lower).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    /// Waits from `first`, doubling, at most `max`.
    pub const fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { first, max }
    }

    /// The wait after `failures` failures in a row: `first` after one (or none),
    /// doubled for each one more, at most the cap.
    pub fn after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first
            .saturating_mul(1u32 << doublings)
            .min(self.max.max(self.first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn waits_double_from_the_first_step_up_to_the_cap() {
        let b = Backoff::new(MS(200), MS(2000));
        let waits: Vec<u64> = (1..=7).map(|n| b.after(n).as_millis() as u64).collect();
        assert_eq!(waits, [200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(b.after(0), MS(200));
        assert_eq!(b.after(u32::MAX), MS(2000));
    }

    #[test]
    fn a_cap_below_the_first_step_waits_the_first_step() {
        let b = Backoff::new(MS(500), MS(100));
        assert_eq!(b.after(1), MS(500));
        assert_eq!(b.after(9), MS(500));
    }

    #[test]
    fn a_huge_first_step_saturates_instead_of_overflowing() {
        let b = Backoff::new(Duration::MAX / 2, Duration::MAX);
        assert_eq!(b.after(40), Duration::MAX);
    }
}
