//! The rebalancer's loop in the head's supervisor: every few seconds a look at the
//! proxy's `/metrics` (and the decode engines' for the inter-token histogram), once a
//! whole window is measured a judgement ([`super::decide`]), and what the mode asks:
//! `advise` says it (log and `status`), `act` hands a `scale` change to the operations
//! engine — the path `pdctl scale` takes, journaled, draining what it stops — waits for
//! its end and appends the move's record to `rebalance.jsonl` in the state dir. The
//! change carries the split the move was judged on: the head refuses it as stale when
//! another change moved the split meanwhile. Whose split runs is the state machine's
//! ([`super::machine`]): a split another change (`pdctl scale`, `apply`) set empties the
//! window, re-reads the budget and is the user's baseline, never moved until `pdctl
//! rebalance act` is said again; the machine's state and the moves' records, read back
//! at start, keep that baseline, the cool-down and its doubling across a restart of the
//! supervisor.

use super::super::drain::metrics_page;
use super::decide::{Budget, State, decide, last_move_of};
use super::history;
use super::machine::{Effect, Event, Machine};
use super::window::{Sample, Unread, Window, decode_urls, from_proxy};
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
const RECENT_MOVES: usize = 100;

/// The rebalancer's state, shared by its loop, `status` and `pdctl rebalance`.
pub struct Rebalancer {
    state_dir: PathBuf,
    state: Mutex<RebalancerState>,
}

