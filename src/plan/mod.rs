//! The plan: what `pdctl up` will run, as pure data.
//!
//! A plan is computed from a topology without starting anything (see [`build`]), so
//! `pdctl plan` can print it for review and tests can check every command line. The
//! supervisor executes a plan and knows nothing of vLLM beyond what is written here.
//!
//! [`resolve`] is the one part that looks at this machine: it picks the topology, asks NVML
//! (once) and vLLM its version, calls [`build`] and finds the programs, so `cli/` only parses
//! arguments, prints and maps errors to exit codes. `ports` holds the port claims every
//! planning step shares, below `build`, `engines` and `support`. The processes pdctl runs
//! as itself (`pdctl proxy`, `pdctl sim`) get their settings in a generated TOML file
//! (`files/proxy.toml`, `files/<instance>.sim.toml`) and `--config FILE` on their command
//! line (see [`crate::child_config`]).

pub mod build;
pub mod diff;
mod engines;
pub mod gpu_fit;
pub mod pairs;
mod ports;
pub mod render;
pub mod resolve;
pub mod source;
mod support;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub use build::{PlanError, PlanInput, build_plan, state_dir_for};

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
    pub vllm_version_source: Option<crate::vllm::VersionSource>,
    /// The connector name from the topology (`example`, `mooncake-store`, ...).
    pub connector: String,
    /// The proxy protocol the connector needs (`two-step`, `nixl`, `mooncake`).
    #[serde(default)]
    pub protocol: String,
    /// Services in start order: dependencies always come before their dependants.
    pub services: Vec<Service>,
    /// Things a person should look at before spending GPU time (busy GPUs, guesses made).
    pub warnings: Vec<String>,
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

    /// Only the services placed on `node` (what `pdctl up --node NODE` runs).
    pub fn local_services<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Service> + 'a {
        self.services.iter().filter(move |s| s.node == node)
    }
}

/// What a service is for; decides start order and how `pdctl logs <role>` groups them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Etcd,
    MooncakeMaster,
    LmcacheServer,
    Prefill,
    Decode,
    Proxy,
}

