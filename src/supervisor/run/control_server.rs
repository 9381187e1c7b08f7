//! Serving the control protocol ([`crate::control`]) on `<state_dir>/control.sock`:
//! one JSON request per line, one answer per line, one handler per request kind.
//! `Status` only copies the shared table, so the proxy can poll it twice a second.

use crate::control::{Request, Response};
use crate::plan::Plan;
use crate::supervisor::run::service::Cmd;
use crate::supervisor::run::table::Table;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

/// A `down` asked for over the socket; answered once everything is stopped.
#[derive(Debug)]
pub struct DownRequest {
    /// Per-service stop timeout, overriding the plan's.
    pub timeout: Duration,
    /// Receives the answer text; the handler acknowledges once it has written it.
    pub reply: oneshot::Sender<(String, oneshot::Sender<()>)>,
}

/// What the handlers need from the supervisor.
#[derive(Debug, Clone)]
pub struct Handlers {
    pub plan: Arc<Plan>,
    pub node: String,
    pub table: Arc<Table>,
    pub commands: Vec<mpsc::UnboundedSender<Cmd>>,
    pub downs: mpsc::UnboundedSender<DownRequest>,
}

/// Binds the socket at `path` (replacing a stale file) with mode 0600.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Accepts connections until the listener fails; each gets its own task.
pub async fn serve(listener: UnixListener, handlers: Handlers) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let h = handlers.clone();
                tokio::spawn(async move { connection(stream, h).await });
            }
            Err(e) => {
                tracing::warn!("control socket: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn connection(stream: UnixStream, h: Handlers) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.trim().is_empty() {
            continue;
        }
        let mut ack = None;
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Status) => Response::Status(h.table.report()),
            Ok(Request::Restart { service }) => restart(&h, &service),
            Ok(Request::Drain { service }) => drain(&h, &service),
            Ok(Request::Down { timeout_s }) => {
                let (resp, a) = down(&h, timeout_s).await;
                ack = a;
                resp
            }
            Err(e) => Response::Error {
                message: format!("cannot read the request {line:?}: {e}"),
            },
        };
        let mut out = serde_json::to_string(&response).expect("responses serialize");
        out.push('\n');
        let written = write.write_all(out.as_bytes()).await;
        let _ = write.flush().await;
        if let Some(a) = ack {
            let _ = a.send(());
        }
        if written.is_err() {
            return;
        }
    }
}

/// The index of a service this supervisor runs, or the error to answer.
fn local_index(h: &Handlers, name: &str) -> Result<usize, Response> {
    let Some(idx) = h.plan.index_of(name) else {
        let known: Vec<&str> = h.plan.services.iter().map(|s| s.name.as_str()).collect();
        return Err(Response::Error {
            message: format!("no service `{name}`; services: {}", known.join(", ")),
        });
    };
    let svc = &h.plan.services[idx];
    if svc.node != h.node {
        return Err(Response::Error {
            message: format!("{name} runs on node {}; ask the supervisor there", svc.node),
        });
    }
    Ok(idx)
}

fn restart(h: &Handlers, name: &str) -> Response {
    let idx = match local_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    let sent = h.commands[idx].send(Cmd::Restart {
        reason: "restart requested".into(),
        cascade: true,
    });
    match sent {
        Ok(()) => Response::Done {
            message: format!("restarting {name}"),
        },
        Err(_) => Response::Error {
            message: format!("{name} is shutting down"),
        },
    }
}

fn drain(h: &Handlers, name: &str) -> Response {
    let idx = match local_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    if h.table.drain(idx) {
        Response::Done {
            message: format!("draining {name}: out of routing until it restarts"),
        }
    } else {
        Response::Error {
            message: format!(
                "{name} is {}, not healthy: there is nothing to drain",
                h.table.state(idx)
            ),
        }
    }
}

async fn down(h: &Handlers, timeout_s: u64) -> (Response, Option<oneshot::Sender<()>>) {
    let (tx, rx) = oneshot::channel();
    let req = DownRequest {
        timeout: Duration::from_secs(timeout_s),
        reply: tx,
    };
    if h.downs.send(req).is_err() {
        return (
            Response::Error {
                message: "the supervisor is already exiting".into(),
            },
            None,
        );
    }
    match rx.await {
        Ok((message, ack)) => (Response::Done { message }, Some(ack)),
        Err(_) => (
            Response::Error {
                message: "the supervisor exited before finishing the down".into(),
            },
            None,
        ),
    }
}
