//! Reads engines' `/metrics` every health interval. Decode instances always: their own
//! `vllm:prompt_tokens_by_source_total` is where a KV handoff that silently turned into a
//! recompute shows (recompute.rs judges it; nothing else of vLLM's says so). With
//! `--scrape-metrics`, every instance's queue too (`vllm:num_requests_running` +
//! `vllm:num_requests_waiting`), so least-loaded and prefix-aware routing also see load that
//! did not come through this proxy.

use super::Proxy;
use super::instances::{Instance, Leg};
use super::recompute::{self, BY_SOURCE, DecodeCounters, DecodeWatch, LedgerSnapshot, Unjudged};
use crate::prometheus::sum;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The gauges summed into an instance's engine load.
const LOAD_GAUGES: [&str; 2] = ["vllm:num_requests_running", "vllm:num_requests_waiting"];

/// Sums the load gauges over every label set in a Prometheus text exposition; None when
/// neither gauge is present (not a vLLM-compatible engine).
pub fn engine_load(text: &str) -> Option<u32> {
    sum(text, &LOAD_GAUGES).map(|v| v.max(0.0).round() as u32)
}

/// Scrapes decode instances (and, with `load`, prefill ones for their load) every
/// `interval`, forever.
pub fn start(p: Arc<Proxy>, interval: Duration, load: bool) {
    tokio::spawn(async move {
        let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(5));
        let mut watches: HashMap<usize, DecodeWatch> = HashMap::new();
        // Instances whose page could not be read last time, so each outage is said once.
        let mut unreadable: HashMap<(Leg, usize), bool> = HashMap::new();
        let mut failed = super::transfer_failures::FailedTransfers::default();
        loop {
            let all: Vec<_> = p
                .pools
                .snapshot()
                .all()
                .filter(|i| load || i.leg == Leg::Decode)
                .cloned()
                .collect();
            // Each decode's legs as they stand before its page is read: every leg counted
            // as ended here has its prompt on the page.
            let ledgers: Vec<LedgerSnapshot> = all.iter().map(|i| i.ledger.snapshot()).collect();
            let results = futures_util::future::join_all(all.iter().map(|i| {
                let url = format!("{}/metrics", i.url);
                let up = p.upstream.clone();
                async move { up.get(&url, timeout).await }
            }))
            .await;
            for ((inst, r), ledger) in all.iter().zip(results).zip(ledgers) {
                let (text, why_not) = match r {
                    Ok((200, body)) => (String::from_utf8_lossy(&body).into_owned(), None),
                    Ok((status, _)) => (String::new(), Some(format!("it answered {status}"))),
                    Err(e) => (String::new(), Some(e.to_string())),
                };
                let was_unreadable = unreadable.insert((inst.leg, inst.index), why_not.is_some());
                let lost = match (load, inst.leg) {
                    (true, Leg::Decode) => {
                        "routing by its engine-reported load and counting KV handoff misses from its counters stop"
                    }
                    (true, Leg::Prefill) => "routing by its engine-reported load stops",
                    (false, _) => "counting KV handoff misses from its counters stops",
                };
                match (&why_not, was_unreadable) {
                    (Some(why), None | Some(false)) => tracing::warn!(
                        "cannot read {}/metrics ({why}): {lost} until it can",
                        inst.url
                    ),
                    (None, Some(true)) => {
                        tracing::info!("{}/metrics is readable again", inst.url)
                    }
                    _ => {}
                }
                if load {
                    inst.set_engine_load(engine_load(&text));
                }
                if inst.leg == Leg::Decode && why_not.is_none() {
                    watch_decode(&p, inst, &text, ledger, &mut watches);
                    failed.observe(&p, inst, &text);
                }
            }
            tokio::time::sleep(interval).await;
        }
    });
}

