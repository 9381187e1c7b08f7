//! One task per local service: wait for its dependencies, start it, wait until it is
//! ready, watch it, restart it by its policy, stop it when asked.
//!
//! The first start fails fast: a process that exits (or never gets ready) before it was
//! ever healthy is `failed` at once with its last log lines, since a bad flag or a model
//! that does not fit will not fix itself by restarting. After it was healthy once, exits
//! and failed liveness probes go through the restart policy. An exit pdctl did not ask
//! for is a failure whatever its status: these are servers, and one that exits 0 (a vLLM
//! API server whose engine core died does) is as down as one that crashed.

pub(crate) mod deps;
pub(crate) mod run_watch;

use crate::control::auth::EngineKey;
use crate::control::{ENDED_BEFORE_STOP, ServiceState};
use crate::supervisor::process::spawner::{SpawnSpec, Spawned, Spawner};
use crate::supervisor::run::console::Console;
use crate::supervisor::run::members::Members;
use crate::supervisor::run::policy::{RestartTracker, Verdict};
use crate::supervisor::run::probe::Prober;
use crate::supervisor::run::pump::{PumpTargets, pump};
use crate::supervisor::run::service::deps::{DepsOutcome, wait_for_dependencies};
use crate::supervisor::run::service::run_watch::RunEnd;
use crate::supervisor::run::stop::{clear_group, describe_exit, parse_signal, stop_run};
use crate::supervisor::run::table::Table;
use crate::supervisor::state_dir::logfile::{ServiceLog, log_message};
use crate::supervisor::state_dir::state::RecordWriter;
use crate::vocab::{Probe, Service};
use nix::sys::signal::Signal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Why a run of a service could not even start; its text is what `status` and the
/// failure report show.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "its plan sets {vars} to the cluster's engine key, but this supervisor was given none (start it with `pdctl up`)"
    )]
    NoEngineKey { vars: String },
    #[error(transparent)]
    HiddenEnv(#[from] crate::control::hidden_env::HiddenEnvError),
    #[error(
        "its plan sets {var} from the topology, but {} holds no value of it for {role} engines: run `pdctl up` (or `pdctl apply`) with the topology that sets it",
        file.display()
    )]
    NoHiddenValue {
        var: String,
        role: String,
        file: PathBuf,
    },
    #[error("could not start `{program}`: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
}

/// What a service task can be told to do (kept beside the channels [`Members`] holds).
pub use crate::supervisor::run::members::Cmd;

/// Everything the service tasks share.
#[derive(Debug)]
pub struct ServiceCtx {
    /// The services now (changed by `scale` and `apply`); read through [`ServiceCtx::members`].
    pub members: std::sync::RwLock<Arc<Members>>,
    pub node: String,
    pub table: Arc<Table>,
    pub spawner: Spawner,
    pub prober: Prober,
    pub record: Arc<RecordWriter>,
    pub console: Console,
    /// Working directory of every service: the cluster's state dir.
    pub cwd: PathBuf,
    /// Log rotation of services added while running: size and files kept.
    pub log_max_bytes: u64,
    pub log_keep: u32,
    /// The cluster's engine key, set in each service's `secret_env` at spawn (and only
    /// there: it is never planned, logged nor reported).
    pub engine_key: Option<EngineKey>,
    /// The proxy's client key, when the cluster has one: set (as `PDCTL_API_KEY`) for the
    /// service that takes the proxy's engine key, and never inherited by any other.
    pub client_key: Option<crate::control::auth::ClientKey>,
}

/// Variables that carry the cluster's secrets: no service inherits them from the
/// supervisor; a service gets the engine key only where its plan names the variable.
const SECRET_VARS: &[&str] = &[
    crate::control::auth::SECRET_ENV,
    crate::control::auth::JOIN_TOKEN_ENV,
    crate::vocab::PROXY_ENGINE_KEY_VAR,
    crate::vocab::ENGINE_API_KEY_VAR,
    crate::control::auth::CLIENT_KEY_ENV,
];

