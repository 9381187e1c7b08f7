//! `pdctl export k8s`: the plan `pdctl plan` prints, as Kubernetes manifests, so a cluster
//! that outgrew one or two machines moves to Kubernetes' scheduler with the same vLLM
//! command lines, KV connector config and proxy, and no second source of vLLM knowledge.
//!
//! Each role of the plan (prefill, decode, proxy, and etcd / mooncake-master /
//! lmcache-server when the connector needs them) becomes one pod template made from the
//! role's first instance: its argv and env with the host-specific values rewritten
//! ([`rewrite`]), its ports fixed per container, its probes as Kubernetes probes, its
//! generated files as a ConfigMap. The config file of `pdctl proxy` / `pdctl sim` is read
//! back into its struct and given to the pod as the flags it holds instead (the pod's
//! rewrites, such as the pod name as the sim's instance, are flag rewrites). [`rbg`] puts
//! the templates into one RoleBasedGroup, [`lws`] into a LeaderWorkerSet per engine role and
//! Deployments for the rest, [`disaggregated`] the engines into one DisaggregatedSet and the
//! rest into Deployments. [`images`] picks each role's image. Services are the same for all
//! formats, named `<cluster>-<role>-svc` so that no workload controller creates or adopts
//! one of the same name ([`service_name`]): a headless one per engine role listing ready pods
//! only (the proxy follows them by DNS) and a ClusterIP one in front of the proxy and of
//! each support service.
//!
//! What a pod cannot express is said in [`Manifests::warnings`], never dropped silently.

pub mod disaggregated;
pub mod images;
pub mod lws;
pub mod rbg;
pub mod rewrite;

use crate::plan::Plan;
use crate::topology::{Device, EngineKind, Topology};
use crate::vocab::{Probe, RestartMode, Role, Service};
use images::{ImageArgs, Images};
use rewrite::{POD_IP_ENV, POD_IP_MARK, POD_NAME_ENV, Rewriter};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// Which workload API the engines are given to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One RoleBasedGroup (workloads.x-k8s.io/v1alpha2) holding every role.
    Rbg,
    /// A LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) per engine role, Deployments for
    /// the proxy and support services.
    Lws,
    /// One DisaggregatedSet (disaggregatedset.x-k8s.io/v1, LWS v0.10.0) holding prefill and
    /// decode, which it rolls out together; Deployments for the proxy and support services.
    #[value(name = "disaggregatedset")]
    DisaggregatedSet,
}

/// The API version of the RoleBasedGroup written (served and stored by RBG v0.7.0).
pub const RBG_API_VERSION: &str = "workloads.x-k8s.io/v1alpha2";
/// The API version of the LeaderWorkerSet written (served by LWS v0.10.0).
pub const LWS_API_VERSION: &str = "leaderworkerset.x-k8s.io/v1";
/// The API version of the DisaggregatedSet written (served by LWS v0.10.0).
pub const DISAGGREGATED_SET_API_VERSION: &str = "disaggregatedset.x-k8s.io/v1";

/// The proxy's readiness path where the plan's probe names none: 503 until at least one
/// prefill and one decode are usable (`/health` alone says only that the process answers).
/// A plan's proxy is probed on `/health?warmed` (its pairs' KV path warmed too), and the
/// export keeps that.
pub const PROXY_READY_PATH: &str = "/health?ready";

/// Everything `export k8s` takes besides the plan.
#[derive(Debug, Clone)]
pub struct Options {
    pub format: Format,
    /// Images given on the command line (the rest are [`images`]' defaults).
    pub images: ImageArgs,
    /// The `--gpu-memory-utilization` each engine gets when `engine.instances_per_gpu`
    /// instances share one GPU (read from a plan made with that few GPUs), for the note on
    /// GPU sharing; None when nothing shares.
    pub shared_gpu_utilization: Option<f64>,
    pub namespace: Option<String>,
    /// The PersistentVolumeClaim that stands for the shared KV directory.
    pub kv_pvc: Option<String>,
    /// A PersistentVolumeClaim holding a model given as a local path.
    pub model_pvc: Option<String>,
    /// A node label key: roles pinned to a topology node get a nodeSelector on it.
    pub node_label: Option<String>,
}

/// The documents to apply, and what the person applying them must know.
#[derive(Debug, Clone)]
pub struct Manifests {
    /// Kubernetes objects, in the order to apply them (ConfigMaps, Services, workloads).
    pub documents: Vec<Value>,
    /// What was rewritten from the plan, one line each (for the header of the YAML).
    pub rewrites: Vec<String>,
    /// What could not be expressed or needs the user's action.
    pub warnings: Vec<String>,
}

/// Input the manifests cannot be made from (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ExportError(pub String);

