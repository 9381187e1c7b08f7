//! Settings of `pdctl sim`, shared by the planner (which writes them into each sim's
//! config file) and the simulator (which reads them from flags or `--config FILE`, see
//! [`super`]), so the two can never drift apart; one set of defaults
//! ([`SimModel::default`], [`SimArgs::default`]).

use super::ChildConfig;
use crate::spelling::value_name;
use crate::topology::KvLoadFailurePolicy;
use crate::vocab::{SimHandoff, SimModel, SimRole};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Left out of generated config files: the policy the simulator always played.
fn is_recompute(p: &KvLoadFailurePolicy) -> bool {
    *p == KvLoadFailurePolicy::Recompute
}

/// Everything `pdctl sim` takes, as flags or as keys of its config file (the latency
/// model's keys in its `[model_params]` table).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value_t = SimArgs::default().host)]
    pub host: String,
    /// OpenAI-compatible HTTP port (as vLLM's --port).
    #[arg(long, required_unless_present = "config", default_value_t = SimArgs::default().port, hide_default_value = true)]
    pub port: u16,
    /// Which side of the PD pair this instance plays.
    #[arg(long, value_enum, default_value_t = SimArgs::default().role)]
    pub role: SimRole,
    /// Served model name, reported by /v1/models and checked against requests.
    #[arg(long, default_value_t = SimArgs::default().model)]
    pub model: String,
    /// Instance name for logs and the engine id (e.g. `prefill-0`).
    #[arg(long)]
    pub instance: Option<String>,
    /// How KV reaches the decode side (must match the proxy's protocol).
    #[arg(long, value_enum, default_value_t = SimArgs::default().handoff)]
    pub handoff: SimHandoff,
    /// Shared directory for the `shared-dir` handoff.
    #[arg(long)]
    pub kv_dir: Option<PathBuf>,
    /// Port of the bootstrap `/query` server for the `mooncake` handoff (prefill only).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// What a decode does with a KV handoff it could not load, as vLLM's
    /// `kv_load_failure_policy`: recompute the prompt (the answer is right, only slower),
    /// or fail the request with vLLM's generation error (a 500, or an error event in a
    /// stream).
    #[arg(long, value_enum, default_value_t = SimArgs::default().kv_load_failure_policy)]
    #[serde(skip_serializing_if = "is_recompute")]
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    #[command(flatten)]
    pub model_params: SimModel,
    /// Fault injection: exit with status 1 after serving this many requests.
    #[arg(long)]
    pub fault_exit_after: Option<u64>,
    /// Fault injection: the first KV handoff this decode takes fails, as vLLM's first
    /// NIXL handshake with a prefill does when it times out (under kv_load_failure_policy
    /// "fail" the request fails; "recompute": decode recomputes).
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fault_first_handshake_fails: bool,
    /// Host that decode instances use to pull KV from this one (nixl `remote_host`).
    /// Defaults to --host, or 127.0.0.1 when --host is a wildcard address.
    #[arg(long)]
    pub kv_host: Option<String>,
    /// Interval of the periodic stats log line (throughput, running, cache hit rate);
    /// 0 turns it off.
    #[arg(long, default_value_t = SimArgs::default().log_stats_interval_ms)]
    pub log_stats_interval_ms: u64,
    /// Require `Authorization: Bearer KEY` on /v1/* routes, as `vllm serve --api-key`
    /// does (/health, /metrics and /version stay open).
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Simulate this many engines in one process, on --port, --port + 1, ..., each with
    /// its own state and metrics: for benchmarks of large clusters on a small machine,
    /// where as many processes would spend the machine waking each other
    /// (bench/scale-cost.sh). Not with --bootstrap-port or --instance.
    #[arg(long, default_value_t = SimArgs::default().instances)]
    #[serde(skip_serializing_if = "is_one")]
    pub instances: u16,
}

fn is_one(n: &u16) -> bool {
    *n == 1
}

/// The defaults of `pdctl sim`; `port` has none on the command line (`--port` or a config
/// file's `port` is required), 0 here only fills the struct.
impl Default for SimArgs {
    fn default() -> Self {
        SimArgs {
            host: "127.0.0.1".into(),
            port: 0,
            role: SimRole::Both,
            model: "sim-model".into(),
            instance: None,
            handoff: SimHandoff::None,
            kv_dir: None,
            bootstrap_port: None,
            kv_load_failure_policy: KvLoadFailurePolicy::Recompute,
            model_params: SimModel::default(),
            fault_exit_after: None,
            fault_first_handshake_fails: false,
            kv_host: None,
            log_stats_interval_ms: 10_000,
            api_key: None,
            instances: 1,
        }
    }
}

