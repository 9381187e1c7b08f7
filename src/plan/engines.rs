//! Prefill and decode instances: where each runs, which GPUs and ports it gets, and its
//! command line (real vLLM, or the simulator speaking the same protocol).

use super::held::Holdings;
use super::kv_budget;
use super::ports::claim;
use crate::child_config::sim::SimArgs;
use crate::child_config::{ChildSettings, Configured};
use crate::connectors::{ClusterCtx, Connector, InstanceCtx, LaunchCtx, PortBook};
use crate::gpu::Gpu;
use crate::model_files::ModelSize;
use crate::topology::{Device, EngineKind, Problem, RoleSection, Topology};
use crate::vocab::{
    Check, GeneratedFile, Probe, ProxyProtocol, RestartPolicy, Role, Service, Shutdown, SimHandoff,
    SimRole, Version,
};
use std::collections::{BTreeMap, BTreeSet};

/// One engine instance placed on a node.
#[derive(Debug, Clone)]
pub(super) struct Placement {
    pub role: Role,
    pub index: u32,
    pub node: String,
    /// Its node's address as the topology writes it (ports are booked per node under it).
    pub host: String,
    /// The address its KV transfer listeners bind and advertise (side channel, transfer
    /// engine): the node's when engines on other nodes reach them, else loopback.
    pub kv_listen: String,
    /// The address its HTTP server binds (see [`super::listen::Reach::engine_http`]).
    pub http_listen: String,
}

/// Every prefill instance, then every decode instance, each on its node: `node`, else
/// round-robin over `nodes`, else the head (listening on the node's address until
/// [`bind`] narrows it).
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
                kv_listen: host.clone(),
                http_listen: host.clone(),
                host,
            });
        }
    }
    out
}

/// Narrows each placed instance's listeners to what other nodes reach: the KV listeners
/// when engines run on other nodes, the HTTP port as [`super::listen::Reach::engine_http`]
/// says (`pull_via_http`: decode pulls KV through the prefill's HTTP address).
pub(super) fn bind(
    placements: &mut [Placement],
    reach: &super::listen::Reach,
    pull_via_http: bool,
) {
    for p in placements {
        p.kv_listen = reach.addr(&p.node, reach.engines_elsewhere(&p.node));
        p.http_listen = reach.addr(&p.node, reach.engine_http(&p.node, p.role, pull_via_http));
    }
}

/// The GPUs of one machine, handed out per node (every node is assumed to have this
/// machine's inventory), and the size of the model they will hold.
pub(super) struct GpuPool {
    inventory: Vec<Gpu>,
    note: Option<String>,
    model: Result<ModelSize, String>,
    /// What the running cluster's instances hold, GPUs and ports (empty for a fresh
    /// cluster).
    held: Holdings,
}

impl GpuPool {
    pub fn new(gpus: &[Gpu], note: Option<String>, model: Result<ModelSize, String>) -> GpuPool {
        GpuPool {
            inventory: gpus.to_vec(),
            note,
            model,
            held: Holdings::default(),
        }
    }

    /// The same pool, with what a running cluster's instances hold kept for them.
    pub fn holding(mut self, held: Holdings) -> GpuPool {
        self.held = held;
        self
    }
}

/// How many instances hold each GPU, per node.
#[derive(Default)]
struct GpuUse {
    load: BTreeMap<String, BTreeMap<u32, u32>>,
}

impl GpuUse {
    /// The GPUs instance `p` holds in the running cluster, booked for it again when it
    /// stays what it was (same node, role and GPU count) and they are still allowed: in
    /// the inventory, in the role's `gpus`, under `instances_per_gpu`.
    fn keep(&mut self, pool: &GpuPool, t: &Topology, p: &Placement) -> Option<Vec<u32>> {
        let held = pool.held.get(&p.role.instance_name(p.index))?;
        let r = role_section(t, p.role);
        let load = self.load.entry(p.node.clone()).or_default();
        let allowed = |g: &u32| {
            pool.inventory.iter().any(|x| x.index == *g)
                && r.gpus.as_ref().is_none_or(|list| list.contains(g))
                && load.get(g).copied().unwrap_or(0) < t.engine.instances_per_gpu
        };
        let same = held.node == p.node
            && held.role == p.role
            && held.gpus.len() == r.gpus_per_instance as usize;
        if !same || !held.gpus.iter().all(allowed) {
            return None;
        }
        for g in &held.gpus {
            *load.entry(*g).or_default() += 1;
        }
        Some(held.gpus.clone())
    }

