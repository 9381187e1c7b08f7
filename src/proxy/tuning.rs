//! Settings a running proxy takes without restarting: routing policies, admission limits
//! (`--rate-limit`, `--max-concurrent`, `--queue-size`), timeouts, retries, the wait for
//! a restarting instance, the body limit (and the clients' API key of a proxy given it as a
//! flag; a planned proxy takes its keys from its environment). `pdctl apply` replaces
//! the proxy's spec and typed settings in the supervisor, which sends the new settings to
//! the proxy over the connection the proxy keeps open to follow them ([`follow`]); the
//! proxy swaps them in, so its counters, its limits' queue and the streams in flight
//! carry on. What it cannot change while it listens (its
//! address, protocol, the engines' key, connect timeout, health interval, scraping, DNS
//! names) is listed by [`restart_only`]: `pdctl apply` says those wait for a restart.

use super::Proxy;
use super::config::{self, ConfigError};
use super::instances::Leg;
use super::policy::{self, Policy};
use super::recorder::Recorder;
use crate::child_config::proxy::{ProxyArgs, live_changes, restart_only};
use crate::child_config::{ChildConfig, ChildSettings};
use crate::control;
use crate::vocab::{PolicyName, Role};
use std::path::PathBuf;
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
    pub fn new(a: &ProxyArgs, recorder: &Arc<dyn Recorder>) -> Self {
        let (p, d) = a.leg_policies();
        Policies {
            prefill: (p, policy::build(p, Leg::Prefill, recorder.clone()).into()),
            decode: (d, policy::build(d, Leg::Decode, recorder.clone()).into()),
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
    if old.leg_policies() != new.leg_policies() {
        let (np, nd) = new.leg_policies();
        let current = p.policies();
        let keep = |leg: Leg, name: PolicyName, (had, policy): &(PolicyName, Arc<dyn Policy>)| {
            if *had == name {
                policy.clone()
            } else {
                policy::build(name, leg, p.recorder.clone()).into()
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

/// What this proxy runs with, and the revision of its spec that came from.
#[derive(Debug)]
pub struct Own {
    args: ProxyArgs,
    /// The spec revision those arguments came from; None until the supervisor sent them.
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

/// How long to wait before following the supervisor again after the connection ended.
const REFOLLOW: Duration = Duration::from_secs(1);

/// Follows this proxy's typed settings as its supervisor sends them
/// (`Request::WatchSettings`): the ones it runs with at once (a change may have come
/// between its start and now), then each change `pdctl apply` makes, taken in place. The
/// proxy's own service is the one the supervisor reports with role proxy on this node.
/// Runs until the process ends; a lost connection is made again.
pub async fn follow(p: Arc<Proxy>, socket: PathBuf, mut own: Own) {
    loop {
        let name = match control::client::status(&socket, Duration::from_secs(2)).await {
            Ok(report) => report
                .services
                .into_iter()
                .find(|s| s.role == Role::Proxy && !s.remote)
                .map(|s| s.name),
            Err(_) => None,
        };
        if let Some(name) = name {
            let ended = control::client::watch_settings(&socket, &name, |revision, settings| {
                take(&p, &name, revision, settings, &mut own)
            })
            .await;
            if let Err(e) = ended {
                tracing::debug!("following {name}'s settings: {e}");
            }
        }
        tokio::time::sleep(REFOLLOW).await;
    }
}

/// Takes the settings of `revision` the supervisor sent: the live ones in place, a warning
/// for those that wait for a restart; problems are logged and change nothing.
fn take(p: &Proxy, name: &str, revision: u64, settings: Option<ChildSettings>, own: &mut Own) {
    if own.revision == Some(revision) {
        return;
    }
    own.revision = Some(revision);
    let Some(ChildSettings::Proxy(new)) = settings else {
        tracing::warn!(
            "the supervisor has no proxy settings for {name}: settings left as they are"
        );
        return;
    };
    let mut new = *new;
    // The keys come from this process's environment, never over the socket.
    new.keep_secrets(&own.args);
    let later = restart_only(&own.args, &new);
    match apply(p, &own.args, &new) {
        Ok(changes) => {
            if !changes.is_empty() {
                tracing::info!(
                    "settings changed while serving (revision {revision}): {}",
                    changes.join(", ")
                );
            }
            if !later.is_empty() {
                tracing::warn!(
                    "{} changed: takes effect when the proxy restarts (`pdctl restart {name}`)",
                    later.join(", ")
                );
            }
            own.args = new;
            p.recorder.settings_applied(revision);
        }
        Err(e) => tracing::warn!("settings of revision {revision} left unapplied: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::child_config::proxy::test_args as args;

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
