//! The supervisors' TCP control channel: mutually authenticated TLS 1.3
//! ([`crate::control::tls`]), then [`PeerRequest`]s, one JSON line each. Which node sent
//! a request is what its certificate names; only the head may ask for anything but
//! status. Bounded everywhere: a cap on connections still in their handshake (in all and
//! per address), a time limit on the handshake and on silence after it, a frame limit
//! (a longer frame is refused without being echoed), and refusals logged at most once per
//! [`LOG_EVERY`] with a count of the ones not logged. The topology's node addresses have
//! handshake places of their own: strangers (any other address, counted per address and
//! per /64 for IPv6, with a shorter time to finish) can fill theirs, never the nodes'.
//! Besides [`PeerRequest`]s a node may send the head a [`RenewRequest`], a type of its
//! own: a new key to certify for the node the connection's certificate names.
//!
//! Authenticated connections are capped too, per node and in all (`[network]`
//! `control_connections_per_node`, `control_connections`), and a connection lasts only as
//! long as its certificate is accepted: checked before every request and every
//! [`REVOKED_CHECK_EVERY`] while it waits, so a node revoked or replaced is cut off within
//! a second, its kept connection too.

use crate::control::frame::{FrameError, PEER_FRAME_MAX, UNAUTHENTICATED_FRAME_MAX, read_frame};
use crate::control::tls::{PeerTls, RENEW_EXPORTER_LABEL, RenewRequest};
use crate::control::{JoinRequest, PeerRequest, Response};
use crate::supervisor::run::control_server::{self as cs, Handlers, Origin, answer};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufRead, AsyncWrite, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// How long a peer may take over the TLS handshake (and a join over its one request).
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(5);
/// How long a connection from an address that is no node's may take over its handshake.
const STRANGER_HANDSHAKE_WITHIN: Duration = Duration::from_secs(2);
/// How long an authenticated peer may stay silent between requests.
const IDLE_WITHIN: Duration = Duration::from_secs(60);
/// Connections from strangers still in their handshake, in all and from one address (an
/// IPv6 /64 counting as one); more are closed at once.
const MAX_UNAUTHENTICATED: usize = 64;
const MAX_UNAUTHENTICATED_PER_ADDRESS: usize = 8;
/// Connections from one of the topology's node addresses still in their handshake: places
/// of their own, which strangers never take.
const MAX_PEER_HANDSHAKES_PER_ADDRESS: usize = 16;
/// Refusals are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// How often a waiting connection's certificate is checked again (revoked, replaced).
const REVOKED_CHECK_EVERY: Duration = Duration::from_millis(250);

/// Authenticated connections open now, per node and in all.
#[derive(Default)]
struct Held {
    per_node: HashMap<String, usize>,
    total: usize,
}

/// A place among the authenticated connections, given back when dropped.
struct Seat {
    held: Arc<Mutex<Held>>,
    node: String,
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        h.total -= 1;
        if let Some(n) = h.per_node.get_mut(&self.node) {
            *n -= 1;
            if *n == 0 {
                h.per_node.remove(&self.node);
            }
        }
    }
}

/// A place for one more connection of `node`, or why not: `per_node` of one node and
/// `total` in all are held already (the topology's `[network]` caps).
fn seat(held: &Arc<Mutex<Held>>, node: &str, per_node: u32, total: u32) -> Result<Seat, String> {
    let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
    let mine = h.per_node.get(node).copied().unwrap_or(0);
    if mine >= per_node as usize {
        return Err(format!(
            "node {node} holds {mine} connections to this control channel already, its cap (network.control_connections_per_node = {per_node}); close one or raise the cap"
        ));
    }
    if h.total >= total as usize {
        return Err(format!(
            "this control channel holds {} connections already, its cap (network.control_connections = {total}); close some or raise the cap",
            h.total
        ));
    }
    h.total += 1;
    *h.per_node.entry(node.to_string()).or_default() += 1;
    Ok(Seat {
        held: held.clone(),
        node: node.to_string(),
    })
}

