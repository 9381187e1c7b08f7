//! Which instances are usable. Standalone, the proxy probes `GET /health` of each itself
//! (with the engines' API key). Embedded in a cluster, it asks the supervisor instead: an
//! instance is usable only while the service whose URL matches it is `healthy`; when the
//! supervisor cannot be reached, or does not know an instance, own probes take over.
//! The supervisor's report is also the cluster's membership: a prefill or decode service
//! it lists that routing does not know joins (unusable until the report says `healthy`),
//! and an instance that followed a service the report no longer lists leaves routing
//! (`pdctl scale` and `apply` add and remove instances this way, the proxy never restarts).

use super::Proxy;
use super::instances::{Instance, Leg, parse_endpoint};
use super::tuning;
use crate::child_config::proxy::ProxyArgs;
use crate::control::{self, ServiceState, ServiceStatus, StatusReport};
use crate::vocab::Role;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Probe failures in a row that take an instance out of rotation (a refused connection
/// does at once): the cluster's default `health.failed_probes`.
pub const DOWN_AFTER: u32 = crate::vocab::HealthSettings::default_failed_probes();
/// Probe successes in a row that bring it back.
pub const UP_AFTER: u32 = 2;
/// How often the supervisor is asked for service states.
pub const SUPERVISOR_POLL: Duration = Duration::from_millis(500);

/// How long one probe may take: the interval, but never less than the cluster's default
/// `health.probe_timeout_s`, which a saturated vLLM's /health stays under (measured, see
/// docs/supervisor.md): a busy engine's slow answer is no failure.
fn probe_timeout(interval: Duration) -> Duration {
    interval.max(crate::vocab::HealthSettings::default().probe_timeout())
}

/// Why a health probe failed.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("/health answered {0}")]
    Status(u16),
    /// No answer in time, but its port takes TCP connections: busy, not gone.
    #[error("{0}, though its port takes connections (busy)")]
    Slow(super::errors::LegFailure),
    #[error(transparent)]
    Unanswered(#[from] super::errors::LegFailure),
}

impl ProbeError {
    /// A refused connection: the process is gone or not listening, which takes the
    /// instance out of rotation at once.
    fn refused(&self) -> bool {
        matches!(
            self,
            ProbeError::Unanswered(super::errors::LegFailure::Connect(_))
        )
    }
}

/// One `GET /health`; Ok when it answered 200. One that times out is told busy (its port
/// still takes a TCP connection) from unreachable (it does not).
async fn probe(p: &Proxy, inst: &Instance) -> Result<(), ProbeError> {
    let url = format!("{}/health", inst.url);
    let limit = probe_timeout(p.settings().health_interval);
    match p.upstream.get(&url, limit).await {
        Ok((200, _)) => Ok(()),
        Ok((status, _)) => Err(ProbeError::Status(status)),
        Err(f @ super::errors::LegFailure::Timeout { .. }) => {
            let connect = tokio::net::TcpStream::connect((inst.host.as_str(), inst.port));
            match tokio::time::timeout(Duration::from_secs(2), connect).await {
                Ok(Ok(_)) => Err(ProbeError::Slow(f)),
                _ => Err(ProbeError::Unanswered(f)),
            }
        }
        Err(e) => Err(e.into()),
    }
}

fn log_change(inst: &Instance, why: &str) {
    if inst.is_usable() {
        tracing::info!("{} instance {} is usable again ({why})", inst.leg, inst.url);
    } else {
        inst.set_out_reason(why);
        tracing::warn!(
            "{} instance {} taken out of rotation: {why}",
            inst.leg,
            inst.url
        );
    }
}

/// Probes every instance the supervisor does not cover, once, applying the thresholds;
/// with `first` the result is taken as is (no thresholds on the very first look). A
/// usable instance that answered a leg 2xx since the last round counts as probed and
/// passed: under load no probe is sent, so the proxy's CPU per request does not grow with
/// the number of instances it probes.
pub async fn probe_round(p: &Arc<Proxy>, first: bool) {
    let pools = p.pools.snapshot();
    let own: Vec<&Arc<Instance>> = pools
        .all()
        .filter(|i| !i.is_supervised())
        .filter(|i| first || !answered_as_probe(i))
        .collect();
    let results = futures_util::future::join_all(own.iter().map(|i| probe(p, i))).await;
    for (inst, result) in own.into_iter().zip(results) {
        let changed = if first {
            inst.set_usable(result.is_ok())
        } else if result.as_ref().is_err_and(ProbeError::refused) {
            // Nothing listens there: whatever answers next is a new run of the engine.
            inst.run.ended();
            inst.set_usable(false)
        } else {
            inst.record_probe(result.is_ok(), DOWN_AFTER, UP_AFTER)
        };
        note_reach(inst, &result);
        if changed || (first && result.is_err()) {
            let why = match &result {
                Ok(()) => "health probes pass".to_string(),
                Err(e) => format!("health probe failed: {e}"),
            };
            log_change(inst, &why);
        }
    }
}

/// A usable instance whose legs were answered since the last round: recorded as a passed
/// probe (what a probe would have shown) and not probed.
fn answered_as_probe(inst: &Instance) -> bool {
    if !inst.is_usable() {
        inst.take_answered(); // a leg answered before it went out of rotation
        return false;
    }
    if !inst.take_answered() {
        return false;
    }
    inst.record_probe(true, DOWN_AFTER, UP_AFTER);
    true
}

/// Takes an instance as unreachable while it is out of rotation and its probes go
/// unanswered (no connection, or no answer in time and no TCP connection either; an
/// answer of any status, or a port that takes connections, means it is alive, maybe
/// busy), so the legs on it end; reachable again on its first answered probe.
fn note_reach(inst: &Instance, result: &Result<(), ProbeError>) {
    let why = match result {
        Err(ProbeError::Unanswered(f)) if !inst.is_usable() => {
            Some(format!("its health probes go unanswered: {f}"))
        }
        Err(ProbeError::Slow(_)) => None,
        Err(_) if inst.reach.is_unreachable() && !inst.is_usable() => return,
        _ => None,
    };
    if inst.reach.set(why) && inst.reach.is_unreachable() {
        tracing::warn!(
            "{} instance {} is unreachable: its legs in flight end now ({} in flight)",
            inst.leg,
            inst.url,
            inst.in_flight()
        );
    }
}

/// Probes instances just found (by DNS) once and takes the answer as is, so a new pod
/// joins routing as soon as it answers, and one that does not never gets a request.
pub async fn first_look(p: &Arc<Proxy>, new: &[Arc<Instance>]) {
    let results = futures_util::future::join_all(new.iter().map(|i| probe(p, i))).await;
    for (inst, result) in new.iter().zip(results) {
        inst.set_usable(result.is_ok());
        let why = match &result {
            Ok(()) => "health probes pass".to_string(),
            Err(e) => format!("health probe failed: {e}"),
        };
        log_change(inst, &why);
    }
}

/// Applies a supervisor report: services that are new to routing join it, instances
/// whose service left leave it, matched instances follow their service's state, and the
/// rest fall back to own probes. The services are looked up by URL in a map made once
/// per report (not parsed again for each instance: at 64P64D that was 16,000 parses
/// every half second on an idle proxy).
pub fn apply_report(p: &Proxy, report: &StatusReport) {
    p.recorder.rebalance_seen(report.rebalance.as_deref());
    join_new(p, report);
    let mut by_url: HashMap<String, &ServiceStatus> = HashMap::new();
    for s in &report.services {
        if let Some(e) = s.url.as_deref().and_then(|u| parse_endpoint(u).ok()) {
            by_url.entry(e.url).or_insert(s);
        }
    }
    let mut left = Vec::new();
    for inst in p.pools.snapshot().all() {
        match by_url.get(&inst.url) {
            Some(s) => follow_service(inst, s),
            // It followed a service the supervisor no longer runs: removed from the cluster.
            None if inst.is_supervised() && inst.dns_name.is_none() => left.push(inst.clone()),
            None => {
                inst.set_coming_back(false);
            }
        }
    }
    for inst in left {
        inst.set_usable(false);
        inst.set_out_reason("removed from the cluster");
        tracing::info!(
            "{} instance {} left routing: the supervisor no longer runs it ({} request(s) in flight finish)",
            inst.leg,
            inst.url,
            inst.in_flight()
        );
        p.pools.update(inst.leg, |now| {
            now.iter()
                .filter(|i| !Arc::ptr_eq(i, &inst))
                .cloned()
                .collect()
        });
    }
}

/// An instance follows the state its supervisor reports of its service: run, coming
/// back, drained, reachable, usable.
fn follow_service(inst: &Instance, s: &ServiceStatus) {
    if !inst.is_supervised() {
        tracing::info!(
            "{} instance {} follows supervisor service {}",
            inst.leg,
            inst.url,
            s.name
        );
    }
    inst.set_supervised(true);
    if inst.run.follow_report(s.pid, s.restarts) {
        tracing::info!(
            "{} instance {} runs anew (supervisor service {}: pid {}, {} restart(s))",
            inst.leg,
            inst.url,
            s.name,
            s.pid.map_or("-".to_string(), |p| p.to_string()),
            s.restarts
        );
    }
    inst.set_coming_back(matches!(
        s.state,
        ServiceState::Pending
            | ServiceState::Starting
            | ServiceState::Unhealthy
            | ServiceState::Restarting
            | ServiceState::Draining
    ));
    inst.drained.set(s.state == ServiceState::Draining);
    let unreachable = (s.state == ServiceState::Unreachable)
        .then(|| format!("supervisor says service {} is unreachable", s.name));
    if inst.reach.set(unreachable) && inst.reach.is_unreachable() {
        tracing::warn!(
            "{} instance {} is unreachable (its node is cut off): its legs in flight end now ({} in flight)",
            inst.leg,
            inst.url,
            inst.in_flight()
        );
    }
    let healthy = s.state == ServiceState::Healthy;
    if inst.is_usable() != healthy {
        inst.set_usable(healthy);
        log_change(
            inst,
            &format!("supervisor says service {} is {}", s.name, s.state),
        );
    }
}

/// Adds to routing the prefill and decode services of the report that it does not know
/// (started by `pdctl scale` or `apply` after the proxy); they wait, unusable, for the
/// report to call them healthy.
fn join_new(p: &Proxy, report: &StatusReport) {
    let pools = p.pools.snapshot();
    let known: HashSet<&str> = pools.all().map(|i| i.url.as_str()).collect();
    for s in &report.services {
        let leg = match s.role {
            Role::Prefill => Leg::Prefill,
            Role::Decode => Leg::Decode,
            _ => continue,
        };
        let Some(endpoint) = s.url.as_deref().and_then(|u| parse_endpoint(u).ok()) else {
            continue;
        };
        if known.contains(endpoint.url.as_str()) {
            continue;
        }
        let bootstrap = s.ports.get("bootstrap").copied();
        let inst = Arc::new(Instance::new(
            leg,
            p.pools.next_index(leg),
            endpoint,
            bootstrap,
        ));
        inst.set_usable(false);
        inst.set_supervised(true);
        inst.set_out_reason(&format!(
            "supervisor says service {} is {}",
            s.name, s.state
        ));
        tracing::info!(
            "{leg} instance {} joins routing once healthy (supervisor service {})",
            inst.url,
            s.name
        );
        p.pools.update(leg, |now| {
            let mut next = now.to_vec();
            next.push(inst.clone());
            next
        });
    }
}

/// Asks the supervisor once and follows its report (health, membership); Err says why it
/// could not be used. (This proxy's own settings come on a connection of their own:
/// [`tuning::follow`].)
pub async fn poll_supervisor(
    p: &Proxy,
    socket: &std::path::Path,
) -> Result<(), control::client::ControlError> {
    let report = control::client::status(socket, Duration::from_secs(2)).await?;
    apply_report(p, &report);
    Ok(())
}

/// Starts the health tasks; the first look at every instance is done before this returns,
/// so the proxy never serves with made-up health.
pub async fn start(p: Arc<Proxy>, socket: Option<PathBuf>, args: ProxyArgs) {
    if let Some(sock) = &socket {
        tokio::spawn(tuning::follow(
            p.clone(),
            sock.clone(),
            tuning::Own::new(args),
        ));
    }
    if let Some(sock) = &socket
        && let Err(e) = poll_supervisor(&p, sock).await
    {
        tracing::warn!(
            "supervisor socket {} unusable ({e}); probing instances directly",
            sock.display()
        );
    }
    probe_round(&p, true).await;
    let prober = p.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(prober.settings().health_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            probe_round(&prober, false).await;
        }
    });
    if let Some(sock) = socket {
        tokio::spawn(async move {
            let mut reachable = true;
            loop {
                tokio::time::sleep(SUPERVISOR_POLL).await;
                match poll_supervisor(&p, &sock).await {
                    Ok(()) if !reachable => {
                        reachable = true;
                        tracing::info!(
                            "supervisor socket {} answers again; following its health states",
                            sock.display()
                        );
                    }
                    Ok(()) => {}
                    Err(e) => {
                        if reachable {
                            tracing::warn!(
                                "supervisor socket {} unreachable ({e}); probing instances directly",
                                sock.display()
                            );
                        }
                        reachable = false;
                        p.pools
                            .snapshot()
                            .all()
                            .for_each(|i| i.set_supervised(false));
                    }
                }
            }
        });
    }
}
