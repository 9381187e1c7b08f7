//! Prefix-cache counters read from the engines' /metrics before and after a run, so a
//! benchmark shows what routing did to the hit rate.

use super::report::CacheFigures;
use std::time::Duration;

/// The sum of the samples of `name` (any labels) in Prometheus text.
fn counter(text: &str, name: &str) -> Option<f64> {
    crate::prometheus::sum(text, &[name])
}

/// (queries, hits) of one engine: vLLM V1 names, else the V0 `gpu_` ones.
pub fn cache_counters(text: &str) -> Option<(f64, f64)> {
    let q = counter(text, "vllm:prefix_cache_queries_total")
        .or_else(|| counter(text, "vllm:gpu_prefix_cache_queries_total"))?;
    let h = counter(text, "vllm:prefix_cache_hits_total")
        .or_else(|| counter(text, "vllm:gpu_prefix_cache_hits_total"))?;
    Some((q, h))
}

/// Reads every engine's counters; an engine that does not answer is left out, and said so.
pub async fn snapshot(client: &reqwest::Client, engines: &[String]) -> Vec<Option<(f64, f64)>> {
    let mut out = Vec::with_capacity(engines.len());
    for e in engines {
        let url = format!("{}/metrics", e.trim_end_matches('/'));
        let text = async {
            client
                .get(&url)
                .timeout(Duration::from_secs(5))
                .send()
                .await?
                .text()
                .await
        };
        let counters = match text.await {
            Ok(t) => cache_counters(&t).or_else(|| {
                eprintln!(
                    "pdctl bench: {url} has no prefix-cache counters; its hit rate is left out"
                );
                None
            }),
            Err(err) => {
                eprintln!(
                    "pdctl bench: cannot read {url} ({}); its hit rate is left out",
                    crate::error_text::chain(&err)
                );
                None
            }
        };
        out.push(counters);
    }
    out
}

/// Per-engine deltas between two snapshots.
pub fn deltas(
    engines: &[String],
    before: &[Option<(f64, f64)>],
    after: &[Option<(f64, f64)>],
) -> Vec<CacheFigures> {
    engines
        .iter()
        .zip(before.iter().zip(after))
        .filter_map(|(e, (b, a))| {
            let ((q0, h0), (q1, h1)) = ((*b)?, (*a)?);
            let (q, h) = (q1 - q0, h1 - h0);
            Some(CacheFigures {
                instance: e.clone(),
                queries: q,
                hits: h,
                hit_rate: if q > 0.0 { h / q } else { 0.0 },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_label_sets_and_ignore_lookalikes() {
        let text = "# HELP x\nvllm:prefix_cache_queries_total{model_name=\"a\"} 100.0\nvllm:prefix_cache_queries_total{model_name=\"b\"} 50\nvllm:prefix_cache_queries_total_created 17\nvllm:prefix_cache_hits_total 75\n";
        assert_eq!(cache_counters(text), Some((150.0, 75.0)));
        assert_eq!(
            cache_counters(
                "vllm:gpu_prefix_cache_queries_total 4\nvllm:gpu_prefix_cache_hits_total 1\n"
            ),
            Some((4.0, 1.0))
        );
        assert_eq!(cache_counters("nothing 1\n"), None);
    }

    /// vLLM's Rust front end serves OpenMetrics text: the same counters are found there.
    #[test]
    fn counters_are_read_from_an_openmetrics_page() {
        let om = "# TYPE vllm:prefix_cache_queries counter\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 120.0 # {trace_id=\"x\"} 1.0\n\
            vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
            # TYPE vllm:prefix_cache_hits counter\n\
            {\"vllm:prefix_cache_hits_total\",engine=\"0\",model_name=\"m\"} 30.0\n\
            # EOF\n";
        assert_eq!(cache_counters(om), Some((120.0, 30.0)));
    }
}
