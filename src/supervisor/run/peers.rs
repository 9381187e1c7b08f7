//! The other nodes' supervisors, asked for their status over the TCP control channel
//! (mutually authenticated TLS) once a second, so `status` here shows their services as they report them (state, pid,
//! restarts, last error) and says `unreachable` (since when) while a node cannot be reached.
//!
//! A node is cut off only when its link is gone: its supervisor has not answered AND no
//! port of that node (the control channel, the services it reported) has taken a TCP
//! connection, for `health.cut_off_after_s`. A busy machine whose supervisor or engines
//! answer slowly still completes TCP handshakes in its kernel, so it is never cut off
//! (and the legs in flight on it are never ended) for being busy.
//!
//! The head's answer also says which certificate it accepts of each node: a node takes
//! that as the only one it accepts of each other node, and renews its own when the head
//! marks it (at the head's `up`) or when it nears its expiry.

use crate::control::client::{Endpoint, StatusConn, logs_at, renew};
use crate::control::operation::now_ms;
use crate::control::{Response, ServiceState, StatusReport};
use crate::supervisor::run::table::Table;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often each peer is asked, and how long an answer may take.
const POLL: Duration = Duration::from_secs(1);
const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// How long a TCP connect to one of a silent peer's ports may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(2);
/// How long a renewal may take, and how long a failed one waits before it is tried again.
const RENEW_WITHIN: Duration = Duration::from_secs(10);
const RENEW_AGAIN_AFTER: Duration = Duration::from_secs(60);

/// A moment read on both clocks: the monotonic one to measure how long since, and Unix
/// time (ms) to report it.
#[derive(Debug, Clone, Copy)]
struct Moment {
    at: Instant,
    unix_ms: u64,
}

impl Moment {
    fn now() -> Moment {
        Moment {
            at: Instant::now(),
            unix_ms: now_ms(),
        }
    }
}

/// What this supervisor last heard from one other node's supervisor.
#[derive(Debug, Default)]
struct LastHeard {
    report: Option<StatusReport>,
    /// Since when it has not answered.
    failing_since: Option<Moment>,
    /// Since when, besides, none of its ports took a TCP connection: its link is gone.
    link_down_since: Option<Moment>,
    error: Option<String>,
}

#[derive(Debug)]
struct Peer {
    node: String,
    /// The node's address, as the topology gives it.
    address: String,
    endpoint: Endpoint,
    heard: Mutex<LastHeard>,
}

/// Every other node of the cluster, polled in the background.
#[derive(Debug)]
pub struct Peers {
    peers: Vec<Arc<Peer>>,
    /// How long a node's channel and ports must be silent before it is cut off.
    cut_off_after: Duration,
}

impl Peers {
    /// Starts polling `nodes` (name, endpoint); stops when the returned value is dropped
    /// by everyone and the runtime ends. A node is cut off once its supervisor and its
    /// ports have been silent for `cut_off_after`. What each reports of its own services
    /// goes into `table` (see [`Table::ready_for_dependents`]).
    pub fn start(
        nodes: Vec<(String, String, Endpoint)>,
        cut_off_after: Duration,
        table: Arc<Table>,
    ) -> Arc<Peers> {
        let now = Moment::now();
        let peers: Vec<Arc<Peer>> = nodes
            .into_iter()
            .map(|(node, address, endpoint)| {
                Arc::new(Peer {
                    node,
                    address,
                    endpoint,
                    heard: Mutex::new(LastHeard {
                        failing_since: Some(now),
                        link_down_since: Some(now),
                        error: Some("not asked yet".into()),
                        ..LastHeard::default()
                    }),
                })
            })
            .collect();
        for p in &peers {
            tokio::spawn(poll(Arc::downgrade(p), table.clone()));
        }
        Arc::new(Peers {
            peers,
            cut_off_after,
        })
    }

    /// The last `lines` lines of service `name`'s log, asked of node `node`'s supervisor:
    /// a `Lines` answer, or an `Error` saying why not.
    pub async fn logs(&self, node: &str, name: &str, lines: usize) -> Response {
        let Some(peer) = self.peers.iter().find(|p| p.node == node) else {
            return Response::Error {
                message: format!("node {node} is not one this supervisor reaches"),
            };
        };
        match logs_at(&peer.endpoint, name, lines, Duration::from_secs(10)).await {
            Ok(lines) => Response::Lines {
                service: name.to_string(),
                lines,
            },
            Err(e) => Response::Error {
                message: format!("the logs of {name} on node {node}: {e}"),
            },
        }
    }

    /// The head's rebalancer as its supervisor last reported it, while it answers: a
    /// node other than the head runs none, and its proxy exports the head's series.
    pub fn rebalance(&self) -> Option<crate::vocab::RebalanceReport> {
        self.peers.iter().find_map(|p| {
            let heard = p.heard.lock().unwrap_or_else(|e| e.into_inner());
            if heard.failing_since.is_some() {
                return None;
            }
            heard.report.as_ref()?.rebalance.as_deref().cloned()
        })
    }

