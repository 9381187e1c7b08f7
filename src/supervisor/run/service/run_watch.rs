//! Watching one run of a service's process: probing until it is ready, then probing its
//! liveness, until the process exits, a probe gives up, or a command arrives.

use super::Task;
use crate::control::ServiceState;
use crate::supervisor::run::probe::{
    LIVENESS_INTERVAL, OUTPUT_PROBE_GAP, startup_delay, unhealthy_now,
};
use crate::supervisor::run::service::Cmd;
use crate::supervisor::run::stop::describe_exit;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use tokio::process::Child;
use tokio::sync::Notify;
use tokio::sync::oneshot;

/// How one run of the process ended.
#[derive(Debug)]
pub enum RunEnd {
    /// The process exited on its own: how (`exit 0`, `exit 1`, `signal 9 (SIGKILL)`). Any
    /// status is a failure: a server is not meant to finish.
    Exited(String),
    /// Too many liveness probes failed in a row; the reason of the last one.
    LivenessFailed(String),
    /// Not ready within its start-up timeout; the last probe's complaint.
    StartTimeout(String),
    /// `down`: stop within this timeout (the plan's when `None`), then acknowledge.
    Stop(Option<Duration>, oneshot::Sender<()>),
    /// Stop and start again, for this reason; `true` also restarts companions.
    Restart(String, bool),
}

/// Watching one run: the task's own commands end it as well as the process and the probes.
impl Task {
    /// Probes until ready (`None`) or the run ends first. Probes follow
    /// [`startup_delay`], and come early when the service prints something (`output`).
    pub(super) async fn wait_ready(
        &mut self,
        child: &mut Child,
        seen: &AtomicBool,
        output: &Notify,
        started: Instant,
    ) -> Option<RunEnd> {
        let pid = child.id();
        let svc = self.ctx.service(self.idx);
        let probe = svc.probe.clone();
        let limit = Duration::from_secs(svc.startup_timeout_s);
        let prober = self.ctx.prober.clone();
        // The first output may trigger a probe at once.
        let mut last_probe = started.checked_sub(OUTPUT_PROBE_GAP).unwrap_or(started);
        loop {
            let next = async {
                let scheduled = tokio::time::sleep(startup_delay(started.elapsed()));
                let early = async {
                    output.notified().await;
                    tokio::time::sleep_until((last_probe + OUTPUT_PROBE_GAP).into()).await;
                };
                tokio::select! {
                    _ = scheduled => {}
                    _ = early => {}
                }
                prober.check(&probe, seen).await
            };
            tokio::select! {
                st = child.wait() => return Some(exited(st, pid)),
                cmd = self.rx.recv() => return Some(command_end(cmd)),
                res = next => {
                    last_probe = Instant::now();
                    match res {
                        Ok(()) => return None,
                        Err(why) if started.elapsed() >= limit => {
                            return Some(RunEnd::StartTimeout(why.to_string()));
                        }
                        Err(_) => {}
                    }
                }
            }
        }
    }

    /// Probes a healthy service every second until its run ends.
    pub(super) async fn watch_liveness(&mut self, child: &mut Child, seen: &AtomicBool) -> RunEnd {
        let pid = child.id();
        let svc = self.ctx.service(self.idx);
        let probe = svc.probe.clone();
        let allowed = svc.restart.liveness_failures.max(1);
        let failed_probes = self.ctx.members().plan.health.failed_probes;
        let prober = self.ctx.prober.clone();
        let mut failures = 0u32;
        loop {
            tokio::select! {
                st = child.wait() => return exited(st, pid),
                cmd = self.rx.recv() => return command_end(cmd),
                res = async { tokio::time::sleep(LIVENESS_INTERVAL).await; prober.check(&probe, seen).await } => {
                    match res {
                        Ok(()) if failures > 0 => {
                            failures = 0;
                            self.ctx.table.set_state(self.idx, ServiceState::Healthy);
                        }
                        Ok(()) => {}
                        Err(why) if why.inconclusive() => {
                            tracing::warn!("liveness probe of {}: {why}", self.ctx.service(self.idx).name);
                        }
                        Err(why) => {
                            failures += 1;
                            // A slow answer of a busy engine keeps it in rotation until
                            // `health.failed_probes` in a row; a refused one does not.
                            if unhealthy_now(failures, &why, failed_probes) {
                                self.ctx.table.set_state(self.idx, ServiceState::Unhealthy);
                            }
                            if failures >= allowed {
                                return RunEnd::LivenessFailed(format!(
                                    "liveness failed {failures} times: {why}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The run end for a finished `wait()` on the process `pid`: its exit status or signal,
/// and "killed by the kernel's OOM killer" where the kernel log says so.
pub fn exited(st: std::io::Result<std::process::ExitStatus>, pid: Option<u32>) -> RunEnd {
    match st {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            let mut why = describe_exit(&s);
            if s.signal() == Some(9)
                && pid.is_some_and(crate::supervisor::process::procfs::oom_killed)
            {
                why.push_str(", killed by the kernel's OOM killer (out of memory)");
            }
            RunEnd::Exited(why)
        }
        Err(e) => RunEnd::Exited(format!("could not be waited for: {e}")),
    }
}

/// The run end a command (or the supervisor going away) asks for.
pub fn command_end(cmd: Option<Cmd>) -> RunEnd {
    match cmd {
        Some(Cmd::Stop { timeout, done }) => RunEnd::Stop(timeout, done),
        Some(Cmd::Restart { reason, cascade }) => RunEnd::Restart(reason, cascade),
        // Every sender gone: the supervisor is ending; stop with the plan's timeout.
        None => RunEnd::Stop(None, oneshot::channel().0),
    }
}
