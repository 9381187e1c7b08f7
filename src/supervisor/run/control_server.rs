//! Serving the control protocol ([`crate::control`]) on `<state_dir>/control.sock`:
//! one JSON request per line, one answer per line, one handler per request kind.
//! `Status` only copies the shared table, so the proxy can poll it twice a second.

use crate::control::{Request, Response};
use crate::supervisor::run::remote::run_remote;
use crate::supervisor::run::service::{Cmd, ServiceCtx, run_local};
use crate::supervisor::state_dir::logfile::ServiceLog;
use crate::supervisor::state_dir::state::{StateDir, write_atomic};
use crate::vocab::Service;
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
    pub ctx: Arc<ServiceCtx>,
    /// Where plan.json is kept in step with the services that run now.
    pub state: StateDir,
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
            Ok(Request::Status) => Response::Status(h.ctx.table.report()),
            Ok(Request::Restart { service }) => restart(&h, &service),
            Ok(Request::Drain { service }) => drain(&h, &service),
            Ok(Request::Add { service }) => add(&h, *service),
            Ok(Request::Remove { service, timeout_s }) => remove(&h, &service, timeout_s).await,
            Ok(Request::Replace { service }) => replace(&h, *service),
            Ok(Request::Spec { service }) => spec(&h, &service),
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
    let idx = any_index(h, name)?;
    let node = h.ctx.members().plan.services[idx].node.clone();
    if node != h.ctx.node {
        return Err(Response::Error {
            message: format!("{name} runs on node {node}; ask the supervisor there"),
        });
    }
    Ok(idx)
}

/// The index of a service this supervisor runs or, on another node, follows (probes and
/// reports), or the error to answer.
fn any_index(h: &Handlers, name: &str) -> Result<usize, Response> {
    let members = h.ctx.members();
    let Some(idx) = members.index_of(name) else {
        let names: Vec<String> = members
            .live_plan()
            .services
            .into_iter()
            .map(|s| s.name)
            .collect();
        return Err(Response::Error {
            message: format!("no service `{name}`; services: {}", names.join(", ")),
        });
    };
    Ok(idx)
}

fn restart(h: &Handlers, name: &str) -> Response {
    let idx = match local_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    let sent = h.ctx.send(
        idx,
        Cmd::Restart {
            reason: "restart requested".into(),
            cascade: true,
        },
    );
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
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    if h.ctx.table.drain(idx) {
        Response::Done {
            message: format!("draining {name}: out of routing until it restarts"),
        }
    } else {
        Response::Error {
            message: format!(
                "{name} is {}, not healthy: there is nothing to drain",
                h.ctx.table.state(idx)
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

/// Writes plan.json anew: the services that run now, so a later `apply` compares with them
/// and a supervisor started again from it runs the same cluster.
fn save_plan(h: &Handlers) -> Result<(), Response> {
    let plan = h.ctx.members().live_plan();
    let json = serde_json::to_vec_pretty(&plan).expect("plans serialize");
    let path = h.state.plan_path();
    write_atomic(&path, &json).map_err(|e| Response::Error {
        message: format!("cannot write {}: {e}", path.display()),
    })
}

/// Refuses what the supervisor cannot take on: a service of another node, or one whose
/// dependencies are not in the cluster.
fn check_new(h: &Handlers, service: &Service) -> Result<(), Response> {
    let members = h.ctx.members();
    if !members.plan.nodes.contains_key(&service.node) {
        return Err(Response::Error {
            message: format!(
                "{} would run on node {}, which this cluster does not have (nodes: {}); its nodes are fixed when it starts: `pdctl apply --recreate` to change them",
                service.name,
                service.node,
                members
                    .plan
                    .nodes
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    if let Some(dep) = service
        .depends_on
        .iter()
        .chain(&service.restart_with)
        .find(|d| members.index_of(d).is_none())
    {
        return Err(Response::Error {
            message: format!(
                "{} depends on `{dep}`, which this cluster does not run",
                service.name
            ),
        });
    }
    Ok(())
}

fn add(h: &Handlers, service: Service) -> Response {
    if let Err(e) = check_new(h, &service) {
        return e;
    }
    let name = service.name.clone();
    let ctx = &h.ctx;
    let (tx, rx) = mpsc::unbounded_channel();
    // Checked and inserted under one lock, so two adds of one name cannot both win; the
    // log is opened only for the one that does.
    let idx = ctx.change_members(|m| {
        if m.index_of(&name).is_some() {
            return None;
        }
        let log = ServiceLog::open(
            &name,
            &h.state.log_path(&name),
            ctx.log_max_bytes,
            ctx.log_keep,
        );
        Some(m.insert(service.clone(), Arc::new(log), tx))
    });
    let Some(idx) = idx else {
        return Response::Error {
            message: format!("{name} already runs"),
        };
    };
    ctx.table.put(idx, &service);
    let remote = service.node != ctx.node;
    if remote {
        tokio::spawn(follow_remote(ctx.clone(), idx, rx));
    } else {
        tokio::spawn(run_local(ctx.clone(), idx, rx));
    }
    ctx.console.event(&format!("{name} added"));
    if let Err(e) = save_plan(h) {
        return e;
    }
    Response::Done {
        message: if remote {
            format!(
                "following {name} on node {}: its supervisor there starts it",
                service.node
            )
        } else {
            format!("starting {name}")
        },
    }
}

async fn remove(h: &Handlers, name: &str, timeout_s: u64) -> Response {
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    let (done, stopped) = oneshot::channel();
    let timeout = Some(Duration::from_secs(timeout_s));
    if h.ctx.send(idx, Cmd::Stop { timeout, done }).is_ok() {
        let _ = stopped.await;
    }
    h.ctx.change_members(|m| m.retire(idx));
    h.ctx.table.retire(idx);
    h.ctx.console.event(&format!("{name} removed"));
    if let Err(e) = save_plan(h) {
        return e;
    }
    Response::Done {
        message: format!("{name} stopped and removed"),
    }
}

/// Probes a service added on another node (as the services of other nodes in the plan
/// are) until it is removed: a `Stop` ends the probing and is answered at once.
async fn follow_remote(
    ctx: Arc<ServiceCtx>,
    idx: usize,
    mut commands: mpsc::UnboundedReceiver<Cmd>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let probing = tokio::spawn(run_remote(ctx, idx, stopped));
    while let Some(cmd) = commands.recv().await {
        if let Cmd::Stop { done, .. } = cmd {
            let _ = stop.send(true);
            let _ = done.send(());
            break;
        }
    }
    let _ = stop.send(true);
    let _ = probing.await;
}

fn spec(h: &Handlers, name: &str) -> Response {
    match any_index(h, name) {
        Ok(idx) => Response::Spec {
            service: Box::new(h.ctx.service(idx)),
        },
        Err(e) => e,
    }
}

fn replace(h: &Handlers, service: Service) -> Response {
    let idx = match any_index(h, &service.name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    if let Err(e) = check_new(h, &service) {
        return e;
    }
    let name = service.name.clone();
    let revision = h.ctx.table.describe(idx, &service);
    h.ctx.change_members(|m| m.plan.services[idx] = service);
    if let Err(e) = save_plan(h) {
        return e;
    }
    Response::Done {
        message: format!(
            "{name} has its new settings (revision {revision}): they take effect at its next start, or at once where it reads them while it runs"
        ),
    }
}
