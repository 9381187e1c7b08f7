//! Command-line contract of `pdctl proxy`, shared by the planner (which builds the argv
//! for the embedded proxy) and the proxy (which parses it).

use crate::spelling::value_name;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How one client request is split over a prefill and a decode instance. Chosen by the
/// connector (see `connectors`), never by the user directly in a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyProtocol {
    /// Prefill copy with max_tokens=1, wait, then the original to decode.
    TwoStep,
    /// kv_transfer_params handshake (NixlConnector): prefill's returned params go to decode.
    Nixl,
    /// Mooncake V1: a shared transfer_id, decode told the prefill's bootstrap address.
    Mooncake,
}

/// How an instance is picked for one leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    RoundRobin,
    Random,
    LeastLoaded,
    PrefixAware,
}

/// Everything `pdctl proxy` takes.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// Client-facing port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill instance base URL (http://HOST:PORT or HOST:PORT); repeat for each.
    #[arg(long = "prefill", required_unless_present = "prefill_dns")]
    pub prefill: Vec<String>,
    /// Decode instance base URL; repeat for each.
    #[arg(long = "decode", required_unless_present = "decode_dns")]
    pub decode: Vec<String>,
    /// A DNS name whose every address is a prefill instance on PORT (NAME:PORT), looked up
    /// again every --health-interval-ms: a Kubernetes headless Service follows its ready pods.
    /// The name need not resolve yet when the proxy starts.
    #[arg(long = "prefill-dns", value_name = "NAME:PORT")]
    pub prefill_dns: Vec<String>,
    /// Like --prefill-dns, for decode instances.
    #[arg(long = "decode-dns", value_name = "NAME:PORT")]
    pub decode_dns: Vec<String>,
    /// Bootstrap port of each prefill instance, in --prefill order (protocol mooncake); with
    /// --prefill-dns one more, for every instance found by name.
    #[arg(long = "bootstrap-port")]
    pub bootstrap_ports: Vec<u16>,
    #[arg(long, value_enum, default_value = "two-step")]
    pub protocol: ProxyProtocol,
    /// Policy for both legs, unless --prefill-policy / --decode-policy say otherwise.
    #[arg(long, value_enum, default_value = "round-robin")]
    pub policy: PolicyName,
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyName>,
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyName>,
    /// Blend the engines' vllm:num_requests_running (scraped from /metrics) into least-loaded.
    #[arg(long)]
    pub scrape_metrics: bool,
    /// Requests per second admitted (token bucket); 0 = unlimited.
    #[arg(long, default_value_t = 0.0)]
    pub rate_limit: f64,
    /// Requests in flight at once; 0 = unlimited.
    #[arg(long, default_value_t = 0)]
    pub max_concurrent: usize,
    /// Requests waiting for a slot beyond --max-concurrent before 429.
    #[arg(long, default_value_t = 0)]
    pub queue_size: usize,
    #[arg(long, default_value_t = 2_000)]
    pub connect_timeout_ms: u64,
    /// Longest wait for the prefill leg to finish.
    #[arg(long, default_value_t = 300)]
    pub prefill_timeout_s: u64,
    /// Longest wait for decode's first byte.
    #[arg(long, default_value_t = 300)]
    pub first_byte_timeout_s: u64,
    /// Longest whole request.
    #[arg(long, default_value_t = 3_600)]
    pub total_timeout_s: u64,
    /// Retries of a leg on connect errors and 502/503, each on another instance.
    #[arg(long, default_value_t = 2)]
    pub retries: u32,
    /// When no instance of a leg is healthy but one is starting or restarting (as the
    /// supervisor reports), how long a request waits for it before the 503; 0 = fail at once.
    #[arg(long, default_value_t = 30)]
    pub restart_wait_s: u64,
    /// Largest accepted request body.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Require `Authorization: Bearer KEY` from clients.
    #[arg(long, env = "PDCTL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Key sent to the engines (and on health probes).
    #[arg(long, env = "PDCTL_ENGINE_API_KEY", hide_env_values = true)]
    pub engine_api_key: Option<String>,
    /// Health of instances from a running supervisor's control socket instead of own probes.
    #[arg(long)]
    pub supervisor_socket: Option<PathBuf>,
    /// Interval of own health probes (standalone mode).
    #[arg(long, default_value_t = 1_000)]
    pub health_interval_ms: u64,
}

impl ProxyArgs {
    /// The argv after `pdctl proxy` that parses back into exactly these arguments
    /// (secrets excepted: keys travel in the environment, never on the command line).
    pub fn to_argv(&self) -> Vec<String> {
        let mut v = vec![
            "--host".to_string(),
            self.host.clone(),
            "--port".into(),
            self.port.to_string(),
        ];
        for p in &self.prefill {
            v.extend(["--prefill".into(), p.clone()]);
        }
        for d in &self.decode {
            v.extend(["--decode".into(), d.clone()]);
        }
        for p in &self.prefill_dns {
            v.extend(["--prefill-dns".into(), p.clone()]);
        }
        for d in &self.decode_dns {
            v.extend(["--decode-dns".into(), d.clone()]);
        }
        for b in &self.bootstrap_ports {
            v.extend(["--bootstrap-port".into(), b.to_string()]);
        }
        v.extend(["--protocol".into(), value_name(self.protocol)]);
        v.extend(["--policy".into(), value_name(self.policy)]);
        if let Some(p) = self.prefill_policy {
            v.extend(["--prefill-policy".into(), value_name(p)]);
        }
        if let Some(p) = self.decode_policy {
            v.extend(["--decode-policy".into(), value_name(p)]);
        }
        if self.scrape_metrics {
            v.push("--scrape-metrics".into());
        }
        let nums: [(&str, String); 11] = [
            ("--rate-limit", self.rate_limit.to_string()),
            ("--max-concurrent", self.max_concurrent.to_string()),
            ("--queue-size", self.queue_size.to_string()),
            ("--connect-timeout-ms", self.connect_timeout_ms.to_string()),
            ("--prefill-timeout-s", self.prefill_timeout_s.to_string()),
            (
                "--first-byte-timeout-s",
                self.first_byte_timeout_s.to_string(),
            ),
            ("--total-timeout-s", self.total_timeout_s.to_string()),
            ("--retries", self.retries.to_string()),
            ("--restart-wait-s", self.restart_wait_s.to_string()),
            ("--max-body-bytes", self.max_body_bytes.to_string()),
            ("--health-interval-ms", self.health_interval_ms.to_string()),
        ];
        for (flag, val) in nums {
            v.extend([flag.to_string(), val]);
        }
        if let Some(s) = &self.supervisor_socket {
            v.extend(["--supervisor-socket".into(), s.display().to_string()]);
        }
        v
    }
}
