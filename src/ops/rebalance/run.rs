//! The rebalancer's loop in the head's supervisor: every few seconds a look at the
//! proxy's `/metrics` (and the decode engines' for the inter-token histogram), once a
//! whole window is measured a judgement ([`super::decide`]), and what the mode asks:
//! `advise` says it (log and `status`), `act` hands a `scale` change to the operations
//! engine — the path `pdctl scale` takes, journaled, draining what it stops — waits for
//! its end and appends the move's record to `rebalance.jsonl` in the state dir.

use super::super::drain::metrics_page;
use super::decide::{Budget, State, decide};
use super::history;
use super::window::{Window, add_itl, decode_urls, from_proxy};
use crate::control::Response;
use crate::control::operation::{ChangeOptions, ChangeRequest, now_ms};
use crate::supervisor::Operations;
use crate::vocab::{
    Figures, HistoryPoint, Move, MoveCounts, MoveRecord, RebalanceMode, RebalancePlan,
    RebalanceReport, Role, Split, Toward,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The file in the state dir each move's record is appended to, one JSON object a line.
pub const MOVES_FILE: &str = "rebalance.jsonl";

/// Moves `status` lists (the file keeps them all).
const SHOWN_MOVES: usize = 10;

/// The rebalancer's state, shared by its loop, `status` and `pdctl rebalance`.
pub struct Rebalancer {
    state_dir: PathBuf,
    shared: Mutex<Shared>,
}

struct Shared {
    /// The table judged by: the plan's, then the kept topology's (`apply` changes, adds
    /// or removes it); None: the cluster has no `[rebalance]` table now.
    plan: Option<RebalancePlan>,
    report: RebalanceReport,
    last_move: Option<(Instant, Toward)>,
}

impl Rebalancer {
    /// The rebalancer of a cluster whose plan carries `plan` (None: no table yet; one
    /// `apply` adds is taken at the next look) and runs `split`, its state in `state_dir`.
    pub fn new(plan: Option<RebalancePlan>, split: Split, state_dir: PathBuf) -> Rebalancer {
        let moves = read_moves(&state_dir.join(MOVES_FILE));
        let report = RebalanceReport {
            mode: plan.as_ref().map_or(RebalanceMode::Off, |p| p.table.mode),
            split,
            window_s: plan.as_ref().map_or(0, |p| p.table.window_s),
            measured_s: 0,
            figures: Figures::default(),
            verdict: "starting".into(),
            moves_total: 0,
            moves: moves[moves.len().saturating_sub(SHOWN_MOVES)..].to_vec(),
            moves_counted: MoveCounts::default(),
        };
        Rebalancer {
            state_dir,
            shared: Mutex::new(Shared {
                plan,
                report,
                last_move: None,
            }),
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What `status` shows; None while the cluster has no `[rebalance]` table.
    pub fn report(&self) -> Option<RebalanceReport> {
        let s = self.shared();
        s.plan.as_ref().map(|_| s.report.clone())
    }

    /// `pdctl rebalance MODE`. (Err stays text: the refusal the client is sent as it is.)
    pub fn set_mode(&self, mode: RebalanceMode) -> Result<String, String> {
        let mut s = self.shared();
        if s.plan.is_none() {
            return Err(format!(
                "this cluster has no rebalancer: its topology has no [rebalance] table (add one and `pdctl apply -f FILE`, taken in place, to use mode {})",
                mode.as_str()
            ));
        }
        let was = s.report.mode;
        s.report.mode = mode;
        tracing::info!("rebalance: mode {} (was {})", mode.as_str(), was.as_str());
        Ok(format!(
            "rebalance: mode {} (was {})",
            mode.as_str(),
            was.as_str()
        ))
    }

    /// The table as it stands.
    fn table(&self) -> Option<RebalancePlan> {
        self.shared().plan.clone()
    }

    /// Takes the `[rebalance]` table of the topology the cluster keeps (`apply` writes
    /// it), when it differs: its mode too when the file's mode changed (or the table is
    /// new); none left there leaves the cluster without a rebalancer.
    fn follow_kept_topology(&self) {
        let Ok(Some(source)) = crate::plan::source::ClusterSource::read(&self.state_dir) else {
            return;
        };
        let Ok(kept) = source.rebalance() else {
            return;
        };
        let mut s = self.shared();
        match (kept, &s.plan) {
            (Some(p), Some(old)) if p != *old => {
                tracing::info!("rebalance: the topology's [rebalance] table changed; taken");
                if p.table.mode != old.table.mode {
                    s.report.mode = p.table.mode;
                }
                s.report.window_s = p.table.window_s;
                s.plan = Some(p);
            }
            (Some(p), None) => {
                tracing::info!("rebalance: the topology has a [rebalance] table now; taken");
                s.report.mode = p.table.mode;
                s.report.window_s = p.table.window_s;
                s.report.verdict = "starting".into();
                s.plan = Some(p);
            }
            (None, Some(_)) => {
                tracing::info!("rebalance: the topology has no [rebalance] table now; off");
                s.report.mode = RebalanceMode::Off;
                s.plan = None;
            }
            _ => {}
        }
    }

    /// The verdict of a look; with figures, the look is kept in the history too.
    fn set_verdict(&self, verdict: String, figures: Option<Figures>, measured_s: u64) {
        let mut s = self.shared();
        if s.report.verdict != verdict {
            tracing::info!("rebalance: {verdict}");
        }
        s.report.verdict = verdict;
        s.report.measured_s = measured_s;
        let Some(f) = figures else {
            return;
        };
        s.report.figures = f;
        let point = HistoryPoint {
            at_ms: now_ms(),
            mode: s.report.mode,
            split: s.report.split,
            measured_s,
            figures: f,
            ttft_p90_ms: s.plan.as_ref().and_then(|p| p.table.ttft_p90_ms),
            itl_p90_ms: s.plan.as_ref().and_then(|p| p.table.itl_p90_ms),
            verdict: s.report.verdict.clone(),
        };
        drop(s);
        if let Err(e) = history::append(&self.state_dir, &point) {
            tracing::debug!("rebalance: cannot keep the look in the history: {e}");
        }
    }
}

/// The window whose pace the loop keeps while there is no table (a look at the kept
/// topology every 5 s).
const IDLE_WINDOW_S: u64 = 30;

/// How often the pages are read: six looks a window, between 1 and 5 seconds apart.
fn tick(window_s: u64) -> Duration {
    Duration::from_millis((window_s * 1000 / 6).clamp(1000, 5000))
}

/// The loop; runs as long as the supervisor does.
pub async fn run(engine: Arc<dyn Operations>, r: Arc<Rebalancer>) {
    let http = crate::ops::drain::metrics_client();
    let started = Instant::now();
    let mut window = Window::default();
    let mut first_split = None;
    loop {
        let window_s = r.table().map_or(IDLE_WINDOW_S, |p| p.table.window_s);
        tokio::time::sleep(tick(window_s)).await;
        r.follow_kept_topology();
        let Some(plan) = r.table() else {
            window.clear();
            continue;
        };
        let window_ms = plan.table.window_s * 1000;
        if r.shared().report.mode == RebalanceMode::Off {
            window.clear();
            r.set_verdict("off: nothing judged".into(), None, 0);
            continue;
        }
        let (split, proxy) = match running_split(&r.state_dir) {
            Ok(x) => x,
            Err(e) => {
                r.set_verdict(format!("cannot read the running plan: {e:#}"), None, 0);
                continue;
            }
        };
        r.shared().report.split = split;
        let budget = Budget::of(&plan, *first_split.get_or_insert(split));
        let Some(proxy) = proxy else {
            r.set_verdict("the cluster has no proxy to measure".into(), None, 0);
            continue;
        };
        let at = started.elapsed().as_millis() as u64;
        match look(&http, &proxy, at).await {
            Ok(sample) => window.push(sample, window_ms),
            Err(e) => {
                r.set_verdict(format!("cannot read the figures: {e}"), None, 0);
                continue;
            }
        }
        let measured_s = window.span_ms() / 1000;
        if window.span_ms() < window_ms {
            let v = format!("measuring: {measured_s} of {} s", plan.table.window_s);
            r.set_verdict(v, Some(window.figures()), measured_s);
            continue;
        }
        let figures = window.figures();
        let state = State {
            change_running: engine.report().is_some_and(|o| o.running()),
            unhealthy: window.unhealthy(),
            last_move: r
                .shared()
                .last_move
                .map(|(at, way)| (at.elapsed().as_millis() as u64, way)),
        };
        match decide(&plan, split, budget, &figures, state) {
            Ok(None) => r.set_verdict(met(&figures), Some(figures), measured_s),
            Err(held) => r.set_verdict(format!("held: {held}"), Some(figures), measured_s),
            Ok(Some(m)) if r.shared().report.mode == RebalanceMode::Advise => {
                let v = format!("would move {} -> {}: {}", m.from, m.to, m.reason);
                r.set_verdict(v, Some(figures), measured_s);
            }
            Ok(Some(m)) => {
                let v = format!("moving {} -> {}: {}", m.from, m.to, m.reason);
                r.set_verdict(v, Some(figures), measured_s);
                act(engine.as_ref(), &r, m, figures).await;
                window.clear();
            }
        }
    }
}

fn met(f: &Figures) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} ms"));
    if f.requests == 0 && f.itl_p90_ms.is_none() {
        return "nothing to judge: no first token and no token gap in the window".into();
    }
    let need = super::decide::MIN_FIRST_TOKENS;
    if f.requests > 0 && f.requests < need {
        return format!(
            "TTFT p90 {} not judged ({} in the window, {need} needed), ITL p90 {} met",
            ms(f.ttft_p90_ms),
            super::decide::requests(f.requests),
            ms(f.itl_p90_ms)
        );
    }
    format!(
        "objectives met: TTFT p90 {}, ITL p90 {} ({})",
        ms(f.ttft_p90_ms),
        ms(f.itl_p90_ms),
        super::decide::requests(f.requests)
    )
}

/// The split the running plan has, and its proxy's URL.
fn running_split(state_dir: &Path) -> anyhow::Result<(Split, Option<String>)> {
    let plan = crate::ops::change::read_plan(state_dir)?;
    let split = Split {
        prefill: plan.by_role(Role::Prefill).count() as u32,
        decode: plan.by_role(Role::Decode).count() as u32,
    };
    Ok((split, plan.proxy_url))
}

/// One look: the proxy's page, and each decode engine's for its inter-token histogram
/// (an engine that does not answer or export one adds nothing).
/// (Err stays text: why the look failed, logged; the loop skips a failed look whatever
/// the reason.)
async fn look(
    http: &reqwest::Client,
    proxy: &str,
    at_ms: u64,
) -> Result<super::window::Sample, String> {
    let page = metrics_page(http, proxy).await?;
    let mut sample = from_proxy(&page, at_ms);
    for url in decode_urls(&page) {
        let url = if url.contains("://") {
            url
        } else {
            format!("http://{url}")
        };
        if let Ok(engine) = metrics_page(http, &url).await {
            add_itl(&mut sample.itl, &engine);
        }
    }
    Ok(sample)
}

/// Carries `m` out as a `scale` change through the operations engine, waits for its end
/// and keeps its record.
async fn act(engine: &dyn Operations, r: &Rebalancer, m: Move, figures: Figures) {
    let change = ChangeRequest::Scale {
        counts: vec![
            ("prefill".to_string(), m.to.prefill),
            ("decode".to_string(), m.to.decode),
        ],
        how: ChangeOptions {
            dry_run: false,
            drain_timeout_s: crate::ops::DEFAULT_DRAIN_TIMEOUT_S,
            state_root: r.state_dir.parent().unwrap_or(&r.state_dir).to_path_buf(),
        },
    };
    let mut record = MoveRecord {
        at_ms: now_ms(),
        from: m.from,
        to: m.to,
        reason: m.reason.clone(),
        figures,
        outcome: None,
        ended_ms: None,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (outcome, failed) = match engine.begin(change, tx) {
        Err(refused) => (format!("not started: {refused}"), true),
        Ok(()) => loop {
            match rx.recv().await {
                Some(Response::Finished { code, message, .. }) => {
                    let first = message.lines().next().unwrap_or_default();
                    break (
                        format!(
                            "{} ({code}): {first}",
                            if code == 0 { "done" } else { "failed" }
                        ),
                        code != 0,
                    );
                }
                Some(_) => {}
                None => break ("the change ended without a word".to_string(), true),
            }
        },
    };
    tracing::info!("rebalance: move {} -> {} {outcome}", m.from, m.to);
    record.outcome = Some(outcome);
    record.ended_ms = Some(now_ms());
    if let Err(e) = history::append_line(&r.state_dir.join(MOVES_FILE), &record) {
        tracing::warn!("rebalance: cannot keep the move's record: {e}");
    }
    let mut s = r.shared();
    s.last_move = Some((Instant::now(), m.toward));
    s.report.moves_total += 1;
    s.report.moves_counted.count(m.toward, failed);
    s.report.moves.push(record);
    let excess = s.report.moves.len().saturating_sub(SHOWN_MOVES);
    s.report.moves.drain(..excess);
}

/// The records kept in `path` (lines that do not read are skipped): a previous run's, for
/// `status`, and all of them for `pdctl rebalance history`.
pub fn read_moves(path: &Path) -> Vec<MoveRecord> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_appended_and_read_back() {
        let dir = std::env::temp_dir().join(format!("pdctl-rebalance-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(MOVES_FILE);
        let _ = std::fs::remove_file(&path);
        let s = |prefill, decode| Split { prefill, decode };
        let rec = MoveRecord {
            at_ms: 1,
            from: s(2, 2),
            to: s(3, 1),
            reason: "TTFT".into(),
            figures: Figures::default(),
            outcome: Some("done (0)".into()),
            ended_ms: Some(2),
        };
        history::append_line(&path, &rec).unwrap();
        history::append_line(&path, &rec).unwrap();
        assert_eq!(read_moves(&path), vec![rec.clone(), rec]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn looks_come_six_times_a_window_within_1_to_5_s() {
        assert_eq!(tick(30), Duration::from_secs(5));
        assert_eq!(tick(12), Duration::from_secs(2));
        assert_eq!(tick(3), Duration::from_secs(1));
    }
}
