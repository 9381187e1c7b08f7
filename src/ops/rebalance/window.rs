//! The figures over a window, from pages of `/metrics` read every few seconds: the
//! proxy's TTFT histogram (`pdctl_proxy_ttft_seconds`), the decode engines' inter-token
//! histogram where they export one (`vllm:inter_token_latency_seconds`, or the older
//! `vllm:time_per_output_token_seconds`), and the proxy's per-instance requests in
//! flight (`pdctl_proxy_instance_in_flight{leg=...}`) and health. A percentile over the
//! window comes from the difference of the cumulative bucket counts between the window's
//! first and last page, interpolated inside its bucket as Prometheus'
//! `histogram_quantile` does.

use super::decide::Figures;
use crate::prometheus::{label_value, samples};
use std::collections::VecDeque;

/// The proxy's end-to-end time-to-first-token histogram.
pub const TTFT: &str = "pdctl_proxy_ttft_seconds";
/// Inter-token histograms engines export, newest vLLM name first.
pub const ITL: [&str; 2] = [
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
];

/// Cumulative bucket counts of one histogram: (upper bound in seconds, count), ascending,
/// `+Inf` last.
pub type Buckets = Vec<(f64, f64)>;

/// What one look at the pages found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// When (ms, any monotonic origin).
    pub at_ms: u64,
    pub ttft: Buckets,
    /// Summed over the decode engines; empty when none exports one.
    pub itl: Buckets,
    /// Requests in flight on each prefill instance, and on each decode instance.
    pub prefill_in_flight: Vec<f64>,
    pub decode_in_flight: Vec<f64>,
    /// Some instance the proxy routes to is marked unhealthy.
    pub unhealthy: bool,
}