/// One role of the plan as a pod template and what goes with it.
#[derive(Debug, Clone)]
pub struct RolePod {
    pub role: Role,
    /// Instances of the role in the plan (the replicas).
    pub replicas: u32,
    /// Roles that must be ready first (from the plan's dependencies).
    pub depends_on: Vec<String>,
    /// Whether its replicas may change while it runs: engine roles, unless the connector
    /// pairs one prefill with one decode (mooncake-te).
    pub scalable: bool,
    /// A PodTemplateSpec.
    pub template: Value,
}

/// The parts both formats share.
#[derive(Debug)]
pub struct Parts {
    /// The Kubernetes name of the cluster (from the plan's cluster name).
    pub name: String,
    pub roles: Vec<RolePod>,
    /// ConfigMaps and Services.
    pub objects: Vec<Value>,
    pub rewrites: Vec<String>,
    pub warnings: Vec<String>,
}

/// A name Kubernetes accepts for objects and labels (DNS-1035 label): lower case letters,
/// digits and `-`, starting with a letter, at most `max` characters.
pub fn k8s_name(raw: &str, max: usize) -> String {
    let mut s: String = raw
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    while s.contains("--") {
        s = s.replace("--", "-");
    }
    if !s.starts_with(|c: char| c.is_ascii_lowercase()) {
        s = format!("pd-{s}");
    }
    s.truncate(max);
    s.trim_end_matches('-').to_string()
}

/// The labels every object of the cluster carries; `role` adds the component.
pub fn labels(name: &str, role: Option<Role>) -> Value {
    let mut m = Map::new();
    m.insert("app.kubernetes.io/name".into(), "pdctl".into());
    m.insert("app.kubernetes.io/instance".into(), name.into());
    m.insert("app.kubernetes.io/managed-by".into(), "pdctl".into());
    if let Some(r) = role {
        m.insert("app.kubernetes.io/component".into(), r.as_str().into());
    }
    Value::Object(m)
}

/// The labels a role's Service selects its pods by.
pub fn selector(name: &str, role: Role) -> Value {
    json!({"app.kubernetes.io/instance": name, "app.kubernetes.io/component": role.as_str()})
}

/// The Service name of a role: `<cluster>-<role>-svc`.
///
/// Not `<cluster>-<role>`: RBG v0.7.0 adopts a Service of that name as the role's headless
/// Service (else it creates `s-<cluster>-<role>`) and force-applies its own selector,
/// `clusterIP: None` and `publishNotReadyAddresses: true` to it, which a ClusterIP Service
/// refuses; LWS names its headless Service after the LeaderWorkerSet (`<cluster>-<role>`
/// here) and a DisaggregatedSet's end in `-prv`. No role name ends in `-svc`, and `name` is
/// at most 40 characters, so this name is never truncated into one of theirs.
pub fn service_name(name: &str, role: Role) -> String {
    k8s_name(&format!("{name}-{}-svc", role.as_str()), 63)
}

/// The name of a role's workload (StatefulSet or RoleInstanceSet under RBG, LeaderWorkerSet,
/// Deployment): `<cluster>-<role>`, as RBG names it too.
pub fn workload_name(name: &str, role: Role) -> String {
    k8s_name(&format!("{name}-{}", role.as_str()), 63)
}

/// `metadata` of a top-level object.
pub fn metadata(name: &str, object: &str, role: Option<Role>, o: &Options) -> Value {
    let mut m = json!({"name": object, "labels": labels(name, role)});
    if let Some(ns) = &o.namespace {
        m["namespace"] = ns.clone().into();
    }
    m
}

/// Builds the manifests of `plan` in the chosen format.
pub fn export(plan: &Plan, topology: &Topology, o: &Options) -> Result<Manifests, ExportError> {
    let parts = parts(plan, topology, o)?;
    Ok(match o.format {
        Format::Rbg => rbg::manifests(parts, o),
        Format::Lws => lws::manifests(parts, o),
        Format::DisaggregatedSet => disaggregated::manifests(parts, o),
    })
}

/// The name a container port may have (IANA service name: at most 15 characters).
fn port_name(raw: &str) -> String {
    let mut s = k8s_name(raw, 15);
    if s.is_empty() {
        s = "port".into();
    }
    s
}

/// Ports of the first instance, as container ports.
fn container_ports(svc: &Service) -> Vec<Value> {
    svc.ports
        .iter()
        .map(|(n, p)| json!({"name": port_name(n), "containerPort": p, "protocol": "TCP"}))
        .collect()
}

/// The port and path of an HTTP probe URL.
fn http_target(url: &str) -> Option<(u16, String)> {
    let u = reqwest::Url::parse(url).ok()?;
    Some((u.port_or_known_default()?, u.path().to_string()))
}

/// The proxy's readiness path: the plan's probe's path and query when it has a query.
fn proxy_readiness(probe: &Probe) -> String {
    let Probe::Http { url, .. } = probe else {
        return PROXY_READY_PATH.into();
    };
    match reqwest::Url::parse(url) {
        Ok(u) if u.query().is_some() => format!("{}?{}", u.path(), u.query().unwrap_or("")),
        _ => PROXY_READY_PATH.into(),
    }
}

