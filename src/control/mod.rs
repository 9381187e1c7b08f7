//! The typed protocol between a running supervisor and its clients (`pdctl status`,
//! `pdctl down`, the embedded proxy's health feed, `pdctl bench`), spoken as one JSON
//! object per line over the Unix socket `<state_dir>/control.sock` (mode 0600); and
//! between the nodes' supervisors ([`PeerRequest`]) inside mutually authenticated TLS
//! ([`tls`]).

pub mod auth;
pub mod client;
pub mod frame;
pub mod hidden_env;
pub mod operation;
pub mod tls;

use crate::child_config::ChildSettings;
use crate::vocab::{Role, Service};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The environment variable the supervisor gives every service: the file in which it
/// writes, just before asking the service to stop, when it will SIGKILL it (Unix time in
/// milliseconds). A service that must finish work in time (the proxy ending streams with a
/// word for the client) reads it on SIGTERM, so `pdctl down -t N` is honoured whole.
pub const STOP_DEADLINE_ENV: &str = "PDCTL_STOP_DEADLINE_FILE";

/// Directory of those files inside a cluster's state dir, one per service.
pub const STOP_DEADLINE_DIR: &str = "stop-by";

/// How a service's last exit starts when its process had ended on its own (killed,
/// crashed) before a stop or remove reached it; `remove`'s answer says it too, so a drain
/// does not report "drained" for an instance that died under it.
pub const ENDED_BEFORE_STOP: &str = "ended before its stop: ";

/// What a client asks of the supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    /// The state of every service (local and, on the head node, remote ones probed).
    Status,
    /// Stop every service in reverse dependency order, then exit the supervisor.
    Down { timeout_s: u64 },
    /// Restart one service (and its `restart_with` companions).
    Restart { service: String },
    /// Take one healthy service out of the proxy's routing (reported `draining`) until its
    /// run ends, so requests in flight can finish before it is restarted or stopped.
    Drain { service: String },
    /// Start a new service on this node (`pdctl scale` / `apply` adding an instance); it
    /// waits for its dependencies like any other and is reported from then on. `settings`:
    /// its typed settings where pdctl runs it as itself (a simulated engine).
    Add {
        service: Box<Service>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        settings: Option<Box<ChildSettings>>,
    },
    /// Stop a service (its shutdown signal, SIGKILL after `timeout_s`) and forget it:
    /// `status` and the proxy stop listing it. Answered once it is stopped.
    Remove { service: String, timeout_s: u64 },
    /// Replace how a service is started (its command, environment, files, typed settings);
    /// it takes effect at its next start, which the client asks for (after draining it).
    /// The service's `revision` goes up by one, and whoever follows its settings
    /// (`WatchSettings`: the running proxy) is sent the new ones at once.
    Replace {
        service: Box<Service>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        settings: Option<Box<ChildSettings>>,
    },
    /// Follow a service's typed settings: answered at once with `Settings`, then with
    /// another `Settings` each time a `Replace` changes its revision, for as long as the
    /// client stays connected. The running proxy takes its live settings this way.
    WatchSettings { service: String },
    /// A service on another node was restarted by its own supervisor after this one
    /// drained it: back into routing once its probe answers.
    Resume { service: String },
    /// A change to the whole cluster (`scale`, `apply`, drained restarts), carried out by
    /// the head's supervisor whatever becomes of the client: the answer is a stream of
    /// `Progress` lines ending with one `Finished`.
    Change { change: operation::ChangeRequest },
    /// The last `lines` lines of a service's log, wherever it runs: a service of another
    /// node is asked of that node's supervisor (`pdctl logs ROLE` on the head). Answered
    /// with `Lines`.
    Logs { service: String, lines: usize },
    /// `pdctl rebalance off|advise|act`: what the head's rebalancer does from now on
    /// (until the supervisor restarts, which reads the topology's `mode` again).
    Rebalance { mode: crate::vocab::RebalanceMode },
    /// Before a change starts engines of `roles` on this node: fetch the plan's model
    /// into this node's cache when it lacks it (the token from the values this node
    /// keeps for those roles). Answered with `Done` once it is there, or `Finished` with
    /// code 2 (a refusal: gated, unknown, offline, no room) or 1 (the network).
    FetchModel {
        source: Box<crate::model_fetch::Source>,
        roles: Vec<Role>,
    },
}

