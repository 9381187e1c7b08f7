//! The vocabulary several layers share: types and names that the topology, the
//! connectors, the planner, the control protocol, the supervisor, the proxy, the
//! simulator and export all speak, kept here, below every one of them, so that none has
//! to import another's module for a word they share and imports only ever run downward
//! (the layers are listed in `tests/layers.rs`, which checks them). Pure data: nothing
//! here does I/O or depends on anything of this crate.

mod control_socket;
mod dashboard;
mod health;
mod proxy;
mod rebalance;
mod restart;
mod role;
mod service;
mod sim;
mod tcp;
mod vllm_version;

pub use control_socket::SOCKET_NAME;
pub use dashboard::{DEFAULT_DASHBOARD_PORT, Dashboard};
pub use health::HealthSettings;
pub use proxy::{AdmissionError, PolicyName, ProxyProtocol, WARMED_WITHIN_S, check_admission};
pub use rebalance::{
    Figures, HistoryPoint, Move, MoveCounts, MoveOutcome, MoveRecord, Rebalance, RebalanceMode,
    RebalancePlan, RebalanceReport, Split, Toward,
};
pub use restart::{RestartMode, RestartPolicy};
pub use role::Role;
pub use service::{
    Check, ENGINE_API_KEY_VAR, GeneratedFile, HUB_TOKEN_VARS, HiddenEnv, PROXY_CLIENT_KEY_VAR,
    PROXY_ENGINE_KEY_VAR, Probe, Service, Shutdown,
};
pub use sim::{SimHandoff, SimModel, SimRole};
pub use tcp::TcpLiveness;
pub use vllm_version::{BadVersion, Version, VersionRange, VersionSource};
