//! The window check: per window between two scrapes, decode's
//! `vllm:prompt_tokens_by_source_total{source="local_compute"}` growth beyond what the
//! handoffs that ended in it leave to compute is recompute. It covers the legs no answer
//! judged ([`super::judgment`]): several prompts, a usage that does not show the handoff,
//! legs that ended without usage.
//!
//! A window is judged only when it can be attributed: no decode leg of this proxy in
//! flight when it closes (so every prompt counted in it belongs to a leg that ended in
//! it), and no more prompts prefilled by decode (its
//! `vllm:time_to_first_token_seconds_count`) than the legs that ended (so no request that
//! reached decode another way is taken for a miss). Under steady load legs are always in
//! flight: a window with nothing left to it (every leg in it judged by its own answer, and
//! none left to it in flight) closes at once with nothing to find; one that holds legs
//! left to it merges into the next, and after [`MAX_MERGED`] scrapes is dropped, its legs
//! counted as unchecked. A miss may go uncounted (and then shows as unchecked), none is
//! counted twice or made up.

use super::counters::{DecodeCounters, PromptSources};
use super::ledger::LedgerSnapshot;

/// Windows merged at most while decode legs are in flight; past that the merged window is
/// dropped unjudged rather than judged with legs whose prompts may or may not be counted.
pub const MAX_MERGED: u32 = 30;

/// One decode's counters followed from scrape to scrape.
#[derive(Debug, Default)]
pub struct DecodeWatch {
    /// Counters and ledger at the last scrape (none before the first: the baseline).
    last: Option<(DecodeCounters, LedgerSnapshot)>,
    /// Growth since the window opened: tokens, prompts prefilled (`None`: not known), legs.
    open: (PromptSources, Option<u64>, LedgerSnapshot),
    merged: u32,
}

/// What one scrape of a decode found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Growth of its counters since the last scrape.
    pub tokens: PromptSources,
    /// Its counters went down: the engine restarted; counting starts again from here.
    pub restarted: bool,
    /// The window closed here and was left unjudged, and why.
    pub unjudged: Option<Unjudged>,
    /// Handoffs left to this check in a window it could not judge.
    pub unchecked: u64,
    pub finding: Option<Finding>,
}

/// Why a closed window was not judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unjudged {
    /// Decode prefilled more prompts than this proxy's legs that ended: requests reached
    /// it another way, and their prompts cannot be told from a miss.
    OtherTraffic { prefilled: u64, legs: u64 },
    /// Its page does not count prefilled prompts, so other traffic cannot be ruled out.
    PrefillsUnknown,
    /// Legs the proxy sent to recompute ended in it: their whole prompts cannot be told
    /// from a miss.
    KnownRecomputes,
    /// Legs stayed in flight for [`MAX_MERGED`] scrapes.
    NeverIdle,
}

impl Unjudged {
    /// The metrics label of the reason.
    pub fn reason(self) -> &'static str {
        match self {
            Unjudged::OtherTraffic { .. } => "other_traffic",
            Unjudged::PrefillsUnknown => "prefills_unknown",
            Unjudged::KnownRecomputes => "known_recomputes",
            Unjudged::NeverIdle => "never_idle",
        }
    }
}

/// Recompute found in a decode's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finding {
    /// `local_compute` growth beyond what the handoffs due leave to compute: counted.
    pub unexplained_tokens: u64,
    /// Requests that recomputed, estimated from the mean prompt length (at least 1, at
    /// most `due`): an estimate, never added to the counted misses.
    pub estimated_misses: u64,
    /// Handoffs due (not judged per request) in the window.
    pub due: u64,
}

