//! Silent recomputes: a decode that was due a prompt's KV from its prefill but computed the
//! prompt itself. The answer is right, only its time to first token was not disaggregated,
//! so nothing fails and nobody notices unless it is counted. Two ways to see one, both from
//! what vLLM itself reports, never from anything only the simulator has:
//!
//! - per request, decode's `usage.prompt_tokens_details.cached_tokens` (vLLM with
//!   `--enable-prompt-tokens-details`, which the plan gives decode instances): vLLM counts
//!   the prompt tokens it did not compute, from its prefix cache and from its KV connector
//!   alike, so a handed-off prompt shows all but its last partial block cached. Far fewer
//!   means decode computed them ([`Judgment`]). Not when the decode request carries
//!   `kv_transfer_params.remote_prefill_cached_tokens` (NixlConnector, vLLM 0.32+): vLLM then
//!   reports the prefill's own cache hits there instead, which say nothing of the handoff.
//! - per window between two scrapes, decode's
//!   `vllm:prompt_tokens_by_source_total{source="local_compute"}` (vLLM 0.26+): growth beyond
//!   what the handoffs that ended in the window leave to compute (the last partial block,
//!   at most one block each; the block size from `vllm:cache_config_info`) is recompute
//!   ([`DecodeWatch`]). A window is judged only when it can be attributed: no decode leg of
//!   this proxy in flight when it closes (so every prompt counted in it belongs to a leg that
//!   ended in it), and no more prompts prefilled by decode (its
//!   `vllm:time_to_first_token_seconds_count`) than the legs that ended (so no request that
//!   reached decode another way is taken for a miss). Other windows merge into the next or
//!   are left unjudged: a miss may go uncounted, none is counted twice or made up.
//!
//! Each leg is counted by one of them only: one the proxy judges by its own answer is taken
//! out of the window's growth (its computed tokens explained) before the window is judged.

use super::instances::Instance;
use super::metrics::Metrics;
use super::protocol::Body;
use crate::prometheus::{label_value, samples, sum};
use serde::Deserialize;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

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
/// One observation per prompt the engine prefilled, made in the same stats update that
/// adds the prompt to [`BY_SOURCE`]: how many prompts a window's token growth came from.
pub const PREFILLS: &str = "vllm:time_to_first_token_seconds_count";
/// Windows merged at most while decode legs are in flight; past that the merged window is
/// dropped unjudged rather than judged with legs whose prompts may or may not be counted.
pub const MAX_MERGED: u32 = 30;

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

/// What one read of a decode's `/metrics` gives the window check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeCounters {
    /// Prompt tokens by source ([`BY_SOURCE`]).
    pub sources: PromptSources,
    /// Prompts prefilled ([`PREFILLS`], summed over engines); `None` when the page lacks it.
    pub prefills: Option<u64>,
}

impl DecodeCounters {
    /// The counters on a `/metrics` page; `None` without [`BY_SOURCE`].
    pub fn read(text: &str) -> Option<DecodeCounters> {
        Some(DecodeCounters {
            sources: PromptSources::read(text)?,
            prefills: sum(text, &[PREFILLS]).map(|v| v.max(0.0).round() as u64),
        })
    }
}

/// What the request path tells the scraper about one decode instance, and what the scraper
/// learned about it: kept on the instance.
#[derive(Debug, Default)]
pub struct HandoffLedger {
    /// The leg counts, under one lock so that a snapshot never sees a leg ended in one
    /// count and not yet in another.
    counts: Mutex<LedgerSnapshot>,
    /// This decode answered with `usage.prompt_tokens_details` at least once.
    reports_cached: AtomicBool,
    /// Its `/metrics` had [`BY_SOURCE`] at the last scrape.
    has_counters: AtomicBool,
    /// The block size its `/metrics` stated (0: not known).
    block_size: AtomicU32,
    /// Prompt tokens its counters grew by while this proxy watched, by source.
    seen: [AtomicU64; 3],
}

