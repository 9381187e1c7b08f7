//! The figures of one run: computed from outcomes, printed as a table, written as JSON
//! (field names as `vllm bench serve` where they mean the same), compared side by side.

use super::runner::Outcome;
use super::stats::{Summary, summarize};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Prefix-cache figures of one engine over the run (deltas of its /metrics counters).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheFigures {
    pub instance: String,
    pub queries: f64,
    pub hits: f64,
    pub hit_rate: f64,
}

/// Everything a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// What was run against what (its fields sit at the top level of the JSON).
    #[serde(flatten)]
    pub run: RunInfo,
    pub num_prompts: usize,
    pub duration: f64,
    pub completed: usize,
    pub failed: usize,
    /// Distinct error messages with how often each happened.
    pub errors: BTreeMap<String, usize>,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub e2el_ms: Summary,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_tpot_ms: f64,
    pub median_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub mean_itl_ms: f64,
    pub median_itl_ms: f64,
    pub p99_itl_ms: f64,
    pub mean_e2el_ms: f64,
    pub median_e2el_ms: f64,
    pub p99_e2el_ms: f64,
    /// Per engine, when the engines' URLs are known.
    pub prefix_cache: Vec<CacheFigures>,
    /// Hits / queries over every engine, when known.
    pub prefix_cache_hit_rate: Option<f64>,
    /// What the pdctl proxy in front did for the run's requests (deltas of its /metrics),
    /// when the target is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyWork>,
    /// Per successful request, seconds (as vLLM's result JSON).
    pub ttfts: Vec<f64>,
    pub e2els: Vec<f64>,
}

/// The proxy's own work over a run: legs retried before a first byte, and streams whose
/// decode broke off and that went on on another decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProxyWork {
    pub retries: f64,
    pub migrations: f64,
}

/// Describes the run for the report header.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub label: String,
    pub url: String,
    pub model: String,
    pub endpoint: String,
    /// Streamed answers (`false`: whole JSON answers, `--no-stream`; runs written before
    /// the flag existed were streamed).
    #[serde(default = "streamed")]
    pub stream: bool,
    pub dataset: String,
    pub strategy: String,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
}

fn streamed() -> bool {
    true
}

impl Report {
    /// Computes the figures from the outcomes of a run that took `duration` seconds.
    pub fn from_outcomes(
        info: RunInfo,
        outcomes: &[Outcome],
        duration: f64,
        cache: Vec<CacheFigures>,
    ) -> Report {
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
        let mut errors = BTreeMap::new();
        for o in outcomes.iter().filter(|o| !o.ok) {
            *errors
                .entry(o.error.clone().unwrap_or_else(|| "unknown".into()))
                .or_insert(0) += 1;
        }
        let ttfts: Vec<f64> = ok.iter().filter_map(|o| o.ttft_ms).collect();
        let tpots: Vec<f64> = ok
            .iter()
            .filter(|o| o.output_tokens > 1)
            .filter_map(|o| {
                o.ttft_ms
                    .map(|t| (o.e2e_ms - t) / (o.output_tokens - 1) as f64)
            })
            .collect();
        let itls: Vec<f64> = ok.iter().flat_map(|o| o.itl_ms.iter().copied()).collect();
        let e2els: Vec<f64> = ok.iter().map(|o| o.e2e_ms).collect();
        let tin: usize = ok.iter().map(|o| o.prompt_tokens).sum();
        let tout: usize = ok.iter().map(|o| o.output_tokens).sum();
        let d = duration.max(1e-9);
        let (ttft, tpot, itl, e2el) = (
            summarize(&ttfts),
            summarize(&tpots),
            summarize(&itls),
            summarize(&e2els),
        );
        let (q, h): (f64, f64) = cache
            .iter()
            .fold((0.0, 0.0), |(q, h), c| (q + c.queries, h + c.hits));
        Report {
            run: info,
            num_prompts: outcomes.len(),
            duration,
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            errors,
            total_input_tokens: tin,
            total_output_tokens: tout,
            request_throughput: ok.len() as f64 / d,
            output_throughput: tout as f64 / d,
            total_token_throughput: (tin + tout) as f64 / d,
            mean_ttft_ms: ttft.mean,
            median_ttft_ms: ttft.median,
            p99_ttft_ms: ttft.p99,
            mean_tpot_ms: tpot.mean,
            median_tpot_ms: tpot.median,
            p99_tpot_ms: tpot.p99,
            mean_itl_ms: itl.mean,
            median_itl_ms: itl.median,
            p99_itl_ms: itl.p99,
            mean_e2el_ms: e2el.mean,
            median_e2el_ms: e2el.median,
            p99_e2el_ms: e2el.p99,
            ttft_ms: ttft,
            tpot_ms: tpot,
            itl_ms: itl,
            e2el_ms: e2el,
            prefix_cache_hit_rate: (q > 0.0).then(|| h / q),
            prefix_cache: cache,
            proxy: None,
            ttfts: ttfts.iter().map(|x| x / 1e3).collect(),
            e2els: e2els.iter().map(|x| x / 1e3).collect(),
        }
    }

