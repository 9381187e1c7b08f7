//! Topology -> plan: placement, ports, GPUs, and one service per process. Pure: the
//! inputs that need I/O (GPU inventory, vLLM version, state root) are given.

use super::Plan;
use super::engines;
use super::held::Holdings;
use super::listen::Reach;
use super::support;
use crate::child_config::ChildSettings;
use crate::connectors::{self, ClusterCtx, PortBook};
use crate::gpu::Gpu;
use crate::topology::{EngineKind, Problem, Topology};
use crate::vocab::{Role, Service, Version, VersionSource};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A topology that cannot be planned: a [`Problem`] naming the key at fault.
pub type PlanError = Problem;

/// Everything planning needs besides the topology.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub topology: &'a Topology,
    /// The head node (resolved by the loader: `head`, else the first node).
    pub head: &'a str,
    /// This machine's GPUs; other nodes are assumed to have the same.
    pub gpus: &'a [Gpu],
    /// Why `gpus` is empty when NVML could not be asked (said in GPU errors).
    pub gpu_note: Option<String>,
    /// The model's size (weights, KV cache per token), read from its files at the edge,
    /// or why it is unknown: engines sharing a GPU get their KV cache size from it.
    pub model: Result<crate::model_files::ModelSize, String>,
    /// The vLLM version templates are chosen for (required for engine = "vllm").
    pub version: Option<Version>,
    /// Where `version` came from (said in the plan beside it).
    pub version_source: VersionSource,
    /// Root of the per-cluster state dirs.
    pub state_root: PathBuf,
    /// The node this machine is (`up --node`); default the head.
    pub local_node: Option<&'a str>,
    /// The GPUs and ports a running cluster's instances hold, when a change plans it again: the
    /// instances the plan keeps keep them (see [`super::held`]); empty for a fresh one.
    pub held: Holdings,
}

/// The state dir of `node`'s supervisor: `<root>/<cluster>`, or `<root>/<cluster>-<node>`
/// when the topology has several nodes (two nodes on one host must not share a lock).
pub fn state_dir_for(t: &Topology, root: &Path, node: &str) -> PathBuf {
    state_dir_of(&t.cluster, t.nodes.len() > 1, root, node)
}

/// [`state_dir_for`] from the names alone (for a plan read back from a file).
pub fn state_dir_of(cluster: &str, several_nodes: bool, root: &Path, node: &str) -> PathBuf {
    if several_nodes {
        root.join(format!("{cluster}-{node}"))
    } else {
        root.join(cluster)
    }
}

/// Builds the plan, or names the first key that makes it impossible: the planning stages
/// in their order (the version the connector accepts, where the engines go, the shared
/// services, the engines, the proxy, the GPU fit, the warnings).
pub fn build_plan(input: &PlanInput) -> Result<Plan, PlanError> {
    let t = input.topology;
    let local = local_node(input)?;
    let conn = connectors::for_kind(t.connector.kind);
    let version = checked_version(input, conn)?;
    if let (EngineKind::Vllm, Some(v)) = (t.engine.kind, version.as_ref()) {
        let kv_heads = input.model.as_ref().ok().and_then(|m| m.kv_heads);
        super::pairs::check_settings(t, conn, v, kv_heads)?;
    }
    let needs = conn.needs(&t.connector, version.as_ref());
    let protocol = conn.protocol(&t.connector, version.as_ref());
    let mut plan = topology_part(input, version.as_ref(), protocol, local);
    let mut ports = PortBook::default();

    let (placements, reach) = place_engines(t, input.head, protocol);
    let for_support = support::SupportFor {
        needs: &needs,
        version: version.as_ref(),
        reach: &reach,
    };
    let sup = support::plan_support(
        t,
        input.head,
        &plan.state_dir,
        for_support,
        &mut ports,
        &mut plan.warnings,
    )?;
    let cx = cluster_ctx(t, version.as_ref(), &sup, &plan.state_dir, &placements);
    let pool = engines::GpuPool::new(input.gpus, input.gpu_note.clone(), input.model.clone())
        .holding(input.held.clone());
    let engine_services = engines::plan_engines(
        &cx,
        conn,
        protocol,
        &placements,
        &pool,
        local,
        &sup.names,
        &mut ports,
        &mut plan.warnings,
        &mut plan.settings,
    )?;

    let mut services: Vec<Service> = sup.services;
    services.extend(engine_services);
    let proxy = if t.proxy.enabled {
        let leaves = support::handoff_leaves_tokens(t, conn, &services, &plan.settings);
        let for_proxy = (protocol, version.as_ref(), leaves);
        Some(plan_the_proxy(input, for_proxy, &services, &mut ports)?)
    } else {
        None
    };
    check_gpu_fit(&services, local, input.gpus)?;
    if let Some((svc, args)) = proxy {
        plan.settings
            .insert(svc.name.clone(), ChildSettings::Proxy(Box::new(args)));
        plan.proxy_url = svc.url.clone();
        services.push(svc);
    }
    if t.nodes.len() > 1 {
        plan.warnings
            .extend(super::listen::open_by_design(&services, &reach));
    }
    plan.warnings
        .extend(super::listen::binds_every_address(&services));
    plan.services = services;
    Ok(plan)
}