/// Seconds between startup probes.
const STARTUP_PERIOD_S: u64 = 10;

/// Readiness, liveness and startup probes from the plan's probe: readiness every 5 s,
/// liveness after the plan's liveness failures, startup as long as the plan's start-up
/// timeout (vLLM loads for minutes before /health answers).
/// The proxy's readiness is the plan's own probe with its query (`/health?warmed`: a pair
/// usable and its KV path warmed; [`PROXY_READY_PATH`] where it has none), its liveness and
/// startup the plain `/health`.
fn probes(svc: &Service, warnings: &mut Vec<String>) -> Map<String, Value> {
    let action = match &svc.probe {
        Probe::Http {
            url, body_contains, ..
        } => match http_target(url) {
            Some((port, path)) => {
                if let Some(b) = body_contains {
                    warnings.push(format!(
                        "{}: the plan also wants /health's body to contain {b:?}; a Kubernetes probe checks the status only",
                        svc.role
                    ));
                }
                json!({"httpGet": {"path": path, "port": port}})
            }
            None => return Map::new(),
        },
        Probe::Tcp { port, .. } => json!({"tcpSocket": {"port": port}}),
        Probe::LogLine { contains } => {
            warnings.push(format!(
                "{}: the plan tells readiness by a log line containing {contains:?}; Kubernetes cannot, so the role has no probe",
                svc.role
            ));
            return Map::new();
        }
    };
    let with = |extra: Value| {
        let mut p = action.clone();
        for (k, v) in extra.as_object().expect("an object") {
            p[k] = v.clone();
        }
        p
    };
    let mut m = Map::new();
    let mut readiness =
        with(json!({"periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5}));
    if svc.role == Role::Proxy && readiness.get("httpGet").is_some() {
        readiness["httpGet"]["path"] = proxy_readiness(&svc.probe).into();
    }
    m.insert("readinessProbe".into(), readiness);
    m.insert(
        "livenessProbe".into(),
        with(json!({
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": svc.restart.liveness_failures.max(1),
        })),
    );
    m.insert(
        "startupProbe".into(),
        with(json!({
            "periodSeconds": STARTUP_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": svc.startup_timeout_s.div_ceil(STARTUP_PERIOD_S).max(1),
        })),
    );
    m
}

/// The env var whose value the downward API fills from `field`.
fn field_env(name: &str, field: &str) -> Value {
    json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}})
}

/// The proxy's argv in a pod: its planned settings (the plan's typed ones) as
/// `pdctl proxy` flags, but the engines named by their headless Services
/// (`--prefill-dns`), no supervisor socket, bound to 0.0.0.0.
fn proxy_argv(
    svc: &Service,
    plan: &Plan,
    name: &str,
    rewrites: &mut Vec<String>,
) -> Result<Vec<String>, ExportError> {
    let mut a = plan
        .settings_of(&svc.name)
        .and_then(crate::child_config::ChildSettings::proxy)
        .cloned()
        .ok_or_else(|| ExportError(format!("the plan has no settings for {}", svc.name)))?;
    let port_of = |role: Role| {
        plan.by_role(role)
            .next()
            .and_then(|s| s.ports.get("http").copied())
    };
    a.host = rewrite::ANY.to_string();
    a.prefill.clear();
    a.decode.clear();
    a.prefill_dns = port_of(Role::Prefill)
        .map(|p| format!("{}:{p}", service_name(name, Role::Prefill)))
        .into_iter()
        .collect();
    a.decode_dns = port_of(Role::Decode)
        .map(|p| format!("{}:{p}", service_name(name, Role::Decode)))
        .into_iter()
        .collect();
    if !a.bootstrap_ports.is_empty() {
        a.bootstrap_ports.truncate(1);
    }
    a.supervisor_socket = None;
    rewrites.push(format!(
        "proxy: --prefill/--decode URLs of each instance -> --prefill-dns {} --decode-dns {} (one address per ready pod); --supervisor-socket dropped (Kubernetes probes and restarts the pods){}",
        a.prefill_dns.join(" "),
        a.decode_dns.join(" "),
        if a.bootstrap_ports.is_empty() {
            ""
        } else {
            "; one --bootstrap-port for every prefill pod"
        }
    ));
    let mut argv = vec![
        rewrite::program_name(&svc.argv[0]),
        svc.argv.get(1).cloned().unwrap_or_default(),
    ];
    argv.extend(a.to_argv());
    Ok(argv)
}

