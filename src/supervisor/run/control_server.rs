//! Serving the control protocol ([`crate::control`]) on `<state_dir>/control.sock`:
//! one JSON request per line, one answer per line, one handler per request kind.
//! `Status` only copies the shared table, so the proxy can poll it twice a second.

use crate::child_config::ChildSettings;
use crate::control::frame::{FrameError, LOCAL_FRAME_MAX, read_frame};
use crate::control::{ENDED_BEFORE_STOP, Request, Response, ServiceState};
use crate::supervisor::run::members::Members;
use crate::supervisor::run::ops_hook::Operations;
use crate::supervisor::run::peers::Peers;
use crate::supervisor::run::remote::run_remote;
use crate::supervisor::run::service::{Cmd, ServiceCtx, run_local};
use crate::supervisor::state_dir::logfile::ServiceLog;
use crate::supervisor::state_dir::state::{StateDir, write_atomic};
use crate::vocab::Service;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
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
#[derive(Clone)]
pub struct Handlers {
    pub ctx: Arc<ServiceCtx>,
    /// Where plan.json is kept in step with the services that run now.
    pub state: StateDir,
    pub downs: mpsc::UnboundedSender<DownRequest>,
    /// The changes to the whole cluster, when this supervisor carries them out.
    pub operations: Option<Arc<dyn Operations>>,
    /// The other nodes' supervisors, whose reports fill in their services' rows.
    pub peers: Option<Arc<Peers>>,
}