    /// `tp` GPUs for one instance, each holding fewer than `per_gpu` instances so far: the
    /// least-loaded ones (so sharing starts only once every allowed GPU holds one),
    /// adjacent indices when possible.
    fn take(
        &mut self,
        pool: &GpuPool,
        node: &str,
        role: &RoleSection,
        tp: u32,
        per_gpu: u32,
    ) -> Option<Vec<u32>> {
        let load = self.load.entry(node.to_string()).or_default();
        let load_of = |i: &u32| load.get(i).copied().unwrap_or(0);
        let allowed: Vec<u32> = pool
            .inventory
            .iter()
            .map(|g| g.index)
            .filter(|i| role.gpus.as_ref().is_none_or(|list| list.contains(i)))
            .filter(|i| load_of(i) < per_gpu)
            .collect();
        let tp = tp as usize;
        let mut levels: Vec<u32> = allowed.iter().map(load_of).collect();
        levels.sort_unstable();
        levels.dedup();
        let pick = levels.into_iter().find_map(|level| {
            let set: Vec<u32> = allowed
                .iter()
                .copied()
                .filter(|i| load_of(i) <= level)
                .collect();
            if set.len() < tp {
                return None;
            }
            let adjacent = set
                .windows(tp)
                .find(|w| w.windows(2).all(|p| p[1] == p[0] + 1))
                .map(|w| w.to_vec());
            Some(adjacent.unwrap_or_else(|| {
                let mut by_load = set.clone();
                by_load.sort_by_key(|i| (load_of(i), *i));
                let mut first = by_load[..tp].to_vec();
                first.sort_unstable();
                first
            }))
        })?;
        for g in &pick {
            *load.entry(*g).or_default() += 1;
        }
        Some(pick)
    }
}

/// vLLM's own `--gpu-memory-utilization` when none is given.
const VLLM_DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// How one instance shares its GPUs: the fraction of each GPU's memory it may take, its
/// KV cache size when pdctl fixes it, and the instance that must be healthy before it
/// starts when it does not (vLLM's start-up memory profiling counts a neighbour's
/// allocations as its own when both start at once).
#[derive(Debug, Clone, Default, PartialEq)]
struct Sharing {
    /// Set when the instance shares a GPU: its slice of `gpu_memory_utilization`.
    split_utilization: Option<f64>,
    /// The fraction of each of its GPUs it will hold (None when the topology fixes the KV
    /// cache size: then only vLLM knows).
    memory_share: Option<f64>,
    /// `--kv-cache-memory-bytes` sized by pdctl (see [`super::kv_budget`]).
    kv_cache_bytes: Option<u64>,
    start_after: Option<String>,
    /// How its memory is sized and when it starts, in words (`pdctl plan` shows it).
    note: Option<String>,
}

/// The sharing of every placed instance, from the GPUs each was given; `Err` when a
/// shared GPU leaves an instance no room for its KV cache.
fn sharing(
    t: &Topology,
    version: Option<&Version>,
    pool: &GpuPool,
    placements: &[Placement],
    gpus: &[Vec<u32>],
) -> Result<Vec<Sharing>, Problem> {
    let mut holders: BTreeMap<(&str, u32), Vec<usize>> = BTreeMap::new();
    for (i, (p, gs)) in placements.iter().zip(gpus).enumerate() {
        for g in gs {
            holders.entry((p.node.as_str(), *g)).or_default().push(i);
        }
    }
    let util = t
        .engine
        .gpu_memory_utilization
        .unwrap_or(VLLM_DEFAULT_GPU_MEMORY_UTILIZATION);
    let mut out = Vec::new();
    for (i, (p, gs)) in placements.iter().zip(gpus).enumerate() {
        if gs.is_empty() {
            out.push(Sharing::default());
            continue;
        }
        let mut others: Vec<usize> = gs
            .iter()
            .flat_map(|g| holders[&(p.node.as_str(), *g)].iter().copied())
            .filter(|j| *j != i)
            .collect();
        others.sort_unstable();
        others.dedup();
        let most = gs
            .iter()
            .map(|g| holders[&(p.node.as_str(), *g)].len())
            .max()
            .unwrap_or(1);
        let Some(split) = (most > 1).then(|| round3(util / most as f64)) else {
            out.push(Sharing {
                memory_share: user_fixed_kv(t, p.role).is_none().then_some(util),
                ..Sharing::default()
            });
            continue;
        };
        out.push(shared(t, version, pool, placements, i, gs, &others, split)?);
    }
    Ok(out)
}

