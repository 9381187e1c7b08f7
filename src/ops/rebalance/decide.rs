//! The rebalancer's judgement, as a pure function: the window's figures, the split that
//! runs, the table's objectives, bounds and budget, and the cluster's state in, no move
//! or one move (one instance from one role to the other, or one more of a role while the
//! budget has room) with its reason out. No clock, no I/O: every rule has a unit test.
//!
//! Steady by design: an objective counts as missed only past its hysteresis margin; a
//! move that takes an instance from the other role is made only when the miss it mends
//! is larger than the miss it would cause there; a move back waits `cooldown_s`, doubled
//! for each move back in a row; and with both objectives missed, a move back (or a move
//! with no instance to give) is no help: the verdict says the cluster is overloaded and
//! which budget would help, and nothing moves. Never blind: an objective without its
//! figure, or a move whose cost to the other role is not known (its figure not judged),
//! moves nothing (`blind: ...`); a split the user set moves only once `pdctl rebalance
//! act` is said again.

pub use crate::vocab::{Figures, Move, Split, Toward};
use crate::vocab::{MoveOutcome, MoveRecord, RebalancePlan};

/// First tokens (or requests with token gaps) a window needs before its TTFT (or ITL)
/// p90 is judged: a p90 of a handful is one request's luck, not the traffic's.
pub const MIN_FIRST_TOKENS: u64 = 5;

/// The hold before a move back doubles at most this many times.
const MAX_DOUBLINGS: u32 = 6;

/// What the cluster is doing besides serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct State {
    /// A change (`scale`, `apply`, a restart, a move) is running.
    pub change_running: bool,
    /// Some prefill or decode instance is not healthy.
    pub unhealthy: bool,
    /// The last move that moved the split.
    pub last_move: Option<LastMove>,
    /// How long ago (ms) another change (`pdctl scale`, `apply`) set the split that runs,
    /// while that split is the user's baseline: nothing moves it until `pdctl rebalance
    /// act` is said again.
    pub user_baseline_ago_ms: Option<u64>,
}

/// The last move as the moves' records tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastMove {
    /// How long ago (ms) its change ended.
    pub ago_ms: u64,
    pub toward: Toward,
    /// Moves back in a row up to it (0: it was no move back, or came after a quiet
    /// period): the hold before the next move back is `cooldown_s` × 2^this.
    pub reversals: u32,
}

impl LastMove {
    /// How long (ms) a move back waits after this one.
    pub fn hold_ms(&self, plan: &RebalancePlan) -> u64 {
        (plan.table.cooldown_s * 1000) << self.reversals.min(MAX_DOUBLINGS)
    }
}

/// The last move of `records` (oldest first) that moved the split, at Unix time
/// `now_ms`, with the moves back in a row up to it: a gap of `backoff_reset_s` without a
/// move starts the count again. A move whose change failed, never started or was refused
/// as stale moved nothing: it is neither a move to hold after nor a move back.
pub fn last_move_of(records: &[MoveRecord], now_ms: u64, plan: &RebalancePlan) -> Option<LastMove> {
    let reset_ms = plan.table.backoff_reset_s() * 1000;
    let mut last: Option<(u64, Toward, u32)> = None;
    let done = |r: &&MoveRecord| {
        r.outcome
            .as_deref()
            .is_some_and(|o| MoveOutcome::of(o) == MoveOutcome::Done)
    };
    for r in records.iter().filter(done) {
        let toward = r.toward();
        let ended = r.ended_ms.unwrap_or(r.at_ms);
        let reversals = match last {
            Some((end, way, n)) if r.at_ms.saturating_sub(end) <= reset_ms => {
                n + u32::from(way != toward)
            }
            _ => 0,
        };
        last = Some((ended, toward, reversals));
    }
    let (ended, toward, reversals) = last?;
    let ago_ms = now_ms.saturating_sub(ended);
    Some(LastMove {
        ago_ms,
        toward,
        reversals: if ago_ms > reset_ms { 0 } else { reversals },
    })
}

