//! Silent recomputes: a decode that was due a prompt's KV from its prefill but computed the
//! prompt itself. The answer is right, only its time to first token was not disaggregated,
//! so nothing fails and nobody notices unless it is counted. Two ways to see one, both from
//! what vLLM itself reports, never from anything only the simulator has:
//!
//! - per request, decode's `usage.prompt_tokens_details.cached_tokens` (vLLM with
//!   `--enable-prompt-tokens-details`): vLLM counts KV that arrived through its connector as
//!   cached, so a handed-off prompt shows almost all its tokens cached. Far fewer means
//!   decode computed them ([`Judgment`]).
//! - per scrape interval, decode's `vllm:prompt_tokens_by_source_total{source="local_compute"}`
//!   (vLLM 0.26+): growth beyond what the handoffs due leave to compute (the last partial
//!   block plus one token each, a block at most) is recompute ([`DecodeWatch`]).
//!
//! Each request is counted by one of them only: one the proxy can judge by its own answer
//! (decode is known to report `cached_tokens` and the answer carries usage) is judged per
//! request, and the tokens it computed are taken out of the counters' growth before the
//! scraper judges what is left. The scraper waits for every such request in flight to be
//! judged before it settles an interval, so a long stream cannot be counted twice.

use super::instances::Instance;
use super::metrics::Metrics;
use super::protocol::Body;
use crate::prometheus::{label_value, samples};
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// Block size assumed for a decode whose `/metrics` does not say (vLLM's default on GPUs).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Metrics reason of a miss seen in one request's own usage.
pub const MISS_USAGE: &str = "decode_cached_tokens_low";
/// vLLM's counter of prompt tokens by where their KV came from.
pub const BY_SOURCE: &str = "vllm:prompt_tokens_by_source_total";
/// The `source` label values of [`BY_SOURCE`], in [`PromptSources::as_array`] order.
pub const SOURCES: [&str; 3] = ["local_compute", "local_cache_hit", "external_kv_transfer"];
/// vLLM's info gauge whose `block_size` label is the engine's KV block size.
const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// Intervals merged at most while requests judged per request are still in flight; past
/// that the merged interval is dropped unjudged rather than risk counting a miss twice.
pub const MAX_MERGED: u32 = 30;

/// Prompt tokens of a decode by source, as vLLM counts them (cumulative, or a difference).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptSources {
    /// Tokens the engine computed itself.
    pub local_compute: u64,
    /// Tokens found in its own prefix cache.
    pub local_cache_hit: u64,
    /// Tokens whose KV arrived through its KV connector (the handoff).
    pub external_kv_transfer: u64,
}

impl PromptSources {
    /// The counters on a `/metrics` page, summed over engines and models; `None` when the
    /// page has no [`BY_SOURCE`] (not vLLM, or a vLLM older than 0.26).
    pub fn read(text: &str) -> Option<PromptSources> {
        let mut sums = [0f64; 3];
        let mut found = false;
        for s in samples(text).filter(|s| s.name == BY_SOURCE) {
            found = true;
            let source = label_value(s.labels, "source");
            if let Some(i) = SOURCES.iter().position(|x| Some(*x) == source.as_deref()) {
                sums[i] += s.value.max(0.0);
            }
        }
        let [c, h, e] = sums.map(|v| v.round() as u64);
        found.then_some(PromptSources {
            local_compute: c,
            local_cache_hit: h,
            external_kv_transfer: e,
        })
    }

    /// The three counts in [`SOURCES`] order.
    pub fn as_array(self) -> [u64; 3] {
        [
            self.local_compute,
            self.local_cache_hit,
            self.external_kv_transfer,
        ]
    }

    /// All prompt tokens.
    pub fn total(self) -> u64 {
        self.as_array().iter().sum()
    }

    /// The growth since `before`; `None` when a counter went down (the engine restarted).
    fn since(self, before: PromptSources) -> Option<PromptSources> {
        Some(PromptSources {
            local_compute: self.local_compute.checked_sub(before.local_compute)?,
            local_cache_hit: self.local_cache_hit.checked_sub(before.local_cache_hit)?,
            external_kv_transfer: self
                .external_kv_transfer
                .checked_sub(before.external_kv_transfer)?,
        })
    }