    /// Fills the rows of other nodes' services in `report` with what their supervisors
    /// say, or marks them unreachable.
    pub fn merge_into(&self, report: &mut StatusReport) {
        for peer in &self.peers {
            let heard = peer.heard.lock().unwrap_or_else(|e| e.into_inner());
            let cut_off = heard
                .link_down_since
                .filter(|since| since.at.elapsed() >= self.cut_off_after);
            for row in report
                .services
                .iter_mut()
                .filter(|s| s.remote && s.node == peer.node)
            {
                if let Some(Moment {
                    unix_ms: since_ms, ..
                }) = cut_off
                {
                    let why = heard.error.clone().unwrap_or_default();
                    row.state = ServiceState::Unreachable;
                    row.unreachable_since_ms = Some(since_ms);
                    row.pid = None;
                    row.uptime_s = None;
                    row.last_exit = Some(format!(
                        "node {} is cut off: its supervisor has not answered and none of its ports has taken a connection for {} s: {why}",
                        peer.node,
                        now_ms().saturating_sub(since_ms) / 1000
                    ));
                    continue;
                }
                let Some(reported) = heard
                    .report
                    .as_ref()
                    .and_then(|r| r.services.iter().find(|s| s.name == row.name && !s.remote))
                else {
                    continue;
                };
                // Healthy there: whether this node reaches it is this node's probe's word,
                // unless it listens where only its own node reaches it.
                let unprobed = row.url.as_deref().and_then(url_host).is_some_and(|h| {
                    crate::supervisor::run::probe::only_on_its_node(h, Some(&peer.address))
                });
                if reported.state != ServiceState::Healthy || unprobed {
                    row.state = reported.state;
                }
                row.pid = reported.pid;
                row.restarts = reported.restarts;
                row.uptime_s = reported.uptime_s;
                row.last_exit = reported.last_exit.clone();
                row.last_error = reported.last_error.clone();
            }
        }
    }
}

/// The host of `http://HOST:PORT/...`.
fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    Some(authority.rsplit_once(':').map_or(authority, |(h, _)| h))
}

/// The peer's status over the kept connection (opened when there is none); a kept one
/// that fails at once (the peer closed it: it restarted) is opened again for one more try.
async fn ask_on_status_conn(
    status_conn: &mut Option<StatusConn>,
    to: &Endpoint,
) -> Result<StatusReport, crate::control::client::ControlError> {
    let started = Instant::now();
    if let Some(conn) = status_conn.as_mut() {
        match conn.status().await {
            Ok(r) => return Ok(r),
            Err(e) if started.elapsed() >= ANSWER_WITHIN / 2 => {
                *status_conn = None;
                return Err(e);
            }
            Err(_) => *status_conn = None,
        }
    }
    let left = ANSWER_WITHIN.saturating_sub(started.elapsed());
    let mut conn = StatusConn::open(to, left.max(Duration::from_secs(1))).await?;
    let answer = conn.status().await;
    if answer.is_ok() {
        *status_conn = Some(conn);
    }
    answer
}

/// Asks one peer for its status once a second while anyone holds it; while it does not
/// answer, tries a TCP connection to each of its ports to tell a busy node (its kernel
/// still takes connections) from one whose link is gone.
async fn poll(peer: std::sync::Weak<Peer>, table: Arc<Table>) {
    // One connection (one TLS handshake) kept for every poll, opened again only after
    // it failed: a peer's polls never queue behind strangers' handshakes.
    let mut status_conn: Option<StatusConn> = None;
    // Renewals installed when `status_conn` was opened: after one, it is opened again with the
    // new certificate, whose first use the head waits for to drop the old one.
    let mut renewals_at_open = 0;
    // A renewal that failed is not tried again before this.
    let mut renew_not_before: Option<Instant> = None;
    loop {
        let Some(p) = peer.upgrade() else { return };
        // A peer that does not answer has not answered since it was asked: a silent one
        // takes ANSWER_WITHIN to fail, which is not added to the time it takes to be cut off.
        let asked = Moment::now();
        let installed = renewals_installed(&p.endpoint);
        if installed != renewals_at_open {
            status_conn = None;
            renewals_at_open = installed;
        }
        let answer = ask_on_status_conn(&mut status_conn, &p.endpoint).await;
        let link_up = match &answer {
            Ok(_) => true,
            Err(_) => any_port_connects(&p.ports()).await,
        };
        {
            let mut heard = p.heard.lock().unwrap_or_else(|e| e.into_inner());
            match answer {
                Ok(mut report) => {
                    if let Some(accepted) = report.certificates.take() {
                        let due = renew_not_before.is_none_or(|t| Instant::now() >= t);
                        if let Some(why) = learn(&p.endpoint, &accepted).filter(|_| due) {
                            renew_not_before = Some(Instant::now() + RENEW_AGAIN_AFTER);
                            tokio::spawn(renew_own(p.endpoint.clone(), why));
                        }
                    }
                    if heard.failing_since.is_some() && heard.report.is_some() {
                        tracing::info!("node {} answers again", p.node);
                    }
                    let services_there: Vec<(String, ServiceState)> = report
                        .services
                        .iter()
                        .filter(|s| !s.remote)
                        .map(|s| (s.name.clone(), s.state))
                        .collect();
                    table.set_reported(&p.node, &services_there);
                    heard.report = Some(report);
                    heard.failing_since = None;
                    heard.error = None;
                }
                Err(e) => {
                    if heard.failing_since.is_none() {
                        tracing::warn!(
                            "node {}'s supervisor does not answer: {e}{}",
                            p.node,
                            if link_up {
                                " (its ports take connections: busy, not cut off)"
                            } else {
                                ""
                            }
                        );
                        heard.failing_since = Some(asked);
                    }
                    heard.error = Some(e.to_string());
                }
            }
            if link_up {
                heard.link_down_since = None;
            } else if heard.link_down_since.is_none() {
                // From this round on: a node busy (silent supervisor, ports open) for a
                // while before its link went is not cut off any sooner for it.
                heard.link_down_since = Some(asked);
            }
        }
        drop(p);
        tokio::time::sleep(POLL).await;
    }
}

