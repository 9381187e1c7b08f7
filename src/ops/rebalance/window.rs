//! The figures over a window, from pages of `/metrics` read every few seconds: the
//! proxy's TTFT histogram (`pdctl_proxy_ttft_seconds`), each decode engine's inter-token
//! histogram where it exports one (`vllm:inter_token_latency_seconds`, or the older
//! `vllm:time_per_output_token_seconds`) with its requests finished and running, and the
//! proxy's per-instance requests in flight (`pdctl_proxy_instance_in_flight{leg=...}`)
//! and health. A percentile over the window comes from the difference of the cumulative
//! bucket counts between the window's first and last page, interpolated inside its
//! bucket as Prometheus' `histogram_quantile` does. Each engine's difference is taken on
//! its own, keyed by its URL: an engine restarted within the window (its counters lower)
//! counts from its first page after the restart, never from zero; an engine that did not
//! answer at some look, or answered without an inter-token histogram, makes the window
//! blind ([`Window::missing`]). The proxy's own warm-up requests
//! (`pdctl_proxy_warmups_total{instance=...}`, one per pair it warms) reach the decode
//! engines' counters as if they were traffic: each engine's finished requests in the
//! window are counted without the warm-ups the proxy sent it in that window.

use super::decide::Figures;
use crate::prometheus::{label_value, samples};
use std::collections::{BTreeMap, VecDeque};

/// The proxy's end-to-end time-to-first-token histogram.
pub const TTFT: &str = "pdctl_proxy_ttft_seconds";
/// Inter-token histograms engines export, newest vLLM name first.
pub const ITL: [&str; 2] = [
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
];
/// A histogram with one observation per request an engine finished (its count is what
/// the window needs).
pub const FINISHED: &str = "vllm:e2e_request_latency_seconds";
/// The gauge of requests an engine runs now.
pub const RUNNING: &str = "vllm:num_requests_running";
/// The proxy's counter of warm-up requests it sent each decode engine (by `instance`).
pub const WARMUPS: &str = "pdctl_proxy_warmups_total";

/// Cumulative bucket counts of one histogram: (upper bound in seconds, count), ascending,
/// `+Inf` last.
pub type Buckets = Vec<(f64, f64)>;

/// What one look found on a decode engine's page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSample {
    /// Its inter-token histogram; empty when it exports none.
    pub itl: Buckets,
    /// Requests it finished since it started.
    pub finished: f64,
    /// Requests it runs now.
    pub running: f64,
}

/// What one look at the pages found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// When (ms, any monotonic origin).
    pub at_ms: u64,
    pub ttft: Buckets,
    /// Each decode engine that answered, by its URL.
    pub engines: BTreeMap<String, EngineSample>,
    /// The decode engines the proxy routes to whose figures this look could not read,
    /// and why.
    pub missing: Vec<(String, Unread)>,
    /// Warm-up requests the proxy sent each decode engine since it started, by its URL.
    pub warmups: BTreeMap<String, f64>,
    /// Requests in flight on each prefill instance, and on each decode instance.
    pub prefill_in_flight: Vec<f64>,
    pub decode_in_flight: Vec<f64>,
    /// Some instance the proxy routes to is marked unhealthy.
    pub unhealthy: bool,
}

/// Why a decode engine's figures were not read at a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unread {
    /// Its `/metrics` did not answer in time.
    NoAnswer,
    /// Its `/metrics` answered without an inter-token histogram.
    NoHistogram,
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
            WARMUPS => {
                if let Some(url) = label_value(m.labels, "instance") {
                    *s.warmups.entry(url).or_default() += m.value;
                }
            }
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

/// Reads one decode engine's page.
pub fn from_engine(page: &str) -> EngineSample {
    let total = |b: &Buckets| b.last().map_or(0.0, |x| x.1);
    EngineSample {
        itl: ITL
            .iter()
            .map(|n| buckets(page, n))
            .find(|b| !b.is_empty())
            .unwrap_or_default(),
        finished: total(&buckets(page, FINISHED)),
        running: samples(page)
            .filter(|m| m.name == RUNNING)
            .map(|m| m.value)
            .sum(),
    }
}

