//! The simulator's metrics under vLLM's names (`vllm:...`, counters ending `_total`,
//! the `model_name` and `engine` labels) plus `pdctl_sim_*` ones. The code bumps them as
//! plain atomics (no lock on the request path); a `prometheus-client` registry per sim
//! holds the same counters and writes the page with the crate's Prometheus text encoder.

use crate::prometheus::FixedFamily;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// vLLM's buckets for time to first token, in seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for the gap between output tokens, in seconds.
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
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

/// A counter the simulator bumps as a plain atomic (`fetch_add`, through `Deref`), exposed
/// as the crate's counter (which adds the `_total` suffix).
#[derive(Debug, Default, Clone)]
pub struct Count(Counter);

impl Deref for Count {
    type Target = AtomicU64;
    fn deref(&self) -> &AtomicU64 {
        self.0.inner()
    }
}

impl TypedMetric for Count {
    const TYPE: MetricType = <Counter as TypedMetric>::TYPE;
}

impl EncodeMetric for Count {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A level the simulator moves as a plain atomic (requests running, blocks held), exposed
/// as a gauge clamped at 0: a decrement may land before the increment it undoes.
#[derive(Debug, Default, Clone)]
pub struct Level(Gauge);

impl Deref for Level {
    type Target = AtomicI64;
    fn deref(&self) -> &AtomicI64 {
        self.0.inner()
    }
}

impl EncodeMetric for Level {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        ConstGauge::new(self.0.get().max(0)).encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        <Gauge as TypedMetric>::TYPE
    }
}

/// A latency histogram with vLLM's buckets (the crate's; the simulator is not the hot
/// path the proxy's lock-free one is for).
#[derive(Debug, Clone)]
pub struct Latency(Histogram);

