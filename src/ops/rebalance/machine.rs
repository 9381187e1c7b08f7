//! The rebalancer's state machine: whose split runs, in one enum, and every way from one
//! state to another in one `match` ([`Machine::on`]). The loop ([`super::run`]) feeds it
//! what it sees (the split read at a look, `pdctl rebalance act`, a move begun and
//! ended) and does what the transition says (empty the window, log); the state is
//! written to [`STATE_FILE`] in the state dir at each change of it, so a restarted head
//! takes up where the last one was: a user's split stays the user's.
//!
//! ```text
//!  Starting --seen(s), s the split left (or none kept)-----------> Watching(s)
//!  Starting --seen(s), another split than the one left-----------> UserBaseline(s)
//!  Watching(k) --seen(s), s != k--------------------------------> UserBaseline(s)
//!  Watching(k) --move begun k -> t------------------------------> Moving(k -> t)
//!  Moving(f -> t) --move ended, s in {f, t} runs----------------> Watching(s)
//!  Moving(f -> t) --move ended, another split runs--------------> UserBaseline(s)
//!  UserBaseline(k) --seen(s), s != k----------------------------> UserBaseline(s)
//!  UserBaseline(k) --`pdctl rebalance act`----------------------> Watching(k)
//!  anything else -----------------------------------------------> unchanged
//! ```

use super::decide::Split;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The file in the state dir the machine's state is kept in (one JSON object).
pub const STATE_FILE: &str = "rebalance-state.json";

/// Whose split runs, as far as the rebalancer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Phase {
    /// The split is not read yet. `left`: the split the rebalancer saw or left last
    /// (kept from a previous run; None: it never ran here); `moving_to`: the split of a
    /// move whose end that run did not see.
    Starting {
        left: Option<Split>,
        moving_to: Option<Split>,
    },
    /// The split is the rebalancer's (the one it started on, or its moves'): it judges
    /// and may move.
    Watching { split: Split },
    /// A move's change runs, from `from` to `to`.
    Moving { from: Split, to: Split },
    /// Another change (`pdctl scale`, `apply`, `tune`) set this split at `since_ms` (Unix
    /// ms): the user's baseline, never moved until `pdctl rebalance act` is said again.
    UserBaseline { split: Split, since_ms: u64 },
}

/// What the loop saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The split the running plan has, read at a look (at Unix ms `at_ms`).
    Seen { split: Split, at_ms: u64 },
    /// `pdctl rebalance act` was said.
    ActSaid,
    /// A move's change was handed to the operations engine.
    MoveBegun { from: Split, to: Split },
    /// That change ended; `split` runs now (at Unix ms `at_ms`).
    MoveEnded { split: Split, at_ms: u64 },
}

/// What a transition asks of the loop besides the new state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Nothing.
    None,
    /// Another change set the split (`was`: the one before, when known): the window's
    /// figures judge another split (empty it) and the budget is re-read from this one.
    UserSplit { was: Option<Split> },
    /// The user's baseline is given back to the rebalancer.
    Released,
}

/// The state and the split the budget is taken from when the table names none (the first
/// split read, then each one another change set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    pub phase: Phase,
    pub budget_split: Option<Split>,
}

impl Default for Machine {
    fn default() -> Self {
        Machine {
            phase: Phase::Starting {
                left: None,
                moving_to: None,
            },
            budget_split: None,
        }
    }
}