impl Sample {
    /// Takes a decode engine's page as one look read it (None: it did not answer in
    /// time): a page without an inter-token histogram is no figure, like no page.
    pub fn add_engine(&mut self, url: String, page: Option<&str>) {
        let Some(page) = page else {
            self.missing.push((url, Unread::NoAnswer));
            return;
        };
        let engine = from_engine(page);
        if engine.itl.is_empty() {
            self.missing.push((url, Unread::NoHistogram));
        } else {
            self.engines.insert(url, engine);
        }
    }
}

/// Adds `b` to a sum of buckets.
fn add(sum: &mut Buckets, b: &Buckets) {
    for (le, n) in b {
        match sum.iter_mut().find(|(x, _)| x == le) {
            Some(slot) => slot.1 += n,
            None => sum.push((*le, *n)),
        }
    }
    sum.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// What was observed between two looks at one histogram (bucket by bucket, never below
/// zero).
pub fn delta(before: &Buckets, after: &Buckets) -> Buckets {
    let count_at = |b: &Buckets, le: f64| b.iter().find(|(x, _)| *x == le).map_or(0.0, |x| x.1);
    after
        .iter()
        .map(|(le, n)| (*le, (n - count_at(before, *le)).max(0.0)))
        .collect()
}

/// Whether a histogram's counts went down between two looks: its process restarted.
fn restarted(before: &Buckets, after: &Buckets) -> bool {
    let total = |b: &Buckets| b.last().map_or(0.0, |x| x.1);
    total(after) < total(before)
}

/// The `q` quantile (0..1) of observations counted in `delta` (cumulative buckets), in
/// seconds; None when there are none.
pub fn quantile_of(delta: &Buckets, q: f64) -> Option<f64> {
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for (le, n) in delta {
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

/// The `q` quantile of what was observed between two looks at one histogram; None when
/// nothing was. A histogram whose counts went down (its process restarted between the
/// looks) gives None: what it counted before the restart is unknown.
pub fn quantile(before: &Buckets, after: &Buckets, q: f64) -> Option<f64> {
    if restarted(before, after) {
        return None;
    }
    quantile_of(&delta(before, after), q)
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

    /// The index of the sample each series counts from: the first sample of the window
    /// that has it, moved on past each sample where its counts went down (a restart: the
    /// sample after it is the new baseline, its counts before it unknown).
    fn base_of(&self, get: impl Fn(&Sample) -> Option<Buckets>) -> Option<(Buckets, Buckets)> {
        let mut base: Option<Buckets> = None;
        let mut prev: Option<Buckets> = None;
        for s in &self.samples {
            let Some(b) = get(s) else {
                continue;
            };
            if base.is_none() || prev.as_ref().is_some_and(|p| restarted(p, &b)) {
                base = Some(b.clone());
            }
            prev = Some(b);
        }
        Some((base?, prev?))
    }

    /// The figures between the first and the last sample: the proxy's first tokens, and
    /// the token gaps summed over each decode engine's own difference.
    pub fn figures(&self) -> Figures {
        let (Some(_), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return Figures::default();
        };
        let total = |b: &Buckets| b.last().map_or(0.0, |x| x.1);
        let ttft = self
            .base_of(|s| Some(s.ttft.clone()))
            .map(|(b, l)| delta(&b, &l))
            .unwrap_or_default();
        let mut itl = Buckets::new();
        let mut itl_requests = 0.0;
        for (url, now) in &last.engines {
            let engine = |s: &Sample| s.engines.get(url).cloned();
            if let Some((b, l)) = self.base_of(|s| engine(s).map(|e| e.itl)) {
                add(&mut itl, &delta(&b, &l));
            }
            // Requests with a gap in the window: those finished in it, and those running
            // at its end.
            let finished = |s: &Sample| engine(s).map(|e| vec![(f64::INFINITY, e.finished)]);
            let warmed = |s: &Sample| s.warmups.get(url).map(|n| vec![(f64::INFINITY, *n)]);
            let warmups = self
                .base_of(warmed)
                .map_or(0.0, |(b, l)| (total(&l) - total(&b)).max(0.0));
            if let Some((b, l)) = self.base_of(finished) {
                itl_requests += (total(&l) - total(&b) - warmups).max(0.0);
            }
            itl_requests += now.running;
        }
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
            requests: total(&ttft) as u64,
            ttft_p90_ms: ms(quantile_of(&ttft, 0.9)),
            itl_p90_ms: ms(quantile_of(&itl, 0.9)),
            itl_requests: itl_requests.round() as u64,
            prefill_queue: mean(&|s| s.prefill_in_flight.iter().sum()),
            decode_queue: mean(&|s| s.decode_in_flight.iter().sum()),
            prefill_busy: mean(&|s| busy(&s.prefill_in_flight)),
            decode_busy: mean(&|s| busy(&s.decode_in_flight)),
        }
    }

    /// The decode engines whose figures some look of the window could not read, and why,
    /// with how many looks each missed (empty: every figure of the window was read).
    pub fn missing(&self) -> BTreeMap<(String, Unread), usize> {
        let mut out = BTreeMap::new();
        for s in &self.samples {
            for key in &s.missing {
                *out.entry(key.clone()).or_insert(0) += 1;
            }
        }
        out
    }

    /// How many looks the window holds.
    pub fn looks(&self) -> usize {
        self.samples.len()
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
    fn a_restarted_counter_is_no_figure_and_inf_gives_the_last_bound() {
        let before = buckets(&page([100, 100, 100, 100], 0, 1), TTFT);
        let after = buckets(&page([0, 0, 0, 4], 0, 1), TTFT);
        assert_eq!(
            quantile(&before, &after, 0.9),
            None,
            "what came before is unknown"
        );
        let more = buckets(&page([0, 0, 0, 8], 0, 1), TTFT);
        assert_eq!(quantile(&after, &more, 0.9), Some(5.0));
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

    /// A decode engine's page: `fast` gaps under 50 ms, `slow` ones 50-100 ms, `done`
    /// requests finished, `running` running.
    fn engine(fast: u64, slow: u64, done: u64, running: u64) -> EngineSample {
        let all = fast + slow;
        from_engine(&format!(
            "vllm:inter_token_latency_seconds_bucket{{model_name=\"m\",le=\"0.05\"}} {fast}\n\
             vllm:inter_token_latency_seconds_bucket{{model_name=\"m\",le=\"0.1\"}} {all}\n\
             vllm:inter_token_latency_seconds_bucket{{model_name=\"m\",le=\"+Inf\"}} {all}\n\
             vllm:e2e_request_latency_seconds_bucket{{model_name=\"m\",le=\"+Inf\"}} {done}\n\
             vllm:num_requests_running{{model_name=\"m\"}} {running}\n"
        ))
    }

    /// A look at `at_ms` with these decode engines (and nothing on the proxy's page).
    fn look(at_ms: u64, engines: &[(&str, EngineSample)], missing: &[&str]) -> Sample {
        Sample {
            at_ms,
            engines: engines
                .iter()
                .map(|(u, e)| (u.to_string(), e.clone()))
                .collect(),
            missing: missing
                .iter()
                .map(|u| (u.to_string(), Unread::NoAnswer))
                .collect(),
            ..from_proxy(&page([0, 0, 0, 0], 0, 1), at_ms)
        }
    }

    #[test]
    fn engine_pages_are_read_and_decode_urls_found() {
        let e = engine(3, 1, 7, 2);
        assert_eq!(e.itl, vec![(0.05, 3.0), (0.1, 4.0), (f64::INFINITY, 4.0)]);
        assert_eq!((e.finished, e.running), (7.0, 2.0));
        assert_eq!(decode_urls(&page([0, 0, 0, 0], 0, 1)), vec!["http://d0"]);
    }

    #[test]
    fn each_engine_counts_its_own_difference() {
        // d0 is old (1000 fast gaps before the window), d1 young: in the window d0 adds
        // 10 slow gaps, d1 10 fast ones: p90 among the slow.
        let mut w = Window::default();
        w.push(
            look(
                0,
                &[("d0", engine(1000, 0, 50, 1)), ("d1", engine(0, 0, 0, 0))],
                &[],
            ),
            10_000,
        );
        w.push(
            look(
                10_000,
                &[("d0", engine(1000, 10, 52, 1)), ("d1", engine(10, 0, 1, 1))],
                &[],
            ),
            10_000,
        );
        let f = w.figures();
        let p90 = f.itl_p90_ms.unwrap();
        assert!(p90 > 50.0 && p90 <= 100.0, "{f:?}");
        // Finished in the window (2 + 1) and running at its end (1 + 1).
        assert_eq!(f.itl_requests, 5);
        assert!(w.missing().is_empty());
    }

    #[test]
    fn an_engine_missing_from_a_look_is_said_never_read_as_a_reset() {
        // d1 does not answer at the middle look: the sum of the others would drop (the
        // old reading: a reset, p90 over d0's whole lifetime); now the window says so.
        let mut w = Window::default();
        let both = |at, slow| {
            look(
                at,
                &[("d0", engine(1000, slow, 0, 0)), ("d1", engine(5, 0, 0, 0))],
                &[],
            )
        };
        w.push(both(0, 0), 20_000);
        w.push(
            look(5_000, &[("d0", engine(1000, 2, 0, 0))], &["d1"]),
            20_000,
        );
        w.push(both(10_000, 4), 20_000);
        assert_eq!(
            w.missing(),
            BTreeMap::from([(("d1".to_string(), Unread::NoAnswer), 1)])
        );
        // Its figures stay each engine's own difference: 4 slow gaps, none of d0's old.
        let p90 = w.figures().itl_p90_ms.unwrap();
        assert!(p90 > 50.0, "{p90}");
    }

    #[test]
    fn an_engine_page_without_the_histogram_is_missing_not_an_engine_with_no_gaps() {
        // Before, such an engine counted as one with no gaps: the window was judged on
        // the others', or with no ITL at all, as if a move cost decode nothing.
        let mut s = look(0, &[], &[]);
        s.add_engine("d0".into(), Some("vllm:num_requests_running 3\n"));
        s.add_engine("d1".into(), None);
        let full = "vllm:inter_token_latency_seconds_bucket{le=\"+Inf\"} 0\n";
        s.add_engine("d2".into(), Some(full));
        let mut w = Window::default();
        w.push(s, 10_000);
        assert_eq!(
            w.missing(),
            BTreeMap::from([
                (("d0".to_string(), Unread::NoHistogram), 1),
                (("d1".to_string(), Unread::NoAnswer), 1),
            ])
        );
        assert_eq!(w.looks(), 1);
    }

    #[test]
    fn the_proxys_warmups_are_not_counted_as_requests_on_decode() {
        // d0 finished 10 requests in the window, 3 of them the proxy's warm-ups (a pair
        // warmed for each instance that joined): 7 requests of traffic (before: 10).
        let warmed = |at, finished: u64, warmups: u64| {
            let page = format!(
                "{}{WARMUPS}{{instance=\"d0\"}} {warmups}\n",
                page([0, 0, 0, 0], 0, 1)
            );
            let mut s = from_proxy(&page, at);
            s.engines
                .insert("d0".into(), engine(0, finished, finished, 0));
            s
        };
        let mut w = Window::default();
        w.push(warmed(0, 10, 2), 10_000);
        w.push(warmed(10_000, 20, 5), 10_000);
        assert_eq!(w.figures().itl_requests, 7);
    }

    #[test]
    fn a_restarted_engine_starts_its_own_baseline() {
        // d1 restarts between the first and second looks (its counts fall from 500 to
        // 2): it counts from the second look; d0 from the first.
        let mut w = Window::default();
        w.push(
            look(
                0,
                &[("d0", engine(0, 0, 0, 0)), ("d1", engine(500, 0, 40, 0))],
                &[],
            ),
            20_000,
        );
        w.push(
            look(
                5_000,
                &[("d0", engine(0, 5, 0, 0)), ("d1", engine(2, 0, 0, 0))],
                &[],
            ),
            20_000,
        );
        w.push(
            look(
                10_000,
                &[("d0", engine(0, 10, 1, 0)), ("d1", engine(4, 0, 1, 0))],
                &[],
            ),
            20_000,
        );
        let f = w.figures();
        // d0: 10 slow gaps; d1: 2 fast ones since its restart (not 4, not -496): p90 of
        // 12 gaps, rank 10.8, among the slow.
        let p90 = f.itl_p90_ms.unwrap();
        assert!(p90 > 50.0 && p90 < 100.0, "{p90}");
        let slow_share = (10.8 - 2.0) / 10.0;
        assert!((p90 - (50.0 + 50.0 * slow_share)).abs() < 1e-6, "{p90}");
        assert_eq!(
            f.itl_requests, 2,
            "one finished on each, counted from its baseline"
        );
    }
}
