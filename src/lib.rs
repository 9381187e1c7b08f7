//! pdctl: stands up prefill/decode disaggregated LLM serving from one TOML topology.
//!
//! Data flows one way: [`topology`] (serde types + validation) -> [`plan`] (pure data:
//! services with argv, env, files, ports, probes) -> [`supervisor`] (spawns and watches
//! generic services) -> [`proxy`] (knows endpoints and a protocol). [`connectors`] holds
//! all knowledge of vLLM's KV connectors; [`sim`] is the simulated engine for machines
//! without GPUs; [`mod@bench`] measures a running cluster; [`child_config`] is the
//! `--config FILE` of the processes pdctl runs as itself (proxy, sim). [`vocab`] holds the
//! types several of them share, below all of them (the layers: `tests/layers.rs`).

pub mod allocator;
pub mod backoff;
pub mod bench;
pub mod check;
pub mod child_config;
pub mod cli;
pub mod connectors;
pub mod constant_time;
pub mod control;
pub mod dashboard;
pub mod error_text;
pub mod export;
pub mod gpu;
pub mod model_fetch;
pub mod model_files;
pub mod ops;
pub mod pictures;
pub mod plan;
pub mod profiles;
pub mod prometheus;
pub mod proxy;
pub mod sim;
pub mod spelling;
pub mod sse;
pub mod stall_clock;
pub mod supervisor;
pub mod tools;
pub mod topology;
pub mod tune;
pub mod vllm;
pub mod vocab;
