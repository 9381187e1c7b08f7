//! Prefill and decode instances: where each runs, which GPUs and ports it gets, and its
//! command line (real vLLM, or the simulator speaking the same protocol).

use super::build::claim;
use super::{Probe, RestartPolicy, Role, Service, Shutdown};
use crate::connectors::{ClusterCtx, Connector, InstanceCtx, PortBook};
use crate::gpu::Gpu;
use crate::proxy::args::ProxyProtocol;
use crate::sim::args::{SimArgs, SimHandoff, SimRole};
use crate::topology::{Device, EngineKind, Problem, RoleSection, Topology};
use clap::Parser;
use std::collections::{BTreeMap, BTreeSet};

/// One engine instance placed on a node.
#[derive(Debug, Clone)]
pub(super) struct Placement {
    pub role: Role,
    pub index: u32,
    pub node: String,
    pub host: String,
}

/// Every prefill instance, then every decode instance, each on its node: `node`, else
/// round-robin over `nodes`, else the head.
pub(super) fn place(t: &Topology, head: &str) -> Vec<Placement> {
    let mut out = Vec::new();
    for (role, r) in [(Role::Prefill, &t.prefill), (Role::Decode, &t.decode)] {
        for i in 0..r.instances {
            let node = match (&r.node, &r.nodes) {
                (Some(n), _) => n.clone(),
                (None, Some(list)) => list[i as usize % list.len()].clone(),
                (None, None) => head.to_string(),
            };
            let host = t.nodes[&node].clone();
            out.push(Placement {
                role,
                index: i,
                node,
                host,
            });
        }
    }
    out
}

/// The GPUs of one machine, handed out per node (every node is assumed to have this
/// machine's inventory).
pub(super) struct GpuPool {
    inventory: Vec<Gpu>,
    note: Option<String>,
}

impl GpuPool {
    pub fn new(gpus: &[Gpu], note: Option<String>) -> GpuPool {
        GpuPool {
            inventory: gpus.to_vec(),
            note,
        }
    }
}

/// GPUs already given out on each node.
#[derive(Default)]
struct GpuUse {
    taken: BTreeMap<String, BTreeSet<u32>>,
}

impl GpuUse {
    /// `tp` GPUs for one instance: adjacent indices when possible.
    fn take(
        &mut self,
        pool: &GpuPool,
        node: &str,
        role: &RoleSection,
        tp: u32,
    ) -> Option<Vec<u32>> {
        let taken = self.taken.entry(node.to_string()).or_default();
        let allowed: Vec<u32> = pool
            .inventory
            .iter()
            .map(|g| g.index)
            .filter(|i| role.gpus.as_ref().is_none_or(|list| list.contains(i)))
            .filter(|i| !taken.contains(i))
            .collect();
        let tp = tp as usize;
        if allowed.len() < tp {
            return None;
        }
        let adjacent = allowed
            .windows(tp)
            .find(|w| w.windows(2).all(|p| p[1] == p[0] + 1))
            .map(|w| w.to_vec());
        let pick = adjacent.unwrap_or_else(|| allowed[..tp].to_vec());
        taken.extend(pick.iter().copied());
        Some(pick)
    }
}

