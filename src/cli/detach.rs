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
use std::time::{Duration, Instant};

/// How long `up -d` waits for a supervisor that does not answer before giving up, counting
/// only the time this process ran (see [`Silence`]).
const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// How long the supervisor has not answered while this process ran. A freeze of the whole
/// machine (seen for over a minute on 2 cores with two vLLM engines) stops the supervisor
/// and this process alike: counted by the wall clock, the first refused ask after it would
/// give up on a supervisor that was only frozen with it, and `up` would take a starting
/// cluster down. The time this process was stalled is left out.
#[derive(Debug, Clone, Copy)]
struct Silence {
    last_answer: Instant,
}

impl Silence {
    fn new(now: Instant) -> Silence {
        Silence { last_answer: now }
    }

    /// The supervisor answered at `at`.
    fn heard(&mut self, at: Instant) {
        self.last_answer = at;
    }

    /// How long it has been silent at `now` while this process ran, `stalled` being how
    /// long this process was frozen since the last answer.
    fn awake_for(&self, now: Instant, stalled: Duration) -> Duration {
        now.saturating_duration_since(self.last_answer)
            .saturating_sub(stalled)
    }

    /// Whether the silence at `now` is past [`SILENCE_LIMIT`].
    fn too_long(&self, now: Instant, stalled: Duration) -> bool {
        self.awake_for(now, stalled) > SILENCE_LIMIT
    }
}

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
    let clock = crate::stall_clock::clock();
    let mut silence = Silence::new(Instant::now());
    // The start-up change last said to be waited for (each is said once).
    let mut waited_for: Option<String> = None;
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
        let now = Instant::now();
        if answer.is_err() && silence.too_long(now, clock.stalled_since(silence.last_answer)) {
            eprintln!(
                "error: the supervisor (pid {}) has not answered on {} for {} s (time this machine was frozen not counted); see {}",
                child.id(),
                socket.display(),
                SILENCE_LIMIT.as_secs(),
                state.supervisor_log_path().display()
            );
            return 1;
        }
        if let Ok(report) = answer {
            silence.heard(now);
            let rows = supervisor::progress_rows(&report, plan, &last_line);
            renderer.draw(&mut std::io::stdout().lock(), &rows);
            match supervisor::startup_verdict(&report) {
                Some(StartupEnd::AllHealthy) => match startup_change(&report) {
                    Some(change) => {
                        if waited_for.as_deref() != Some(change.what.as_str()) {
                            eprintln!(
                                "waiting for the start-up change: {} ({})",
                                change.what, change.step
                            );
                            waited_for = Some(change.what.clone());
                        }
                    }
                    None => {
                        say_up(&report, plan, child.id()).await;
                        return 0;
                    }
                },
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

/// The cluster is up: its status table (with the dashboard's line on the head) and what
/// keeps it running (the detached supervisor, pid `pid`).
/// The change the new supervisor is doing at its start (on the head: reconciling the other
/// nodes with the plan, or taking up one its predecessor left half done), if one runs.
/// `up` returns after it: a `scale` or `restart` typed next would be refused while it runs.
fn startup_change(
    report: &crate::control::StatusReport,
) -> Option<&crate::control::operation::OperationReport> {
    report.operation.as_deref().filter(|op| op.running())
}

async fn say_up(report: &crate::control::StatusReport, plan: &Plan, pid: u32) {
    let line = match report.node == plan.head_node {
        true => super::dashboard::line(plan).await,
        false => None,
    };
    let mut out = std::io::stdout().lock();
    let table = status_table(report);
    let _ = write!(
        out,
        "{}",
        super::dashboard::after_table(&table, line.as_deref())
    );
    let _ = writeln!(
        out,
        "cluster {} is up; the supervisor (pid {pid}) keeps it running: \
         `pdctl status`, `pdctl logs ROLE`, `pdctl down`",
        plan.cluster,
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_waits_for_a_start_up_change_that_runs_and_not_for_one_that_ended() {
        use crate::control::operation::{OperationReport, Outcome};
        let mut report: crate::control::StatusReport = serde_json::from_value(
            serde_json::json!({"cluster": "c", "node": "head", "services": []}),
        )
        .unwrap();
        assert!(
            startup_change(&report).is_none(),
            "no change: nothing to wait for"
        );
        let mut op = OperationReport {
            what: "reconcile the other nodes with the plan".into(),
            started_ms: 1,
            step: "node worker".into(),
            outcome: None,
            interrupted: None,
        };
        report.operation = Some(Box::new(op.clone()));
        let running = startup_change(&report).map(|o| o.what.clone());
        assert_eq!(running.as_deref(), Some(op.what.as_str()));
        op.outcome = Some(Outcome {
            code: 0,
            message: "done".into(),
            ended_ms: 2,
        });
        report.operation = Some(Box::new(op));
        assert!(
            startup_change(&report).is_none(),
            "an ended change is not waited for"
        );
    }

    #[test]
    fn a_silence_that_was_a_freeze_of_this_process_too_is_not_counted() {
        let t0 = Instant::now();
        let silence = Silence::new(t0);
        let later = t0 + Duration::from_secs(80);
        // Frozen 76 s of the 80 with the supervisor (the failed round's whole-machine freeze).
        assert_eq!(
            silence.awake_for(later, Duration::from_secs(76)),
            Duration::from_secs(4)
        );
        assert!(!silence.too_long(later, Duration::from_secs(76)));
        // The same 80 s with this process running throughout: the supervisor hangs.
        assert!(silence.too_long(later, Duration::ZERO));
    }

    #[test]
    fn an_answer_starts_the_silence_again() {
        let t0 = Instant::now();
        let mut silence = Silence::new(t0);
        silence.heard(t0 + Duration::from_secs(25));
        let at = t0 + Duration::from_secs(50);
        assert_eq!(
            silence.awake_for(at, Duration::ZERO),
            Duration::from_secs(25)
        );
        assert!(!silence.too_long(at, Duration::ZERO));
        assert!(silence.too_long(t0 + Duration::from_secs(56), Duration::ZERO));
    }
}