/// The sharing of instance `i` of `placements`, on GPUs `gs` that it shares with `others`,
/// taking `split` of each: its KV cache size when it can be fixed (then it starts together
/// with the others), else the neighbour it starts after, and why.
#[allow(clippy::too_many_arguments)]
fn shared(
    t: &Topology,
    version: Option<&Version>,
    pool: &GpuPool,
    placements: &[Placement],
    i: usize,
    gs: &[u32],
    others: &[usize],
    split: f64,
) -> Result<Sharing, Problem> {
    let p = &placements[i];
    let name_of = |j: usize| placements[j].role.instance_name(placements[j].index);
    let neighbours: Vec<String> = others.iter().map(|j| name_of(*j)).collect();
    let mut share = Sharing {
        split_utilization: Some(split),
        memory_share: Some(split),
        ..Sharing::default()
    };
    let sized = match (user_fixed_kv(t, p.role), version) {
        (Some(key), _) => {
            share.memory_share = None;
            kv_budget::Sized::Fixed {
                bytes: 0,
                why: format!("KV cache fixed by {key}"),
            }
        }
        (None, Some(v)) => {
            let inventory: Vec<&Gpu> = gs
                .iter()
                .filter_map(|g| pool.inventory.iter().find(|x| x.index == *g))
                .collect();
            let flag = |f: &str| last_flag(t, p.role, f);
            kv_budget::size(&kv_budget::Ask {
                name: &name_of(i),
                neighbours: &neighbours,
                gpus: &inventory,
                share: split,
                version: v,
                model: pool.model.as_ref().map_err(String::as_str),
                dtype_bytes: flag("--dtype").and_then(|d| kv_budget::dtype_width(&d)),
                kv_dtype_bytes: flag("--kv-cache-dtype").and_then(|d| kv_budget::dtype_width(&d)),
                max_model_len: flag("--max-model-len")
                    .and_then(|n| n.parse().ok())
                    .or(t.model.max_model_len.map(u64::from)),
            })?
        }
        (None, None) => kv_budget::Sized::Profiled {
            why: "the vLLM version is unknown".into(),
        },
    };
    match sized {
        kv_budget::Sized::Fixed { bytes, why } => {
            share.kv_cache_bytes = (bytes > 0).then_some(bytes);
            share.note = Some(format!(
                "{why}; starts together with {}",
                neighbours.join(", ")
            ));
        }
        kv_budget::Sized::Profiled { why } => {
            share.start_after = others.iter().copied().filter(|j| *j < i).max().map(name_of);
            let when = match &share.start_after {
                Some(a) => format!("starts after {a}"),
                None => "starts first".to_string(),
            };
            share.note = Some(format!(
                "{split} of the GPU, KV cache sized by vLLM's own profiling; {when}: {why}"
            ));
        }
    }
    Ok(share)
}

/// Where the topology itself fixes the KV cache size of `role`'s engines:
/// `engine.kv_cache_memory`, or `--kv-cache-memory-bytes` in their args.
fn user_fixed_kv(t: &Topology, role: Role) -> Option<&'static str> {
    if t.engine.kv_cache_memory.is_some() {
        return Some("engine.kv_cache_memory");
    }
    last_flag(t, role, "--kv-cache-memory-bytes").map(|_| "--kv-cache-memory-bytes in the args")
}

/// The value of `flag` as `role`'s engines get it: the last of `engine.args` then the
/// role's args, written `--flag VALUE` or `--flag=VALUE`.
fn last_flag(t: &Topology, role: Role, flag: &str) -> Option<String> {
    let args: Vec<&String> = t
        .engine
        .args
        .iter()
        .chain(&role_section(t, role).args)
        .collect();
    let mut found = None;
    for (i, a) in args.iter().enumerate() {
        if *a == flag {
            found = args.get(i + 1).map(|v| v.to_string());
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            found = Some(v.to_string());
        }
    }
    found
}