impl Machine {
    /// Every transition: the state `event` leads to from this one, and what the loop does.
    pub fn on(self, event: Event) -> (Machine, Effect) {
        use Event::*;
        use Phase::*;
        let user = |split, since_ms, was| {
            let m = Machine {
                phase: UserBaseline { split, since_ms },
                budget_split: Some(split),
            };
            (m, Effect::UserSplit { was })
        };
        let watching = |split| Machine {
            phase: Watching { split },
            budget_split: self.budget_split.or(Some(split)),
        };
        match (self.phase, event) {
            (Starting { left, moving_to }, Seen { split, at_ms }) => {
                if left.is_none_or(|l| l == split) || moving_to == Some(split) {
                    (watching(split), Effect::None)
                } else {
                    user(split, at_ms, left)
                }
            }
            (Watching { split: k }, Seen { split, at_ms }) if split != k => {
                user(split, at_ms, Some(k))
            }
            (Watching { split: k }, MoveBegun { from, to }) if from == k => {
                let phase = Moving { from, to };
                (Machine { phase, ..self }, Effect::None)
            }
            (Moving { from, to }, MoveEnded { split, .. }) if split == from || split == to => {
                (watching(split), Effect::None)
            }
            (Moving { from, .. }, MoveEnded { split, at_ms }) => user(split, at_ms, Some(from)),
            (UserBaseline { split: k, .. }, Seen { split, at_ms }) if split != k => {
                user(split, at_ms, Some(k))
            }
            (UserBaseline { split, .. }, ActSaid) => (watching(split), Effect::Released),
            _ => (self, Effect::None),
        }
    }

    /// The split the rebalancer knows runs (None: not read yet).
    pub fn split(&self) -> Option<Split> {
        match self.phase {
            Phase::Starting { .. } => None,
            Phase::Watching { split } | Phase::UserBaseline { split, .. } => Some(split),
            Phase::Moving { from, .. } => Some(from),
        }
    }

    /// The user's baseline and since when (Unix ms), while there is one.
    pub fn user_baseline(&self) -> Option<(Split, u64)> {
        match self.phase {
            Phase::UserBaseline { split, since_ms } => Some((split, since_ms)),
            _ => None,
        }
    }

