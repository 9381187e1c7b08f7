//! Everything pdctl knows about vLLM's KV connectors, one file per connector.
//!
//! A connector gives, for a vLLM version: the `--kv-transfer-config` JSON, generated files
//! (mooncake.json, LMCache yaml), environment, extra ports, the support services it needs,
//! and the proxy protocol that moves a request's KV from prefill to decode. Adding a
//! connector means a file here and a profile; nothing else knows connector names.
//!
//! Each file gives its [`About`] (kind, vLLM classes, versions) and implements
//! [`Connector`]: support services and protocol default to none and two-step, and the
//! launch is planned from one [`LaunchCtx`]; the shapes several share (`transfer_config`,
//! per-rank port names, Mooncake's metadata needs) are helpers here.

mod example;
mod lmcache;
mod mooncake;
mod mooncake_store;
mod mooncake_te;
mod nixl;
pub mod pairing;
mod ports;
pub mod transport;

pub use lmcache::server_command as lmcache_server_command;
pub use pairing::Pairing;
pub use ports::PortBook;

use crate::topology::{
    ConnectorKind, ConnectorSection, Device, KvLoadFailurePolicy, MooncakeMetadata, Problem,
    Topology,
};
use crate::vocab::{GeneratedFile, ProxyProtocol, Role, SimHandoff, Version, VersionRange};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A host and port of a support service, as instances must reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Support services a connector needs next to the engines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    pub etcd: bool,
    pub mooncake_master: bool,
    /// mooncake_master must also serve HTTP metadata (instead of etcd).
    pub master_http_metadata: bool,
    pub lmcache_server: bool,
}

impl Needs {
    /// What a Mooncake transfer engine's metadata server takes: etcd, or mooncake_master
    /// serving HTTP metadata (P2P handshakes need neither).
    fn mooncake_metadata(m: MooncakeMetadata) -> Needs {
        Needs {
            etcd: m == MooncakeMetadata::Etcd,
            mooncake_master: m == MooncakeMetadata::Http,
            master_http_metadata: m == MooncakeMetadata::Http,
            lmcache_server: false,
        }
    }
}

/// What is known of the cluster when one instance's launch is asked for.
#[derive(Debug, Clone)]
pub struct ClusterCtx<'a> {
    pub topology: &'a Topology,
    /// None for the simulated engine.
    pub version: Option<&'a Version>,
    pub etcd: Option<Endpoint>,
    /// mooncake_master's RPC endpoint, and its HTTP metadata endpoint when enabled.
    pub master: Option<Endpoint>,
    pub master_http_metadata: Option<Endpoint>,
    pub lmcache: Option<Endpoint>,
    /// The directory shared storage connectors read and write.
    pub shared_dir: PathBuf,
    /// Where generated files go (inside the state dir).
    pub files_dir: PathBuf,
    /// Addresses of the prefill and decode instances, in index order.
    pub prefill_hosts: Vec<String>,
    pub decode_hosts: Vec<String>,
}

/// One engine instance being planned.
#[derive(Debug, Clone)]
pub struct InstanceCtx {
    pub role: Role,
    /// Service name, e.g. `prefill-0`.
    pub name: String,
    /// The address of its node, under which its ports are booked.
    pub host: String,
    /// The address its KV transfer listeners bind and advertise: the node's when engines
    /// on other nodes reach them, else loopback.
    pub listen: String,
    /// GPUs per instance (tensor-parallel size).
    pub tp: u32,
    /// Bootstrap port when the proxy protocol needs one (Mooncake V1 prefill).
    pub bootstrap_port: Option<u16>,
}

/// What a connector adds to one engine's launch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launch {
    /// The `--kv-transfer-config` JSON.
    pub kv_transfer_config: Value,
    /// vLLM flags the connector needs to work at all (before the topology's own args, so a
    /// user can still override them), each with its reason in the connector's file.
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub files: Vec<GeneratedFile>,
    /// Extra ports the engine opens, by name (checked for clashes per node).
    pub ports: BTreeMap<String, u16>,
    /// Directories that must exist and be writable.
    pub dirs: Vec<PathBuf>,
}

