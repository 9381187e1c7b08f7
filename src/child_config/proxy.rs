//! Settings of `pdctl proxy`, shared by the planner (which writes them into the proxy's
//! config file and compares a running proxy's with a new plan's) and the proxy (which
//! reads them from flags or `--config FILE`): one struct, one set of defaults
//! ([`ProxyArgs::default`]), and the one list of which settings a running proxy takes in
//! place ([`live_changes`]) and which wait for its restart ([`restart_only`]).

use super::ChildConfig;
use crate::spelling::value_name;
use crate::topology::KvLoadFailurePolicy;
use crate::vocab::{PolicyName, ProxyProtocol, TcpLiveness, WARMED_WITHIN_S};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Left out of generated config files: the policy the proxy assumes unless told (and,
/// below, the TCP settings at their defaults).
fn is_recompute(p: &KvLoadFailurePolicy) -> bool {
    *p == KvLoadFailurePolicy::Recompute
}

fn is_default_migration_limit(v: &u32) -> bool {
    *v == ProxyArgs::default().migration_limit
}
fn is_default_drain_grace_s(v: &u64) -> bool {
    *v == ProxyArgs::default().drain_grace_s
}
fn is_default_migration_max_tokens(v: &u32) -> bool {
    *v == ProxyArgs::default().migration_max_tokens
}
fn is_default_warmed_within_s(v: &u64) -> bool {
    *v == WARMED_WITHIN_S
}
fn is_default_tcp_keepalive_idle_s(v: &u32) -> bool {
    *v == TcpLiveness::default().tcp_keepalive_idle_s
}
fn is_default_tcp_keepalive_interval_s(v: &u32) -> bool {
    *v == TcpLiveness::default().tcp_keepalive_interval_s
}
fn is_default_tcp_keepalive_count(v: &u32) -> bool {
    *v == TcpLiveness::default().tcp_keepalive_count
}
fn is_default_tcp_user_timeout_s(v: &u32) -> bool {
    *v == TcpLiveness::default().tcp_user_timeout_s
}
fn is_default_header_read_timeout_s(v: &u64) -> bool {
    *v == ProxyArgs::default().header_read_timeout_s
}
fn is_default_max_client_connections(v: &usize) -> bool {
    *v == ProxyArgs::default().max_client_connections
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
    /// Prompt tokens a good KV handoff may leave decode to compute (what the connector
    /// leaves: a KV block, an LMCache chunk); decode computing more of a prompt is a silent
    /// recompute. 0: one KV block, as decode's /metrics states it (else 16).
    #[arg(long, default_value_t = ProxyArgs::default().handoff_leaves_tokens)]
    pub handoff_leaves_tokens: u32,
    /// The decodes run with --enable-prompt-tokens-details: an answer whose usage has no
    /// prompt_tokens_details cached nothing (vLLM leaves the field out at 0).
    #[arg(long)]
    pub decode_prompt_tokens_details: bool,
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
    /// Route every prefill/decode pair at once, without warming its KV path first
    /// (docs/proxy.md, "Ready means the KV path works"): for engines that are not vLLM,
    /// such as test fakes; real NIXL engines make their handshake on the first request.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub no_warmup: bool,
    /// How long, at most, `/health?warmed` (what the supervisor waits on before `up` ends)
    /// waits for the pairs usable at start to have their KV path warmed, failed warm-ups
    /// retried meanwhile; then it says ready all the same and requests wait for a warmed
    /// pair. Read at the proxy's start only.
    #[arg(long, default_value_t = ProxyArgs::default().warmed_within_s)]
    #[serde(skip_serializing_if = "is_default_warmed_within_s")]
    pub warmed_within_s: u64,
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
    /// How many times a stream whose decode broke off mid-answer is continued on another
    /// decode (0: never, the stream ends with an error event).
    #[arg(long, default_value_t = ProxyArgs::default().migration_limit)]
    #[serde(skip_serializing_if = "is_default_migration_limit")]
    pub migration_limit: u32,
    /// Most answer tokens a continuation may carry (its prompt grows by as many).
    #[arg(long, default_value_t = ProxyArgs::default().migration_max_tokens)]
    #[serde(skip_serializing_if = "is_default_migration_max_tokens")]
    pub migration_max_tokens: u32,
    /// How long a stream may go on on a draining decode (`scale` down, `restart --drain`,
    /// a rebalance move) before it is continued on another decode.
    #[arg(long, default_value_t = ProxyArgs::default().drain_grace_s)]
    #[serde(skip_serializing_if = "is_default_drain_grace_s")]
    pub drain_grace_s: u64,
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
    /// Seconds a leg's connection to an engine may stay silent before TCP keepalive probes it.
    #[arg(long, default_value_t = ProxyArgs::default().tcp_keepalive_idle_s)]
    #[serde(skip_serializing_if = "is_default_tcp_keepalive_idle_s")]
    pub tcp_keepalive_idle_s: u32,
    /// Seconds between keepalive probes of a silent connection.
    #[arg(long, default_value_t = ProxyArgs::default().tcp_keepalive_interval_s)]
    #[serde(skip_serializing_if = "is_default_tcp_keepalive_interval_s")]
    pub tcp_keepalive_interval_s: u32,
    /// Unanswered keepalive probes that end the connection (and its leg).
    #[arg(long, default_value_t = ProxyArgs::default().tcp_keepalive_count)]
    #[serde(skip_serializing_if = "is_default_tcp_keepalive_count")]
    pub tcp_keepalive_count: u32,
    /// Seconds a request sent to an engine may stay unacknowledged before the connection
    /// ends (TCP_USER_TIMEOUT).
    #[arg(long, default_value_t = ProxyArgs::default().tcp_user_timeout_s)]
    #[serde(skip_serializing_if = "is_default_tcp_user_timeout_s")]
    pub tcp_user_timeout_s: u32,
    /// Seconds a client connection may take to send a request's headers, and may stay
    /// idle between requests (keep-alive): past it the connection is closed, so a client
    /// that sends half a request holds nothing for long.
    #[arg(long, default_value_t = ProxyArgs::default().header_read_timeout_s)]
    #[serde(skip_serializing_if = "is_default_header_read_timeout_s")]
    pub header_read_timeout_s: u64,
    /// Client connections open at once; one more is answered 503 and closed.
    #[arg(long, default_value_t = ProxyArgs::default().max_client_connections)]
    #[serde(skip_serializing_if = "is_default_max_client_connections")]
    pub max_client_connections: usize,
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
            handoff_leaves_tokens: 0,
            decode_prompt_tokens_details: false,
            policy: PolicyName::RoundRobin,
            prefill_policy: None,
            decode_policy: None,
            scrape_metrics: false,
            no_warmup: false,
            warmed_within_s: WARMED_WITHIN_S,
            rate_limit: 0.0,
            max_concurrent: 0,
            queue_size: 0,
            connect_timeout_ms: 2_000,
            prefill_timeout_s: 300,
            first_byte_timeout_s: 300,
            total_timeout_s: 3_600,
            retries: 2,
            restart_wait_s: 30,
            migration_limit: 3,
            migration_max_tokens: 32_768,
            drain_grace_s: 10,
            max_body_bytes: 32 * 1024 * 1024,
            api_key: None,
            engine_api_key: None,
            supervisor_socket: None,
            health_interval_ms: 1_000,
            tcp_keepalive_idle_s: TcpLiveness::default().tcp_keepalive_idle_s,
            tcp_keepalive_interval_s: TcpLiveness::default().tcp_keepalive_interval_s,
            tcp_keepalive_count: TcpLiveness::default().tcp_keepalive_count,
            tcp_user_timeout_s: TcpLiveness::default().tcp_user_timeout_s,
            header_read_timeout_s: 10,
            max_client_connections: 4096,
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
    /// The TCP keepalive and user timeout of the legs' connections.
    pub fn tcp(&self) -> TcpLiveness {
        TcpLiveness {
            tcp_keepalive_idle_s: self.tcp_keepalive_idle_s,
            tcp_keepalive_interval_s: self.tcp_keepalive_interval_s,
            tcp_keepalive_count: self.tcp_keepalive_count,
            tcp_user_timeout_s: self.tcp_user_timeout_s,
            ..TcpLiveness::default()
        }
    }

    /// Takes the TCP keepalive and user timeout of the legs' connections from `tcp`.
    pub fn set_tcp(&mut self, tcp: TcpLiveness) {
        self.tcp_keepalive_idle_s = tcp.tcp_keepalive_idle_s;
        self.tcp_keepalive_interval_s = tcp.tcp_keepalive_interval_s;
        self.tcp_keepalive_count = tcp.tcp_keepalive_count;
        self.tcp_user_timeout_s = tcp.tcp_user_timeout_s;
    }

    /// The first timeout or limit that is 0, by its key (`total_timeout_s`, the topology's
    /// `[proxy]` key and the flag's id), where 0 cannot work (a timeout that fires at once,
    /// no body at all); the TCP settings by [`TcpLiveness::first_zero`]. The one rule for
    /// them: the planner applies it to the settings it plans, the proxy at its start and to
    /// every change it is sent.
    pub fn first_zero(&self) -> Option<&'static str> {
        [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("prefill_timeout_s", self.prefill_timeout_s),
            ("first_byte_timeout_s", self.first_byte_timeout_s),
            ("total_timeout_s", self.total_timeout_s),
            ("health_interval_ms", self.health_interval_ms),
            ("max_body_bytes", self.max_body_bytes as u64),
            ("header_read_timeout_s", self.header_read_timeout_s),
            ("max_client_connections", self.max_client_connections as u64),
        ]
        .into_iter()
        .find(|(_, v)| *v == 0)
        .map(|(key, _)| key)
        .or_else(|| self.tcp().first_zero())
    }

    /// The policy of each leg (prefill, decode): its own, else `--policy`.
    pub fn leg_policies(&self) -> (PolicyName, PolicyName) {
        (
            self.prefill_policy.unwrap_or(self.policy),
            self.decode_policy.unwrap_or(self.policy),
        )
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
        self.engines_argv(&mut v);
        self.protocol_argv(&mut v);
        self.limits_argv(&mut v);
        v
    }

    /// The engines' flags: the instances, the names that list them, bootstrap ports.
    fn engines_argv(&self, v: &mut Vec<String>) {
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
    }

    /// How requests go: the protocol, the handoff, the policies, the figures, warm-up,
    /// migration and drain.
    fn protocol_argv(&self, v: &mut Vec<String>) {
        v.extend(["--protocol".into(), value_name(self.protocol)]);
        if !is_recompute(&self.kv_load_failure_policy) {
            v.extend([
                "--kv-load-failure-policy".into(),
                value_name(self.kv_load_failure_policy),
            ]);
        }
        v.extend([
            "--handoff-leaves-tokens".into(),
            self.handoff_leaves_tokens.to_string(),
        ]);
        if self.decode_prompt_tokens_details {
            v.push("--decode-prompt-tokens-details".into());
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
        if self.no_warmup {
            v.push("--no-warmup".into());
        }
        if !is_default_migration_limit(&self.migration_limit) {
            v.extend(["--migration-limit".into(), self.migration_limit.to_string()]);
        }
        if !is_default_drain_grace_s(&self.drain_grace_s) {
            v.extend(["--drain-grace-s".into(), self.drain_grace_s.to_string()]);
        }
        if !is_default_migration_max_tokens(&self.migration_max_tokens) {
            let n = self.migration_max_tokens.to_string();
            v.extend(["--migration-max-tokens".into(), n]);
        }
        if !is_default_warmed_within_s(&self.warmed_within_s) {
            v.extend(["--warmed-within-s".into(), self.warmed_within_s.to_string()]);
        }
    }

    /// The limits and timeouts (the TCP ones and the last few only where they differ
    /// from the defaults), and the supervisor's socket.
    fn limits_argv(&self, v: &mut Vec<String>) {
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
        // Written only where they differ from the defaults.
        let tcp = self.tcp();
        let usual = TcpLiveness::default().named();
        for ((name, val), (_, default)) in tcp.named().into_iter().zip(usual) {
            if val != default {
                v.extend([format!("--{}", name.replace('_', "-")), val.to_string()]);
            }
        }
        if let Some(s) = &self.supervisor_socket {
            v.extend(["--supervisor-socket".into(), s.display().to_string()]);
        }
        if !is_default_header_read_timeout_s(&self.header_read_timeout_s) {
            let t = self.header_read_timeout_s.to_string();
            v.extend(["--header-read-timeout-s".into(), t]);
        }
        if !is_default_max_client_connections(&self.max_client_connections) {
            let n = self.max_client_connections.to_string();
            v.extend(["--max-client-connections".into(), n]);
        }
    }
}

/// Flags a running proxy takes in place (besides the policies, compared as resolved).
const LIVE: [&str; 12] = [
    "--drain-grace-s",
    "--migration-limit",
    "--migration-max-tokens",
    "--rate-limit",
    "--max-concurrent",
    "--queue-size",
    "--prefill-timeout-s",
    "--first-byte-timeout-s",
    "--total-timeout-s",
    "--retries",
    "--restart-wait-s",
    "--max-body-bytes",
];

/// Flags a running proxy takes only when it restarts. The instance lists are in neither
/// list: the proxy follows the supervisor's services.
const RESTART: [&str; 17] = [
    "--host",
    "--port",
    "--protocol",
    "--handoff-leaves-tokens",
    "--decode-prompt-tokens-details",
    "--prefill-dns",
    "--decode-dns",
    "--connect-timeout-ms",
    "--health-interval-ms",
    "--scrape-metrics",
    "--supervisor-socket",
    "--tcp-keepalive-idle-s",
    "--tcp-keepalive-interval-s",
    "--tcp-keepalive-count",
    "--tcp-user-timeout-s",
    "--header-read-timeout-s",
    "--max-client-connections",
];

/// Every value `flag` has in `argv`, joined (flags may repeat; a switch reads `on`).
fn values(argv: &[String], flag: &str) -> String {
    let found: Vec<&str> = argv
        .iter()
        .enumerate()
        .filter(|(_, a)| *a == flag)
        .map(|(i, _)| match argv.get(i + 1) {
            Some(v) if !v.starts_with("--") => v.as_str(),
            _ => "on",
        })
        .collect();
    found.join(",")
}

/// The `flags` whose values differ between `old` and `new`, as (flag, old, new).
fn differing<'a>(
    old: &ProxyArgs,
    new: &ProxyArgs,
    flags: &[&'a str],
) -> Vec<(&'a str, String, String)> {
    let (a, b) = (old.to_argv(), new.to_argv());
    flags
        .iter()
        .map(|f| (*f, values(&a, f), values(&b, f)))
        .filter(|(_, x, y)| x != y)
        .collect()
}

/// The flags that differ between `old` and `new` which a running proxy cannot take (it
/// needs a restart for them).
pub fn restart_only(old: &ProxyArgs, new: &ProxyArgs) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = differing(old, new, &RESTART)
        .into_iter()
        .map(|(f, _, _)| f)
        .collect();
    if old.engine_api_key != new.engine_api_key {
        out.push("--engine-api-key");
    }
    out
}