    /// The table a person reads after a run.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "{:=^52}", format!(" {} ", self.run.label));
        self.totals_rows(&mut o);
        // With nothing completed there is no latency to show, only the errors.
        if self.completed > 0 {
            self.latency_rows(&mut o);
        }
        if !self.prefix_cache.is_empty() {
            let _ = writeln!(o, "{:-^52}", " Prefix cache (engines' /metrics, this run) ");
            for c in &self.prefix_cache {
                table_line(
                    &mut o,
                    &format!("{}:", c.instance),
                    format!("{:.1} %", c.hit_rate * 100.0),
                );
            }
            if let Some(r) = self.prefix_cache_hit_rate {
                table_line(&mut o, "All instances:", format!("{:.1} %", r * 100.0));
            }
        }
        if let Some(w) = self.proxy {
            let _ = writeln!(o, "{:-^52}", " Proxy (its /metrics, this run) ");
            table_line(&mut o, "Legs retried:", format!("{:.0}", w.retries));
            table_line(
                &mut o,
                "Streams continued elsewhere:",
                format!("{:.0}", w.migrations),
            );
        }
        if !self.errors.is_empty() {
            let _ = writeln!(o, "{:-^52}", " Errors ");
            for (e, n) in &self.errors {
                let _ = writeln!(o, "{n:>5} x {e}");
            }
        }
        let _ = writeln!(o, "{}", "=".repeat(52));
        o
    }

    /// The table's first rows: requests, duration, tokens, throughputs.
    fn totals_rows(&self, o: &mut String) {
        let rows = [
            ("Successful requests:", self.completed.to_string()),
            ("Failed requests:", self.failed.to_string()),
            ("Benchmark duration (s):", format!("{:.2}", self.duration)),
            ("Total input tokens:", self.total_input_tokens.to_string()),
            (
                "Total generated tokens:",
                self.total_output_tokens.to_string(),
            ),
            (
                "Request throughput (req/s):",
                format!("{:.2}", self.request_throughput),
            ),
            (
                "Output token throughput (tok/s):",
                format!("{:.2}", self.output_throughput),
            ),
            (
                "Total token throughput (tok/s):",
                format!("{:.2}", self.total_token_throughput),
            ),
        ];
        for (k, v) in rows {
            table_line(o, k, v);
        }
    }

    /// Mean, median, P90 and P99 of each latency, a section each.
    fn latency_rows(&self, o: &mut String) {
        let latencies = [
            ("Time to First Token", "TTFT", &self.ttft_ms),
            (
                "Time per Output Token (excl. 1st token)",
                "TPOT",
                &self.tpot_ms,
            ),
            ("Inter-token Latency", "ITL", &self.itl_ms),
            ("End-to-end Latency", "E2EL", &self.e2el_ms),
        ];
        for (name, short, s) in latencies {
            let _ = writeln!(o, "{:-^52}", format!(" {name} "));
            for (which, v) in [
                ("Mean", s.mean),
                ("Median", s.median),
                ("P90", s.p90),
                ("P99", s.p99),
            ] {
                table_line(o, &format!("{which} {short} (ms):"), format!("{v:.2}"));
            }
        }
    }
}

/// One row of [`Report::table`]: the name left, the value right.
fn table_line(o: &mut String, k: &str, v: String) {
    let _ = writeln!(o, "{k:<40}{v:>12}");
}

