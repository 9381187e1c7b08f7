//! Start-up progress a person can read while engines load for minutes:
//! `decode-2  starting  47 s  last log: Loading weights ...`. On a terminal one line per
//! service is redrawn in place; otherwise (CI, tests, pipes) a line is printed when a
//! service changes state, and every 10 s for a service still starting.

use crate::control::{ServiceState, ServiceStatus, StatusReport};
use crate::plan::Plan;
use crate::supervisor::state_dir::logfile::log_message;
use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

const PLAIN_REPEAT: Duration = Duration::from_secs(10);

/// One service's line.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub name: String,
    pub state: ServiceState,
    /// Seconds its current process has run.
    pub secs: Option<f64>,
    pub detail: String,
}

/// How the start of a cluster ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StartupEnd {
    /// Every local service is healthy.
    AllHealthy,
    /// The local services that failed (or stopped).
    Failed(Vec<StartFailure>),
}

/// A local service that did not start.
#[derive(Debug, Clone, PartialEq)]
pub struct StartFailure {
    /// The service's name.
    pub name: String,
    /// How its run ended (`exit 3 while starting`), or its state when nothing says more.
    pub why: String,
    /// The last error-looking line it printed, if any.
    pub error: Option<String>,
}

/// `Some` once every local service is healthy, or as soon as one failed or stopped.
/// Remote services do not hold up a node's start. While a change runs (one a dead
/// supervisor left in its journal, finished by this one), a stopped service is one the
/// change is removing, not a failed start: the start waits for the change instead.
pub fn startup_verdict(report: &StatusReport) -> Option<StartupEnd> {
    let changing = report
        .operation
        .as_ref()
        .is_some_and(|o| o.outcome.is_none());
    let local = report.services.iter().filter(|s| !s.remote);
    let failed: Vec<StartFailure> = local
        .clone()
        .filter(|s| match s.state {
            ServiceState::Failed => true,
            ServiceState::Stopped => !changing,
            _ => false,
        })
        .map(|s| StartFailure {
            name: s.name.clone(),
            why: s.last_exit.clone().unwrap_or_else(|| s.state.to_string()),
            error: s.last_error.clone(),
        })
        .collect();
    if !failed.is_empty() {
        return Some(StartupEnd::Failed(failed));
    }
    local
        .clone()
        .all(|s| s.state == ServiceState::Healthy)
        .then_some(StartupEnd::AllHealthy)
}

/// The rows to show for `report`. `last_line(name)` gives a service's latest log line.
pub fn rows(
    report: &StatusReport,
    plan: &Plan,
    last_line: &dyn Fn(&str) -> Option<String>,
) -> Vec<Row> {
    let state_of: HashMap<&str, ServiceState> = report
        .services
        .iter()
        .map(|s| (s.name.as_str(), s.state))
        .collect();
    report
        .services
        .iter()
        .map(|s| {
            let detail = match s.state {
                ServiceState::Pending => {
                    let waiting: Vec<&str> = plan
                        .service(&s.name)
                        .map(|p| {
                            p.depends_on
                                .iter()
                                .map(String::as_str)
                                .filter(|d| state_of.get(d) != Some(&ServiceState::Healthy))
                                .collect()
                        })
                        .unwrap_or_default();
                    if waiting.is_empty() {
                        String::new()
                    } else {
                        format!("waiting for {}", waiting.join(", "))
                    }
                }
                _ if s.remote => {
                    let base = format!("on node {}", s.node);
                    match (&s.state, &s.last_exit) {
                        (ServiceState::Healthy, _) | (_, None) => base,
                        (_, Some(why)) => format!("{base}: {why}"),
                    }
                }
                ServiceState::Starting | ServiceState::Restarting | ServiceState::Unhealthy => {
                    last_line(&s.name)
                        .map(|l| format!("last log: {}", l.trim()))
                        .unwrap_or_default()
                }
                ServiceState::Failed | ServiceState::Stopped => exit_summary(s).unwrap_or_default(),
                ServiceState::Healthy
                | ServiceState::Draining
                | ServiceState::Stopping
                | ServiceState::Unreachable => String::new(),
            };
            Row {
                name: s.name.clone(),
                state: s.state,
                secs: s.uptime_s,
                detail,
            }
        })
        .collect()
}

