//! `--scrape-metrics`: reads each engine's own queue (`vllm:num_requests_running` +
//! `vllm:num_requests_waiting` from its `/metrics`) so least-loaded and prefix-aware
//! routing also see load that did not come through this proxy. Where a decode engine
//! counts the KV handoffs it had to give up on (the simulator's
//! `pdctl_sim_kv_handoffs_missed_total`), new ones are logged and counted as misses too:
//! a decode that silently recomputed is exactly what users cannot see otherwise.

use super::Proxy;
use super::instances::Leg;
use crate::prometheus::sum;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The gauges summed into an instance's engine load.
const LOAD_GAUGES: [&str; 2] = ["vllm:num_requests_running", "vllm:num_requests_waiting"];
/// Counters of KV handoffs an engine gave up on (decode recomputed).
const MISS_COUNTERS: [&str; 1] = ["pdctl_sim_kv_handoffs_missed_total"];
/// Metrics reason for misses the engines reported themselves.
pub const MISS_ENGINE_REPORTED: &str = "engine_reported";

/// Sums the load gauges over every label set in a Prometheus text exposition; None when
/// neither gauge is present (not a vLLM-compatible engine).
pub fn engine_load(text: &str) -> Option<u32> {
    sum(text, &LOAD_GAUGES).map(|v| v.max(0.0).round() as u32)
}

/// The engine's own count of KV handoffs it gave up on, if it exposes one.
pub fn engine_misses(text: &str) -> Option<u64> {
    sum(text, &MISS_COUNTERS).map(|v| v.max(0.0).round() as u64)
}

/// Scrapes every instance every `interval`, forever.
pub fn start(p: Arc<Proxy>, interval: Duration) {
    tokio::spawn(async move {
        let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(5));
        let mut misses_seen: HashMap<usize, u64> = HashMap::new();
        // Instances whose page could not be read last time, so each outage is said once.
        let mut unreadable: HashMap<usize, bool> = HashMap::new();
        loop {
            let all: Vec<_> = p.pools.snapshot().all().cloned().collect();
            let results = futures_util::future::join_all(all.iter().map(|i| {
                let url = format!("{}/metrics", i.url);
                let up = p.upstream.clone();
                async move { up.get(&url, timeout).await }
            }))
            .await;
            for (inst, r) in all.iter().zip(results) {
                let (text, why_not) = match r {
                    Ok((200, body)) => (String::from_utf8_lossy(&body).into_owned(), None),
                    Ok((status, _)) => (String::new(), Some(format!("it answered {status}"))),
                    Err(e) => (String::new(), Some(e.to_string())),
                };
                let was_unreadable = unreadable.insert(inst.index, why_not.is_some());
                match (&why_not, was_unreadable) {
                    (Some(why), None | Some(false)) => tracing::warn!(
                        "cannot read {}/metrics ({why}): routing by its engine-reported load stops until it can",
                        inst.url
                    ),
                    (None, Some(true)) => {
                        tracing::info!("{}/metrics is readable again", inst.url)
                    }
                    _ => {}
                }
                inst.set_engine_load(engine_load(&text));
                if inst.leg == Leg::Decode
                    && let Some(now) = engine_misses(&text)
                {
                    // The first look is a baseline: misses from before this proxy are not ours.
                    let before = misses_seen.insert(inst.index, now);
                    if let Some(before) = before
                        && now > before
                    {
                        let new = now - before;
                        p.metrics.handoff_misses_n(MISS_ENGINE_REPORTED, new);
                        tracing::warn!(
                            "decode instance {} reports {new} KV handoff(s) it gave up on (it recomputed the prompt); see its log",
                            inst.url
                        );
                    }
                }
            }
            tokio::time::sleep(interval).await;
        }
    });
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
    fn engine_reported_misses_are_read_when_exposed() {
        let text = "pdctl_sim_kv_handoffs_missed_total{model_name=\"m\",engine=\"0\"} 3\n";
        assert_eq!(engine_misses(text), Some(3));
        assert_eq!(engine_misses("vllm:num_requests_running 1\n"), None);
    }

    #[test]
    fn an_engine_without_the_gauges_has_unknown_load() {
        assert_eq!(engine_load("pdctl_sim_other 1\n"), None);
        assert_eq!(engine_load(""), None);
    }
}
