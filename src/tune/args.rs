//! Arguments of `pdctl tune`: the budget, the objectives and the workload (the bench's
//! own dataset flags, so a workload measured with `pdctl bench` is tuned for as written).

use super::choose::{Budget, Slo, parse_ms};
use crate::bench::args::{BenchArgs, DatasetKind, Endpoint, Strategy};
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
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: DatasetKind,
    /// The ShareGPT JSON file (`--dataset sharegpt`).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Requests per split.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Poisson arrivals at this many requests per second (default: all at once, bounded
    /// by --max-concurrency).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Requests in flight at once.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Completion length in tokens (default 64).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Prefix dataset: number of groups sharing a context.
    #[arg(long, default_value_t = 4)]
    pub prefix_groups: usize,
    /// Prefix dataset: length of each group's shared context, in tokens.
    #[arg(long, default_value_t = 512)]
    pub prefix_len: usize,
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: Endpoint,
    /// Model name sent in requests (default: the first one the proxy lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Seed for the dataset and arrivals (the same requests for every split).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
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
            url: None,
            // Through the proxy, with its client key when the cluster has one.
            api_key: std::env::var("PDCTL_API_KEY")
                .ok()
                .filter(|k| !k.is_empty()),
            model: self.model.clone(),
            dataset: self.dataset,
            dataset_path: self.dataset_path.clone(),
            num_prompts: self.num_prompts,
            request_rate: self.request_rate,
            max_concurrency: self.max_concurrency,
            input_len: self.input_len,
            output_len: self.output_len,
            endpoint: self.endpoint,
            no_stream: false,
            prefix_groups: self.prefix_groups,
            prefix_len: self.prefix_len,
            strategy: Strategy::None,
            prefill: Vec::new(),
            decode: Vec::new(),
            json: None,
            compare: None,
            plot: None,
            seed: self.seed,
            timeout_s: self.timeout_s,
            label: None,
            state_dir: None,
            cluster: None,
        }
    }
}
