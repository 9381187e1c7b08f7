//! The rebalancer's loop in the head's supervisor: every few seconds a look at the
//! proxy's `/metrics` (and the decode engines' for the inter-token histogram), once a
//! whole window is measured a judgement ([`super::decide`]), and what the mode asks:
//! `advise` says it (log and `status`), `act` hands a `scale` change to the operations
//! engine — the path `pdctl scale` takes, journaled, draining what it stops — waits for
//! its end and appends the move's record to `rebalance.jsonl` in the state dir. The
//! change carries the split the move was judged on: the head refuses it as stale when
//! another change moved the split meanwhile. A split changed by another change (`pdctl
//! scale`, `apply`) empties the window, re-reads the budget and is left alone for the
//! cool-down; the moves' records, read back at start, keep the cool-down and its doubling
//! across a restart of the supervisor.

use super::super::drain::metrics_page;
use super::decide::{Budget, State, decide, last_move_of};
use super::history;
use super::window::{Sample, Window, decode_urls, from_engine, from_proxy};
use crate::control::Response;
use crate::control::operation::{ChangeOptions, ChangeRequest, now_ms};
use crate::supervisor::Operations;
use crate::vocab::{
    Figures, HistoryPoint, Move, MoveCounts, MoveOutcome, MoveRecord, RebalanceMode, RebalancePlan,
    RebalanceReport, Split,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The file in the state dir each move's record is appended to, one JSON object a line.
pub const MOVES_FILE: &str = "rebalance.jsonl";

/// Moves `status` lists (the file keeps them all).
const SHOWN_MOVES: usize = 10;

/// Moves kept in memory to judge the cool-down and its doubling by (the last ones).
const KEPT_MOVES: usize = 100;

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
    /// The last moves' records, oldest first (the file's at start, then each move's).
    records: Vec<MoveRecord>,
    /// The split the rebalancer last saw or left (None: not read yet): another split at
    /// the next look was made by another change.
    known_split: Option<Split>,
    /// The split the budget is taken from when the table names none: the first one read,
    /// then each one another change made.
    budget_split: Option<Split>,
    /// When (Unix ms) another change last changed the split.
    changed_by_other_ms: Option<u64>,
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
                records: moves[moves.len().saturating_sub(KEPT_MOVES)..].to_vec(),
                known_split: None,
                budget_split: None,
                changed_by_other_ms: None,
            }),
        }
    }

    /// Takes the split read at a look: another one than the rebalancer last saw or left
    /// was made by another change, which empties `window`, re-reads the budget (a table
    /// without one takes this split's size) and starts the cool-down. Returns whether it
    /// was so.
    fn see_split(&self, split: Split, window: &mut Window) -> bool {
        let mut s = self.shared();
        s.report.split = split;
        let changed = s.known_split.is_some_and(|k| k != split);
        if changed {
            tracing::info!(
                "rebalance: the split is {split} now (was {}), changed by another change: the window starts again, the budget is re-read",
                s.known_split.unwrap_or(split)
            );
            window.clear();
            s.budget_split = Some(split);
            s.changed_by_other_ms = Some(now_ms());
        }
        s.known_split = Some(split);
        changed
    }

    /// The budget to judge by.
    fn budget(&self, plan: &RebalancePlan, split: Split) -> Budget {
        let mut s = self.shared();
        Budget::of(plan, *s.budget_split.get_or_insert(split))
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
    let started = std::time::Instant::now();
    let mut window = Window::default();
    loop {
        let window_s = r.table().map_or(IDLE_WINDOW_S, |p| p.table.window_s);
        tokio::time::sleep(tick(window_s)).await;
        r.follow_kept_topology();
        let Some(plan) = r.table() else {
            window.clear();
            continue;
        };
        let window_ms = plan.table.window_s * 1000;
        // The split is followed in every mode (status and the proxy's series show it).
        let (split, proxy) = match running_split(&r.state_dir) {
            Ok(x) => x,
            Err(e) => {
                r.set_verdict(format!("cannot read the running plan: {e:#}"), None, 0);
                continue;
            }
        };
        r.see_split(split, &mut window);
        if r.shared().report.mode == RebalanceMode::Off {
            window.clear();
            r.set_verdict("off: nothing judged".into(), None, 0);
            continue;
        }
        let budget = r.budget(&plan, split);
        let Some(proxy) = proxy else {
            r.set_verdict("the cluster has no proxy to measure".into(), None, 0);
            continue;
        };
        let at = started.elapsed().as_millis() as u64;
        let sample = match look(&http, &proxy, at).await {
            Ok(sample) => sample,
            Err(e) => {
                r.set_verdict(format!("cannot read the figures: {e}"), None, 0);
                continue;
            }
        };
        // The split may have changed while the pages were read: those figures judge
        // another split.
        match running_split(&r.state_dir) {
            Ok((now, _)) if r.see_split(now, &mut window) => continue,
            _ => window.push(sample, window_ms),
        }
        let measured_s = window.span_ms() / 1000;
        let missing = window.missing();
        if !missing.is_empty() {
            let v = not_judged(&missing, window.looks());
            r.set_verdict(v, Some(window.figures()), measured_s);
            continue;
        }
        if window.span_ms() < window_ms {
            let v = format!("measuring: {measured_s} of {} s", plan.table.window_s);
            r.set_verdict(v, Some(window.figures()), measured_s);
            continue;
        }
        let figures = window.figures();
        let state = {
            let s = r.shared();
            let now = now_ms();
            State {
                change_running: engine.report().is_some_and(|o| o.running()),
                unhealthy: window.unhealthy(),
                last_move: last_move_of(&s.records, now, &plan),
                changed_by_other_ms: s.changed_by_other_ms.map(|at| now.saturating_sub(at)),
            }
        };
        match decide(&plan, split, budget, &figures, state) {
            Ok(None) => r.set_verdict(met(&figures), Some(figures), measured_s),
            Err(held) => r.set_verdict(held, Some(figures), measured_s),
            Ok(Some(m)) if r.shared().report.mode == RebalanceMode::Advise => {
                let v = format!("would move {} -> {}: {}", m.from, m.to, m.reason);
                r.set_verdict(v, Some(figures), measured_s);
            }
            Ok(Some(m)) => {
                let v = format!("moving {} -> {}: {}", m.from, m.to, m.reason);
                r.set_verdict(v, Some(figures), measured_s);
                let to = m.to;
                if act(engine.as_ref(), &r, m, figures).await == MoveOutcome::Done {
                    // The split the move left is the rebalancer's own, not another
                    // change's (a stale or failed move left the split as it found it).
                    r.shared().known_split = Some(to);
                }
                window.clear();
            }
        }
    }
}

