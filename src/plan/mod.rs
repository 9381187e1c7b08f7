//! The plan: what `pdctl up` will run, as pure data.
//!
//! A plan is computed from a topology without starting anything (see [`build`]), so
//! `pdctl plan` can print it for review and tests can check every command line. The
//! supervisor executes a plan and knows nothing of vLLM beyond what is written here.
//!
//! [`resolve`] is the one part that looks at this machine: it picks the topology, asks NVML
//! (once) and vLLM its version, reads the model's size, calls [`build`] and finds the
//! programs, so `cli/` only parses arguments, prints and maps errors to exit codes. `ports`
//! holds the port claims every planning step shares, below `build`, `engines` and
//! `support`. The processes pdctl runs as itself (`pdctl proxy`, `pdctl sim`) get their
//! settings in a generated TOML file (`files/proxy.toml`, `files/<instance>.sim.toml`) and
//! `--config FILE` on their command line (see [`crate::child_config`]).

pub mod build;
pub mod diff;
mod engines;
pub mod gpu_fit;
pub mod held;
mod kv_budget;
pub mod listen;
pub mod order;
pub mod pairs;
mod ports;
pub mod render;
pub mod resolve;
pub mod source;
mod support;

use crate::child_config::ChildSettings;
use crate::vocab::{Role, Service};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub use build::{PlanError, PlanInput, build_plan, state_dir_for};
pub use held::Holdings;

/// Every process of one cluster, in dependency order, plus what a reviewer should know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Cluster name from the topology; names the state dir and the lock.
    pub cluster: String,
    /// Where generated files, logs, the control socket and the lock live.
    pub state_dir: PathBuf,
    /// The node that runs the shared services (etcd, master, proxy) by default.
    pub head_node: String,
    /// Node name -> address, as written in the topology.
    pub nodes: BTreeMap<String, String>,
    /// The URL clients send requests to (the proxy), when the plan has one.
    pub proxy_url: Option<String>,
    /// The engine kind, for display (`vllm` or `sim`).
    pub engine: String,
    /// The vLLM version the templates were chosen for (None for the simulator).
    pub vllm_version: Option<String>,
    /// Where that version came from: `installed` (asked the vLLM in engine.python),
    /// `pinned` (the topology says) or `assumed` (no vLLM found; `up` refuses such a plan).
    #[serde(default)]
    pub vllm_version_source: Option<crate::vocab::VersionSource>,
    /// The connector name from the topology (`example`, `mooncake-store`, ...).
    pub connector: String,
    /// The proxy protocol the connector needs (`two-step`, `nixl`, `mooncake`).
    #[serde(default)]
    pub protocol: String,
    /// Services in start order: dependencies always come before their dependants.
    pub services: Vec<Service>,
    /// Things a person should look at before spending GPU time (busy GPUs, guesses made).
    pub warnings: Vec<String>,
    /// Port of the supervisors' TCP control channel at each node's address, when the
    /// cluster spans several nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_port: Option<u16>,
    /// TCP keepalive and user timeout for connections to other machines (the topology's
    /// `[network]`): the supervisors' probes of other nodes' services use them.
    #[serde(default, skip_serializing_if = "crate::vocab::TcpLiveness::is_default")]
    pub tcp: crate::vocab::TcpLiveness,
    /// The topology's `[health]`: the supervisors' probe timeout, the failed probes that
    /// make a service unhealthy, and how long a node must be silent to be cut off.
    #[serde(
        default,
        skip_serializing_if = "crate::vocab::HealthSettings::is_default"
    )]
    pub health: crate::vocab::HealthSettings,
    /// The typed settings of the services pdctl runs as itself (the proxy, simulated
    /// engines), by service name: what their generated config files say, kept as values
    /// so a change is compared and carried as one, never as text read back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, ChildSettings>,
    /// The topology's `[rebalance]`, for the head's operations layer to act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<crate::vocab::RebalancePlan>,
    /// The Hugging Face model the engines serve, as each node fetches it before its
    /// engines start (a node run from this plan, an engine `scale` or `apply` adds): None
    /// for simulated engines and a model in a local directory. Its environment holds no
    /// token (`Service::hidden_env`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_fetch: Option<crate::model_fetch::Source>,
    /// The topology's `[dashboard]`: where the head serves the cluster's live page.
    #[serde(default, skip_serializing_if = "crate::vocab::Dashboard::is_default")]
    pub dashboard: crate::vocab::Dashboard,
}

impl Plan {
    /// The service of that name, if the plan has it.
    pub fn service(&self, name: &str) -> Option<&Service> {
        self.services.iter().find(|s| s.name == name)
    }

    /// The position of the service of that name (the supervisor's per-service tables
    /// follow plan order).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.services.iter().position(|s| s.name == name)
    }

    /// Services of one role, in plan order.
    pub fn by_role(&self, role: Role) -> impl Iterator<Item = &Service> {
        self.services.iter().filter(move |s| s.role == role)
    }

    /// The typed settings of the service of that name, when pdctl runs it as itself.
    pub fn settings_of(&self, name: &str) -> Option<&ChildSettings> {
        self.settings.get(name)
    }

    /// Only the services placed on `node` (what `pdctl up --node NODE` runs).
    pub fn local_services<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Service> + 'a {
        self.services.iter().filter(move |s| s.node == node)
    }
}

#[cfg(test)]
impl Plan {
    /// A plan of `services` for unit tests: cluster `c` under /state/c headed by `head`,
    /// vLLM 0.26.0 with NIXL, nothing else; a test sets the fields it is about with `..`.
    pub(crate) fn for_tests(head: &str, services: Vec<Service>) -> Plan {
        Plan {
            cluster: "c".into(),
            state_dir: "/state/c".into(),
            head_node: head.into(),
            nodes: BTreeMap::new(),
            proxy_url: None,
            engine: "vllm".into(),
            vllm_version: Some("0.26.0".into()),
            vllm_version_source: None,
            connector: "nixl".into(),
            protocol: "nixl".into(),
            services,
            warnings: vec![],
            control_port: None,
            tcp: Default::default(),
            health: Default::default(),
            settings: BTreeMap::new(),
            rebalance: None,
            model_fetch: None,
            dashboard: Default::default(),
        }
    }
}
