//! The proxy's Prometheus metrics (`/metrics`, names prefixed `pdctl_proxy_`): what a
//! user needs to see that requests flow, where they went, how long each stage took, and
//! every KV handoff that did not happen. One `prometheus-client` registry per proxy holds
//! them and writes the page (its Prometheus text encoder); the per-instance series are
//! read from the instances at each scrape (instances come and go with DNS names), the
//! others are handles kept here and bumped without a lookup.

pub use super::histogram::Histogram;
/// Handoff failure reason: decode could not load the KV and failed the request
/// (kv_load_failure_policy "fail"); the client got an error naming the KV load.
pub const KV_LOAD_FAILED: &str = "decode_failed_the_request";
/// Handoff failure reason: growth of a decode's `vllm:nixl_num_failed_transfers`.
pub const ENGINE_FAILED_TRANSFERS: &str = "engine_reported_failed_transfers";

use super::instances::{FailureKind, Instance, Leg, Pools};
use super::rebalance_seen::RebalanceSeen;
pub use super::recorder::LimitReason;
use super::recorder::Recorder;
use crate::prometheus::FixedFamily;
use crate::vocab::RebalanceReport;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The labels of a finished request: its route and HTTP status.
type RequestLabels = ([(&'static str, &'static str); 1], [(&'static str, u16); 1]);

/// Label values of the per-leg families, in `Leg as usize` order.
const LEGS: [&str; 2] = ["prefill", "decode"];

/// Every counter the proxy keeps outside the per-instance ones, and the registry that
/// writes them all.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// The instances of the scrape being written, read by the per-instance series.
    scraped: Arc<Mutex<Arc<Pools>>>,
    /// Held while a scrape is written, so each reads the instances it put in `scraped`.
    scrape: Mutex<()>,
    requests: Sparse<RequestLabels>,
    in_flight: Gauge,
    /// Prefill leg: request sent until its answer is complete.
    pub prefill_duration: Histogram,
    /// Decode leg: request sent until its first byte.
    pub decode_ttft: Histogram,
    /// Client request received until the first byte of the answer goes out.
    pub ttft: Histogram,
    handoff_misses: Sparse<[(&'static str, &'static str); 1]>,
    handoff_failures: Sparse<[(&'static str, &'static str); 1]>,
    recomputed_tokens: Counter,
    misses_estimated: Counter,
    unexplained_tokens: Counter,
    handoffs_unchecked: Sparse<[(&'static str, &'static str); 1]>,
    rate_limited: FixedFamily<Counter, 2>,
    queued: Counter,
    queue_depth: Gauge,
    retries: FixedFamily<Counter, 2>,
    redone: Sparse<[(&'static str, &'static str); 1]>,
    migrations: Sparse<[(&'static str, &'static str); 1]>,
    migrations_refused: Sparse<[(&'static str, &'static str); 1]>,
    restart_waits: FixedFamily<Counter, 2>,
    prefix_routing: Sparse<[(&'static str, &'static str); 2]>,
    client_disconnects: Counter,
    warmups: Sparse<[(&'static str, String); 1]>,
    settings_revision: Gauge,
    rebalance: RebalanceSeen,
}

impl Default for Metrics {
    /// Zeroed metrics, registered in the order the page lists them.
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("pdctl_proxy"),
            scraped: Arc::new(Mutex::new(Arc::new(no_instances()))),
            scrape: Mutex::new(()),
            requests: Sparse::default(),
            in_flight: Gauge::default(),
            prefill_duration: Histogram::default(),
            decode_ttft: Histogram::default(),
            ttft: Histogram::default(),
            handoff_misses: Sparse::default(),
            handoff_failures: Sparse::default(),
            recomputed_tokens: Counter::default(),
            misses_estimated: Counter::default(),
            unexplained_tokens: Counter::default(),
            handoffs_unchecked: Sparse::default(),
            rate_limited: FixedFamily::new("reason", ["rate", "concurrency"]),
            queued: Counter::default(),
            queue_depth: Gauge::default(),
            retries: FixedFamily::new("leg", LEGS),
            redone: Sparse::default(),
            migrations: Sparse::default(),
            migrations_refused: Sparse::default(),
            restart_waits: FixedFamily::new("leg", LEGS),
            prefix_routing: Sparse::default(),
            client_disconnects: Counter::default(),
            warmups: Sparse::default(),
            settings_revision: Gauge::default(),
            rebalance: RebalanceSeen::default(),
        };
        m.register_all();
        m
    }
}

impl Metrics {
    /// Registers every family, in page order. Names lack `_total` and help texts their
    /// final full stop: the registry adds both. The page's three parts, in its order.
    fn register_all(&mut self) {
        self.register_requests_and_instances();
        self.register_handoffs();
        self.register_admission_and_retries();
    }

    /// The client requests, the per-instance series and the stages' durations.
    fn register_requests_and_instances(&mut self) {
        let r = &mut self.registry;
        let s = &self.scraped;
        r.register(
            "requests",
            "Client requests answered, by route and HTTP status",
            self.requests.clone(),
        );
        r.register(
            "requests_in_flight",
            "Client requests being served now (until their response ends)",
            self.in_flight.clone(),
        );
        r.register(
            "instance_selected",
            "Times routing chose an instance",
            at_scrape(s, MetricType::Counter, |p, e| {
                each_instance(p, e, |i| ConstCounter::new(i.selected()))
            }),
        );
        r.register(
            "instance_in_flight",
            "Requests on an instance now, counted until the response stream ends",
            at_scrape(s, MetricType::Gauge, |p, e| {
                each_instance(p, e, |i| ConstGauge::new(i.in_flight() as i64))
            }),
        );
        r.register(
            "instance_errors",
            "Leg failures on an instance, by kind (client 4xx are not counted)",
            at_scrape(s, MetricType::Counter, |p, e| {
                for i in p.all() {
                    for k in FailureKind::ALL {
                        let labels = (instance_labels(i), [("kind", k.as_str())]);
                        ConstCounter::new(i.failures(k)).encode(e.encode_family(&labels)?)?;
                    }
                }
                Ok(())
            }),
        );
        r.register(
            "instance_healthy",
            "1 when routing may use the instance, 0 when health checks took it out",
            at_scrape(s, MetricType::Gauge, |p, e| {
                each_instance(p, e, |i| ConstGauge::new(i64::from(i.is_usable())))
            }),
        );
        r.register(
            "instance_engine_load",
            "Running + waiting requests the engine reported (--scrape-metrics); -1 unknown",
            at_scrape(s, MetricType::Gauge, |p, e| {
                each_instance(p, e, |i| {
                    ConstGauge::new(i.engine_load().map_or(-1, i64::from))
                })
            }),
        );
        r.register(
            "prefill_duration_seconds",
            "Prefill leg: sent until its answer was complete",
            self.prefill_duration.clone(),
        );
        r.register(
            "decode_ttft_seconds",
            "Decode leg: sent until its first byte",
            self.decode_ttft.clone(),
        );
        r.register(
            "ttft_seconds",
            "End to end: client request received until the first byte was sent back",
            self.ttft.clone(),
        );
    }

    /// The KV handoffs: misses counted and estimated, failures, what decodes computed.
    fn register_handoffs(&mut self) {
        let r = &mut self.registry;
        let s = &self.scraped;
        r.register(
            "kv_handoff_misses",
            "Requests whose decode had to recompute the prompt, counted one by one, by reason",
            self.handoff_misses.clone(),
        );
        r.register(
            "kv_handoff_misses_estimated",
            "Requests estimated to have recomputed their prompt from decodes' counters (kv_handoff_unexplained_tokens over the mean prompt), for legs no answer judged; apart from the counted misses",
            self.misses_estimated.clone(),
        );
        r.register(
            "kv_handoff_unexplained_tokens",
            "Prompt tokens decodes computed beyond what the handoffs left to their counters leave to compute, by their vllm:prompt_tokens_by_source_total",
            self.unexplained_tokens.clone(),
        );
        r.register(
            "kv_handoffs_unchecked",
            "Handoffs no answer judged whose decode counters' window could not be attributed, by reason (other_traffic, prefills_unknown, known_recomputes, never_idle): misses among them go uncounted",
            self.handoffs_unchecked.clone(),
        );
        r.register(
            "kv_handoff_failures",
            "KV handoffs that failed to load on decode, by reason: requests failed for it (kv_load_failure_policy fail), and failed transfers decodes reported (vllm:nixl_num_failed_transfers)",
            self.handoff_failures.clone(),
        );
        r.register(
            "kv_handoff_recomputed_tokens",
            "Prompt tokens decodes computed themselves in the misses their answers' usage showed",
            self.recomputed_tokens.clone(),
        );
        r.register(
            "decode_prompt_tokens",
            "Prompt tokens of each decode by source, from its vllm:prompt_tokens_by_source_total, since this proxy started watching it (absent until a page with them is read)",
            at_scrape(s, MetricType::Counter, |p, e| {
                for i in p.decode.iter().filter(|i| i.ledger.has_counters()) {
                    let seen = i.ledger.seen();
                    for (source, n) in super::recompute::SOURCES.iter().zip(seen) {
                        let labels = [("instance", i.url.as_str()), ("source", source)];
                        ConstCounter::new(n).encode(e.encode_family(&labels)?)?;
                    }
                }
                Ok(())
            }),
        );
    }

    /// Admission, retries and continuations, and what the supervisor and the head set.
    fn register_admission_and_retries(&mut self) {
        let r = &mut self.registry;
        r.register(
            "rate_limited",
            "Requests refused with 429, by limit",
            self.rate_limited.clone(),
        );
        r.register(
            "queued",
            "Requests that waited for a concurrency slot",
            self.queued.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for a concurrency slot now",
            self.queue_depth.clone(),
        );
        r.register(
            "retries",
            "Legs retried on another instance after a connect error or 502/503",
            self.retries.clone(),
        );
        r.register(
            "requests_redone",
            "Requests redone once on another prefill/decode pair (the same when it is the only one) after a leg failed before any byte reached the client, by reason (kv_load_failed, connect, reset, unreachable, handshake)",
            self.redone.clone(),
        );
        r.register(
            "migrations",
            "Streams whose decode broke off mid-answer, continued on another decode (or the same one, back), by what broke it (connection, ended_early, unreachable, drained)",
            self.migrations.clone(),
        );
        r.register(
            "migrations_refused",
            "Streams whose decode broke off mid-answer and that could not be continued, by why (not_migratable, limit, tokens, failed)",
            self.migrations_refused.clone(),
        );
        r.register(
            "restart_waits",
            "Requests that found no healthy instance of a leg and waited for one the supervisor reports coming back",
            self.restart_waits.clone(),
        );
        r.register(
            "prefix_routing",
            "Prefix-aware decisions: matched a known prefix, cold (none known), rebalanced (owner too loaded)",
            self.prefix_routing.clone(),
        );
        r.register(
            "client_disconnects",
            "Clients gone before their answer was complete (both legs were cancelled)",
            self.client_disconnects.clone(),
        );
        r.register(
            "warmups",
            "Warm-up requests sent to each decode instance (one per pair warmed); the engine's own counters count them as requests",
            self.warmups.clone(),
        );
        r.register(
            "settings_revision",
            "Revision of this proxy's spec in the supervisor whose settings are in effect (0: as started; pdctl apply raises it)",
            self.settings_revision.clone(),
        );
        for (name, help, family) in self.rebalance.families() {
            r.register(name, help, family);
        }
    }

    /// Counts one finished request by route and status.
    pub fn request_done(&self, route: &'static str, status: u16) {
        self.requests
            .add(([("route", route)], [("status", status)]), 1);
    }

    /// Requests with that route and status so far.
    pub fn requests(&self, route: &'static str, status: u16) -> u64 {
        self.requests
            .get(&([("route", route)], [("status", status)]))
    }

    /// Adds `delta` to the client requests in flight.
    pub fn add_in_flight(&self, delta: i64) {
        self.in_flight.inc_by(delta);
    }

    /// Counts one KV handoff that did not happen (decode recomputes the prompt).
    pub fn handoff_miss(&self, reason: &'static str) {
        self.handoff_misses_n(reason, 1);
    }

    /// Counts `n` KV handoffs that did not happen.
    pub fn handoff_misses_n(&self, reason: &'static str, n: u64) {
        self.handoff_misses.add([("reason", reason)], n);
    }

    /// Counts `n` KV handoffs whose load failed on decode (see [`KV_LOAD_FAILED`]).
    pub fn handoff_failures_n(&self, reason: &'static str, n: u64) {
        self.handoff_failures.add([("reason", reason)], n);
    }

    /// Counts prompt tokens a decode computed itself in KV handoff misses its answers'
    /// usage showed (recompute/).
    pub fn recomputed_tokens(&self, n: u64) {
        self.recomputed_tokens.inc_by(n);
    }

    /// Adds `n` requests estimated, from a decode's counters, to have recomputed.
    pub fn handoff_misses_estimated(&self, n: u64) {
        self.misses_estimated.inc_by(n);
    }

    /// Counts prompt tokens a decode's counters show computed beyond what its handoffs
    /// leave.
    pub fn unexplained_tokens(&self, n: u64) {
        self.unexplained_tokens.inc_by(n);
    }

    /// Counts `n` handoffs whose window the counters' check could not judge.
    pub fn handoffs_unchecked(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.handoffs_unchecked.add([("reason", reason)], n);
        }
    }

    /// Counts one 429.
    pub fn rate_limited(&self, reason: LimitReason) {
        self.rate_limited.get(reason as usize).inc();
    }

    /// Counts one request that had to wait for a concurrency slot.
    pub fn queued(&self) {
        self.queued.inc();
    }

    /// The supervisor's revision of this proxy's spec whose settings are now in effect.
    pub fn settings_applied(&self, revision: u64) {
        self.settings_revision.set(revision as i64);
    }

    /// Moves the current queue depth gauge.
    pub fn queue_depth(&self, delta: i64) {
        self.queue_depth.inc_by(delta);
    }

    /// Counts one retry of a leg on another instance.
    pub fn retry(&self, leg: Leg) {
        self.retries.get(leg as usize).inc();
    }

    /// Counts one request that waited for an instance of `leg` coming back.
    pub fn restart_wait(&self, leg: Leg) {
        self.restart_waits.get(leg as usize).inc();
    }

    /// Counts one prefix-aware routing decision (`matched`, `cold` or `rebalanced`).
    pub fn prefix_routing(&self, leg: Leg, outcome: &'static str) {
        self.prefix_routing
            .add([("leg", leg.as_str()), ("outcome", outcome)], 1);
    }

    /// Counts a client that went away before its answer was complete.
    pub fn client_disconnect(&self) {
        self.client_disconnects.inc();
    }

    /// Counts one warm-up request sent to the decode instance at `url` (the rebalancer
    /// takes it out of that engine's requests).
    pub fn warmup_sent(&self, url: &str) {
        self.warmups.add([("instance", url.to_string())], 1);
    }

    /// The Prometheus text exposition of everything, per-instance series of `pools`
    /// included.
    pub fn render(&self, pools: &Pools) -> String {
        let _one_scrape_at_a_time = self.scrape.lock().unwrap_or_else(PoisonError::into_inner);
        let set =
            |p: Pools| *self.scraped.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(p);
        set(Pools {
            prefill: pools.prefill.clone(),
            decode: pools.decode.clone(),
        });
        let mut out = String::with_capacity(8192);
        // Writing to a String cannot fail, nor can any metric here.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        set(no_instances());
        out
    }
}

/// Pools with no instance: what the per-instance series see outside a scrape.
fn no_instances() -> Pools {
    Pools {
        prefill: vec![],
        decode: vec![],
    }
}

/// How a per-instance family writes its series from the instances of a scrape.
type WriteSeries = fn(&Pools, &mut MetricEncoder) -> fmt::Result;

/// A per-instance family, read from the instances of the scrape being written (so an
/// instance that left has no series).
#[derive(Debug)]
struct PerScrape {
    scraped: Arc<Mutex<Arc<Pools>>>,
    kind: MetricType,
    write: WriteSeries,
}

/// A [`PerScrape`] family of `kind` reading the instances from `scraped`.
fn at_scrape(scraped: &Arc<Mutex<Arc<Pools>>>, kind: MetricType, write: WriteSeries) -> PerScrape {
    PerScrape {
        scraped: scraped.clone(),
        kind,
        write,
    }
}

impl EncodeMetric for PerScrape {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        let pools = self
            .scraped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        (self.write)(&pools, &mut encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

/// The labels of an instance's series: its leg and URL.
fn instance_labels(i: &Instance) -> [(&'static str, &str); 2] {
    [("leg", i.leg.as_str()), ("instance", i.url.as_str())]
}

/// Writes one series per instance, prefill first, with the value `v` gives.
fn each_instance<M: EncodeMetric>(
    pools: &Pools,
    encoder: &mut MetricEncoder,
    v: impl Fn(&Instance) -> M,
) -> fmt::Result {
    for i in pools.all() {
        v(i).encode(encoder.encode_family(&instance_labels(i))?)?;
    }
    Ok(())
}

/// A counter family whose label sets show up as requests come (a route and status, a
/// miss reason): a map under a lock, as the proxy kept before the crate, written sorted
/// by labels.
#[derive(Debug)]
struct Sparse<K>(Arc<Mutex<BTreeMap<K, u64>>>);

impl<K> Clone for Sparse<K> {
    fn clone(&self) -> Self {
        Sparse(self.0.clone())
    }
}

impl<K> Default for Sparse<K> {
    fn default() -> Self {
        Sparse(Arc::default())
    }
}

impl<K: Ord> Sparse<K> {
    /// Adds `n` to the series labelled `k`.
    fn add(&self, k: K, n: u64) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(k)
            .or_default() += n;
    }

    /// The count of the series labelled `k` (0 before its first count).
    fn get(&self, k: &K) -> u64 {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(k).copied().unwrap_or(0)
    }
}

impl<K: EncodeLabelSet> EncodeMetric for Sparse<K> {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for (labels, n) in map.iter() {
            ConstCounter::new(*n).encode(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        <Counter as TypedMetric>::TYPE
    }
}

/// The figures take what the lower layers count ([`Recorder`]) into the same counters
/// `/metrics` writes.
impl Recorder for Metrics {
    fn add_in_flight(&self, delta: i64) {
        Metrics::add_in_flight(self, delta);
    }
    fn request_done(&self, route: &'static str, status: u16) {
        Metrics::request_done(self, route, status);
    }
    fn client_disconnect(&self) {
        Metrics::client_disconnect(self);
    }
    fn first_byte(&self, ttft: Duration) {
        self.ttft.observe(ttft);
    }
    fn prefill_done(&self, took: Duration) {
        self.prefill_duration.observe(took);
    }
    fn decode_first_byte(&self, took: Duration) {
        self.decode_ttft.observe(took);
    }
    fn handoff_miss(&self, reason: &'static str) {
        Metrics::handoff_miss(self, reason);
    }
    fn recomputed_tokens(&self, tokens: u64) {
        Metrics::recomputed_tokens(self, tokens);
    }
    fn kv_load_failed(&self) {
        self.handoff_failures_n(KV_LOAD_FAILED, 1);
    }
    fn retry(&self, leg: Leg) {
        Metrics::retry(self, leg);
    }
    fn migrated(&self, reason: &'static str) {
        self.migrations.add([("reason", reason)], 1);
    }
    fn migration_refused(&self, reason: &'static str) {
        self.migrations_refused.add([("reason", reason)], 1);
    }
    fn redone(&self, reason: &'static str) {
        self.redone.add([("reason", reason)], 1);
    }
    fn restart_wait(&self, leg: Leg) {
        Metrics::restart_wait(self, leg);
    }
    fn rate_limited(&self, reason: LimitReason) {
        Metrics::rate_limited(self, reason);
    }
    fn queued(&self) {
        Metrics::queued(self);
    }
    fn queue_depth(&self, delta: i64) {
        Metrics::queue_depth(self, delta);
    }
    fn prefix_routing(&self, leg: Leg, outcome: &'static str) {
        Metrics::prefix_routing(self, leg, outcome);
    }
    fn settings_applied(&self, revision: u64) {
        Metrics::settings_applied(self, revision);
    }
    fn rebalance_seen(&self, report: Option<&RebalanceReport>) {
        self.rebalance.set(report);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_prefixed_and_typed() {
        let m = Metrics::default();
        m.request_done("/v1/completions", 200);
        m.handoff_miss("no_kv_transfer_params");
        let pools = Pools {
            prefill: vec![],
            decode: vec![],
        };
        let text = m.render(&pools);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.starts_with("pdctl_proxy_"), "{line}");
        }
        assert!(
            text.contains("pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"200\"} 1")
        );
        assert!(
            text.contains(
                "pdctl_proxy_kv_handoff_misses_total{reason=\"no_kv_transfer_params\"} 1"
            )
        );
    }
}