/// Counts connections not yet authenticated: strangers in all and per source, and the
/// nodes' own per address.
#[derive(Default)]
struct Gate {
    /// The topology's node addresses (as resolved at start).
    nodes: HashSet<IpAddr>,
    /// Strangers in their handshake, in all.
    total: usize,
    /// In their handshake per source: a node's address, or a stranger's (its /64 for IPv6).
    per_address: HashMap<IpAddr, usize>,
}

/// Where a connection comes from, as the gate counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// One of the topology's node addresses.
    Node(IpAddr),
    /// Any other: its address, or for IPv6 its /64 (one host holds a whole /64).
    Stranger(IpAddr),
}

impl Source {
    fn of(from: IpAddr, nodes: &HashSet<IpAddr>) -> Source {
        let from = match from {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(from, IpAddr::V4),
            v4 => v4,
        };
        if nodes.contains(&from) {
            return Source::Node(from);
        }
        Source::Stranger(match from {
            IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(bits.into())
            }
            v4 => v4,
        })
    }

    fn key(self) -> IpAddr {
        match self {
            Source::Node(a) | Source::Stranger(a) => a,
        }
    }

    /// How long this source's connection may take over its handshake.
    fn handshake_within(self) -> Duration {
        match self {
            Source::Node(_) => HANDSHAKE_WITHIN,
            Source::Stranger(_) => STRANGER_HANDSHAKE_WITHIN,
        }
    }
}

/// A place among the unauthenticated connections, given back when dropped.
struct Ticket {
    gate: Arc<Mutex<Gate>>,
    from: Source,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if let Source::Stranger(_) = self.from {
            g.total -= 1;
        }
        let key = self.from.key();
        if let Some(n) = g.per_address.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                g.per_address.remove(&key);
            }
        }
    }
}

fn admit(gate: &Arc<Mutex<Gate>>, from: IpAddr) -> Option<Ticket> {
    let mut g = gate.lock().unwrap_or_else(|e| e.into_inner());
    let source = Source::of(from, &g.nodes);
    let mine = g.per_address.get(&source.key()).copied().unwrap_or(0);
    let full = match source {
        Source::Node(_) => mine >= MAX_PEER_HANDSHAKES_PER_ADDRESS,
        Source::Stranger(_) => {
            g.total >= MAX_UNAUTHENTICATED || mine >= MAX_UNAUTHENTICATED_PER_ADDRESS
        }
    };
    if full {
        return None;
    }
    if let Source::Stranger(_) = source {
        g.total += 1;
    }
    *g.per_address.entry(source.key()).or_default() += 1;
    Some(Ticket {
        gate: gate.clone(),
        from: source,
    })
}

/// The addresses of the topology's nodes, resolved (a node written as a host name
/// counts with every address it has now).
fn node_addresses(h: &Handlers) -> HashSet<IpAddr> {
    use std::net::ToSocketAddrs;
    let members = h.ctx.members();
    members
        .plan
        .nodes
        .values()
        .flat_map(|addr| {
            (addr.as_str(), 0)
                .to_socket_addrs()
                .map(|it| it.map(|a| a.ip()).collect::<Vec<_>>())
                .unwrap_or_default()
        })
        .collect()
}

/// Logs refusals, at most one line per [`LOG_EVERY`], saying how many were not logged.
#[derive(Default)]
struct RefusalLog {
    state: Mutex<(Option<Instant>, u64)>,
}

impl RefusalLog {
    fn refused(&self, h: &Handlers, what: &str) {
        if let Some(line) = self.line_at(Instant::now(), what) {
            tracing::warn!("{line}");
            h.ctx.console.event(&line);
        }
    }

    /// The line to log for a refusal at `now`, or None while one was logged less than
    /// [`LOG_EVERY`] ago (it is counted, and the next line says how many).
    fn line_at(&self, now: Instant, what: &str) -> Option<String> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.0.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            s.1 += 1;
            return None;
        }
        let more = std::mem::take(&mut s.1);
        s.0 = Some(now);
        Some(match more {
            0 => format!("control channel: refused {what}"),
            n => format!("control channel: refused {what} (and {n} more since the last line)"),
        })
    }
}