impl ServiceCtx {
    /// The services as they are now.
    pub fn members(&self) -> Arc<Members> {
        self.members
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Changes the services (a copy is changed, then swapped in); returns `f`'s answer.
    pub fn change_members<T>(&self, f: impl FnOnce(&mut Members) -> T) -> T {
        let mut guard = self.members.write().unwrap_or_else(|p| p.into_inner());
        let mut next = Members::clone(&guard);
        let out = f(&mut next);
        *guard = Arc::new(next);
        out
    }

    /// How service `idx` is started now.
    pub fn service(&self, idx: usize) -> Service {
        self.members().plan.services[idx].clone()
    }

    /// Where service `idx`'s output goes.
    pub fn log(&self, idx: usize) -> Arc<ServiceLog> {
        self.members().logs[idx].clone()
    }

    /// Tells service `idx`'s task to do `cmd`; false when the task is gone.
    pub fn send(&self, idx: usize, cmd: Cmd) -> Result<(), Cmd> {
        self.members().commands[idx].send(cmd).map_err(|e| e.0)
    }
}

/// Lines of output quoted when a service fails.
pub const FAILURE_LINES: usize = 12;

/// What the task does next.
enum Next {
    WaitDeps,
    Start,
    Backoff(Duration),
    Idle,
    Exit,
}

struct Task {
    ctx: Arc<ServiceCtx>,
    idx: usize,
    /// How it is started: read again before each start, so a `Replace` takes effect.
    svc: Service,
    log: Arc<ServiceLog>,
    rx: mpsc::UnboundedReceiver<Cmd>,
    tracker: RestartTracker,
    ever_healthy: bool,
    runs: u32,
}

/// Runs service `idx` until it is told to stop.
pub async fn run_local(ctx: Arc<ServiceCtx>, idx: usize, rx: mpsc::UnboundedReceiver<Cmd>) {
    let svc = ctx.service(idx);
    let log = ctx.log(idx);
    let policy = svc.restart.clone();
    let mut task = Task {
        ctx,
        idx,
        svc,
        log,
        rx,
        tracker: RestartTracker::new(policy),
        ever_healthy: false,
        runs: 0,
    };
    let mut next = Next::WaitDeps;
    loop {
        next = match next {
            Next::WaitDeps => task.wait_deps().await,
            Next::Start => task.start_and_watch().await,
            Next::Backoff(d) => task.backoff(d).await,
            Next::Idle => task.idle().await,
            Next::Exit => return,
        };
    }
}

impl Task {
    fn svc(&self) -> &Service {
        &self.svc
    }
    fn log(&self) -> &Arc<ServiceLog> {
        &self.log
    }
    fn signal(&self) -> Signal {
        parse_signal(&self.svc().shutdown.signal).unwrap_or(Signal::SIGTERM)
    }
    fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs(self.svc().shutdown.timeout_s)
    }

    /// Where this service learns when it will be SIGKILLed (see
    /// [`crate::control::STOP_DEADLINE_ENV`]).
    fn stop_deadline_file(&self) -> std::path::PathBuf {
        self.ctx
            .cwd
            .join(crate::control::STOP_DEADLINE_DIR)
            .join(&self.svc().name)
    }

    /// Writes when the stop about to be asked for turns into SIGKILL.
    fn announce_stop(&self, within: Duration) {
        let path = self.stop_deadline_file();
        let at = std::time::SystemTime::now() + within;
        let ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = std::fs::write(&path, ms.to_string()) {
            tracing::warn!("cannot write {}: {e}", path.display());
        }
    }

    async fn wait_deps(&mut self) -> Next {
        self.ctx.table.set_state(self.idx, ServiceState::Pending);
        match wait_for_dependencies(&self.ctx, self.idx, &mut self.rx).await {
            DepsOutcome::Ready => Next::Start,
            DepsOutcome::Failed(why) => self.fail(why, None),
            DepsOutcome::Stop(done) => {
                self.ctx.table.set_state(self.idx, ServiceState::Stopped);
                let _ = done.send(());
                Next::Exit
            }
        }
    }

