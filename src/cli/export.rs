//! `pdctl export k8s`: the plan as Kubernetes manifests (see [`crate::export`]).

use super::ExitError;
use super::common::TopologyArgs;
use crate::export::images::ImageArgs;
use crate::export::{self, Format, Options};
use crate::plan::resolve::{Machine, load_topology, plan_programs_unresolved};
use crate::topology::LoadedTopology;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// Where the engines' containers keep generated files, logs and data (the plan's state
/// root, so the paths in the commands are the paths in the pods).
pub const POD_STATE_ROOT: &str = "/var/lib/pdctl";

/// Arguments of `pdctl export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    #[command(subcommand)]
    pub target: ExportTarget,
}

/// What a plan can be exported to.
#[derive(Debug, Subcommand)]
pub enum ExportTarget {
    /// Kubernetes manifests: a RoleBasedGroup (or LeaderWorkerSets, or a DisaggregatedSet),
    /// Services, ConfigMaps.
    K8s(K8sArgs),
    /// A Grafana dashboard (JSON) and a Prometheus scrape configuration for the running
    /// cluster's targets (docs/observability.md).
    Grafana(super::dashboard::GrafanaArgs),
}

/// Arguments of `pdctl export k8s`.
#[derive(Debug, Args)]
pub struct K8sArgs {
    /// Topology file (default: ./pdctl.toml if present, else a built-in profile).
    #[arg(short = 'f', long = "file", conflicts_with = "profile")]
    pub file: Option<PathBuf>,
    /// Built-in profile name (`pdctl profiles` lists them).
    #[arg(short = 'p', long = "profile")]
    pub profile: Option<String>,
    /// The workload API: one RoleBasedGroup, a LeaderWorkerSet per engine role, or one
    /// DisaggregatedSet for the engines.
    #[arg(long, value_enum, default_value = "rbg")]
    pub format: Format,
    /// Image of the vLLM engines (default vllm/vllm-openai:vVERSION, or vLLM's CPU image for
    /// device = "cpu", VERSION being the planned vLLM version).
    #[arg(long)]
    pub image: Option<String>,
    /// Image with `pdctl` and `mooncake_master` on its PATH, for the proxy, simulated engines
    /// and the Mooncake master (default pdctl:VERSION, built from the repository's Dockerfile).
    #[arg(long)]
    pub pdctl_image: Option<String>,
    /// Image of etcd, when the connector needs it (default quay.io/coreos/etcd:v3.5.21).
    #[arg(long)]
    pub etcd_image: Option<String>,
    /// Image of the LMCache server, when the connector needs it (default
    /// lmcache/vllm-openai:v0.5.5).
    #[arg(long)]
    pub lmcache_image: Option<String>,
    /// Namespace written into every object (default: none, kubectl's current one).
    #[arg(long)]
    pub namespace: Option<String>,
    /// PersistentVolumeClaim standing for the shared KV directory (default CLUSTER-kv).
    #[arg(long, value_name = "CLAIM")]
    pub kv_pvc: Option<String>,
    /// PersistentVolumeClaim holding a model given as a local path, mounted at its directory.
    #[arg(long, value_name = "CLAIM")]
    pub model_pvc: Option<String>,
    /// Node label key: roles pinned to a `[nodes]` entry get nodeSelector KEY=NODE.
    #[arg(long, value_name = "KEY")]
    pub node_label: Option<String>,
    /// Where to write: `-` for stdout (default), or a directory (one file per object).
    #[arg(short = 'o', long = "output", default_value = "-")]
    pub output: String,
}

/// Runs `pdctl export`.
pub fn export(a: ExportArgs) -> anyhow::Result<ExitCode> {
    match a.target {
        ExportTarget::K8s(k) => k8s(k),
        ExportTarget::Grafana(g) => super::dashboard::export_grafana(g),
    }
}

