//! Every integration test in one test binary: each `tests/x.rs` is a module of this crate
//! (`mod x;` below), not a crate of its own. One binary links the library once instead of
//! once per file, which took most of the test build's time, and lets the tests of all files
//! run side by side.
//!
//! A new file of tests: write `tests/x.rs` as before, but take the shared helpers with
//! `use crate::common;` (and `use crate::common::supervisor as suph;` and the like) instead
//! of `mod common;` and `#[path = "common/..."] mod ...;`, then add `mod x;` here.
//! `cargo test --test all x::` runs that file's tests alone.
//!
//! `tests/e2e_vllm_cpu.rs` stays a target of its own (see Cargo.toml): it runs real vLLM,
//! ignored by default, and is built in release by scripts/e2e-vllm-cpu.sh.

mod common;

mod bench;
mod check;
mod cluster;
mod dashboard;
mod export;
mod faults;
mod hub_token;
mod journal;
mod layers;
mod migration;
mod operations;
mod partition;
mod plan;
mod proxy;
mod proxy_sim;
mod pull;
mod readme;
mod rebalance;
mod rebalance_history;
mod recompute_load;
mod security;
mod sim;
mod slow_clients;
mod supervisor;
mod tune;
mod two_machines;