/// The ledger's leg counts at one moment (or the difference of two moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// Decode legs sent.
    pub sent: u64,
    /// Decode legs that ended (answered, failed or dropped); each also in one count below.
    pub ended: u64,
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

    /// Prompts of the ended legs: the engine requests this proxy can account for.
    fn prompts(self) -> u64 {
        self.due + self.judged + self.known_recomputes
    }

    fn since(self, b: LedgerSnapshot) -> LedgerSnapshot {
        LedgerSnapshot {
            sent: self.sent.saturating_sub(b.sent),
            ended: self.ended.saturating_sub(b.ended),
            due: self.due.saturating_sub(b.due),
            judged: self.judged.saturating_sub(b.judged),
            explained_tokens: self.explained_tokens.saturating_sub(b.explained_tokens),
            known_recomputes: self.known_recomputes.saturating_sub(b.known_recomputes),
        }
    }

    fn add(&mut self, d: LedgerSnapshot) {
        self.sent += d.sent;
        self.ended += d.ended;
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

    fn update(&self, f: impl FnOnce(&mut LedgerSnapshot)) {
        f(&mut self.counts.lock().unwrap_or_else(|p| p.into_inner()));
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
    /// A handoff is due for each of the request's prompts. `own_usage`: decode's
    /// `cached_tokens` will count its own cache and the handoff (false when the decode
    /// request carries the prefill's `remote_prefill_cached_tokens`, which vLLM reports
    /// in their place).
    Handoff { prompts: u64, own_usage: bool },
    /// Decode recomputes the prompt and the proxy knows it (already counted as a miss).
    Recompute,
}

impl Expect {
    /// A handoff due for the request `body`'s prompts, sent to decode as `decode_body`
    /// (`None`: the client's body unchanged).
    pub fn handoff(body: &Body, decode_body: Option<&Body>) -> Expect {
        let carries_prefill_cache = decode_body
            .and_then(|b| b.get("kv_transfer_params"))
            .and_then(|kv| kv.get("remote_prefill_cached_tokens"))
            .is_some_and(|v| !v.is_null());
        Expect::Handoff {
            prompts: prompts(body),
            own_usage: !carries_prefill_cache,
        }
    }
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

/// Notes a decode leg about to be sent on `inst`, and returns the leg's account: judge it
/// with the answer's usage when there is one (`usage_expected`: a whole answer, or a stream
/// that asked for usage), or drop it when the leg ends; either way the leg counts as ended
/// once, for the window check.
pub fn leg_sent(
    metrics: &Arc<Metrics>,
    inst: &Arc<Instance>,
    expect: Expect,
    usage_expected: bool,
    request_id: &str,
) -> Judgment {
    let ledger = &inst.ledger;
    let role = match expect {
        Expect::Recompute => Role::Known,
        // vLLM reports cached_tokens of the last prompt only: one prompt or no judgment.
        Expect::Handoff {
            prompts: 1,
            own_usage: true,
        } if usage_expected => {
            if ledger.reports_cached.load(Relaxed) {
                Role::Owner
            } else {
                Role::Watcher
            }
        }
        Expect::Handoff { prompts, .. } => Role::Counted { prompts },
    };
    ledger.update(|c| c.sent += 1);
    Judgment {
        inst: inst.clone(),
        metrics: metrics.clone(),
        request_id: request_id.to_string(),
        role,
        ended: false,
    }
}

/// One decode leg's account. An owner (decode was known to report `cached_tokens` when the
/// leg was sent) judges the answer's usage, counts a miss it finds and tells the scraper
/// the tokens decode computed; a watcher reads the usage for the log line only (and learns
/// that decode reports it), leaving the count to the window check, except on a decode
/// without counters. Dropped unjudged (no usage, failed leg), every leg ends as one the
/// window check accounts for.
#[derive(Debug)]
pub struct Judgment {
    inst: Arc<Instance>,
    metrics: Arc<Metrics>,
    request_id: String,
    role: Role,
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Owner,
    Watcher,
    /// Left to the window check: several prompts, no usage expected, or a usage that does
    /// not show the handoff.
    Counted {
        prompts: u64,
    },
    Known,
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
        if !matches!(self.role, Role::Owner | Role::Watcher) {
            return None; // ends on drop
        }
        let ledger = &self.inst.ledger;
        let usage = usage?; // no usage: ends on drop, left to the window check
        let cached = match usage.cached_tokens() {
            Some(c) => {
                ledger.reports_cached.store(true, Relaxed);
                c
            }
            None if ledger.reports_cached.load(Relaxed) => 0,
            None => return None,
        };
        let computed = usage.prompt_tokens.saturating_sub(cached);
        let owner = self.role == Role::Owner;
        if owner {
            self.ended = true;
            ledger.update(|c| {
                c.ended += 1;
                c.judged += 1;
                c.explained_tokens += computed;
            });
        }
        let leaves = ledger.block_size();
        if computed <= leaves {
            return None;
        }
        let counted = owner || !ledger.has_counters.load(Relaxed);
        if counted {
            self.metrics.handoff_miss(MISS_USAGE);
            self.metrics.recomputed_tokens(computed);
        }
        tracing::warn!(
            request_id = %self.request_id,
            decode = %self.inst.url,
            recomputed_tokens = computed,
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
        if self.ended {
            return;
        }
        let role = self.role;
        self.inst.ledger.update(|c| {
            c.ended += 1;
            match role {
                Role::Owner | Role::Watcher => c.due += 1,
                Role::Counted { prompts } => c.due += prompts,
                Role::Known => c.known_recomputes += 1,
            }
        });
    }
}

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
    /// Legs stayed in flight for [`MAX_MERGED`] scrapes.
    NeverIdle,
}

/// Recompute found in a decode's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finding {
    /// `local_compute` growth beyond what the handoffs due leave to compute.
    pub recomputed_tokens: u64,
    /// Requests that recomputed, estimated from the mean prompt length (at least 1, at most
    /// `due`).
    pub misses: u64,
    /// Handoffs due (not judged per request) in the window.
    pub due: u64,
}

