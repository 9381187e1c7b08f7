//! Arguments of `pdctl tune`: the budget, the objectives and the workload (the bench's
//! own dataset flags, so a workload measured with `pdctl bench` is tuned for as written).

use super::choose::{Budget, Slo, parse_ms};
use crate::bench::args::{BenchArgs, Strategy, WorkloadArgs};
use clap::Args;
use std::path::PathBuf;

/// Everything `pdctl tune` takes besides which cluster.
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    /// Instances to share between prefill and decode (default: as many as run now).
    #[arg(long, conflicts_with = "gpu_budget")]
    pub budget: Option<u32>,
    /// GPUs to share instead, each instance holding as many as its role's
    /// gpus_per_instance.
    #[arg(long)]
    pub gpu_budget: Option<u32>,
    /// Objective for the time to first token, e.g. 200ms or 0.2s.
    #[arg(long, value_parser = parse_ms, value_name = "DURATION")]
    pub ttft_p90: Option<f64>,
    /// Objective for the inter-token latency, e.g. 30ms.
    #[arg(long, value_parser = parse_ms, value_name = "DURATION")]
    pub itl_p90: Option<f64>,
    /// The requests sent to every split (the bench's own flags).
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Seconds a removed instance's requests in flight get when the split changes.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
    /// Leave the cluster on the best split (default: back to the split it runs now).
    #[arg(long)]
    pub apply: bool,
    /// Write every split's figures and the best split as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw every split's latency CDFs into an SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

impl TuneArgs {
    /// The objectives given.
    pub fn slo(&self) -> Slo {
        Slo {
            ttft_p90_ms: self.ttft_p90,
            itl_p90_ms: self.itl_p90,
        }
    }

    /// The budget given, or the running split's size; `gpus_per` is what one prefill and
    /// one decode instance hold.
    pub fn budget(&self, running: u32, gpus_per: (u32, u32)) -> Budget {
        match (self.budget, self.gpu_budget) {
            (_, Some(gpus)) => Budget::Gpus {
                gpus,
                per_prefill: gpus_per.0,
                per_decode: gpus_per.1,
            },
            (Some(n), None) => Budget::Instances(n),
            (None, None) => Budget::Instances(running),
        }
    }

    /// The workload as the bench takes it (no designation: the proxy routes).
    pub fn bench_args(&self) -> BenchArgs {
        BenchArgs {
            workload: self.workload.clone(),
            url: None,
            // Through the proxy, with its client key when the cluster has one.
            api_key: std::env::var("PDCTL_API_KEY")
                .ok()
                .filter(|k| !k.is_empty()),
            no_stream: false,
            strategy: Strategy::None,
            prefill: Vec::new(),
            decode: Vec::new(),
            json: None,
            compare: None,
            plot: None,
            label: None,
            state_dir: None,
            cluster: None,
        }
    }
}
