//! The rebalancer's judgement, as a pure function: the window's figures, the split that
//! runs, the table's objectives, bounds and budget, and the cluster's state in, no move
//! or one move (one instance from one role to the other, or one more of a role while the
//! budget has room) with its reason out. No clock, no I/O: every rule has a unit test.

use crate::vocab::RebalancePlan;
pub use crate::vocab::{Figures, Move, Split, Toward};

/// First tokens a window needs before its TTFT p90 is judged.
pub const MIN_FIRST_TOKENS: u64 = 5;

/// What the cluster is doing besides serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct State {
    /// A change (`scale`, `apply`, a restart, a move) is running.
    pub change_running: bool,
    /// Some prefill or decode instance is not healthy.
    pub unhealthy: bool,
    /// The last move: how long ago (ms) and which way.
    pub last_move: Option<(u64, Toward)>,
}

/// The judgement: Ok(Some(move)), Ok(None) when the objectives are met or nothing can
/// help, Err(why) when a rule holds a wanted move back (the reason is shown as it is).
pub fn decide(
    plan: &RebalancePlan,
    split: Split,
    budget: Budget,
    figures: &Figures,
    state: State,
) -> Result<Option<Move>, String> {
    let t = &plan.table;
    // Long answers may put no first token in a window and still show its gaps: the
    // inter-token figure is judged on its own.
    if figures.requests == 0 && figures.itl_p90_ms.is_none() {
        return Ok(None);
    }
    let over = |v: Option<f64>, goal: Option<f64>| match (v, goal) {
        (Some(v), Some(g)) if v > g => Some(v / g),
        _ => None,
    };
    // A p90 of a handful of first tokens is one request's luck, not the traffic's.
    let ttft_miss = (figures.requests >= MIN_FIRST_TOKENS)
        .then(|| over(figures.ttft_p90_ms, t.ttft_p90_ms))
        .flatten();
    let itl_miss = over(figures.itl_p90_ms, t.itl_p90_ms);
    let toward = match (ttft_miss, itl_miss) {
        (None, None) => return Ok(None),
        (Some(_), None) => Toward::Prefill,
        (None, Some(_)) => Toward::Decode,
        // Both missed: help the one missed by more; the busier role breaks a tie.
        (Some(a), Some(b)) if a > b => Toward::Prefill,
        (Some(a), Some(b)) if b > a => Toward::Decode,
        _ if figures.prefill_busy >= figures.decode_busy => Toward::Prefill,
        _ => Toward::Decode,
    };
    let why = reason(toward, figures, plan);
    let to = match target(split, toward, budget, plan) {
        Some(to) => to,
        None => return Err(format!("{why}, but {}", no_room(toward, split, plan))),
    };
    if state.change_running {
        return Err(format!("{why}, but a change runs: no move until it ends"));
    }
    if state.unhealthy {
        return Err(format!(
            "{why}, but an instance is not healthy: no move until every one is"
        ));
    }
    if let Some((ago_ms, last)) = state.last_move {
        let window_ms = t.window_s * 1000;
        let cooldown_ms = t.cooldown_s * 1000;
        if last != toward && ago_ms < cooldown_ms {
            return Err(format!(
                "{why}, but the last move went the other way {} s ago (cooldown_s = {})",
                ago_ms / 1000,
                t.cooldown_s
            ));
        }
        if ago_ms < window_ms {
            return Err(format!(
                "{why}, but the last move was {} s ago: its effect is judged over a whole window first (window_s = {})",
                ago_ms / 1000,
                t.window_s
            ));
        }
    }
    Ok(Some(Move {
        from: split,
        to,
        toward,
        reason: why,
    }))
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
    let (what, v, goal) = match toward {
        Toward::Prefill => ("TTFT", f.ttft_p90_ms, t.ttft_p90_ms),
        Toward::Decode => ("ITL", f.itl_p90_ms, t.itl_p90_ms),
    };
    format!(
        "{what} p90 {} ms over the {} ms objective ({}; queue P {:.1} D {:.1}; busy P {:.0}% D {:.0}%)",
        ms(v),
        ms(goal),
        requests(f.requests),
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
    fn gaps_are_judged_in_a_window_without_a_first_token() {
        let long_answers = Figures {
            requests: 0,
            ttft_p90_ms: None,
            itl_p90_ms: Some(72.0),
            ..Figures::default()
        };
        let m = run(&plan(P), s(3, 1), &long_answers, State::default())
            .unwrap()
            .unwrap();
        assert_eq!((m.to, m.toward), (s(2, 2), Toward::Decode));
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
            last_move: Some((60_000, Toward::Decode)),
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), back).unwrap_err();
        assert!(e.contains("other way 60 s ago (cooldown_s = 120)"), "{e}");
        let later = State {
            last_move: Some((121_000, Toward::Decode)),
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
            last_move: Some((10_000, Toward::Prefill)),
            ..State::default()
        };
        let e = run(&plan(P), s(2, 2), &slow_first_token(), soon).unwrap_err();
        assert!(e.contains("whole window"), "{e}");
        let after = State {
            last_move: Some((31_000, Toward::Prefill)),
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
        let f = Figures {
            requests: 9,
            ttft_p90_ms: Some(1200.0),
            itl_p90_ms: Some(150.0),
            ..Figures::default()
        };
        let m = run(&plan(P), s(2, 2), &f, State::default())
            .unwrap()
            .unwrap();
        assert_eq!(m.toward, Toward::Decode);
    }
}