/// Builds every role's pod template and the ConfigMaps and Services around them.
pub fn parts(plan: &Plan, topology: &Topology, o: &Options) -> Result<Parts, ExportError> {
    let name = k8s_name(&plan.cluster, 40);
    check_claim_names(o)?;
    let rw = Rewriter::new(plan, |r| service_name(&name, r));
    let mut rewrites: Vec<String> = vec![
        "every program by name (argv[0] without its directory), found on the image's PATH"
            .into(),
        "--host, --listen-* and mooncake_master's bind addresses (the node's or loopback) -> 0.0.0.0 (each pod listens on its own IP); ports are the first instance's, the same in every pod".into(),
        "HOST:PORT of another service -> its Service name and port".into(),
    ];
    let mut warnings: Vec<String> = Vec::new();
    let images = images::choose(plan, topology, &o.images, &mut warnings)?;
    plan_warnings(plan, o, &name, &images, &mut warnings);
    let cx = PodCtx {
        plan,
        topology,
        o,
        name: &name,
        rw: &rw,
        images: &images,
    };
    let mut roles = Vec::new();
    let mut objects = Vec::new();
    let order = [
        Role::Etcd,
        Role::MooncakeMaster,
        Role::LmcacheServer,
        Role::Prefill,
        Role::Decode,
        Role::Proxy,
    ];
    for role in order {
        let Some(first) = plan.by_role(role).next() else {
            continue;
        };
        let pod = role_pod(&cx, first, &mut rewrites, &mut warnings)?;
        if let Some(cm) = pod.config_map {
            objects.push(cm);
        }
        objects.push(service(&name, first, o));
        roles.push(role_part(plan, first, pod.template));
    }
    if plan
        .services
        .iter()
        .any(|s| s.restart.mode == RestartMode::Never)
    {
        warnings.push(
            "restart = \"never\" is not kept: Kubernetes restarts every container that exits"
                .into(),
        );
    }
    let mut seen = std::collections::BTreeSet::new();
    rewrites.retain(|r| seen.insert(r.clone()));
    let mut seen = std::collections::BTreeSet::new();
    warnings.retain(|w| seen.insert(w.clone()));
    Ok(Parts {
        name,
        roles,
        objects,
        rewrites,
        warnings,
    })
}

/// Refuses a claim name (`--kv-pvc`, `--model-pvc`) Kubernetes would refuse.
fn check_claim_names(o: &Options) -> Result<(), ExportError> {
    for (flag, v) in [("kv-pvc", &o.kv_pvc), ("model-pvc", &o.model_pvc)] {
        if let Some(v) = v
            && k8s_name(v, 253) != *v
        {
            return Err(ExportError(format!(
                "--{flag} {v:?} is not a Kubernetes object name: use lower case letters, digits and '-', starting with a letter"
            )));
        }
    }
    Ok(())
}

/// What the whole plan's manifests cannot keep: the simulated engine, mooncake-te's one
/// pair, `[nodes]` pinning.
fn plan_warnings(
    plan: &Plan,
    o: &Options,
    name: &str,
    images: &Images,
    warnings: &mut Vec<String>,
) {
    if plan.engine == "sim" {
        warnings.push(format!(
            "engine = \"sim\": the engines are pdctl's simulator (`pdctl sim`, image {}), not vLLM: for trying the manifests on a cluster without GPUs",
            images.pdctl()
        ));
    }
    if plan.connector == "mooncake-te" {
        warnings.push(format!(
            "connector mooncake-te (V0 transfer engine) pairs one prefill with one decode: keep 1 replica each; its prefill_url and decode_url name the roles' Services ({}, {}), which list a pod only once it is ready",
            service_name(name, Role::Prefill),
            service_name(name, Role::Decode)
        ));
    }
    if plan.nodes.len() > 1 {
        pin_note(plan, o, warnings);
    }
}

/// A role's pod template with its replicas (one per instance) and the roles it waits for.
fn role_part(plan: &Plan, first: &Service, template: Value) -> RolePod {
    let role = first.role;
    let mut depends_on: Vec<String> = first
        .depends_on
        .iter()
        .filter_map(|d| plan.service(d))
        .map(|s| s.role.as_str().to_string())
        .filter(|r| r != role.as_str())
        .collect();
    depends_on.dedup();
    RolePod {
        role,
        replicas: plan.by_role(role).count() as u32,
        depends_on,
        scalable: role.is_engine() && plan.connector != "mooncake-te",
        template,
    }
}

/// Says what becomes of `[nodes]` pinning.
fn pin_note(plan: &Plan, o: &Options, warnings: &mut Vec<String>) {
    match &o.node_label {
        Some(key) => warnings.push(format!(
            "[nodes]: roles pinned to one topology node get nodeSelector {key}=<node name>; label the Kubernetes nodes so (kubectl label node NODE {key}=<node name>)"
        )),
        None => {
            let pinned: Vec<String> = [Role::Prefill, Role::Decode, Role::Proxy]
                .iter()
                .filter_map(|r| plan.by_role(*r).next().map(|s| format!("{r} on {}", s.node)))
                .collect();
            warnings.push(format!(
                "[nodes] pinning dropped ({}): Kubernetes places the pods; pass --node-label KEY to turn it into nodeSelectors",
                pinned.join(", ")
            ));
        }
    }
}