impl DecodeWatch {
    /// Takes one scrape: `ledger` read before the page was fetched, the decode's counters
    /// `now` on that page, `leaves` the tokens a good handoff may leave to compute. Every
    /// leg `ledger` counts as ended had its prompt counted on the page, so a window closed
    /// when none is in flight holds whole legs only.
    pub fn step(&mut self, now: DecodeCounters, ledger: LedgerSnapshot, leaves: u64) -> Step {
        let Some((before, ledger_before)) = self.last.replace((now, ledger)) else {
            return Step::default();
        };
        let prefills_down = matches!((now.prefills, before.prefills), (Some(n), Some(b)) if n < b);
        let tokens = match now.sources.since(before.sources) {
            Some(t) if !prefills_down => t,
            _ => {
                *self = DecodeWatch {
                    last: Some((now, ledger)),
                    ..DecodeWatch::default()
                };
                return Step {
                    restarted: true,
                    ..Step::default()
                };
            }
        };
        let prefilled = now.prefills.zip(before.prefills).map(|(n, b)| n - b);
        self.grow(tokens, prefilled, ledger.since(ledger_before));
        let mut step = Step {
            tokens,
            ..Step::default()
        };
        if ledger.in_flight() > 0 {
            if self.open.2.due == 0 && ledger.left_in_flight() == 0 {
                // Every leg in it was judged by its own answer: nothing to find here.
                self.close();
            } else if self.merged >= MAX_MERGED {
                let (_, _, legs) = self.close();
                step.unjudged = Some(Unjudged::NeverIdle);
                step.unchecked = legs.due;
            }
            return step;
        }
        let (grown, prefilled, legs) = self.close();
        match settle(grown, prefilled, legs, leaves) {
            Ok(finding) => step.finding = finding,
            Err(why) => {
                step.unjudged = Some(why);
                step.unchecked = legs.due;
            }
        }
        step
    }

    /// Adds one scrape's growth to the open window.
    fn grow(&mut self, tokens: PromptSources, prefilled: Option<u64>, legs: LedgerSnapshot) {
        let fresh = self.merged == 0;
        self.open.0.add(tokens);
        self.open.1 = match (fresh, self.open.1, prefilled) {
            (true, _, p) => p,
            (false, Some(a), Some(p)) => Some(a + p),
            _ => None,
        };
        self.open.2.add(legs);
        self.merged += 1;
    }

    fn close(&mut self) -> (PromptSources, Option<u64>, LedgerSnapshot) {
        self.merged = 0;
        std::mem::take(&mut self.open)
    }
}