/// The node this machine plans for (`--node`, else the head), when the topology has it.
fn local_node<'a>(input: &PlanInput<'a>) -> Result<&'a str, PlanError> {
    let local = input.local_node.unwrap_or(input.head);
    check_node(input.topology, local)?;
    Ok(local)
}

/// Fails unless `node` (`--node`) is a node of the topology.
pub fn check_node(t: &Topology, node: &str) -> Result<(), PlanError> {
    if t.nodes.contains_key(node) {
        return Ok(());
    }
    let known: Vec<&str> = t.nodes.keys().map(String::as_str).collect();
    Err(Problem::new(
        "nodes",
        format!("--node {node} is not a node of this topology"),
    )
    .hint(format!("nodes are: {}", known.join(", "))))
}

/// What the connectors are told of the cluster: its shared services' endpoints, the
/// directories, and where each role's engines listen for KV.
fn cluster_ctx<'a>(
    t: &'a Topology,
    version: Option<&'a Version>,
    sup: &support::SupportPlan,
    state_dir: &Path,
    placements: &[engines::Placement],
) -> ClusterCtx<'a> {
    let kv_hosts = |role: Role| {
        placements
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.kv_listen.clone())
            .collect()
    };
    ClusterCtx {
        topology: t,
        version,
        etcd: sup.etcd.clone(),
        master: sup.master.clone(),
        master_http_metadata: sup.master_http_metadata.clone(),
        lmcache: sup.lmcache.clone(),
        shared_dir: t
            .connector
            .shared_storage_path
            .clone()
            .unwrap_or_else(|| state_dir.join("kv")),
        files_dir: state_dir.join("files"),
        prefill_hosts: kv_hosts(Role::Prefill),
        decode_hosts: kv_hosts(Role::Decode),
    }
}

/// The plan's part that comes straight from the topology and the chosen version, with no
/// services, settings or warnings yet.
fn topology_part(
    input: &PlanInput,
    version: Option<&Version>,
    protocol: crate::vocab::ProxyProtocol,
    local: &str,
) -> Plan {
    let t = input.topology;
    Plan {
        cluster: t.cluster.clone(),
        state_dir: state_dir_for(t, &input.state_root, local),
        head_node: input.head.to_string(),
        nodes: t.nodes.clone(),
        proxy_url: None,
        engine: match t.engine.kind {
            EngineKind::Vllm => "vllm".into(),
            EngineKind::Sim => "sim".into(),
        },
        vllm_version_source: version.map(|_| input.version_source),
        vllm_version: version.map(|v| v.to_string()),
        connector: connectors::kind_name(t.connector.kind),
        protocol: protocol_name(protocol),
        services: Vec::new(),
        warnings: Vec::new(),
        control_port: (t.nodes.len() > 1).then_some(t.control.port),
        tcp: t.network,
        health: t.health,
        settings: BTreeMap::new(),
        rebalance: t
            .rebalance
            .clone()
            .map(|table| crate::vocab::RebalancePlan {
                table,
                prefill_gpus: t.prefill.gpus_per_instance,
                decode_gpus: t.decode.gpus_per_instance,
            }),
        model_fetch: None,
        dashboard: t.dashboard.clone(),
    }
}

/// Where each engine runs, which node reaches which, and the address each engine's KV
/// listener binds. Decode finds the prefill's KV at the prefill's HTTP address: the
/// simulator pulls it from there (but through a shared directory), Mooncake's bootstrap
/// host is taken from the prefill's URL.
fn place_engines<'a>(
    t: &'a Topology,
    head: &'a str,
    protocol: crate::vocab::ProxyProtocol,
) -> (Vec<engines::Placement>, Reach<'a>) {
    let mut placements = engines::place(t, head);
    let reach = Reach::new(t, placements.iter().map(|p| (p.role, p.node.clone())), head);
    let pull_via_http = protocol == crate::vocab::ProxyProtocol::Mooncake
        || (t.engine.kind == EngineKind::Sim
            && connectors::sim_handoff(protocol) != crate::vocab::SimHandoff::SharedDir);
    engines::bind(&mut placements, &reach, pull_via_http);
    (placements, reach)
}