/// Plans every engine instance.
#[allow(clippy::too_many_arguments)]
pub(super) fn plan_engines(
    cx: &ClusterCtx,
    conn: &dyn Connector,
    protocol: ProxyProtocol,
    placements: &[Placement],
    pool: &GpuPool,
    local_node: &str,
    support: &[String],
    ports: &mut PortBook,
    warnings: &mut Vec<String>,
) -> Result<Vec<Service>, Problem> {
    let t = cx.topology;
    // Fixed HTTP ports first, so clashes name the keys the user wrote.
    for p in placements {
        let svc = p.role.instance_name(p.index);
        claim(ports, &p.host, http_port(t, p), &svc, "http")?;
    }
    check_gpu_counts(t, placements, pool)?;
    if let (EngineKind::Vllm, Some(v)) = (t.engine.kind, cx.version) {
        warnings.extend(conn.warnings(t, v));
    }
    let mut gpu_use = GpuUse::default();
    let mut warned_nodes = BTreeSet::new();
    let mut per_node: BTreeMap<&str, u32> = BTreeMap::new();
    for p in placements {
        *per_node.entry(&p.node).or_default() += 1;
    }
    let mut out = Vec::new();
    for p in placements {
        let r = role_section(t, p.role);
        let name = p.role.instance_name(p.index);
        let needs_gpus = t.engine.kind == EngineKind::Vllm && t.engine.device == Device::Cuda;
        let gpus = if needs_gpus {
            gpu_use
                .take(pool, &p.node, r, r.gpus_per_instance)
                .ok_or_else(|| gpu_shortage(t, placements, p.role, &p.node, pool))?
        } else {
            Vec::new()
        };
        if needs_gpus && p.node != local_node && warned_nodes.insert(p.node.clone()) {
            warnings.push(format!(
                "node {}: GPUs assumed to match this machine's; plan on that node (pdctl plan --node {}) to check",
                p.node, p.node
            ));
        }
        for g in &gpus {
            if let Some(reason) = pool
                .inventory
                .iter()
                .find(|x| x.index == *g)
                .and_then(Gpu::busy_reason)
            {
                warnings.push(format!("{name}: {reason}"));
            }
        }
        let bootstrap_port = if protocol == ProxyProtocol::Mooncake && p.role == Role::Prefill {
            Some(
                ports
                    .take(
                        &p.host,
                        t.connector.bootstrap_port,
                        1,
                        &format!("{name} (bootstrap)"),
                    )
                    .ok_or_else(|| {
                        Problem::new(
                            "connector.bootstrap_port",
                            format!(
                                "no free bootstrap port for {name} on {} at or above {}",
                                p.host, t.connector.bootstrap_port
                            ),
                        )
                        .hint("set connector.bootstrap_port lower, below the ports in use")
                    })?,
            )
        } else {
            None
        };
        let inst = InstanceCtx {
            role: p.role,
            name: name.clone(),
            host: p.host.clone(),
            tp: r.gpus_per_instance,
            bootstrap_port,
        };
        let mut svc = match (t.engine.kind, cx.version) {
            (EngineKind::Vllm, Some(v)) => {
                let launch = conn.launch(cx, v, &inst, ports)?;
                let shares_node = per_node[p.node.as_str()] > 1;
                vllm_service(t, p, &inst, &gpus, launch, shares_node)
            }
            _ => sim_service(cx, p, &inst, protocol),
        };
        svc.depends_on = support.to_vec();
        svc.restart_with = expand_restart_with(t, r, &name);
        out.push(svc);
    }
    Ok(out)
}

fn role_section(t: &Topology, role: Role) -> &RoleSection {
    if role == Role::Prefill {
        &t.prefill
    } else {
        &t.decode
    }
}

fn http_port(t: &Topology, p: &Placement) -> u16 {
    let r = role_section(t, p.role);
    let base = r
        .base_port
        .unwrap_or(if p.role == Role::Prefill { 8100 } else { 8200 });
    base + p.index as u16
}

/// Fails early with the whole count when a node cannot hold its instances.
fn check_gpu_counts(t: &Topology, placements: &[Placement], pool: &GpuPool) -> Result<(), Problem> {
    if t.engine.kind != EngineKind::Vllm || t.engine.device != Device::Cuda {
        return Ok(());
    }
    let mut per_node: BTreeMap<&str, u32> = BTreeMap::new();
    for p in placements {
        *per_node.entry(&p.node).or_default() += role_section(t, p.role).gpus_per_instance;
    }
    for (node, wanted) in per_node {
        if wanted as usize > pool.inventory.len() {
            let last = placements
                .iter()
                .rev()
                .find(|p| p.node == node)
                .expect("node has placements");
            return Err(gpu_shortage(t, placements, last.role, node, pool));
        }
    }
    Ok(())
}

