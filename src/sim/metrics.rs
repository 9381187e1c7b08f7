//! The simulator's counters, all atomics (no lock on the request path), rendered in
//! Prometheus text format under vLLM's metric names plus `pdctl_sim_*` ones.

use crate::prometheus::{Histogram, header};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// vLLM's buckets for time to first token, in seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for whole-request latency, in seconds.
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Why a request ended, as vLLM labels `request_success_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

/// Where a prompt token's KV came from, as vLLM labels `vllm:prompt_tokens_by_source_total`
/// (`source=...`): the value and the index into [`Metrics::prompt_tokens_by_source`].
pub const PROMPT_SOURCES: [&str; 3] = ["local_compute", "local_cache_hit", "external_kv_transfer"];

/// Every number the simulator exposes on `/metrics`.
pub struct Metrics {
    labels: String,
    block_size: u32,
    pub running: AtomicI64,
    pub waiting: AtomicI64,
    /// KV blocks held by running sequences (for `vllm:kv_cache_usage_perc`).
    pub blocks_in_use: AtomicI64,
    cache_blocks: u32,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Prompt tokens by where their KV came from, in [`PROMPT_SOURCES`] order: what vLLM
    /// counts on a decode, so a decode that silently recomputed shows in `local_compute`.
    pub prompt_tokens_by_source: [AtomicU64; 3],
    /// Tokens a decode asked a KV handoff for (vLLM's `external_prefix_cache_queries`).
    pub external_prefix_queries: AtomicU64,
    /// Of those, the tokens the handoff delivered (`external_prefix_cache_hits`).
    pub external_prefix_hits: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub aborted: AtomicU64,
    pub handoffs_received: AtomicU64,
    pub handoff_tokens_received: AtomicU64,
    pub handoffs_missed: AtomicU64,
    pub handoffs_sent: AtomicU64,
    pub handoffs_expired: AtomicU64,
    /// KV blocks a prefill keeps for decodes that have not pulled them yet.
    pub blocks_held: AtomicI64,
    pub faults_injected: AtomicU64,
    /// TCP connections accepted on the API port: a client that reuses its connections keeps
    /// this far below the number of requests.
    pub connections_accepted: AtomicU64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Metrics {
    /// Zeroed metrics for a sim serving `model` with `cache_blocks` KV blocks of
    /// `block_size` tokens.
    pub fn new(model: &str, cache_blocks: u32, block_size: u32) -> Metrics {
        let escaped = model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        Metrics {
            labels: format!("model_name=\"{escaped}\",engine=\"0\""),
            block_size,
            running: AtomicI64::new(0),
            waiting: AtomicI64::new(0),
            blocks_in_use: AtomicI64::new(0),
            cache_blocks,
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens_by_source: Default::default(),
            external_prefix_queries: AtomicU64::new(0),
            external_prefix_hits: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            handoffs_received: AtomicU64::new(0),
            handoff_tokens_received: AtomicU64::new(0),
            handoffs_missed: AtomicU64::new(0),
            handoffs_sent: AtomicU64::new(0),
            handoffs_expired: AtomicU64::new(0),
            blocks_held: AtomicI64::new(0),
            faults_injected: AtomicU64::new(0),
            connections_accepted: AtomicU64::new(0),
            ttft: Histogram::new(&TTFT_BUCKETS),
            e2e: Histogram::new(&E2E_BUCKETS),
        }
    }

    /// Counts a finished sequence.
    pub fn finished(&self, why: Finish) {
        match why {
            Finish::Stop => self.success_stop.fetch_add(1, Relaxed),
            Finish::Length => self.success_length.fetch_add(1, Relaxed),
        };
    }

    /// Counts one prompt the way vLLM's decode does: `computed` tokens prefilled here,
    /// `cached` found in the local prefix cache, `received` loaded from a KV handoff.
    pub fn prompt_by_source(&self, computed: u64, cached: u64, received: u64) {
        for (counter, n) in self
            .prompt_tokens_by_source
            .iter()
            .zip([computed, cached, received])
        {
            counter.fetch_add(n, Relaxed);
        }
    }

    /// Counts one lookup of a KV handoff: `queried` tokens were asked for (those not in the
    /// local cache), `hit` of them arrived.
    pub fn external_lookup(&self, queried: u64, hit: u64) {
        self.external_prefix_queries.fetch_add(queried, Relaxed);
        self.external_prefix_hits.fetch_add(hit, Relaxed);
    }

    /// Fraction of KV blocks in use by running sequences, 0..=1 as vLLM reports it.
    pub fn kv_usage(&self) -> f64 {
        if self.cache_blocks == 0 {
            return 0.0;
        }
        (self.blocks_in_use.load(Relaxed).max(0) as f64 / f64::from(self.cache_blocks)).min(1.0)
    }

    /// Cumulative prefix cache hit rate in percent (0 before any query).
    pub fn hit_rate_percent(&self) -> f64 {
        let q = self.prefix_queries.load(Relaxed);
        if q == 0 {
            return 0.0;
        }
        self.prefix_hits.load(Relaxed) as f64 * 100.0 / q as f64
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        let l = &self.labels;
        let gauge = |out: &mut String, name: &str, help: &str, v: String| {
            header(out, name, "gauge", help);
            let _ = writeln!(out, "{name}{{{l}}} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            header(out, name, "counter", help);
            let _ = writeln!(out, "{name}{{{l}}} {v}");
        };
        let g = |a: &AtomicI64| a.load(Relaxed).max(0).to_string();
        let c = |a: &AtomicU64| a.load(Relaxed);
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            g(&self.running),
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            g(&self.waiting),
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self.kv_usage().to_string(),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            c(&self.prefix_queries),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            c(&self.prefix_hits),
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            c(&self.external_prefix_queries),
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            c(&self.external_prefix_hits),
        );
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            c(&self.prompt_tokens),
        );
        header(
            &mut out,
            "vllm:prompt_tokens_by_source_total",
            "counter",
            "Number of prompt tokens by source.",
        );
        for (source, n) in PROMPT_SOURCES.iter().zip(&self.prompt_tokens_by_source) {
            let _ = writeln!(
                out,
                "vllm:prompt_tokens_by_source_total{{{l},source=\"{source}\"}} {}",
                c(n)
            );
        }
        // vLLM's info gauge: its labels are the cache settings (here the ones the sim has).
        header(
            &mut out,
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
        );
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
            self.block_size, self.cache_blocks
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            c(&self.generation_tokens),
        );
        header(
            &mut out,
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
        );
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{l},finished_reason=\"stop\"}} {}\n\
             vllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
            c(&self.success_stop),
            c(&self.success_length)
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            l,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            l,
        );
        counter(
            &mut out,
            "pdctl_sim_requests_aborted_total",
            "Requests aborted because the client went away.",
            c(&self.aborted),
        );
        counter(
            &mut out,
            "pdctl_sim_kv_handoffs_received_total",
            "Requests whose prompt KV came from a prefill instance.",
            c(&self.handoffs_received),
        );
        counter(
            &mut out,
            "pdctl_sim_kv_handoff_tokens_received_total",
            "Prompt tokens whose KV came from a prefill instance.",
            c(&self.handoff_tokens_received),
        );
        counter(
            &mut out,
            "pdctl_sim_kv_handoffs_missed_total",
            "Requests that expected KV from a prefill, found none and recomputed.",
            c(&self.handoffs_missed),
        );
        counter(
            &mut out,
            "pdctl_sim_kv_handoffs_sent_total",
            "KV handoffs this prefill instance made available to a decode.",
            c(&self.handoffs_sent),
        );
        counter(
            &mut out,
            "pdctl_sim_kv_handoffs_expired_total",
            "Held KV handoffs dropped because no decode pulled them in time.",
            c(&self.handoffs_expired),
        );
        gauge(
            &mut out,
            "pdctl_sim_kv_blocks_held",
            "KV blocks held for decodes that have not pulled them yet.",
            g(&self.blocks_held),
        );
        counter(
            &mut out,
            "pdctl_sim_faults_injected_total",
            "Requests failed, hung or stalled on purpose (fault injection).",
            c(&self.faults_injected),
        );
        // Not per model: a plain counter without the vLLM labels.
        header(
            &mut out,
            "pdctl_sim_connections_accepted_total",
            "counter",
            "TCP connections accepted on the API port.",
        );
        let _ = writeln!(
            out,
            "pdctl_sim_connections_accepted_total {}",
            c(&self.connections_accepted)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_and_usage() {
        let m = Metrics::new("m\"x", 100, 16);
        assert_eq!(m.hit_rate_percent(), 0.0);
        m.prefix_queries.fetch_add(40, Relaxed);
        m.prefix_hits.fetch_add(10, Relaxed);
        assert_eq!(m.hit_rate_percent(), 25.0);
        m.blocks_in_use.fetch_add(25, Relaxed);
        assert_eq!(m.kv_usage(), 0.25);
        let text = m.render();
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\",engine=\"0\"} 0.25\n")
        );
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
    }

    #[test]
    fn prompt_tokens_are_exposed_by_source_with_vllm_labels() {
        let m = Metrics::new("m", 100, 32);
        m.prompt_by_source(5, 16, 48);
        m.prompt_by_source(69, 0, 0);
        m.external_lookup(53, 48);
        let text = m.render();
        for (source, n) in [
            ("local_compute", 74),
            ("local_cache_hit", 16),
            ("external_kv_transfer", 48),
        ] {
            let line = format!(
                "vllm:prompt_tokens_by_source_total{{model_name=\"m\",engine=\"0\",source=\"{source}\"}} {n}\n"
            );
            assert!(text.contains(&line), "{line} in:\n{text}");
        }
        assert!(text.contains(
            "vllm:external_prefix_cache_queries_total{model_name=\"m\",engine=\"0\"} 53\n"
        ));
        assert!(
            text.contains(
                "vllm:external_prefix_cache_hits_total{model_name=\"m\",engine=\"0\"} 48\n"
            )
        );
        assert!(
            text.contains("vllm:cache_config_info{block_size=\"32\","),
            "{text}"
        );
    }
}