impl DecodeWatch {
    /// Takes one scrape: `ledger` read before the page was fetched, the decode's counters
    /// `now` on that page. Every leg `ledger` counts as ended had its prompt counted on
    /// the page, so a window closed when none is in flight holds whole legs only.
    pub fn step(&mut self, now: DecodeCounters, ledger: LedgerSnapshot, block_size: u64) -> Step {
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
        let fresh = self.merged == 0;
        self.open.0.add(tokens);
        self.open.1 = match (fresh, self.open.1, prefilled) {
            (true, _, p) => p,
            (false, Some(a), Some(p)) => Some(a + p),
            _ => None,
        };
        self.open.2.add(ledger.since(ledger_before));
        self.merged += 1;
        let mut step = Step {
            tokens,
            ..Step::default()
        };
        if ledger.in_flight() > 0 {
            if self.merged >= MAX_MERGED {
                self.close();
                step.unjudged = Some(Unjudged::NeverIdle);
            }
            return step;
        }
        let (grown, prefilled, legs) = self.close();
        match settle(grown, prefilled, legs, block_size) {
            Ok(finding) => step.finding = finding,
            Err(why) => step.unjudged = Some(why),
        }
        step
    }

    fn close(&mut self) -> (PromptSources, Option<u64>, LedgerSnapshot) {
        self.merged = 0;
        std::mem::take(&mut self.open)
    }
}