/// Accepts peers until the listener fails; each connection gets its own task.
pub async fn serve(listener: TcpListener, handlers: Handlers, tls: Arc<PeerTls>) {
    let gate = Arc::new(Mutex::new(Gate {
        nodes: node_addresses(&handlers),
        ..Gate::default()
    }));
    let log = Arc::new(RefusalLog::default());
    let held = Arc::new(Mutex::new(Held::default()));
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, most likely: wait rather than spin.
                log.refused(&handlers, &format!("a connection: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(ticket) = admit(&gate, from.ip()) else {
            drop(stream);
            log.refused(
                &handlers,
                &format!(
                    "a connection from {from}: too many still in their handshake ({MAX_UNAUTHENTICATED} from strangers in all, {MAX_UNAUTHENTICATED_PER_ADDRESS} per stranger address or /64, {MAX_PEER_HANDSHAKES_PER_ADDRESS} per node address)"
                ),
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (h, tls, log, held) = (handlers.clone(), tls.clone(), log.clone(), held.clone());
        tokio::spawn(async move {
            if let Err(why) = serve_one(stream, from, (ticket, held), &h, &tls).await {
                log.refused(&h, &format!("a connection from {from}: {why}"));
            }
        });
    }
}

/// Whether the peer closed the connection before sending a byte: a TLS client always
/// speaks first, so this is a reachability check (the head telling a busy node from a cut
/// one connects to the node's ports and closes), not a peer to refuse. Logged as a
/// refusal it would be noise, and would take the place of a real refusal's line for
/// [`LOG_EVERY`].
async fn closed_unheard(stream: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    matches!(stream.peek(&mut first).await, Ok(0))
}

/// One connection: the handshake (within its time, holding its ticket), then a node's
/// requests or, from a client without a certificate, one join.
/// (Err stays text: why the connection ended, only logged, rate-limited; no caller
/// decides by its kind.)
async fn serve_one(
    stream: TcpStream,
    from: SocketAddr,
    (ticket, held): (Ticket, Arc<Mutex<Held>>),
    h: &Handlers,
    tls: &PeerTls,
) -> Result<(), String> {
    let within = ticket.from.handshake_within();
    let shake = tokio::time::timeout(within, async {
        if closed_unheard(&stream).await {
            return Ok(None);
        }
        tls.acceptor().accept(stream).await.map(Some)
    });
    let stream = match shake.await {
        Ok(Ok(Some(s))) => s,
        Ok(Ok(None)) => {
            tracing::debug!("control channel: {from} connected and closed unheard (a port check)");
            return Ok(());
        }
        Ok(Err(e)) => return Err(format!("TLS handshake failed: {e}")),
        Err(_) => return Err(format!("no TLS handshake within {within:?}")),
    };
    let peer_cert = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .cloned();
    let Some(cert) = peer_cert else {
        let joined = serve_join(stream, from, h, tls, within).await;
        drop(ticket);
        return joined;
    };
    let Some(node) = tls.node_of(&cert) else {
        return Err("its certificate names no node of this cluster".into());
    };
    drop(ticket);
    let mut stream = stream;
    let caps = h.ctx.members().plan.tcp;
    let _seat = match seat(
        &held,
        &node,
        caps.control_connections_per_node,
        caps.control_connections,
    ) {
        Ok(s) => s,
        Err(message) => {
            let said = Response::Error {
                message: message.clone(),
            };
            let _ = tokio::time::timeout(HANDSHAKE_WITHIN, answer(&mut stream, &said)).await;
            return Err(message);
        }
    };
    let mut binding = [0u8; 32];
    let exported =
        stream
            .get_ref()
            .1
            .export_keying_material(&mut binding, RENEW_EXPORTER_LABEL, None);
    exported.map_err(|e| e.to_string())?;
    let peer = Peer {
        node: &node,
        cert: &cert,
        binding: &binding,
    };
    let (read, write) = tokio::io::split(stream);
    requests(BufReader::new(read), write, h, tls, &peer).await;
    Ok(())
}

/// A connection from a client without a certificate, after its handshake: one join,
/// within `within`, said on the console once done.
async fn serve_join(
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    from: SocketAddr,
    h: &Handlers,
    tls: &PeerTls,
    within: Duration,
) -> Result<(), String> {
    let mut binding = [0u8; 32];
    let exported = stream.get_ref().1.export_keying_material(
        &mut binding,
        crate::control::tls::JOIN_EXPORTER_LABEL,
        None,
    );
    exported.map_err(|e| e.to_string())?;
    let (read, mut write) = tokio::io::split(stream);
    let work = join(BufReader::new(read), &mut write, h, tls, &binding);
    let node = tokio::time::timeout(within, work)
        .await
        .unwrap_or_else(|_| Err(format!("no join request within {within:?}")))?;
    let line = format!("control channel: node {node} joined from {from}");
    tracing::info!("{line}");
    h.ctx.console.event(&line);
    Ok(())
}

/// An authenticated node at the other end of a connection: its name, the certificate it
/// opened the connection with and the session's keying material for a renewal's proof.
struct Peer<'a> {
    node: &'a str,
    cert: &'a rustls::pki_types::CertificateDer<'static>,
    binding: &'a [u8],
}

/// What an authenticated node may send: a request of [`PeerRequest`], or a renewal.
enum NodeMessage {
    Peer(PeerRequest),
    Renew(RenewRequest),
}

impl NodeMessage {
    /// Reads a frame; the error of reading it as a [`PeerRequest`] when it is neither.
    fn read(frame: &[u8]) -> Result<NodeMessage, serde_json::Error> {
        serde_json::from_slice::<PeerRequest>(frame)
            .map(NodeMessage::Peer)
            .or_else(|e| {
                serde_json::from_slice::<RenewRequest>(frame)
                    .map(NodeMessage::Renew)
                    .map_err(|_| e)
            })
    }
}

/// The head's answer to a node's renewal: its new certificate (recorded as pending: the
/// old one stays accepted until the node uses it), or why not; None when the answer is to
/// be lost ([`LOSE_RENEWAL_ANSWERS`]).
fn renew(h: &Handlers, tls: &PeerTls, peer: &Peer<'_>, req: &RenewRequest) -> Option<Response> {
    match tls.answer_renewal(peer.node, peer.cert, req, peer.binding) {
        Ok(cert_pem) => {
            let line = format!(
                "control channel: node {} renewed its certificate",
                peer.node
            );
            tracing::info!("{line}");
            h.ctx.console.event(&line);
            if lose_renewal_answer() {
                tracing::warn!(
                    "control channel: the answer to node {}'s renewal is lost on purpose ({LOSE_RENEWAL_ANSWERS})",
                    peer.node
                );
                return None;
            }
            Some(Response::Renewed { cert_pem })
        }
        Err(why) => {
            let message = format!(
                "node {} asked node {} for a new certificate: refused: {why}",
                peer.node, tls.node
            );
            tracing::warn!("control channel: {message}");
            Some(Response::Error { message })
        }
    }
}

/// The environment variable that makes a debug build's head lose that many answers to
/// renewals (it records them, then closes the connection unanswered): how the tests show
/// a lost answer locks no node out. Release builds do not read it.
pub const LOSE_RENEWAL_ANSWERS: &str = "PDCTL_TEST_LOSE_RENEWAL_ANSWERS";

/// Whether this answer to a renewal is to be lost ([`LOSE_RENEWAL_ANSWERS`]).
fn lose_renewal_answer() -> bool {
    if !cfg!(debug_assertions) {
        return false;
    }
    static LEFT: std::sync::OnceLock<std::sync::atomic::AtomicU32> = std::sync::OnceLock::new();
    let left = LEFT.get_or_init(|| {
        let n = std::env::var(LOSE_RENEWAL_ANSWERS).ok();
        std::sync::atomic::AtomicU32::new(n.and_then(|n| n.parse().ok()).unwrap_or(0))
    });
    left.fetch_update(
        std::sync::atomic::Ordering::SeqCst,
        std::sync::atomic::Ordering::SeqCst,
        |n| n.checked_sub(1),
    )
    .is_ok()
}

/// A node started by hand asks for its credentials: one request, one answer. The node
/// that joined, or why it was refused.
/// (Err stays text: the refusal the joining node is sent and the log says.)
async fn join(
    mut read: impl AsyncBufRead + Unpin,
    write: &mut (impl AsyncWrite + Unpin),
    h: &Handlers,
    tls: &PeerTls,
    binding: &[u8],
) -> Result<String, String> {
    let mut frame = Vec::new();
    match read_frame(&mut read, UNAUTHENTICATED_FRAME_MAX, &mut frame).await {
        Ok(true) => {}
        Ok(false) => return Err("a client without a certificate said nothing".into()),
        Err(e) => return Err(format!("a client without a certificate: {e}")),
    }
    let req: JoinRequest = serde_json::from_slice(&frame).map_err(|_| {
        "a client without a certificate sent something other than a join".to_string()
    })?;
    match tls.answer_join(&req.join, &req.token, &req.proof, binding) {
        Ok(creds) => {
            let reply = Response::Joined {
                creds: Box::new(creds),
                engine_key: h.ctx.engine_key.clone(),
            };
            answer(write, &reply).await;
            Ok(req.join)
        }
        Err(message) => {
            let reply = Response::Error {
                message: message.clone(),
            };
            answer(write, &reply).await;
            Err(format!("a join as node {}: {message}", req.join))
        }
    }
}

/// Serves one authenticated node: a request per frame, until it leaves, stays silent
/// past [`IDLE_WITHIN`], or sends a frame past [`PEER_FRAME_MAX`].
async fn requests(
    mut read: impl AsyncBufRead + Unpin,
    mut write: impl AsyncWrite + Unpin,
    h: &Handlers,
    tls: &PeerTls,
    peer: &Peer<'_>,
) {
    let node = peer.node;
    let mut frame = Vec::new();
    loop {
        let next = tokio::time::timeout(
            IDLE_WITHIN,
            read_frame(&mut read, PEER_FRAME_MAX, &mut frame),
        );
        let next = tokio::select! {
            n = next => n,
            () = no_longer_accepted(tls, peer) => {
                cut_off(h, node);
                return;
            }
        };
        if !tls.accepts(node, peer.cert) {
            let message = format!(
                "node {node}'s certificate on this connection is no longer accepted (revoked or replaced): connect again with the current one"
            );
            answer(&mut write, &Response::Error { message }).await;
            cut_off(h, node);
            return;
        }
        match next {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) | Ok(Err(FrameError::Io(_))) | Err(_) => return,
            Ok(Err(e @ FrameError::TooLong { .. })) => {
                let message = format!("request from node {node} refused: {e}");
                tracing::warn!("control channel: {message}");
                answer(&mut write, &Response::Error { message }).await;
                return;
            }
        }
        let mut ack = None;
        let response = match NodeMessage::read(&frame) {
            Ok(NodeMessage::Peer(PeerRequest::Down { timeout_s })) if node == tls.head => {
                let (resp, a) = cs::down(h, timeout_s, Origin::Peer).await;
                ack = a;
                resp
            }
            // None: the answer is lost on purpose (a test hook), the connection closed.
            Ok(NodeMessage::Renew(req)) => match renew(h, tls, peer, &req) {
                Some(answer) => answer,
                None => return,
            },
            Ok(NodeMessage::Peer(req)) => match permitted(tls, node, &req) {
                Ok(()) => carry_out(h, tls, req).await,
                Err(message) => {
                    tracing::warn!("control channel: {message}");
                    Response::Error { message }
                }
            },
            // Never echoed: the frame is the peer's, and may be anything.
            Err(e) => Response::Error {
                message: format!(
                    "node {node} sent a request this supervisor cannot read ({} bytes): {e}",
                    frame.len()
                ),
            },
        };
        let written = answer(&mut write, &response).await;
        // The supervisor exits once a `down` is answered (or a second later).
        if let Some(a) = ack {
            let _ = a.send(());
        }
        if !written {
            return;
        }
    }
}

