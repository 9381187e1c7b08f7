//! The supervisor process: starts every local service task, serves the control socket,
//! shows start-up progress, and takes the cluster down on Ctrl-C, SIGTERM, SIGHUP or
//! `pdctl down`, leaving no process behind.

use crate::control::StatusReport;
use crate::control::auth::EngineKey;
use crate::control::client::Endpoint;
use crate::control::tls::PeerTls;
use crate::plan::Plan;
use crate::supervisor::SupervisorError;
use crate::supervisor::process::spawner::Spawner;
use crate::supervisor::process::watchdog::{self, Watchdog};
use crate::supervisor::run::console::{Console, ConsoleMode, colour_wanted};
use crate::supervisor::run::control_server::{self, DownRequest, Handlers};
use crate::supervisor::run::control_tcp;
use crate::supervisor::run::members::Members;
use crate::supervisor::run::ops_hook::Operations;
use crate::supervisor::run::peers::Peers;
use crate::supervisor::run::probe::Prober;
use crate::supervisor::run::progress::{self, Renderer, StartFailure, StartupEnd};
use crate::supervisor::run::remote::run_remote;
use crate::supervisor::run::service::{Cmd, FAILURE_LINES, ServiceCtx, run_local};
use crate::supervisor::run::stop::stop_waves;
use crate::supervisor::run::table::{Table, sample_usage};
use crate::supervisor::state_dir::logfile::ServiceLog;
use crate::supervisor::state_dir::state::{ClusterLock, RecordWriter, RunRecord, StateDir};
use futures_util::future::join_all;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// How this supervisor runs.
#[derive(Clone)]
pub struct RunOptions {
    /// The node whose services run here.
    pub node: String,
    /// `pdctl up` in the foreground (progress, status table, log stream) rather than
    /// the detached `pdctl supervise`.
    pub foreground: bool,
    pub log_max_bytes: u64,
    pub log_keep: u32,
    /// What a person sees when every local service is healthy in the foreground: the
    /// status table and whatever the caller adds to it (the CLI adds the proxy's figures).
    /// Given by the caller because the supervisor knows nothing of how it is shown.
    pub healthy_text: Option<HealthyText>,
    /// This node's side of the TLS control channel between the nodes' supervisors
    /// (clusters over several nodes): its certificate, the cluster's CA, and on the head
    /// what it needs to let nodes join.
    pub channel: Option<Arc<PeerTls>>,
    /// The key every engine requires and the proxy sends, given to the services whose
    /// plan names it (`Service::secret_env`).
    pub engine_key: Option<EngineKey>,
    /// The proxy's client key, when the cluster has one (kept in the state dir).
    pub client_key: Option<crate::control::auth::ClientKey>,
    /// Changes to the whole cluster (`scale`, `apply`, drained restarts, a cluster-wide
    /// `down`), carried out in this process when this supervisor is the head's.
    pub operations: Option<Arc<dyn Operations>>,
}

/// Turns the status report into the text shown once every local service is healthy.
pub type HealthyText = fn(StatusReport) -> Pin<Box<dyn Future<Output = String> + Send>>;

/// Why the supervisor is taking the cluster down.
enum Trigger {
    Signal(&'static str),
    Down(DownRequest),
    StartFailed,
}

/// SIGINT, SIGTERM and SIGHUP as one stream.
struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

/// The console a run writes to: progress, table and log stream in the foreground, event
/// lines detached.
fn start_console(plan: &Plan, foreground: bool) -> Console {
    let names: Vec<String> = plan.services.iter().map(|s| s.name.clone()).collect();
    let mode = if foreground {
        ConsoleMode::Foreground {
            colour: colour_wanted(),
        }
    } else {
        ConsoleMode::Detached
    };
    Console::start(mode, names)
}

/// What every service task shares (the members, their logs, the table, the spawner...),
/// and the command channel of each service, in plan order.
fn service_ctx(
    plan: &Plan,
    state: &StateDir,
    opts: &RunOptions,
    spawner: Spawner,
    record: Arc<RecordWriter>,
    console: Console,
) -> (Arc<ServiceCtx>, Vec<mpsc::UnboundedReceiver<Cmd>>) {
    let logs = service_logs(plan, state, opts);
    let (txs, rxs): (Vec<_>, Vec<_>) = plan
        .services
        .iter()
        .map(|_| mpsc::unbounded_channel::<Cmd>())
        .unzip();
    let members = Members::new(plan.clone(), logs, txs);
    let ctx = Arc::new(ServiceCtx {
        members: std::sync::RwLock::new(Arc::new(members)),
        node: opts.node.clone(),
        table: Arc::new(Table::new(plan, &opts.node)),
        spawner,
        prober: Prober::new(plan.tcp, plan.health),
        record,
        console,
        cwd: state.dir.clone(),
        log_max_bytes: opts.log_max_bytes,
        log_keep: opts.log_keep,
        engine_key: opts.engine_key.clone(),
        client_key: opts.client_key.clone(),
    });
    (ctx, rxs)
}

/// Starts one task per service: a local one runs and watches its process, a remote one
/// follows what its node's supervisor reports (until `remote_stopped`). Says so on the
/// console, and returns the local tasks, which the stop waits for.
fn start_services(
    ctx: &Arc<ServiceCtx>,
    plan: &Plan,
    rxs: Vec<mpsc::UnboundedReceiver<Cmd>>,
    remote_stopped: watch::Receiver<bool>,
    console: &Console,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        if plan.services[i].node == ctx.node {
            tasks.push(tokio::spawn(run_local(ctx.clone(), i, rx)));
        } else {
            tokio::spawn(run_remote(ctx.clone(), i, remote_stopped.clone()));
        }
    }
    let local = plan.local_services(&ctx.node).count();
    console.event(&format!(
        "supervising cluster {} on node {}: {local} local and {} remote service(s), pid {}",
        plan.cluster,
        ctx.node,
        plan.services.len() - local,
        std::process::id()
    ));
    tasks
}

