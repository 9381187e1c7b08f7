//! The result of `pdctl tune`: the table a person reads, the JSON a script reads (with a
//! top-level `best`); its plot (the bench's latency CDFs, one line per split) is drawn by
//! `src/pictures` for the command line.

use super::{Measured, Slo, Split};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// The workload as the result records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadInfo {
    pub dataset: String,
    pub num_prompts: usize,
    pub input_len: usize,
    pub output_len: Option<usize>,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
}

/// Everything one sweep found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuneResult {
    pub cluster: String,
    /// `4 instances` or `8 GPUs`.
    pub budget: String,
    pub slo: Slo,
    pub workload: WorkloadInfo,
    /// The split the cluster ran before the sweep.
    pub start: Split,
    pub splits: Vec<Measured>,
    pub best: Split,
    /// Whether the best split meets the objectives (false: none did; it is the one with
    /// the highest goodput).
    pub best_meets_slo: bool,
    /// The split the cluster runs after the sweep (`--apply`: the best one).
    pub left_on: Split,
}

impl TuneResult {
    /// One row per split, the best marked, then a sentence naming it.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{:<8} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9}  SLO",
            "split", "req/s", "goodput", "failed", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90",
        );
        for m in &self.splits {
            let mark = if m.split() == self.best { " *" } else { "" };
            let _ = writeln!(
                o,
                "{:<8} {:>9.2} {:>9.2} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {}{mark}",
                m.split().to_string(),
                m.request_throughput,
                m.goodput,
                m.failed,
                m.ttft_p50_ms,
                m.ttft_p90_ms,
                m.itl_p50_ms,
                m.itl_p90_ms,
                if m.meets_slo { "met" } else { "missed" },
            );
        }
        let _ = writeln!(
            o,
            "(latencies in ms; goodput: requests per second within the objectives: {})",
            self.slo.describe()
        );
        let how = if self.best_meets_slo {
            "meets the objectives with the highest goodput"
        } else {
            "has the highest goodput, but NO split met the objectives"
        };
        let _ = writeln!(
            o,
            "best split: {} ({} prefill, {} decode) {how}; the cluster runs {}",
            self.best, self.best.prefill, self.best.decode, self.left_on
        );
        o
    }
}