/// Rounded down to 3 decimals, so the shares of a GPU never add up to more than the whole.
fn round3(x: f64) -> f64 {
    (x * 1000.0).floor() / 1000.0
}

/// The engines' fixed HTTP ports first, so clashes name the keys the user wrote; then the
/// ports running instances hold, which stay theirs: a kept one is given its own back, a new
/// one none of them (a change plans with them: plan::held).
fn book_ports(
    t: &Topology,
    placements: &[Placement],
    pool: &GpuPool,
    ports: &mut PortBook,
) -> Result<(), Problem> {
    for p in placements {
        let svc = p.role.instance_name(p.index);
        claim(ports, &p.host, http_port(t, p), &svc, "http")?;
    }
    for (name, held) in pool.held.iter() {
        for port in &held.ports {
            ports.hold(&held.host, *port, name);
        }
    }
    Ok(())
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
    settings: &mut BTreeMap<String, ChildSettings>,
) -> Result<Vec<Service>, Problem> {
    let t = cx.topology;
    book_ports(t, placements, pool, ports)?;
    check_gpu_counts(t, placements, pool)?;
    if let (EngineKind::Vllm, Some(v)) = (t.engine.kind, cx.version) {
        warnings.extend(conn.warnings(t, v));
    }
    let needs_gpus = t.engine.kind == EngineKind::Vllm && t.engine.device == Device::Cuda;
    let gpus_of = assign_gpus(t, placements, pool, needs_gpus, warnings)?;
    let kv_cache_bytes = kv_cache_bytes(t, cx.version)?;
    let shares = if needs_gpus {
        sharing(t, cx.version, pool, placements, &gpus_of)?
    } else {
        vec![Sharing::default(); placements.len()]
    };
    let mut warned_nodes = BTreeSet::new();
    let per_node = engines_per_node(placements);
    let mut out = Vec::new();
    for ((p, gpus), share) in placements.iter().zip(gpus_of).zip(shares) {
        let r = role_section(t, p.role);
        let name = p.role.instance_name(p.index);
        if needs_gpus && p.node != local_node && warned_nodes.insert(p.node.clone()) {
            warnings.push(format!(
                "node {}: GPUs assumed to match this machine's; plan on that node (pdctl plan --node {}) to check",
                p.node, p.node
            ));
        }
        warnings.extend(busy_gpus(&name, &gpus, pool));
        let inst = instance_ctx(t, p, protocol, ports)?;
        let mut svc = match (t.engine.kind, cx.version) {
            (EngineKind::Vllm, Some(v)) => {
                let mut launch = conn.launch(LaunchCtx {
                    cx,
                    v,
                    inst: &inst,
                    ports,
                })?;
                crate::connectors::apply_load_failure_policy(&t.connector, &mut launch);
                let shares_node = per_node[p.node.as_str()] > 1;
                let mut svc = vllm_service(t, p, &inst, &gpus, launch, shares_node);
                memory_flags(&mut svc, &share, kv_cache_bytes.or(share.kv_cache_bytes));
                svc.gpu_memory_note = share.note.clone();
                svc.checks = engine_checks(t, conn);
                svc
            }
            _ => {
                let (svc, sim) = sim_service(cx, p, &inst, protocol)?;
                settings.insert(name.clone(), ChildSettings::Sim(Box::new(sim)));
                svc
            }
        };
        svc.secret_env = vec![crate::vocab::ENGINE_API_KEY_VAR.to_string()];
        svc.depends_on = support.to_vec();
        svc.depends_on.extend(share.start_after);
        svc.restart_with = expand_restart_with(t, r, &name);
        out.push(svc);
    }
    Ok(out)
}

/// A warning for each of `name`'s GPUs that something else already uses.
fn busy_gpus<'a>(
    name: &'a str,
    gpus: &'a [u32],
    pool: &'a GpuPool,
) -> impl Iterator<Item = String> + 'a {
    gpus.iter().filter_map(move |g| {
        let gpu = pool.inventory.iter().find(|x| x.index == *g)?;
        Some(format!("{name}: {}", gpu.busy_reason()?))
    })
}

/// How many engines each node runs (an engine is launched knowing whether it shares its
/// node).
fn engines_per_node(placements: &[Placement]) -> BTreeMap<&str, u32> {
    let mut per_node: BTreeMap<&str, u32> = BTreeMap::new();
    for p in placements {
        *per_node.entry(&p.node).or_default() += 1;
    }
    per_node
}

