//! The topology file: one TOML document describing a whole PD cluster.
//!
//! Types here are plain serde structs with defaults, so the common file is short; every
//! table rejects unknown keys (with a "did you mean"). `load` parses and locates errors
//! at file:line:col; `validate` checks what serde cannot (unknown nodes, port clashes).

mod load;
pub(crate) use load::{backticked_after, expected_list};
mod locate;
mod nodes;
mod validate;
pub use validate::{NODE_NAME_RULE, node_name_problem};

pub use load::{Source, Topology as LoadedTopology, load_file, load_str, recheck};
pub use locate::Locator;

use crate::vocab::{PolicyName, RestartMode, SimModel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A topology that cannot be used, located at file:line:col with the key at fault and,
/// where one exists, what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{col}: {key}: {message}{}", hint.as_ref().map(|h| format!("\n  hint: {h}")).unwrap_or_default())]
pub struct TopologyError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    /// Dotted key path, e.g. `prefill.nodes[1]`.
    pub key: String,
    pub message: String,
    pub hint: Option<String>,
}

/// A problem with one key of a topology, before it is located in a file. The planner
/// reports these (it knows keys, not files); [`LoadedTopology::locate`] turns one into a
/// [`TopologyError`] with file:line:col.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct Problem {
    /// Dotted key path, e.g. `prefill.gpus_per_instance`.
    pub key: String,
    pub message: String,
    pub hint: Option<String>,
    /// Other keys the problem involves; the error points at the first one the file
    /// actually writes (a clash with a default port should point at the written port).
    pub also: Vec<String>,
}

impl Problem {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem {
            key: key.into(),
            message: message.into(),
            hint: None,
            also: Vec::new(),
        }
    }

    /// Adds a key that may be the one written in the file.
    pub fn also(mut self, key: impl Into<String>) -> Problem {
        self.also.push(key.into());
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Problem {
        self.hint = Some(hint.into());
        self
    }
}

/// The whole cluster description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Names the state dir and the lock; letters, digits, `-`, `_`, `.`.
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// One line for `pdctl profiles`.
    #[serde(default)]
    pub description: Option<String>,
    pub model: ModelSection,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub connector: ConnectorSection,
    /// Node name -> address. Default: one node `local` at 127.0.0.1. A node may also be
    /// a table, `worker = { address = "10.0.0.2", ssh = "user@10.0.0.2" }`, saying how
    /// the head reaches it over SSH to start its supervisor (kept in [`Topology::ssh`]).
    #[serde(default = "default_nodes", deserialize_with = "nodes::addresses")]
    pub nodes: BTreeMap<String, String>,
    /// Node name -> SSH destination (`user@host`, or a host of ~/.ssh/config), for the
    /// nodes whose table says `ssh`: `pdctl up` on the head starts their supervisors.
    #[serde(skip)]
    pub ssh: BTreeMap<String, String>,
    /// The node running etcd, the master and the proxy unless their tables say otherwise.
    /// Default: the first node in the file.
    #[serde(default)]
    pub head: Option<String>,
    #[serde(default)]
    pub etcd: EtcdSection,
    #[serde(default)]
    pub mooncake_master: MasterSection,
    #[serde(default)]
    pub lmcache_server: LmcacheSection,
    #[serde(default = "RoleSection::prefill_default")]
    pub prefill: RoleSection,
    #[serde(default = "RoleSection::decode_default")]
    pub decode: RoleSection,
    #[serde(default)]
    pub proxy: ProxySection,
    #[serde(default)]
    pub control: ControlSection,
    /// How connections between machines find a silent peer (TCP keepalive and user
    /// timeout): the proxy's legs and the supervisors' probes of other nodes.
    #[serde(default)]
    pub network: crate::vocab::TcpLiveness,
    /// When a busy service is told from one that cannot serve, and a slow node from a
    /// cut-off one: the probe timeout, the failed probes in a row, the cut-off delay.
    #[serde(default)]
    pub health: crate::vocab::HealthSettings,
    /// Moving instances between prefill and decode as the traffic asks (`[rebalance]`,
    /// see docs/rebalance.md); absent: the split stays as written.
    #[serde(default)]
    pub rebalance: Option<crate::vocab::Rebalance>,
    /// The cluster's live page, served by the head's supervisor (`[dashboard]`; on
    /// loopback port 8265 unless it says otherwise, `enabled = false` for none).
    #[serde(default)]
    pub dashboard: crate::vocab::Dashboard,
}

