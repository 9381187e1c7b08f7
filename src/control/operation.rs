//! What a client asks the head's supervisor to change in a running cluster, and how the
//! supervisor reports the change while it runs and after: the words both sides share.

use crate::plan::source::ClusterSource;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A change to a running cluster, carried out by the head's supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ChangeRequest {
    /// `pdctl scale ROLE=N...`: instances per role (`prefill`, `decode`).
    Scale {
        counts: Vec<(String, u32)>,
        /// The split the change was decided on (the rebalancer's moves): the head refuses
        /// the change, "refused as stale", when the running split is another one by then,
        /// so that a move judged on old figures never undoes someone else's change. None
        /// (`pdctl scale`): whatever runs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expect: Option<crate::vocab::Split>,
        #[serde(flatten)]
        how: ChangeOptions,
    },
    /// `pdctl apply` (and `up` on a running cluster): the topology as read by the client,
    /// planned again by the supervisor.
    Apply {
        source: Box<ClusterSource>,
        #[serde(flatten)]
        how: ChangeOptions,
    },
    /// `pdctl restart SERVICE|ROLE...`: each by the supervisor of its node; `drained`
    /// (`--drain`, `--rolling`): one at a time out of routing, its requests in flight
    /// finished, restarted, healthy again, back in routing.
    Restart {
        targets: Vec<String>,
        #[serde(default)]
        drained: bool,
        /// Every instance of the roles named (`--rolling`); targets must be roles.
        #[serde(default)]
        rolling: bool,
        #[serde(flatten)]
        how: ChangeOptions,
    },
}

/// How a change is carried out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChangeOptions {
    /// Print what would change, change nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Seconds a drained instance's requests in flight get before it is stopped anyway.
    pub drain_timeout_s: u64,
    /// The state root the cluster was started under (a plan names its state dir by it).
    pub state_root: PathBuf,
}

impl ChangeRequest {
    /// One line naming the change, as `status` and a refused second change show it.
    pub fn describe(&self) -> String {
        match self {
            ChangeRequest::Scale { counts, expect, .. } => format!(
                "scale {}{}",
                counts
                    .iter()
                    .map(|(r, n)| format!("{r}={n}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                expect.map_or(String::new(), |e| format!(" (from {e})"))
            ),
            ChangeRequest::Apply { source, .. } => format!("apply {}", source.label),
            ChangeRequest::Restart {
                targets,
                drained,
                rolling,
                ..
            } => format!(
                "restart{} {}",
                if *rolling {
                    " --rolling"
                } else if *drained {
                    " --drain"
                } else {
                    ""
                },
                targets.join(" ")
            ),
        }
    }

    /// How it is carried out.
    pub fn options(&self) -> &ChangeOptions {
        match self {
            ChangeRequest::Scale { how, .. }
            | ChangeRequest::Apply { how, .. }
            | ChangeRequest::Restart { how, .. } => how,
        }
    }
}

/// A change as `pdctl status` shows it: the one running, or the last one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperationReport {
    /// e.g. `scale decode=4`.
    pub what: String,
    /// When it started (Unix time, ms).
    pub started_ms: u64,
    /// The step it is on, or was on when it ended (e.g. `decode-3: starting`).
    pub step: String,
    /// How it ended; None while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Set when this is the head's supervisor taking up, at its start, a change that was
    /// cut short when it stopped (crash, reboot, `kill -9`): which, and what became of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<Interrupted>,
}

/// A change cut short by the head's supervisor stopping, as its next start found it in
/// the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interrupted {
    /// The change, e.g. `scale decode=2`.
    pub what: String,
    /// The step it was on.
    pub step: String,
    /// What the start made of it; None while it is being done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered: Option<Recovered>,
}

/// What the head's supervisor made of an interrupted change at its start (the rule is in
/// docs/operations.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recovered {
    /// Carried on to the plan it was making.
    Finished,
    /// Taken back to the plan that ran before it.
    Undone,
    /// Neither: `up` was given a topology that is neither plan; the cluster runs that.
    SetAside,
}

impl Recovered {
    pub fn as_str(self) -> &'static str {
        match self {
            Recovered::Finished => "finished",
            Recovered::Undone => "undone",
            Recovered::SetAside => "set aside",
        }
    }
}

/// How a change ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The client's exit code: 0 done, 1 a step failed, 2 refused.
    pub code: u8,
    pub message: String,
    /// When it ended (Unix time, ms).
    pub ended_ms: u64,
}

impl OperationReport {
    /// True while the change runs.
    pub fn running(&self) -> bool {
        self.outcome.is_none()
    }

    /// One line for the status table: `change in progress: ...` or `last change: ...`.
    pub fn line(&self, now_ms: u64) -> String {
        let ago = |ms: u64| {
            let s = now_ms.saturating_sub(ms) / 1000;
            if s < 120 {
                format!("{s} s")
            } else {
                format!("{} min", s / 60)
            }
        };
        let what = match &self.interrupted {
            Some(i) => format!(
                "{} (cut short at `{}` when the head's supervisor stopped; {} at its start)",
                self.what,
                i.step,
                i.recovered.map_or("being taken up", Recovered::as_str)
            ),
            None => self.what.clone(),
        };
        match &self.outcome {
            None => format!(
                "change in progress: {} (for {}), at {}",
                what,
                ago(self.started_ms),
                self.step
            ),
            Some(o) => format!(
                "last change: {} {} {} ago: {}",
                what,
                if o.code == 0 { "done" } else { "FAILED" },
                ago(o.ended_ms),
                o.message
            ),
        }
    }
}

/// Unix time now, in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_says_what_became_of_an_interrupted_change() {
        let mut r = OperationReport {
            what: "scale decode=2".into(),
            started_ms: 1_000,
            step: "decode-1: waiting until healthy".into(),
            outcome: None,
            interrupted: Some(Interrupted {
                what: "scale decode=2".into(),
                step: "decode-1: wait until healthy".into(),
                recovered: None,
            }),
        };
        let line = r.line(3_000);
        assert!(line.starts_with("change in progress: scale decode=2 (cut short at `decode-1: wait until healthy` when the head's supervisor stopped; being taken up at its start)"), "{line}");
        r.interrupted.as_mut().unwrap().recovered = Some(Recovered::Finished);
        r.outcome = Some(Outcome {
            code: 0,
            message: "`scale decode=2` finished".into(),
            ended_ms: 4_000,
        });
        let line = r.line(5_000);
        assert!(
            line.contains("; finished at its start) done 1 s ago"),
            "{line}"
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["interrupted"]["recovered"], "finished");
        r.interrupted = None;
        let json = serde_json::to_value(&r).unwrap();
        assert!(
            json.get("interrupted").is_none(),
            "absent when nothing was cut short"
        );
    }
}