/// Judges a closed window: the decode's own computing against what its legs leave to
/// compute (`leaves` tokens each). Err: the window cannot be attributed to this proxy's
/// legs.
fn settle(
    grown: PromptSources,
    prefilled: Option<u64>,
    l: LedgerSnapshot,
    leaves: u64,
) -> Result<Option<Finding>, Unjudged> {
    if l.due == 0 {
        return Ok(None); // no handoff left to this check
    }
    if l.known_recomputes > 0 {
        return Err(Unjudged::KnownRecomputes);
    }
    let legs = l.prompts();
    match prefilled {
        None => return Err(Unjudged::PrefillsUnknown),
        Some(p) if p > legs => return Err(Unjudged::OtherTraffic { prefilled: p, legs }),
        Some(_) => {}
    }
    let allowed = l.due * leaves + l.explained_tokens;
    let Some(tokens) = grown.local_compute.checked_sub(allowed).filter(|t| *t > 0) else {
        return Ok(None);
    };
    // A miss computes its whole prompt where a handoff leaves at most `leaves`.
    let mean = grown.total() / legs.max(1);
    let per_miss = mean.saturating_sub(leaves).max(1);
    Ok(Some(Finding {
        unexplained_tokens: tokens,
        estimated_misses: tokens.div_ceil(per_miss).clamp(1, l.due),
        due: l.due,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decode's counters: local compute, external, prompts prefilled.
    fn counters(compute: u64, external: u64, prefills: u64) -> DecodeCounters {
        DecodeCounters {
            sources: PromptSources {
                local_compute: compute,
                local_cache_hit: 0,
                external_kv_transfer: external,
            },
            prefills: Some(prefills),
        }
    }

    /// Legs that all ended, `due` of them left to the window check.
    fn ended(due: u64) -> LedgerSnapshot {
        LedgerSnapshot {
            sent: due,
            ended: due,
            left_sent: due,
            left_ended: due,
            due,
            ..LedgerSnapshot::default()
        }
    }

    /// `judged` legs judged by their answers (each `computed` tokens), `running` more in
    /// flight, none left to this check.
    fn judged(judged: u64, computed: u64, running: u64) -> LedgerSnapshot {
        LedgerSnapshot {
            sent: judged + running,
            ended: judged,
            judged,
            explained_tokens: judged * computed,
            ..LedgerSnapshot::default()
        }
    }

    const BS: u64 = 128;

    #[test]
    fn good_handoffs_leave_nothing_and_a_lost_one_is_found() {
        let mut w = DecodeWatch::default();
        assert_eq!(w.step(counters(100, 0, 1), ended(0), BS), Step::default());
        // Three 495-token prompts handed off as vLLM does: 384 loaded, 111 computed each.
        let s = w.step(counters(433, 1152, 4), ended(3), BS);
        assert_eq!((s.finding, s.unjudged), (None, None));
        // One more: its whole prompt computed, 495 - 128 beyond what a handoff leaves.
        let f = w
            .step(counters(928, 1152, 5), ended(4), BS)
            .finding
            .unwrap();
        assert_eq!(
            (f.unexplained_tokens, f.estimated_misses, f.due),
            (367, 1, 1)
        );
    }

    #[test]
    fn a_request_that_reached_decode_another_way_is_not_a_miss() {
        // What the ExampleConnector run showed: two good handoffs (384 loaded, 111 and 128
        // computed) and, in the same window, a 499-token prompt sent straight to decode.
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        let s = w.step(counters(111 + 128 + 499, 768, 3), ended(2), BS);
        assert_eq!(s.finding, None);
        assert_eq!(
            s.unjudged,
            Some(Unjudged::OtherTraffic {
                prefilled: 3,
                legs: 2
            })
        );
        assert_eq!(s.unchecked, 2);
        // Without the prefill count the window cannot be judged either.
        let mut w = DecodeWatch::default();
        let blind = |c: u64| DecodeCounters {
            prefills: None,
            ..counters(c, 0, 0)
        };
        w.step(blind(0), ended(0), BS);
        let s = w.step(blind(900), ended(1), BS);
        assert_eq!(
            (s.finding, s.unjudged, s.unchecked),
            (None, Some(Unjudged::PrefillsUnknown), 1)
        );
    }

    #[test]
    fn a_window_with_legs_left_to_it_closes_only_when_no_leg_is_in_flight() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        // A lost handoff's prompt is counted while its stream still runs: held, not judged.
        let running = LedgerSnapshot {
            sent: 1,
            left_sent: 1,
            ..LedgerSnapshot::default()
        };
        assert_eq!(
            w.step(counters(495, 0, 1), running, BS),
            Step {
                tokens: counters(495, 0, 0).sources,
                ..Step::default()
            }
        );
        // It ended: the merged window holds the leg and its prompt, judged once.
        let f = w.step(counters(495, 0, 1), ended(1), BS).finding.unwrap();
        assert_eq!((f.unexplained_tokens, f.estimated_misses), (367, 1));
        assert_eq!(w.step(counters(495, 0, 1), ended(1), BS).finding, None);
    }

    #[test]
    fn under_steady_load_of_judged_legs_windows_close_and_find_nothing() {
        // Every leg judged by its own answer, some always in flight: each window closes at
        // once, and the recomputes the answers counted are not found again here.
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), judged(0, 0, 4), BS);
        for k in 1..=3 * MAX_MERGED as u64 {
            let s = w.step(counters(k * 495, 0, k), judged(k, 495, 4), BS);
            assert_eq!((s.finding, s.unjudged, s.unchecked), (None, None, 0), "{k}");
        }
    }

    #[test]
    fn a_leg_credited_before_its_prompt_counts_hides_nothing_later() {
        // A leg that ended in a window whose prompt was counted in the one before (it was
        // sent just after the ledger was read) gives credit; the window before it, with a
        // prompt and no leg, was not judged.
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        let s = w.step(counters(111, 384, 1), ended(0), BS);
        assert_eq!(s.finding, None); // nothing due: nothing to judge
        let s = w.step(counters(111, 384, 1), ended(1), BS);
        assert_eq!((s.finding, s.unjudged), (None, None));
        // A later lone miss is still found in full.
        let f = w.step(counters(606, 384, 2), ended(2), BS).finding.unwrap();
        assert_eq!(f.unexplained_tokens, 367);
    }

    #[test]
    fn several_misses_are_estimated_from_the_mean_prompt() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        // 22 prompts of 495 tokens, two lost: 2 * 495 + 20 * 111 computed.
        let f = w
            .step(counters(2 * 495 + 20 * 111, 20 * 384, 22), ended(22), BS)
            .finding
            .unwrap();
        assert_eq!(
            (f.unexplained_tokens, f.estimated_misses),
            (3210 - 22 * 128, 2)
        );
    }

    #[test]
    fn growth_with_no_handoff_due_or_with_a_known_recompute_is_not_a_miss() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        assert_eq!(w.step(counters(500, 0, 1), ended(0), BS).finding, None);
        let known = LedgerSnapshot {
            known_recomputes: 1,
            sent: 2,
            ended: 2,
            due: 1,
            ..LedgerSnapshot::default()
        };
        let s = w.step(counters(1500, 0, 3), known, BS);
        assert_eq!(
            (s.finding, s.unjudged, s.unchecked),
            (None, Some(Unjudged::KnownRecomputes), 1)
        );
    }

    #[test]
    fn counters_that_go_down_restart_the_count() {
        let mut w = DecodeWatch::default();
        w.step(counters(500, 0, 2), ended(0), BS);
        let s = w.step(counters(10, 0, 0), ended(1), BS);
        assert!(s.restarted && s.finding.is_none());
        assert_eq!(w.step(counters(10, 384, 1), ended(2), BS).finding, None);
        // The prefill count alone going down is a restart too.
        let s = w.step(counters(20, 384, 0), ended(2), BS);
        assert!(s.restarted);
    }

    #[test]
    fn legs_judged_per_request_have_their_tokens_taken_out() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        // A judged miss (495 computed, counted by its usage) and a lost unjudged one.
        let l = LedgerSnapshot {
            due: 1,
            judged: 1,
            explained_tokens: 495,
            ..ended(1)
        };
        let l = LedgerSnapshot {
            sent: 2,
            ended: 2,
            ..l
        };
        let f = w.step(counters(990, 0, 2), l, BS).finding.unwrap();
        assert_eq!(
            (f.unexplained_tokens, f.estimated_misses, f.due),
            (367, 1, 1)
        );
        // Judged legs alone leave nothing to this check.
        let more = LedgerSnapshot {
            sent: 3,
            ended: 3,
            judged: 2,
            explained_tokens: 990,
            ..l
        };
        assert_eq!(w.step(counters(1980, 0, 3), more, BS).finding, None);
    }

    #[test]
    fn a_window_held_too_long_is_dropped_and_its_legs_counted_unchecked() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        let stuck = LedgerSnapshot {
            sent: 2,
            ended: 1,
            left_sent: 2,
            left_ended: 1,
            due: 1,
            ..LedgerSnapshot::default()
        };
        for i in 1..MAX_MERGED {
            let s = w.step(counters(495, 0, 1), stuck, BS);
            assert_eq!((s.finding, s.unjudged), (None, None), "{i}");
        }
        let s = w.step(counters(495, 0, 1), stuck, BS);
        assert_eq!((s.unjudged, s.unchecked), (Some(Unjudged::NeverIdle), 1));
        let s = w.step(counters(495, 0, 1), ended(2), BS);
        assert_eq!(s.finding, None);
    }
}
