//! What the dashboard reads off the `/metrics` pages it scrapes once a second: the proxy's
//! (`pdctl_proxy_*`) and each engine's (vLLM's names, which the simulator writes too).
//! Series are read by name; one a page lacks (an older proxy has no migrations) is None
//! or zero, never an error.

use crate::prometheus::{Sample, label_value, samples};
use std::collections::BTreeMap;

/// A histogram as cumulative counts by upper bound, summed over every series of it on
/// the pages read (the `+Inf` bound last).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(pub Vec<(f64, f64)>);

impl Buckets {
    /// Adds one `_bucket` sample.
    fn add(&mut self, s: &Sample) {
        let Some(le) = label_value(s.labels, "le").and_then(|v| match v.as_str() {
            "+Inf" => Some(f64::INFINITY),
            other => other.parse().ok(),
        }) else {
            return;
        };
        match self.0.iter_mut().find(|(b, _)| *b == le) {
            Some(slot) => slot.1 += s.value,
            None => {
                self.0.push((le, s.value));
                self.0.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// Adds every bucket of `other` (another engine's histogram).
    pub fn merge(&mut self, other: &Buckets) {
        for &(le, n) in &other.0 {
            match self.0.iter_mut().find(|(b, _)| *b == le) {
                Some(slot) => slot.1 += n,
                None => self.0.push((le, n)),
            }
        }
        self.0.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    /// The observations since `earlier`; a count that went down (the process restarted)
    /// means everything now counted is new.
    pub fn since(&self, earlier: &Buckets) -> Buckets {
        let before = |le: f64| {
            earlier
                .0
                .iter()
                .find(|(b, _)| *b == le)
                .map_or(0.0, |x| x.1)
        };
        let restarted = self.0.iter().any(|&(le, n)| n < before(le));
        Buckets(
            self.0
                .iter()
                .map(|&(le, n)| (le, if restarted { n } else { n - before(le) }))
                .collect(),
        )
    }

    /// Observations counted.
    pub fn count(&self) -> f64 {
        self.0.last().map_or(0.0, |x| x.1)
    }

    /// The `q` quantile, interpolated in its bucket as Prometheus' `histogram_quantile`
    /// does; None without observations. One in the `+Inf` bucket is the last finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, cum) in &self.0 {
            if cum >= rank {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let within = cum - lower.1;
                let frac = if within > 0.0 {
                    (rank - lower.1) / within
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * frac);
            }
            lower = (le, cum);
        }
        Some(lower.0)
    }
}

/// The proxy's figures on one instance (matched by its URL).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProxyInstance {
    pub selected: f64,
    pub in_flight: f64,
    pub routed: bool,
}

/// What the proxy's page says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProxyPage {
    pub requests: f64,
    pub failed: f64,
    pub in_flight: f64,
    pub retries: f64,
    pub redone: f64,
    /// `pdctl_proxy_migrations_total` by reason; None where the proxy has no such series.
    pub migrations: Option<BTreeMap<String, f64>>,
    pub misses: BTreeMap<String, f64>,
    pub handoff_failures: f64,
    pub ttft: Buckets,
    pub instances: BTreeMap<String, ProxyInstance>,
}

/// Reads the proxy's page; None when it is not the pdctl proxy's.
pub fn read_proxy(text: &str) -> Option<ProxyPage> {
    let mut p = ProxyPage::default();
    let mut found = false;
    for s in samples(text) {
        let label = |k: &str| label_value(s.labels, k).unwrap_or_default();
        match s.name {
            "pdctl_proxy_requests_total" => {
                found = true;
                p.requests += s.value;
                if label("status").starts_with(['4', '5']) {
                    p.failed += s.value;
                }
            }
            "pdctl_proxy_requests_in_flight" => p.in_flight += s.value,
            "pdctl_proxy_retries_total" => p.retries += s.value,
            "pdctl_proxy_requests_redone_total" => p.redone += s.value,
            "pdctl_proxy_migrations_total" => {
                *p.migrations
                    .get_or_insert_default()
                    .entry(label("reason"))
                    .or_default() += s.value
            }
            "pdctl_proxy_kv_handoff_misses_total" => {
                *p.misses.entry(label("reason")).or_default() += s.value
            }
            "pdctl_proxy_kv_handoff_failures_total" => p.handoff_failures += s.value,
            "pdctl_proxy_ttft_seconds_bucket" => p.ttft.add(&s),
            "pdctl_proxy_instance_selected_total" => {
                p.instances.entry(instance(&s)).or_default().selected += s.value
            }
            "pdctl_proxy_instance_in_flight" => {
                p.instances.entry(instance(&s)).or_default().in_flight += s.value
            }
            "pdctl_proxy_instance_healthy" => {
                p.instances.entry(instance(&s)).or_default().routed = s.value == 1.0
            }
            _ => {}
        }
    }
    found.then_some(p)
}

/// An instance label, without a trailing `/` (as the status report's URLs are compared).
fn instance(s: &Sample) -> String {
    label_value(s.labels, "instance")
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_string()
}