impl Launch {
    /// Names the ports `first..first + width` that an engine opens one per TP rank: `name`
    /// for rank 0, `name-1`, `name-2`... after it.
    fn rank_ports(&mut self, name: &str, first: u16, width: u16) {
        for rank in 0..width {
            let key = if rank == 0 {
                name.to_string()
            } else {
                format!("{name}-{rank}")
            };
            self.ports.insert(key, first + rank);
        }
    }
}

/// Where a connector's code in the installed vLLM says whether it starts on the CPU build.
#[derive(Clone, Copy)]
pub struct CpuSource {
    /// Paths under the `vllm` package directory, newest layout first.
    pub files: &'static [&'static str],
    /// True when the file's text starts without an accelerator.
    pub starts_on_cpu: fn(&str) -> bool,
}

/// The connectors the vLLM package at `vllm_dir` can start on its CPU build, as their
/// [`Connector::cpu_source`] reads its files (a connector whose file is absent is not).
pub fn cpu_ready(vllm_dir: &std::path::Path) -> Vec<ConnectorKind> {
    all()
        .iter()
        .filter_map(|c| {
            let src = c.cpu_source()?;
            let text = src
                .files
                .iter()
                .find_map(|f| std::fs::read_to_string(vllm_dir.join(f)).ok())?;
            (src.starts_on_cpu)(&text).then_some(c.about().kind)
        })
        .collect()
}

/// What is fixed about a connector, for plans and messages.
#[derive(Debug, Clone, Copy)]
pub struct About {
    /// The `connector.kind` it answers to.
    pub kind: ConnectorKind,
    /// One line for messages: the vLLM class names it uses.
    pub classes: &'static str,
    /// The vLLM versions with a template.
    pub versions: &'static [VersionRange],
}

/// What one engine's launch is planned from: the cluster, the planned vLLM version, the
/// instance, and the ports taken so far (a connector that opens ports takes them here).
pub struct LaunchCtx<'a> {
    pub cx: &'a ClusterCtx<'a>,
    pub v: &'a Version,
    pub inst: &'a InstanceCtx,
    pub ports: &'a mut PortBook,
}

/// One KV connector: its launch templates per vLLM version and its proxy protocol.
pub trait Connector: Sync {
    fn about(&self) -> &'static About;
    /// Checks that do not fit serde (instance counts, device); version support is checked
    /// by [`check_version`].
    fn check(&self, _t: &Topology, _v: Option<&Version>) -> Result<(), Problem> {
        Ok(())
    }
    /// What plans but will not always do what a user expects with real vLLM `v`; shown
    /// with the plan.
    fn warnings(&self, _t: &Topology, _v: &Version) -> Vec<String> {
        Vec::new()
    }
    /// The Python package the connector imports inside vLLM, and how to get it: `up`
    /// checks `engine.python` can import it before starting anything.
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        None
    }
    /// Every Python module the connector needs on `device`, each with what installs it
    /// (worded to end "... into engine.python"): [`Connector::python_module`] unless a
    /// device needs more.
    fn python_modules(&self, _device: Device) -> Vec<(&'static str, String)> {
        self.python_module()
            .map(|(m, why)| vec![(m, why.to_string())])
            .unwrap_or_default()
    }
    /// Support services the engines need: none unless the connector says so.
    fn needs(&self, _c: &ConnectorSection, _v: Option<&Version>) -> Needs {
        Needs::default()
    }
    /// How the proxy must split requests: two steps (prefill, then decode reading what
    /// prefill left) unless the connector hands KV over itself.
    fn protocol(&self, _c: &ConnectorSection, _v: Option<&Version>) -> ProxyProtocol {
        ProxyProtocol::TwoStep
    }
    /// The launch of one real vLLM instance.
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem>;
    /// Prompt tokens a good handoff may leave decode to compute, with KV blocks of
    /// `block_size` tokens: the proxy counts a decode that computed more of a prompt as a
    /// silent recompute. vLLM's connectors move whole blocks, so decode computes the last
    /// partial block (a whole one when the prompt fills its blocks exactly) unless a
    /// connector says otherwise.
    fn decode_leaves(&self, _c: &ConnectorSection, block_size: u32) -> u32 {
        block_size
    }
    /// Where the installed vLLM's own source tells whether this connector starts on vLLM's
    /// CPU build: the files to read (under the `vllm` package, the first that exists), and
    /// whether its text can. None: nothing to read, the connector's `check` decides alone.
    fn cpu_source(&self) -> Option<CpuSource> {
        None
    }
    /// Which prefill/decode differences (tensor-parallel and pipeline-parallel sizes, KV
    /// block size) the connector carries KV across on vLLM `v`: `pdctl plan` refuses a
    /// pair outside them. Everything the same unless the connector's file says more.
    fn pairing(&self, _c: &ConnectorSection, _v: &Version) -> Pairing {
        Pairing::same(self.about().classes)
    }
}