    fn add(&mut self, other: PromptSources) {
        self.local_compute += other.local_compute;
        self.local_cache_hit += other.local_cache_hit;
        self.external_kv_transfer += other.external_kv_transfer;
    }
}

/// The KV block size a vLLM page states in `vllm:cache_config_info{block_size="..."}`.
pub fn block_size(text: &str) -> Option<u32> {
    samples(text)
        .filter(|s| s.name == CACHE_CONFIG_INFO)
        .find_map(|s| label_value(s.labels, "block_size")?.parse().ok())
        .filter(|b| *b > 0)
}

/// What the request path tells the scraper about one decode instance, and what the scraper
/// learned about it: kept on the instance, all atomics.
#[derive(Debug, Default)]
pub struct HandoffLedger {
    /// Prompts sent with a handoff due that are not judged per request.
    due: AtomicU64,
    /// Requests sent that are judged per request, and those judged (or given up) since.
    judged_sent: AtomicU64,
    judged_done: AtomicU64,
    /// Prompt tokens the judged requests computed themselves (prompt minus cached tokens).
    explained_tokens: AtomicU64,
    /// Legs sent knowing decode recomputes (already counted as misses when sent).
    known_recomputes: AtomicU64,
    /// This decode answered with `usage.prompt_tokens_details` at least once.
    reports_cached: AtomicBool,
    /// Its `/metrics` had [`BY_SOURCE`] at the last scrape.
    has_counters: AtomicBool,
    /// The block size its `/metrics` stated (0: not known).
    block_size: AtomicU32,
    /// Prompt tokens its counters grew by while this proxy watched, by source.
    seen: [AtomicU64; 3],
}

/// The ledger's counts at one moment (or the difference of two moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerSnapshot {
    pub due: u64,
    pub judged_sent: u64,
    pub judged_done: u64,
    pub explained_tokens: u64,
    pub known_recomputes: u64,
}

impl LedgerSnapshot {
    /// Judged requests whose answer has not been judged yet.
    fn in_flight(self) -> u64 {
        self.judged_sent.saturating_sub(self.judged_done)
    }

    fn since(self, b: LedgerSnapshot) -> LedgerSnapshot {
        LedgerSnapshot {
            due: self.due.saturating_sub(b.due),
            judged_sent: self.judged_sent.saturating_sub(b.judged_sent),
            judged_done: self.judged_done.saturating_sub(b.judged_done),
            explained_tokens: self.explained_tokens.saturating_sub(b.explained_tokens),
            known_recomputes: self.known_recomputes.saturating_sub(b.known_recomputes),
        }
    }

    fn add(&mut self, d: LedgerSnapshot) {
        self.due += d.due;
        self.judged_sent += d.judged_sent;
        self.judged_done += d.judged_done;
        self.explained_tokens += d.explained_tokens;
        self.known_recomputes += d.known_recomputes;
    }
}

impl HandoffLedger {
    /// The counts now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        LedgerSnapshot {
            due: self.due.load(Relaxed),
            judged_sent: self.judged_sent.load(Relaxed),
            judged_done: self.judged_done.load(Relaxed),
            explained_tokens: self.explained_tokens.load(Relaxed),
            known_recomputes: self.known_recomputes.load(Relaxed),
        }
    }

    /// The decode's block size: what its `/metrics` said, else [`DEFAULT_BLOCK_SIZE`].
    pub fn block_size(&self) -> u64 {
        match self.block_size.load(Relaxed) {
            0 => u64::from(DEFAULT_BLOCK_SIZE),
            b => u64::from(b),
        }
    }

    /// Records the block size its `/metrics` states.
    pub fn set_block_size(&self, b: u32) {
        self.block_size.store(b, Relaxed);
    }

    /// Records whether its `/metrics` has [`BY_SOURCE`]; returns the previous answer.
    pub fn set_has_counters(&self, has: bool) -> bool {
        self.has_counters.swap(has, Relaxed)
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

/// What the proxy expects of decode's KV for one decode leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// A handoff is due for each of the request's prompts.
    Handoff { prompts: u64 },
    /// Decode recomputes the prompt and the proxy knows it (already counted as a miss).
    Recompute,
}