/// The proxy on its node (the head unless `proxy.node` says), in front of `services`,
/// for a protocol, a vLLM version and the prompt tokens a good handoff leaves decode.
fn plan_the_proxy(
    input: &PlanInput,
    (protocol, version, leaves): (crate::vocab::ProxyProtocol, Option<&Version>, u32),
    services: &[Service],
    ports: &mut PortBook,
) -> Result<(Service, crate::child_config::proxy::ProxyArgs), PlanError> {
    let t = input.topology;
    let node = t.proxy.node.as_deref().unwrap_or(input.head);
    let socket = state_dir_for(t, &input.state_root, node).join(crate::vocab::SOCKET_NAME);
    support::plan_proxy(t, node, protocol, version, services, leaves, &socket, ports)
}

/// The vLLM version the plan is for (none for the simulator), once the connector has said
/// it can work with it and the topology's connector settings: the connector's own
/// refusals come first, they say more than "no template for vLLM X".
fn checked_version(
    input: &PlanInput,
    conn: &dyn connectors::Connector,
) -> Result<Option<Version>, PlanError> {
    let t = input.topology;
    let version = match t.engine.kind {
        EngineKind::Sim => None,
        EngineKind::Vllm => Some(input.version.clone().ok_or_else(|| {
            Problem::new("engine.vllm_version", "the vLLM version is unknown")
                .hint("pin engine.vllm_version, or install vLLM into engine.python")
        })?),
    };
    connectors::check_nixl_mode(&t.connector)?;
    conn.check(t, version.as_ref())?;
    if let Some(v) = &version {
        connectors::check_version(conn, v)?;
        connectors::check_extra_config(&t.connector, v)?;
        connectors::check_load_failure_policy(&t.connector, v)?;
    }
    Ok(version)
}

/// Fails when this node's engines do not fit its GPUs. Only this machine's GPUs are
/// known; other nodes are checked when planned there.
fn check_gpu_fit(services: &[Service], local: &str, gpus: &[Gpu]) -> Result<(), PlanError> {
    let local_services = services.iter().filter(|s| s.node == local);
    match super::gpu_fit::check(local_services, gpus).first() {
        Some(short) => Err(Problem::new(
            "engine.gpu_memory_utilization",
            format!("the engines do not fit: {short}"),
        )
        .also("engine.instances_per_gpu")
        .hint("free that GPU, lower engine.gpu_memory_utilization (shared GPUs split it), or set engine.kv_cache_memory")),
        None => Ok(()),
    }
}

fn protocol_name(p: crate::vocab::ProxyProtocol) -> String {
    crate::spelling::value_name(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Source, load_str};

    fn plan_of(text: &str, gpus: &[u32]) -> Result<Plan, Problem> {
        let t = load_str(text, Source::Profile("t".into()), "t.toml".into()).unwrap();
        let inv: Vec<Gpu> = gpus.iter().copied().map(Gpu::declared).collect();
        build_plan(&PlanInput {
            topology: &t.spec,
            head: &t.head,
            gpus: &inv,
            gpu_note: None,
            model: Err("not read in this test".into()),
            version: Some("0.9.2".parse().unwrap()),
            version_source: VersionSource::Pinned,
            state_root: "/state".into(),
            local_node: None,
            held: Holdings::default(),
        })
    }

    #[test]
    fn a_short_sim_file_plans_one_pair_and_a_proxy() {
        let p = plan_of("[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n", &[]).unwrap();
        let names: Vec<&str> = p.services.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["prefill-0", "decode-0", "proxy"]);
        assert_eq!(p.state_dir, PathBuf::from("/state/pd"));
        assert_eq!(p.proxy_url.as_deref(), Some("http://127.0.0.1:8000"));
        assert_eq!(
            p.service("proxy").unwrap().depends_on,
            ["prefill-0", "decode-0"]
        );
    }

    #[test]
    fn clashing_ports_name_the_key_to_change() {
        let e = plan_of(
            "[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n[decode]\nbase_port = 8100\n",
            &[],
        )
        .unwrap_err();
        assert_eq!(e.key, "decode.base_port");
        assert!(e.message.contains("prefill-0 (http)"), "{}", e.message);
    }

    #[test]
    fn too_few_gpus_lists_the_ones_there_are() {
        let e = plan_of("[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.9.2\"\n[prefill]\ninstances = 2\n[decode]\ninstances = 2\n", &[0, 1, 2])
            .unwrap_err();
        assert_eq!(e.key, "decode.instances");
        assert!(e.message.contains("0, 1, 2"), "{}", e.message);
    }
}
