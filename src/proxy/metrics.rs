//! The proxy's Prometheus metrics (`/metrics`, names prefixed `pdctl_proxy_`): what a
//! user needs to see that requests flow, where they went, how long each stage took, and
//! every KV handoff that did not happen.

pub use super::histogram::Histogram;
use super::instances::{FailureKind, Instance, Leg, Pools};
use crate::prometheus::header;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Why the proxy refused a request with 429.
#[derive(Debug, Clone, Copy)]
pub enum LimitReason {
    /// The token bucket (--rate-limit) was empty.
    Rate,
    /// Every slot (--max-concurrent) was taken and the wait queue (--queue-size) full.
    Concurrency,
}

/// Every counter the proxy keeps outside the per-instance ones.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    in_flight: AtomicI64,
    /// Prefill leg: request sent until its answer is complete.
    pub prefill_duration: Histogram,
    /// Decode leg: request sent until its first byte.
    pub decode_ttft: Histogram,
    /// Client request received until the first byte of the answer goes out.
    pub ttft: Histogram,
    handoff_misses: Mutex<BTreeMap<&'static str, u64>>,
    recomputed_tokens: AtomicU64,
    rate_limited: [AtomicU64; 2],
    queued: AtomicU64,
    queue_depth: AtomicI64,
    retries: [AtomicU64; 2],
    restart_waits: [AtomicU64; 2],
    prefix_routing: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    client_disconnects: AtomicU64,
}

impl Metrics {
    /// Counts one finished request by route and status.
    pub fn request_done(&self, route: &'static str, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((route, status))
            .or_default() += 1;
    }

