//! The `[rebalance]` table: the objectives, budget, bounds and pace by which the head's
//! supervisor moves instances between prefill and decode while the cluster serves. Here,
//! below the topology, the plan and the operations layer, because all three carry it:
//! the topology reads and checks it, the plan carries it as data, `crate::ops` acts on it.

use serde::{Deserialize, Serialize};

/// What the rebalancer does with a move it finds.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum RebalanceMode {
    /// Judges nothing, says nothing (only `pdctl rebalance off` sets it).
    Off,
    /// Says what it would move and why (supervisor log, `pdctl status`), changes nothing.
    #[default]
    Advise,
    /// Moves one instance from one role to the other, like `pdctl scale` would.
    Act,
}

impl RebalanceMode {
    /// Its name as the topology and `pdctl rebalance` write it.
    pub fn as_str(self) -> &'static str {
        match self {
            RebalanceMode::Off => "off",
            RebalanceMode::Advise => "advise",
            RebalanceMode::Act => "act",
        }
    }
}

/// The `[rebalance]` table of a topology, carried unchanged into the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rebalance {
    /// Objective: the 90th percentile of time to first token over the window, ms.
    #[serde(default)]
    pub ttft_p90_ms: Option<f64>,
    /// Objective: the 90th percentile of the gap between output tokens over the window, ms.
    #[serde(default)]
    pub itl_p90_ms: Option<f64>,
    /// Instances the two roles share; default: as many as run when the supervisor starts.
    #[serde(default)]
    pub budget: Option<u32>,
    /// GPUs the two roles share (each instance takes its role's `gpus_per_instance`);
    /// instead of `budget`.
    #[serde(default)]
    pub gpu_budget: Option<u32>,
    /// Prefill instances never fewer than this.
    #[serde(default = "one")]
    pub min_prefill: u32,
    /// Decode instances never fewer than this.
    #[serde(default = "one")]
    pub min_decode: u32,
    /// Seconds of figures each judgement looks at.
    #[serde(default = "Rebalance::default_window")]
    pub window_s: u64,
    /// Seconds after a move before a move the other way.
    #[serde(default = "Rebalance::default_cooldown")]
    pub cooldown_s: u64,
    /// Hysteresis, percent: an objective counts as missed only when its p90 is over it
    /// by more than this (a p90 just over its objective is noise, not a reason to move).
    #[serde(default = "Rebalance::default_hysteresis")]
    pub hysteresis_pct: f64,
    /// Seconds without a move after which the hold before a move back is `cooldown_s`
    /// again: each move back within this of the move before it doubles that hold.
    /// Default: 4 × `cooldown_s`.
    #[serde(default)]
    pub backoff_reset_s: Option<u64>,
    #[serde(default)]
    pub mode: RebalanceMode,
}

fn one() -> u32 {
    1
}

impl Rebalance {
    fn default_window() -> u64 {
        30
    }
    fn default_cooldown() -> u64 {
        120
    }
    fn default_hysteresis() -> f64 {
        10.0
    }
    /// Seconds without a move that bring the hold before a move back to `cooldown_s`.
    pub fn backoff_reset_s(&self) -> u64 {
        self.backoff_reset_s.unwrap_or(4 * self.cooldown_s)
    }
}

/// `[rebalance]` as the plan carries it: the table, and what one instance of each role
/// costs of a `gpu_budget` (its role's `gpus_per_instance`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebalancePlan {
    pub table: Rebalance,
    /// GPUs one prefill instance takes.
    pub prefill_gpus: u32,
    /// GPUs one decode instance takes.
    pub decode_gpus: u32,
}

/// What the proxy's figures said over one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Requests whose first token came back within the window.
    pub requests: u64,
    /// 90th percentile of time to first token, ms (None: no request in the window).
    pub ttft_p90_ms: Option<f64>,
    /// 90th percentile of the gap between output tokens, ms (None: not measured).
    pub itl_p90_ms: Option<f64>,
    /// Requests with a gap between tokens in the window: finished on a decode engine in
    /// it, or running there at its end.
    #[serde(default)]
    pub itl_requests: u64,
    /// Mean requests on the prefill instances (the queue in front of prefill).
    pub prefill_queue: f64,
    /// Mean requests on the decode instances.
    pub decode_queue: f64,
    /// Share of the window (0..1) the prefill instances had a request on them.
    pub prefill_busy: f64,
    /// Share of the window the decode instances had a request on them.
    pub decode_busy: f64,
}

/// Instances per role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    pub prefill: u32,
    pub decode: u32,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}P{}D", self.prefill, self.decode)
    }
}

/// Which way a move goes: toward more prefill or toward more decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Toward {
    Prefill,
    Decode,
}

/// A move the rebalancer found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    pub from: Split,
    pub to: Split,
    pub toward: Toward,
    /// Why, in words, with the figures.
    pub reason: String,
}