/// Judges a closed window: the decode's own computing against what its legs leave to
/// compute. Err: the window cannot be attributed to this proxy's legs.
fn settle(
    grown: PromptSources,
    prefilled: Option<u64>,
    l: LedgerSnapshot,
    bs: u64,
) -> Result<Option<Finding>, Unjudged> {
    // No handoff left to this check, or a leg known to recompute: nothing to find.
    if l.due == 0 || l.known_recomputes > 0 {
        return Ok(None);
    }
    let legs = l.prompts();
    match prefilled {
        None => return Err(Unjudged::PrefillsUnknown),
        Some(p) if p > legs => return Err(Unjudged::OtherTraffic { prefilled: p, legs }),
        Some(_) => {}
    }
    let allowed = l.due * bs + l.explained_tokens;
    let Some(tokens) = grown.local_compute.checked_sub(allowed).filter(|t| *t > 0) else {
        return Ok(None);
    };
    // A miss computes its whole prompt where a handoff leaves at most a block.
    let mean = grown.total() / legs.max(1);
    let per_miss = mean.saturating_sub(bs).max(1);
    Ok(Some(Finding {
        recomputed_tokens: tokens,
        misses: tokens.div_ceil(per_miss).clamp(1, l.due),
        due: l.due,
    }))
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
            due,
            ..LedgerSnapshot::default()
        }
    }

    const BS: u64 = 128;

    #[test]
    fn vllm_counters_are_read_by_source_and_summed_over_engines() {
        let mut text = page(10, 20, 30);
        text.push_str(
            "vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"local_compute\"} 5\n\
             vllm:prompt_tokens_by_source_created{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 1.7e9\n\
             vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
             vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 7.0\n\
             vllm:time_to_first_token_seconds_count{engine=\"1\",model_name=\"m\"} 2.0\n",
        );
        let c = DecodeCounters::read(&text).unwrap();
        assert_eq!(
            c.sources,
            PromptSources {
                local_compute: 15,
                local_cache_hit: 20,
                external_kv_transfer: 30
            }
        );
        assert_eq!(c.prefills, Some(9));
        assert_eq!(block_size(&text), Some(32));
        assert_eq!(DecodeCounters::read(&page(1, 0, 0)).unwrap().prefills, None);
        assert_eq!(DecodeCounters::read("vllm:prompt_tokens_total 5\n"), None);
        assert_eq!(block_size("vllm:prompt_tokens_total 5\n"), None);
    }

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
        assert_eq!((f.recomputed_tokens, f.misses, f.due), (367, 1, 1));
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
        // Without the prefill count the window cannot be judged either.
        let mut w = DecodeWatch::default();
        let blind = |c: u64| DecodeCounters {
            prefills: None,
            ..counters(c, 0, 0)
        };
        w.step(blind(0), ended(0), BS);
        let s = w.step(blind(900), ended(1), BS);
        assert_eq!(
            (s.finding, s.unjudged),
            (None, Some(Unjudged::PrefillsUnknown))
        );
    }

    #[test]
    fn a_window_closes_only_when_no_leg_is_in_flight() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        // A lost handoff's prompt is counted while its stream still runs: held, not judged.
        let running = LedgerSnapshot {
            sent: 1,
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
        assert_eq!((f.recomputed_tokens, f.misses), (367, 1));
        assert_eq!(w.step(counters(495, 0, 1), ended(1), BS).finding, None);
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
        assert_eq!(f.recomputed_tokens, 367);
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
        assert_eq!((f.recomputed_tokens, f.misses), (3210 - 22 * 128, 2));
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
        assert_eq!(w.step(counters(1500, 0, 3), known, BS).finding, None);
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
            sent: 2,
            ended: 2,
            due: 1,
            judged: 1,
            explained_tokens: 495,
            ..LedgerSnapshot::default()
        };
        let f = w.step(counters(990, 0, 2), l, BS).finding.unwrap();
        assert_eq!((f.recomputed_tokens, f.misses, f.due), (367, 1, 1));
        // Judged legs alone leave nothing to this check.
        let judged = LedgerSnapshot {
            sent: 3,
            ended: 3,
            judged: 2,
            explained_tokens: 990,
            ..l
        };
        assert_eq!(w.step(counters(1980, 0, 3), judged, BS).finding, None);
    }

    #[test]
    fn a_window_held_too_long_is_dropped_unjudged() {
        let mut w = DecodeWatch::default();
        w.step(counters(0, 0, 0), ended(0), BS);
        let stuck = LedgerSnapshot {
            sent: 2,
            ended: 1,
            due: 1,
            ..LedgerSnapshot::default()
        };
        for i in 1..MAX_MERGED {
            let s = w.step(counters(495, 0, 1), stuck, BS);
            assert_eq!((s.finding, s.unjudged), (None, None), "{i}");
        }
        let s = w.step(counters(495, 0, 1), stuck, BS);
        assert_eq!(s.unjudged, Some(Unjudged::NeverIdle));
        let s = w.step(counters(495, 0, 1), ended(2), BS);
        assert_eq!(s.finding, None);
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

    const ONE: Expect = Expect::Handoff {
        prompts: 1,
        own_usage: true,
    };

    #[test]
    fn an_answer_with_few_cached_tokens_is_a_miss_counted_once() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        inst.ledger.set_has_counters(true);
        // Not yet known to report cached_tokens: left to the counters, only logged.
        let j = leg_sent(&m, &inst, ONE, true, "r1");
        assert_eq!(inst.ledger.snapshot().in_flight(), 1);
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(6)))), Some(MISS_USAGE));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.in_flight()), (1, 0));
        assert!(!misses(&m).contains(MISS_USAGE));
        // Now known: judged and counted here, its tokens handed to the scraper.
        let j = leg_sent(&m, &inst, ONE, true, "r2");
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(0)))), Some(MISS_USAGE));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.judged, l.explained_tokens), (1, 1, 70));
        let text = misses(&m);
        assert!(
            text.contains(
                "pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains("pdctl_proxy_kv_handoff_recomputed_tokens_total 70\n"));
        // A working handoff: 64 of 70 cached.
        let j = leg_sent(&m, &inst, ONE, true, "r3");
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(64)))), None);
        assert_eq!(inst.ledger.snapshot().explained_tokens, 76);
        // An answer without usage goes back to the counters.
        drop(leg_sent(&m, &inst, ONE, true, "r4"));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.judged, l.sent, l.ended), (2, 2, 4, 4));
    }

    #[test]
    fn every_leg_ends_once_in_the_count_that_fits_it() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        inst.ledger.set_has_counters(true);
        inst.ledger.reports_cached.store(true, Relaxed);
        let nixl = Expect::Handoff {
            prompts: 1,
            own_usage: false,
        };
        // The prefill's cache hits in cached_tokens say nothing of the handoff: not judged.
        let j = leg_sent(&m, &inst, nixl, true, "n");
        assert_eq!(j.judge(Some(UsageSeen::new(900, Some(0)))), None);
        drop(leg_sent(
            &m,
            &inst,
            Expect::Handoff {
                prompts: 3,
                own_usage: true,
            },
            true,
            "p",
        ));
        drop(leg_sent(&m, &inst, ONE, false, "s"));
        drop(leg_sent(&m, &inst, Expect::Recompute, true, "k"));
        let l = inst.ledger.snapshot();
        assert_eq!(
            l,
            LedgerSnapshot {
                sent: 4,
                ended: 4,
                due: 1 + 3 + 1,
                judged: 0,
                explained_tokens: 0,
                known_recomputes: 1
            }
        );
        assert!(!misses(&m).contains(MISS_USAGE));
    }

    #[test]
    fn a_decode_without_counters_has_its_usage_misses_counted() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        let j = leg_sent(&m, &inst, ONE, true, "r");
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(0)))), Some(MISS_USAGE));
        assert!(misses(&m).contains("reason=\"decode_cached_tokens_low\"} 1\n"));
        // Usage without details from a decode never seen to report them says nothing.
        let j = decode();
        let judgment = leg_sent(&m, &j, ONE, true, "r");
        assert_eq!(judgment.judge(Some(UsageSeen::new(70, None))), None);
    }

    #[test]
    fn the_decode_body_says_whether_its_usage_shows_the_handoff() {
        let body = |v: Value| v.as_object().unwrap().clone();
        let client = body(json!({"prompt": "a"}));
        assert_eq!(Expect::handoff(&client, None), ONE);
        let nixl = body(json!({"prompt": "a", "kv_transfer_params": {
            "do_remote_prefill": true, "remote_prefill_cached_tokens": 0}}));
        assert_eq!(
            Expect::handoff(&client, Some(&nixl)),
            Expect::Handoff {
                prompts: 1,
                own_usage: false
            }
        );
        let older =
            body(json!({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_prefill": true}}));
        assert_eq!(
            Expect::handoff(&older, Some(&older)),
            Expect::Handoff {
                prompts: 2,
                own_usage: true
            }
        );
    }
}