/// The verdict of a window some decode engine's figures are missing from.
fn not_judged(missing: &std::collections::BTreeMap<String, usize>, looks: usize) -> String {
    let which: Vec<String> = missing
        .iter()
        .map(|(url, n)| format!("{url} at {n} of {looks} looks"))
        .collect();
    format!(
        "not judged: the /metrics of {} did not answer in time; no move on figures not read",
        which.join(", ")
    )
}

fn met(f: &Figures) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} ms"));
    if f.requests == 0 && f.itl_p90_ms.is_none() {
        return "nothing to judge: no first token and no token gap in the window".into();
    }
    let need = super::decide::MIN_FIRST_TOKENS;
    let mut few = Vec::new();
    if f.requests > 0 && f.requests < need {
        few.push(format!(
            "TTFT p90 {} not judged ({} in the window, {need} needed)",
            ms(f.ttft_p90_ms),
            super::decide::requests(f.requests),
        ));
    }
    if f.itl_p90_ms.is_some() && f.itl_requests < need {
        few.push(format!(
            "ITL p90 {} not judged ({} on decode in the window, {need} needed)",
            ms(f.itl_p90_ms),
            super::decide::requests(f.itl_requests),
        ));
    }
    if !few.is_empty() {
        return format!("{}; no move", few.join(", "));
    }
    format!(
        "objectives met: TTFT p90 {}, ITL p90 {} ({}; {} on decode)",
        ms(f.ttft_p90_ms),
        ms(f.itl_p90_ms),
        super::decide::requests(f.requests),
        f.itl_requests
    )
}

