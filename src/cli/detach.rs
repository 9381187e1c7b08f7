//! `pdctl up -d`: hands the checked plan and the cluster lock to a detached
//! `pdctl supervise`, then shows its start-up progress over the control socket and
//! returns once every local service is healthy (exit 0) or one failed (exit 1).

use super::logs_cmd::history;
use super::view::status_table;
use crate::control::client;
use crate::plan::Plan;
use crate::supervisor::{
    self, ClusterLock, FAILURE_LINES, NOTE_PREFIX, Renderer, StartupEnd, StateDir, strip_ansi,
};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long `up -d` waits for a supervisor that does not answer before giving up.
const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Log settings passed on to the detached supervisor.
#[derive(Debug, Clone, Copy)]
pub struct LogSettings {
    pub max_bytes: u64,
    pub keep: u32,
}

/// Starts `pdctl supervise` in a new session (no terminal signals reach it), with the
/// lock passed as an inherited descriptor so no other `up` can slip in between, and
/// its output appended to `logs/supervisor.log`.
pub fn spawn_supervisor(
    state: &StateDir,
    node: &str,
    lock: ClusterLock,
    logs: LogSettings,
) -> anyhow::Result<Child> {
    use anyhow::Context;
    use std::os::unix::process::CommandExt;
    let log_path = state.supervisor_log_path();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding the pdctl binary")?;
    let fd = lock.hand_off()?;
    let mut cmd = Command::new(exe);
    cmd.arg("supervise")
        .arg("--cluster-dir")
        .arg(&state.dir)
        .args(["--node", node, "--lock-fd", &fd.to_string()])
        .args(["--log-max-bytes", &logs.max_bytes.to_string()])
        .args(["--log-keep", &logs.keep.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setsid()?;
            Ok(())
        });
    }
    cmd.spawn().context("starting the detached supervisor")
}

/// Polls the new supervisor until the start is decided; prints progress, then the
/// status table or what failed. `other_failed`: why a node started over SSH failed, if
/// one did (the start is then decided too). Returns the exit code.
pub async fn wait_for_start(
    child: &mut Child,
    state: &StateDir,
    plan: &Plan,
    other_failed: &dyn Fn() -> Option<String>,
) -> u8 {
    use std::io::IsTerminal;
    let socket = state.socket_path();
    let mut renderer = Renderer::new(std::io::stdout().is_terminal());
    let last_line = |name: &str| last_line(&state.log_path(name));
    let mut last_answer = std::time::Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let tail = history(&state.supervisor_log_path(), Some(15)).join("\n    ");
            eprintln!(
                "error: the supervisor exited ({status}) before the cluster was up; its log ({}):\n    {tail}",
                state.supervisor_log_path().display()
            );
            return 1;
        }
        if let Some(why) = other_failed() {
            eprintln!(
                "error: {why}\nthe supervisor here (pid {}) keeps running so you can look: `pdctl status`; `pdctl down` stops it",
                child.id()
            );
            return 1;
        }
        let answer = client::status(&socket, Duration::from_secs(2)).await;
        if answer.is_err() && last_answer.elapsed() > SILENCE_LIMIT {
            eprintln!(
                "error: the supervisor (pid {}) has not answered on {} for {} s; see {}",
                child.id(),
                socket.display(),
                SILENCE_LIMIT.as_secs(),
                state.supervisor_log_path().display()
            );
            return 1;
        }
        if let Ok(report) = answer {
            last_answer = std::time::Instant::now();
            let rows = supervisor::progress_rows(&report, plan, &last_line);
            renderer.draw(&mut std::io::stdout().lock(), &rows);
            match supervisor::startup_verdict(&report) {
                Some(StartupEnd::AllHealthy) => {
                    let mut out = std::io::stdout().lock();
                    let _ = write!(out, "{}", status_table(&report));
                    let _ = writeln!(
                        out,
                        "cluster {} is up; the supervisor (pid {}) keeps it running: \
                         `pdctl status`, `pdctl logs ROLE`, `pdctl down`",
                        plan.cluster,
                        child.id()
                    );
                    return 0;
                }
                Some(StartupEnd::Failed(failed)) => {
                    for f in failed {
                        eprintln!("{}", failure_of(state, &f.name, &f.why, f.error.as_deref()));
                    }
                    eprintln!(
                        "the supervisor (pid {}) keeps running so you can look: `pdctl status`, \
                         `pdctl logs NAME`; `pdctl down` stops it",
                        child.id()
                    );
                    return 1;
                }
                None => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a service that failed to start is shown with: why, its last error line, and the
/// last lines of its log (the supervisor's own notes left out).
fn failure_of(state: &StateDir, name: &str, why: &str, error: Option<&str>) -> String {
    let lines: Vec<String> = history(&state.log_path(name), Some(40))
        .iter()
        .filter(|l| !l.starts_with(NOTE_PREFIX))
        .map(|l| strip_ansi(l))
        .collect();
    let shown = &lines[lines.len().saturating_sub(FAILURE_LINES)..];
    supervisor::failure_text(name, why, error, shown)
}

/// The last non-empty line of a log, reading only its final 4 KiB; lines the supervisor
/// wrote itself (`[pdctl] ...`) are skipped.
pub fn last_line(path: &Path) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(4096))).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    let text = strip_ansi(&String::from_utf8_lossy(&buf));
    text.lines()
        .rev()
        .map(|l| l.rsplit('\r').next().unwrap_or(l).trim())
        .find(|l| !l.is_empty() && !l.starts_with(NOTE_PREFIX))
        .map(str::to_string)
}