/// Follows one decode's prompt token counters and counts the recompute they show.
fn watch_decode(
    p: &Proxy,
    inst: &Instance,
    text: &str,
    snapshot: LedgerSnapshot,
    watches: &mut HashMap<usize, DecodeWatch>,
) {
    let ledger = &inst.ledger;
    let Some(now) = DecodeCounters::read(text) else {
        if ledger.set_has_counters(false) || !watches.contains_key(&inst.index) {
            tracing::info!(
                "decode instance {} has no {BY_SOURCE} on its /metrics (vLLM before 0.26, or not vLLM): KV handoff misses on it are only seen in answers' usage.prompt_tokens_details.cached_tokens (vLLM --enable-prompt-tokens-details)",
                inst.url
            );
        }
        // Keep an entry, so the line above is said once per change.
        watches.insert(inst.index, DecodeWatch::default());
        return;
    };
    ledger.set_has_counters(true);
    if let Some(b) = recompute::block_size(text) {
        ledger.set_block_size(b);
    }
    let leaves = ledger.leaves(p.handoff.leaves_tokens);
    let step = watches
        .entry(inst.index)
        .or_default()
        .step(now, snapshot, leaves);
    ledger.add_seen(step.tokens);
    if step.restarted {
        tracing::info!(
            "decode instance {}: its prompt token counters went down (engine restarted?); counting from here",
            inst.url
        );
    }
    if let Some(why) = step.unjudged {
        unjudged(p, inst, why, step.unchecked);
    }
    if let Some(f) = step.finding {
        p.metrics.handoff_misses_estimated(f.estimated_misses);
        p.metrics.unexplained_tokens(f.unexplained_tokens);
        tracing::warn!(
            decode = %inst.url,
            unexplained_tokens = f.unexplained_tokens,
            "KV handoff missed: decode {} computed {} prompt tokens itself beyond what the {} KV handoff(s) left to this check that ended on it leave to compute ({leaves} tokens each), by its own vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}}: an estimated {} request(s) silently recomputed their prompt (right answers, TTFT not disaggregated; an estimate from the mean prompt, counted apart from the misses answers showed); see its log",
            inst.url,
            f.unexplained_tokens,
            f.due,
            f.estimated_misses
        );
    }
}

/// Counts and logs a window the check could not judge, with the handoffs left to it.
fn unjudged(p: &Proxy, inst: &Instance, why: Unjudged, unchecked: u64) {
    p.metrics.handoffs_unchecked(why.reason(), unchecked);
    let what = match why {
        Unjudged::OtherTraffic { prefilled, legs } => format!(
            "decode prefilled {prefilled} prompts, {legs} of them from this proxy's legs; requests that reached it another way cannot be told from misses"
        ),
        Unjudged::PrefillsUnknown => format!(
            "decode's /metrics has no {} to rule out requests that reached it another way",
            recompute::PREFILLS
        ),
        Unjudged::KnownRecomputes => {
            "legs the proxy sent to recompute ended in it, and their prompts cannot be told from misses".to_string()
        }
        Unjudged::NeverIdle => format!(
            "legs were in flight for {} scrapes in a row",
            recompute::MAX_MERGED
        ),
    };
    tracing::debug!(
        decode = %inst.url,
        "KV handoff check could not judge a window: {what}; its {unchecked} handoff(s) left to the check are counted as unchecked (pdctl_proxy_kv_handoffs_unchecked_total)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_and_waiting_are_summed_over_label_sets() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{model_name=\"m\"} 4.0 1712345678\n\
            vllm:num_requests_running_other 100\n";
        assert_eq!(engine_load(text), Some(9));
    }

    #[test]
    fn labels_containing_braces_or_spaces_do_not_confuse_the_parser() {
        assert_eq!(
            engine_load("vllm:num_requests_running{model_name=\"a b}\"} 5\n"),
            Some(5)
        );
        assert_eq!(engine_load("vllm:num_requests_waiting 7\n"), Some(7));
    }

    #[test]
    fn an_engine_without_the_gauges_has_unknown_load() {
        assert_eq!(engine_load("pdctl_sim_other 1\n"), None);
        assert_eq!(engine_load(""), None);
    }
}
