//! Rebalancing: the head's supervisor moves instances between prefill and decode as the
//! traffic asks (`[rebalance]`, docs/rebalance.md). [`window`] turns `/metrics` pages into
//! the figures of a window, [`decide`] judges them, [`run`] is the loop that does both
//! every few seconds and, in `act` mode, carries a move out as a `scale` change;
//! [`machine`] is its state (whose split runs) and every transition of it, in one place;
//! [`history`] keeps each look's figures for `pdctl rebalance history` (drawn in
//! `src/pictures`, not here).

pub mod decide;
pub mod history;
pub mod machine;
mod run;
pub mod window;

pub use run::{MOVES_FILE, Rebalancer, read_moves, run};