/// The connector for a topology's `connector.kind`.
pub fn for_kind(kind: ConnectorKind) -> &'static dyn Connector {
    match kind {
        ConnectorKind::Example => &example::Example,
        ConnectorKind::Mooncake => &mooncake::MooncakeV1,
        ConnectorKind::MooncakeStore => &mooncake_store::MooncakeStore,
        ConnectorKind::MooncakeTe => &mooncake_te::MooncakeTe,
        ConnectorKind::Nixl => &nixl::Nixl,
        ConnectorKind::Lmcache => &lmcache::Lmcache,
        ConnectorKind::P2pNccl => &Unsupported,
    }
}

/// The newest vLLM release the templates here were written and checked against (every
/// flag, class and key read in the 0.33.0 wheel's source, docs/connectors.md; vLLM
/// 0.32.0's CPU build end to end; 0.26.0 on a GPU). `vllm_version = "auto"` plans for it
/// when no vLLM is installed, so a plan can be read before vLLM is.
pub const NEWEST_TEMPLATED: Version = Version::new(0, 33, 0);

/// Every connector pdctl can plan, for "which connectors does vLLM X have" hints.
pub fn all() -> [&'static dyn Connector; 6] {
    [
        &example::Example,
        &nixl::Nixl,
        &mooncake::MooncakeV1,
        &mooncake_store::MooncakeStore,
        &mooncake_te::MooncakeTe,
        &lmcache::Lmcache,
    ]
}