/// The live settings that differ, as `--flag old -> new` phrases (for the log and the
/// plan's difference list).
pub fn live_changes(old: &ProxyArgs, new: &ProxyArgs) -> Vec<String> {
    let ((op, od), (np, nd)) = (old.leg_policies(), new.leg_policies());
    let policies = [("--prefill-policy", op, np), ("--decode-policy", od, nd)]
        .into_iter()
        .filter(|(_, a, b)| a != b)
        .map(|(f, a, b)| (f, value_name(a), value_name(b)));
    let mut out: Vec<String> = policies
        .chain(differing(old, new, &LIVE))
        .map(|(f, a, b)| format!("{f} {a} -> {b}"))
        .collect();
    if old.api_key != new.api_key {
        out.push("--api-key changed".into());
    }
    out
}

/// For tests of the proxy's settings: `pdctl proxy --prefill 127.0.0.1:1 --decode
/// 127.0.0.1:2 EXTRA...` as the proxy parses it.
#[cfg(test)]
pub fn test_args(extra: &[&str]) -> ProxyArgs {
    let argv: Vec<String> = [
        "pdctl",
        "proxy",
        "--prefill",
        "127.0.0.1:1",
        "--decode",
        "127.0.0.1:2",
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .map(String::from)
    .collect();
    super::from_service(&argv, []).expect("test flags parse")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Role, Service};

    fn args(extra: &[&str]) -> ProxyArgs {
        test_args(extra)
    }

    fn service(argv: &[&str]) -> Service {
        Service::new("proxy", Role::Proxy, "local", argv.iter().copied())
    }

    /// What the proxy reads at its start from a planned service's command and files.
    fn read(s: &Service) -> Result<ProxyArgs, crate::child_config::FromServiceError> {
        let files = s
            .files
            .iter()
            .map(|f| (f.path.as_path(), f.content.as_str()));
        crate::child_config::from_service(&s.argv, files)
    }

    #[test]
    fn a_spec_gives_the_arguments_after_the_subcommand() {
        let a = read(&service(&[
            "/bin/pdctl",
            "proxy",
            "--prefill",
            "h:1",
            "--decode",
            "h:2",
            "--max-concurrent",
            "8",
        ]))
        .unwrap();
        assert_eq!(
            (a.max_concurrent, a.prefill.clone()),
            (8, vec!["h:1".to_string()])
        );
        let e = read(&service(&["/bin/pdctl", "sim"])).unwrap_err();
        assert!(e.to_string().contains("is not `pdctl proxy"), "{e}");
        let e = read(&service(&["pdctl", "proxy", "--max-concurrent", "many"])).unwrap_err();
        assert!(e.to_string().contains("--max-concurrent"), "{e}");
    }

    #[test]
    fn a_spec_with_a_config_file_is_read_from_its_generated_files() {
        let mut s = service(&["pdctl", "proxy", "--config", "/state/files/proxy.toml"]);
        let wanted = args(&["--max-concurrent", "3", "--policy", "least-loaded"]);
        s.files.push(crate::vocab::GeneratedFile {
            path: "/state/files/proxy.toml".into(),
            content: toml::to_string(&wanted).unwrap(),
        });
        assert_eq!(read(&s).unwrap(), wanted);
        s.files.clear();
        let e = read(&s).unwrap_err().to_string();
        assert!(e.contains("proxy.toml"), "{e}");
    }

    #[test]
    fn what_needs_a_restart_is_told_apart_from_what_changes_live() {
        let old = args(&[]);
        let new = args(&[
            "--port",
            "9",
            "--max-concurrent",
            "4",
            "--queue-size",
            "2",
            "--policy",
            "least-loaded",
            "--retries",
            "0",
        ]);
        assert_eq!(restart_only(&old, &new), vec!["--port"]);
        let live = live_changes(&old, &new);
        assert!(
            live.iter().any(|c| c == "--max-concurrent 0 -> 4"),
            "{live:?}"
        );
        assert!(
            live.iter().any(|c| c.starts_with("--decode-policy ")),
            "{live:?}"
        );
        assert!(live.iter().any(|c| c.starts_with("--retries ")), "{live:?}");
        assert!(live_changes(&old, &old).is_empty());
        // Only the instance lists differ: nothing to change in the proxy.
        let more = args(&["--decode", "127.0.0.1:3"]);
        assert!(restart_only(&old, &more).is_empty() && live_changes(&old, &more).is_empty());
    }
}
