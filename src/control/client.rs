//! Client side of the control socket, and of the other nodes' TLS channel: one request,
//! one response.

use super::frame::{LOCAL_FRAME_MAX, read_frame};
use super::operation::ChangeRequest;
use super::tls::{JoinToken, NodeCreds, PeerTls};
use super::{JoinRequest, PeerRequest, Request, Response, StatusReport};
use crate::child_config::ChildSettings;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Why a control request did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no supervisor answers on {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("the supervisor on {path} closed the connection without answering")]
    NoAnswer { path: String },
    #[error("the supervisor on {path} did not answer within {secs} s")]
    Timeout { path: String, secs: u64 },
    #[error("talking to the supervisor on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("the supervisor on {path} sent an answer this pdctl cannot read: {source}")]
    Decode {
        path: String,
        source: serde_json::Error,
    },
    #[error("the supervisor on {path} refused the connection: {reason}")]
    Auth { path: String, reason: String },
    #[error("the supervisor on {path} answered: {message}")]
    Refused { path: String, message: String },
    #[error("the supervisor on {path} answered {what} where {asked} was asked for")]
    Unexpected {
        path: String,
        asked: &'static str,
        what: String,
    },
}

/// Asks the supervisor on `socket` for its status report.
pub async fn status(socket: &Path, timeout: Duration) -> Result<StatusReport, ControlError> {
    status_at(&Endpoint::Unix(socket.to_path_buf()), timeout).await
}

/// Asks the supervisor at `to` (this node's or another's) for its status report.
pub async fn status_at(to: &Endpoint, timeout: Duration) -> Result<StatusReport, ControlError> {
    ask(to, &Request::Status, timeout, "its status", |r| match r {
        Response::Status(report) => Ok(report),
        other => Err(other),
    })
    .await
}