/// Takes the head's word on which certificate it accepts of each node (`to`: the head's
/// channel); whether this node should renew its own (`Some`: why).
fn learn(
    to: &Endpoint,
    accepted: &std::collections::BTreeMap<String, crate::control::tls::Accepted>,
) -> Option<&'static str> {
    match to {
        Endpoint::Tcp { node, tls, .. } if *node == tls.head => tls.learn(accepted),
        _ => None,
    }
}

/// How many renewed certificates this node installed (the channel's count; 0 elsewhere).
fn renewals_installed(to: &Endpoint) -> u64 {
    match to {
        Endpoint::Tcp { tls, .. } => tls.installed(),
        Endpoint::Unix(_) => 0,
    }
}

/// Renews this node's certificate with the head at `to`, saying so (or why it failed).
async fn renew_own(to: Endpoint, why: &'static str) {
    match renew(&to, RENEW_WITHIN).await {
        Ok(creds) => tracing::info!(
            "renewed the certificate of node {} ({why}); the head accepts only the new one",
            creds.node
        ),
        Err(e) => tracing::warn!(
            "cannot renew this node's certificate ({why}): {e}; tried again in {} s",
            RENEW_AGAIN_AFTER.as_secs()
        ),
    }
}

impl Peer {
    /// Every `host:port` of this node worth a TCP connect: its control channel, and the
    /// main port of each service it last reported running there.
    fn ports(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Endpoint::Tcp { addr, .. } = &self.endpoint {
            out.push(addr.clone());
        }
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(report) = &heard.report {
            for s in report.services.iter().filter(|s| !s.remote) {
                let host = s
                    .url
                    .as_deref()
                    .and_then(url_host)
                    .unwrap_or(self.address.as_str());
                if crate::supervisor::run::probe::only_on_its_node(host, Some(&self.address)) {
                    continue;
                }
                if let Some(port) = s.port {
                    out.push(format!("{host}:{port}"));
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

/// Whether any of `addrs` takes a TCP connection within [`CONNECT_WITHIN`] (tried at once).
async fn any_port_connects(addrs: &[String]) -> bool {
    let tries = addrs.iter().map(|a| async move {
        matches!(
            tokio::time::timeout(CONNECT_WITHIN, tokio::net::TcpStream::connect(a.as_str())).await,
            Ok(Ok(_))
        )
    });
    futures_util::future::join_all(tries)
        .await
        .into_iter()
        .any(|ok| ok)
}

#[cfg(test)]
mod rebalance_tests {
    use super::*;
    use crate::vocab::{Figures, MoveCounts, RebalanceMode, RebalanceReport, Split};

    #[test]
    fn a_node_off_the_head_passes_on_the_heads_rebalancer_while_it_answers() {
        let head = RebalanceReport {
            mode: RebalanceMode::Act,
            split: Split {
                prefill: 3,
                decode: 1,
            },
            window_s: 30,
            measured_s: 30,
            figures: Figures::default(),
            verdict: "objectives met".into(),
            moves_total: 1,
            moves: vec![],
            moves_counted: MoveCounts::default(),
        };
        let heard = |failing: bool| LastHeard {
            report: Some(StatusReport {
                cluster: "c".into(),
                node: "head".into(),
                proxy_url: None,
                services: vec![],
                operation: None,
                rebalance: Some(Box::new(head.clone())),
                certificates: None,
            }),
            failing_since: failing.then(Moment::now),
            link_down_since: None,
            error: None,
        };
        let peers = |failing: bool| Peers {
            cut_off_after: Duration::from_secs(6),
            peers: vec![Arc::new(Peer {
                node: "head".into(),
                address: "127.0.0.1".into(),
                endpoint: Endpoint::Unix("/nonexistent".into()),
                heard: Mutex::new(heard(failing)),
            })],
        };
        assert_eq!(peers(false).rebalance().map(|r| r.split), Some(head.split));
        assert_eq!(
            peers(true).rebalance(),
            None,
            "not while the head does not answer"
        );
    }
}