/// How far each objective is missed: the p90 over its objective (1.0: just met), None
/// when it is not judged (no objective, no figure, or too few requests for one).
fn ratios(plan: &RebalancePlan, f: &Figures) -> (Option<f64>, Option<f64>) {
    let t = &plan.table;
    let over = |n: u64, v: Option<f64>, goal: Option<f64>| match (v, goal) {
        (Some(v), Some(g)) if n >= MIN_FIRST_TOKENS => Some(v / g),
        _ => None,
    };
    (
        over(f.requests, f.ttft_p90_ms, t.ttft_p90_ms),
        over(f.itl_requests, f.itl_p90_ms, t.itl_p90_ms),
    )
}

/// Why the window cannot judge a move: an objective whose figure it has none of while
/// the other figure shows traffic (no first token, or no gap between tokens on decode).
/// None: every objective has its figure, or the window has neither (nothing to judge).
fn blind(plan: &RebalancePlan, f: &Figures) -> Option<String> {
    let t = &plan.table;
    if f.ttft_p90_ms.is_none() && f.itl_p90_ms.is_none() {
        return None;
    }
    let mut unknown = Vec::new();
    if t.ttft_p90_ms.is_some() && f.ttft_p90_ms.is_none() {
        unknown.push("no TTFT (no first token in the window)".to_string());
    }
    if t.itl_p90_ms.is_some() && f.itl_p90_ms.is_none() {
        unknown.push(format!(
            "no ITL (no gap between tokens read on decode, {})",
            requests(f.itl_requests)
        ));
    }
    (!unknown.is_empty()).then(|| {
        format!(
            "blind: {}; no move on a figure not read",
            unknown.join(", ")
        )
    })
}

/// The role the figures ask for (None: both objectives met or not judged): the one whose
/// objective is missed past the hysteresis margin; both missed, the one missed by more
/// (the busier role on a tie).
fn wanted(
    plan: &RebalancePlan,
    f: &Figures,
    ttft: Option<f64>,
    itl: Option<f64>,
) -> Option<Toward> {
    let margin = 1.0 + plan.table.hysteresis_pct / 100.0;
    let missed = |r: Option<f64>| r.filter(|r| *r > margin);
    Some(match (missed(ttft), missed(itl)) {
        (None, None) => return None,
        (Some(_), None) => Toward::Prefill,
        (None, Some(_)) => Toward::Decode,
        (Some(a), Some(b)) if a > b => Toward::Prefill,
        (Some(a), Some(b)) if b > a => Toward::Decode,
        _ if f.prefill_busy >= f.decode_busy => Toward::Prefill,
        _ => Toward::Decode,
    })
}

/// The judgement: Ok(Some(move)), Ok(None) when the objectives are met or not judged,
/// Err(verdict) when the figures are blind (`blind: ...`), a rule holds a wanted move
/// back (`held: ...`) or no move can help (`overloaded: ...`); the verdict is shown as it
/// is.
pub fn decide(
    plan: &RebalancePlan,
    split: Split,
    budget: Budget,
    figures: &Figures,
    state: State,
) -> Result<Option<Move>, String> {
    if let Some(blind) = blind(plan, figures) {
        return Err(blind);
    }
    let (ttft, itl) = ratios(plan, figures);
    let Some(toward) = wanted(plan, figures, ttft, itl) else {
        return Ok(None);
    };
    let margin = 1.0 + plan.table.hysteresis_pct / 100.0;
    let both = ttft.is_some_and(|r| r > margin) && itl.is_some_and(|r| r > margin);
    let why = reason(toward, figures, plan);
    let back = state.last_move.is_some_and(|l| l.toward != toward);
    let to = target(split, toward, budget, plan);
    let cost = to.map_or(Cost::Mends, |to| {
        cost_of(split, to, toward, figures, (ttft, itl), plan)
    });
    // Both missed: a move back, a move with no instance to give, or one that costs the
    // other role more than it mends only shifts the miss; more instances would help.
    if both && (back || to.is_none() || cost != Cost::Mends) {
        return Err(overloaded(split, toward, budget, figures, plan));
    }
    let Some(to) = to else {
        return Err(format!("held: {why}, but {}", no_room(toward, split, plan)));
    };
    if let Cost::Unknown(unknown) = &cost {
        return Err(format!(
            "blind: {why}, but {unknown}; no move on a figure not read"
        ));
    }
    if let Some(rule) = held_by(plan, split, cost, state, back) {
        return Err(format!("held: {why}, but {rule}"));
    }
    Ok(Some(Move {
        from: split,
        to,
        toward,
        reason: why,
    }))
}