/// The number of prompts of a request (a completions `prompt` may be a list of them).
pub fn prompts(body: &Body) -> u64 {
    match body.get("prompt") {
        Some(Value::Array(items))
            if items.first().is_some_and(|v| v.is_string() || v.is_array()) =>
        {
            items.len() as u64
        }
        _ => 1,
    }
}

/// Whether a streamed request asked for the usage chunk (`stream_options.include_usage`).
pub fn asks_usage(body: &Body) -> bool {
    body.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true)
}

/// Notes a decode leg about to be sent on `inst`, and returns the check of its answer when
/// the answer can show a miss (`usage_expected`: a whole answer, or a stream that asked for
/// usage).
pub fn leg_sent(
    metrics: &Arc<Metrics>,
    inst: &Arc<Instance>,
    expect: Expect,
    usage_expected: bool,
    request_id: &str,
) -> Option<Judgment> {
    let ledger = &inst.ledger;
    let prompts = match expect {
        Expect::Recompute => {
            ledger.known_recomputes.fetch_add(1, Relaxed);
            return None;
        }
        Expect::Handoff { prompts } => prompts,
    };
    // vLLM reports cached_tokens of the last prompt only: one prompt or no judgment.
    let judgeable = prompts == 1 && usage_expected;
    let owner = judgeable && ledger.reports_cached.load(Relaxed);
    if owner {
        ledger.judged_sent.fetch_add(1, Relaxed);
    } else {
        ledger.due.fetch_add(prompts, Relaxed);
    }
    judgeable.then(|| Judgment {
        inst: inst.clone(),
        metrics: metrics.clone(),
        request_id: request_id.to_string(),
        owner,
        done: false,
    })
}

/// The check of one decode answer's usage for a recompute. An owner (decode was known to
/// report `cached_tokens` when the leg was sent) counts what it finds and tells the
/// scraper the tokens decode computed; any other only logs, since the scraper counts its
/// request from the counters (it counts too when decode has no such counters). Dropped
/// unjudged (no usage, failed leg), an owner hands its request back to the scraper.
#[derive(Debug)]
pub struct Judgment {
    inst: Arc<Instance>,
    metrics: Arc<Metrics>,
    request_id: String,
    owner: bool,
    done: bool,
}

/// The usage of an answer, the fields a recompute shows in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct UsageSeen {
    pub prompt_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl UsageSeen {
    /// A usage of `prompt` tokens with `cached` of them cached, if given.
    #[cfg(test)]
    pub fn new(prompt: u64, cached: Option<u64>) -> UsageSeen {
        UsageSeen {
            prompt_tokens: prompt,
            prompt_tokens_details: cached.map(|c| PromptDetails {
                cached_tokens: Some(c),
            }),
        }
    }

    /// `prompt_tokens_details.cached_tokens`, when the answer has it.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

/// The last `"usage"` object in a whole answer or in stream chunks; `None` when there is
/// none or the last one is `null`. Only the usage value is parsed, not the answer around
/// it: a key `"usage"` cannot occur inside a JSON string (its quotes would be escaped).
pub fn usage_in(bytes: &[u8]) -> Option<UsageSeen> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = bytes.len();
    while let Some(at) = bytes[..end].windows(KEY.len()).rposition(|w| w == KEY) {
        let rest = bytes[at + KEY.len()..].trim_ascii_start();
        if let Some(value) = rest.strip_prefix(b":") {
            let mut de = serde_json::Deserializer::from_slice(value);
            return Option::<UsageSeen>::deserialize(&mut de).ok().flatten();
        }
        end = at; // the string "usage" as a value: look further back
    }
    None
}