/// Runs side by side, for `--compare`: each figure of each run, and each run's ratio to
/// the first (the column `B/A` when there are two).
pub fn compare(runs: &[&Report]) -> String {
    let mut o = String::new();
    let _ = write!(o, "{:<32}", "");
    for r in runs {
        let _ = write!(o, "{:>16}", r.run.label);
    }
    if runs.len() == 2 {
        let _ = write!(o, "{:>10}", "B/A");
    }
    o.push('\n');
    let hit = |r: &Report| r.prefix_cache_hit_rate.unwrap_or(f64::NAN) * 100.0;
    type Figure = fn(&Report) -> f64;
    let rows: [(&str, Figure); 14] = [
        ("completed", |r| r.completed as f64),
        ("failed", |r| r.failed as f64),
        ("request throughput (req/s)", |r| r.request_throughput),
        ("output throughput (tok/s)", |r| r.output_throughput),
        ("mean TTFT (ms)", |r| r.ttft_ms.mean),
        ("median TTFT (ms)", |r| r.ttft_ms.median),
        ("p99 TTFT (ms)", |r| r.ttft_ms.p99),
        ("median TPOT (ms)", |r| r.tpot_ms.median),
        ("p99 TPOT (ms)", |r| r.tpot_ms.p99),
        ("median ITL (ms)", |r| r.itl_ms.median),
        ("median E2E (ms)", |r| r.e2el_ms.median),
        ("p99 E2E (ms)", |r| r.e2el_ms.p99),
        ("prefix cache hit rate (%)", hit),
        ("duration (s)", |r| r.duration),
    ];
    let fmt = |v: f64| {
        if v.is_finite() {
            format!("{v:.2}")
        } else {
            "-".into()
        }
    };
    for (name, get) in rows {
        let _ = write!(o, "{name:<32}");
        let first = get(runs[0]);
        for r in runs {
            let _ = write!(o, "{:>16}", fmt(get(r)));
        }
        if runs.len() == 2 {
            let y = get(runs[1]);
            let ratio = if first.abs() > 1e-12 && first.is_finite() && y.is_finite() {
                format!("{:.2}", y / first)
            } else {
                "-".into()
            };
            let _ = write!(o, "{ratio:>10}");
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ttft: f64, e2e: f64, out: usize) -> Outcome {
        Outcome {
            ok: true,
            ttft_ms: Some(ttft),
            itl_ms: vec![(e2e - ttft) / (out - 1) as f64; out - 1],
            e2e_ms: e2e,
            prompt_tokens: 10,
            output_tokens: out,
            ..Outcome::default()
        }
    }

    #[test]
    fn figures_follow_from_outcomes() {
        let mut outs = vec![outcome(100.0, 190.0, 10), outcome(200.0, 290.0, 10)];
        outs.push(Outcome {
            error: Some("HTTP 502: prefill down".into()),
            ..Outcome::default()
        });
        let r = Report::from_outcomes(RunInfo::default(), &outs, 2.0, vec![]);
        assert_eq!((r.completed, r.failed), (2, 1));
        assert_eq!(r.errors["HTTP 502: prefill down"], 1);
        assert_eq!(r.mean_ttft_ms, 150.0);
        assert!((r.mean_tpot_ms - 10.0).abs() < 1e-9);
        assert_eq!(r.total_output_tokens, 20);
        assert_eq!(r.request_throughput, 1.0);
        assert_eq!(r.ttfts, vec![0.1, 0.2]);
        assert!(r.table().contains("Failed requests:"));
    }

    #[test]
    fn cache_figures_add_up_over_instances() {
        let cache = vec![
            CacheFigures {
                instance: "a".into(),
                queries: 100.0,
                hits: 90.0,
                hit_rate: 0.9,
            },
            CacheFigures {
                instance: "b".into(),
                queries: 100.0,
                hits: 10.0,
                hit_rate: 0.1,
            },
        ];
        let r = Report::from_outcomes(RunInfo::default(), &[outcome(1.0, 2.0, 2)], 1.0, cache);
        assert_eq!(r.prefix_cache_hit_rate, Some(0.5));
    }

    #[test]
    fn comparisons_show_ratios() {
        let a = Report::from_outcomes(
            RunInfo {
                label: "a".into(),
                ..RunInfo::default()
            },
            &[outcome(100.0, 200.0, 2)],
            1.0,
            vec![],
        );
        let b = Report::from_outcomes(
            RunInfo {
                label: "b".into(),
                ..RunInfo::default()
            },
            &[outcome(50.0, 200.0, 2)],
            1.0,
            vec![],
        );
        let t = compare(&[&a, &b]);
        let row = t.lines().find(|l| l.starts_with("mean TTFT")).unwrap();
        assert!(row.trim_end().ends_with("0.50"), "{row}");
    }
}