/// A role's pod template and the ConfigMap of its generated files.
struct Pod {
    template: Value,
    config_map: Option<Value>,
}

/// What every role's pod is made from.
struct PodCtx<'a> {
    plan: &'a Plan,
    topology: &'a Topology,
    o: &'a Options,
    /// The cluster's Kubernetes name.
    name: &'a str,
    rw: &'a Rewriter,
    images: &'a Images,
}

/// A role's pod, made from its first instance `svc`: the command, the environment and
/// the files with host-specific values rewritten, the volumes around them, the container.
fn role_pod(
    cx: &PodCtx,
    svc: &Service,
    rewrites: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Result<Pod, ExportError> {
    let role = svc.role;
    let image = cx.images.for_role(role).to_string();
    let (argv, own_config) = pod_argv(cx, svc, rewrites)?;
    let mut env = pod_env(cx.rw, svc, rewrites);
    let (files, file_names_host) = pod_files(cx.rw, svc, own_config.as_ref());
    let render = files.values().any(|(_, c)| c.contains(POD_IP_MARK));
    if render {
        rewrites.push(format!(
            "{role}: the own address in generated files -> the pod IP, written by an init container from the ConfigMap"
        ));
    }
    warn_leftover_hosts(cx.rw, role, &argv, &env, &files, warnings);
    if file_names_host || argv.iter().any(|a| a.contains("$(POD_IP)")) {
        env.push(field_env(POD_IP_ENV, "status.podIP"));
    }
    if argv.iter().any(|a| a.contains("$(POD_NAME)")) {
        env.push(field_env(POD_NAME_ENV, "metadata.name"));
    }
    // Volumes: the state dir is the pod's own; files come from the ConfigMap; the shared
    // KV directory and a local model are claims the user names.
    let mut vols = Volumes {
        volumes: vec![json!({"name": "state", "emptyDir": {}})],
        mounts: vec![
            json!({"name": "state", "mountPath": cx.plan.state_dir.display().to_string()}),
        ],
        init: Vec::new(),
    };
    let config_map = files_volume(cx, role, &image, &files, render, &mut vols);
    kv_volume(cx, svc, &mut vols, warnings);
    if role.is_engine() && cx.plan.engine == "vllm" {
        engine_volumes(cx, svc, &image, &mut vols, warnings);
    }
    let template = pod_template(cx, svc, &image, argv, env, vols, warnings);
    Ok(Pod {
        template,
        config_map,
    })
}

/// The pod's command (pdctl's own config file of the proxy and sim turned into flags),
/// and the path of that config file, which is then no file of the pod.
fn pod_argv(
    cx: &PodCtx,
    svc: &Service,
    rewrites: &mut Vec<String>,
) -> Result<(Vec<String>, Option<std::path::PathBuf>), ExportError> {
    let (plan, role) = (cx.plan, svc.role);
    let sim_engine = plan.engine == "sim" && role.is_engine();
    let mut argv = if role == Role::Proxy {
        proxy_argv(svc, plan, cx.name, rewrites)?
    } else if sim_engine {
        let a = plan
            .settings_of(&svc.name)
            .and_then(crate::child_config::ChildSettings::sim)
            .ok_or_else(|| ExportError(format!("the plan has no settings for {}", svc.name)))?;
        let mut flagged = svc.clone();
        flagged.argv.truncate(2);
        flagged.argv.extend(a.to_argv());
        cx.rw.argv(&flagged)
    } else {
        cx.rw.argv(svc)
    };
    let own_config = (role == Role::Proxy || sim_engine)
        .then(|| crate::child_config::config_file(&svc.argv, files_of(svc)))
        .flatten()
        .map(|(path, _)| path.to_path_buf());
    if sim_engine {
        sim_argv(&mut argv, rewrites);
    }
    Ok((argv, own_config))
}

/// The container's environment: GPUs are the device plugin's, the own address is the
/// pod's, other services' addresses are their Services'.
fn pod_env(rw: &Rewriter, svc: &Service, rewrites: &mut Vec<String>) -> Vec<Value> {
    let mut env: Vec<Value> = Vec::new();
    let mut own_env = Vec::new();
    for (k, v) in &svc.env {
        if k == "CUDA_VISIBLE_DEVICES" {
            rewrites.push(
                "CUDA_VISIBLE_DEVICES dropped: the NVIDIA device plugin gives each pod its GPUs"
                    .into(),
            );
        } else if v == &svc.host {
            own_env.push(k.clone());
            env.push(field_env(k, "status.podIP"));
        } else {
            env.push(json!({"name": k, "value": rw.endpoints(v)}));
        }
    }
    if !own_env.is_empty() {
        rewrites.push(format!(
            "{} (the engine's own address, told to its peers) -> the pod IP from the downward API (status.podIP)",
            own_env.join(", ")
        ));
    }
    // A hub token the topology sets is planned by name only: the pods read it from a
    // Secret the user makes, never from the manifest.
    for k in &svc.hidden_env {
        env.push(json!({
            "name": k,
            "valueFrom": {"secretKeyRef": {"name": HUB_TOKEN_SECRET, "key": k}},
        }));
    }
    if !svc.hidden_env.is_empty() {
        rewrites.push(format!(
            "{} (a token the topology sets) -> from the Secret {HUB_TOKEN_SECRET}, which you make: kubectl create secret generic {HUB_TOKEN_SECRET} {}",
            svc.hidden_env.join(", "),
            svc.hidden_env
                .iter()
                .map(|k| format!("--from-literal={k}=..."))
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    env
}

/// The Secret the exported pods read a hub token from (`Service::hidden_env`).
pub const HUB_TOKEN_SECRET: &str = "pdctl-hub-token";

/// A pod's generated files by ConfigMap key: (path, content).
type PodFiles = BTreeMap<String, (String, String)>;

/// Generated files: the same content, other services by name, the own address marked for
/// the init container to fill in (the flag: some file named it). `own_config` is left out.
fn pod_files(
    rw: &Rewriter,
    svc: &Service,
    own_config: Option<&std::path::PathBuf>,
) -> (PodFiles, bool) {
    let mut names_host = false;
    let mut files = PodFiles::new();
    for f in svc.files.iter().filter(|f| Some(&f.path) != own_config) {
        let key = f
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "file".into());
        let mut content = rw.endpoints(&f.content);
        if rewrite::names_host(&content, &svc.host) {
            content = rewrite::replace_whole(&content, &svc.host, POD_IP_MARK);
            names_host = true;
        }
        files.insert(key, (f.path.display().to_string(), content));
    }
    (files, names_host)
}

/// Says any host still named in the command, env or files after the rewrites.
fn warn_leftover_hosts(
    rw: &Rewriter,
    role: Role,
    argv: &[String],
    env: &[Value],
    files: &PodFiles,
    warnings: &mut Vec<String>,
) {
    let env_values: Vec<String> = env
        .iter()
        .filter_map(|e| e["value"].as_str().map(str::to_string))
        .collect();
    let mut leftovers: Vec<String> = argv
        .iter()
        .chain(env_values.iter())
        .chain(files.values().map(|(_, c)| c))
        .flat_map(|text| rw.leftover_hosts(text))
        .collect();
    leftovers.sort();
    leftovers.dedup();
    if !leftovers.is_empty() {
        warnings.push(format!(
            "{role}: {} still named in its command, env or files (no rule rewrites it): check that the pods can reach it",
            leftovers.join(", ")
        ));
    }
}

/// A pod's volumes, the container's mounts of them, and its init containers.
struct Volumes {
    volumes: Vec<Value>,
    mounts: Vec<Value>,
    init: Vec<Value>,
}

/// The ConfigMap of the generated files (None without files) and their mounts: straight
/// from the ConfigMap, or (`render`) through an init container that puts in the pod IP.
fn files_volume(
    cx: &PodCtx,
    role: Role,
    image: &str,
    files: &PodFiles,
    render: bool,
    vols: &mut Volumes,
) -> Option<Value> {
    if files.is_empty() {
        return None;
    }
    let cm_name = k8s_name(&format!("{}-{}-files", cx.name, role.as_str()), 253);
    let data: Map<String, Value> = files
        .iter()
        .map(|(k, (_, c))| (k.clone(), Value::String(c.clone())))
        .collect();
    let config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(cx.name, &cm_name, Some(role), cx.o),
        "data": data,
    });
    vols.volumes
        .push(json!({"name": "files", "configMap": {"name": cm_name}}));
    let source = if render {
        vols.volumes
            .push(json!({"name": "rendered", "emptyDir": {}}));
        vols.init.push(json!({
            "name": "render-files",
            "image": image,
            "command": ["sh", "-c", format!(
                "for f in /etc/pdctl/templates/*; do sed \"s/{POD_IP_MARK}/$POD_IP/g\" \"$f\" > \"/etc/pdctl/rendered/${{f##*/}}\"; done"
            )],
            "env": [field_env(POD_IP_ENV, "status.podIP")],
            "volumeMounts": [
                {"name": "files", "mountPath": "/etc/pdctl/templates", "readOnly": true},
                {"name": "rendered", "mountPath": "/etc/pdctl/rendered"},
            ],
        }));
        "rendered"
    } else {
        "files"
    };
    for (key, (path, _)) in files {
        vols.mounts
            .push(json!({"name": source, "mountPath": path, "subPath": key}));
    }
    Some(config_map)
}

/// The shared KV directory (the first of the service's directories) as a claim.
fn kv_volume(cx: &PodCtx, svc: &Service, vols: &mut Volumes, warnings: &mut Vec<String>) {
    let Some(dir) = svc.dirs.first() else {
        return;
    };
    let o = cx.o;
    let claim = o
        .kv_pvc
        .clone()
        .unwrap_or_else(|| k8s_name(&format!("{}-kv", cx.name), 253));
    vols.volumes
        .push(json!({"name": "kv", "persistentVolumeClaim": {"claimName": claim}}));
    vols.mounts
        .push(json!({"name": "kv", "mountPath": dir.display().to_string()}));
    warnings.push(format!(
        "the shared KV directory {} is PersistentVolumeClaim {claim} (ReadWriteMany, so prefill and decode pods on different nodes share it): create it before applying{}",
        dir.display(),
        if o.kv_pvc.is_none() { ", or name an existing one with --kv-pvc" } else { "" }
    ));
    if svc.dirs.len() > 1 {
        warnings.push(format!(
            "{}: only the first of its directories ({}) is a volume",
            svc.role,
            dir.display()
        ));
    }
}

/// A vLLM engine's model (when a local path) and shared memory, and what its image must
/// hold.
fn engine_volumes(
    cx: &PodCtx,
    svc: &Service,
    image: &str,
    vols: &mut Volumes,
    warnings: &mut Vec<String>,
) {
    let model = svc
        .argv
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| svc.argv.get(i + 1))
        .cloned()
        .unwrap_or_else(|| cx.topology.model.name.clone());
    model_volume(&model, cx.o, &mut vols.volumes, &mut vols.mounts, warnings);
    vols.volumes
        .push(json!({"name": "dshm", "emptyDir": {"medium": "Memory"}}));
    vols.mounts
        .push(json!({"name": "dshm", "mountPath": "/dev/shm"}));
    for c in &svc.checks {
        if let crate::vocab::Check::PythonModule { module, .. } = c
            && module != "vllm"
        {
            warnings.push(format!(
                "image {image} must have the Python module {module} (the plan checks it on a host; here nobody can)"
            ));
        }
    }
}