/// What another node's supervisor may ask of this one over the TCP channel: a type of
/// its own, so a request the Unix socket takes (a cluster-wide `Change`, following
/// settings) cannot be sent by a peer at all. Which peer may send which is decided by
/// [`PeerRequest::head_only`]: every node may ask for status; only the head, carrying out
/// a change, asks a node to run, stop or change services, or to go down.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PeerRequest {
    /// This node's own services (the head merges them into its status).
    Status,
    /// The last lines of one of this node's services' logs.
    Logs {
        service: String,
        lines: usize,
    },
    Down {
        timeout_s: u64,
    },
    Restart {
        service: String,
    },
    Drain {
        service: String,
    },
    Resume {
        service: String,
    },
    Add {
        service: Box<Service>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        settings: Option<Box<ChildSettings>>,
    },
    Remove {
        service: String,
        timeout_s: u64,
    },
    Replace {
        service: Box<Service>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        settings: Option<Box<ChildSettings>>,
    },
    FetchModel {
        source: Box<crate::model_fetch::Source>,
        roles: Vec<Role>,
    },
}

impl PeerRequest {
    /// The peer form of a request the head's operations send a node; None for what no
    /// peer may ask (`Change`, `WatchSettings`).
    pub fn from_local(req: &Request) -> Option<PeerRequest> {
        Some(match req.clone() {
            Request::Status => PeerRequest::Status,
            Request::Logs { service, lines } => PeerRequest::Logs { service, lines },
            Request::Down { timeout_s } => PeerRequest::Down { timeout_s },
            Request::Restart { service } => PeerRequest::Restart { service },
            Request::Drain { service } => PeerRequest::Drain { service },
            Request::Resume { service } => PeerRequest::Resume { service },
            Request::Add { service, settings } => PeerRequest::Add { service, settings },
            Request::Remove { service, timeout_s } => PeerRequest::Remove { service, timeout_s },
            Request::Replace { service, settings } => PeerRequest::Replace { service, settings },
            Request::FetchModel { source, roles } => PeerRequest::FetchModel { source, roles },
            Request::WatchSettings { .. } | Request::Change { .. } | Request::Rebalance { .. } => {
                return None;
            }
        })
    }

    /// Whether only the head may ask it: everything but status (logs too: they may hold
    /// what the services print of the requests they serve).
    pub fn head_only(&self) -> bool {
        !matches!(self, PeerRequest::Status)
    }

    /// Its name, for refusals and logs.
    pub fn name(&self) -> &'static str {
        match self {
            PeerRequest::Status => "status",
            PeerRequest::Logs { .. } => "logs",
            PeerRequest::Down { .. } => "down",
            PeerRequest::Restart { .. } => "restart",
            PeerRequest::Drain { .. } => "drain",
            PeerRequest::Resume { .. } => "resume",
            PeerRequest::Add { .. } => "add",
            PeerRequest::Remove { .. } => "remove",
            PeerRequest::Replace { .. } => "replace",
            PeerRequest::FetchModel { .. } => "fetch-model",
        }
    }
}

/// What a client without a certificate may send, on the head only: a node started by
/// hand asking for its certificate, naming its join token (`token`: the id) and proving
/// its secret for this TLS session ([`tls::JoinToken::proof`]). Answered with `Joined`
/// or `Error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    pub join: String,
    pub token: String,
    pub proof: String,
}

/// What the supervisor answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Response {
    Status(StatusReport),
    /// A service's typed settings and the revision of its spec they belong to (the
    /// answers to `WatchSettings`); `settings` is None for a service pdctl does not run as
    /// itself.
    Settings {
        service: String,
        revision: u64,
        settings: Option<Box<ChildSettings>>,
    },
    /// The request was carried out.
    Done {
        message: String,
    },
    Error {
        message: String,
    },
    /// One line of a change's progress, as the client prints it (`error`: on stderr).
    Progress {
        line: String,
        #[serde(default)]
        error: bool,
    },
    /// A service's last log lines (the answer to `Logs`), oldest first.
    Lines {
        service: String,
        lines: Vec<String>,
    },
    /// The answer to a [`tls::RenewRequest`]: the node's new certificate (PEM), for the
    /// key it sent; the only one the head accepts of it from now on.
    Renewed {
        cert_pem: String,
    },
    /// The answer to a `JoinRequest`: the joining node's certificate and key, and the
    /// cluster's CA certificate.
    Joined {
        creds: Box<tls::NodeCreds>,
        /// The key the cluster's engines require (the cluster's secret stays on the head).
        #[serde(default)]
        engine_key: Option<auth::EngineKey>,
    },
    /// The end of a change: the exit code the client exits with (0 done, 1 a step
    /// failed, 2 refused) and its last words.
    Finished {
        code: u8,
        message: String,
        /// Refused because it cannot be made while the cluster runs (connector, model,
        /// node layout...): taking the cluster down and up again would make it.
        #[serde(default)]
        needs_recreate: bool,
    },
}