/// The supervisors' TCP control channel, over which the head's supervisor carries a
/// change to the other nodes and reads their services' state (clusters over several
/// nodes only; one node has its Unix socket alone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlSection {
    /// Port each node's supervisor listens on, at the node's address (default 7070).
    #[serde(default = "default_control_port")]
    pub port: u16,
}

impl Default for ControlSection {
    fn default() -> Self {
        ControlSection {
            port: default_control_port(),
        }
    }
}

fn default_control_port() -> u16 {
    7070
}

fn default_cluster() -> String {
    "pd".to_string()
}

fn default_nodes() -> BTreeMap<String, String> {
    BTreeMap::from([("local".to_string(), "127.0.0.1".to_string())])
}

/// The model every instance serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Hugging Face id or local path (vLLM's --model).
    pub name: String,
    /// Name clients use (vLLM's --served-model-name). Default: `name`.
    #[serde(default)]
    pub served_name: Option<String>,
    /// vLLM's --max-model-len; simulated engines get it too (their `--max-model-len`),
    /// so they refuse the prompts vLLM would.
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// vLLM's --trust-remote-code.
    #[serde(default)]
    pub trust_remote_code: bool,
}

impl ModelSection {
    /// The name requests must carry.
    pub fn served(&self) -> &str {
        self.served_name.as_deref().unwrap_or(&self.name)
    }
}

/// Which engine runs the instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// Real vLLM (`python -m vllm.entrypoints.openai.api_server`).
    Vllm,
    /// pdctl's simulated engine (`pdctl sim`), for machines without GPUs.
    Sim,
}

/// Where an engine computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    Cuda,
    /// vLLM's CPU build: no GPUs are assigned.
    Cpu,
}

/// Engine settings shared by every prefill and decode instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    #[serde(default = "EngineSection::default_kind")]
    pub kind: EngineKind,
    /// `auto` (ask `python`) or a pinned version such as `0.9.2`.
    #[serde(default = "EngineSection::default_version")]
    pub vllm_version: String,
    /// The python that has vLLM installed.
    #[serde(default = "EngineSection::default_python")]
    pub python: String,
    #[serde(default = "EngineSection::default_device")]
    pub device: Device,
    /// vLLM's --gpu-memory-utilization.
    #[serde(default)]
    pub gpu_memory_utilization: Option<f64>,
    /// How many engine instances (of either role) one GPU may hold. 1 (the default) gives
    /// each instance GPUs of its own; 2 lets a one-GPU workstation run 1P1D. Instances
    /// sharing a GPU split `gpu_memory_utilization` (vLLM's 0.9 when unset) equally and
    /// start together, each with the KV cache size the plan gives it from the GPU's free
    /// memory and the model's weights (vLLM 0.10.2 on); where that size cannot be worked
    /// out they start one after another, unless `kv_cache_memory` fixes it.
    #[serde(default = "EngineSection::default_instances_per_gpu")]
    pub instances_per_gpu: u32,
    /// A fixed KV cache size per instance, e.g. "2GB" (vLLM's --kv-cache-memory-bytes),
    /// instead of the one the plan works out for instances sharing a GPU: vLLM then skips
    /// its start-up memory profiling, so they start together.
    #[serde(default)]
    pub kv_cache_memory: Option<String>,
    /// Extra arguments for every engine.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every engine.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds an engine may take to become healthy (vLLM loads for minutes).
    #[serde(default)]
    pub startup_timeout_s: Option<u64>,
    /// The simulated engine's latency and cache model (`kind = "sim"`).
    #[serde(default)]
    pub sim: SimModel,
    /// Connectors whose code in the installed vLLM was read and can start on its CPU
    /// build (`Connector::cpu_source`): filled where the plan is made on the machine that
    /// runs vLLM, never written in a file.
    #[serde(skip)]
    pub cpu_ready: Vec<ConnectorKind>,
}