/// The rule that holds a wanted move from `split` back, in words (None: none does).
fn held_by(
    plan: &RebalancePlan,
    split: Split,
    cost: Cost,
    state: State,
    back: bool,
) -> Option<String> {
    let t = &plan.table;
    if state.change_running {
        return Some("a change runs: no move until it ends".into());
    }
    if state.unhealthy {
        return Some("an instance is not healthy: no move until every one is".into());
    }
    if let Cost::More(why) | Cost::Unknown(why) = cost {
        return Some(why);
    }
    if let Some(ago) = state.user_baseline_ago_ms {
        return Some(format!(
            "the split {split} was set by another change {} s ago (`pdctl scale`, `apply`): it is the user's baseline, not moved until `pdctl rebalance act` is said again",
            ago / 1000
        ));
    }
    let last = state.last_move?;
    let hold_ms = last.hold_ms(plan);
    if back && last.ago_ms < hold_ms {
        let doubled = if last.reversals > 0 {
            format!(
                "; {} s after {} move{} back in a row",
                hold_ms / 1000,
                last.reversals,
                if last.reversals == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        };
        return Some(format!(
            "the last move went the other way {} s ago (cooldown_s = {}{doubled})",
            last.ago_ms / 1000,
            t.cooldown_s
        ));
    }
    (last.ago_ms < t.window_s * 1000).then(|| {
        format!(
            "the last move was {} s ago: its effect is judged over a whole window first (window_s = {})",
            last.ago_ms / 1000,
            t.window_s
        )
    })
}

/// What a move costs the role it takes an instance from.
#[derive(Debug, Clone, PartialEq)]
enum Cost {
    /// Less than it mends, or nothing (it takes no instance, or that role has no
    /// objective).
    Mends,
    /// More than it mends: why, in words.
    More(String),
    /// Not known: that role's figure is not judged (too few requests); the look is blind
    /// to it.
    Unknown(String),
}

/// What moving from `split` to `to` costs the role it takes an instance from. That
/// role's figure rises about in proportion to its instances (its load on one fewer); the
/// move helps only when the miss it mends is larger than the miss it would cause, and is
/// not made when that role's figure is not judged (its cost unknown).
fn cost_of(
    split: Split,
    to: Split,
    toward: Toward,
    f: &Figures,
    (ttft, itl): (Option<f64>, Option<f64>),
    plan: &RebalancePlan,
) -> Cost {
    let t = &plan.table;
    let (mended, donor, (had, left), role, what, goal, n) = match toward {
        Toward::Prefill => (
            ttft,
            itl,
            (split.decode, to.decode),
            "decode",
            "ITL",
            t.itl_p90_ms,
            format!("{} on decode", requests(f.itl_requests)),
        ),
        Toward::Decode => (
            itl,
            ttft,
            (split.prefill, to.prefill),
            "prefill",
            "TTFT",
            t.ttft_p90_ms,
            requests(f.requests),
        ),
    };
    if left >= had || left == 0 || goal.is_none() {
        return Cost::Mends;
    }
    let Some(donor) = donor else {
        return Cost::Unknown(format!(
            "what one {role} fewer would cost is not known: {what} p90 is not judged ({n} in the window, {MIN_FIRST_TOKENS} needed)"
        ));
    };
    let cost = donor * f64::from(had) / f64::from(left);
    let mends = mended.unwrap_or(0.0);
    if cost > 1.0 && cost >= mends {
        return Cost::More(format!(
            "one {role} fewer would put {what} p90 at about {cost:.1}× its objective, more than the {mends:.1}× it would mend"
        ));
    }
    Cost::Mends
}

/// The verdict when both objectives are missed and no move helps: which budget would.
fn overloaded(
    split: Split,
    toward: Toward,
    budget: Budget,
    f: &Figures,
    plan: &RebalancePlan,
) -> String {
    let t = &plan.table;
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let grown = match toward {
        Toward::Prefill => Split {
            prefill: split.prefill + 1,
            ..split
        },
        Toward::Decode => Split {
            decode: split.decode + 1,
            ..split
        },
    };
    let role = match toward {
        Toward::Prefill => "prefill",
        Toward::Decode => "decode",
    };
    let help = match budget {
        Budget::Gpus(_) => format!(
            "gpu_budget = {} (one more {role}: {grown})",
            grown.prefill * plan.prefill_gpus + grown.decode * plan.decode_gpus
        ),
        Budget::Instances(_) => format!(
            "budget = {} (one more {role}: {grown})",
            grown.prefill + grown.decode
        ),
    };
    format!(
        "overloaded: both objectives missed; more instances needed, not a move: TTFT p90 {} ms over the {} ms objective ({}), ITL p90 {} ms over the {} ms ({} on decode); {help} would help",
        ms(f.ttft_p90_ms),
        ms(t.ttft_p90_ms),
        requests(f.requests),
        ms(f.itl_p90_ms),
        ms(t.itl_p90_ms),
        requests(f.itl_requests),
    )
}

/// How many instances (or GPUs) the two roles may share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Instances(u32),
    Gpus(u32),
}

