//! What the request path tells the scraper about one decode instance's legs, and what the
//! scraper learned of that decode: kept on the instance, shared by the per-request
//! judgment ([`super::judgment`]) and the window check ([`super::windows`]).

use super::counters::{PromptSources, SOURCES};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// Block size assumed for a decode whose `/metrics` does not say and whose plan gave no
/// allowance (vLLM's default on GPUs).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// One decode's leg counts and what its `/metrics` said.
#[derive(Debug, Default)]
pub struct HandoffLedger {
    /// The leg counts, under one lock so that a snapshot never sees a leg ended in one
    /// count and not yet in another.
    counts: Mutex<LedgerSnapshot>,
    /// This decode answered with `usage.prompt_tokens_details` at least once.
    pub(super) reports_cached: AtomicBool,
    /// Its `/metrics` had the by-source counters at the last scrape.
    pub(super) has_counters: AtomicBool,
    /// The block size its `/metrics` stated (0: not known).
    block_size: AtomicU32,
    /// Prompt tokens its counters grew by while this proxy watched, by source.
    seen: [AtomicU64; SOURCES.len()],
}

/// The ledger's leg counts at one moment (or the difference of two moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// Decode legs sent.
    pub sent: u64,
    /// Decode legs that ended (answered, failed or dropped); each also in one count below.
    pub ended: u64,
    /// Legs sent whose judgment was left to the window check from the start (several
    /// prompts, a usage that does not show the handoff, a decode not known to report it),
    /// and those of them that ended: the legs a window must wait for.
    pub left_sent: u64,
    pub left_ended: u64,
    /// Prompts of ended legs with a handoff due, left to the window check.
    pub due: u64,
    /// Ended legs judged by their own usage, and the prompt tokens they computed.
    pub judged: u64,
    pub explained_tokens: u64,
    /// Ended legs the proxy knew would recompute (counted as misses when sent).
    pub known_recomputes: u64,
}

impl LedgerSnapshot {
    /// Legs sent that have not ended.
    pub fn in_flight(self) -> u64 {
        self.sent.saturating_sub(self.ended)
    }

    /// Legs left to the window check that have not ended.
    pub fn left_in_flight(self) -> u64 {
        self.left_sent.saturating_sub(self.left_ended)
    }

    /// Prompts of the ended legs: the engine requests this proxy can account for.
    pub fn prompts(self) -> u64 {
        self.due + self.judged + self.known_recomputes
    }

    /// The counts since `b`.
    pub fn since(self, b: LedgerSnapshot) -> LedgerSnapshot {
        LedgerSnapshot {
            sent: self.sent.saturating_sub(b.sent),
            ended: self.ended.saturating_sub(b.ended),
            left_sent: self.left_sent.saturating_sub(b.left_sent),
            left_ended: self.left_ended.saturating_sub(b.left_ended),
            due: self.due.saturating_sub(b.due),
            judged: self.judged.saturating_sub(b.judged),
            explained_tokens: self.explained_tokens.saturating_sub(b.explained_tokens),
            known_recomputes: self.known_recomputes.saturating_sub(b.known_recomputes),
        }
    }

    /// Adds the counts of `d`.
    pub fn add(&mut self, d: LedgerSnapshot) {
        self.sent += d.sent;
        self.ended += d.ended;
        self.left_sent += d.left_sent;
        self.left_ended += d.left_ended;
        self.due += d.due;
        self.judged += d.judged;
        self.explained_tokens += d.explained_tokens;
        self.known_recomputes += d.known_recomputes;
    }
}

impl HandoffLedger {
    /// The counts now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        *self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the counts under their lock.
    pub(super) fn update(&self, f: impl FnOnce(&mut LedgerSnapshot)) {
        f(&mut self.counts.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Prompt tokens a good handoff may leave this decode to compute: the plan's
    /// allowance for the connector (`planned`, 0 when not given), and at least one KV
    /// block as its `/metrics` states it ([`DEFAULT_BLOCK_SIZE`] when neither says).
    pub fn leaves(&self, planned: u32) -> u64 {
        let stated = self.block_size.load(Relaxed);
        match planned.max(stated) {
            0 => u64::from(DEFAULT_BLOCK_SIZE),
            n => u64::from(n),
        }
    }

    /// Records the block size its `/metrics` states.
    pub fn set_block_size(&self, b: u32) {
        self.block_size.store(b, Relaxed);
    }

    /// Records whether its `/metrics` has the by-source counters; returns the previous
    /// answer.
    pub fn set_has_counters(&self, has: bool) -> bool {
        self.has_counters.swap(has, Relaxed)
    }

    /// Whether its last `/metrics` page had the by-source counters (so their growth is
    /// watched from the first such page on).
    pub fn has_counters(&self) -> bool {
        self.has_counters.load(Relaxed)
    }

    /// Adds the growth of its counters seen at one scrape.
    pub fn add_seen(&self, d: PromptSources) {
        for (a, n) in self.seen.iter().zip(d.as_array()) {
            a.fetch_add(n, Relaxed);
        }
    }

    /// Prompt tokens its counters grew by while this proxy watched, in [`SOURCES`] order.
    pub fn seen(&self) -> [u64; 3] {
        self.seen.each_ref().map(|a| a.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allowance_is_the_larger_of_the_plans_and_one_stated_block() {
        let l = HandoffLedger::default();
        assert_eq!(l.leaves(0), 16);
        assert_eq!(l.leaves(256), 256);
        l.set_block_size(128);
        assert_eq!(l.leaves(0), 128);
        assert_eq!(l.leaves(16), 128);
        assert_eq!(l.leaves(256), 256);
    }

    #[test]
    fn snapshots_subtract_and_add_back() {
        let a = LedgerSnapshot {
            sent: 5,
            ended: 3,
            left_sent: 2,
            left_ended: 1,
            due: 1,
            judged: 2,
            explained_tokens: 20,
            known_recomputes: 0,
        };
        let mut b = a;
        b.add(a);
        assert_eq!(b.since(a), a);
        assert_eq!((a.in_flight(), a.left_in_flight(), a.prompts()), (2, 1, 3));
    }
}