/// Serves the control socket and, on a cluster of several nodes, the TCP control channel
/// (their tasks are returned, to end with the run). A change cut short when this
/// supervisor last stopped is taken up (and other nodes reconciled) before the socket
/// takes any request: meanwhile a new change is refused and `status` shows the recovery.
async fn serve_control(
    plan: &Plan,
    opts: &RunOptions,
    ctx: &Arc<ServiceCtx>,
    state: &StateDir,
    listener: tokio::net::UnixListener,
    downs: mpsc::UnboundedSender<DownRequest>,
) -> Result<(JoinHandle<()>, Option<JoinHandle<()>>), SupervisorError> {
    let channel = match (plan.control_port, &opts.channel) {
        (Some(port), Some(tls)) => {
            Some(control_channel(plan, &opts.node, port, tls, &ctx.table).await?)
        }
        (Some(_), None) => {
            return Err(SupervisorError::NoSecret {
                node: opts.node.clone(),
            });
        }
        (None, _) => None,
    };
    let handlers = Handlers {
        ctx: ctx.clone(),
        state: StateDir::new(&state.dir),
        downs,
        operations: opts.operations.clone(),
        peers: channel.as_ref().map(|(_, peers)| peers.clone()),
    };
    if let Some(ops) = &opts.operations {
        ops.recover();
    }
    let server = tokio::spawn(control_server::serve(listener, handlers.clone()));
    let tcp_server = channel.map(|(listener, _)| {
        tokio::spawn(control_tcp::serve(
            listener,
            handlers,
            opts.channel.clone().expect("checked above"),
        ))
    });
    Ok((server, tcp_server))
}

/// Each service's log: a file for the services of this node, memory only for the others
/// (their lines come from their own node's supervisor).
fn service_logs(plan: &Plan, state: &StateDir, opts: &RunOptions) -> Vec<Arc<ServiceLog>> {
    plan.services
        .iter()
        .map(|s| {
            Arc::new(if s.node == opts.node {
                ServiceLog::open(
                    &s.name,
                    &state.log_path(&s.name),
                    opts.log_max_bytes,
                    opts.log_keep,
                )
            } else {
                ServiceLog::memory_only(&s.name)
            })
        })
        .collect()
}

/// Watches the start, says how it went, then waits for what ends the run: a signal, a
/// `down` request, or (in the foreground) a start that failed.
async fn serve_until_down(
    ctx: &ServiceCtx,
    opts: &RunOptions,
    signals: &mut Signals,
    downs: &mut mpsc::UnboundedReceiver<DownRequest>,
) -> Trigger {
    let started = Instant::now();
    tokio::select! {
        end = watch_startup(ctx, opts.foreground) => match end {
            StartupEnd::AllHealthy => {
                announce_healthy(ctx, opts.foreground, opts.healthy_text, started).await;
                wait_for_down(signals, downs).await
            }
            StartupEnd::Failed(failed) => {
                report_start_failure(ctx, &failed, opts.foreground);
                if opts.foreground {
                    Trigger::StartFailed
                } else {
                    // Detached: stay up so `status` and `logs` can show what happened.
                    wait_for_down(signals, downs).await
                }
            }
        },
        sig = signals.recv() => Trigger::Signal(sig),
        req = downs.recv() => req.map(Trigger::Down).unwrap_or(Trigger::Signal("EOF")),
    }
}