/// The split the running plan has, and its proxy's URL.
fn running_split(state_dir: &Path) -> anyhow::Result<(Split, Option<String>)> {
    let plan = crate::ops::change::read_plan(state_dir)?;
    Ok((crate::ops::change::split_of(&plan), plan.proxy_url))
}

/// One look: the proxy's page, and each decode engine's at once (for its inter-token
/// histogram and requests), keyed by its URL; an engine that does not answer in time is
/// named in the sample's `missing`.
/// (Err stays text: why the look failed, logged; the loop skips a failed look whatever
/// the reason.)
async fn look(http: &reqwest::Client, proxy: &str, at_ms: u64) -> Result<Sample, String> {
    let page = metrics_page(http, proxy).await?;
    let mut sample = from_proxy(&page, at_ms);
    let urls = decode_urls(&page);
    let pages = futures_util::future::join_all(urls.iter().map(|url| {
        let url = if url.contains("://") {
            url.clone()
        } else {
            format!("http://{url}")
        };
        async move { metrics_page(http, &url).await }
    }))
    .await;
    for (url, page) in urls.into_iter().zip(pages) {
        match page {
            Ok(page) => {
                sample.engines.insert(url, from_engine(&page));
            }
            Err(e) => {
                tracing::debug!("rebalance: {e}");
                sample.missing.push(url);
            }
        }
    }
    Ok(sample)
}

/// Carries `m` out as a `scale` change through the operations engine (carrying the split
/// it was judged on: the head refuses it as stale if another change moved the split
/// meanwhile), waits for its end and keeps its record; returns how it ended.
async fn act(engine: &dyn Operations, r: &Rebalancer, m: Move, figures: Figures) -> MoveOutcome {
    let change = ChangeRequest::Scale {
        counts: vec![
            ("prefill".to_string(), m.to.prefill),
            ("decode".to_string(), m.to.decode),
        ],
        expect: Some(m.from),
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
    // On GPUs, the change says which instance goes first and whose GPUs the new one
    // takes: the record keeps it.
    let mut freed = None;
    let outcome = match engine.begin(change, tx) {
        Err(refused) => format!("not started: {refused}"),
        Ok(()) => loop {
            match rx.recv().await {
                Some(Response::Progress { line, .. }) if line.trim().starts_with("first: ") => {
                    freed = Some(line.trim().to_string());
                }
                Some(Response::Finished { code, message, .. }) => {
                    let first = message.lines().next().unwrap_or_default();
                    let how = if code == 0 {
                        "done"
                    } else if first.starts_with(crate::ops::change::REFUSED_AS_STALE) {
                        crate::ops::change::REFUSED_AS_STALE
                    } else {
                        "failed"
                    };
                    // The whole answer: a refusal's reasons are on the lines after its first.
                    let said = message
                        .lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .collect::<Vec<_>>()
                        .join(" ");
                    let freed = freed.take().map_or(String::new(), |f| format!("; {f}"));
                    break format!("{how} ({code}): {said}{freed}");
                }
                Some(_) => {}
                None => break "the change ended without a word".to_string(),
            }
        },
    };
    tracing::info!("rebalance: move {} -> {} {outcome}", m.from, m.to);
    let ended = MoveOutcome::of(&outcome);
    record.outcome = Some(outcome);
    record.ended_ms = Some(now_ms());
    if let Err(e) = history::append_line(&r.state_dir.join(MOVES_FILE), &record) {
        tracing::warn!("rebalance: cannot keep the move's record: {e}");
    }
    let mut s = r.shared();
    s.report.moves_total += 1;
    s.report.moves_counted.count(m.toward, ended);
    s.records.push(record.clone());
    let excess = s.records.len().saturating_sub(KEPT_MOVES);
    s.records.drain(..excess);
    s.report.moves.push(record);
    let excess = s.report.moves.len().saturating_sub(SHOWN_MOVES);
    s.report.moves.drain(..excess);
    ended
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