    /// The state a previous run kept in `state_dir`, as this run starts from it: a user's
    /// baseline stays one; any other state becomes [`Phase::Starting`] with the split it
    /// knew (a file that is not there or does not read: as on a first start).
    pub fn read(state_dir: &Path) -> Machine {
        let previous: Option<Machine> = std::fs::read_to_string(state_dir.join(STATE_FILE))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok());
        let Some(previous) = previous else {
            return Machine::default();
        };
        let phase = match previous.phase {
            Phase::UserBaseline { .. } => previous.phase,
            Phase::Starting { left, moving_to } => Phase::Starting { left, moving_to },
            Phase::Watching { split } => Phase::Starting {
                left: Some(split),
                moving_to: None,
            },
            Phase::Moving { from, to } => Phase::Starting {
                left: Some(from),
                moving_to: Some(to),
            },
        };
        Machine { phase, ..previous }
    }

    /// Keeps the state in `state_dir` (written aside, then renamed over the old one).
    pub fn write(&self, state_dir: &Path) -> std::io::Result<()> {
        let path = state_dir.join(STATE_FILE);
        let aside = state_dir.join(format!("{STATE_FILE}.new"));
        let text = serde_json::to_string(self).map_err(std::io::Error::other)?;
        std::fs::write(&aside, text)?;
        std::fs::rename(&aside, &path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(prefill: u32, decode: u32) -> Split {
        Split { prefill, decode }
    }

    fn at(phase: Phase) -> Machine {
        Machine {
            phase,
            budget_split: Some(s(2, 2)),
        }
    }

    fn seen(split: Split) -> Event {
        Event::Seen { split, at_ms: 7 }
    }

    #[test]
    fn a_first_start_watches_the_split_it_reads_and_takes_its_budget() {
        let (m, e) = Machine::default().on(seen(s(2, 2)));
        assert_eq!(m.phase, Phase::Watching { split: s(2, 2) });
        assert_eq!((m.budget_split, e), (Some(s(2, 2)), Effect::None));
    }

    #[test]
    fn a_restart_on_the_split_left_or_moved_to_watches_it() {
        let starting = at(Phase::Starting {
            left: Some(s(2, 2)),
            moving_to: Some(s(3, 1)),
        });
        for split in [s(2, 2), s(3, 1)] {
            let (m, e) = starting.on(seen(split));
            assert_eq!((m.phase, e), (Phase::Watching { split }, Effect::None));
        }
    }

    #[test]
    fn a_restart_on_another_split_than_the_one_left_is_the_users() {
        let starting = at(Phase::Starting {
            left: Some(s(2, 2)),
            moving_to: None,
        });
        let (m, e) = starting.on(seen(s(2, 3)));
        assert_eq!(m.user_baseline(), Some((s(2, 3), 7)));
        assert_eq!(e, Effect::UserSplit { was: Some(s(2, 2)) });
        assert_eq!(m.budget_split, Some(s(2, 3)));
    }

    #[test]
    fn another_split_while_watching_is_the_users_new_baseline() {
        let w = at(Phase::Watching { split: s(2, 2) });
        assert_eq!(w.on(seen(s(2, 2))), (w, Effect::None));
        let (m, e) = w.on(seen(s(2, 3)));
        assert_eq!(m.user_baseline(), Some((s(2, 3), 7)));
        assert_eq!(
            (m.budget_split, e),
            (Some(s(2, 3)), Effect::UserSplit { was: Some(s(2, 2)) })
        );
    }

    #[test]
    fn a_move_begun_on_the_split_watched_is_moving() {
        let w = at(Phase::Watching { split: s(2, 2) });
        let (m, _) = w.on(Event::MoveBegun {
            from: s(2, 2),
            to: s(3, 1),
        });
        assert_eq!(
            m.phase,
            Phase::Moving {
                from: s(2, 2),
                to: s(3, 1)
            }
        );
        // Not from the split watched, or not watching: no move.
        let other = Event::MoveBegun {
            from: s(1, 3),
            to: s(2, 2),
        };
        assert_eq!(w.on(other).0, w);
        let u = at(Phase::UserBaseline {
            split: s(2, 2),
            since_ms: 1,
        });
        assert_eq!(u.on(other).0, u);
    }

    #[test]
    fn a_move_ended_on_either_of_its_splits_is_watched_another_is_the_users() {
        let moving = at(Phase::Moving {
            from: s(2, 2),
            to: s(3, 1),
        });
        let ended = |split| Event::MoveEnded { split, at_ms: 9 };
        // Done, or failed / not started / refused (the split it found).
        for split in [s(3, 1), s(2, 2)] {
            assert_eq!(
                moving.on(ended(split)),
                (at(Phase::Watching { split }), Effect::None)
            );
        }
        // Refused as stale: another change moved the split meanwhile.
        let (m, e) = moving.on(ended(s(2, 3)));
        assert_eq!(m.user_baseline(), Some((s(2, 3), 9)));
        assert_eq!(e, Effect::UserSplit { was: Some(s(2, 2)) });
    }

    #[test]
    fn the_users_baseline_stays_until_act_is_said_and_follows_the_user() {
        let u = at(Phase::UserBaseline {
            split: s(2, 3),
            since_ms: 1,
        });
        assert_eq!(u.on(seen(s(2, 3))), (u, Effect::None));
        let (m, e) = u.on(seen(s(1, 4)));
        assert_eq!(m.user_baseline(), Some((s(1, 4), 7)));
        assert_eq!(e, Effect::UserSplit { was: Some(s(2, 3)) });
        let (m, e) = u.on(Event::ActSaid);
        assert_eq!(
            (m.phase, e),
            (Phase::Watching { split: s(2, 3) }, Effect::Released)
        );
        // Act said while watching changes nothing.
        let w = at(Phase::Watching { split: s(2, 2) });
        assert_eq!(w.on(Event::ActSaid), (w, Effect::None));
    }

    #[test]
    fn the_state_is_kept_across_a_restart_the_users_baseline_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Machine::read(dir.path()), Machine::default());
        let u = at(Phase::UserBaseline {
            split: s(2, 3),
            since_ms: 5,
        });
        u.write(dir.path()).unwrap();
        assert_eq!(Machine::read(dir.path()), u);
        at(Phase::Moving {
            from: s(2, 2),
            to: s(3, 1),
        })
        .write(dir.path())
        .unwrap();
        let m = Machine::read(dir.path());
        assert_eq!(
            m.phase,
            Phase::Starting {
                left: Some(s(2, 2)),
                moving_to: Some(s(3, 1))
            }
        );
        std::fs::write(dir.path().join(STATE_FILE), "not json").unwrap();
        assert_eq!(Machine::read(dir.path()), Machine::default());
    }
}
