//! The simulated engine's vocabulary: its role, how KV moves between a prefill and a
//! decode sim, and its latency model. Lives in `vocab` because a topology's
//! `[engine.sim]` table is a [`SimModel`], the connectors choose a [`SimHandoff`] per
//! protocol, and the planner writes both into each sim's settings.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

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
    /// NIXL push-style: decode, told where the prefill is, waits for the prefill to hand
    /// over the KV of the request with its own request id (both legs at once).
    NixlPush,
}

/// Latency, cache and start-up model of the simulated engine. Also the `[engine.sim]`
/// table of a topology, so every field has a default and a unit in its name.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimModel {
    /// Prefill cost per uncached prompt token, in milliseconds.
    #[arg(long, default_value_t = SimModel::default().prefill_ms_per_token)]
    pub prefill_ms_per_token: f64,
    /// Fixed cost per request (scheduling, tokenizing), in milliseconds.
    #[arg(long, default_value_t = SimModel::default().overhead_ms)]
    pub overhead_ms: f64,
    /// Time between output tokens of one sequence with nothing else running, in ms.
    #[arg(long, default_value_t = SimModel::default().itl_ms)]
    pub itl_ms: f64,
    /// Batching effect: each additional running sequence makes a step this much slower
    /// (0.02 = 2 % per sequence).
    #[arg(long, default_value_t = SimModel::default().batch_slowdown)]
    pub batch_slowdown: f64,
    /// Time from process start until `/health` answers 200 ("loading the model").
    #[arg(long, default_value_t = SimModel::default().startup_ms)]
    pub startup_ms: u64,
    /// Longest prompt + completion, in tokens (as vLLM's --max-model-len).
    #[arg(long, default_value_t = SimModel::default().max_model_len)]
    pub max_model_len: u32,
    /// Tokens per KV block (vLLM's default is 16).
    #[arg(long, default_value_t = SimModel::default().block_size)]
    pub block_size: u32,
    /// Prefix cache capacity in blocks (LRU beyond it).
    #[arg(long, default_value_t = SimModel::default().cache_blocks)]
    pub cache_blocks: u32,
    /// Sequences running at once before requests wait (as vLLM's --max-num-seqs).
    #[arg(long, default_value_t = SimModel::default().max_num_seqs)]
    pub max_num_seqs: u32,
    /// Cost of loading one handed-off KV token on the decode side, in milliseconds
    /// (much cheaper than computing it, as a real KV transfer is).
    #[arg(long, default_value_t = SimModel::default().kv_load_ms_per_token)]
    pub kv_load_ms_per_token: f64,
    /// How long a decode waits for a mooncake transfer before it recomputes, in ms.
    #[arg(long, default_value_t = SimModel::default().handoff_wait_ms)]
    pub handoff_wait_ms: u64,
    /// How long a prefill keeps KV blocks for a decode that never pulls them, in ms
    /// (vLLM's NIXL abort timeout plays this part).
    #[arg(long, default_value_t = SimModel::default().kv_hold_timeout_ms)]
    pub kv_hold_timeout_ms: u64,
    /// Prompts an instance computes at once, each at full speed; the others wait their
    /// turn in arrival order, so prefill time grows with the prompt tokens queued on the
    /// instance, as on a GPU. 0 = no limit (every prompt computes alongside the others).
    #[arg(long, default_value_t = SimModel::default().max_concurrent_prefills)]
    pub max_concurrent_prefills: u32,
}

/// The one place the simulated model's defaults are written: clap's `default_value_t`s,
/// the `[engine.sim]` table and the config file's missing keys all read it.
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
            kv_load_ms_per_token: 0.005,
            handoff_wait_ms: 30_000,
            kv_hold_timeout_ms: 120_000,
            max_concurrent_prefills: 1,
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
            kv_load_ms_per_token: 0.0,
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
            "--kv-load-ms-per-token".into(),
            self.kv_load_ms_per_token.to_string(),
            "--handoff-wait-ms".into(),
            self.handoff_wait_ms.to_string(),
            "--kv-hold-timeout-ms".into(),
            self.kv_hold_timeout_ms.to_string(),
            "--max-concurrent-prefills".into(),
            self.max_concurrent_prefills.to_string(),
        ]
    }
}