/// Returns once the certificate `peer` opened its connection with is no longer accepted
/// of its node (looked at every [`REVOKED_CHECK_EVERY`]).
async fn no_longer_accepted(tls: &PeerTls, peer: &Peer<'_>) {
    loop {
        tokio::time::sleep(REVOKED_CHECK_EVERY).await;
        if !tls.accepts(peer.node, peer.cert) {
            return;
        }
    }
}

/// Says that `node`'s connection was closed for its certificate.
fn cut_off(h: &Handlers, node: &str) {
    let line = format!(
        "control channel: closed a connection of node {node}: its certificate is no longer accepted (revoked or replaced)"
    );
    tracing::warn!("{line}");
    h.ctx.console.event(&line);
}

/// Whether `node` may ask `req` of this node: status of anyone; the rest of the head only.
/// (Err stays text: the refusal the peer is sent; nothing decides by its kind.)
fn permitted(tls: &PeerTls, node: &str, req: &PeerRequest) -> Result<(), String> {
    if req.head_only() && node != tls.head {
        return Err(format!(
            "node {node} asked node {} for `{}`: only the head ({}) asks another node to run, stop or change services",
            tls.node,
            req.name(),
            tls.head
        ));
    }
    Ok(())
}

async fn carry_out(h: &Handlers, tls: &PeerTls, req: PeerRequest) -> Response {
    match req {
        PeerRequest::Status => {
            let mut report = cs::status(h, Origin::Peer);
            // The head tells every node which certificates it accepts (and who renews).
            report.certificates = tls.accepted().map(Box::new);
            Response::Status(report)
        }
        PeerRequest::Logs { service, lines } => match local_service(h, &service) {
            Ok(()) => cs::logs(h, &service, lines).await,
            Err(e) => e,
        },
        // Taken by `requests` itself (it is answered before the supervisor exits).
        PeerRequest::Down { .. } => Response::Error {
            message: "down is asked of the head only".into(),
        },
        PeerRequest::Restart { service } => cs::restart(h, &service),
        PeerRequest::Drain { service } => cs::drain(h, &service),
        PeerRequest::Resume { service } => cs::resume(h, &service),
        PeerRequest::Add { service, settings } => cs::add(h, *service, settings),
        PeerRequest::Remove { service, timeout_s } => cs::remove(h, &service, timeout_s).await,
        PeerRequest::Replace { service, settings } => cs::replace(h, *service, settings),
        PeerRequest::FetchModel { source, roles } => cs::fetch_model(h, *source, &roles).await,
    }
}