/// A snapshot of a cluster, as `pdctl status --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub cluster: String,
    /// The node this supervisor runs.
    pub node: String,
    /// Where clients send requests, if the cluster has a proxy.
    pub proxy_url: Option<String>,
    pub services: Vec<ServiceStatus>,
    /// The change running now, or the last one, when the supervisor carried one out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<Box<operation::OperationReport>>,
    /// The head's rebalancer (`[rebalance]`): its mode, figures, verdict and moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<Box<crate::vocab::RebalanceReport>>,
    /// In the head's answer to another node's status poll only: the one certificate the
    /// head accepts of each node (the others refuse every other), and which nodes should
    /// renew theirs ([`tls::RenewRequest`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates: Option<Box<BTreeMap<String, tls::Accepted>>>,
}

impl StatusReport {
    /// True when every service is healthy (what `status` exits 0 on).
    pub fn all_healthy(&self) -> bool {
        self.services
            .iter()
            .all(|s| s.state == ServiceState::Healthy)
    }
}

/// One row of `pdctl status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub role: Role,
    pub node: String,
    pub pid: Option<u32>,
    pub state: ServiceState,
    pub gpus: Vec<u32>,
    /// The main port (http / client / rpc).
    pub port: Option<u16>,
    /// Base URL for HTTP services.
    pub url: Option<String>,
    pub restarts: u32,
    /// How many times its spec was replaced (`Request::Replace`) since the supervisor
    /// started: a running proxy compares it with the one it runs with.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revision: u64,
    /// Every port the service listens on, by label (`http`, `bootstrap`, `metrics`, ...):
    /// the proxy takes a new instance's side ports (Mooncake's bootstrap) from here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<String, u16>,
    pub uptime_s: Option<f64>,
    /// How the last run ended, e.g. `exit 0`, `signal 9 (SIGKILL)`, `liveness failed ...`,
    /// `restart requested`.
    pub last_exit: Option<String>,
    /// The last error-looking line the service printed in the run `last_exit` describes,
    /// whole (e.g. `ERROR ... [core.py:812] RuntimeError: shape mismatch`), when that run
    /// ended on its own and printed one.
    #[serde(default)]
    pub last_error: Option<String>,
    /// Runs on another node; its state comes from its own node's supervisor where that
    /// answers, and from probing its endpoint.
    pub remote: bool,
    /// On another node whose supervisor has not answered since then (Unix time, ms):
    /// the state is `unreachable` meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable_since_ms: Option<u64>,
    /// CPU use of the service's process and every process below it, in percent of one core
    /// (200 = two cores busy), between the supervisor's last two samples; `None` for a
    /// service that does not run here, or before its second sample.
    #[serde(default)]
    pub cpu_percent: Option<f32>,
    /// Resident memory of the service's process and every process below it, in bytes.
    #[serde(default)]
    pub rss_bytes: Option<u64>,
    /// GPU memory NVML reports for those processes, in bytes; `None` without NVML or when
    /// NVML lists none of them.
    #[serde(default)]
    pub gpu_memory_bytes: Option<u64>,
}

/// Lifecycle of a service, as process-compose users know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServiceState {
    /// Not started yet: waiting for its dependencies.
    Pending,
    Starting,
    Healthy,
    /// Healthy, but out of routing while its requests in flight finish.
    Draining,
    Unhealthy,
    Restarting,
    /// Asked to stop (`pdctl down`): its shutdown signal sent, not gone yet.
    Stopping,
    /// Crash loop or start-up failure: given up on; the proxy stops using it.
    Failed,
    Stopped,
    /// On another node that cannot be reached (neither its supervisor nor its port
    /// answers): out of routing until it answers again.
    Unreachable,
}

impl ServiceState {
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceState::Pending => "pending",
            ServiceState::Starting => "starting",
            ServiceState::Healthy => "healthy",
            ServiceState::Draining => "draining",
            ServiceState::Unhealthy => "unhealthy",
            ServiceState::Restarting => "restarting",
            ServiceState::Stopping => "stopping",
            ServiceState::Failed => "failed",
            ServiceState::Stopped => "stopped",
            ServiceState::Unreachable => "unreachable",
        }
    }
}

impl std::fmt::Display for ServiceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