impl Judgment {
    /// Judges decode's answer by its usage; the metrics reason when decode recomputed.
    pub fn judge(mut self, usage: Option<UsageSeen>) -> Option<&'static str> {
        let ledger = &self.inst.ledger;
        let usage = usage?; // dropped unjudged: see Drop
        let cached = match usage.cached_tokens() {
            Some(c) => {
                ledger.reports_cached.store(true, Relaxed);
                c
            }
            // vLLM leaves prompt_tokens_details out when cached_tokens is 0.
            None if ledger.reports_cached.load(Relaxed) => 0,
            None => return None,
        };
        self.done = true;
        let computed = usage.prompt_tokens.saturating_sub(cached);
        if self.owner {
            ledger.explained_tokens.fetch_add(computed, Relaxed);
            ledger.judged_done.fetch_add(1, Relaxed);
        }
        let leaves = ledger.block_size();
        if computed <= leaves {
            return None;
        }
        let counted = self.owner || !ledger.has_counters.load(Relaxed);
        if counted {
            self.metrics.handoff_miss(MISS_USAGE);
            self.metrics.recomputed_tokens(computed);
        }
        tracing::warn!(
            request_id = %self.request_id,
            decode = %self.inst.url,
            "KV handoff missed: decode {} computed {computed} of {} prompt tokens itself (usage.prompt_tokens_details.cached_tokens = {cached}; a handoff leaves at most {leaves}); the answer is right but its TTFT was not disaggregated{}",
            self.inst.url,
            usage.prompt_tokens,
            if counted { "" } else { " (counted from its vllm:prompt_tokens_by_source_total)" }
        );
        Some(MISS_USAGE)
    }
}

impl Drop for Judgment {
    fn drop(&mut self) {
        if self.owner && !self.done {
            let ledger = &self.inst.ledger;
            ledger.due.fetch_add(1, Relaxed);
            ledger.judged_done.fetch_add(1, Relaxed);
        }
    }
}

/// One decode's counters followed from scrape to scrape.
#[derive(Debug, Default)]
pub struct DecodeWatch {
    /// Counters and ledger at the last scrape (none before the first: the baseline).
    last: Option<(PromptSources, LedgerSnapshot)>,
    /// Growth since the last settlement.
    open: (PromptSources, LedgerSnapshot),
    merged: u32,
    carry: Carry,
}

/// What one settled interval leaves to the next: a prefill may be counted by the engine an
/// interval after the proxy sent it, and an answer judged before the engine's counters
/// that the scraper read show its prompt.
#[derive(Debug, Default, Clone, Copy)]
struct Carry {
    /// Unused credit (tokens, at most 0), from this interval's own handoffs only.
    balance: i64,
    /// Handoffs due in that interval.
    due: u64,
    /// Whether it had legs the proxy knew would recompute.
    known: bool,
}

/// What one scrape of a decode found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Growth of its counters since the last scrape.
    pub tokens: PromptSources,
    /// Its counters went down: the engine restarted; counting starts again from here.
    pub restarted: bool,
    pub finding: Option<Finding>,
}

/// Recompute found in a decode's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finding {
    /// `local_compute` growth beyond what the handoffs due leave to compute.
    pub recomputed_tokens: u64,
    /// Requests that recomputed, estimated from the mean prompt length (at least 1, at most
    /// `due`).
    pub misses: u64,
    /// Handoffs due (not judged per request) in the interval.
    pub due: u64,
}

impl DecodeWatch {
    /// Takes one scrape: the decode's counters `now` and its ledger read after them.
    pub fn step(&mut self, now: PromptSources, ledger: LedgerSnapshot, block_size: u64) -> Step {
        let Some((before, ledger_before)) = self.last.replace((now, ledger)) else {
            return Step::default();
        };
        let Some(tokens) = now.since(before) else {
            *self = DecodeWatch {
                last: Some((now, ledger)),
                ..DecodeWatch::default()
            };
            return Step {
                restarted: true,
                ..Step::default()
            };
        };
        self.open.0.add(tokens);
        self.open.1.add(ledger.since(ledger_before));
        self.merged += 1;
        let mut step = Step {
            tokens,
            ..Step::default()
        };
        if ledger.in_flight() > 0 {
            if self.merged >= MAX_MERGED {
                self.open = Default::default();
                self.merged = 0;
                self.carry = Carry::default();
            }
            return step;
        }
        let (grown, l) = std::mem::take(&mut self.open);
        self.merged = 0;
        step.finding = self.settle(grown, l, block_size);
        step
    }