/// What the loop, `status` and `pdctl rebalance` share, under one lock.
struct RebalancerState {
    /// The table judged by: the plan's, then the kept topology's (`apply` changes, adds
    /// or removes it); None: the cluster has no `[rebalance]` table now.
    plan: Option<RebalancePlan>,
    report: RebalanceReport,
    /// The last moves' records, oldest first (the file's at start, then each move's).
    records: Vec<MoveRecord>,
    /// Whose split runs, and the split the budget is taken from.
    machine: Machine,
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
            state: Mutex::new(RebalancerState {
                plan,
                report,
                records: moves[moves.len().saturating_sub(RECENT_MOVES)..].to_vec(),
                machine: Machine::read(&state_dir),
            }),
            state_dir,
        }
    }

    /// Feeds `event` to the state machine, keeps its new state in the state dir when it
    /// changed, and returns what the loop is to do.
    fn on(&self, event: Event) -> Effect {
        let mut s = self.lock();
        let (next, effect) = s.machine.on(event);
        if let Event::Seen { split, .. } = event {
            s.report.split = split;
        }
        if next == s.machine {
            return effect;
        }
        match effect {
            Effect::UserSplit { was } => tracing::info!(
                "rebalance: the split is {} now (was {}), set by another change: the window starts again, the budget is re-read, and the split is the user's baseline until `pdctl rebalance act`",
                next.split().map_or("-".into(), |s| s.to_string()),
                was.map_or("-".into(), |s| s.to_string()),
            ),
            Effect::Released => {
                tracing::info!("rebalance: `act` said: the user's split is judged again")
            }
            Effect::None => {}
        }
        s.machine = next;
        if let Err(e) = next.write(&self.state_dir) {
            tracing::warn!("rebalance: cannot keep its state in the state dir: {e}");
        }
        effect
    }

    /// Takes the split read at a look; one another change set empties `window`. Returns
    /// whether it was so.
    fn see_split(&self, split: Split, window: &mut Window) -> bool {
        let effect = self.on(Event::Seen {
            split,
            at_ms: now_ms(),
        });
        let changed = matches!(effect, Effect::UserSplit { .. });
        if changed {
            window.clear();
        }
        changed
    }

    /// The budget to judge by.
    fn budget(&self, plan: &RebalancePlan, split: Split) -> Budget {
        Budget::of(plan, self.lock().machine.budget_split.unwrap_or(split))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RebalancerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What `status` shows; None while the cluster has no `[rebalance]` table.
    pub fn report(&self) -> Option<RebalanceReport> {
        let s = self.lock();
        s.plan.as_ref().map(|_| s.report.clone())
    }

    /// `pdctl rebalance MODE`. (Err stays text: the refusal the client is sent as it is.)
    pub fn set_mode(&self, mode: RebalanceMode) -> Result<String, String> {
        let mut s = self.lock();
        if s.plan.is_none() {
            return Err(format!(
                "this cluster has no rebalancer: its topology has no [rebalance] table (add one and `pdctl apply -f FILE`, taken in place, to use mode {})",
                mode.as_str()
            ));
        }
        let was = s.report.mode;
        s.report.mode = mode;
        tracing::info!("rebalance: mode {} (was {})", mode.as_str(), was.as_str());
        drop(s);
        // `act` said again gives a user's split back to the rebalancer.
        let released = mode == RebalanceMode::Act && self.on(Event::ActSaid) == Effect::Released;
        Ok(format!(
            "rebalance: mode {} (was {}){}",
            mode.as_str(),
            was.as_str(),
            if released {
                "; the split another change set is judged again"
            } else {
                ""
            }
        ))
    }

    /// The table as it stands.
    fn table(&self) -> Option<RebalancePlan> {
        self.lock().plan.clone()
    }

    /// Takes the `[rebalance]` table of the topology the cluster keeps (`apply` writes
    /// it), when it differs: its mode too when the file's mode changed (or the table is
    /// new); none left there leaves the cluster without a rebalancer.
    fn follow_cluster_topology(&self) {
        let Ok(Some(source)) = crate::plan::source::ClusterSource::read(&self.state_dir) else {
            return;
        };
        let Ok(table) = source.rebalance() else {
            return;
        };
        let mut s = self.lock();
        match (table, &s.plan) {
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
        let mut s = self.lock();
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
        r.follow_cluster_topology();
        let Some(plan) = r.table() else {
            window.clear();
            continue;
        };
        let at_ms = started.elapsed().as_millis() as u64;
        if let Some(judged) = measure(&http, &r, &plan, &mut window, at_ms).await {
            judge(engine.as_ref(), &r, &plan, judged, &mut window).await;
        }
    }
}

/// A whole window's figures, read from every engine, on the split that ran throughout.
struct Measured {
    split: Split,
    figures: Figures,
    measured_s: u64,
}

/// One look: the split (followed in every mode: status and the proxy's series show it),
/// then, unless the mode is off, the pages added to `window`. Returns the window's
/// figures once it is whole and nothing in it is blind; else sets the verdict saying
/// why not.
async fn measure(
    http: &reqwest::Client,
    r: &Rebalancer,
    plan: &RebalancePlan,
    window: &mut Window,
    at_ms: u64,
) -> Option<Measured> {
    let (split, proxy) = match running_split(&r.state_dir) {
        Ok(x) => x,
        Err(e) => {
            r.set_verdict(format!("cannot read the running plan: {e:#}"), None, 0);
            return None;
        }
    };
    r.see_split(split, window);
    if r.lock().report.mode == RebalanceMode::Off {
        window.clear();
        r.set_verdict("off: nothing judged".into(), None, 0);
        return None;
    }
    let Some(proxy) = proxy else {
        r.set_verdict("the cluster has no proxy to measure".into(), None, 0);
        return None;
    };
    let sample = match look(http, &proxy, at_ms).await {
        Ok(sample) => sample,
        Err(e) => {
            r.set_verdict(format!("cannot read the figures: {e}"), None, 0);
            return None;
        }
    };
    // The split may have changed while the pages were read: those figures judge
    // another split.
    match running_split(&r.state_dir) {
        Ok((now, _)) if r.see_split(now, window) => return None,
        _ => window.push(sample, plan.table.window_s * 1000),
    }
    let measured_s = window.span_ms() / 1000;
    let missing = window.missing();
    let verdict = if !missing.is_empty() {
        blind(&missing, window.looks())
    } else if window.span_ms() < plan.table.window_s * 1000 {
        format!("measuring: {measured_s} of {} s", plan.table.window_s)
    } else {
        let figures = window.figures();
        return Some(Measured {
            split,
            figures,
            measured_s,
        });
    };
    r.set_verdict(verdict, Some(window.figures()), measured_s);
    None
}

/// Judges a whole window and does what the mode asks of the verdict.
async fn judge(
    engine: &dyn Operations,
    r: &Rebalancer,
    plan: &RebalancePlan,
    m: Measured,
    window: &mut Window,
) {
    let Measured {
        split,
        figures,
        measured_s,
    } = m;
    let budget = r.budget(plan, split);
    let state = {
        let s = r.lock();
        let now = now_ms();
        State {
            change_running: engine.report().is_some_and(|o| o.running()),
            unhealthy: window.unhealthy(),
            last_move: last_move_of(&s.records, now, plan),
            user_baseline_ago_ms: s
                .machine
                .user_baseline()
                .map(|(_, since)| now.saturating_sub(since)),
        }
    };
    match decide(plan, split, budget, &figures, state) {
        Ok(None) => r.set_verdict(met(&figures), Some(figures), measured_s),
        Err(held) => r.set_verdict(held, Some(figures), measured_s),
        Ok(Some(m)) if r.lock().report.mode == RebalanceMode::Advise => {
            let v = format!("would move {} -> {}: {}", m.from, m.to, m.reason);
            r.set_verdict(v, Some(figures), measured_s);
        }
        Ok(Some(m)) => {
            let v = format!("moving {} -> {}: {}", m.from, m.to, m.reason);
            r.set_verdict(v, Some(figures), measured_s);
            let (from, to) = (m.from, m.to);
            r.on(Event::MoveBegun { from, to });
            let ended = act(engine, r, m, figures).await;
            // The split that runs after the move: either of its own is the rebalancer's,
            // another one was set by another change meanwhile (refused as stale).
            let fallback = if ended == MoveOutcome::Done { to } else { from };
            let split = running_split(&r.state_dir).map_or(fallback, |(s, _)| s);
            r.on(Event::MoveEnded {
                split,
                at_ms: now_ms(),
            });
            window.clear();
        }
    }
}

/// The verdict of a window some decode engine's figures could not be read in.
fn blind(missing: &std::collections::BTreeMap<(String, Unread), usize>, looks: usize) -> String {
    let which: Vec<String> = missing
        .iter()
        .map(|((url, why), n)| {
            let why = match why {
                Unread::NoAnswer => "did not answer in time",
                Unread::NoHistogram => "answered without an inter-token histogram",
            };
            format!("the /metrics of {url} {why} at {n} of {looks} looks")
        })
        .collect();
    format!("blind: {}; no move on figures not read", which.join(", "))
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
        if let Err(e) = &page {
            tracing::debug!("rebalance: {e}");
        }
        sample.add_engine(url, page.as_deref().ok());
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
    let mut s = r.lock();
    s.report.moves_total += 1;
    s.report.moves_counted.count(m.toward, ended);
    s.records.push(record.clone());
    let excess = s.records.len().saturating_sub(RECENT_MOVES);
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
    fn act_said_again_gives_a_kept_user_baseline_back_and_keeps_that() {
        use super::super::machine::Phase;
        let dir = tempfile::tempdir().unwrap();
        let split = Split {
            prefill: 2,
            decode: 3,
        };
        let kept = Machine {
            phase: Phase::UserBaseline { split, since_ms: 1 },
            budget_split: Some(split),
        };
        kept.write(dir.path()).unwrap();
        let plan = RebalancePlan {
            table: toml::from_str("ttft_p90_ms = 200\nmode = \"act\"\n").unwrap(),
            prefill_gpus: 1,
            decode_gpus: 1,
        };
        let r = Rebalancer::new(Some(plan), split, dir.path().to_path_buf());
        assert_eq!(r.lock().machine, kept, "read back at start");
        let said = r.set_mode(RebalanceMode::Advise).unwrap();
        assert_eq!(said, "rebalance: mode advise (was act)");
        assert_eq!(Machine::read(dir.path()), kept, "advise gives nothing back");
        let said = r.set_mode(RebalanceMode::Act).unwrap();
        assert_eq!(
            said,
            "rebalance: mode act (was advise); the split another change set is judged again"
        );
        assert_eq!(
            Machine::read(dir.path()).phase,
            Phase::Starting {
                left: Some(split),
                moving_to: None
            },
            "kept as the rebalancer's (watched) split"
        );
    }

    #[test]
    fn looks_come_six_times_a_window_within_1_to_5_s() {
        assert_eq!(tick(30), Duration::from_secs(5));
        assert_eq!(tick(12), Duration::from_secs(2));
        assert_eq!(tick(3), Duration::from_secs(1));
    }
}