impl EngineSection {
    fn default_kind() -> EngineKind {
        EngineKind::Vllm
    }
    fn default_version() -> String {
        "auto".into()
    }
    fn default_python() -> String {
        "python3".into()
    }
    fn default_device() -> Device {
        Device::Cuda
    }
    fn default_instances_per_gpu() -> u32 {
        1
    }
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            kind: Self::default_kind(),
            vllm_version: Self::default_version(),
            python: Self::default_python(),
            device: Self::default_device(),
            gpu_memory_utilization: None,
            instances_per_gpu: Self::default_instances_per_gpu(),
            kv_cache_memory: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            startup_timeout_s: None,
            sim: SimModel::default(),
            cpu_ready: Vec::new(),
        }
    }
}

/// The KV connectors pdctl knows (see `connectors/` for what each one launches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConnectorKind {
    /// SharedStorageConnector (<= 0.12) / ExampleConnector (>= 0.13): a shared directory.
    #[serde(alias = "shared-storage")]
    Example,
    /// MooncakeConnector V1 (transfer_id handshake, bootstrap server).
    Mooncake,
    /// MooncakeStoreConnector: etcd + mooncake_master.
    MooncakeStore,
    /// MooncakeConnector V0 over the transfer engine (1P1D, etcd metadata).
    MooncakeTe,
    /// NixlConnector (kv_transfer_params handshake).
    Nixl,
    /// LMCacheConnector (V0) / LMCacheConnectorV1 with an lmcache server.
    Lmcache,
    /// P2pNcclConnector (named so it gets a clear answer; not planned yet).
    P2pNccl,
}

/// Which metadata service the Mooncake transfer engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MooncakeMetadata {
    /// etcd started by pdctl.
    Etcd,
    /// mooncake_master's built-in HTTP metadata server (no etcd).
    Http,
    /// Peer-to-peer handshake (store form only).
    P2p,
}

/// How the Mooncake transfer engine moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    Tcp,
    /// Needs `device_name` (the RDMA NICs).
    Rdma,
}

/// What a decode does when it cannot load the KV a prefill handed over: vLLM's
/// `kv_load_failure_policy` (in `--kv-transfer-config`), and what the simulator plays.
/// Named here because the topology, the sim's flags and the proxy's flags all carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvLoadFailurePolicy {
    /// Reschedule the request and compute the blocks that did not arrive (slower, silent).
    Recompute,
    /// Fail the request with an error (vLLM's finish reason "error", an HTTP 500).
    Fail,
}