/// The cumulative buckets of histogram `name` on a page, summed over its label sets.
pub fn buckets(page: &str, name: &str) -> Buckets {
    let bucket = format!("{name}_bucket");
    let mut out: Vec<(f64, f64)> = Vec::new();
    for s in samples(page).filter(|s| s.name == bucket) {
        let Some(le) = label_value(s.labels, "le") else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        match out.iter_mut().find(|(b, _)| *b == le) {
            Some(slot) => slot.1 += s.value,
            None => out.push((le, s.value)),
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Reads the proxy's page into a sample (the ITL buckets are added from the engines').
pub fn from_proxy(page: &str, at_ms: u64) -> Sample {
    let mut s = Sample {
        at_ms,
        ttft: buckets(page, TTFT),
        ..Sample::default()
    };
    for m in samples(page) {
        match m.name {
            "pdctl_proxy_instance_in_flight" => match label_value(m.labels, "leg").as_deref() {
                Some("prefill") => s.prefill_in_flight.push(m.value),
                Some("decode") => s.decode_in_flight.push(m.value),
                _ => {}
            },
            "pdctl_proxy_instance_healthy" if m.value < 0.5 => s.unhealthy = true,
            _ => {}
        }
    }
    s
}

/// The decode instances' URLs the proxy's page names.
pub fn decode_urls(page: &str) -> Vec<String> {
    samples(page)
        .filter(|m| m.name == "pdctl_proxy_instance_in_flight")
        .filter(|m| label_value(m.labels, "leg").as_deref() == Some("decode"))
        .filter_map(|m| label_value(m.labels, "instance"))
        .collect()
}

/// Adds one engine page's inter-token buckets to a sum.
pub fn add_itl(sum: &mut Buckets, page: &str) {
    let Some(b) = ITL.iter().map(|n| buckets(page, n)).find(|b| !b.is_empty()) else {
        return;
    };
    for (le, n) in b {
        match sum.iter_mut().find(|(x, _)| *x == le) {
            Some(slot) => slot.1 += n,
            None => sum.push((le, n)),
        }
    }
    sum.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// The `q` quantile (0..1) of what was observed between two looks at a histogram, in
/// seconds; None when nothing was. A counter that went down (a restarted proxy or
/// engine) counts from zero.
pub fn quantile(before: &Buckets, after: &Buckets, q: f64) -> Option<f64> {
    let count_at = |b: &Buckets, le: f64| b.iter().find(|(x, _)| *x == le).map_or(0.0, |x| x.1);
    let reset = after.iter().any(|(le, n)| *n < count_at(before, *le));
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| (*le, if reset { *n } else { n - count_at(before, *le) }))
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for (le, n) in &delta {
        if *n >= rank {
            if le.is_infinite() {
                // Above the last bound: the last bound is all that is known.
                return Some(lower.0);
            }
            let inside = n - lower.1;
            let share = if inside > 0.0 {
                (rank - lower.1) / inside
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * share);
        }
        lower = (*le, *n);
    }
    None
}

/// The samples of the last window.
#[derive(Debug, Default)]
pub struct Window {
    samples: VecDeque<Sample>,
}

impl Window {
    /// Adds a sample and forgets those older than `window_ms` before it (the oldest one
    /// kept is the window's base).
    pub fn push(&mut self, s: Sample, window_ms: u64) {
        let start = s.at_ms.saturating_sub(window_ms);
        self.samples.push_back(s);
        while self.samples.len() > 2 && self.samples[1].at_ms <= start {
            self.samples.pop_front();
        }
    }

    /// Forgets every sample (after a move: the figures before it judge another split).
    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// How many ms the samples span.
    pub fn span_ms(&self) -> u64 {
        match (self.samples.front(), self.samples.back()) {
            (Some(a), Some(b)) => b.at_ms - a.at_ms,
            _ => 0,
        }
    }

    /// The figures between the first and the last sample.
    pub fn figures(&self) -> Figures {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return Figures::default();
        };
        let total = |b: &Buckets| b.last().map_or(0.0, |x| x.1);
        let requests = (total(&last.ttft) - total(&first.ttft)).max(0.0) as u64;
        let ms = |v: Option<f64>| v.map(|s| s * 1000.0);
        let n = self.samples.len() as f64;
        let mean = |f: &dyn Fn(&Sample) -> f64| self.samples.iter().map(f).sum::<f64>() / n;
        let busy = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().filter(|x| **x > 0.0).count() as f64 / v.len() as f64
            }
        };
        Figures {
            requests,
            ttft_p90_ms: ms(quantile(&first.ttft, &last.ttft, 0.9)),
            itl_p90_ms: ms(quantile(&first.itl, &last.itl, 0.9)),
            prefill_queue: mean(&|s| s.prefill_in_flight.iter().sum()),
            decode_queue: mean(&|s| s.decode_in_flight.iter().sum()),
            prefill_busy: mean(&|s| busy(&s.prefill_in_flight)),
            decode_busy: mean(&|s| busy(&s.decode_in_flight)),
        }
    }

    /// Whether the last sample saw an unhealthy instance.
    pub fn unhealthy(&self) -> bool {
        self.samples.back().is_some_and(|s| s.unhealthy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(ttft: [u64; 4], p_in_flight: u64, healthy: u8) -> String {
        format!(
            "# TYPE pdctl_proxy_ttft_seconds histogram\n\
             pdctl_proxy_ttft_seconds_sum 1.0\n\
             pdctl_proxy_ttft_seconds_count {c}\n\
             pdctl_proxy_ttft_seconds_bucket{{le=\"0.1\"}} {}\n\
             pdctl_proxy_ttft_seconds_bucket{{le=\"1.0\"}} {}\n\
             pdctl_proxy_ttft_seconds_bucket{{le=\"5.0\"}} {}\n\
             pdctl_proxy_ttft_seconds_bucket{{le=\"+Inf\"}} {c}\n\
             pdctl_proxy_instance_in_flight{{leg=\"prefill\",instance=\"http://p0\"}} {p_in_flight}\n\
             pdctl_proxy_instance_in_flight{{leg=\"decode\",instance=\"http://d0\"}} 0\n\
             pdctl_proxy_instance_healthy{{leg=\"decode\",instance=\"http://d0\"}} {healthy}\n",
            ttft[0],
            ttft[1],
            ttft[2],
            c = ttft[3],
        )
    }

    #[test]
    fn buckets_are_read_cumulative_and_sorted() {
        let b = buckets(&page([1, 5, 9, 10], 0, 1), TTFT);
        assert_eq!(
            b,
            vec![(0.1, 1.0), (1.0, 5.0), (5.0, 9.0), (f64::INFINITY, 10.0)]
        );
    }

    #[test]
    fn the_p90_comes_from_the_window_s_deltas_only() {
        // Before the window: 100 fast requests. In it: 10 requests, 9 of them 1-5 s.
        let before = buckets(&page([100, 100, 100, 100], 0, 1), TTFT);
        let after = buckets(&page([101, 101, 110, 110], 0, 1), TTFT);
        let p90 = quantile(&before, &after, 0.9).unwrap();
        // Rank 9 of 10: 8/9 of the way through the 1..5 s bucket.
        assert!((p90 - (1.0 + 4.0 * 8.0 / 9.0)).abs() < 1e-9, "{p90}");
        assert_eq!(quantile(&after, &after, 0.9), None, "nothing observed");
    }

    #[test]
    fn a_reset_counter_counts_from_zero_and_inf_gives_the_last_bound() {
        let before = buckets(&page([100, 100, 100, 100], 0, 1), TTFT);
        let after = buckets(&page([0, 0, 0, 4], 0, 1), TTFT);
        assert_eq!(quantile(&before, &after, 0.9), Some(5.0));
    }

    #[test]
    fn the_window_keeps_its_base_and_measures_queues_and_health() {
        let mut w = Window::default();
        w.push(from_proxy(&page([0, 0, 0, 0], 0, 1), 0), 30_000);
        w.push(from_proxy(&page([0, 0, 0, 0], 0, 1), 5_000), 30_000);
        w.push(from_proxy(&page([0, 0, 0, 0], 2, 1), 20_000), 30_000);
        w.push(from_proxy(&page([0, 10, 10, 10], 2, 0), 40_000), 30_000);
        // The base is the last sample at or before 40 s - 30 s: the one at 5 s.
        assert_eq!(w.span_ms(), 35_000);
        let f = w.figures();
        assert_eq!(f.requests, 10);
        assert!((f.prefill_queue - 4.0 / 3.0).abs() < 1e-9, "{f:?}");
        assert!((f.prefill_busy - 2.0 / 3.0).abs() < 1e-9, "{f:?}");
        assert_eq!(f.decode_busy, 0.0);
        assert!(w.unhealthy());
        assert!(f.ttft_p90_ms.unwrap() > 100.0 && f.ttft_p90_ms.unwrap() <= 1000.0);
    }

    #[test]
    fn engine_itl_pages_are_summed_and_decode_urls_found() {
        let mut sum = Buckets::new();
        let e = "vllm:inter_token_latency_seconds_bucket{model_name=\"m\",le=\"0.05\"} 3\n\
                 vllm:inter_token_latency_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4\n";
        add_itl(&mut sum, e);
        add_itl(&mut sum, e);
        assert_eq!(sum, vec![(0.05, 6.0), (f64::INFINITY, 8.0)]);
        assert_eq!(decode_urls(&page([0, 0, 0, 0], 0, 1)), vec!["http://d0"]);
    }
}
