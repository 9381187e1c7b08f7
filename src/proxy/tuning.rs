//! Settings a running proxy takes without restarting: routing policies, admission limits
//! (`--rate-limit`, `--max-concurrent`, `--queue-size`), timeouts, retries, the wait for
//! a restarting instance, the body limit (and the clients' API key of a proxy given it as a
//! flag; a planned proxy takes its keys from its environment). `pdctl apply` replaces
//! the proxy's spec in the supervisor; the proxy sees the spec's revision go up in the
//! report it polls, asks for the spec and swaps these in, so its counters, its limits'
//! queue and the streams in flight carry on. What it cannot change while it listens (its
//! address, protocol, the engines' key, connect timeout, health interval, scraping, DNS
//! names) is listed by [`restart_only`]: `pdctl apply` says those wait for a restart.

use super::Proxy;
use super::args::ProxyArgs;
use super::config::{self, ConfigError};
use super::instances::Leg;
use super::metrics::Metrics;
use super::policy::{self, Policy};
use crate::control::{self, StatusReport};
use crate::spelling::value_name;
use crate::vocab::{PolicyName, Role, Service};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The routing policy of each leg, with the names they were built from.
#[derive(Debug)]
pub struct Policies {
    prefill: (PolicyName, Arc<dyn Policy>),
    decode: (PolicyName, Arc<dyn Policy>),
}

impl Policies {
    /// The policies the arguments name.
    pub fn new(a: &ProxyArgs, metrics: &Arc<Metrics>) -> Self {
        let (p, d) = names(a);
        Policies {
            prefill: (p, policy::build(p, Leg::Prefill, metrics.clone()).into()),
            decode: (d, policy::build(d, Leg::Decode, metrics.clone()).into()),
        }
    }

    /// The policy of `leg`.
    pub fn of(&self, leg: Leg) -> &Arc<dyn Policy> {
        match leg {
            Leg::Prefill => &self.prefill.1,
            Leg::Decode => &self.decode.1,
        }
    }
}

fn names(a: &ProxyArgs) -> (PolicyName, PolicyName) {
    (
        a.prefill_policy.unwrap_or(a.policy),
        a.decode_policy.unwrap_or(a.policy),
    )
}

/// Why a spec gives no proxy arguments: which service, and what the reader said (not a
/// `pdctl proxy` command, flags that do not parse, a config file at fault).
#[derive(Debug, thiserror::Error)]
#[error("{service}'s settings cannot be read: {source}")]
pub struct SpecError {
    service: String,
    source: Box<crate::child_config::FromServiceError>,
}

/// The proxy arguments of a service's spec (`<program> proxy [--config FILE] FLAGS...`,
/// the file among the spec's generated files), read without touching the disk. Flags with
/// an environment fallback read this process's environment, as they did when the proxy
/// started.
pub fn args_of(service: &Service) -> Result<ProxyArgs, SpecError> {
    let files = service
        .files
        .iter()
        .map(|f| (f.path.as_path(), f.content.as_str()));
    ProxyArgs::from_service(&service.argv, files).map_err(|source| SpecError {
        service: service.name.clone(),
        source: Box::new(source),
    })
}