    /// Requests with that route and status so far.
    pub fn requests(&self, route: &'static str, status: u16) -> u64 {
        let map = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(route, status)).copied().unwrap_or(0)
    }

    /// Adds `delta` to the client requests in flight.
    pub fn add_in_flight(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Ordering::Relaxed);
    }

    /// Counts one KV handoff that did not happen (decode recomputes the prompt).
    pub fn handoff_miss(&self, reason: &'static str) {
        self.handoff_misses_n(reason, 1);
    }

    /// Counts `n` KV handoffs that did not happen.
    pub fn handoff_misses_n(&self, reason: &'static str, n: u64) {
        *self
            .handoff_misses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(reason)
            .or_default() += n;
    }

    /// Counts prompt tokens a decode computed itself in KV handoff misses found from its
    /// usage or counters (recompute.rs).
    pub fn recomputed_tokens(&self, n: u64) {
        self.recomputed_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one 429.
    pub fn rate_limited(&self, reason: LimitReason) {
        self.rate_limited[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one request that had to wait for a concurrency slot.
    pub fn queued(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// Moves the current queue depth gauge.
    pub fn queue_depth(&self, delta: i64) {
        self.queue_depth.fetch_add(delta, Ordering::Relaxed);
    }

    /// Counts one retry of a leg on another instance.
    pub fn retry(&self, leg: Leg) {
        self.retries[leg as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one request that waited for an instance of `leg` coming back.
    pub fn restart_wait(&self, leg: Leg) {
        self.restart_waits[leg as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one prefix-aware routing decision (`matched`, `cold` or `rebalanced`).
    pub fn prefix_routing(&self, leg: Leg, outcome: &'static str) {
        *self
            .prefix_routing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((leg.as_str(), outcome))
            .or_default() += 1;
    }

    /// Counts a client that went away before its answer was complete.
    pub fn client_disconnect(&self) {
        self.client_disconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of everything, per-instance series included.
    pub fn render(&self, pools: &Pools) -> String {
        let mut o = String::with_capacity(8192);
        let p = "pdctl_proxy";
        header(
            &mut o,
            &format!("{p}_requests_total"),
            "counter",
            "Client requests answered, by route and HTTP status.",
        );
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                o,
                "{p}_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        header(
            &mut o,
            &format!("{p}_requests_in_flight"),
            "gauge",
            "Client requests being served now (until their response ends).",
        );
        let _ = writeln!(
            o,
            "{p}_requests_in_flight {}",
            self.in_flight.load(Ordering::Relaxed)
        );

        let per_instance = |o: &mut String,
                            name: &str,
                            kind: &str,
                            help: &str,
                            v: &dyn Fn(&Instance) -> String| {
            header(o, &format!("{p}_{name}"), kind, help);
            for i in pools.all() {
                let _ = writeln!(
                    o,
                    "{p}_{name}{{leg=\"{}\",instance=\"{}\"}} {}",
                    i.leg,
                    i.url,
                    v(i)
                );
            }
        };
        per_instance(
            &mut o,
            "instance_selected_total",
            "counter",
            "Times routing chose an instance.",
            &|i| i.selected().to_string(),
        );
        per_instance(
            &mut o,
            "instance_in_flight",
            "gauge",
            "Requests on an instance now, counted until the response stream ends.",
            &|i| i.in_flight().to_string(),
        );
        header(
            &mut o,
            &format!("{p}_instance_errors_total"),
            "counter",
            "Leg failures on an instance, by kind (client 4xx are not counted).",
        );
        for i in pools.all() {
            for k in FailureKind::ALL {
                let _ = writeln!(
                    o,
                    "{p}_instance_errors_total{{leg=\"{}\",instance=\"{}\",kind=\"{}\"}} {}",
                    i.leg,
                    i.url,
                    k.as_str(),
                    i.failures(k)
                );
            }
        }
        per_instance(
            &mut o,
            "instance_healthy",
            "gauge",
            "1 when routing may use the instance, 0 when health checks took it out.",
            &|i| u8::from(i.is_usable()).to_string(),
        );
        per_instance(
            &mut o,
            "instance_engine_load",
            "gauge",
            "Running + waiting requests the engine reported (--scrape-metrics); -1 unknown.",
            &|i| i.engine_load().map_or(-1, i64::from).to_string(),
        );

        self.prefill_duration.render(
            &mut o,
            &format!("{p}_prefill_duration_seconds"),
            "Prefill leg: sent until its answer was complete.",
            "",
        );
        self.decode_ttft.render(
            &mut o,
            &format!("{p}_decode_ttft_seconds"),
            "Decode leg: sent until its first byte.",
            "",
        );
        self.ttft.render(
            &mut o,
            &format!("{p}_ttft_seconds"),
            "End to end: client request received until the first byte was sent back.",
            "",
        );

        header(
            &mut o,
            &format!("{p}_kv_handoff_misses_total"),
            "counter",
            "Requests whose decode had to recompute the prompt, by reason.",
        );
        for (reason, n) in self
            .handoff_misses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(o, "{p}_kv_handoff_misses_total{{reason=\"{reason}\"}} {n}");
        }
        header(
            &mut o,
            &format!("{p}_kv_handoff_recomputed_tokens_total"),
            "counter",
            "Prompt tokens decodes computed themselves in the misses found from their usage (all of them) or counters (those beyond one block per handoff).",
        );
        let _ = writeln!(
            o,
            "{p}_kv_handoff_recomputed_tokens_total {}",
            self.recomputed_tokens.load(Ordering::Relaxed)
        );
        header(
            &mut o,
            &format!("{p}_decode_prompt_tokens_total"),
            "counter",
            "Prompt tokens of each decode by source, from its vllm:prompt_tokens_by_source_total, since this proxy started watching it.",
        );
        for i in &pools.decode {
            for (source, n) in super::recompute::SOURCES.iter().zip(i.ledger.seen()) {
                let _ = writeln!(
                    o,
                    "{p}_decode_prompt_tokens_total{{instance=\"{}\",source=\"{source}\"}} {n}",
                    i.url
                );
            }
        }
        header(
            &mut o,
            &format!("{p}_rate_limited_total"),
            "counter",
            "Requests refused with 429, by limit.",
        );
        for (i, reason) in ["rate", "concurrency"].iter().enumerate() {
            let _ = writeln!(
                o,
                "{p}_rate_limited_total{{reason=\"{reason}\"}} {}",
                self.rate_limited[i].load(Ordering::Relaxed)
            );
        }
        header(
            &mut o,
            &format!("{p}_queued_total"),
            "counter",
            "Requests that waited for a concurrency slot.",
        );
        let _ = writeln!(
            o,
            "{p}_queued_total {}",
            self.queued.load(Ordering::Relaxed)
        );
        header(
            &mut o,
            &format!("{p}_queue_depth"),
            "gauge",
            "Requests waiting for a concurrency slot now.",
        );
        let _ = writeln!(
            o,
            "{p}_queue_depth {}",
            self.queue_depth.load(Ordering::Relaxed)
        );
        header(
            &mut o,
            &format!("{p}_retries_total"),
            "counter",
            "Legs retried on another instance after a connect error or 502/503.",
        );
        for leg in [Leg::Prefill, Leg::Decode] {
            let _ = writeln!(
                o,
                "{p}_retries_total{{leg=\"{leg}\"}} {}",
                self.retries[leg as usize].load(Ordering::Relaxed)
            );
        }
        header(
            &mut o,
            &format!("{p}_restart_waits_total"),
            "counter",
            "Requests that found no healthy instance of a leg and waited for one the supervisor reports coming back.",
        );
        for leg in [Leg::Prefill, Leg::Decode] {
            let _ = writeln!(
                o,
                "{p}_restart_waits_total{{leg=\"{leg}\"}} {}",
                self.restart_waits[leg as usize].load(Ordering::Relaxed)
            );
        }
        header(
            &mut o,
            &format!("{p}_prefix_routing_total"),
            "counter",
            "Prefix-aware decisions: matched a known prefix, cold (none known), rebalanced (owner too loaded).",
        );
        for ((leg, outcome), n) in self
            .prefix_routing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                o,
                "{p}_prefix_routing_total{{leg=\"{leg}\",outcome=\"{outcome}\"}} {n}"
            );
        }
        header(
            &mut o,
            &format!("{p}_client_disconnects_total"),
            "counter",
            "Clients gone before their answer was complete (both legs were cancelled).",
        );
        let _ = writeln!(
            o,
            "{p}_client_disconnects_total {}",
            self.client_disconnects.load(Ordering::Relaxed)
        );
        o
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