/// The GPUs of each placed engine, in placement order (none where the engines need none:
/// the simulator, vLLM on CPU); fails naming the role a node has too few GPUs for.
///
/// A change to a running cluster gives the pool what its instances hold: the ones it
/// keeps stay on their GPUs, the others get theirs from what is left, in placement order.
/// When what is left cannot hold them (a fragmented inventory), the GPUs are handed out
/// as for a fresh cluster, with a warning: the kept instances that move are restarted.
fn assign_gpus(
    t: &Topology,
    placements: &[Placement],
    pool: &GpuPool,
    needs_gpus: bool,
    warnings: &mut Vec<String>,
) -> Result<Vec<Vec<u32>>, Problem> {
    if !needs_gpus {
        return Ok(vec![Vec::new(); placements.len()]);
    }
    let sticky = hand_out(t, placements, pool, true);
    if sticky.is_ok() || pool.held.is_empty() {
        return sticky;
    }
    let fresh = hand_out(t, placements, pool, false)?;
    warnings.push(
        "the GPUs left once the kept instances keep theirs cannot hold the new ones: GPUs are handed out anew, and kept instances that move are restarted".into(),
    );
    Ok(fresh)
}

/// [`assign_gpus`]'s hand-out: with `keep`, the GPUs held by the instances that stay
/// first, then the rest in placement order.
fn hand_out(
    t: &Topology,
    placements: &[Placement],
    pool: &GpuPool,
    keep: bool,
) -> Result<Vec<Vec<u32>>, Problem> {
    let mut gpu_use = GpuUse::default();
    let kept: Vec<Option<Vec<u32>>> = placements
        .iter()
        .map(|p| keep.then(|| gpu_use.keep(pool, t, p)).flatten())
        .collect();
    let mut gpus_of = Vec::new();
    for (p, kept) in placements.iter().zip(kept) {
        let r = role_section(t, p.role);
        gpus_of.push(match kept {
            Some(gpus) => gpus,
            None => gpu_use
                .take(
                    pool,
                    &p.node,
                    r,
                    r.gpus_per_instance,
                    t.engine.instances_per_gpu,
                )
                .ok_or_else(|| gpu_shortage(t, placements, p.role, &p.node, pool))?,
        });
    }
    Ok(gpus_of)
}

/// What the connector is told of one engine instance: its name, where it listens, its
/// tensor parallelism, and (a Mooncake prefill) its bootstrap port.
fn instance_ctx(
    t: &Topology,
    p: &Placement,
    protocol: ProxyProtocol,
    ports: &mut PortBook,
) -> Result<InstanceCtx, Problem> {
    let name = p.role.instance_name(p.index);
    let bootstrap_port = if protocol == ProxyProtocol::Mooncake && p.role == Role::Prefill {
        Some(bootstrap_port(t, &p.host, &name, ports)?)
    } else {
        None
    };
    Ok(InstanceCtx {
        role: p.role,
        name,
        host: p.host.clone(),
        listen: p.kv_listen.clone(),
        tp: role_section(t, p.role).gpus_per_instance,
        bootstrap_port,
    })
}

/// The Mooncake bootstrap port of prefill `name` on `host`: the first free one at or above
/// `connector.bootstrap_port`.
fn bootstrap_port(
    t: &Topology,
    host: &str,
    name: &str,
    ports: &mut PortBook,
) -> Result<u16, Problem> {
    let base = t.connector.bootstrap_port;
    ports
        .take(host, base, 1, &format!("{name} (bootstrap)"))
        .ok_or_else(|| {
            Problem::new(
                "connector.bootstrap_port",
                format!("no free bootstrap port for {name} on {host} at or above {base}"),
            )
            .hint("set connector.bootstrap_port lower, below the ports in use")
        })
}