    /// Marks the service failed and tells the user why, with its last log lines and the
    /// run's last error line (`error`), if it printed one.
    fn fail(&mut self, why: String, error: Option<String>) -> Next {
        let name = self.svc().name.clone();
        let lines = self.log().last_lines(FAILURE_LINES);
        self.log().note(&format!("failed: {why}"));
        let text =
            crate::supervisor::run::progress::failure_text(&name, &why, error.as_deref(), &lines);
        self.ctx
            .table
            .run_ended(self.idx, ServiceState::Failed, Some(why), error);
        self.ctx.console.event(&text);
        Next::Idle
    }

    fn write_files(&self) -> Result<(), StartError> {
        for f in &self.svc().files {
            if let Some(parent) = f.path.parent() {
                std::fs::create_dir_all(parent).map_err(|source| StartError::CreateDir {
                    path: parent.to_path_buf(),
                    source,
                })?;
            }
            std::fs::write(&f.path, &f.content).map_err(|source| StartError::WriteFile {
                path: f.path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    async fn spawn(&mut self) -> Result<Spawned, StartError> {
        self.svc = self.ctx.service(self.idx);
        self.write_files()?;
        let mut env = self.svc().env.clone();
        env.insert(
            crate::supervisor::process::procfs::RUN_MARKER_ENV.to_string(),
            self.ctx.record.run_id(),
        );
        let deadline_file = self.stop_deadline_file();
        let _ = std::fs::remove_file(&deadline_file);
        env.insert(
            crate::control::STOP_DEADLINE_ENV.to_string(),
            deadline_file.display().to_string(),
        );
        if !self.svc().secret_env.is_empty() {
            let Some(key) = &self.ctx.engine_key else {
                return Err(StartError::NoEngineKey {
                    vars: self.svc().secret_env.join(", "),
                });
            };
            for var in &self.svc().secret_env {
                env.insert(var.clone(), key.reveal().to_string());
            }
        }
        if !self.svc().hidden_env.is_empty() {
            // Read at each start: `apply` may have changed a value since.
            let kept = crate::control::hidden_env::kept(&self.ctx.cwd)?;
            for var in &self.svc().hidden_env {
                let Some(value) = kept.get(self.svc().role, var) else {
                    return Err(StartError::NoHiddenValue {
                        var: var.clone(),
                        role: self.svc().role.as_str().to_string(),
                        file: self
                            .ctx
                            .cwd
                            .join(crate::control::hidden_env::HIDDEN_ENV_FILE),
                    });
                };
                env.insert(var.clone(), value.to_string());
            }
        }
        let proxy = self
            .svc()
            .secret_env
            .iter()
            .any(|v| v == crate::vocab::PROXY_ENGINE_KEY_VAR);
        if let (true, Some(key)) = (proxy, &self.ctx.client_key) {
            env.insert(
                crate::control::auth::CLIENT_KEY_ENV.to_string(),
                key.reveal().to_string(),
            );
        }
        let spec = SpawnSpec {
            argv: self.svc().argv.clone(),
            env,
            env_remove: SECRET_VARS.iter().map(|v| v.to_string()).collect(),
            cwd: self.ctx.cwd.clone(),
        };
        self.ctx
            .spawner
            .spawn(spec)
            .await
            .map_err(|source| StartError::Spawn {
                program: self.svc().argv.first().cloned().unwrap_or_default(),
                source,
            })
    }

    async fn start_and_watch(&mut self) -> Next {
        let spawned = match self.spawn().await {
            Ok(s) => s,
            Err(why) => return self.fail(why.to_string(), None),
        };
        let Spawned {
            mut child,
            pid,
            output,
        } = spawned;
        self.runs += 1;
        self.log().forget_errors();
        if self.runs > 1 {
            self.ctx.table.update(self.idx, |s| s.restarts += 1);
        }
        self.log().note(&format!("start #{}: pid {pid}", self.runs));
        self.ctx.record.child_started(&self.svc().name, pid);
        self.ctx
            .table
            .run_started(self.idx, Some(pid as u32), ServiceState::Starting);
        let seen = Arc::new(AtomicBool::new(false));
        let watch_for = match &self.svc().probe {
            Probe::LogLine { contains } => Some((contains.clone(), seen.clone())),
            _ => None,
        };
        let activity = Arc::new(tokio::sync::Notify::new());
        let pump_task = tokio::spawn(pump(
            output,
            PumpTargets {
                log: self.log().clone(),
                console: self.ctx.console.clone(),
                idx: self.idx,
                name: self.svc().name.clone(),
                watch_for,
                activity: activity.clone(),
            },
        ));

        let started = Instant::now();
        let mut end = self.wait_ready(&mut child, &seen, &activity, started).await;
        let mut healthy_since = None;
        if end.is_none() {
            self.ever_healthy = true;
            healthy_since = Some(Instant::now());
            let took = format!("ready after {:.1} s", started.elapsed().as_secs_f64());
            self.log().note(&took);
            self.ctx
                .console
                .event(&format!("{} {took}", self.svc().name));
            self.ctx.table.set_state(self.idx, ServiceState::Healthy);
            end = Some(self.watch_liveness(&mut child, &seen).await);
        }
        let end = end.expect("a run always ends");
        let healthy_for = healthy_since.map(|t| t.elapsed()).unwrap_or_default();
        self.finish_run(child, pid, pump_task, end, healthy_for)
            .await
    }

    /// Whatever ended the run, leaves no process of it behind: a requested stop or a
    /// restart stops the run (announced, within its grace), an exit clears what is left of
    /// its group. Returns why the run ended, as its log says.
    async fn end_processes(
        &mut self,
        child: &mut tokio::process::Child,
        pgid: i32,
        end: &RunEnd,
    ) -> String {
        let signal = self.signal();
        let grace = self.shutdown_timeout();
        match end {
            RunEnd::Exited(why) => {
                clear_group(pgid, signal, grace).await;
                why.clone()
            }
            RunEnd::Stop(t, _) => {
                // Ended on its own before the stop reached it (killed, crashed): say so,
                // or a stop would take the credit for a death (a drain that "drained").
                if let Ok(Some(st)) = child.try_wait() {
                    clear_group(pgid, signal, grace).await;
                    return format!("{ENDED_BEFORE_STOP}{}", describe_exit(&st));
                }
                let t = t.unwrap_or(grace);
                self.announce_stop(t);
                self.ctx.table.set_state(self.idx, ServiceState::Stopping);
                let st = stop_run(child, pgid, signal, t).await;
                st.map(|s| format!("stopped: {}", describe_exit(&s)))
                    .unwrap_or_else(|| "stopped".into())
            }
            RunEnd::LivenessFailed(why) | RunEnd::StartTimeout(why) | RunEnd::Restart(why, _) => {
                self.announce_stop(grace);
                stop_run(child, pgid, signal, grace).await;
                why.clone()
            }
        }
    }

    /// Ends a run: its processes gone, its log and record told, then what comes next by
    /// how it ended (exit the task, start again, or the restart policy's verdict).
    async fn finish_run(
        &mut self,
        mut child: tokio::process::Child,
        pgid: i32,
        pump_task: tokio::task::JoinHandle<()>,
        end: RunEnd,
        healthy_for: Duration,
    ) -> Next {
        let why = self.end_processes(&mut child, pgid, &end).await;
        let _ = tokio::time::timeout(Duration::from_secs(1), pump_task).await;
        // The last error line the service printed, when it ended on its own (after a
        // requested stop, shutdown chatter would be blamed for nothing).
        let error = match &end {
            RunEnd::Exited(_) | RunEnd::LivenessFailed(_) | RunEnd::StartTimeout(_) => {
                self.log().last_error()
            }
            RunEnd::Stop(..) | RunEnd::Restart(..) => None,
        };
        self.ctx.record.child_gone(&self.svc().name);
        self.log().note(&format!("run #{} ended: {why}", self.runs));
        let name = self.svc().name.clone();
        match end {
            RunEnd::Stop(_, done) => {
                self.ctx
                    .table
                    .run_ended(self.idx, ServiceState::Stopped, Some(why), None);
                let _ = done.send(());
                Next::Exit
            }
            RunEnd::Restart(reason, cascade) => {
                self.ctx.table.run_ended(
                    self.idx,
                    ServiceState::Restarting,
                    Some(reason.clone()),
                    None,
                );
                self.ctx
                    .console
                    .event(&format!("restarting {name}: {reason}"));
                if cascade {
                    // Asked for by a person: a fresh start, crash history forgotten. A
                    // companion's restart (no cascade) keeps it, or two coupled services
                    // that crash in turn would wipe each other's count forever.
                    self.restart_companions();
                    self.tracker.reset();
                }
                Next::Start
            }
            RunEnd::StartTimeout(probe_why) if !self.ever_healthy => self.fail(
                format!(
                    "not ready after {} s (last probe: {probe_why})",
                    self.svc().startup_timeout_s
                ),
                error,
            ),
            RunEnd::Exited(why) if !self.ever_healthy => {
                self.fail(format!("{why} while starting"), error)
            }
            RunEnd::Exited(_) | RunEnd::LivenessFailed(_) | RunEnd::StartTimeout(_) => {
                self.after_crash(why, error, healthy_for)
            }
        }
    }

    /// Applies the restart policy after an end nobody asked for (an exit with any status,
    /// status 0 included, or failed liveness probes); `error` is the run's last error line.
    fn after_crash(&mut self, why: String, error: Option<String>, healthy_for: Duration) -> Next {
        let name = self.svc().name.clone();
        match self.tracker.after_exit(Instant::now(), healthy_for) {
            Verdict::Restart { delay } => {
                let last_error = error
                    .as_deref()
                    .map(|e| format!(" (last error: {})", log_message(e)))
                    .unwrap_or_default();
                self.ctx.console.event(&format!(
                    "{name}: {why}{last_error}; restarting in {:.1} s",
                    delay.as_secs_f64()
                ));
                self.ctx
                    .table
                    .run_ended(self.idx, ServiceState::Restarting, Some(why), error);
                self.restart_companions();
                Next::Backoff(delay)
            }
            Verdict::Fail { reason } => self.fail(format!("{why}; {reason}"), error),
        }
    }

    /// Restarts this service's `restart_with` companions (they do not cascade further).
    fn restart_companions(&self) {
        let me = self.svc().name.clone();
        for other in &self.svc().restart_with {
            if let Some(i) = self.ctx.members().index_of(other) {
                let _ = self.ctx.send(
                    i,
                    Cmd::Restart {
                        reason: format!("restarted together with {me}"),
                        cascade: false,
                    },
                );
            }
        }
    }

    /// Waits out a restart delay; a stop or restart request cuts it short.
    async fn backoff(&mut self, delay: Duration) -> Next {
        tokio::select! {
            _ = tokio::time::sleep(delay) => Next::Start,
            cmd = self.rx.recv() => match cmd {
                Some(Cmd::Restart { .. }) => Next::Start,
                Some(Cmd::Stop { done, .. }) => {
                    self.ctx.table.set_state(self.idx, ServiceState::Stopped);
                    let _ = done.send(());
                    Next::Exit
                }
                None => Next::Exit,
            }
        }
    }

    /// Failed or stopped: waits to be stopped for good or restarted by a person. A
    /// companion's restart does not revive it: a service that failed its crash-loop limit
    /// would otherwise be started again each time its partner crashed.
    async fn idle(&mut self) -> Next {
        loop {
            match self.rx.recv().await {
                Some(Cmd::Restart { cascade: false, .. }) => continue,
                Some(Cmd::Restart { .. }) => {
                    self.tracker.reset();
                    self.ever_healthy = false;
                    return Next::WaitDeps;
                }
                Some(Cmd::Stop { done, .. }) => {
                    let _ = done.send(());
                    return Next::Exit;
                }
                None => return Next::Exit,
            }
        }
    }
}
