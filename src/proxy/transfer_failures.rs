//! Failed KV transfers the decode engines report themselves: vLLM's connector stats
//! `vllm:nixl_num_failed_transfers` (and `vllm:mooncake_num_failed_transfers`), read from
//! the pages scrape.rs fetches. Their growth counts into
//! `pdctl_proxy_kv_handoff_failures_total{reason="engine_reported_failed_transfers"}`:
//! under kv_load_failure_policy "recompute" such a failure is otherwise silent.

use super::Proxy;
use super::instances::Instance;
use super::metrics::ENGINE_FAILED_TRANSFERS;
use std::collections::HashMap;

/// The counters followed (`_total`: both text formats write counters so).
pub const FAILED_TRANSFER_COUNTERS: [&str; 2] = [
    "vllm:nixl_num_failed_transfers_total",
    "vllm:mooncake_num_failed_transfers_total",
];

/// The last value seen of each decode's failed transfer counters.
#[derive(Debug, Default)]
pub struct FailedTransfers {
    last: HashMap<usize, u64>,
}

impl FailedTransfers {
    /// Reads one decode's page; returns the growth since the last page (None the first
    /// time, when the counters are absent, or when they went down: a restarted engine).
    pub fn step(&mut self, index: usize, text: &str) -> Option<u64> {
        let now = crate::prometheus::sum(text, &FAILED_TRANSFER_COUNTERS)?.max(0.0) as u64;
        let before = self.last.insert(index, now)?;
        now.checked_sub(before).filter(|&d| d > 0)
    }

    /// [`step`](Self::step), counted and logged for the proxy.
    pub fn observe(&mut self, p: &Proxy, inst: &Instance, text: &str) {
        if let Some(n) = self.step(inst.index, text) {
            p.metrics.handoff_failures_n(ENGINE_FAILED_TRANSFERS, n);
            tracing::warn!(
                decode = %inst.url,
                "decode {} reports {n} more failed KV transfer(s) (vllm:nixl_num_failed_transfers / vllm:mooncake_num_failed_transfers): those requests recomputed their prompt or failed, by its kv_load_failure_policy",
                inst.url
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_of_the_failed_transfer_counters_is_counted_in_either_text_format() {
        let mut f = FailedTransfers::default();
        let prom = |n: u32| format!("vllm:nixl_num_failed_transfers_total{{engine=\"0\"}} {n}.0\n");
        let om = |n: u32| {
            format!(
                "# TYPE vllm:nixl_num_failed_transfers counter\nvllm:nixl_num_failed_transfers_total{{engine=\"0\"}} {n}\nvllm:nixl_num_failed_transfers_created{{engine=\"0\"}} 1.7e9\n# EOF\n"
            )
        };
        assert_eq!(f.step(0, &prom(1)), None);
        assert_eq!(f.step(0, &om(3)), Some(2));
        assert_eq!(f.step(0, &prom(3)), None);
        // Went down: a restart; counting goes on from there.
        assert_eq!(f.step(0, &om(0)), None);
        assert_eq!(f.step(0, &om(1)), Some(1));
        assert_eq!(f.step(1, "vllm:num_requests_running 1\n"), None);
    }
}