/// What a real vLLM engine needs on its machine to start at all: vLLM in `engine.python`,
/// the connector's Python package, and a local model's config.json (a hub id such as
/// `Qwen/Qwen2.5-7B-Instruct` is left to vLLM, which may fetch it).
fn engine_checks(t: &Topology, conn: &dyn Connector) -> Vec<Check> {
    let python = &t.engine.python;
    let mut checks = vec![Check::PythonModule {
        python: python.clone(),
        module: "vllm".into(),
        fix: "engine.python must be the python that has vLLM: install it (./install.sh --with-vllm) or point engine.python at it".into(),
    }];
    for (module, why) in conn.python_modules(t.engine.device) {
        checks.push(Check::PythonModule {
            python: python.clone(),
            module: module.into(),
            fix: format!("connector.kind needs it: {why} into engine.python"),
        });
    }
    let model = &t.model.name;
    if model.starts_with('/') || model.starts_with("./") || model.starts_with("../") {
        checks.push(Check::FileExists {
            path: std::path::Path::new(model).join("config.json"),
            fix: format!("[model] name is the local path {model}: put the model there, or name a model id vLLM can fetch"),
        });
    }
    checks
}

/// `engine.kv_cache_memory` in bytes, for a vLLM that takes `--kv-cache-memory-bytes`.
fn kv_cache_bytes(t: &Topology, v: Option<&Version>) -> Result<Option<u64>, Problem> {
    let (Some(size), EngineKind::Vllm) = (&t.engine.kv_cache_memory, t.engine.kind) else {
        return Ok(None);
    };
    let bytes = crate::connectors::size_bytes("engine.kv_cache_memory", size)?;
    if let Some(v) = v
        && !kv_budget::KV_CACHE_MEMORY_BYTES.contains(v)
    {
        return Err(Problem::new(
            "engine.kv_cache_memory",
            format!(
                "vLLM {v} has no --kv-cache-memory-bytes ({} have it)",
                kv_budget::KV_CACHE_MEMORY_BYTES
            ),
        )
        .hint(
            "remove engine.kv_cache_memory and size the cache with engine.gpu_memory_utilization",
        ));
    }
    Ok(Some(bytes))
}

/// The memory flags of a vLLM instance: its slice of the GPU when it shares one, or the
/// fixed KV cache size; and the share the plan records for the free-memory check.
fn memory_flags(svc: &mut Service, share: &Sharing, kv_cache_bytes: Option<u64>) {
    if let Some(u) = share.split_utilization {
        set_flag(&mut svc.argv, "--gpu-memory-utilization", &u.to_string());
    }
    if let Some(b) = kv_cache_bytes {
        set_flag(&mut svc.argv, "--kv-cache-memory-bytes", &b.to_string());
    }
    if !svc.gpus.is_empty() {
        svc.gpu_memory_share = share.memory_share;
    }
}