fn k8s(a: K8sArgs) -> anyhow::Result<ExitCode> {
    let args = TopologyArgs {
        file: a.file.clone(),
        profile: a.profile.clone(),
        node: None,
        gpus: None,
        state_dir: Some(PathBuf::from(POD_STATE_ROOT)),
    };
    let machine = Machine::new(args.gpus.clone());
    let (topology, source_note) = load_topology(&args.request(), &machine)?;
    // Pods get GPUs from the device plugin: plan as if this machine had all the cluster needs.
    let t = &topology.spec;
    let needed = t.prefill.instances * t.prefill.gpus_per_instance.max(1)
        + t.decode.instances * t.decode.gpus_per_instance.max(1);
    let pinned = [&t.prefill.gpus, &t.decode.gpus]
        .into_iter()
        .flatten()
        .flatten()
        .map(|g| g + 1)
        .max()
        .unwrap_or(0);
    let args = TopologyArgs {
        gpus: Some((0..needed.max(pinned).max(1)).map(Into::into).collect()),
        ..args
    };
    let shared_gpu_utilization = if t.engine.instances_per_gpu > 1 {
        shared_utilization(
            &topology,
            &args,
            needed.div_ceil(t.engine.instances_per_gpu),
        )
    } else {
        None
    };
    let machine = Machine::new(args.gpus.clone());
    let loaded = plan_programs_unresolved(&topology, &args.request(), machine)?;
    let mut warnings = Vec::new();
    if let Some(v) = &loaded.version_note {
        warnings.push(format!(
            "{}; pin engine.vllm_version to the vLLM of the engine image",
            v.note
        ));
    }
    let options = Options {
        format: a.format,
        images: ImageArgs {
            engine: a.image,
            pdctl: a.pdctl_image,
            etcd: a.etcd_image,
            lmcache: a.lmcache_image,
        },
        shared_gpu_utilization,
        namespace: a.namespace,
        kv_pvc: a.kv_pvc,
        model_pvc: a.model_pvc,
        node_label: a.node_label,
    };
    let mut m = export::export(&loaded.plan, t, &options).map_err(|e| ExitError::usage(e.0))?;
    warnings.append(&mut m.warnings);
    m.warnings = warnings;
    let source = source_note
        .strip_prefix("using ")
        .unwrap_or(&source_note)
        .to_string();
    if a.output == "-" {
        print!("{}", export::to_yaml(&m, &source)?);
    } else {
        write_dir(&m, &source, &PathBuf::from(&a.output))?;
    }
    for w in &m.warnings {
        eprintln!("pdctl: warning: {w}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The `--gpu-memory-utilization` of an engine in a plan made with `gpus` GPUs, fewer than
/// the instances: what `pdctl up` gives each instance that shares a GPU.
fn shared_utilization(topology: &LoadedTopology, args: &TopologyArgs, gpus: u32) -> Option<f64> {
    let args = TopologyArgs {
        gpus: Some((0..gpus.max(1)).map(Into::into).collect()),
        ..args.clone()
    };
    let machine = Machine::new(args.gpus.clone());
    let shared = plan_programs_unresolved(topology, &args.request(), machine).ok()?;
    let argv = &shared
        .plan
        .services
        .iter()
        .find(|s| s.role.is_engine())?
        .argv;
    let i = argv.iter().position(|a| a == "--gpu-memory-utilization")?;
    argv.get(i + 1)?.parse().ok()
}

/// One file per object, `<kind>-<name>.yaml`, each with the header.
fn write_dir(m: &export::Manifests, source: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        ExitError::usage(format!(
            "-o {}: cannot create the directory: {e}",
            dir.display()
        ))
    })?;
    for d in &m.documents {
        let kind = d["kind"].as_str().unwrap_or("object").to_ascii_lowercase();
        let name = d["metadata"]["name"].as_str().unwrap_or("unnamed");
        let one = export::Manifests {
            documents: vec![d.clone()],
            rewrites: m.rewrites.clone(),
            warnings: m.warnings.clone(),
        };
        let path = dir.join(format!("{kind}-{name}.yaml"));
        std::fs::write(&path, export::to_yaml(&one, source)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
