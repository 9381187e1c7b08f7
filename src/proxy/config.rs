//! Checks `pdctl proxy` arguments before anything starts, turning them into endpoint
//! pools and durations; every mistake is reported with the flag to fix.

use super::instances::{EndpointError, Instance, Leg, Pools, parse_endpoint};
use crate::child_config::proxy::ProxyArgs;
use crate::vocab::{AdmissionError, ProxyProtocol, check_admission};
use std::sync::Arc;
use std::time::Duration;

/// Why the arguments cannot run a proxy.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--{flag} {source}")]
    Endpoint {
        flag: &'static str,
        source: EndpointError,
    },
    #[error("--{flag} {url} is given twice: list each instance once")]
    Duplicate { flag: &'static str, url: String },
    #[error("{url} is listed as both --prefill and --decode: an engine plays one role")]
    BothRoles { url: String },
    #[error(
        "--protocol mooncake needs one --bootstrap-port per --prefill (in the same order){dns}: got {ports} for {prefills} prefill instance(s)",
        dns = if *.by_name { ", plus one for the instances --prefill-dns finds" } else { "" }
    )]
    BootstrapPorts {
        ports: usize,
        prefills: usize,
        by_name: bool,
    },
    #[error(
        "no {leg} instance: give --{leg} URL or --{leg}-dns NAME:PORT (in a config file `{leg} = [...]` or `{leg}_dns = [...]`)"
    )]
    NoInstances { leg: &'static str },
    #[error("--bootstrap-port only applies to --protocol mooncake")]
    BootstrapUnused,
    #[error("{}{}", zero(.key), if .key.starts_with("tcp_") { format!(" (in a topology: network.{}); leave it out for the default", .key) } else { String::new() })]
    Zero { key: &'static str },
    #[error("{}: {}", flag(.0.setting()), .0.message(flag))]
    Admission(AdmissionError),
    #[error(
        "--engine-api-key (or PDCTL_ENGINE_API_KEY) contains characters not allowed in an HTTP header"
    )]
    EngineKey,
    #[error(
        "cannot listen on {addr}: {source} (is another process using port {port}? choose one with --port)"
    )]
    Listen {
        addr: String,
        port: u16,
        source: std::io::Error,
    },
}

/// Durations and switches the request path needs, read once.
#[derive(Debug, Clone)]
pub struct Settings {
    pub connect_timeout: Duration,
    pub prefill_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub total_timeout: Duration,
    pub retries: u32,
    /// How long a request waits for an instance that is coming back (`--restart-wait-s`).
    pub restart_wait: Duration,
    /// Continuations a broken-off stream may take (`--migration-limit`).
    pub migration_limit: u32,
    /// Most tokens one continuation may carry (`--migration-max-tokens`).
    pub migration_max_tokens: u32,
    /// How long a stream stays on a draining decode before it moves (`--drain-grace-s`).
    pub drain_grace: Duration,
    pub max_body_bytes: usize,
    pub api_key: Option<String>,
    pub health_interval: Duration,
    pub scrape_metrics: bool,
}

/// Builds the instance pools, checking every endpoint.
pub fn pools(args: &ProxyArgs) -> Result<Pools, ConfigError> {
    // A supervisor tells the proxy its instances; alone it must be told some (clap
    // enforces this for flags, a config file can leave them out).
    if args.supervisor_socket.is_none() {
        for (leg, urls, names) in [
            ("prefill", &args.prefill, &args.prefill_dns),
            ("decode", &args.decode, &args.decode_dns),
        ] {
            if urls.is_empty() && names.is_empty() {
                return Err(ConfigError::NoInstances { leg });
            }
        }
    }
    let mooncake = args.protocol == ProxyProtocol::Mooncake;
    let by_name = !args.prefill_dns.is_empty();
    if mooncake && args.bootstrap_ports.len() != args.prefill.len() + usize::from(by_name) {
        return Err(ConfigError::BootstrapPorts {
            ports: args.bootstrap_ports.len(),
            prefills: args.prefill.len(),
            by_name,
        });
    }
    if !mooncake && !args.bootstrap_ports.is_empty() {
        return Err(ConfigError::BootstrapUnused);
    }
    let build = |leg: Leg, flag: &'static str, raw: &[String]| {
        let mut out: Vec<Arc<Instance>> = Vec::new();
        for (index, r) in raw.iter().enumerate() {
            let endpoint =
                parse_endpoint(r).map_err(|source| ConfigError::Endpoint { flag, source })?;
            if out.iter().any(|i| i.url == endpoint.url) {
                return Err(ConfigError::Duplicate {
                    flag,
                    url: endpoint.url,
                });
            }
            let boot = args
                .bootstrap_ports
                .get(index)
                .copied()
                .filter(|_| mooncake);
            out.push(Arc::new(Instance::new(leg, index, endpoint, boot)));
        }
        Ok(out)
    };
    let prefill = build(Leg::Prefill, "prefill", &args.prefill)?;
    let decode = build(Leg::Decode, "decode", &args.decode)?;
    if let Some(p) = prefill
        .iter()
        .find(|p| decode.iter().any(|d| d.url == p.url))
    {
        return Err(ConfigError::BothRoles { url: p.url.clone() });
    }
    Ok(Pools { prefill, decode })
}