/// Sets `flag value` in a vLLM argv: replaces the value where the flag is already given,
/// else inserts it before `--kv-transfer-config` (which stays last, as users write it).
fn set_flag(argv: &mut Vec<String>, flag: &str, value: &str) {
    if let Some(i) = argv.iter().position(|a| a == flag)
        && i + 1 < argv.len()
    {
        argv[i + 1] = value.to_string();
        return;
    }
    let at = argv
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .unwrap_or(argv.len());
    argv.splice(at..at, [flag.to_string(), value.to_string()]);
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
        if wanted as usize > pool.inventory.len() * t.engine.instances_per_gpu as usize {
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
    let url = format!("http://{}:{port}", p.http_listen);
    Service {
        name: inst.name.clone(),
        role: p.role,
        node: p.node.clone(),
        host: p.host.clone(),
        argv: Vec::new(),
        env: BTreeMap::new(),
        gpus: Vec::new(),
        gpu_memory_share: None,
        gpu_memory_note: None,
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
        checks: Vec::new(),
        secret_env: Vec::new(),
        hidden_env: Vec::new(),
    }
}

/// A real vLLM instance: `python -m vllm.entrypoints.openai.api_server ...`.
/// vLLM's flag for `usage.prompt_tokens_details` in its answers (every V1 version).
const DETAILS: &str = "--enable-prompt-tokens-details";

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
        p.http_listen.clone(),
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
    // Decode's answers then carry usage.prompt_tokens_details.cached_tokens (prompt tokens
    // it did not compute, the handoff's included): the proxy judges each request's KV
    // handoff by it, and names the request when decode recomputed (docs/proxy.md).
    if p.role == Role::Decode && !t.engine.args.iter().chain(&r.args).any(|a| a == DETAILS) {
        argv.push(DETAILS.into());
    }
    argv.extend(launch.args.iter().cloned());
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
    // A CUDA_VISIBLE_DEVICES the topology sets itself is where the engine really runs.
    if let Some(list) = svc.env.get("CUDA_VISIBLE_DEVICES")
        && let Ok(own) = list
            .split(',')
            .map(|g| g.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
    {
        svc.gpus = own;
    }
    svc
}

/// What the topology sets for every engine of a role, on top of what pdctl planned: its
/// env (which wins; a hub token only by name, in `hidden_env`), restart policy and
/// start-up timeout (`default_s` when it sets none).
fn apply_user_settings(svc: &mut Service, t: &Topology, r: &RoleSection, default_s: u64) {
    svc.env.extend(t.engine.env.clone());
    svc.env.extend(r.env.clone());
    for var in crate::vocab::HUB_TOKEN_VARS {
        if svc.env.remove(*var).is_some() {
            svc.hidden_env.push(var.to_string());
        }
    }
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

/// A simulated instance: `pdctl sim --config FILE` with its settings in a generated file
/// (`files/<name>.sim.toml`): the handoff matching the proxy protocol, the context length
/// of `[model] max_model_len` when the topology sets it, `[engine.sim]`. The engine's and
/// the role's `args` follow on the command line as written, as for vLLM: `pdctl sim`
/// flags, which override the file (`args = ["--itl-ms", "8"]` makes that role's simulated
/// model faster), each checked here.
fn sim_service(
    cx: &ClusterCtx,
    p: &Placement,
    inst: &InstanceCtx,
    protocol: ProxyProtocol,
) -> Result<(Service, SimArgs), Problem> {
    let t = cx.topology;
    let r = role_section(t, p.role);
    let port = http_port(t, p);
    let mut svc = base_service(p, inst, port);
    let handoff = crate::connectors::sim_handoff(protocol);
    let kv_dir = (handoff == SimHandoff::SharedDir).then(|| cx.shared_dir.clone());
    svc.dirs.extend(kv_dir.clone());
    if let Some(b) = inst.bootstrap_port {
        svc.ports.insert("bootstrap".into(), b);
    }
    let mut model_params = t.engine.sim.clone();
    // The model's context length is the cluster's, whichever engine serves it: a sim
    // stand-in must refuse the prompts the real vLLM would.
    if let Some(n) = t.model.max_model_len {
        model_params.max_model_len = n;
    }
    let a = SimArgs {
        host: p.http_listen.clone(),
        port,
        role: if p.role == Role::Prefill {
            SimRole::Prefill
        } else {
            SimRole::Decode
        },
        model: t.model.served().to_string(),
        instance: Some(inst.name.clone()),
        handoff,
        kv_dir,
        bootstrap_port: inst.bootstrap_port,
        model_params,
        ..SimArgs::default()
    };
    let config = cx.files_dir.join(format!("{}.sim.toml", inst.name));
    let mut argv = vec![
        crate::tools::SELF_PROGRAM.to_string(),
        "sim".to_string(),
        "--config".to_string(),
        config.display().to_string(),
    ];
    for (key, extra) in [("engine.args", &t.engine.args), (role_key(p.role), &r.args)] {
        Configured::<SimArgs>::parse_args(argv[2..].iter().chain(extra.iter())).map_err(|e| {
            let first = e.to_string();
            let first = first
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ");
            Problem::new(
                key,
                format!("simulated engines take `pdctl sim` flags here: {first}"),
            )
            .hint("`pdctl sim --help` lists them (e.g. --itl-ms, --max-num-seqs)")
        })?;
        argv.extend(extra.iter().cloned());
    }
    let file = GeneratedFile {
        path: config,
        content: crate::child_config::to_file(&a),
    };
    // What the sim will run with: the file with the role's flags over it, resolved once
    // here by the loader the sim itself uses (checked above, so it resolves).
    let effective = crate::child_config::from_service::<SimArgs>(
        &argv,
        [(file.path.as_path(), file.content.as_str())],
    )
    .map_err(|e| Problem::new(role_key(p.role), format!("simulated engine settings: {e}")))?;
    svc.files.push(file);
    svc.argv = argv;
    svc.shutdown.timeout_s = 10;
    let startup = t.engine.sim.startup_ms.div_ceil(1000);
    apply_user_settings(&mut svc, t, r, 60 + startup);
    Ok((svc, effective))
}

/// The topology table of a role, for locating a problem (`prefill.args`).
fn role_key(role: Role) -> &'static str {
    if role == Role::Prefill {
        "prefill.args"
    } else {
        "decode.args"
    }
}