    /// Judges a settled interval: the decode's own computing against what was due.
    fn settle(&mut self, grown: PromptSources, l: LedgerSnapshot, bs: u64) -> Option<Finding> {
        let credits = (l.due * bs + l.explained_tokens) as i64;
        let balance = grown.local_compute as i64 - credits + self.carry.balance;
        let due = l.due + self.carry.due;
        let tainted = l.known_recomputes > 0 || self.carry.known;
        self.carry = Carry {
            balance: balance.clamp(-credits, 0),
            due: l.due,
            known: l.known_recomputes > 0,
        };
        // No handoff due: growth from traffic that did not pass this proxy.
        if tainted || balance <= 0 || due == 0 {
            return None;
        }
        let tokens = balance as u64;
        let prompts = (l.due + l.judged_sent).max(1);
        let mean = (grown.total() / prompts).max(1);
        Some(Finding {
            recomputed_tokens: tokens,
            misses: tokens.div_ceil(mean).clamp(1, due),
            due,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::instances::{Leg, parse_endpoint};
    use serde_json::json;

    fn page(compute: u64, hit: u64, external: u64) -> String {
        let mut s = String::from(
            "# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n\
             # TYPE vllm:prompt_tokens_by_source counter\n",
        );
        for (source, n) in SOURCES.iter().zip([compute, hit, external]) {
            s.push_str(&format!(
                "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"{source}\"}} {n}.0\n"
            ));
        }
        s
    }

    fn sources(c: u64, h: u64, e: u64) -> PromptSources {
        PromptSources {
            local_compute: c,
            local_cache_hit: h,
            external_kv_transfer: e,
        }
    }

    fn due(n: u64) -> LedgerSnapshot {
        LedgerSnapshot {
            due: n,
            ..LedgerSnapshot::default()
        }
    }

    #[test]
    fn vllm_counters_are_read_by_source_and_summed_over_engines() {
        let mut text = page(10, 20, 30);
        text.push_str(
            "vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"local_compute\"} 5\n\
             vllm:prompt_tokens_by_source_created{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 1.7e9\n\
             vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n",
        );
        assert_eq!(PromptSources::read(&text), Some(sources(15, 20, 30)));
        assert_eq!(block_size(&text), Some(32));
        assert_eq!(PromptSources::read("vllm:prompt_tokens_total 5\n"), None);
        assert_eq!(block_size("vllm:prompt_tokens_total 5\n"), None);
    }

    #[test]
    fn good_handoffs_leave_nothing_and_a_lost_one_is_found() {
        let mut w = DecodeWatch::default();
        assert_eq!(w.step(sources(100, 0, 0), due(0), 16), Step::default());
        // Three 70-token prompts handed off: 6 tokens each computed, under 16 per handoff.
        let s = w.step(sources(118, 0, 192), due(3), 16);
        assert_eq!(s.tokens, sources(18, 0, 192));
        assert_eq!(s.finding, None);
        // One more handoff due, and the whole 70-token prompt computed. The last interval's
        // unused credit (3 * 16 - 18) still counts, in case a prefill was counted late.
        let s = w.step(sources(188, 0, 192), due(4), 16);
        assert_eq!(
            s.finding,
            Some(Finding {
                recomputed_tokens: 70 - 16 - 30,
                misses: 1,
                due: 1 + 3
            })
        );
    }

    #[test]
    fn a_prefill_counted_an_interval_after_its_handoff_was_sent_is_still_judged() {
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), due(0), 16);
        // Sent, not yet prefilled: unused credit carried.
        assert_eq!(w.step(sources(0, 0, 0), due(1), 16).finding, None);
        let f = w.step(sources(70, 0, 0), due(1), 16).finding.unwrap();
        assert_eq!((f.recomputed_tokens, f.misses, f.due), (54, 1, 1));
        // Credit does not pile up beyond one interval: a later lone miss is found.
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), due(0), 16);
        w.step(sources(0, 0, 640), due(10), 16);
        w.step(sources(0, 0, 640), due(10), 16);
        let f = w.step(sources(70, 0, 640), due(11), 16).finding.unwrap();
        assert_eq!(f.recomputed_tokens, 54);
    }

    #[test]
    fn several_misses_are_estimated_from_the_mean_prompt() {
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), due(0), 16);
        // Five 100-token prompts, two lost: 2 * 100 + 3 * 4 computed, 3 * 96 received.
        let f = w.step(sources(212, 0, 288), due(5), 16).finding.unwrap();
        assert_eq!((f.recomputed_tokens, f.misses), (212 - 80, 2));
    }

    #[test]
    fn growth_with_no_handoff_due_or_after_a_known_recompute_is_not_a_miss() {
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), due(0), 16);
        assert_eq!(w.step(sources(500, 0, 0), due(0), 16).finding, None);
        let known = LedgerSnapshot {
            due: 1,
            known_recomputes: 1,
            ..LedgerSnapshot::default()
        };
        assert_eq!(w.step(sources(600, 0, 0), known, 16).finding, None);
        // The known recompute's prompt may land an interval late.
        let later = LedgerSnapshot {
            due: 2,
            known_recomputes: 1,
            ..LedgerSnapshot::default()
        };
        assert_eq!(w.step(sources(700, 0, 0), later, 16).finding, None);
    }

    #[test]
    fn counters_that_go_down_restart_the_count() {
        let mut w = DecodeWatch::default();
        w.step(sources(500, 0, 0), due(0), 16);
        let s = w.step(sources(10, 0, 0), due(1), 16);
        assert!(s.restarted && s.finding.is_none());
        assert_eq!(w.step(sources(10, 0, 64), due(2), 16).finding, None);
    }

    #[test]
    fn requests_judged_per_request_hold_the_interval_and_their_tokens_are_taken_out() {
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), LedgerSnapshot::default(), 16);
        let sent = LedgerSnapshot {
            judged_sent: 1,
            ..LedgerSnapshot::default()
        };
        // Its prefill recomputed 70 tokens while its stream still runs: not judged yet.
        assert_eq!(w.step(sources(70, 0, 0), sent, 16).finding, None);
        let judged = LedgerSnapshot {
            judged_sent: 1,
            judged_done: 1,
            explained_tokens: 70,
            ..LedgerSnapshot::default()
        };
        assert_eq!(w.step(sources(70, 0, 0), judged, 16).finding, None);
        // An unjudged handoff lost in the same merged interval is still found.
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), LedgerSnapshot::default(), 16);
        let mixed = LedgerSnapshot {
            due: 1,
            judged_sent: 1,
            ..LedgerSnapshot::default()
        };
        w.step(sources(140, 0, 0), mixed, 16);
        let done = LedgerSnapshot {
            judged_done: 1,
            explained_tokens: 70,
            ..mixed
        };
        let f = w.step(sources(140, 0, 0), done, 16).finding.unwrap();
        assert_eq!((f.recomputed_tokens, f.misses), (54, 1));
    }

    #[test]
    fn an_interval_held_too_long_is_dropped_unjudged() {
        let mut w = DecodeWatch::default();
        w.step(sources(0, 0, 0), LedgerSnapshot::default(), 16);
        let stuck = LedgerSnapshot {
            due: 1,
            judged_sent: 1,
            ..LedgerSnapshot::default()
        };
        for i in 0..MAX_MERGED {
            assert_eq!(w.step(sources(70, 0, 0), stuck, 16).finding, None, "{i}");
        }
        let done = LedgerSnapshot {
            judged_done: 1,
            ..stuck
        };
        assert_eq!(w.step(sources(70, 0, 0), done, 16).finding, None);
    }

    #[test]
    fn usage_is_found_at_the_end_of_answers_and_stream_chunks() {
        let whole = json!({"id": "cmpl-1", "choices": [{"text": "the \"usage\": is", "index": 0}],
            "usage": {"prompt_tokens": 70, "completion_tokens": 8, "total_tokens": 78,
                      "prompt_tokens_details": {"cached_tokens": 64}},
            "kv_transfer_params": null});
        let u = usage_in(whole.to_string().as_bytes()).unwrap();
        assert_eq!((u.prompt_tokens, u.cached_tokens()), (70, Some(64)));
        let no_details = br#"{"choices":[],"usage":{"prompt_tokens":70,"completion_tokens":1,"prompt_tokens_details":null}}"#;
        assert_eq!(usage_in(no_details), Some(UsageSeen::new(70, None)));
        let chunks = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\": {\"prompt_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(usage_in(chunks), Some(UsageSeen::new(9, Some(0))));
        assert_eq!(usage_in(b"data: {\"choices\":[],\"usage\":null}\n\n"), None);
        assert_eq!(usage_in(br#"{"stop_reason":"usage"}"#), None);
        assert_eq!(usage_in(b"data: {\"usage\":{\"prompt_tok"), None);
        assert_eq!(usage_in(b""), None);
    }

    #[test]
    fn prompts_and_usage_requests_are_read_from_the_body() {
        let body = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(prompts(&body(json!({"prompt": "a"}))), 1);
        assert_eq!(prompts(&body(json!({"prompt": ["a", "b"]}))), 2);
        assert_eq!(prompts(&body(json!({"prompt": [1, 2, 3]}))), 1);
        assert_eq!(prompts(&body(json!({"prompt": [[1], [2]]}))), 2);
        assert_eq!(prompts(&body(json!({"messages": []}))), 1);
        assert!(asks_usage(&body(
            json!({"stream_options": {"include_usage": true}})
        )));
        assert!(!asks_usage(&body(json!({"stream": true}))));
    }

    fn decode() -> Arc<Instance> {
        Arc::new(Instance::new(
            Leg::Decode,
            0,
            parse_endpoint("10.0.0.9:8200").unwrap(),
            None,
        ))
    }

    fn misses(m: &Metrics) -> String {
        m.render(&crate::proxy::instances::Pools {
            prefill: vec![],
            decode: vec![],
        })
    }

    #[test]
    fn an_answer_with_few_cached_tokens_is_a_miss_counted_once() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        let handoff = Expect::Handoff { prompts: 1 };
        inst.ledger.set_has_counters(true);
        // Not yet known to report cached_tokens: left to the counters, only logged.
        let j = leg_sent(&m, &inst, handoff, true, "r1").unwrap();
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(6)))), Some(MISS_USAGE));
        assert_eq!(inst.ledger.snapshot().due, 1);
        assert!(!misses(&m).contains(MISS_USAGE));
        // Now known: judged and counted here, its tokens handed to the scraper.
        let j = leg_sent(&m, &inst, handoff, true, "r2").unwrap();
        assert_eq!(inst.ledger.snapshot().in_flight(), 1);
        assert_eq!(j.judge(Some(UsageSeen::new(70, None))), Some(MISS_USAGE));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.in_flight(), l.explained_tokens), (1, 0, 70));
        let text = misses(&m);
        assert!(
            text.contains(
                "pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains("pdctl_proxy_kv_handoff_recomputed_tokens_total 70\n"));
        // A working handoff: 64 of 70 cached.
        let j = leg_sent(&m, &inst, handoff, true, "r3").unwrap();
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(64)))), None);
        assert_eq!(inst.ledger.snapshot().explained_tokens, 76);
        // An answer without usage goes back to the counters.
        drop(leg_sent(&m, &inst, handoff, true, "r4").unwrap());
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.in_flight()), (2, 0));
    }

    #[test]
    fn a_decode_without_counters_has_its_usage_misses_counted_and_others_are_not_judged() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        let j = leg_sent(&m, &inst, Expect::Handoff { prompts: 1 }, true, "r").unwrap();
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(0)))), Some(MISS_USAGE));
        assert!(misses(&m).contains("reason=\"decode_cached_tokens_low\"} 1\n"));
        assert!(leg_sent(&m, &inst, Expect::Handoff { prompts: 2 }, true, "r").is_none());
        assert!(leg_sent(&m, &inst, Expect::Handoff { prompts: 1 }, false, "r").is_none());
        assert!(leg_sent(&m, &inst, Expect::Recompute, true, "r").is_none());
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.known_recomputes), (1 + 2 + 1, 1));
        // Usage without details from a decode never seen to report them says nothing.
        let j = decode();
        let judgment = leg_sent(&m, &j, Expect::Handoff { prompts: 1 }, true, "r").unwrap();
        assert_eq!(judgment.judge(Some(UsageSeen::new(70, None))), None);
    }
}