impl Latency {
    /// An empty histogram with these upper bounds (seconds).
    fn new(bounds: &[f64]) -> Latency {
        Latency(Histogram::new(bounds.iter().copied()))
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Every number the simulator exposes on `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub running: Level,
    pub waiting: Level,
    /// KV blocks held by running sequences (for `vllm:kv_cache_usage_perc`).
    pub blocks_in_use: Level,
    cache_blocks: u32,
    pub prompt_tokens: Count,
    pub generation_tokens: Count,
    pub prefix_queries: Count,
    pub prefix_hits: Count,
    /// Prompt tokens by where their KV came from, in [`PROMPT_SOURCES`] order: what vLLM
    /// counts on a decode, so a decode that silently recomputed shows in `local_compute`.
    pub prompt_tokens_by_source: FixedFamily<Count, 3>,
    /// Tokens a decode asked a KV handoff for (vLLM's `external_prefix_cache_queries`).
    pub external_prefix_queries: Count,
    /// Of those, the tokens the handoff delivered (`external_prefix_cache_hits`).
    pub external_prefix_hits: Count,
    /// Finished requests by [`Finish`] (`finished_reason`).
    success: FixedFamily<Count, 2>,
    pub aborted: Count,
    pub handoffs_received: Count,
    pub handoff_tokens_received: Count,
    pub handoffs_missed: Count,
    /// NIXL transfers (pull or push) that failed, as vLLM's NIXL connector stats count
    /// them (`vllm:nixl_num_failed_transfers`).
    pub nixl_failed_transfers: Count,
    /// Requests failed because their KV could not be loaded (policy "fail").
    pub kv_load_failures: Count,
    pub handoffs_sent: Count,
    pub handoffs_expired: Count,
    /// KV blocks a prefill keeps for decodes that have not pulled them yet.
    pub blocks_held: Level,
    pub faults_injected: Count,
    /// TCP connections accepted on the API port: a client that reuses its connections keeps
    /// this far below the number of requests.
    pub connections_accepted: Count,
    pub ttft: Latency,
    /// Gaps between one sequence's output tokens (vLLM's inter_token_latency_seconds):
    /// what the head's rebalancer reads for `itl_p90_ms`.
    pub itl: Latency,
    pub e2e: Latency,
}

impl Metrics {
    /// Zeroed metrics for a sim serving `model` with `cache_blocks` KV blocks of
    /// `block_size` tokens.
    pub fn new(model: &str, cache_blocks: u32, block_size: u32) -> Metrics {
        let m = Metrics {
            registry: Registry::default(),
            running: Level::default(),
            waiting: Level::default(),
            blocks_in_use: Level::default(),
            cache_blocks,
            prompt_tokens: Count::default(),
            generation_tokens: Count::default(),
            prefix_queries: Count::default(),
            prefix_hits: Count::default(),
            prompt_tokens_by_source: FixedFamily::new("source", PROMPT_SOURCES),
            external_prefix_queries: Count::default(),
            external_prefix_hits: Count::default(),
            success: FixedFamily::new("finished_reason", ["stop", "length"]),
            aborted: Count::default(),
            handoffs_received: Count::default(),
            handoff_tokens_received: Count::default(),
            handoffs_missed: Count::default(),
            nixl_failed_transfers: Count::default(),
            kv_load_failures: Count::default(),
            handoffs_sent: Count::default(),
            handoffs_expired: Count::default(),
            blocks_held: Level::default(),
            faults_injected: Count::default(),
            connections_accepted: Count::default(),
            ttft: Latency::new(&TTFT_BUCKETS),
            itl: Latency::new(&ITL_BUCKETS),
            e2e: Latency::new(&E2E_BUCKETS),
        };
        m.registered(model, block_size)
    }

    /// Registers every family in the order vLLM's page lists them. Counter names lack
    /// `_total` and help texts their final full stop: the registry adds both. The series
    /// carrying vLLM's `model_name` and `engine` labels go in sub-registries with those
    /// labels, the others in sub-registries without, so the page keeps its order.
    fn registered(mut self, model: &str, block_size: u32) -> Metrics {
        let vllm_labels = || {
            [
                ("model_name", Cow::Owned(model.to_string())),
                ("engine", Cow::Borrowed("0")),
            ]
            .into_iter()
            .map(|(k, v)| (Cow::Borrowed(k), v))
        };
        // The registry is taken out while the families are registered, so the methods
        // below can read the counters it registers.
        let mut registry = std::mem::take(&mut self.registry);
        self.register_scheduler_and_cache(registry.sub_registry_with_labels(vllm_labels()));
        // vLLM's info gauge: its labels are the cache settings (here the ones the sim has),
        // not the model's, and its help has no full stop.
        registry
            .sub_registry_with_labels(std::iter::empty())
            .register_collector(Box::new(CacheConfigInfo {
                block_size,
                num_gpu_blocks: self.cache_blocks,
            }));
        let r = registry.sub_registry_with_labels(vllm_labels());
        self.register_requests(r);
        self.register_sim_own(r.sub_registry_with_prefix("pdctl_sim"));
        // Not per model: a plain counter without the vLLM labels.
        registry.sub_registry_with_prefix("pdctl_sim").register(
            "connections_accepted",
            "TCP connections accepted on the API port",
            self.connections_accepted.clone(),
        );
        self.registry = registry;
        self
    }

    /// vLLM's scheduler, KV cache, prefix cache and connector families.
    fn register_scheduler_and_cache(&self, r: &mut Registry) {
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            self.running.clone(),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            self.waiting.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            KvUsage {
                blocks_in_use: self.blocks_in_use.clone(),
                cache_blocks: self.cache_blocks,
            },
        );
        let counters: [(&str, &str, &Count); 5] = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens",
                &self.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens",
                &self.prefix_hits,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens",
                &self.external_prefix_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens",
                &self.external_prefix_hits,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed",
                &self.prompt_tokens,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers",
            self.nixl_failed_transfers.clone(),
        );
        r.register(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source",
            self.prompt_tokens_by_source.clone(),
        );
    }

    /// vLLM's families of finished requests: tokens generated, successes, latencies.
    fn register_requests(&self, r: &mut Registry) {
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            self.generation_tokens.clone(),
        );
        r.register(
            "vllm:request_success",
            "Count of successfully processed requests",
            self.success.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            self.ttft.0.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            self.itl.0.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            self.e2e.0.clone(),
        );
    }

    /// pdctl_sim's own families: handoffs, aborts, faults.
    fn register_sim_own(&self, r: &mut Registry) {
        let counters: [(&str, &str, &Count); 7] = [
            (
                "requests_aborted",
                "Requests aborted because the client went away",
                &self.aborted,
            ),
            (
                "kv_handoffs_received",
                "Requests whose prompt KV came from a prefill instance",
                &self.handoffs_received,
            ),
            (
                "kv_handoff_tokens_received",
                "Prompt tokens whose KV came from a prefill instance",
                &self.handoff_tokens_received,
            ),
            (
                "kv_handoffs_missed",
                "Requests that expected KV from a prefill, found none and recomputed",
                &self.handoffs_missed,
            ),
            (
                "kv_load_failures",
                "Requests failed because their KV could not be loaded (kv_load_failure_policy fail)",
                &self.kv_load_failures,
            ),
            (
                "kv_handoffs_sent",
                "KV handoffs this prefill instance made available to a decode",
                &self.handoffs_sent,
            ),
            (
                "kv_handoffs_expired",
                "Held KV handoffs dropped because no decode pulled them in time",
                &self.handoffs_expired,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "kv_blocks_held",
            "KV blocks held for decodes that have not pulled them yet",
            self.blocks_held.clone(),
        );
        r.register(
            "faults_injected",
            "Requests failed, hung or stalled on purpose (fault injection)",
            self.faults_injected.clone(),
        );
    }

    /// Counts a finished sequence.
    pub fn finished(&self, why: Finish) {
        self.success.get(why as usize).fetch_add(1, Relaxed);
    }

    /// Counts one prompt the way vLLM's decode does: `computed` tokens prefilled here,
    /// `cached` found in the local prefix cache, `received` loaded from a KV handoff.
    pub fn prompt_by_source(&self, computed: u64, cached: u64, received: u64) {
        for (i, n) in [computed, cached, received].into_iter().enumerate() {
            self.prompt_tokens_by_source.get(i).fetch_add(n, Relaxed);
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
        kv_usage(&self.blocks_in_use, self.cache_blocks)
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
        // Writing to a String cannot fail, nor can any metric here.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// Fraction of `cache_blocks` that `blocks_in_use` holds, 0..=1.
fn kv_usage(blocks_in_use: &Level, cache_blocks: u32) -> f64 {
    if cache_blocks == 0 {
        return 0.0;
    }
    (blocks_in_use.load(Relaxed).max(0) as f64 / f64::from(cache_blocks)).min(1.0)
}

/// `vllm:kv_cache_usage_perc`, worked out from the blocks in use when the page is written.
#[derive(Debug)]
struct KvUsage {
    blocks_in_use: Level,
    cache_blocks: u32,
}

impl EncodeMetric for KvUsage {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        ConstGauge::new(kv_usage(&self.blocks_in_use, self.cache_blocks)).encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        <Gauge as TypedMetric>::TYPE
    }
}

/// vLLM's `vllm:cache_config_info`, written through the crate's descriptor encoder
/// because its help text has no full stop (the registry would add one) and its value is
/// vLLM's `1.0` (the crate's info type writes `1`).
#[derive(Debug)]
struct CacheConfigInfo {
    block_size: u32,
    num_gpu_blocks: u32,
}

impl Collector for CacheConfigInfo {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let mut m = encoder.encode_descriptor(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            None,
            MetricType::Gauge,
        )?;
        let labels: [(&str, Cow<str>); 5] = [
            ("block_size", self.block_size.to_string().into()),
            // vLLM's CacheConfig field; the simulator's KV is never quantized.
            ("cache_dtype", "auto".into()),
            ("enable_prefix_caching", "True".into()),
            ("engine", "0".into()),
            ("num_gpu_blocks", self.num_gpu_blocks.to_string().into()),
        ];
        ConstGauge::new(1.0).encode(m.encode_family(&labels)?)
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
