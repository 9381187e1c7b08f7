//! Whether this process itself was stalled: a thread ticks every 100 ms and notes each
//! tick that came late by more than [`GAP`]. On a machine that freezes whole (two vLLM
//! engines with NIXL's progress threads on 2 cores froze one for 15-45 s at a time, and
//! once for over a minute, the kernel itself reporting a stuck workqueue), a wait that ran
//! out across such a freeze says nothing of what it waited for: the waiter was frozen as
//! long as the other side, which did not get the time the wait promises it. The
//! supervisor's prober does not count such a probe, and `pdctl up -d` does not count such
//! time as the supervisor's silence; what hangs while this process runs is caught as
//! before.

use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often the clock ticks.
const TICK: Duration = Duration::from_millis(100);
/// A tick later than this after the one before marks a stall (scheduling jitter on a busy
/// machine is well below it).
const GAP: Duration = Duration::from_millis(500);
/// How long stalls are remembered (longer than any wait that asks).
const KEEP: Duration = Duration::from_secs(600);
/// At most this many stalls are remembered.
const MAX_GAPS: usize = 1024;

/// The stalls seen lately, as `[start, end)` spans, and the last tick.
#[derive(Debug)]
struct Gaps {
    last_tick: Instant,
    spans: VecDeque<(Instant, Instant)>,
}

impl Gaps {
    fn new(now: Instant) -> Gaps {
        Gaps {
            last_tick: now,
            spans: VecDeque::new(),
        }
    }

    /// A tick at `now`: a late one records the span it missed.
    fn tick(&mut self, now: Instant) {
        if now.saturating_duration_since(self.last_tick) > GAP {
            self.spans.push_back((self.last_tick + TICK, now));
        }
        self.last_tick = now;
        while self.spans.len() > MAX_GAPS
            || self
                .spans
                .front()
                .is_some_and(|(_, end)| now.saturating_duration_since(*end) > KEEP)
        {
            self.spans.pop_front();
        }
    }

    /// How long this process was stalled within `[from, to]`, `now` being the present: the
    /// recorded stalls, and the one still open when the clock has not ticked for over
    /// [`GAP`] (a timer that fired right after a freeze may be served before the clock).
    fn stalled_between(&self, from: Instant, to: Instant, now: Instant) -> Duration {
        let open = (now.saturating_duration_since(self.last_tick) > GAP)
            .then_some((self.last_tick + TICK, now));
        self.spans
            .iter()
            .copied()
            .chain(open)
            .map(|(start, end)| end.min(to).saturating_duration_since(start.max(from)))
            .sum()
    }
}

/// The process's stall clock, started on first use.
pub struct StallClock {
    gaps: Mutex<Gaps>,
}

impl StallClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Gaps> {
        self.gaps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long this process was stalled between `from` and now.
    pub fn stalled_since(&self, from: Instant) -> Duration {
        let now = Instant::now();
        self.lock().stalled_between(from, now, now)
    }
}

/// The process's one stall clock (its thread starts with the first call).
pub fn clock() -> &'static StallClock {
    static CLOCK: OnceLock<&'static StallClock> = OnceLock::new();
    CLOCK.get_or_init(|| {
        let clock: &'static StallClock = Box::leak(Box::new(StallClock {
            gaps: Mutex::new(Gaps::new(Instant::now())),
        }));
        let started = std::thread::Builder::new()
            .name("pdctl-stall-clock".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(TICK);
                    clock.lock().tick(Instant::now());
                }
            });
        if let Err(e) = started {
            tracing::warn!(
                "no stall clock (cannot start its thread: {e}): every wait that runs out counts, frozen or not"
            );
        }
        clock
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_tick_is_a_stall_counted_where_it_overlaps() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = Gaps::new(t0);
        for ms in (100..=1_000).step_by(100) {
            g.tick(at(ms));
        }
        assert_eq!(g.stalled_between(t0, at(1_000), at(1_000)), Duration::ZERO);
        // Frozen from 1.1 s to 4 s: the next tick comes at 4 s.
        g.tick(at(4_000));
        g.tick(at(4_100));
        assert_eq!(
            g.stalled_between(at(500), at(4_100), at(4_100)),
            Duration::from_millis(2_900)
        );
        assert_eq!(
            g.stalled_between(at(3_000), at(3_500), at(4_100)),
            Duration::from_millis(500),
            "only the overlap"
        );
        assert_eq!(
            g.stalled_between(at(4_000), at(4_100), at(4_100)),
            Duration::ZERO
        );
        // Jitter below GAP is no stall.
        g.tick(at(4_500));
        assert_eq!(
            g.stalled_between(at(4_100), at(4_500), at(4_500)),
            Duration::ZERO
        );
    }

    #[test]
    fn a_stall_the_clock_has_not_ticked_after_yet_counts_too() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let g = Gaps::new(t0);
        // Asked at 3 s, the clock's last tick at 0: frozen since 0.1 s.
        assert_eq!(
            g.stalled_between(at(0), at(3_000), at(3_000)),
            Duration::from_millis(2_900)
        );
        assert_eq!(
            g.stalled_between(at(0), at(300), at(300)),
            Duration::ZERO,
            "not late enough to say"
        );
    }

    #[test]
    fn old_stalls_are_forgotten() {
        let t0 = Instant::now();
        let mut g = Gaps::new(t0);
        g.tick(t0 + Duration::from_secs(2));
        assert_eq!(g.spans.len(), 1);
        g.tick(t0 + KEEP + Duration::from_secs(3));
        assert_eq!(g.spans.len(), 1, "the old one gone, the new one kept");
        assert!(g.spans[0].0 > t0 + Duration::from_secs(2));
    }
}