/// Flags a running proxy takes in place (besides the policies, compared as resolved).
const LIVE: [&str; 9] = [
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
const RESTART: [&str; 9] = [
    "--host",
    "--port",
    "--protocol",
    "--prefill-dns",
    "--decode-dns",
    "--connect-timeout-ms",
    "--health-interval-ms",
    "--scrape-metrics",
    "--supervisor-socket",
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
    let ((op, od), (np, nd)) = (names(old), names(new));
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

/// Takes `new`'s live settings into the running proxy, whose current arguments are
/// `old`; returns the changes made. Checked first: a value the proxy would refuse at
/// start changes nothing.
pub fn apply(p: &Proxy, old: &ProxyArgs, new: &ProxyArgs) -> Result<Vec<String>, ConfigError> {
    let checked = config::settings(new)?;
    let changes = live_changes(old, new);
    if changes.is_empty() {
        return Ok(changes);
    }
    let now = p.settings();
    // What cannot change while the proxy runs stays as it started.
    let settings = config::Settings {
        connect_timeout: now.connect_timeout,
        health_interval: now.health_interval,
        scrape_metrics: now.scrape_metrics,
        ..checked
    };
    p.set_settings(settings);
    if names(old) != names(new) {
        let (np, nd) = names(new);
        let current = p.policies();
        let keep = |leg: Leg, name: PolicyName, (had, policy): &(PolicyName, Arc<dyn Policy>)| {
            if *had == name {
                policy.clone()
            } else {
                policy::build(name, leg, p.metrics.clone()).into()
            }
        };
        p.set_policies(Policies {
            prefill: (np, keep(Leg::Prefill, np, &current.prefill)),
            decode: (nd, keep(Leg::Decode, nd, &current.decode)),
        });
    }
    p.limits
        .set(new.rate_limit, new.max_concurrent, new.queue_size);
    Ok(changes)
}

/// What this proxy runs with, as far as the supervisor's spec of it goes.
#[derive(Debug)]
pub struct Own {
    args: ProxyArgs,
    /// The spec revision those arguments came from; None until the first report.
    revision: Option<u64>,
}

impl Own {
    /// A proxy started with `args`.
    pub fn new(args: ProxyArgs) -> Self {
        Own {
            args,
            revision: None,
        }
    }
}

/// Follows this proxy's spec in a supervisor report: when its revision is not the one the
/// proxy runs with (and at the first report, in case a change came between its start and
/// then), asks for the spec and takes its live settings. Problems are logged; a spec that
/// cannot be read or used is not asked for again until its revision moves.
pub async fn follow(p: &Proxy, socket: &Path, report: &StatusReport, own: &mut Own) {
    let Some(me) = report
        .services
        .iter()
        .find(|s| s.role == Role::Proxy && !s.remote)
    else {
        return;
    };
    if own.revision == Some(me.revision) {
        return;
    }
    let spec = match control::client::spec(socket, &me.name, Duration::from_secs(2)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot read {}'s spec from the supervisor: {e}", me.name);
            return;
        }
    };
    own.revision = Some(me.revision);
    let new = match args_of(&spec) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!("settings left as they are: {e}");
            return;
        }
    };
    let later = restart_only(&own.args, &new);
    match apply(p, &own.args, &new) {
        Ok(changes) => {
            if !changes.is_empty() {
                tracing::info!(
                    "settings changed while serving (revision {}): {}",
                    me.revision,
                    changes.join(", ")
                );
            }
            if !later.is_empty() {
                tracing::warn!(
                    "{} changed: takes effect when the proxy restarts (`pdctl restart {}`)",
                    later.join(", "),
                    me.name
                );
            }
            own.args = new;
            p.metrics.settings_applied(me.revision);
        }
        Err(e) => tracing::warn!("settings of revision {} left unapplied: {e}", me.revision),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> ProxyArgs {
        let mut v = vec![
            "pdctl",
            "proxy",
            "--prefill",
            "127.0.0.1:1",
            "--decode",
            "127.0.0.1:2",
        ];
        v.extend_from_slice(extra);
        args_of(&service(&v)).unwrap()
    }

    fn service(argv: &[&str]) -> Service {
        Service::new("proxy", Role::Proxy, "local", argv.iter().copied())
    }

    #[test]
    fn a_spec_gives_the_arguments_after_the_subcommand() {
        let a = args_of(&service(&[
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
        let e = args_of(&service(&["/bin/pdctl", "sim"])).unwrap_err();
        assert!(e.to_string().contains("is not `pdctl proxy"), "{e}");
        let e = args_of(&service(&["pdctl", "proxy", "--max-concurrent", "many"])).unwrap_err();
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
        assert_eq!(args_of(&s).unwrap(), wanted);
        s.files.clear();
        let e = args_of(&s).unwrap_err().to_string();
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

    #[tokio::test]
    async fn applying_swaps_policies_and_limits_and_keeps_what_needs_a_restart() {
        let old = args(&["--policy", "round-robin", "--total-timeout-s", "30"]);
        let p = Proxy::new(&old).unwrap();
        let new = args(&[
            "--decode-policy",
            "least-loaded",
            "--total-timeout-s",
            "5",
            "--connect-timeout-ms",
            "7",
            "--max-concurrent",
            "1",
        ]);
        let prefill_before = p.policy(Leg::Prefill);
        let changes = apply(&p, &old, &new).unwrap();
        assert!(
            changes.iter().any(|c| c == "--total-timeout-s 30 -> 5"),
            "{changes:?}"
        );
        assert_eq!(p.settings().total_timeout.as_secs(), 5);
        assert_ne!(
            p.settings().connect_timeout.as_millis(),
            7,
            "connect timeout needs a restart"
        );
        assert_eq!(p.policy(Leg::Decode).name(), "least-loaded");
        assert!(
            Arc::ptr_eq(&prefill_before, &p.policy(Leg::Prefill)),
            "an unchanged policy keeps its state"
        );
        let first = p.limits.admit().await.unwrap();
        assert_eq!(p.limits.admit().await.unwrap_err().status(), 429);
        drop(first);
        // A value the proxy refuses at start changes nothing.
        let bad = args(&["--total-timeout-s", "0"]);
        assert!(apply(&p, &new, &bad).is_err());
        assert_eq!(p.settings().total_timeout.as_secs(), 5);
    }
}
