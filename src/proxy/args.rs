//! Settings of `pdctl proxy`, shared by the planner (which writes them into the proxy's
//! config file) and the proxy (which reads them from flags or `--config FILE`, see
//! [`crate::child_config`]): one struct, one set of defaults ([`ProxyArgs::default`]).

use crate::child_config::{ChildConfig, FromServiceError};
use crate::spelling::value_name;
use crate::topology::KvLoadFailurePolicy;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Left out of generated config files: the policy the proxy assumes unless told.
fn is_recompute(p: &KvLoadFailurePolicy) -> bool {
    *p == KvLoadFailurePolicy::Recompute
}

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
    /// NixlPushConnector: both legs at once, decode told where the prefill is (learned from
    /// that prefill's first answer), prefill writes the KV into decode's blocks.
    NixlPush,
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

/// Everything `pdctl proxy` takes, as flags or as keys of its config file.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value_t = ProxyArgs::default().host)]
    pub host: String,
    /// Client-facing port.
    #[arg(long, default_value_t = ProxyArgs::default().port)]
    pub port: u16,
    /// Prefill instance base URL (http://HOST:PORT or HOST:PORT); repeat for each.
    #[arg(long = "prefill", required_unless_present_any = ["prefill_dns", "config"])]
    pub prefill: Vec<String>,
    /// Decode instance base URL; repeat for each.
    #[arg(long = "decode", required_unless_present_any = ["decode_dns", "config"])]
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
    #[arg(long, value_enum, default_value_t = ProxyArgs::default().protocol)]
    pub protocol: ProxyProtocol,
    /// The decodes' kv_load_failure_policy: with "fail", a decode's generation error on a
    /// request it was handed KV for is reported as a failed KV load (and counted).
    #[arg(long, value_enum, default_value_t = ProxyArgs::default().kv_load_failure_policy)]
    #[serde(skip_serializing_if = "is_recompute")]
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Policy for both legs, unless --prefill-policy / --decode-policy say otherwise.
    #[arg(long, value_enum, default_value_t = ProxyArgs::default().policy)]
    pub policy: PolicyName,
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyName>,
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyName>,
    /// Blend the engines' vllm:num_requests_running (scraped from /metrics) into least-loaded.
    #[arg(long)]
    pub scrape_metrics: bool,
    /// Requests per second admitted (token bucket); 0 = unlimited.
    #[arg(long, default_value_t = ProxyArgs::default().rate_limit)]
    pub rate_limit: f64,
    /// Requests in flight at once; 0 = unlimited.
    #[arg(long, default_value_t = ProxyArgs::default().max_concurrent)]
    pub max_concurrent: usize,
    /// Requests waiting for a slot beyond --max-concurrent before 429.
    #[arg(long, default_value_t = ProxyArgs::default().queue_size)]
    pub queue_size: usize,
    #[arg(long, default_value_t = ProxyArgs::default().connect_timeout_ms)]
    pub connect_timeout_ms: u64,
    /// Longest wait for the prefill leg to finish.
    #[arg(long, default_value_t = ProxyArgs::default().prefill_timeout_s)]
    pub prefill_timeout_s: u64,
    /// Longest wait for decode's first byte.
    #[arg(long, default_value_t = ProxyArgs::default().first_byte_timeout_s)]
    pub first_byte_timeout_s: u64,
    /// Longest whole request.
    #[arg(long, default_value_t = ProxyArgs::default().total_timeout_s)]
    pub total_timeout_s: u64,
    /// Retries of a leg on connect errors and 502/503, each on another instance.
    #[arg(long, default_value_t = ProxyArgs::default().retries)]
    pub retries: u32,
    /// When no instance of a leg is healthy but one is starting or restarting (as the
    /// supervisor reports), how long a request waits for it before the 503; 0 = fail at once.
    #[arg(long, default_value_t = ProxyArgs::default().restart_wait_s)]
    pub restart_wait_s: u64,
    /// Largest accepted request body.
    #[arg(long, default_value_t = ProxyArgs::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Require `Authorization: Bearer KEY` from clients.
    #[arg(long, env = "PDCTL_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Key sent to the engines (and on health probes).
    #[arg(long, env = "PDCTL_ENGINE_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub engine_api_key: Option<String>,
    /// Health of instances from a running supervisor's control socket instead of own probes.
    #[arg(long)]
    pub supervisor_socket: Option<PathBuf>,
    /// Interval of own health probes (standalone mode).
    #[arg(long, default_value_t = ProxyArgs::default().health_interval_ms)]
    pub health_interval_ms: u64,
}

/// The one place the proxy's defaults are written: clap's `default_value_t`s and the
/// config file's missing keys both read it.
impl Default for ProxyArgs {
    fn default() -> Self {
        ProxyArgs {
            host: "0.0.0.0".into(),
            port: 8000,
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_dns: Vec::new(),
            decode_dns: Vec::new(),
            bootstrap_ports: Vec::new(),
            protocol: ProxyProtocol::TwoStep,
            kv_load_failure_policy: KvLoadFailurePolicy::Recompute,
            policy: PolicyName::RoundRobin,
            prefill_policy: None,
            decode_policy: None,
            scrape_metrics: false,
            rate_limit: 0.0,
            max_concurrent: 0,
            queue_size: 0,
            connect_timeout_ms: 2_000,
            prefill_timeout_s: 300,
            first_byte_timeout_s: 300,
            total_timeout_s: 3_600,
            retries: 2,
            restart_wait_s: 30,
            max_body_bytes: 32 * 1024 * 1024,
            api_key: None,
            engine_api_key: None,
            supervisor_socket: None,
            health_interval_ms: 1_000,
        }
    }
}

impl ChildConfig for ProxyArgs {
    const COMMAND: &'static str = "proxy";
    fn keep_secrets(&mut self, flags: &Self) {
        self.api_key.clone_from(&flags.api_key);
        self.engine_api_key.clone_from(&flags.engine_api_key);
    }
}

impl ProxyArgs {
    /// The settings of a planned proxy service from its argv and generated files (path,
    /// content), without touching disk: what a running proxy re-reads from its spec.
    pub fn from_service<'a>(
        argv: &[String],
        files: impl IntoIterator<Item = (&'a std::path::Path, &'a str)>,
    ) -> Result<ProxyArgs, FromServiceError> {
        crate::child_config::from_service(argv, files)
    }

    /// The argv after `pdctl proxy` that parses back into exactly these arguments
    /// (secrets excepted: keys travel in the environment, never on the command line);
    /// what `export` gives a pod.
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
        if !is_recompute(&self.kv_load_failure_policy) {
            v.extend([
                "--kv-load-failure-policy".into(),
                value_name(self.kv_load_failure_policy),
            ]);
        }
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