impl Budget {
    /// The table's budget, or what `split` takes when it names none.
    pub fn of(plan: &RebalancePlan, split: Split) -> Budget {
        match (plan.table.budget, plan.table.gpu_budget) {
            (Some(b), _) => Budget::Instances(b),
            (_, Some(g)) => Budget::Gpus(g),
            _ => Budget::Instances(split.prefill + split.decode),
        }
    }

    fn fits(self, s: Split, plan: &RebalancePlan) -> bool {
        match self {
            Budget::Instances(b) => s.prefill + s.decode <= b,
            Budget::Gpus(g) => s.prefill * plan.prefill_gpus + s.decode * plan.decode_gpus <= g,
        }
    }
}

/// The split one step `toward` a role: one more of it while the budget has room, else
/// one taken from the other role while it stays within its bound.
fn target(s: Split, toward: Toward, budget: Budget, plan: &RebalancePlan) -> Option<Split> {
    let t = &plan.table;
    let (grown, moved) = match toward {
        Toward::Prefill => (
            Split {
                prefill: s.prefill + 1,
                ..s
            },
            (s.decode > t.min_decode).then(|| Split {
                prefill: s.prefill + 1,
                decode: s.decode - 1,
            }),
        ),
        Toward::Decode => (
            Split {
                decode: s.decode + 1,
                ..s
            },
            (s.prefill > t.min_prefill).then(|| Split {
                prefill: s.prefill - 1,
                decode: s.decode + 1,
            }),
        ),
    };
    if budget.fits(grown, plan) {
        return Some(grown);
    }
    moved.filter(|m| budget.fits(*m, plan))
}

fn no_room(toward: Toward, s: Split, plan: &RebalancePlan) -> String {
    let (role, n, min) = match toward {
        Toward::Prefill => ("decode", s.decode, plan.table.min_decode),
        Toward::Decode => ("prefill", s.prefill, plan.table.min_prefill),
    };
    format!("{role} has no instance to give ({n}, min_{role} = {min}) and the budget no room")
}

/// `1 request`, `16 requests`: first tokens in the window.
pub fn requests(n: u64) -> String {
    format!("{n} request{}", if n == 1 { "" } else { "s" })
}