/// Draws rows over and over, in place on a terminal, as change lines otherwise.
#[derive(Debug)]
pub struct Renderer {
    tty: bool,
    width: usize,
    drawn: usize,
    last_state: HashMap<String, ServiceState>,
    last_print: HashMap<String, Instant>,
}

impl Renderer {
    pub fn new(tty: bool) -> Renderer {
        let width = std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(240usize)
            .max(40);
        Renderer {
            tty,
            width,
            drawn: 0,
            last_state: HashMap::new(),
            last_print: HashMap::new(),
        }
    }

    /// Shows `rows`; write errors (a closed stdout) are ignored.
    pub fn draw(&mut self, out: &mut dyn Write, rows: &[Row]) {
        let name_w = rows.iter().map(|r| r.name.len()).max().unwrap_or(4);
        if self.tty {
            if self.drawn > 0 {
                let _ = write!(out, "\x1b[{}A", self.drawn);
            }
            // Auto-wrap off while drawing: a line wider than the terminal is clipped
            // instead of wrapping, so moving up `drawn` lines always lands on the first.
            let _ = write!(out, "\x1b[?7l");
            for r in rows {
                let mut line = format_row(r, name_w);
                truncate_chars(&mut line, self.width - 1);
                let _ = writeln!(out, "\x1b[2K{line}");
            }
            let _ = write!(out, "\x1b[?7h");
            self.drawn = rows.len();
        } else {
            let now = Instant::now();
            for r in rows {
                let changed = self.last_state.get(&r.name) != Some(&r.state);
                let due = r.state == ServiceState::Starting
                    && self
                        .last_print
                        .get(&r.name)
                        .is_some_and(|t| now.duration_since(*t) >= PLAIN_REPEAT);
                if changed || due {
                    let mut line = format_row(r, name_w);
                    truncate_chars(&mut line, 300);
                    let _ = writeln!(out, "{line}");
                    self.last_state.insert(r.name.clone(), r.state);
                    self.last_print.insert(r.name.clone(), now);
                }
            }
        }
        let _ = out.flush();
    }
}

fn format_row(r: &Row, name_w: usize) -> String {
    let secs = r.secs.map(|s| format!("{s:.0} s")).unwrap_or_default();
    let line = format!(
        "{:<name_w$}  {:<10}  {:>5}  {}",
        r.name,
        r.state.as_str(),
        secs,
        r.detail
    );
    line.trim_end().to_string()
}

fn truncate_chars(s: &mut String, max: usize) {
    if let Some((i, _)) = s.char_indices().nth(max) {
        s.truncate(i);
    }
}

/// `prefill-1 failed: exit 2 while starting` followed by its last error line when the
/// last log lines no longer show it, then those lines, indented.
pub fn failure_text(name: &str, why: &str, error: Option<&str>, lines: &[String]) -> String {
    let mut t = format!("{name} failed: {why}");
    if let Some(e) = error.filter(|e| !lines.iter().any(|l| l.trim() == *e)) {
        t.push_str(&format!("\n  last error line: {e}"));
    }
    if lines.is_empty() {
        t.push_str("\n    (no output)");
    } else {
        t.push_str("\n  last log lines:");
        for l in lines {
            t.push_str(&format!("\n    {l}"));
        }
    }
    t
}