/// The KV connector and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorSection {
    #[serde(default = "ConnectorSection::default_kind")]
    pub kind: ConnectorKind,
    /// Mooncake transport: `tcp` or `rdma`.
    #[serde(default = "ConnectorSection::default_transport")]
    pub transport: Transport,
    /// RDMA device names (e.g. `erdma_0`); empty for tcp.
    #[serde(default)]
    pub device_name: String,
    #[serde(default = "ConnectorSection::default_metadata")]
    pub metadata: MooncakeMetadata,
    /// Directory both sides read and write (example connector). Default: `<state dir>/kv`
    /// on a single node; required when instances span nodes.
    #[serde(default)]
    pub shared_storage_path: Option<PathBuf>,
    /// Mooncake store: memory each instance contributes / buffers.
    #[serde(default = "ConnectorSection::default_segment")]
    pub global_segment_size: String,
    #[serde(default = "ConnectorSection::default_buffer")]
    pub local_buffer_size: String,
    /// Mooncake transfer engine (V0) port of each side (decode gets +100 on a shared host).
    #[serde(default = "ConnectorSection::default_te_port")]
    pub te_port: u16,
    /// First NIXL side-channel port on a node (default by vLLM version: 5557 / 5600).
    #[serde(default)]
    pub side_channel_port: Option<u16>,
    /// First Mooncake bootstrap port on a node (prefill instances).
    #[serde(default = "ConnectorSection::default_bootstrap")]
    pub bootstrap_port: u16,
    /// Mooncake store on vLLM >= 0.21: wrap in MultiConnector with MooncakeConnector, so KV
    /// moves P->D by the transfer_id handshake while the store keeps prefixes.
    #[serde(default)]
    pub multi: bool,
    /// LMCache chunk size in tokens.
    #[serde(default = "ConnectorSection::default_chunk")]
    pub lmcache_chunk_size: u32,
    /// LMCache local CPU cache, GB.
    #[serde(default = "ConnectorSection::default_lmcache_cpu")]
    pub lmcache_max_local_cpu_size: f64,
    /// Merged into kv_connector_extra_config.
    #[serde(default)]
    pub extra_config: BTreeMap<String, toml::Value>,
    /// vLLM's `kv_load_failure_policy`; unset leaves vLLM's default for its version
    /// (see `connectors::load_failure_policy`).
    #[serde(default)]
    pub kv_load_failure_policy: Option<KvLoadFailurePolicy>,
    /// NixlConnector mode: `pull` (decode reads after prefill answered) or `push`
    /// (NixlPushConnector: prefill writes into decode's blocks; both legs at once).
    #[serde(default)]
    pub nixl_mode: NixlMode,
}

/// Which NIXL connector class carries the KV.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NixlMode {
    /// NixlConnector (NixlPullConnector): decode reads prefill's blocks.
    #[default]
    Pull,
    /// NixlPushConnector: decode registers its blocks, prefill writes into them.
    Push,
}

impl ConnectorSection {
    fn default_kind() -> ConnectorKind {
        ConnectorKind::Example
    }
    fn default_transport() -> Transport {
        Transport::Tcp
    }
    fn default_metadata() -> MooncakeMetadata {
        MooncakeMetadata::Etcd
    }
    fn default_segment() -> String {
        "4GB".into()
    }
    fn default_buffer() -> String {
        "1GB".into()
    }
    fn default_te_port() -> u16 {
        13003
    }
    fn default_bootstrap() -> u16 {
        8998
    }
    fn default_chunk() -> u32 {
        256
    }
    fn default_lmcache_cpu() -> f64 {
        5.0
    }
}

impl Default for ConnectorSection {
    fn default() -> Self {
        toml::from_str("").expect("every connector key has a default")
    }
}

/// etcd, the metadata server of the Mooncake transfer engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdSection {
    /// Default: on when the connector needs it.
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default = "EtcdSection::default_client")]
    pub client_port: u16,
    #[serde(default = "EtcdSection::default_peer")]
    pub peer_port: u16,
}

impl EtcdSection {
    fn default_client() -> u16 {
        2379
    }
    fn default_peer() -> u16 {
        2380
    }
}

impl Default for EtcdSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// mooncake_master, the Mooncake store's master service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasterSection {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default = "MasterSection::default_rpc")]
    pub rpc_port: u16,
    #[serde(default = "MasterSection::default_metrics")]
    pub metrics_port: u16,
    /// Port of the built-in HTTP metadata server (`connector.metadata = "http"`).
    #[serde(default = "MasterSection::default_http")]
    pub http_metadata_port: u16,
    /// Extra mooncake_master flags.
    #[serde(default)]
    pub args: Vec<String>,
}

impl MasterSection {
    fn default_rpc() -> u16 {
        50051
    }
    fn default_metrics() -> u16 {
        9003
    }
    fn default_http() -> u16 {
        8080
    }
}

impl Default for MasterSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// The LMCache storage server (`lm://host:port`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LmcacheSection {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default = "LmcacheSection::default_port")]
    pub port: u16,
}

impl LmcacheSection {
    fn default_port() -> u16 {
        65432
    }
}