fn gpu_shortage(
    t: &Topology,
    placements: &[Placement],
    role: Role,
    node: &str,
    pool: &GpuPool,
) -> Problem {
    let key = format!("{}.instances", role.as_str());
    if pool.inventory.is_empty() {
        let why = pool
            .note
            .clone()
            .unwrap_or_else(|| "no GPU inventory".into());
        return Problem::new(key, format!("engines need GPUs but none are known: {why}"))
            .hint("pass --gpus 0,1,... (or PDCTL_GPUS), use engine.kind = \"sim\", or engine.device = \"cpu\"");
    }
    let mut asks = Vec::new();
    for (role_name, r) in [(Role::Prefill, &t.prefill), (Role::Decode, &t.decode)] {
        let here = placements
            .iter()
            .filter(|p| p.node == node && p.role == role_name)
            .count();
        if here > 0 {
            asks.push(format!("{role_name} {here} x {}", r.gpus_per_instance));
        }
    }
    let list: Vec<String> = pool.inventory.iter().map(|g| g.index.to_string()).collect();
    Problem::new(
        key,
        format!(
            "node {node} is asked for more GPUs than it has ({}), and it has {}: {}",
            asks.join(", "),
            list.len(),
            list.join(", ")
        ),
    )
    .hint("lower instances or gpus_per_instance, spread instances over more nodes, or plan for another machine with --gpus")
}

/// Role names become every instance of that role; the service itself is left out.
fn expand_restart_with(t: &Topology, r: &RoleSection, me: &str) -> Vec<String> {
    let mut out = Vec::new();
    for w in &r.restart_with {
        match w.as_str() {
            "prefill" => {
                out.extend((0..t.prefill.instances).map(|i| Role::Prefill.instance_name(i)))
            }
            "decode" => out.extend((0..t.decode.instances).map(|i| Role::Decode.instance_name(i))),
            other => out.push(other.to_string()),
        }
    }
    out.retain(|s| s != me);
    out.dedup();
    out
}

fn base_service(p: &Placement, inst: &InstanceCtx, port: u16) -> Service {
    let url = format!("http://{}:{port}", inst.host);
    Service {
        name: inst.name.clone(),
        role: p.role,
        node: p.node.clone(),
        host: p.host.clone(),
        argv: Vec::new(),
        env: BTreeMap::new(),
        gpus: Vec::new(),
        ports: BTreeMap::from([("http".to_string(), port)]),
        files: Vec::new(),
        depends_on: Vec::new(),
        probe: Probe::Http {
            url: format!("{url}/health"),
            status: 200,
            body_contains: None,
        },
        url: Some(url),
        startup_timeout_s: 900,
        restart: RestartPolicy::default(),
        restart_with: Vec::new(),
        shutdown: Shutdown::default(),
        dirs: Vec::new(),
    }
}

/// A real vLLM instance: `python -m vllm.entrypoints.openai.api_server ...`.
fn vllm_service(
    t: &Topology,
    p: &Placement,
    inst: &InstanceCtx,
    gpus: &[u32],
    launch: crate::connectors::Launch,
    shares_node: bool,
) -> Service {
    let r = role_section(t, p.role);
    let port = http_port(t, p);
    let mut svc = base_service(p, inst, port);
    let m = &t.model;
    let mut argv: Vec<String> = vec![
        t.engine.python.clone(),
        "-m".into(),
        "vllm.entrypoints.openai.api_server".into(),
        "--model".into(),
        m.name.clone(),
    ];
    if let Some(s) = &m.served_name {
        argv.extend(["--served-model-name".into(), s.clone()]);
    }
    argv.extend([
        "--host".into(),
        inst.host.clone(),
        "--port".into(),
        port.to_string(),
    ]);
    if let Some(n) = m.max_model_len {
        argv.extend(["--max-model-len".into(), n.to_string()]);
    }
    if let Some(u) = t.engine.gpu_memory_utilization {
        argv.extend(["--gpu-memory-utilization".into(), u.to_string()]);
    }
    if m.trust_remote_code {
        argv.push("--trust-remote-code".into());
    }
    if inst.tp > 1 {
        argv.extend(["--tensor-parallel-size".into(), inst.tp.to_string()]);
    }
    argv.extend(t.engine.args.iter().cloned());
    argv.extend(r.args.iter().cloned());
    argv.extend([
        "--kv-transfer-config".into(),
        launch.kv_transfer_config.to_string(),
    ]);
    svc.argv = argv;
    svc.env.insert("PYTHONUNBUFFERED".into(), "1".into());
    if t.engine.device == Device::Cuda {
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        svc.env
            .insert("CUDA_VISIBLE_DEVICES".into(), list.join(","));
    } else {
        svc.env.extend(cpu_env(t, r, shares_node));
    }
    svc.env.extend(launch.env);
    svc.gpus = gpus.to_vec();
    svc.ports.extend(launch.ports);
    svc.files = launch.files;
    svc.dirs = launch.dirs;
    apply_user_settings(&mut svc, t, r, 900);
    svc
}