/// How the last run ended and, beside it, the message of its last error line:
/// `exit 0: RuntimeError: shape mismatch`. `None` before any run ended.
pub fn exit_summary(s: &ServiceStatus) -> Option<String> {
    let exit = s.last_exit.as_deref()?;
    Some(match s.last_error.as_deref() {
        Some(e) => format!("{exit}: {}", log_message(e)),
        None => exit.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ServiceStatus;
    use crate::vocab::Role;

    fn status(name: &str, state: ServiceState, remote: bool) -> ServiceStatus {
        ServiceStatus {
            name: name.into(),
            role: Role::Decode,
            node: "n".into(),
            pid: None,
            state,
            gpus: vec![],
            port: None,
            url: None,
            restarts: 0,
            revision: 0,
            ports: Default::default(),
            uptime_s: Some(47.2),
            last_exit: Some("exit 3".into()),
            last_error: None,
            remote,
            unreachable_since_ms: None,
            cpu_percent: None,
            rss_bytes: None,
            gpu_memory_bytes: None,
        }
    }

    fn report(services: Vec<ServiceStatus>) -> StatusReport {
        StatusReport {
            cluster: "c".into(),
            node: "n".into(),
            proxy_url: None,
            services,
            operation: None,
            rebalance: None,
            certificates: None,
        }
    }

    #[test]
    fn a_service_stopped_by_a_running_change_is_waited_for_not_a_failed_start() {
        let mut r = report(vec![
            status("a", ServiceState::Healthy, false),
            status("b", ServiceState::Stopped, false),
        ]);
        assert!(matches!(startup_verdict(&r), Some(StartupEnd::Failed(_))));
        let op = crate::control::operation::OperationReport {
            what: "scale prefill=2 decode=2".into(),
            started_ms: 0,
            step: "b: removed".into(),
            outcome: None,
            interrupted: None,
        };
        r.operation = Some(Box::new(op));
        assert_eq!(startup_verdict(&r), None, "the change is still removing b");
        r.services[1].state = ServiceState::Failed;
        assert!(
            matches!(startup_verdict(&r), Some(StartupEnd::Failed(_))),
            "a failure is one whatever runs"
        );
        r.services[1].state = ServiceState::Stopped;
        r.operation = None;
        assert!(matches!(startup_verdict(&r), Some(StartupEnd::Failed(_))));
    }

    #[test]
    fn verdict_waits_for_local_services_only_and_reports_failures_at_once() {
        let r = report(vec![
            status("a", ServiceState::Healthy, false),
            status("b", ServiceState::Starting, true),
        ]);
        assert_eq!(startup_verdict(&r), Some(StartupEnd::AllHealthy));
        let r = report(vec![
            status("a", ServiceState::Starting, false),
            status("b", ServiceState::Failed, false),
        ]);
        assert_eq!(
            startup_verdict(&r),
            Some(StartupEnd::Failed(vec![StartFailure {
                name: "b".into(),
                why: "exit 3".into(),
                error: None
            }]))
        );
        let r = report(vec![status("a", ServiceState::Starting, false)]);
        assert_eq!(startup_verdict(&r), None);
    }

    #[test]
    fn a_failure_names_the_error_line_unless_the_last_lines_show_it() {
        let lines = vec!["INFO:     Shutting down".to_string()];
        let t = failure_text("decode-0", "exit 0; x", Some("RuntimeError: bad"), &lines);
        assert_eq!(
            t,
            "decode-0 failed: exit 0; x\n  last error line: RuntimeError: bad\n  last log lines:\n    INFO:     Shutting down"
        );
        let shown = vec!["RuntimeError: bad".to_string()];
        let t = failure_text("decode-0", "exit 1", Some("RuntimeError: bad"), &shown);
        assert!(!t.contains("last error line"), "{t}");
        assert!(failure_text("p", "exit 2", None, &[]).ends_with("(no output)"));
    }

    #[test]
    fn plain_mode_prints_changes_only() {
        let plan_json = serde_json::json!({
            "cluster": "c", "state_dir": "/tmp/c", "head_node": "n", "nodes": {},
            "proxy_url": null, "engine": "sim", "vllm_version": null, "connector": "example",
            "services": [], "warnings": []
        });
        let plan: Plan = serde_json::from_value(plan_json).unwrap();
        let last = |_: &str| Some("Loading weights ...".to_string());
        let r = report(vec![status("decode-2", ServiceState::Starting, false)]);
        let mut out = Vec::new();
        let mut p = Renderer::new(false);
        p.draw(&mut out, &rows(&r, &plan, &last));
        p.draw(&mut out, &rows(&r, &plan, &last));
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("decode-2  starting"), "{text}");
        assert!(
            text.contains("47 s  last log: Loading weights ..."),
            "{text}"
        );
    }
}