/// Follows service `name`'s typed settings on the supervisor at `socket`: hands `each`
/// (revision, settings) at once and after every change, until the connection ends
/// (Ok when the supervisor closed it) or fails.
pub async fn watch_settings(
    socket: &Path,
    name: &str,
    mut each: impl FnMut(u64, Option<ChildSettings>),
) -> Result<(), ControlError> {
    let to = Endpoint::Unix(socket.to_path_buf());
    let mut conn = Conn::open_within(&to, 2).await?;
    conn.send(&Request::WatchSettings {
        service: name.to_string(),
    })
    .await?;
    loop {
        match conn.receive().await {
            Ok(Response::Settings {
                revision, settings, ..
            }) => each(revision, settings.map(|s| *s)),
            Ok(Response::Error { message }) => {
                return Err(ControlError::Refused {
                    path: to.label(),
                    message,
                });
            }
            Ok(other) => {
                return Err(ControlError::Unexpected {
                    path: to.label(),
                    asked: "a service's settings",
                    what: format!("{other:?}"),
                });
            }
            Err(ControlError::NoAnswer { .. }) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// Sends `req` and takes the answer `pick` accepts; an error answer is `Refused`, any
/// other `Unexpected` (what was `asked` for named).
async fn ask<T>(
    to: &Endpoint,
    req: &Request,
    timeout: Duration,
    asked: &'static str,
    pick: impl FnOnce(Response) -> Result<T, Response>,
) -> Result<T, ControlError> {
    let path = to.label();
    match pick(send_to(to, req, timeout).await?) {
        Ok(t) => Ok(t),
        Err(Response::Error { message }) => Err(ControlError::Refused { path, message }),
        Err(other) => Err(ControlError::Unexpected {
            path,
            asked,
            what: format!("{other:?}"),
        }),
    }
}

/// Where a supervisor listens: its Unix socket on this machine, or another node's TCP
/// control channel (mutually authenticated TLS: this node's certificate, theirs checked
/// to name `node`).
#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(std::path::PathBuf),
    Tcp {
        /// `address:port` of the node's control channel.
        addr: String,
        /// The node that must answer there.
        node: String,
        tls: Arc<PeerTls>,
    },
}

impl Endpoint {
    /// Node `node`'s control channel at `addr` (`address:port`), reached with `tls`.
    pub fn peer(addr: String, node: &str, tls: &Arc<PeerTls>) -> Endpoint {
        Endpoint::Tcp {
            addr,
            node: node.to_string(),
            tls: tls.clone(),
        }
    }

    fn label(&self) -> String {
        match self {
            Endpoint::Unix(p) => p.display().to_string(),
            Endpoint::Tcp { addr, node, .. } => format!("{addr} (node {node})"),
        }
    }
}

/// A byte stream both ways, whatever carries it.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}

/// Connects to `addr` and completes the TLS handshake as node `tls.node`, checking the
/// server is node `node`: the raw channel, for tests that send what pdctl never would.
pub async fn open_peer(addr: &str, node: &str, tls: &PeerTls) -> std::io::Result<Box<dyn Duplex>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let _ = stream.set_nodelay(true);
    Ok(Box::new(tls.connect(node, stream).await?))
}

/// A connection to a supervisor, past the handshake where there is one.
struct Conn {
    read: BufReader<Box<dyn tokio::io::AsyncRead + Send + Unpin>>,
    write: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    path: String,
    /// Another node's supervisor: requests go as [`PeerRequest`].
    peer: bool,
}

impl Conn {
    /// [`Conn::open`], given up as `Timeout` after `secs`.
    async fn open_within(to: &Endpoint, secs: u64) -> Result<Conn, ControlError> {
        tokio::time::timeout(Duration::from_secs(secs), Conn::open(to))
            .await
            .map_err(|_| ControlError::Timeout {
                path: to.label(),
                secs,
            })?
    }

    async fn open(to: &Endpoint) -> Result<Conn, ControlError> {
        let path = to.label();
        let connect = |source| ControlError::Connect {
            path: path.clone(),
            source,
        };
        match to {
            Endpoint::Unix(socket) => {
                let stream = UnixStream::connect(socket).await.map_err(connect)?;
                let (r, w) = stream.into_split();
                Ok(Conn {
                    read: BufReader::new(Box::new(r)),
                    write: Box::new(w),
                    path,
                    peer: false,
                })
            }
            Endpoint::Tcp { addr, node, tls } => {
                let stream = open_peer(addr, node, tls).await.map_err(|e| {
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        ControlError::Auth {
                            path: path.clone(),
                            reason: e.to_string(),
                        }
                    } else {
                        connect(e)
                    }
                })?;
                let (r, w) = tokio::io::split(stream);
                Ok(Conn {
                    read: BufReader::new(Box::new(r)),
                    write: Box::new(w),
                    path,
                    peer: true,
                })
            }
        }
    }

    async fn send(&mut self, req: &Request) -> Result<(), ControlError> {
        let line = if self.peer {
            let Some(peer) = PeerRequest::from_local(req) else {
                return Err(ControlError::Refused {
                    path: self.path.clone(),
                    message: "this request is asked of the supervisor on its own machine, not over the channel between nodes".into(),
                });
            };
            serde_json::to_string(&peer)
        } else {
            serde_json::to_string(req)
        };
        let mut line = line.expect("requests serialize");
        line.push('\n');
        self.write_line(&line).await
    }

    async fn write_line(&mut self, line: &str) -> Result<(), ControlError> {
        let path = self.path.clone();
        let io = |source| ControlError::Io { path, source };
        self.write
            .write_all(line.as_bytes())
            .await
            .map_err(io.clone())?;
        self.write.flush().await.map_err(io)
    }

    async fn receive(&mut self) -> Result<Response, ControlError> {
        let mut frame = Vec::new();
        let got = read_frame(&mut self.read, LOCAL_FRAME_MAX, &mut frame)
            .await
            .map_err(|e| ControlError::Io {
                path: self.path.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
        if !got {
            return Err(ControlError::NoAnswer {
                path: self.path.clone(),
            });
        }
        serde_json::from_slice(&frame).map_err(|source| ControlError::Decode {
            path: self.path.clone(),
            source,
        })
    }
}

/// Sends `req` to the supervisor listening on `socket` and waits up to `timeout` for its answer.
pub async fn send(
    socket: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Response, ControlError> {
    send_to(&Endpoint::Unix(socket.to_path_buf()), req, timeout).await
}

/// Sends `req` to the supervisor at `to` and waits up to `timeout` for its answer.
pub async fn send_to(
    to: &Endpoint,
    req: &Request,
    timeout: Duration,
) -> Result<Response, ControlError> {
    let work = async {
        let mut conn = Conn::open(to).await?;
        conn.send(req).await?;
        conn.receive().await
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(ControlError::Timeout {
            path: to.label(),
            secs: timeout.as_secs(),
        }),
    }
}

/// How a change ended, as the supervisor said.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeEnd {
    /// The exit code: 0 done, 1 a step failed, 2 refused.
    pub code: u8,
    pub message: String,
    /// Refused because only taking the cluster down and up again would make it.
    pub needs_recreate: bool,
}

/// Asks the supervisor on `socket` for a change and hands each progress line to
/// `progress` as it comes; returns how it ended. The change goes on if this client goes
/// away.
pub async fn change(
    socket: &Path,
    change: ChangeRequest,
    mut progress: impl FnMut(&str, bool),
) -> Result<ChangeEnd, ControlError> {
    let to = Endpoint::Unix(socket.to_path_buf());
    let mut conn = Conn::open_within(&to, 10).await?;
    conn.send(&Request::Change { change }).await?;
    loop {
        match conn.receive().await? {
            Response::Progress { line, error } => progress(&line, error),
            Response::Finished {
                code,
                message,
                needs_recreate,
            } => {
                return Ok(ChangeEnd {
                    code,
                    message,
                    needs_recreate,
                });
            }
            Response::Error { message } => {
                return Ok(ChangeEnd {
                    code: 2,
                    message,
                    needs_recreate: false,
                });
            }
            other => {
                return Err(ControlError::Unexpected {
                    path: to.label(),
                    asked: "a change",
                    what: format!("{other:?}"),
                });
            }
        }
    }
}

/// One connection to a supervisor kept open to ask for its status again and again: a
/// wait that follows a service's state makes one connection (and one handshake), not one
/// per look.
pub struct StatusConn {
    conn: Conn,
    timeout: Duration,
}

impl StatusConn {
    /// Connects to the supervisor at `to`; each answer is awaited up to `timeout`.
    pub async fn open(to: &Endpoint, timeout: Duration) -> Result<StatusConn, ControlError> {
        let conn = Conn::open_within(to, timeout.as_secs().max(1)).await?;
        Ok(StatusConn { conn, timeout })
    }

    /// The supervisor's status report now.
    pub async fn status(&mut self) -> Result<StatusReport, ControlError> {
        let path = self.conn.path.clone();
        let work = async {
            self.conn.send(&Request::Status).await?;
            self.conn.receive().await
        };
        let answer = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| ControlError::Timeout {
                path: path.clone(),
                secs: self.timeout.as_secs(),
            })??;
        match answer {
            Response::Status(report) => Ok(report),
            Response::Error { message } => Err(ControlError::Refused { path, message }),
            other => Err(ControlError::Unexpected {
                path,
                asked: "its status",
                what: format!("{other:?}"),
            }),
        }
    }
}

/// The last `lines` lines of service `name`'s log, asked of the supervisor at `to` (which
/// asks the service's own node where it runs elsewhere).
pub async fn logs_at(
    to: &Endpoint,
    name: &str,
    lines: usize,
    timeout: Duration,
) -> Result<Vec<String>, ControlError> {
    let req = Request::Logs {
        service: name.to_string(),
        lines,
    };
    ask(to, &req, timeout, "log lines", |r| match r {
        Response::Lines { lines, .. } => Ok(lines),
        other => Err(other),
    })
    .await
}

/// What a node that joined is given: its certificate and key, and the engines' key.
#[derive(Debug, Clone)]
pub struct Joined {
    pub creds: NodeCreds,
    pub engine_key: Option<super::auth::EngineKey>,
}

/// Joins the cluster as `node`: connects to the head's channel at `addr` trusting only
/// the CA `token` pins, proves the secret for this session and takes the credentials the
/// head issues (their CA checked against the pin again).
pub async fn join(
    addr: &str,
    head: &str,
    node: &str,
    token: &JoinToken,
    timeout: Duration,
) -> Result<Joined, ControlError> {
    let path = format!("{addr} (node {head})");
    let work = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| ControlError::Connect {
                path: path.clone(),
                source,
            })?;
        let tls = token
            .connect(head, stream)
            .await
            .map_err(|e| ControlError::Auth {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let mut binding = [0u8; 32];
        tls.get_ref()
            .1
            .export_keying_material(&mut binding, super::tls::JOIN_EXPORTER_LABEL, None)
            .map_err(|e| ControlError::Auth {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        // The head's certificate this session showed (chained to the pinned CA): the only
        // one this node will take for the head's.
        let head_cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| super::tls::cert_hash(c));
        let (r, w) = tokio::io::split(tls);
        let mut conn = Conn {
            read: BufReader::new(Box::new(r)),
            write: Box::new(w),
            path: path.clone(),
            peer: true,
        };
        let req = JoinRequest {
            join: node.to_string(),
            token: token.id.clone(),
            proof: token.proof(node, &binding),
        };
        let mut line = serde_json::to_string(&req).expect("joins serialize");
        line.push('\n');
        conn.write_line(&line).await?;
        Ok::<_, ControlError>((head_cert, conn.receive().await?))
    };
    let (head_cert, answer) = match tokio::time::timeout(timeout, work).await {
        Ok(a) => a?,
        Err(_) => {
            return Err(ControlError::Timeout {
                path,
                secs: timeout.as_secs(),
            });
        }
    };
    joined_from(answer, path, token, node, head_cert)
}

/// The credentials in the head's `answer` to a join, taken only if they are of the CA
/// `token` pins, for `node`, and name the head certificate the session showed
/// (`head_cert`); else why not.
fn joined_from(
    answer: Response,
    path: String,
    token: &JoinToken,
    node: &str,
    head_cert: Option<String>,
) -> Result<Joined, ControlError> {
    match answer {
        Response::Joined { creds, engine_key }
            if creds.ca_hash() == token.ca_hash
                && creds.node == node
                && head_cert.is_some()
                && creds.head_hash() == head_cert =>
        {
            Ok(Joined {
                creds: *creds,
                engine_key,
            })
        }
        Response::Joined { .. } => Err(ControlError::Auth {
            path,
            reason: "the head sent credentials of another CA or node, or a head certificate other than the one this session showed".into(),
        }),
        Response::Error { message } => Err(ControlError::Refused { path, message }),
        other => Err(ControlError::Unexpected {
            path,
            asked: "a join",
            what: format!("{other:?}"),
        }),
    }
}

/// Renews this node's certificate with the head at `to` (its TCP channel): a new key is
/// made here, certified by the head for the node this node's current certificate names,
/// kept (0600, synced) where this node keeps its credentials and used for every
/// connection from then on. The credentials now used.
pub async fn renew(to: &Endpoint, timeout: Duration) -> Result<NodeCreds, ControlError> {
    let Endpoint::Tcp { addr, node, tls } = to else {
        return Err(ControlError::Refused {
            path: to.label(),
            message: "a certificate is renewed with the head over the channel between nodes".into(),
        });
    };
    let path = to.label();
    let auth = |reason: String| ControlError::Auth {
        path: path.clone(),
        reason,
    };
    let work = async {
        let stream = tokio::net::TcpStream::connect(addr.as_str())
            .await
            .map_err(|source| ControlError::Connect {
                path: path.clone(),
                source,
            })?;
        let stream = tls
            .connect(node, stream)
            .await
            .map_err(|e| auth(e.to_string()))?;
        let mut binding = [0u8; 32];
        stream
            .get_ref()
            .1
            .export_keying_material(&mut binding, super::tls::RENEW_EXPORTER_LABEL, None)
            .map_err(|e| auth(e.to_string()))?;
        let renewal = tls.renewal(&binding).map_err(|e| auth(e.to_string()))?;
        let (r, w) = tokio::io::split(stream);
        let mut conn = Conn {
            read: BufReader::new(Box::new(r)),
            write: Box::new(w),
            path: path.clone(),
            peer: true,
        };
        let mut line = serde_json::to_string(&renewal.request).expect("renewals serialize");
        line.push('\n');
        conn.write_line(&line).await?;
        Ok::<_, ControlError>((renewal, conn.receive().await?))
    };
    let (renewal, answer) =
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| ControlError::Timeout {
                path: path.clone(),
                secs: timeout.as_secs(),
            })??;
    match answer {
        Response::Renewed { cert_pem } => tls.install(renewal, &cert_pem).map_err(|e| {
            auth(format!(
                "{e}; the head accepts only the certificate it just sent from now on: on the head run `pdctl join-token --node {}` and join again with it",
                tls.node
            ))
        }),
        Response::Error { message } => Err(ControlError::Refused { path, message }),
        other => Err(ControlError::Unexpected {
            path,
            asked: "a renewed certificate",
            what: format!("{other:?}"),
        }),
    }
}