/// One move as the state dir's `rebalance.jsonl` and `pdctl status --json` keep it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveRecord {
    /// When it was decided (Unix time, ms).
    pub at_ms: u64,
    pub from: Split,
    pub to: Split,
    pub reason: String,
    /// The window's figures that triggered it.
    pub figures: Figures,
    /// How the change carrying it out ended (its first line), once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// When that change ended (Unix time, ms): the cool-down counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
}

/// The rebalancer as `pdctl status` shows it (`rebalance` in `--json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebalanceReport {
    pub mode: RebalanceMode,
    /// The split that runs.
    pub split: Split,
    /// The window judged over, and the seconds of figures it holds so far.
    pub window_s: u64,
    pub measured_s: u64,
    /// The last window's figures.
    pub figures: Figures,
    /// The last judgement in words: `would move 2P2D -> 3P1D: ...` (advise), `moving ...`
    /// (act), `held: ...` (a rule held a wanted move back), or why nothing is judged.
    pub verdict: String,
    /// Moves carried out since the supervisor started, and the last few of them.
    pub moves_total: u64,
    pub moves: Vec<MoveRecord>,
    /// The moves since the supervisor started, by way and outcome (`/metrics` of the
    /// proxy exports them).
    #[serde(default)]
    pub moves_counted: MoveCounts,
}

/// Moves counted since the supervisor started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveCounts {
    /// Moves toward more prefill, and toward more decode (whatever their outcome).
    pub toward_prefill: u64,
    pub toward_decode: u64,
    /// Of those, the moves whose change was refused or failed (nothing moved), stale
    /// refusals included.
    pub failed: u64,
    /// Of those, the moves the head refused as stale: the split had changed since the
    /// figures were judged (nothing moved).
    #[serde(default)]
    pub stale: u64,
    /// Of those, the moves whose change never started (refused by the operations engine).
    #[serde(default)]
    pub not_started: u64,
}

/// How the change carrying a move out ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The split moved.
    Done,
    /// Refused or failed: nothing moved.
    Failed,
    /// Refused because the split had changed since the figures were judged.
    Stale,
    /// Never started: the operations engine refused the change (another one runs, the
    /// journal could not be read): nothing moved.
    NotStarted,
}

impl MoveOutcome {
    /// Its name as the proxy's `outcome` label writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            MoveOutcome::Done => "done",
            MoveOutcome::Failed => "failed",
            MoveOutcome::Stale => "refused as stale",
            MoveOutcome::NotStarted => "not started",
        }
    }

    /// How a record's `outcome` text ended (None: no end recorded yet).
    pub fn of(outcome: &str) -> MoveOutcome {
        if outcome.starts_with("done") {
            MoveOutcome::Done
        } else if outcome.contains("refused as stale") {
            MoveOutcome::Stale
        } else if outcome.starts_with("not started") {
            MoveOutcome::NotStarted
        } else {
            MoveOutcome::Failed
        }
    }
}

impl MoveCounts {
    /// Counts one move `toward` that ended `outcome`.
    pub fn count(&mut self, toward: Toward, outcome: MoveOutcome) {
        match toward {
            Toward::Prefill => self.toward_prefill += 1,
            Toward::Decode => self.toward_decode += 1,
        }
        self.failed += u64::from(outcome != MoveOutcome::Done);
        self.stale += u64::from(outcome == MoveOutcome::Stale);
        self.not_started += u64::from(outcome == MoveOutcome::NotStarted);
    }

    /// Moves that ended `outcome`.
    pub fn ended(&self, outcome: MoveOutcome) -> u64 {
        let all = self.toward_prefill + self.toward_decode;
        match outcome {
            MoveOutcome::Done => all - self.failed,
            MoveOutcome::Failed => self.failed - self.stale - self.not_started,
            MoveOutcome::Stale => self.stale,
            MoveOutcome::NotStarted => self.not_started,
        }
    }
}

impl MoveRecord {
    /// Which way the move went.
    pub fn toward(&self) -> Toward {
        if self.to.prefill > self.from.prefill || self.to.decode < self.from.decode {
            Toward::Prefill
        } else {
            Toward::Decode
        }
    }
}

/// One look of the rebalancer as the state dir's `rebalance-history.jsonl` keeps it: the
/// figures over time that `pdctl rebalance history` lists and plots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryPoint {
    /// When (Unix time, ms).
    pub at_ms: u64,
    pub mode: RebalanceMode,
    /// The split that ran.
    pub split: Split,
    /// Seconds of figures the window held (a judgement needs `window_s`).
    pub measured_s: u64,
    /// The window's figures at this look.
    pub figures: Figures,
    /// The objectives judged by at this look (the table may change while it runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p90_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p90_ms: Option<f64>,
    /// The verdict of this look, as `status` shows it.
    pub verdict: String,
}
