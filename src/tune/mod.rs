//! `pdctl tune`: finds the prefill:decode split for a workload and its objectives on the
//! running cluster by measuring it. Each candidate split is reached with a live change
//! (the caller's `move_to`, which never restarts the proxy nor fails a request), the
//! bench's own runner sends the workload (its prompts led by a word of their own per
//! split, so no split is served from caches an earlier one filled), and the splits are
//! ranked by goodput within the objectives (`choose`). The table, JSON and plot of the result are in `report`.

pub mod args;
pub mod choose;
pub mod report;

use crate::bench::dataset::BenchRequest;
use crate::bench::report::{Report, RunInfo};
use crate::bench::runner::{self, Load};
use anyhow::Context;
pub use choose::{Budget, Slo, Split};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::Duration;

/// The requests sent to every split, how, and what they are held to.
#[derive(Debug, Clone)]
pub struct Workload {
    pub load: Load,
    pub requests: Vec<BenchRequest>,
    pub slo: Slo,
    /// For the bench report's header (dataset name).
    pub dataset: String,
}

/// One split, measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    pub prefill: u32,
    pub decode: u32,
    pub completed: usize,
    pub failed: usize,
    pub request_throughput: f64,
    /// Requests per second that completed within the objectives.
    pub goodput: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p90_ms: f64,
    /// Whether the split's p90s meet the objectives (and it failed no request).
    pub meets_slo: bool,
    /// Every figure of the bench run, as `pdctl bench --json` writes them.
    pub bench: Report,
}

impl Measured {
    /// The split this was measured on.
    pub fn split(&self) -> Split {
        Split {
            prefill: self.prefill,
            decode: self.decode,
        }
    }

    /// What ranking looks at.
    pub fn score(&self) -> choose::Score {
        choose::Score {
            meets_slo: self.meets_slo,
            goodput: self.goodput,
            request_throughput: self.request_throughput,
            failed: self.failed,
        }
    }
}

/// Measures every split in `splits`, in order: `move_to` changes the cluster to it, then
/// the workload runs against it. Stops at the first split the cluster cannot be moved to.
pub async fn sweep<F, Fut>(
    splits: &[Split],
    workload: &Workload,
    mut move_to: F,
) -> anyhow::Result<Vec<Measured>>
where
    F: FnMut(Split) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(1024)
        .build()?;
    let mut out = Vec::with_capacity(splits.len());
    let n = splits.len();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    for (i, split) in splits.iter().enumerate() {
        eprintln!("pdctl tune: [{}/{n}] {split}: changing the split", i + 1);
        move_to(*split)
            .await
            .with_context(|| format!("moving the cluster to {split}"))?;
        let total = workload.requests.len();
        eprintln!(
            "pdctl tune: [{}/{n}] {split}: sending {total} requests",
            i + 1
        );
        let requests = fresh(&workload.requests, &format!("{nonce:x}{split}"));
        let (outcomes, duration) = runner::run(&client, &workload.load, &requests, move |done| {
            if done == total || done % (total / 4).max(1) == 0 {
                eprintln!("pdctl tune:         {done}/{total} requests done");
            }
        })
        .await;
        let m = measure(*split, workload, &outcomes, duration);
        eprintln!(
            "pdctl tune: [{}/{n}] {split}: {:.2} req/s, goodput {:.2} req/s, TTFT p90 {:.1} ms, ITL p90 {:.1} ms, {} failed",
            i + 1,
            m.request_throughput,
            m.goodput,
            m.ttft_p90_ms,
            m.itl_p90_ms,
            m.failed
        );
        out.push(m);
    }
    Ok(out)
}

/// The workload's requests, each prompt led by `salt`, so no split is served from the
/// prefix caches an earlier split (or an earlier sweep) filled: every block hash chains
/// from the first one. Prompts sharing a prefix within the workload still share it.
pub fn fresh(requests: &[BenchRequest], salt: &str) -> Vec<BenchRequest> {
    requests
        .iter()
        .map(|r| BenchRequest {
            prompt: format!("{salt} {}", r.prompt),
            ..r.clone()
        })
        .collect()
}

/// The figures of one split from its outcomes.
pub fn measure(
    split: Split,
    workload: &Workload,
    outcomes: &[runner::Outcome],
    duration: f64,
) -> Measured {
    let info = RunInfo {
        label: split.to_string(),
        url: workload.load.url.clone(),
        model: workload.load.model.clone(),
        endpoint: crate::spelling::value_name(workload.load.endpoint),
        stream: workload.load.stream,
        dataset: workload.dataset.clone(),
        strategy: "none".into(),
        request_rate: workload.load.request_rate,
        max_concurrency: workload.load.max_concurrency,
    };
    let bench = Report::from_outcomes(info, outcomes, duration, Vec::new());
    let (ttft, itl) = (bench.ttft_ms, bench.itl_ms);
    Measured {
        prefill: split.prefill,
        decode: split.decode,
        completed: bench.completed,
        failed: bench.failed,
        request_throughput: bench.request_throughput,
        goodput: choose::goodput(&workload.slo, outcomes, duration),
        ttft_p50_ms: ttft.median,
        ttft_p90_ms: ttft.p90,
        itl_p50_ms: itl.median,
        itl_p90_ms: itl.p90,
        meets_slo: bench.completed > 0
            && bench.failed == 0
            && workload.slo.met_by_split(ttft.p90, itl.p90),
        bench,
    }
}