/// The topology name of a connector kind (`mooncake-store`).
pub fn kind_name(kind: ConnectorKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The simulator's handoff mechanism that matches a proxy protocol.
pub fn sim_handoff(protocol: ProxyProtocol) -> SimHandoff {
    match protocol {
        ProxyProtocol::TwoStep => SimHandoff::SharedDir,
        ProxyProtocol::Nixl => SimHandoff::Nixl,
        ProxyProtocol::Mooncake => SimHandoff::Mooncake,
        ProxyProtocol::NixlPush => SimHandoff::NixlPush,
    }
}

/// Fails when `v` is outside every range the connector has a template for, saying which
/// versions have it and which connectors `v` has.
pub fn check_version(conn: &dyn Connector, v: &Version) -> Result<(), Problem> {
    let about = conn.about();
    if about.versions.iter().any(|r| r.contains(v)) {
        return Ok(());
    }
    let ranges: Vec<String> = about.versions.iter().map(|r| r.to_string()).collect();
    let available: Vec<String> = all()
        .iter()
        .map(|c| c.about())
        .filter(|a| a.versions.iter().any(|r| r.contains(v)))
        .map(|a| kind_name(a.kind))
        .collect();
    Err(Problem::new(
        "connector.kind",
        format!(
            "vLLM {v} has no `{}` ({}): pdctl has templates for vLLM {}",
            kind_name(about.kind),
            about.classes,
            ranges.join(" and ")
        ),
    )
    .hint(format!(
        "pin engine.vllm_version to a version in that range, or use a connector vLLM {v} has: {}",
        if available.is_empty() {
            "none known".to_string()
        } else {
            available.join(", ")
        }
    )))
}

/// vLLM that reads `kv_connector_extra_config`: the field came with 0.8.0.
const EXTRA_CONFIG: VersionRange = VersionRange::from((0, 8, 0));

/// Fails when the topology sets `connector.extra_config` for a vLLM without the field it is
/// passed in (vLLM would refuse to start on the unknown key).
pub fn check_extra_config(c: &ConnectorSection, v: &Version) -> Result<(), Problem> {
    if c.extra_config.is_empty() || EXTRA_CONFIG.contains(v) {
        return Ok(());
    }
    Err(Problem::new(
        "connector.extra_config",
        format!(
            "vLLM {v} has no kv_connector_extra_config to pass these keys in (it came with 0.8.0)"
        ),
    )
    .hint("remove connector.extra_config, or pin engine.vllm_version to 0.8.0 or later"))
}

/// vLLM with `kv_load_failure_policy` in its KVTransferConfig (absent in 0.12.0, present in
/// 0.13.0; vLLM refuses unknown keys there).
const LOAD_FAILURE_POLICY: VersionRange = VersionRange::from((0, 13, 0));

/// vLLM whose default policy is "fail" (0.13.0 to 0.16.0 default to "recompute").
const FAILS_BY_DEFAULT: VersionRange = VersionRange::from((0, 17, 0));

/// Fails when the topology sets `connector.kv_load_failure_policy` for a vLLM that has no
/// such key, naming the versions that have it.
pub fn check_load_failure_policy(c: &ConnectorSection, v: &Version) -> Result<(), Problem> {
    if c.kv_load_failure_policy.is_none() || LOAD_FAILURE_POLICY.contains(v) {
        return Ok(());
    }
    Err(Problem::new(
        "connector.kv_load_failure_policy",
        format!(
            "vLLM {v} has no kv_load_failure_policy: it came with vLLM 0.13.0 (vLLM {LOAD_FAILURE_POLICY}); before it a decode always recomputes what it could not load"
        ),
    )
    .hint("remove connector.kv_load_failure_policy, or pin engine.vllm_version to 0.13.0 or later"))
}

/// The policy decodes run with: the topology's, else vLLM `v`'s own default ("fail" from
/// 0.17.0, "recompute" before and without the key). The simulator (`v` None) plays
/// "recompute" unless told otherwise, as it always did.
pub fn load_failure_policy(c: &ConnectorSection, v: Option<&Version>) -> KvLoadFailurePolicy {
    c.kv_load_failure_policy.unwrap_or_else(|| match v {
        Some(v) if FAILS_BY_DEFAULT.contains(v) => KvLoadFailurePolicy::Fail,
        _ => KvLoadFailurePolicy::Recompute,
    })
}

/// Writes the topology's `kv_load_failure_policy` into a launch's kv_transfer_config (the
/// top level: vLLM's scheduler reads it there, also under a MultiConnector). Unset, vLLM
/// keeps its default; [`check_load_failure_policy`] has refused versions without the key.
pub fn apply_load_failure_policy(c: &ConnectorSection, launch: &mut Launch) {
    if let Some(p) = c.kv_load_failure_policy
        && let Some(cfg) = launch.kv_transfer_config.as_object_mut()
    {
        cfg.insert(
            "kv_load_failure_policy".into(),
            serde_json::to_value(p).expect("policy serializes"),
        );
    }
}

/// Fails when `connector.nixl_mode = "push"` is set for another connector than NIXL (it
/// would be silently ignored).
pub fn check_nixl_mode(c: &ConnectorSection) -> Result<(), Problem> {
    if c.nixl_mode == crate::topology::NixlMode::Pull || c.kind == ConnectorKind::Nixl {
        return Ok(());
    }
    Err(Problem::new(
        "connector.nixl_mode",
        format!(
            "nixl_mode only applies to kind = \"nixl\", not `{}`",
            kind_name(c.kind)
        ),
    )
    .hint("remove connector.nixl_mode, or set connector.kind = \"nixl\""))
}

/// `kv_producer` for prefill, `kv_consumer` for decode.
fn producer_consumer(role: Role) -> &'static str {
    if role == Role::Prefill {
        "kv_producer"
    } else {
        "kv_consumer"
    }
}