/// "--KEY must be at least 1", the key spelled as its flag.
fn zero(key: &str) -> String {
    format!("{} must be at least 1", flag(key))
}

/// A setting's key (`max_concurrent`) as its flag (`--max-concurrent`).
fn flag(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

/// Reads the timeouts and limits, refusing values that cannot work.
pub fn settings(args: &ProxyArgs) -> Result<Settings, ConfigError> {
    check_admission(args.rate_limit, args.max_concurrent, args.queue_size)
        .map_err(ConfigError::Admission)?;
    if let Some(key) = args.first_zero() {
        return Err(ConfigError::Zero { key });
    }
    Ok(Settings {
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        prefill_timeout: Duration::from_secs(args.prefill_timeout_s),
        first_byte_timeout: Duration::from_secs(args.first_byte_timeout_s),
        total_timeout: Duration::from_secs(args.total_timeout_s),
        retries: args.retries,
        restart_wait: Duration::from_secs(args.restart_wait_s),
        migration_limit: args.migration_limit,
        migration_max_tokens: args.migration_max_tokens,
        drain_grace: Duration::from_secs(args.drain_grace_s),
        max_body_bytes: args.max_body_bytes,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        health_interval: Duration::from_millis(args.health_interval_ms),
        scrape_metrics: args.scrape_metrics,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: crate::child_config::Configured<ProxyArgs>,
    }

    /// The proxy's flags as its command line parses `extra` (for the proxy's unit tests).
    pub(crate) fn args(extra: &[&str]) -> ProxyArgs {
        let mut v = vec!["proxy"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).unwrap().args.flags
    }

    #[test]
    fn mooncake_needs_a_bootstrap_port_per_prefill() {
        let a = args(&[
            "--prefill",
            "h:1",
            "--prefill",
            "h:2",
            "--decode",
            "h:3",
            "--protocol",
            "mooncake",
            "--bootstrap-port",
            "8998",
        ]);
        let e = pools(&a).unwrap_err().to_string();
        assert!(e.contains("got 1 for 2"), "{e}");
        let a = args(&[
            "--prefill",
            "h:1",
            "--decode",
            "h:3",
            "--protocol",
            "mooncake",
            "--bootstrap-port",
            "8998",
        ]);
        assert_eq!(pools(&a).unwrap().prefill[0].bootstrap_port, Some(8998));
    }

    #[test]
    fn the_same_engine_cannot_be_listed_twice_or_in_both_roles() {
        let a = args(&[
            "--prefill",
            "h:1",
            "--prefill",
            "http://h:1/",
            "--decode",
            "h:3",
        ]);
        assert!(matches!(pools(&a), Err(ConfigError::Duplicate { .. })));
        let a = args(&["--prefill", "h:1", "--decode", "http://h:1"]);
        assert!(matches!(pools(&a), Err(ConfigError::BothRoles { .. })));
    }

    #[test]
    fn a_bad_endpoint_names_its_flag() {
        let a = args(&["--prefill", "h:1", "--decode", "https://h:3"]);
        let e = pools(&a).unwrap_err().to_string();
        assert!(e.starts_with("--decode \"https://h:3\""), "{e}");
    }

    #[test]
    fn limits_that_cannot_work_are_refused() {
        let a = args(&["--prefill", "h:1", "--decode", "h:3", "--queue-size", "5"]);
        assert!(matches!(
            settings(&a),
            Err(ConfigError::Admission(AdmissionError::QueueWithoutLimit(5)))
        ));
        let a = args(&[
            "--prefill",
            "h:1",
            "--decode",
            "h:3",
            "--total-timeout-s",
            "0",
        ]);
        assert!(
            settings(&a)
                .unwrap_err()
                .to_string()
                .contains("--total-timeout-s")
        );
        let a = args(&["--prefill", "h:1", "--decode", "h:3", "--rate-limit=-1"]);
        let e = settings(&a).unwrap_err().to_string();
        assert!(e.starts_with("--rate-limit: -1 must be >= 0"), "{e}");
    }
}