/// What an engine's page says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnginePage {
    pub running: f64,
    pub waiting: f64,
    /// 0..1
    pub kv_cache_usage: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    /// Prompt tokens whose KV came from another instance (a decode's handed-over KV).
    pub kv_tokens_in: f64,
    pub generation_tokens: f64,
    pub itl: Buckets,
}

/// Reads an engine's page (vLLM's names; the older ITL name too).
pub fn read_engine(text: &str) -> EnginePage {
    let mut e = EnginePage::default();
    for s in samples(text) {
        match s.name {
            "vllm:num_requests_running" => e.running += s.value,
            "vllm:num_requests_waiting" => e.waiting += s.value,
            "vllm:kv_cache_usage_perc" => e.kv_cache_usage = e.kv_cache_usage.max(s.value),
            "vllm:prefix_cache_queries_total" => e.prefix_queries += s.value,
            "vllm:prefix_cache_hits_total" => e.prefix_hits += s.value,
            "vllm:prompt_tokens_by_source_total"
                if label_value(s.labels, "source").as_deref() == Some("external_kv_transfer") =>
            {
                e.kv_tokens_in += s.value
            }
            "vllm:generation_tokens_total" => e.generation_tokens += s.value,
            "vllm:inter_token_latency_seconds_bucket"
            | "vllm:time_per_output_token_seconds_bucket" => e.itl.add(&s),
            _ => {}
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROXY: &str = "pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"200\"} 10\n\
        pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"503\"} 2\n\
        pdctl_proxy_requests_in_flight 3\n\
        pdctl_proxy_instance_selected_total{leg=\"decode\",instance=\"http://d:1\"} 7\n\
        pdctl_proxy_instance_healthy{leg=\"decode\",instance=\"http://d:1\"} 1\n\
        pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"} 2\n\
        pdctl_proxy_ttft_seconds_bucket{le=\"0.1\"} 4\n\
        pdctl_proxy_ttft_seconds_bucket{le=\"1\"} 8\n\
        pdctl_proxy_ttft_seconds_bucket{le=\"+Inf\"} 8\n";

    #[test]
    fn the_proxy_page_gives_totals_instances_and_its_histogram() {
        let p = read_proxy(PROXY).unwrap();
        assert_eq!((p.requests, p.failed, p.in_flight), (12.0, 2.0, 3.0));
        assert_eq!(p.instances["http://d:1"].selected, 7.0);
        assert!(p.instances["http://d:1"].routed);
        assert_eq!(p.misses["decode_cached_tokens_low"], 2.0);
        assert_eq!(p.migrations, None, "a proxy without the series has none");
        assert_eq!(p.ttft.quantile(0.5), Some(0.1));
        let p99 = p.ttft.quantile(0.99).unwrap();
        assert!(p99 > 0.9 && p99 <= 1.0, "{p99}");
        let with = format!("{PROXY}pdctl_proxy_migrations_total{{reason=\"decode_died\"}} 3\n");
        let p = read_proxy(&with).unwrap();
        assert_eq!(p.migrations.unwrap()["decode_died"], 3.0);
        assert_eq!(read_proxy("vllm:num_requests_running 1\n"), None);
    }

    #[test]
    fn buckets_since_an_earlier_look_and_after_a_restart() {
        let now = Buckets(vec![(0.1, 5.0), (1.0, 10.0), (f64::INFINITY, 10.0)]);
        let then = Buckets(vec![(0.1, 5.0), (1.0, 6.0), (f64::INFINITY, 6.0)]);
        let d = now.since(&then);
        assert_eq!(d.count(), 4.0);
        assert!(
            d.quantile(0.5).unwrap() > 0.1,
            "the new ones are all above 0.1 s"
        );
        let restarted = Buckets(vec![(0.1, 1.0), (1.0, 1.0), (f64::INFINITY, 1.0)]);
        assert_eq!(restarted.since(&now).count(), 1.0);
        assert_eq!(Buckets::default().quantile(0.5), None);
    }

    #[test]
    fn an_engine_page_gives_its_cache_kv_and_itl() {
        let text = "vllm:num_requests_running{model_name=\"m\"} 2\n\
            vllm:prefix_cache_queries_total{model_name=\"m\"} 100\n\
            vllm:prefix_cache_hits_total{model_name=\"m\"} 25\n\
            vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"} 640\n\
            vllm:prompt_tokens_by_source_total{source=\"local_compute\"} 9\n\
            vllm:inter_token_latency_seconds_bucket{le=\"0.01\"} 3\n\
            vllm:inter_token_latency_seconds_bucket{le=\"+Inf\"} 3\n";
        let e = read_engine(text);
        assert_eq!(
            (e.running, e.prefix_queries, e.prefix_hits),
            (2.0, 100.0, 25.0)
        );
        assert_eq!(e.kv_tokens_in, 640.0);
        assert_eq!(e.itl.count(), 3.0);
    }
}