/// The pod template: one container with its probes and GPUs, the volumes, init
/// containers, and a nodeSelector when every instance of the role is on one node.
fn pod_template(
    cx: &PodCtx,
    svc: &Service,
    image: &str,
    argv: Vec<String>,
    env: Vec<Value>,
    vols: Volumes,
    warnings: &mut Vec<String>,
) -> Value {
    let (plan, role) = (cx.plan, svc.role);
    let mut container = json!({
        "name": role.as_str(),
        "image": image,
        "command": argv,
        "ports": container_ports(svc),
        "volumeMounts": vols.mounts,
    });
    if !env.is_empty() {
        container["env"] = Value::Array(env);
    }
    for (k, v) in probes(svc, warnings) {
        container[k] = v;
    }
    if let Some(gpus) = gpus_of(role, plan, cx.topology, cx.o, warnings) {
        // A quantity, written as the string Kubernetes prints it.
        let gpus = gpus.to_string();
        container["resources"] = json!({
            "requests": {"nvidia.com/gpu": gpus},
            "limits": {"nvidia.com/gpu": gpus},
        });
    }
    let mut spec = json!({
        "containers": [container],
        "volumes": vols.volumes,
        "terminationGracePeriodSeconds": svc.shutdown.timeout_s,
    });
    if !vols.init.is_empty() {
        spec["initContainers"] = Value::Array(vols.init);
    }
    if plan.nodes.len() > 1
        && let Some(key) = &cx.o.node_label
    {
        let nodes: Vec<&str> = plan.by_role(role).map(|s| s.node.as_str()).collect();
        if nodes.iter().all(|n| *n == nodes[0]) {
            spec["nodeSelector"] = json!({ key.clone(): nodes[0] });
        } else {
            warnings.push(format!(
                "{role}: its instances are spread over nodes {}; one pod template cannot say which replica goes where, so it has no nodeSelector",
                nodes.join(", ")
            ));
        }
    }
    json!({
        "metadata": {"labels": labels(cx.name, Some(role))},
        "spec": spec,
    })
}

