//! Command-line contract of `pdctl sim`, shared by the planner (which builds the argv)
//! and the simulator (which parses it), so the two can never drift apart.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which side of the PD pair a simulated engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimRole {
    Prefill,
    Decode,
    /// A plain engine doing both (no handoff), like a non-disaggregated vLLM.
    Both,
}

/// How KV blocks move from a prefill sim to a decode sim: one mechanism per proxy protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimHandoff {
    /// No handoff: decode always recomputes.
    None,
    /// Two-step protocol: prefill writes files keyed by block hashes into `--kv-dir`,
    /// decode reads them (like ExampleConnector / SharedStorageConnector).
    SharedDir,
    /// NIXL-style: prefill returns `kv_transfer_params`, decode pulls blocks over HTTP.
    Nixl,
    /// Mooncake V1-style: `transfer_id` plus a bootstrap `/query` server on the prefill.
    Mooncake,
}

/// Latency, cache and start-up model of the simulated engine. Also the `[engine.sim]`
/// table of a topology, so every field has a default and a unit in its name.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimModel {
    /// Prefill cost per uncached prompt token, in milliseconds.
    #[arg(long, default_value_t = 0.05)]
    pub prefill_ms_per_token: f64,
    /// Fixed cost per request (scheduling, tokenizing), in milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub overhead_ms: f64,
    /// Time between output tokens of one sequence with nothing else running, in ms.
    #[arg(long, default_value_t = 10.0)]
    pub itl_ms: f64,
    /// Batching effect: each additional running sequence makes a step this much slower
    /// (0.02 = 2 % per sequence).
    #[arg(long, default_value_t = 0.02)]
    pub batch_slowdown: f64,
    /// Time from process start until `/health` answers 200 ("loading the model").
    #[arg(long, default_value_t = 0)]
    pub startup_ms: u64,
    /// Longest prompt + completion, in tokens (as vLLM's --max-model-len).
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u32,
    /// Tokens per KV block (vLLM's default is 16).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Prefix cache capacity in blocks (LRU beyond it).
    #[arg(long, default_value_t = 16384)]
    pub cache_blocks: u32,
    /// Sequences running at once before requests wait (as vLLM's --max-num-seqs).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
}

impl Default for SimModel {
    fn default() -> Self {
        SimModel {
            prefill_ms_per_token: 0.05,
            overhead_ms: 2.0,
            itl_ms: 10.0,
            batch_slowdown: 0.02,
            startup_ms: 0,
            max_model_len: 8192,
            block_size: 16,
            cache_blocks: 16384,
            max_num_seqs: 256,
        }
    }
}

impl SimModel {
    /// A model with every latency at zero, for measuring proxy overhead.
    pub fn zero_latency() -> Self {
        SimModel {
            prefill_ms_per_token: 0.0,
            overhead_ms: 0.0,
            itl_ms: 0.0,
            batch_slowdown: 0.0,
            ..SimModel::default()
        }
    }

    /// The flags that reproduce this model on a `pdctl sim` command line.
    pub fn to_argv(&self) -> Vec<String> {
        vec![
            "--prefill-ms-per-token".into(),
            self.prefill_ms_per_token.to_string(),
            "--overhead-ms".into(),
            self.overhead_ms.to_string(),
            "--itl-ms".into(),
            self.itl_ms.to_string(),
            "--batch-slowdown".into(),
            self.batch_slowdown.to_string(),
            "--startup-ms".into(),
            self.startup_ms.to_string(),
            "--max-model-len".into(),
            self.max_model_len.to_string(),
            "--block-size".into(),
            self.block_size.to_string(),
            "--cache-blocks".into(),
            self.cache_blocks.to_string(),
            "--max-num-seqs".into(),
            self.max_num_seqs.to_string(),
        ]
    }
}

/// Everything `pdctl sim` takes.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// OpenAI-compatible HTTP port (as vLLM's --port).
    #[arg(long)]
    pub port: u16,
    #[arg(long, value_enum, default_value = "both")]
    pub role: SimRole,
    /// Served model name, reported by /v1/models and checked against requests.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Instance name for logs and the engine id (e.g. `prefill-0`).
    #[arg(long)]
    pub instance: Option<String>,
    #[arg(long, value_enum, default_value = "none")]
    pub handoff: SimHandoff,
    /// Shared directory for the `shared-dir` handoff.
    #[arg(long)]
    pub kv_dir: Option<PathBuf>,
    /// Port of the bootstrap `/query` server for the `mooncake` handoff (prefill only).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    #[command(flatten)]
    pub model_params: SimModel,
    /// Fault injection: exit with status 1 after serving this many requests.
    #[arg(long)]
    pub fault_exit_after: Option<u64>,
}

impl SimArgs {
    /// The argv after `pdctl sim` that parses back into exactly these arguments.
    pub fn to_argv(&self) -> Vec<String> {
        let mut v = vec![
            "--host".to_string(),
            self.host.clone(),
            "--port".into(),
            self.port.to_string(),
            "--role".into(),
            value_name(self.role),
            "--model".into(),
            self.model.clone(),
        ];
        if let Some(i) = &self.instance {
            v.extend(["--instance".into(), i.clone()]);
        }
        v.extend(["--handoff".into(), value_name(self.handoff)]);
        if let Some(d) = &self.kv_dir {
            v.extend(["--kv-dir".into(), d.display().to_string()]);
        }
        if let Some(p) = self.bootstrap_port {
            v.extend(["--bootstrap-port".into(), p.to_string()]);
        }
        v.extend(self.model_params.to_argv());
        if let Some(n) = self.fault_exit_after {
            v.extend(["--fault-exit-after".into(), n.to_string()]);
        }
        v
    }
}

/// The command-line spelling of a clap value enum.
pub(crate) fn value_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .expect("no skipped variants")
        .get_name()
        .to_string()
}