/// `{"kv_connector": name, "kv_role": role}` plus extra config (the topology's
/// `connector.extra_config` merged over `extra`) when there is any.
fn transfer_config(c: &ConnectorSection, name: &str, role: &str, extra: Value) -> Value {
    let mut cfg = json!({ "kv_connector": name, "kv_role": role });
    let mut merged = match extra {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    for (k, v) in &c.extra_config {
        merged.insert(k.clone(), serde_json::to_value(v).unwrap_or(Value::Null));
    }
    if !merged.is_empty() {
        cfg["kv_connector_extra_config"] = Value::Object(merged);
    }
    cfg
}

/// Bytes of a size such as `4GB`, `256MB`, `1073741824` (Mooncake's readers differ in
/// which string forms they take; every version takes an integer).
pub(crate) fn size_bytes(key: &str, s: &str) -> Result<u64, Problem> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        Problem::new(key, format!("`{s}` is not a size"))
            .hint("write e.g. \"4GB\", \"256MB\" or a byte count")
    })?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" | "K" | "KIB" => 1 << 10,
        "MB" | "M" | "MIB" => 1 << 20,
        "GB" | "G" | "GIB" => 1 << 30,
        "TB" | "T" | "TIB" => 1 << 40,
        other => {
            return Err(
                Problem::new(key, format!("unknown size unit `{other}` in `{s}`"))
                    .hint("use B, KB, MB, GB or TB"),
            );
        }
    };
    if n <= 0.0 {
        return Err(Problem::new(key, format!("`{s}` must be more than zero")));
    }
    Ok((n * mult as f64) as u64)
}

/// Named so a topology asking for it gets a clear answer instead of a wrong plan.
struct Unsupported;

impl Connector for Unsupported {
    fn about(&self) -> &'static About {
        &About {
            kind: ConnectorKind::P2pNccl,
            classes: "P2pNcclConnector",
            versions: &[],
        }
    }
    /// Refused for every engine and version, before anything else is looked at.
    fn check(&self, _: &Topology, _: Option<&Version>) -> Result<(), Problem> {
        Err(Problem::new(
            "connector.kind",
            "p2p-nccl is not supported by pdctl yet: its proxy must register instances over ZMQ and encode routes in X-Request-Id",
        )
        .hint("use nixl or mooncake for direct GPU-to-GPU transfer"))
    }
    fn launch(&self, _: LaunchCtx) -> Result<Launch, Problem> {
        unreachable!("check refuses p2p-nccl before any launch is planned")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_as_mooncake_means_them() {
        assert_eq!(size_bytes("k", "4GB").unwrap(), 4 << 30);
        assert_eq!(size_bytes("k", "256MB").unwrap(), 256 << 20);
        assert_eq!(size_bytes("k", "1073741824").unwrap(), 1 << 30);
        assert!(size_bytes("k", "lots").is_err());
        assert!(size_bytes("k", "4XB").is_err());
        assert!(size_bytes("k", "0GB").is_err());
    }

    #[test]
    fn version_errors_say_which_versions_and_connectors_fit() {
        let v: Version = "0.13.0".parse().unwrap();
        let e = check_version(for_kind(ConnectorKind::MooncakeTe), &v).unwrap_err();
        assert_eq!(e.key, "connector.kind");
        assert!(e.message.contains("0.6.4 to 0.10.0"), "{}", e.message);
        let hint = e.hint.unwrap();
        assert!(hint.contains("nixl") && hint.contains("example"), "{hint}");
        assert!(!hint.contains("mooncake-te"), "{hint}");
    }
}