/// A service's generated files as (path, content), as the child configs read them.
fn files_of(svc: &Service) -> impl Iterator<Item = (&std::path::Path, &str)> {
    svc.files
        .iter()
        .map(|f| (f.path.as_path(), f.content.as_str()))
}

/// `pdctl sim` in a pod: its instance name is the pod's.
fn sim_argv(argv: &mut [String], rewrites: &mut Vec<String>) {
    if let Some(i) = argv.iter().position(|a| a == "--instance")
        && let Some(v) = argv.get_mut(i + 1)
    {
        *v = format!("$({POD_NAME_ENV})");
        rewrites.push("pdctl sim --instance NAME -> the pod name".into());
    }
}

/// GPUs per pod: the topology's gpus_per_instance for vLLM on CUDA. A pod gets whole GPUs,
/// so instances that share a GPU under `pdctl up` get one each (said in `warnings`).
fn gpus_of(
    role: Role,
    plan: &Plan,
    t: &Topology,
    o: &Options,
    warnings: &mut Vec<String>,
) -> Option<u32> {
    if !role.is_engine() || plan.engine != "vllm" || t.engine.device != Device::Cuda {
        return None;
    }
    if t.engine.kind != EngineKind::Vllm {
        return None;
    }
    if t.engine.instances_per_gpu > 1 {
        let n = t.engine.instances_per_gpu;
        let instances = t.prefill.instances + t.decode.instances;
        let flag = match o.shared_gpu_utilization {
            Some(u) => format!("--gpu-memory-utilization {u}"),
            None => "a --gpu-memory-utilization of its share".into(),
        };
        warnings.push(format!(
            "engine.instances_per_gpu = {n}: a pod gets whole GPUs (nvidia.com/gpu is counted in GPUs), so each of the {instances} engine pods asks for its own GPU and vLLM takes its default share of it; the commands carry no memory share. To put {n} pods on one GPU, the cluster's NVIDIA device plugin must offer each GPU as {n} nvidia.com/gpu (time-slicing or MPS sharing), and each engine needs {flag} added to its command, as `pdctl up` gives it on a shared GPU"
        ));
    }
    let section = if role == Role::Prefill {
        &t.prefill
    } else {
        &t.decode
    };
    Some(section.gpus_per_instance.max(1))
}