/// Ok when `name` is a service of this node (a peer asks each node for its own logs).
fn local_service(h: &Handlers, name: &str) -> Result<(), Response> {
    let members = h.ctx.members();
    match members.index_of(name) {
        Some(i) if members.plan.services[i].node == h.ctx.node => Ok(()),
        _ => Err(Response::Error {
            message: format!("{name} is not a service of node {}", h.ctx.node),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshakes_are_capped_in_all_and_per_address_and_places_come_back() {
        let gate = Arc::new(Mutex::new(Gate::default()));
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        let mut held: Vec<Ticket> = (0..MAX_UNAUTHENTICATED_PER_ADDRESS)
            .map(|_| admit(&gate, one).expect("a place"))
            .collect();
        assert!(admit(&gate, one).is_none(), "one address past its cap");
        held.pop();
        assert!(
            admit(&gate, one).is_some(),
            "a place given back is free again"
        );
        drop(held);
        let mut all = Vec::new();
        for i in 0..MAX_UNAUTHENTICATED {
            let addr: IpAddr = format!("10.1.{}.{}", i / 200, i % 200 + 1).parse().unwrap();
            all.push(admit(&gate, addr).expect("a place"));
        }
        assert!(
            admit(&gate, "10.9.9.9".parse().unwrap()).is_none(),
            "past the cap in all"
        );
        drop(all);
        assert_eq!(gate.lock().unwrap().total, 0);
        assert!(gate.lock().unwrap().per_address.is_empty());
    }

    #[test]
    fn authenticated_connections_are_capped_per_node_and_in_all_and_places_come_back() {
        let held = Arc::new(Mutex::new(Held::default()));
        let (per_node, total) = (3, 5);
        let mut a: Vec<Seat> = (0..per_node)
            .map(|_| seat(&held, "a", per_node, total).expect("a place"))
            .collect();
        let e = seat(&held, "a", per_node, total)
            .err()
            .expect("past a's cap");
        assert!(
            e.contains("network.control_connections_per_node = 3"),
            "{e}"
        );
        let b: Vec<Seat> = (0..2)
            .map(|_| seat(&held, "b", per_node, total).expect("b's own places"))
            .collect();
        let e = seat(&held, "c", per_node, total)
            .err()
            .expect("past the cap in all");
        assert!(e.contains("network.control_connections = 5"), "{e}");
        a.pop();
        assert!(
            seat(&held, "c", per_node, total).is_ok(),
            "a place given back is free again"
        );
        drop((a, b));
        let h = held.lock().unwrap();
        assert_eq!(h.total, 0);
        assert!(h.per_node.is_empty());
    }

    #[test]
    fn strangers_never_take_the_nodes_places_and_an_ipv6_64_counts_once() {
        let node: IpAddr = "10.0.0.2".parse().unwrap();
        let gate = Arc::new(Mutex::new(Gate {
            nodes: HashSet::from([node]),
            ..Gate::default()
        }));
        let strangers: Vec<Ticket> = (0..MAX_UNAUTHENTICATED)
            .filter_map(|i| {
                admit(
                    &gate,
                    format!("10.9.{}.{}", i / 8, i % 8 + 1).parse().unwrap(),
                )
            })
            .collect();
        assert_eq!(strangers.len(), MAX_UNAUTHENTICATED);
        assert!(admit(&gate, "10.9.200.1".parse().unwrap()).is_none());
        let held: Vec<Ticket> = (0..MAX_PEER_HANDSHAKES_PER_ADDRESS)
            .map(|_| admit(&gate, node).expect("a node's own place"))
            .collect();
        assert_eq!(held[0].from.handshake_within(), HANDSHAKE_WITHIN);
        assert_eq!(
            strangers[0].from.handshake_within(),
            STRANGER_HANDSHAKE_WITHIN
        );
        let mapped: IpAddr = "::ffff:10.0.0.2".parse().unwrap();
        assert_eq!(
            Source::of(mapped, &HashSet::from([node])),
            Source::Node(node)
        );
        drop((strangers, held));
        let v6: Vec<Option<Ticket>> = (0..=MAX_UNAUTHENTICATED_PER_ADDRESS)
            .map(|i| admit(&gate, format!("2001:db8:1:2::{:x}", i + 1).parse().unwrap()))
            .collect();
        assert!(
            v6[..MAX_UNAUTHENTICATED_PER_ADDRESS]
                .iter()
                .all(Option::is_some)
        );
        assert!(
            v6[MAX_UNAUTHENTICATED_PER_ADDRESS].is_none(),
            "one /64, one count"
        );
        assert!(admit(&gate, "2001:db8:1:3::1".parse().unwrap()).is_some());
    }

    #[tokio::test]
    async fn a_connection_closed_before_its_first_byte_is_told_from_one_that_spoke() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        drop(TcpStream::connect(at).await.unwrap());
        let (check, _) = listener.accept().await.unwrap();
        assert!(closed_unheard(&check).await, "connected and closed");
        let mut hello = TcpStream::connect(at).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut hello, b"\x16")
            .await
            .unwrap();
        drop(hello);
        let (spoke, _) = listener.accept().await.unwrap();
        assert!(!closed_unheard(&spoke).await, "sent a byte, then closed");
    }

    #[test]
    fn refusals_are_logged_once_per_period_with_a_count_of_the_rest() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        assert_eq!(
            log.line_at(t0, "a").as_deref(),
            Some("control channel: refused a")
        );
        for i in 1..=1999 {
            assert!(log.line_at(t0 + Duration::from_millis(i), "b").is_none());
        }
        let next = log.line_at(t0 + LOG_EVERY, "c").unwrap();
        assert!(
            next.ends_with("(and 1999 more since the last line)"),
            "{next}"
        );
    }
}
