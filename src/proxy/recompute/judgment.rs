//! Judging one decode leg by its own answer: decode's
//! `usage.prompt_tokens_details.cached_tokens` counts every prompt token it did not
//! compute (its prefix cache and its KV connector alike), so a handed-off prompt shows all
//! but what the connector leaves to compute. Every leg is accounted for once: judged here,
//! or left to the window check ([`super::windows`]) when it ends.

use super::ledger::HandoffLedger;
use crate::proxy::instances::Instance;
use crate::proxy::protocol::Body;
use crate::proxy::recorder::Recorder;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// Metrics reason of a miss seen in one request's own usage.
pub const MISS_USAGE: &str = "decode_cached_tokens_low";

/// What the plan says of the decodes' KV, for judging their answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffSettings {
    /// Prompt tokens a good handoff may leave decode to compute (the connector's unit at
    /// the planned block size); 0: one block as decode's `/metrics` states it.
    pub leaves_tokens: u32,
    /// Decodes run with `--enable-prompt-tokens-details`: an answer's usage without
    /// `prompt_tokens_details` means no cached token (vLLM leaves the field out at 0).
    pub details: bool,
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

/// Notes a decode leg about to be sent on `inst`, and returns the leg's account: judge it
/// with the answer's usage when there is one (`usage_expected`: a whole answer, or a
/// stream that carries the usage chunk), or drop it when the leg ends; either way the leg
/// counts as ended once, for the window check.
pub fn leg_sent(
    recorder: &Arc<dyn Recorder>,
    inst: &Arc<Instance>,
    expect: Expect,
    usage_expected: bool,
    settings: HandoffSettings,
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
            if settings.details || ledger.reports_cached.load(Relaxed) {
                Role::Owner
            } else {
                Role::Watcher
            }
        }
        Expect::Handoff { prompts, .. } => Role::Counted { prompts },
    };
    let left = matches!(role, Role::Watcher | Role::Counted { .. });
    ledger.update(|c| {
        c.sent += 1;
        c.left_sent += u64::from(left);
    });
    Judgment {
        inst: inst.clone(),
        recorder: recorder.clone(),
        request_id: request_id.to_string(),
        settings,
        role,
        ended: false,
    }
}

/// One decode leg's account. An owner (decode reports `cached_tokens`, by the plan or as
/// seen before the leg was sent) judges the answer's usage, counts a miss it finds and
/// tells the scraper the tokens decode computed; a watcher reads the usage for the log
/// line only (and learns that decode reports it), leaving the count to the window check,
/// except on a decode without counters. Dropped unjudged (no usage, failed leg), every
/// leg ends as one the window check accounts for.
#[derive(Debug)]
pub struct Judgment {
    inst: Arc<Instance>,
    recorder: Arc<dyn Recorder>,
    request_id: String,
    settings: HandoffSettings,
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
    while let Some(at) = memchr::memmem::rfind(&bytes[..end], KEY) {
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
        let cached = cached_tokens(ledger, usage, self.settings.details)?;
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
        let leaves = ledger.leaves(self.settings.leaves_tokens);
        if computed <= leaves {
            return None;
        }
        let counted = owner || !ledger.has_counters.load(Relaxed);
        if counted {
            self.recorder.handoff_miss(MISS_USAGE);
            self.recorder.recomputed_tokens(computed);
        }
        tracing::warn!(
            request_id = %self.request_id,
            decode = %self.inst.url,
            recomputed_tokens = computed,
            "KV handoff missed: decode {} computed {computed} of {} prompt tokens itself (usage.prompt_tokens_details.cached_tokens = {cached}; a handoff leaves at most {leaves}); the answer is right but its TTFT was not disaggregated{}",
            self.inst.url,
            usage.prompt_tokens,
            if counted {
                ""
            } else {
                " (not counted from this answer: decode was not yet known to report cached tokens, so the leg is left to the window check of its vllm:prompt_tokens_by_source_total, which counts it only if it can attribute its window)"
            }
        );
        Some(MISS_USAGE)
    }
}

/// The cached tokens of an answer's usage: as given; 0 when the field is missing from a
/// decode that reports it (`details` from the plan, or seen before); `None` when a decode
/// never seen to report it leaves it out (nothing can be told).
fn cached_tokens(ledger: &HandoffLedger, usage: UsageSeen, details: bool) -> Option<u64> {
    match usage.cached_tokens() {
        Some(c) => {
            ledger.reports_cached.store(true, Relaxed);
            Some(c)
        }
        None if details || ledger.reports_cached.load(Relaxed) => Some(0),
        None => None,
    }
}