impl Role {
    /// The name used in the CLI, JSON and service names.
    /// The service name of instance `index` of this role: `prefill-0`, `decode-3`.
    pub fn instance_name(self, index: u32) -> String {
        format!("{}-{index}", self.as_str())
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Etcd => "etcd",
            Role::MooncakeMaster => "mooncake-master",
            Role::LmcacheServer => "lmcache-server",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Proxy => "proxy",
        }
    }

    /// Engines are the prefill and decode instances (the GPU-holding processes).
    pub fn is_engine(self) -> bool {
        matches!(self, Role::Prefill | Role::Decode)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One process to run, with everything needed to start, probe and stop it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Service {
    /// Unique name: `etcd`, `mooncake-master`, `lmcache-server`, `prefill-0`, `decode-3`, `proxy`.
    pub name: String,
    pub role: Role,
    /// Node name from the topology.
    pub node: String,
    /// That node's address, so other nodes can reach this service.
    pub host: String,
    /// Program and arguments. `argv[0]` is a bare program name resolved at `up` time
    /// (the pdctl tools venv first, then PATH) or an absolute path.
    pub argv: Vec<String>,
    /// Environment added to the inherited one.
    pub env: BTreeMap<String, String>,
    /// GPU indices this service holds (also in CUDA_VISIBLE_DEVICES for engines).
    pub gpus: Vec<u32>,
    /// The fraction of each of its GPUs' memory it will take, when known: checked against
    /// the memory free on those GPUs before anything starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_share: Option<f64>,
    /// Named ports this service listens on: `http`, `client`, `peer`, `rpc`, `metrics`,
    /// `bootstrap`, `side-channel`, `kv`, ... (all checked free before `up`).
    pub ports: BTreeMap<String, u16>,
    /// Files written (absolute paths) before the service starts.
    pub files: Vec<GeneratedFile>,
    /// Services that must be ready before this one starts.
    pub depends_on: Vec<String>,
    /// How to tell the service is ready (and, after start, still alive).
    pub probe: Probe,
    /// The base URL of an HTTP service (engines, proxy), for the proxy and status.
    pub url: Option<String>,
    /// How long the service may take to become ready before `up` gives up on it.
    pub startup_timeout_s: u64,
    pub restart: RestartPolicy,
    /// Services restarted together with this one (a restarted prefill can leave decode
    /// with stale transfer state).
    pub restart_with: Vec<String>,
    pub shutdown: Shutdown,
    /// Directories that must exist and be writable before start (shared KV storage).
    pub dirs: Vec<PathBuf>,
    /// What must hold on this machine for the service to start at all (a model's files, a
    /// Python package), checked by `up` before anything is spawned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<Check>,
}

impl Service {
    /// A service of `role` on `node` (at 127.0.0.1) running `argv`, with nothing else:
    /// no ports, GPUs, files or dependencies, ready at its first log line, the default
    /// restart and shutdown. What tests and other tools start from, setting the fields
    /// they are about.
    pub fn new(
        name: &str,
        role: Role,
        node: &str,
        argv: impl IntoIterator<Item = impl Into<String>>,
    ) -> Service {
        Service {
            name: name.into(),
            role,
            node: node.into(),
            host: "127.0.0.1".into(),
            argv: argv.into_iter().map(Into::into).collect(),
            env: BTreeMap::new(),
            gpus: vec![],
            gpu_memory_share: None,
            ports: BTreeMap::new(),
            files: vec![],
            depends_on: vec![],
            probe: Probe::LogLine {
                contains: String::new(),
            },
            url: None,
            startup_timeout_s: 60,
            restart: RestartPolicy::default(),
            restart_with: vec![],
            shutdown: Shutdown::default(),
            dirs: vec![],
            checks: vec![],
        }
    }
}

/// One thing `up` verifies before spawning anything, with what to do when it fails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Check {
    /// A file must exist.
    FileExists {
        path: PathBuf,
        /// Which setting names it and what to do, for the error.
        fix: String,
    },
    /// `python` must be able to import `module` (found without importing it).
    PythonModule {
        python: String,
        module: String,
        fix: String,
    },
}

/// A file the service reads, written by `up` into the state dir.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GeneratedFile {
    pub path: PathBuf,
    pub content: String,
}

/// Readiness / liveness check, as process-compose names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Probe {
    /// GET `url` answers `status`; when `body_contains` is set the body must contain it.
    Http {
        url: String,
        status: u16,
        body_contains: Option<String>,
    },
    /// A TCP connect to host:port succeeds.
    Tcp { host: String, port: u16 },
    /// The service's log contains this text (used where nothing else tells).
    LogLine { contains: String },
}

/// When a service that ended without being asked to is started again.
///
/// Every service pdctl runs is a long-running server, so an end pdctl did not ask for is
/// a failure whatever the exit status: a vLLM API server whose engine core died exits
/// with status 0 and serves nothing. `on-failure` and `always` therefore behave the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartMode {
    /// Restart after an unrequested exit (status 0 included), a signal, or failed
    /// liveness probes, within the crash-loop limit (the default).
    OnFailure,
    /// The same as `on-failure` for pdctl's services: any unrequested end restarts.
    Always,
    /// Never restart: an unrequested end marks the service `failed`.
    Never,
}

/// Restart policy with exponential backoff and a crash-loop limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestartPolicy {
    pub mode: RestartMode,
    /// First backoff delay; doubled after each failed start, capped at `backoff_max_ms`.
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// More than this many restarts within `window_s` marks the service `failed`.
    pub max_restarts: u32,
    pub window_s: u64,
    /// Consecutive failed liveness probes after which a running service is restarted.
    pub liveness_failures: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            mode: RestartMode::OnFailure,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
            max_restarts: 5,
            window_s: 300,
            liveness_failures: 3,
        }
    }
}

/// How a service is asked to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shutdown {
    /// Signal name sent to the process group first (`SIGTERM`, `SIGINT`).
    pub signal: String,
    /// Seconds to wait before SIGKILL.
    pub timeout_s: u64,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            signal: "SIGTERM".into(),
            timeout_s: 30,
        }
    }
}