/// What the topology sets for every engine of a role, on top of what pdctl planned: its
/// env (which wins), restart policy and start-up timeout (`default_s` when it sets none).
fn apply_user_settings(svc: &mut Service, t: &Topology, r: &RoleSection, default_s: u64) {
    svc.env.extend(t.engine.env.clone());
    svc.env.extend(r.env.clone());
    svc.restart.mode = r.restart;
    svc.startup_timeout_s = r
        .startup_timeout_s
        .or(t.engine.startup_timeout_s)
        .unwrap_or(default_s);
}

/// Environment vLLM's CPU build needs to serve PD, where its defaults get it wrong; the
/// topology's own `env` (applied later) and the flags named below win.
///
/// - `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache): without it (vLLM 0.32) each instance
///   reserves `gpu_memory_utilization` (0.92) of its NUMA node's RAM and refuses to start
///   when that much is not free: a second instance never starts, often not even one. 4 GiB
///   is what vLLM used before it sized the cache itself. Left out when the topology sets
///   `engine.gpu_memory_utilization` or passes `--kv-cache-memory-bytes` (the variable
///   would override both).
/// - `VLLM_CPU_OMP_THREADS_BIND=nobind` when instances share a machine: the default
///   `auto` pins every instance's threads to the same cores.
fn cpu_env(t: &Topology, r: &RoleSection, shares_node: bool) -> BTreeMap<String, String> {
    let has_flag = |f: &str| {
        t.engine
            .args
            .iter()
            .chain(&r.args)
            .any(|a| a == f || a.starts_with(&format!("{f}=")))
    };
    let mut env = BTreeMap::new();
    if t.engine.gpu_memory_utilization.is_none()
        && !has_flag("--kv-cache-memory-bytes")
        && !has_flag("--gpu-memory-utilization")
    {
        env.insert("VLLM_CPU_KVCACHE_SPACE".into(), "4".into());
    }
    if shares_node {
        env.insert("VLLM_CPU_OMP_THREADS_BIND".into(), "nobind".into());
    }
    env
}

/// Wraps SimArgs so they can be built from their own defaults.
#[derive(Parser)]
struct SimCmd {
    #[command(flatten)]
    args: SimArgs,
}

/// A simulated instance: `pdctl sim ...` with the handoff matching the proxy protocol and
/// the context length of `[model] max_model_len` when the topology sets it.
fn sim_service(
    cx: &ClusterCtx,
    p: &Placement,
    inst: &InstanceCtx,
    protocol: ProxyProtocol,
) -> Service {
    let t = cx.topology;
    let r = role_section(t, p.role);
    let port = http_port(t, p);
    let mut svc = base_service(p, inst, port);
    let mut a = SimCmd::parse_from(["sim", "--port", &port.to_string()]).args;
    a.host = inst.host.clone();
    a.role = if p.role == Role::Prefill {
        SimRole::Prefill
    } else {
        SimRole::Decode
    };
    a.model = t.model.served().to_string();
    a.instance = Some(inst.name.clone());
    a.handoff = crate::connectors::sim_handoff(protocol);
    if a.handoff == SimHandoff::SharedDir {
        a.kv_dir = Some(cx.shared_dir.clone());
        svc.dirs.push(cx.shared_dir.clone());
    }
    a.bootstrap_port = inst.bootstrap_port;
    if let Some(b) = inst.bootstrap_port {
        svc.ports.insert("bootstrap".into(), b);
    }
    a.model_params = t.engine.sim.clone();
    // The model's context length is the cluster's, whichever engine serves it: a sim
    // stand-in must refuse the prompts the real vLLM would.
    if let Some(n) = t.model.max_model_len {
        a.model_params.max_model_len = n;
    }
    let mut argv = vec![crate::tools::SELF_PROGRAM.to_string(), "sim".to_string()];
    argv.extend(a.to_argv());
    svc.argv = argv;
    svc.shutdown.timeout_s = 10;
    let startup = t.engine.sim.startup_ms.div_ceil(1000);
    apply_user_settings(&mut svc, t, r, 60 + startup);
    svc
}