fn reason(toward: Toward, f: &Figures, plan: &RebalancePlan) -> String {
    let t = &plan.table;
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let (what, v, goal, n) = match toward {
        Toward::Prefill => ("TTFT", f.ttft_p90_ms, t.ttft_p90_ms, requests(f.requests)),
        Toward::Decode => (
            "ITL",
            f.itl_p90_ms,
            t.itl_p90_ms,
            format!("{} on decode", requests(f.itl_requests)),
        ),
    };
    format!(
        "{what} p90 {} ms over the {} ms objective ({n}; queue P {:.1} D {:.1}; busy P {:.0}% D {:.0}%)",
        ms(v),
        ms(goal),
        f.prefill_queue,
        f.decode_queue,
        f.prefill_busy * 100.0,
        f.decode_busy * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Rebalance;

    fn plan(text: &str) -> RebalancePlan {
        RebalancePlan {
            table: toml::from_str::<Rebalance>(text).unwrap(),
            prefill_gpus: 1,
            decode_gpus: 2,
        }
    }

    fn s(prefill: u32, decode: u32) -> Split {
        Split { prefill, decode }
    }

    fn slow_first_token() -> Figures {
        Figures {
            requests: 40,
            ttft_p90_ms: Some(3000.0),
            itl_p90_ms: Some(20.0),
            itl_requests: 40,
            ..Figures::default()
        }
    }

    const P: &str = "ttft_p90_ms = 1000\nitl_p90_ms = 50\nwindow_s = 30\ncooldown_s = 120\n";

    fn run(
        p: &RebalancePlan,
        split: Split,
        f: &Figures,
        st: State,
    ) -> Result<Option<Move>, String> {
        decide(p, split, Budget::of(p, split), f, st)
    }

    #[test]
    fn a_missed_ttft_moves_a_decode_to_prefill() {
        let m = run(&plan(P), s(2, 2), &slow_first_token(), State::default())
            .unwrap()
            .unwrap();
        assert_eq!(
            (m.from, m.to, m.toward),
            (s(2, 2), s(3, 1), Toward::Prefill)
        );
        assert!(
            m.reason.contains("TTFT p90 3000 ms over the 1000 ms"),
            "{}",
            m.reason
        );
    }

    #[test]
    fn a_missed_itl_moves_a_prefill_to_decode() {
        let f = Figures {
            requests: 5,
            ttft_p90_ms: Some(100.0),
            itl_p90_ms: Some(80.0),
            itl_requests: 5,
            ..Figures::default()
        };
        let m = run(&plan(P), s(2, 2), &f, State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.to, s(1, 3));
    }

    #[test]
    fn met_objectives_or_no_traffic_move_nothing() {
        let mut f = slow_first_token();
        f.ttft_p90_ms = Some(900.0);
        assert_eq!(run(&plan(P), s(2, 2), &f, State::default()), Ok(None));
        let idle = Figures::default();
        assert_eq!(run(&plan(P), s(2, 2), &idle, State::default()), Ok(None));
    }

    #[test]
    fn a_ttft_of_too_few_first_tokens_is_not_judged() {
        let mut f = slow_first_token();
        f.requests = MIN_FIRST_TOKENS - 1;
        assert_eq!(run(&plan(P), s(2, 2), &f, State::default()), Ok(None));
        f.requests = MIN_FIRST_TOKENS;
        assert!(
            run(&plan(P), s(2, 2), &f, State::default())
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn a_window_without_a_first_token_is_blind_and_holds() {
        // Long answers: gaps on decode, no first token. The TTFT a move toward decode
        // would cost is not known: before, it read as costing nothing and moved.
        let long_answers = Figures {
            requests: 0,
            ttft_p90_ms: None,
            itl_p90_ms: Some(72.0),
            itl_requests: 9,
            ..Figures::default()
        };
        let e = run(&plan(P), s(3, 1), &long_answers, State::default()).unwrap_err();
        assert_eq!(
            e,
            "blind: no TTFT (no first token in the window); no move on a figure not read"
        );
    }

    #[test]
    fn a_missing_itl_figure_is_blind_never_a_free_move() {
        // TTFT missed, no gap read on decode (an engine without the histogram, requests
        // of one token): before, `costs_more` read the unknown ITL as a move costing
        // nothing, and decodes went to prefill one window at a time.
        let mut f = slow_first_token();
        f.itl_p90_ms = None;
        let e = run(&plan(P), s(2, 2), &f, State::default()).unwrap_err();
        assert_eq!(
            e,
            "blind: no ITL (no gap between tokens read on decode, 40 requests); no move on a figure not read"
        );
        // A table without an ITL objective has nothing to be blind to.
        let ttft_only = plan("ttft_p90_ms = 1000\nwindow_s = 30\n");
        assert!(
            run(&ttft_only, s(2, 2), &f, State::default())
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn a_donor_figure_of_too_few_requests_is_blind_to_the_moves_cost() {
        let mut f = slow_first_token();
        f.itl_requests = 2;
        let e = run(&plan(P), s(2, 2), &f, State::default()).unwrap_err();
        assert!(
            e.starts_with("blind: TTFT p90 3000 ms over the 1000 ms objective")
                && e.ends_with("but what one decode fewer would cost is not known: ITL p90 is not judged (2 requests on decode in the window, 5 needed); no move on a figure not read"),
            "{e}"
        );
        // A move that takes no instance (the budget has room) costs decode nothing.
        let roomy = plan(&format!("{P}budget = 5\n"));
        let m = run(&roomy, s(2, 2), &f, State::default()).unwrap().unwrap();
        assert_eq!(m.to, s(3, 2));
    }

    #[test]
    fn never_below_a_bound() {
        let p = plan(&format!("{P}min_decode = 2\n"));
        let e = run(&p, s(2, 2), &slow_first_token(), State::default()).unwrap_err();
        assert!(
            e.contains("decode has no instance to give (2, min_decode = 2)"),
            "{e}"
        );
    }

    #[test]
    fn a_budget_with_room_grows_the_role_instead() {
        let p = plan(&format!("{P}budget = 5\n"));
        let m = run(&p, s(2, 2), &slow_first_token(), State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.to, s(3, 2));
        // GPUs: a decode takes 2 here, so 2P2D (6 GPUs) of 7 has room for one prefill.
        let p = plan(&format!("{P}gpu_budget = 7\n"));
        let m = run(&p, s(2, 2), &slow_first_token(), State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.to, s(3, 2));
    }

    #[test]
    fn no_move_while_a_change_runs_or_an_instance_is_unhealthy() {
        let busy = State {
            change_running: true,
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), busy).unwrap_err();
        assert!(e.contains("a change runs"), "{e}");
        let sick = State {
            unhealthy: true,
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), sick).unwrap_err();
        assert!(e.contains("not healthy"), "{e}");
    }

    #[test]
    fn no_move_back_within_the_cooldown() {
        let back = State {
            last_move: Some(last(60_000, Toward::Decode, 0)),
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), back).unwrap_err();
        assert!(e.contains("other way 60 s ago (cooldown_s = 120)"), "{e}");
        let later = State {
            last_move: Some(last(121_000, Toward::Decode, 0)),
            ..State::default()
        };
        assert!(
            run(&plan(P), s(2, 2), &slow_first_token(), later)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn the_same_way_again_waits_one_window() {
        let soon = State {
            last_move: Some(last(10_000, Toward::Prefill, 0)),
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), soon).unwrap_err();
        assert!(e.contains("whole window"), "{e}");
        let after = State {
            last_move: Some(last(31_000, Toward::Prefill, 0)),
            ..State::default()
        };
        assert!(
            run(&plan(P), s(2, 2), &slow_first_token(), after)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn both_missed_helps_the_one_missed_by_more() {
        // ITL 3× its objective, TTFT 1.2×: one prefill fewer (2 -> 1) would put TTFT
        // at 2.4×, less than the 3× mended.
        let f = Figures {
            requests: 9,
            ttft_p90_ms: Some(1200.0),
            itl_p90_ms: Some(150.0),
            itl_requests: 9,
            ..Figures::default()
        };
        let m = run(&plan(P), s(2, 2), &f, State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.toward, Toward::Decode);
        assert!(m.reason.contains("(9 requests on decode;"), "{}", m.reason);
    }

    fn last(ago_ms: u64, toward: Toward, reversals: u32) -> LastMove {
        LastMove {
            ago_ms,
            toward,
            reversals,
        }
    }

    #[test]
    fn an_itl_of_too_few_requests_is_not_judged() {
        let f = Figures {
            requests: 9,
            ttft_p90_ms: Some(100.0),
            itl_p90_ms: Some(195.0),
            itl_requests: MIN_FIRST_TOKENS - 1,
            ..Figures::default()
        };
        assert_eq!(run(&plan(P), s(3, 1), &f, State::default()), Ok(None));
    }

    #[test]
    fn a_miss_within_the_hysteresis_margin_moves_nothing() {
        // 1000 ms objective, 10 % margin by default: 1090 ms is no miss, 1110 ms is.
        let mut f = slow_first_token();
        f.ttft_p90_ms = Some(1090.0);
        assert_eq!(run(&plan(P), s(2, 2), &f, State::default()), Ok(None));
        f.ttft_p90_ms = Some(1110.0);
        assert!(
            run(&plan(P), s(2, 2), &f, State::default())
                .unwrap()
                .is_some()
        );
        let p = plan(&format!("{P}hysteresis_pct = 20\n"));
        assert_eq!(run(&p, s(2, 2), &f, State::default()), Ok(None));
    }

    #[test]
    fn a_move_that_would_cause_a_larger_miss_than_it_mends_is_held() {
        // TTFT 1.5× its objective; ITL 0.9× on two decodes would be 1.8× on one.
        let f = Figures {
            requests: 20,
            ttft_p90_ms: Some(1500.0),
            itl_p90_ms: Some(45.0),
            itl_requests: 20,
            ..Figures::default()
        };
        let e = run(&plan(P), s(2, 2), &f, State::default()).unwrap_err();
        assert!(
            e.starts_with("held: TTFT p90 1500 ms")
                && e.contains("one decode fewer would put ITL p90 at about 1.8× its objective, more than the 1.5× it would mend"),
            "{e}"
        );
        // With three decodes, one fewer costs 1.35×: the move helps.
        let m = run(&plan(P), s(2, 3), &f, State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.to, s(3, 2));
    }

    #[test]
    fn both_missed_and_the_move_back_asked_is_overloaded() {
        let f = Figures {
            requests: 30,
            ttft_p90_ms: Some(3000.0),
            itl_p90_ms: Some(100.0),
            itl_requests: 30,
            ..Figures::default()
        };
        // The last move went toward decode; the figures ask for prefill back.
        let st = State {
            last_move: Some(last(600_000, Toward::Decode, 0)),
            ..State::default()
        };
        let e = run(&plan(P), s(1, 3), &f, st).unwrap_err();
        assert!(
            e.starts_with("overloaded: both objectives missed; more instances needed, not a move: TTFT p90 3000 ms over the 1000 ms objective"),
            "{e}"
        );
        assert!(
            e.ends_with("budget = 5 (one more prefill: 2P3D) would help"),
            "{e}"
        );
        let g = plan(&format!("{P}gpu_budget = 7\n"));
        let e = run(&g, s(1, 3), &f, st).unwrap_err();
        assert!(
            e.ends_with("gpu_budget = 8 (one more prefill: 2P3D) would help"),
            "{e}"
        );
        // Both missed and no instance to give: overloaded too.
        let e = run(&plan(P), s(3, 1), &f, State::default()).unwrap_err();
        assert!(e.starts_with("overloaded:"), "{e}");
    }

    #[test]
    fn moves_back_in_a_row_double_the_hold() {
        let p = plan(P);
        let itl = Figures {
            requests: 9,
            ttft_p90_ms: Some(100.0),
            itl_p90_ms: Some(80.0),
            itl_requests: 9,
            ..Figures::default()
        };
        // After 2 moves back in a row the hold is 4 × 120 s.
        let st = |ago| State {
            last_move: Some(last(ago, Toward::Prefill, 2)),
            ..State::default()
        };
        let e = run(&p, s(3, 1), &itl, st(300_000)).unwrap_err();
        assert!(
            e.contains("other way 300 s ago (cooldown_s = 120; 480 s after 2 moves back in a row)"),
            "{e}"
        );
        assert!(run(&p, s(3, 1), &itl, st(481_000)).unwrap().is_some());
    }

    #[test]
    fn a_split_set_by_the_user_is_not_moved_however_long_ago() {
        // Before, it was left alone for `cooldown_s` only, then reverted.
        for ago_ms in [30_000, 121_000, 10 * 3_600_000] {
            let st = State {
                user_baseline_ago_ms: Some(ago_ms),
                ..State::default()
            };
            let e = run(&plan(P), s(2, 3), &slow_first_token(), st).unwrap_err();
            assert!(
                e.contains(&format!(
                    "but the split 2P3D was set by another change {} s ago",
                    ago_ms / 1000
                )) && e.ends_with(
                    "it is the user's baseline, not moved until `pdctl rebalance act` is said again"
                ),
                "{e}"
            );
        }
    }

    fn record(at_s: u64, from: Split, to: Split, outcome: &str) -> MoveRecord {
        MoveRecord {
            at_ms: at_s * 1000,
            from,
            to,
            reason: String::new(),
            figures: Figures::default(),
            outcome: Some(outcome.into()),
            ended_ms: Some(at_s * 1000 + 2000),
        }
    }

    #[test]
    fn the_last_move_and_its_hold_are_read_from_the_records() {
        // cooldown 120 s: moves back reset after 480 s without a move.
        let p = plan(P);
        let (a, b) = (s(2, 2), s(3, 1));
        let recs = vec![
            record(0, a, b, "done (0): ok"),
            record(200, b, a, "done (0): ok"),
            record(300, a, b, "done (0): ok"),
        ];
        let l = last_move_of(&recs, 302_000 + 5_000, &p).unwrap();
        assert_eq!(l, last(5_000, Toward::Prefill, 2));
        assert_eq!(l.hold_ms(&p), 480_000);
        // A quiet period resets the count.
        let l = last_move_of(&recs, 302_000 + 481_000, &p).unwrap();
        assert_eq!(l.reversals, 0);
        let mut later = recs.clone();
        later.push(record(2000, b, a, "done (0): ok"));
        let l = last_move_of(&later, 2_010_000, &p).unwrap();
        assert_eq!(l, last(8_000, Toward::Decode, 0));
        assert_eq!(last_move_of(&[], 1, &p), None);
    }

    #[test]
    fn moves_that_moved_nothing_are_no_move_and_no_reversal() {
        // Failed, never started, refused as stale: the split stayed, so none is a move
        // back nor a move to hold after (before, a failed one doubled the next hold).
        let p = plan(P);
        let (a, b) = (s(2, 2), s(3, 1));
        let recs = vec![
            record(0, a, b, "done (0): ok"),
            record(200, b, a, "failed (1): decode-2 did not start"),
            record(250, b, a, "not started: another change runs"),
            record(300, b, a, "not started: refused as stale: ..."),
        ];
        let l = last_move_of(&recs, 310_000, &p).unwrap();
        assert_eq!(l, last(308_000, Toward::Prefill, 0));
        assert_eq!(l.hold_ms(&p), 120_000);
        assert_eq!(last_move_of(&recs[1..], 310_000, &p), None);
    }
}