/// Who sent a request: this machine (the Unix socket, mode 0600) or another node's
/// supervisor over the TCP control channel, past the secret handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Local,
    Peer,
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
                tokio::spawn(async move {
                    let (read, write) = stream.into_split();
                    connection(BufReader::new(read), write, h, Origin::Local).await
                });
            }
            Err(e) => {
                tracing::warn!("control socket: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Writes one answer line; false when the client has gone.
pub(crate) async fn answer(write: &mut (impl AsyncWrite + Unpin), response: &Response) -> bool {
    let mut out = serde_json::to_string(response).expect("responses serialize");
    out.push('\n');
    let written = write.write_all(out.as_bytes()).await;
    let _ = write.flush().await;
    written.is_ok()
}

/// Serves one client: a request per line, an answer per line (a change: its progress
/// lines, then its end). A request longer than [`LOCAL_FRAME_MAX`] ends the connection.
pub async fn connection(
    mut read: impl AsyncBufRead + Unpin,
    mut write: impl AsyncWrite + Unpin,
    h: Handlers,
    origin: Origin,
) {
    let mut frame = Vec::new();
    loop {
        match read_frame(&mut read, LOCAL_FRAME_MAX, &mut frame).await {
            Ok(true) => {}
            Ok(false) | Err(FrameError::Io(_)) => return,
            Err(e @ FrameError::TooLong { .. }) => {
                let message = format!("request refused: {e}");
                answer(&mut write, &Response::Error { message }).await;
                return;
            }
        }
        if frame.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let mut ack = None;
        let response = match serde_json::from_slice::<Request>(&frame) {
            Ok(Request::Status) => Response::Status(status(&h, origin)),
            Ok(Request::Restart { service }) => restart(&h, &service),
            Ok(Request::Drain { service }) => drain(&h, &service),
            Ok(Request::Resume { service }) => resume(&h, &service),
            Ok(Request::Add { service, settings }) => add(&h, *service, settings),
            Ok(Request::Remove { service, timeout_s }) => remove(&h, &service, timeout_s).await,
            Ok(Request::Replace { service, settings }) => replace(&h, *service, settings),
            Ok(Request::FetchModel { source, roles }) => fetch_model(&h, *source, &roles).await,
            Ok(Request::Logs { service, lines }) => logs(&h, &service, lines).await,
            Ok(Request::Rebalance { mode }) => set_rebalance(&h, mode),
            Ok(Request::WatchSettings { service }) => {
                // Answered until the client leaves: this connection serves nothing else.
                watch_settings(&h, &service, &mut read, &mut write).await;
                return;
            }
            Ok(Request::Change { change }) => {
                if !relay_change(&h, change, origin, &mut write).await {
                    return;
                }
                continue;
            }
            Ok(Request::Down { timeout_s }) => {
                let (resp, a) = down(&h, timeout_s, origin).await;
                ack = a;
                resp
            }
            Err(e) => Response::Error {
                message: format!("cannot read the request ({} bytes): {e}", frame.len()),
            },
        };
        let written = answer(&mut write, &response).await;
        if let Some(a) = ack {
            let _ = a.send(());
        }
        if !written {
            return;
        }
    }
}

/// Carries out a change and relays its progress while the client listens (the change
/// goes on when it leaves); false when the client has gone.
async fn relay_change(
    h: &Handlers,
    change: crate::control::operation::ChangeRequest,
    origin: Origin,
    write: &mut (impl AsyncWrite + Unpin),
) -> bool {
    let Some(mut progress) = begin_change(h, change, origin) else {
        return true;
    };
    while let Some(r) = progress.recv().await {
        let end = matches!(r, Response::Finished { .. } | Response::Error { .. });
        if !answer(write, &r).await {
            return false;
        }
        if end {
            return true;
        }
    }
    let message = "the change ended without a word (see the supervisor log)".to_string();
    answer(write, &Response::Error { message }).await
}

/// The last `lines` lines of a service's log: read here for a service of this node,
/// asked of its node's supervisor for one elsewhere.
pub(crate) async fn logs(h: &Handlers, name: &str, lines: usize) -> Response {
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    let node = h.ctx.members().plan.services[idx].node.clone();
    if node == h.ctx.node {
        let path = h.state.log_path(name);
        return Response::Lines {
            service: name.to_string(),
            lines: tail(&path, lines.min(MAX_LOG_LINES)),
        };
    }
    match &h.peers {
        Some(peers) => peers.logs(&node, name, lines).await,
        None => Response::Error {
            message: format!("{name} runs on node {node}, which this supervisor cannot reach"),
        },
    }
}

/// The most log lines one answer carries, and the most bytes read for them.
const MAX_LOG_LINES: usize = 10_000;
const MAX_LOG_BYTES: u64 = 4 << 20;

/// The last `n` lines of the log file at `path` (from its last 4 MiB).
fn tail(path: &Path, n: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(MAX_LOG_BYTES);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(from)).is_err() || f.read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let mut all: Vec<&str> = text.lines().collect();
    if from > 0 && !all.is_empty() {
        all.remove(0); // cut in the middle
    }
    all[all.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

/// The status report: this node's rows, the other nodes' services as their own
/// supervisors report them, and the change running or last run.
pub(crate) fn status(h: &Handlers, origin: Origin) -> crate::control::StatusReport {
    let mut report = h.ctx.table.report();
    // A peer asks for what this node knows first-hand; merging its own answer back
    // would only echo it.
    if origin == Origin::Local
        && let Some(peers) = &h.peers
    {
        peers.merge_into(&mut report);
    }
    report.operation = h.operations.as_ref().and_then(|o| o.report()).map(Box::new);
    report.rebalance = match &h.operations {
        Some(o) => o.rebalance(),
        // Not the head: the head's, as its supervisor reports it (so this node's proxy
        // exports the rebalancer's series too).
        None if origin == Origin::Local => h.peers.as_ref().and_then(|p| p.rebalance()),
        None => None,
    }
    .map(Box::new);
    report
}

/// `pdctl rebalance MODE`, answered by the head's operations layer.
fn set_rebalance(h: &Handlers, mode: crate::vocab::RebalanceMode) -> Response {
    let Some(ops) = &h.operations else {
        return Response::Error {
            message: format!(
                "the supervisor of node {} does not rebalance the cluster: run the command on the head node",
                h.ctx.node
            ),
        };
    };
    match ops.set_rebalance(mode) {
        Ok(message) => Response::Done { message },
        Err(message) => Response::Error { message },
    }
}

/// Hands `change` to the operations layer; the channel its progress comes on, or None
/// when the refusal was already answered.
fn begin_change(
    h: &Handlers,
    change: crate::control::operation::ChangeRequest,
    origin: Origin,
) -> Option<mpsc::UnboundedReceiver<Response>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let refusal = match (&h.operations, origin) {
        (_, Origin::Peer) => Some(
            "changes to the cluster are asked of the head's supervisor by `pdctl` on the head, not over the control channel".to_string(),
        ),
        (None, _) => Some(format!(
            "the supervisor of node {} does not carry out changes to the cluster: run the command on the head node",
            h.ctx.node
        )),
        (Some(ops), Origin::Local) => ops.begin(change, tx.clone()).err(),
    };
    if let Some(message) = refusal {
        let _ = tx.send(Response::Finished {
            code: 2,
            message,
            needs_recreate: false,
        });
    }
    Some(rx)
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

pub(crate) fn restart(h: &Handlers, name: &str) -> Response {
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

/// A service of another node, drained here and restarted by its own supervisor: back in
/// routing once its probe answers again.
pub(crate) fn resume(h: &Handlers, name: &str) -> Response {
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    h.ctx.table.resume(idx);
    Response::Done {
        message: format!("{name} back in routing once it answers"),
    }
}

pub(crate) fn drain(h: &Handlers, name: &str) -> Response {
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

pub(crate) async fn down(
    h: &Handlers,
    timeout_s: u64,
    origin: Origin,
) -> (Response, Option<oneshot::Sender<()>>) {
    // `pdctl down` on the head takes the other nodes down first, so none is left running.
    let mut others = Vec::new();
    if origin == Origin::Local
        && let Some(ops) = &h.operations
    {
        others = ops.down_others(timeout_s).await;
    }
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
        Ok((message, ack)) => {
            others.push(message);
            (
                Response::Done {
                    message: others.join("\npdctl: "),
                },
                Some(ack),
            )
        }
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

/// A service planned on another machine (the head) names its program by that machine's
/// path; where no such file is here, the program of the same name this machine has is
/// run instead (pdctl, mooncake_master, a venv's python), as `up` here would have found.
fn localize_program(h: &Handlers, service: &mut Service) {
    if service.node != h.ctx.node {
        return;
    }
    let Some(program) = service.argv.first() else {
        return;
    };
    let path = std::path::Path::new(program);
    if !path.is_absolute() || path.exists() {
        return;
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string);
    let found = match name.as_deref() {
        // The head's own binary: this machine's is the one running here.
        Some("pdctl") => std::env::current_exe().ok(),
        Some(n) => crate::tools::find_program(n),
        None => None,
    };
    if let Some(found) = found {
        service.argv[0] = found.display().to_string();
    }
}

/// Keeps service `name`'s typed settings (or forgets them) in the supervisor's plan.
fn set_settings(m: &mut Members, name: &str, settings: Option<Box<ChildSettings>>) {
    match settings {
        Some(s) => {
            m.plan.settings.insert(name.to_string(), *s);
        }
        None => {
            m.plan.settings.remove(name);
        }
    }
}

/// Fetches the plan's model into this node's cache when it lacks it, before the head
/// starts engines of `roles` here (their token from the values kept in the state dir);
/// each progress line goes to this supervisor's log.
pub(crate) async fn fetch_model(
    h: &Handlers,
    source: crate::model_fetch::Source,
    roles: &[crate::vocab::Role],
) -> Response {
    let finished = |code: u8, message: String| Response::Finished {
        code,
        message,
        needs_recreate: false,
    };
    let hidden = match crate::control::hidden_env::kept(&h.ctx.cwd) {
        Ok(k) => k,
        Err(e) => return finished(1, e.to_string()),
    };
    let tokens: Vec<(&str, String)> = crate::vocab::HUB_TOKEN_VARS
        .iter()
        .filter_map(|var| {
            let value = roles.iter().find_map(|r| hidden.get(*r, var))?;
            Some((*var, value.to_string()))
        })
        .collect();
    let runnable = source.runnable(tokens.iter().map(|(k, v)| (*k, v.as_str())));
    let model = runnable.model.clone();
    if !runnable.missing() {
        return Response::Done {
            message: format!("{model} is in the Hugging Face cache here"),
        };
    }
    let node = h.ctx.node.clone();
    let fetched = tokio::task::spawn_blocking(move || {
        let mut say = |line: String| tracing::info!("{line}");
        runnable.fetch_saying(
            &node,
            std::time::Duration::from_secs(10),
            &mut say,
            &mut |_| {},
        )
    })
    .await;
    match fetched {
        Ok(Ok(snapshot)) => Response::Done {
            message: format!("fetched {model} into {}", snapshot.display()),
        },
        Ok(Err(e)) => finished(if e.is_usage() { 2 } else { 1 }, e.to_string()),
        Err(e) => finished(1, format!("fetching {model}: {e}")),
    }
}

pub(crate) fn add(
    h: &Handlers,
    mut service: Service,
    settings: Option<Box<ChildSettings>>,
) -> Response {
    localize_program(h, &mut service);
    if let Err(e) = check_new(h, &service) {
        return e;
    }
    let name = service.name.clone();
    let ctx = &h.ctx;
    let (tx, rx) = mpsc::unbounded_channel();
    // Checked and inserted under one lock, so two adds of one name cannot both win; the
    // log is opened only for the one that does.
    let mut same = false;
    let idx = ctx.change_members(|m| {
        if let Some(i) = m.index_of(&name) {
            // Already running with this very spec (an interrupted change taken up again
            // asks twice): nothing to do.
            same =
                m.plan.services[i] == service && m.plan.settings_of(&name) == settings.as_deref();
            return None;
        }
        let log = ServiceLog::open(
            &name,
            &h.state.log_path(&name),
            ctx.log_max_bytes,
            ctx.log_keep,
        );
        set_settings(m, &name, settings);
        Some(m.insert(service.clone(), Arc::new(log), tx))
    });
    let Some(idx) = idx else {
        if same {
            return Response::Done {
                message: format!("{name} already runs with this spec"),
            };
        }
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

pub(crate) async fn remove(h: &Handlers, name: &str, timeout_s: u64) -> Response {
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    // A run that had ended on its own before this remove (waiting to restart, or failed)
    // is said as one the stop found ended, whichever of the two saw the death first.
    let ended_before = matches!(
        h.ctx.table.state(idx),
        ServiceState::Restarting | ServiceState::Failed
    )
    .then(|| h.ctx.table.last_exit(idx))
    .flatten()
    .filter(|e| !e.starts_with("stopped"));
    let (done, stopped) = oneshot::channel();
    let timeout = Some(Duration::from_secs(timeout_s));
    if h.ctx.send(idx, Cmd::Stop { timeout, done }).is_ok() {
        let _ = stopped.await;
    }
    let last_exit = match ended_before {
        Some(e) if !e.starts_with(ENDED_BEFORE_STOP) => Some(format!("{ENDED_BEFORE_STOP}{e}")),
        Some(e) => Some(e),
        None => h.ctx.table.last_exit(idx),
    };
    h.ctx.change_members(|m| m.retire(idx));
    h.ctx.table.retire(idx);
    h.ctx.console.event(&format!("{name} removed"));
    if let Err(e) = save_plan(h) {
        return e;
    }
    let message = match last_exit
        .as_deref()
        .and_then(|e| e.strip_prefix(ENDED_BEFORE_STOP))
    {
        Some(how) => format!("{name} removed; it had {ENDED_BEFORE_STOP}{how}"),
        None => format!("{name} stopped and removed"),
    };
    Response::Done { message }
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

/// The settings of service `idx` as they are now, as a `Settings` answer.
fn settings_now(h: &Handlers, idx: usize) -> (u64, Response) {
    let members = h.ctx.members();
    let name = members.plan.services[idx].name.clone();
    let revision = h.ctx.table.revision(idx);
    let settings = members.plan.settings_of(&name).cloned().map(Box::new);
    (
        revision,
        Response::Settings {
            service: name,
            revision,
            settings,
        },
    )
}

/// Sends service `name`'s typed settings now and again whenever its revision moves, until
/// the client closes the connection (or writing to it fails).
async fn watch_settings(
    h: &Handlers,
    name: &str,
    read: &mut (impl AsyncBufRead + Unpin),
    write: &mut (impl AsyncWrite + Unpin),
) {
    let idx = match any_index(h, name) {
        Ok(i) => i,
        Err(e) => {
            answer(write, &e).await;
            return;
        }
    };
    let mut changed = h.ctx.table.subscribe();
    let mut sent = None;
    let mut scratch = Vec::new();
    loop {
        let (revision, response) = settings_now(h, idx);
        if sent != Some(revision) {
            if !answer(write, &response).await {
                return;
            }
            sent = Some(revision);
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return },
            // The client says nothing more; end of input (or anything it sends) ends this.
            _ = read_frame(read, LOCAL_FRAME_MAX, &mut scratch) => return,
        }
    }
}

pub(crate) fn replace(
    h: &Handlers,
    mut service: Service,
    settings: Option<Box<ChildSettings>>,
) -> Response {
    localize_program(h, &mut service);
    let idx = match any_index(h, &service.name) {
        Ok(i) => i,
        Err(e) => return e,
    };
    if let Err(e) = check_new(h, &service) {
        return e;
    }
    let name = service.name.clone();
    let row = service.clone();
    // The new spec and settings first, then the revision: whoever watches the settings
    // and sees the revision move reads the new ones.
    h.ctx.change_members(|m| {
        m.plan.services[idx] = service;
        set_settings(m, &name, settings);
    });
    let revision = h.ctx.table.describe(idx, &row);
    if let Err(e) = save_plan(h) {
        return e;
    }
    Response::Done {
        message: format!(
            "{name} has its new settings (revision {revision}): they take effect at its next start, or at once where it reads them while it runs"
        ),
    }
}
