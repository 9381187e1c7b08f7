//! One process to run ([`Service`]) and the parts it is made of: the files written before
//! it starts, how its readiness is probed, what must hold on the machine, how it stops.
//! Lives in `vocab` because the planner writes it, the connectors contribute its files,
//! the control protocol carries it (`Add`, `Replace`), the supervisor runs it and
//! export turns it into manifests: pure data that every one of them reads.

use super::restart::RestartPolicy;
use super::role::Role;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

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
    /// For an engine sharing a GPU: how its memory is sized (the KV cache bytes pdctl gives
    /// it and from what, or why vLLM sizes it) and whether it starts together with its
    /// neighbours or after them, in words. `pdctl plan` prints it; nothing acts on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_note: Option<String>,
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
    /// Environment variables the supervisor sets to the cluster's engine key when it
    /// starts the service (`VLLM_API_KEY` for an engine, `PDCTL_ENGINE_API_KEY` for the
    /// proxy). Only the names are planned: the key never enters the plan, so it is in no
    /// plan file, plan output or status.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<String>,
    /// Variables the topology sets for this service whose values are secrets (a Hugging
    /// Face token, [`HUB_TOKEN_VARS`]): only the names are planned; the supervisor sets
    /// them at spawn from the values `up` keeps in the state dir ([`HiddenEnv`]), so no
    /// plan file, plan output, journal or status holds them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden_env: Vec<String>,
}

/// The variables huggingface_hub reads a token from: the topology may set them in
/// `[engine.env]` (or a role's `env`), and the plan keeps only their names.
pub const HUB_TOKEN_VARS: &[&str] = &["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_ID_TOKEN"];

/// The values of the variables services name in `hidden_env`, by role (`prefill`,
/// `decode`) then variable: what `up` keeps in the state dir (mode 0600) and hands the
/// nodes it starts, never part of a plan. Its `Debug` shows the names only.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HiddenEnv(pub BTreeMap<String, BTreeMap<String, String>>);

impl HiddenEnv {
    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.0.values().all(BTreeMap::is_empty)
    }

    /// The value of `var` for services of `role`, if kept.
    pub fn get(&self, role: Role, var: &str) -> Option<&str> {
        self.0.get(role.as_str())?.get(var).map(String::as_str)
    }

    /// Every value kept (to look for them where they must not be).
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.0.values().flat_map(|m| m.values().map(String::as_str))
    }
}

impl std::fmt::Debug for HiddenEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: BTreeMap<&str, Vec<&str>> = self
            .0
            .iter()
            .map(|(role, vars)| (role.as_str(), vars.keys().map(String::as_str).collect()))
            .collect();
        f.debug_tuple("HiddenEnv").field(&names).finish()
    }
}

/// The variable vLLM (and `pdctl sim`) takes its API key from: requests without
/// `Authorization: Bearer KEY` are refused.
pub const ENGINE_API_KEY_VAR: &str = "VLLM_API_KEY";

/// The variable the proxy takes the key it sends to the engines from (`pdctl proxy
/// --engine-api-key`); the same name sets the cluster's engine key for `pdctl up`.
pub const PROXY_ENGINE_KEY_VAR: &str = "PDCTL_ENGINE_API_KEY";

/// The variable that gives the proxy its client key (clients send it; `/v1/*` answers 401
/// without it), in the environment of `up` and of the proxy the supervisor starts.
pub const PROXY_CLIENT_KEY_VAR: &str = "PDCTL_API_KEY";

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
            gpu_memory_note: None,
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
            secret_env: vec![],
            hidden_env: vec![],
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