impl Drop for Judgment {
    fn drop(&mut self) {
        let role = self.role;
        let ended = self.ended;
        self.inst.ledger.update(|c| {
            if matches!(role, Role::Watcher | Role::Counted { .. }) {
                c.left_ended += 1;
            }
            if ended {
                return;
            }
            c.ended += 1;
            match role {
                Role::Owner | Role::Watcher => c.due += 1,
                Role::Counted { prompts } => c.due += prompts,
                Role::Known => c.known_recomputes += 1,
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::metrics::Metrics;

    /// The recorder the legs would get: the same counters, seen as events.
    fn rec(m: &Arc<Metrics>) -> Arc<dyn Recorder> {
        m.clone()
    }
    use crate::proxy::instances::{Leg, parse_endpoint};
    use crate::proxy::recompute::ledger::LedgerSnapshot;
    use serde_json::json;

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
    /// Settings of a proxy planned without the details flag or an allowance.
    const UNPLANNED: HandoffSettings = HandoffSettings {
        leaves_tokens: 0,
        details: false,
    };
    const PLANNED: HandoffSettings = HandoffSettings {
        leaves_tokens: 128,
        details: true,
    };

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
    fn prompts_are_read_from_the_body() {
        let body = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(prompts(&body(json!({"prompt": "a"}))), 1);
        assert_eq!(prompts(&body(json!({"prompt": ["a", "b"]}))), 2);
        assert_eq!(prompts(&body(json!({"prompt": [1, 2, 3]}))), 1);
        assert_eq!(prompts(&body(json!({"prompt": [[1], [2]]}))), 2);
        assert_eq!(prompts(&body(json!({"messages": []}))), 1);
    }

    #[test]
    fn an_answer_with_few_cached_tokens_is_a_miss_counted_once() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        inst.ledger.set_has_counters(true);
        // Not yet known to report cached_tokens: left to the counters, only logged.
        let j = leg_sent(&rec(&m), &inst, ONE, true, UNPLANNED, "r1");
        assert_eq!(inst.ledger.snapshot().in_flight(), 1);
        assert_eq!(inst.ledger.snapshot().left_in_flight(), 1);
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(6)))), Some(MISS_USAGE));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.in_flight(), l.left_in_flight()), (1, 0, 0));
        assert!(!misses(&m).contains(MISS_USAGE));
        // Now known: judged and counted here, its tokens handed to the scraper.
        let j = leg_sent(&rec(&m), &inst, ONE, true, UNPLANNED, "r2");
        assert_eq!(inst.ledger.snapshot().left_in_flight(), 0);
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
        let j = leg_sent(&rec(&m), &inst, ONE, true, UNPLANNED, "r3");
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(64)))), None);
        assert_eq!(inst.ledger.snapshot().explained_tokens, 76);
        // An answer without usage goes back to the counters.
        drop(leg_sent(&rec(&m), &inst, ONE, true, UNPLANNED, "r4"));
        let l = inst.ledger.snapshot();
        assert_eq!((l.due, l.judged, l.sent, l.ended), (2, 2, 4, 4));
    }

    #[test]
    fn with_the_plans_details_flag_the_first_answer_is_judged_and_no_details_reads_as_zero() {
        let m = Arc::new(Metrics::default());
        let inst = decode();
        inst.ledger.set_has_counters(true);
        // vLLM leaves prompt_tokens_details out when nothing was cached: a whole miss.
        let j = leg_sent(&rec(&m), &inst, ONE, true, PLANNED, "r1");
        assert_eq!(inst.ledger.snapshot().left_in_flight(), 0);
        assert_eq!(j.judge(Some(UsageSeen::new(495, None))), Some(MISS_USAGE));
        let l = inst.ledger.snapshot();
        assert_eq!((l.judged, l.explained_tokens, l.due), (1, 495, 0));
        assert!(misses(&m).contains("reason=\"decode_cached_tokens_low\"} 1\n"));
        // A handoff leaving the last partial block of 128 (the plan's allowance) is good.
        let j = leg_sent(&rec(&m), &inst, ONE, true, PLANNED, "r2");
        assert_eq!(j.judge(Some(UsageSeen::new(495, Some(384)))), None);
        assert!(misses(&m).contains("reason=\"decode_cached_tokens_low\"} 1\n"));
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
        let j = leg_sent(&rec(&m), &inst, nixl, true, UNPLANNED, "n");
        assert_eq!(j.judge(Some(UsageSeen::new(900, Some(0)))), None);
        let three = Expect::Handoff {
            prompts: 3,
            own_usage: true,
        };
        drop(leg_sent(&rec(&m), &inst, three, true, UNPLANNED, "p"));
        drop(leg_sent(&rec(&m), &inst, ONE, false, UNPLANNED, "s"));
        drop(leg_sent(
            &rec(&m),
            &inst,
            Expect::Recompute,
            true,
            UNPLANNED,
            "k",
        ));
        let l = inst.ledger.snapshot();
        assert_eq!(
            l,
            LedgerSnapshot {
                sent: 4,
                ended: 4,
                left_sent: 3,
                left_ended: 3,
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
        let j = leg_sent(&rec(&m), &inst, ONE, true, UNPLANNED, "r");
        assert_eq!(j.judge(Some(UsageSeen::new(70, Some(0)))), Some(MISS_USAGE));
        assert!(misses(&m).contains("reason=\"decode_cached_tokens_low\"} 1\n"));
        // Usage without details from a decode never seen to report them says nothing.
        let j = decode();
        let judgment = leg_sent(&rec(&m), &j, ONE, true, UNPLANNED, "r");
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