impl Default for LmcacheSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// The prefill or decode instances.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleSection {
    #[serde(default = "RoleSection::default_instances")]
    pub instances: u32,
    /// One node for every instance...
    #[serde(default)]
    pub node: Option<String>,
    /// ...or instances spread round-robin over these nodes. Default: the head node.
    #[serde(default)]
    pub nodes: Option<Vec<String>>,
    /// GPUs per instance; > 1 means tensor parallel.
    #[serde(default = "RoleSection::default_gpus_per_instance")]
    pub gpus_per_instance: u32,
    /// GPUs this role may use, in order (default: any free GPU of the node).
    #[serde(default)]
    pub gpus: Option<Vec<u32>>,
    /// HTTP port of instance 0; instance i gets base_port + i.
    #[serde(default)]
    pub base_port: Option<u16>,
    /// Extra engine arguments for this role.
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// What happens when an instance ends without being asked to (`on-failure`, the
    /// default, and `always` restart it, whatever its exit status; `never` marks it failed).
    #[serde(default = "RoleSection::default_restart")]
    pub restart: RestartMode,
    /// Roles or services restarted together with each instance of this role.
    #[serde(default)]
    pub restart_with: Vec<String>,
    #[serde(default)]
    pub startup_timeout_s: Option<u64>,
}

impl RoleSection {
    fn default_instances() -> u32 {
        1
    }
    fn default_gpus_per_instance() -> u32 {
        1
    }
    fn default_restart() -> RestartMode {
        RestartMode::OnFailure
    }
    fn prefill_default() -> Self {
        toml::from_str("").expect("defaults")
    }
    fn decode_default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// The embedded PD proxy clients talk to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxySection {
    #[serde(default = "ProxySection::default_enabled")]
    pub enabled: bool,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default = "ProxySection::default_port")]
    pub port: u16,
    /// Policy for both legs unless prefill_policy / decode_policy say otherwise.
    #[serde(default = "ProxySection::default_policy")]
    pub policy: PolicyName,
    #[serde(default)]
    pub prefill_policy: Option<PolicyName>,
    #[serde(default)]
    pub decode_policy: Option<PolicyName>,
    /// Blend engines' vllm:num_requests_running into least-loaded.
    #[serde(default)]
    pub scrape_metrics: bool,
    /// Requests per second admitted; 0 = unlimited.
    #[serde(default)]
    pub rate_limit: f64,
    /// Requests in flight; 0 = unlimited.
    #[serde(default)]
    pub max_concurrent: usize,
    /// Requests waiting for a slot before 429.
    #[serde(default)]
    pub queue_size: usize,
    #[serde(default)]
    pub retries: Option<u32>,
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    #[serde(default)]
    pub prefill_timeout_s: Option<u64>,
    #[serde(default)]
    pub first_byte_timeout_s: Option<u64>,
    #[serde(default)]
    pub total_timeout_s: Option<u64>,
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
    /// How long a request waits for an instance that is starting or restarting when no
    /// other instance of its role is healthy (default 30 s; 0 fails at once with a 503).
    #[serde(default)]
    pub restart_wait_s: Option<u64>,
    /// How many times a stream whose decode broke off mid-answer is continued on another
    /// decode (default 3; 0 never: the stream ends with an error event).
    #[serde(default)]
    pub migration_limit: Option<u32>,
    /// Most answer tokens one continuation may carry (default 32768).
    #[serde(default)]
    pub migration_max_tokens: Option<u32>,
    /// Seconds a stream may go on on a draining decode before it is continued on another
    /// (default 10).
    #[serde(default)]
    pub drain_grace_s: Option<u64>,
    /// Seconds a client may take over a request's headers, and stay idle between
    /// requests, before its connection is closed (default 10; docs/security.md).
    #[serde(default)]
    pub header_read_timeout_s: Option<u64>,
    /// Client connections the proxy holds open at once; one more is answered 503
    /// (default 4096; docs/security.md).
    #[serde(default)]
    pub max_client_connections: Option<usize>,
}

impl ProxySection {
    fn default_enabled() -> bool {
        true
    }
    fn default_port() -> u16 {
        8000
    }
    fn default_policy() -> PolicyName {
        PolicyName::RoundRobin
    }
}

impl Default for ProxySection {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}