/// Says that the cluster's services here stopped (a block in the foreground, an event
/// line detached), and returns the words, which each `down` request is answered with.
fn say_stopped(
    ctx: &ServiceCtx,
    state: &StateDir,
    console: &Console,
    foreground: bool,
    since: Instant,
) -> String {
    let plan = ctx.members().live_plan();
    let local = plan.local_services(&ctx.node).count();
    let message = format!(
        "stopped {local} service(s) of cluster {} in {:.1} s; logs kept in {}",
        plan.cluster,
        since.elapsed().as_secs_f64(),
        state.logs_dir().display()
    );
    if foreground {
        console.block(&message);
    } else {
        console.event(&message);
    }
    console.flush();
    message
}

/// Runs `plan`'s services for `opts.node` until the cluster is taken down; returns the
/// process exit code (0 after a requested down, 1 when a foreground start failed).
pub async fn run(
    plan: Plan,
    state: StateDir,
    lock: ClusterLock,
    opts: RunOptions,
) -> Result<u8, SupervisorError> {
    let node = opts.node.clone();
    let plan = Arc::new(plan);
    // Bound first: if that fails nothing was started and no record needs cleaning up.
    let socket = state.socket_path();
    let listener = control_server::bind(&socket)
        .map_err(|e| SupervisorError::io("listen on the control socket", &socket, e))?;
    let record = Arc::new(RecordWriter::create(
        &state,
        RunRecord::new_for_this_process(&plan.cluster, &node),
    )?);
    let watchdog = Watchdog::spawn(&record.run_id())
        .map_err(|e| tracing::warn!("no watchdog (grandchildren may outlive a killed pdctl): {e}"))
        .ok();
    let spawner = Spawner::start(tokio::runtime::Handle::current())
        .map_err(|e| SupervisorError::io("start the spawning thread", &state.dir, e))?;
    let console = start_console(&plan, opts.foreground);
    let (ctx, rxs) = service_ctx(
        &plan,
        &state,
        &opts,
        spawner,
        record.clone(),
        console.clone(),
    );
    let usage = tokio::spawn(sample_usage(ctx.table.clone()));
    let (down_tx, mut downs) = mpsc::unbounded_channel();
    raise_open_file_limit();
    let (server, tcp_server) = serve_control(&plan, &opts, &ctx, &state, listener, down_tx).await?;
    let mut signals =
        Signals::new().map_err(|e| SupervisorError::io("handle signals", &state.dir, e))?;
    let (stop_remote, remote_stopped) = watch::channel(false);
    let tasks = start_services(&ctx, &plan, rxs, remote_stopped, &console);

    let trigger = serve_until_down(&ctx, &opts, &mut signals, &mut downs).await;

    let start_failed = matches!(trigger, Trigger::StartFailed);
    let (timeout, mut requests) = match trigger {
        Trigger::Down(req) => (Some(req.timeout), vec![req]),
        Trigger::Signal(sig) => {
            console.event(&format!("{sig} received: stopping the cluster"));
            (None, vec![])
        }
        Trigger::StartFailed => (None, vec![]),
    };
    let t0 = Instant::now();
    stop_everything(&ctx, timeout, &mut signals, &record).await;
    let _ = stop_remote.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    server.abort();
    if let Some(t) = tcp_server {
        t.abort();
    }
    usage.abort();
    state.remove_runtime();
    // Taken down on purpose: a change cut short by that has nothing left to finish.
    let _ = std::fs::remove_file(state.journal_path());
    drop(watchdog);
    let message = say_stopped(&ctx, &state, &console, opts.foreground, t0);
    while let Ok(req) = downs.try_recv() {
        requests.push(req);
    }
    reply_all(requests, &message).await;
    drop(lock);
    Ok(u8::from(start_failed))
}

/// The TCP control channel of this node (listening at its address) and the other nodes'
/// supervisors, polled for their services' state.
async fn control_channel(
    plan: &Plan,
    node: &str,
    port: u16,
    tls: &Arc<PeerTls>,
    table: &Arc<Table>,
) -> Result<(tokio::net::TcpListener, Arc<Peers>), SupervisorError> {
    let address = plan
        .nodes
        .get(node)
        .cloned()
        .unwrap_or_else(|| "127.0.0.1".into());
    let at = format!("{address}:{port}");
    let listener = tokio::net::TcpListener::bind(&at).await.map_err(|e| {
        SupervisorError::io(
            "listen on the control channel at",
            std::path::Path::new(&at),
            e,
        )
    })?;
    let peers = plan
        .nodes
        .iter()
        .filter(|(n, _)| n.as_str() != node)
        .map(|(n, addr)| {
            let endpoint = Endpoint::peer(format!("{addr}:{port}"), n, tls);
            (n.clone(), addr.clone(), endpoint)
        })
        .collect();
    Ok((
        listener,
        Peers::start(peers, plan.health.cut_off_after(), table.clone()),
    ))
}