impl ChildConfig for SimArgs {
    const COMMAND: &'static str = "sim";
    const REQUIRED: &'static [&'static str] = &["port"];
    fn keep_secrets(&mut self, flags: &Self) {
        self.api_key.clone_from(&flags.api_key);
    }
}

impl SimArgs {
    /// The argv after `pdctl sim` that parses back into exactly these arguments (what
    /// `export` gives a pod), the API key excepted: a secret travels in the environment (`VLLM_API_KEY`), never on a
    /// command line that `ps` shows.
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
        if !is_recompute(&self.kv_load_failure_policy) {
            v.extend([
                "--kv-load-failure-policy".into(),
                value_name(self.kv_load_failure_policy),
            ]);
        }
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
        if self.fault_first_handshake_fails {
            v.push("--fault-first-handshake-fails".into());
        }
        if let Some(h) = &self.kv_host {
            v.extend(["--kv-host".into(), h.clone()]);
        }
        if !is_one(&self.instances) {
            v.extend(["--instances".into(), self.instances.to_string()]);
        }
        v.extend([
            "--log-stats-interval-ms".into(),
            self.log_stats_interval_ms.to_string(),
        ]);
        v
    }
}

/// Every setting away from its default, for the tests that a value survives a trip.
#[cfg(test)]
pub(crate) fn every_setting() -> SimArgs {
    SimArgs {
        host: "0.0.0.0".into(),
        port: 8200,
        role: SimRole::Prefill,
        model: "qwen".into(),
        instance: Some("prefill-1".into()),
        handoff: SimHandoff::Mooncake,
        kv_dir: Some(PathBuf::from("/tmp/kv dir")),
        bootstrap_port: Some(8998),
        kv_load_failure_policy: KvLoadFailurePolicy::Fail,
        model_params: SimModel {
            prefill_ms_per_token: 0.125,
            overhead_ms: 0.1,
            itl_ms: 7.3,
            batch_slowdown: 0.015,
            startup_ms: 2500,
            max_model_len: 4096,
            block_size: 32,
            cache_blocks: 9,
            max_num_seqs: 3,
            kv_load_ms_per_token: 0.0001,
            handoff_wait_ms: 1234,
            kv_hold_timeout_ms: 5678,
            max_concurrent_prefills: 2,
        },
        fault_exit_after: Some(7),
        fault_first_handshake_fails: true,
        kv_host: Some("10.0.0.2".into()),
        log_stats_interval_ms: 0,
        api_key: None,
        instances: 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        sim: crate::child_config::Configured<SimArgs>,
    }

    fn parse(argv: &[String]) -> SimArgs {
        let mut full = vec!["pdctl-sim".to_string()];
        full.extend_from_slice(argv);
        Wrapper::try_parse_from(full)
            .expect("to_argv output parses")
            .sim
            .flags
    }

    #[test]
    fn to_argv_round_trips_defaults_and_every_field() {
        let minimal = parse(&["--port".into(), "8100".into()]);
        assert_eq!(parse(&minimal.to_argv()), minimal);
        assert_eq!(minimal.model_params, SimModel::default());
        let full = every_setting();
        assert_eq!(parse(&full.to_argv()), full);
        let keyed = SimArgs {
            api_key: Some("secret".into()),
            ..full.clone()
        };
        assert!(!keyed.to_argv().iter().any(|a| a.contains("secret")));
        let zero = SimArgs {
            model_params: SimModel::zero_latency(),
            ..minimal
        };
        assert_eq!(parse(&zero.to_argv()), zero);
    }

    #[test]
    fn topology_table_fills_defaults_and_rejects_typos() {
        let m: SimModel = toml::from_str("itl_ms = 5.0\nhandoff_wait_ms = 100").unwrap();
        assert_eq!(m.itl_ms, 5.0);
        assert_eq!(m.handoff_wait_ms, 100);
        assert_eq!(m.block_size, 16);
        let err = toml::from_str::<SimModel>("itl = 5.0")
            .unwrap_err()
            .to_string();
        assert!(err.contains("itl"), "{err}");
    }
}
