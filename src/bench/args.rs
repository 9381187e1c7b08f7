//! Arguments of `pdctl bench`.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Where prompts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetKind {
    /// Random words, `--input-len` tokens in, `--output-len` out.
    Random,
    /// The prefix-caching workload: groups sharing a long context.
    Prefix,
    /// ShareGPT JSON (`--dataset-path`): first human turn in, reply length out.
    Sharegpt,
}

/// How the `prefix` dataset assigns instances through the `user` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Strategy {
    /// No designation: the proxy's routing policy decides.
    None,
    /// A random prefill/decode pair per request.
    Random,
    /// Every request of a group to the same pair.
    Designate,
    /// Pairs taken round-robin, request by request.
    Rr,
}

/// Which OpenAI route requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// The requests of a run: dataset, lengths, arrivals, concurrency, model, seed and
/// timeout. One set of flags for `pdctl bench` and `pdctl tune` (which sends the same
/// requests to every split it measures), checked in one place ([`WorkloadArgs::check`]).
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Model name sent in requests (default: the first one GET /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: DatasetKind,
    /// The ShareGPT JSON file (`--dataset sharegpt`).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Requests to send (`pdctl tune`: to each split).
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Poisson arrivals at this many requests per second (default: all at once, bounded
    /// by --max-concurrency).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Requests in flight at once.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Prompt length in tokens (random dataset) or question length (prefix dataset).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Completion length in tokens (default 64). ShareGPT: each reply's own length, capped
    /// by this when given.
    #[arg(long)]
    pub output_len: Option<usize>,
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: Endpoint,
    /// Prefix dataset: number of groups sharing a context.
    #[arg(long, default_value_t = 4)]
    pub prefix_groups: usize,
    /// Prefix dataset: length of each group's shared context, in tokens.
    #[arg(long, default_value_t = 512)]
    pub prefix_len: usize,
    /// Seed for the dataset, arrivals and random designation (`pdctl tune`: the same
    /// requests for every split).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

impl WorkloadArgs {
    /// Refuses values no run can use, naming the flag and what to give instead.
    pub fn check(&self) -> Result<(), WorkloadError> {
        if let Some(r) = self.request_rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(WorkloadError::RequestRate(r));
        }
        if self.max_concurrency == Some(0) {
            return Err(WorkloadError::NoConcurrency);
        }
        if self.output_len == Some(0) {
            return Err(WorkloadError::NoOutput);
        }
        Ok(())
    }
}

/// A workload flag no run can use ([`WorkloadArgs::check`]): each variant names the flag
/// and what to give instead, so `pdctl bench` and `pdctl tune` refuse it the same way.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    #[error("--request-rate {0}: give a number of requests per second above 0")]
    RequestRate(f64),
    #[error("--max-concurrency 0: give at least 1")]
    NoConcurrency,
    #[error("--output-len 0: give at least 1 token")]
    NoOutput,
}

/// Everything `pdctl bench` takes.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The requests to send.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Base URL of an OpenAI-compatible server (default: the running cluster's proxy).
    #[arg(long)]
    pub url: Option<String>,
    /// Key sent as `Authorization: Bearer KEY` to --url (the proxy's client key, when it
    /// has one). When --url is an engine of a cluster running under the state root, its
    /// engine key is sent instead, found in the cluster's state dir.
    #[arg(long, env = "PDCTL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Ask for whole JSON answers instead of streams (`"stream": false`): no TTFT or
    /// inter-token figures then, only end-to-end latency and throughput.
    #[arg(long)]
    pub no_stream: bool,
    /// Prefix dataset: how requests are pinned to instances via `user`.
    #[arg(long, value_enum, default_value = "none")]
    pub strategy: Strategy,
    /// Prefill instances (HOST:PORT or URL) for designation and cache figures
    /// (default: from the running cluster).
    #[arg(long = "prefill")]
    pub prefill: Vec<String>,
    /// Decode instances, likewise.
    #[arg(long = "decode")]
    pub decode: Vec<String>,
    /// Write every figure as JSON (field names as `vllm bench serve` where they mean the same).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Print earlier --json results side by side instead of running (two or more).
    #[arg(long, num_args = 2.., value_names = ["A.json", "B.json"])]
    pub compare: Option<Vec<PathBuf>>,
    /// Draw latency CDFs (TTFT, end-to-end) into an SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Name of this run in JSON, comparisons and plots.
    #[arg(long)]
    pub label: Option<String>,
    /// State root to find the running cluster in (as `pdctl status`).
    #[arg(long, env = "PDCTL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The running cluster to benchmark when several run.
    #[arg(long)]
    pub cluster: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        workload: WorkloadArgs,
    }

    fn check(flags: &[&str]) -> Result<(), WorkloadError> {
        let all = std::iter::once("bench").chain(flags.iter().copied());
        Flags::parse_from(all).workload.check()
    }

    #[test]
    fn each_unusable_flag_is_its_own_error() {
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(
            check(&["--request-rate", "0"]),
            Err(WorkloadError::RequestRate(0.0))
        );
        assert_eq!(
            check(&["--max-concurrency", "0"]),
            Err(WorkloadError::NoConcurrency)
        );
        assert_eq!(check(&["--output-len", "0"]), Err(WorkloadError::NoOutput));
        assert!(
            WorkloadError::NoConcurrency
                .to_string()
                .contains("--max-concurrency 0")
        );
    }
}