/// Raises this process's open-file limit to its hard limit: every connection, log and
/// child pipe takes a descriptor, and the default soft limit (1024) is what a burst of
/// connections to the control channel would exhaust first.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("cannot raise the open-file limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the open-file limit: {e}"),
    }
}

/// Until every local service is healthy or one failed; draws progress in the foreground.
async fn watch_startup(ctx: &ServiceCtx, foreground: bool) -> StartupEnd {
    use std::io::IsTerminal;
    let mut changes = ctx.table.subscribe();
    let mut renderer = Renderer::new(std::io::stdout().is_terminal());
    loop {
        let members = ctx.members();
        let last_line = |name: &str| {
            let i = members.index_of(name)?;
            members.logs[i].last_line()
        };
        let report = ctx.table.report();
        if foreground {
            let rows = progress::rows(&report, &members.plan, &last_line);
            renderer.draw(&mut std::io::stdout().lock(), &rows);
        }
        if let Some(end) = progress::startup_verdict(&report) {
            return end;
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

async fn announce_healthy(
    ctx: &ServiceCtx,
    foreground: bool,
    healthy_text: Option<HealthyText>,
    started: Instant,
) {
    let secs = started.elapsed().as_secs_f64();
    if foreground {
        let mut text = match healthy_text {
            Some(render) => render(ctx.table.report()).await,
            None => String::new(),
        };
        text.push_str(&format!(
            "all local services healthy in {secs:.1} s; streaming their logs (Ctrl-C stops the cluster)"
        ));
        ctx.console.block(&text);
        ctx.console.start_streaming();
    } else {
        ctx.console
            .event(&format!("all local services healthy in {secs:.1} s"));
    }
}

fn report_start_failure(ctx: &ServiceCtx, failed: &[StartFailure], foreground: bool) {
    for f in failed {
        let members = ctx.members();
        let lines = members
            .index_of(&f.name)
            .map(|i| members.logs[i].last_lines(FAILURE_LINES))
            .unwrap_or_default();
        let text = progress::failure_text(&f.name, &f.why, f.error.as_deref(), &lines);
        if foreground {
            ctx.console.block(&text);
        } else {
            ctx.console.event(&text);
        }
    }
    if foreground {
        ctx.console
            .block("stopping the cluster because it could not start");
    }
}

async fn wait_for_down(
    signals: &mut Signals,
    downs: &mut mpsc::UnboundedReceiver<DownRequest>,
) -> Trigger {
    tokio::select! {
        sig = signals.recv() => Trigger::Signal(sig),
        req = downs.recv() => req.map(Trigger::Down).unwrap_or(Trigger::Signal("EOF")),
    }
}

/// Stops local services wave by wave (dependants first). A second signal while stopping
/// kills every process of the run at once.
async fn stop_everything(
    ctx: &ServiceCtx,
    timeout: Option<Duration>,
    signals: &mut Signals,
    record: &RecordWriter,
) {
    let waves = stop_waves(&ctx.members().plan, &ctx.node);
    let work = async {
        for wave in waves {
            join_all(wave.into_iter().map(|i| async move {
                let (done, stopped) = oneshot::channel();
                if ctx.send(i, Cmd::Stop { timeout, done }).is_ok() {
                    let _ = stopped.await;
                }
            }))
            .await;
        }
    };
    tokio::pin!(work);
    tokio::select! {
        _ = &mut work => return,
        sig = signals.recv() => {
            ctx.console.event(&format!("{sig} again: killing every process now"));
            let run_id = record.run_id();
            // A detached supervisor leads its session: its members are the run's too.
            let me = nix::unistd::getpid();
            let session = (nix::unistd::getsid(None).ok() == Some(me)).then_some(me.as_raw());
            tokio::task::spawn_blocking(move || watchdog::stop_marked(&run_id, session, Duration::ZERO));
        }
    }
    work.await;
}

async fn reply_all(requests: Vec<DownRequest>, message: &str) {
    let mut acks = Vec::new();
    for req in requests {
        let (ack, written) = oneshot::channel();
        if req.reply.send((message.to_string(), ack)).is_ok() {
            acks.push(written);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), join_all(acks)).await;
}