/// A model given as a local path must be in the pods too.
fn model_volume(
    model: &str,
    o: &Options,
    volumes: &mut Vec<Value>,
    mounts: &mut Vec<Value>,
    warnings: &mut Vec<String>,
) {
    let path = std::path::Path::new(model);
    if !path.is_absolute() {
        return;
    }
    let dir = path
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "/".into());
    match &o.model_pvc {
        Some(claim) => {
            volumes.push(json!({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}));
            mounts.push(json!({"name": "model", "mountPath": dir, "readOnly": true}));
            warnings.push(format!(
                "model {model} is a local path: PersistentVolumeClaim {claim} is mounted at {dir} and must hold it"
            ));
        }
        None => warnings.push(format!(
            "model {model} is a path on this host: the pods see it only if the image has it; pass --model-pvc CLAIM to mount a claim holding it at {dir}"
        )),
    }
}

/// The Service of a role, named by [`service_name`]: headless for engines (one DNS address
/// per ready pod, what the proxy follows), ClusterIP for the proxy and support services.
fn service(name: &str, svc: &Service, o: &Options) -> Value {
    let role = svc.role;
    let ports: Vec<Value> = svc
        .ports
        .iter()
        .map(|(n, p)| json!({"name": port_name(n), "port": p, "targetPort": p, "protocol": "TCP"}))
        .collect();
    let mut spec = json!({
        "selector": selector(name, role),
        "ports": ports,
    });
    if role.is_engine() {
        // One DNS address per ready pod: the proxy adds an engine only once it is ready.
        spec["clusterIP"] = "None".into();
        spec["publishNotReadyAddresses"] = false.into();
    } else {
        spec["type"] = "ClusterIP".into();
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, &service_name(name, role), Some(role), o),
        "spec": spec,
    })
}

/// The manifests as one YAML stream: a header saying what was rewritten and what needs
/// attention, then one document per object.
pub fn to_yaml(m: &Manifests, source: &str) -> Result<String, ExportError> {
    let mut out = String::new();
    out.push_str(&format!(
        "# Generated by `pdctl export k8s` from {source}.\n# Rewritten from the plan (`pdctl plan`) for pods:\n"
    ));
    for r in &m.rewrites {
        out.push_str(&format!("#   - {r}\n"));
    }
    if !m.warnings.is_empty() {
        out.push_str("# Before applying:\n");
        for w in &m.warnings {
            out.push_str(&format!("#   - {w}\n"));
        }
    }
    for d in &m.documents {
        out.push_str("---\n");
        out.push_str(&document_yaml(d)?);
    }
    Ok(out)
}

/// One object as YAML.
pub fn document_yaml(d: &Value) -> Result<String, ExportError> {
    serde_yaml_ng::to_string(d).map_err(|e| ExportError(format!("cannot write YAML: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_what_kubernetes_accepts() {
        assert_eq!(k8s_name("4p4d", 63), "pd-4p4d");
        assert_eq!(k8s_name("My_Cluster.v2", 63), "my-cluster-v2");
        assert_eq!(k8s_name("side-channel-0", 15), "side-channel-0");
        assert_eq!(k8s_name("transfer-engine-x", 15), "transfer-engine");
    }
}
