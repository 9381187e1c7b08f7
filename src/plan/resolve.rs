//! Resolve: what stands between a topology and a plan on this machine. It reads the topology
//! a request points at (a file, a profile, or the default chosen by the GPUs found), asks
//! NVML once and vLLM its version, reads the model's size from its files (for engines that
//! share a GPU), builds the plan and finds its programs. [`Resolved`] is that walk stopped
//! after the machine's facts, for `up` to fetch the model before it builds the plan.
//! `cli/` is a thin shell over it: it parses arguments into a [`Request`], prints, and maps
//! errors to exit codes; pre-flight reuses the [`Machine`] and missing programs found here
//! instead of asking again.

use crate::gpu::{self, Gpu, GpuError};
use crate::plan::source::ClusterSource;
use crate::plan::{Holdings, Plan, PlanInput, build_plan};
use crate::profiles;
use crate::tools::{self, MissingProgram};
use crate::topology::{self, EngineKind, LoadedTopology, Source, TopologyError};
use crate::vocab::VersionSource;
use std::cell::OnceCell;
use std::path::{Path, PathBuf};

/// Where the topology comes from and what this machine contributes to it: the command line's
/// topology arguments as plain data, so planning does not depend on clap.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Topology file (default: ./pdctl.toml if present, else a built-in profile).
    pub file: Option<PathBuf>,
    /// Built-in profile name.
    pub profile: Option<String>,
    /// Only this node's services.
    pub node: Option<String>,
    /// GPUs to plan with (indices, each with its memory when given), instead of asking NVML.
    pub gpus: Option<Vec<gpu::Declared>>,
    /// State root holding one directory per running cluster.
    pub state_dir: Option<PathBuf>,
    /// The GPUs and ports the instances of the running cluster hold, when a change plans it again
    /// (kept by the instances it keeps); empty when planning a cluster afresh.
    pub held: crate::plan::Holdings,
}

/// Why a request could not be resolved into a plan; all of it is bad input (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// `-p NAME` names no built-in profile; the message lists the known ones.
    #[error("{0}")]
    UnknownProfile(String),
    /// The topology cannot be read or planned, located in its file.
    #[error(transparent)]
    Topology(Box<TopologyError>),
    /// No state root: HOME unset and none given.
    #[error(transparent)]
    NoStateRoot(#[from] NoStateRoot),
}

impl From<TopologyError> for ResolveError {
    fn from(e: TopologyError) -> Self {
        ResolveError::Topology(Box::new(e))
    }
}

/// This machine's GPUs, asked of NVML at most once per command (or the declared `--gpus`),
/// whoever needs them first: the default profile's choice, planning, pre-flight.
#[derive(Debug, Default)]
pub struct Machine {
    declared: Option<Vec<gpu::Declared>>,
    gpus: OnceCell<Result<Vec<Gpu>, GpuError>>,
}

impl Machine {
    /// A machine whose GPUs are `declared` (`--gpus`), else NVML's answer when first asked.
    pub fn new(declared: Option<Vec<gpu::Declared>>) -> Machine {
        Machine {
            declared,
            gpus: OnceCell::new(),
        }
    }

    /// The inventory; `Err` says why there is none.
    pub fn gpus(&self) -> Result<&[Gpu], &GpuError> {
        self.gpus
            .get_or_init(|| gpu::inventory(self.declared.as_deref()))
            .as_deref()
    }
}

/// The state root: the given one, else `$XDG_STATE_HOME/pdctl`, else `~/.local/state/pdctl`.
/// A cluster's own state dir is `<root>/<cluster>` (`<root>/<cluster>-<node>` when the
/// topology spans several nodes, so two nodes on one host never share a lock). Never a
/// shared temporary folder: with none of these, [`NoStateRoot`].
pub fn state_root(given: Option<&Path>) -> Result<PathBuf, NoStateRoot> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("pdctl"));
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".local/state/pdctl")),
        None => Err(NoStateRoot),
    }
}

/// No state root can be had: HOME is unset and none was given (a shared temporary folder
/// would let other local users at the cluster's files).
#[derive(Debug, thiserror::Error)]
#[error(
    "no state directory: HOME is not set, and neither --state-dir, PDCTL_STATE_DIR nor XDG_STATE_HOME gives one; give a directory of your own (--state-dir DIR)"
)]
pub struct NoStateRoot;

/// With a client key set (`PDCTL_API_KEY` in the environment of `plan` / `up`), a proxy
/// on a node other than the head must be on one the head starts over SSH: that is how it
/// hands the node the key (in the node's bundle). Anywhere else the proxy would serve
/// `/v1/*` without the key, so the topology is refused, located at `proxy.node`.
fn check_client_key_reach(
    t: &LoadedTopology,
    plan: &crate::plan::Plan,
) -> Result<(), ResolveError> {
    let key_set =
        std::env::var(crate::vocab::PROXY_CLIENT_KEY_VAR).is_ok_and(|k| !k.trim().is_empty());
    let Some(proxy) = plan
        .services
        .iter()
        .find(|s| s.role == crate::vocab::Role::Proxy)
    else {
        return Ok(());
    };
    if !key_set || proxy.node == plan.head_node || t.spec.ssh.contains_key(&proxy.node) {
        return Ok(());
    }
    let node = &proxy.node;
    Err(ResolveError::Topology(Box::new(t.locate(
        topology::Problem::new(
            "proxy.node",
            format!(
                "the proxy runs on node `{node}`, which the head does not start over ssh: the head cannot hand it the client key ({})",
                crate::vocab::PROXY_CLIENT_KEY_VAR
            ),
        )
        .hint(format!(
            "give `{node}` an `ssh` destination in [nodes] (`{node} = {{ address = \"...\", ssh = \"user@host\" }}`) so the head starts it and hands it the key, or run the proxy on the head (`[proxy] node = \"{}\"`)",
            plan.head_node
        )),
    ))))
}

/// A plan ready to run, with a sentence saying where its topology came from.
#[derive(Debug)]
pub struct LoadedPlan {
    /// `argv[0]` of every service resolved to a full path where the program was found.
    pub plan: Plan,
    /// e.g. "using profile sim-1p1d: no ./pdctl.toml and no GPU found".
    pub source_note: String,
    /// Programs the plan needs that this machine lacks (their argv is left bare).
    pub missing: Vec<MissingProgram>,
    /// The node this machine runs (`--node`, else the head).
    pub node: String,
    /// Set when `vllm_version = "auto"` found no vLLM and the version was assumed.
    pub version_note: Option<VersionNote>,
    /// This machine's GPUs as asked once while resolving, for pre-flight to reuse.
    pub machine: Machine,
    /// The topology it came from, for `up` to keep beside the plan (`scale` plans again
    /// from it).
    pub source: Option<ClusterSource>,
    /// The values of the secret variables the plan names only (`Service::hidden_env`),
    /// read from the topology, for `up` to keep in the state dir (none from a plan file).
    pub hidden_env: crate::vocab::HiddenEnv,
}

/// What to say when the vLLM version was assumed: a warning for `plan`, an error for `up`.
#[derive(Debug, Clone)]
pub struct VersionNote {
    /// One line for stderr: where pdctl looked, what it assumed, what to do.
    pub note: String,
    /// The located error `up` refuses with.
    pub refusal: topology::TopologyError,
}

/// Request -> topology -> GPU inventory and vLLM version -> plan, programs resolved:
/// the one walk `plan` and `up` make. Every error is bad input (exit code 2).
pub fn resolve(req: &Request) -> Result<LoadedPlan, ResolveError> {
    Resolved::read(req)?.plan()
}

/// A topology read and this machine's facts about it asked (its GPUs, the vLLM version
/// and python, what that vLLM's CPU build can start, the state root), not yet planned:
/// what `up` knows before it fetches the model, and builds the plan from after, once.
#[derive(Debug)]
pub struct Resolved {
    /// The topology as read (as written: `~/` and `engine.python` as the user wrote them).
    pub topology: LoadedTopology,
    /// e.g. "using profile sim-1p1d: no ./pdctl.toml and no GPU found".
    pub source_note: String,
    /// The node this machine runs (`--node`, else the head).
    pub node: String,
    /// Set when `vllm_version = "auto"` found no vLLM and the version was assumed.
    pub version_note: Option<VersionNote>,
    /// The state dir of this node's supervisor.
    pub state_dir: PathBuf,
    /// The topology with the facts written in (`~/` expanded, the python found, the
    /// connectors the CPU build can start).
    spec: topology::Topology,
    machine: Machine,
    needs_gpus: bool,
    version: Option<crate::vocab::Version>,
    version_source: VersionSource,
    state_root: PathBuf,
    request: Request,
}

impl Resolved {
    /// Reads the topology `req` points at and asks this machine about it.
    pub fn read(req: &Request) -> Result<Resolved, ResolveError> {
        let machine = Machine::new(req.gpus.clone());
        let (topology, source_note) = load_topology(req, &machine)?;
        let mut resolved = Resolved::of(topology, req, machine)?;
        resolved.source_note = source_note;
        Ok(resolved)
    }

    /// Asks this machine about the loaded topology `t`.
    pub fn of(
        t: LoadedTopology,
        req: &Request,
        machine: Machine,
    ) -> Result<Resolved, ResolveError> {
        let mut spec = t.spec.clone();
        // A model path written `~/...` is the user's home, as a shell would read it.
        if let Some(rest) = spec.model.name.strip_prefix("~/")
            && let Some(home) = std::env::var_os("HOME")
        {
            spec.model.name = PathBuf::from(home).join(rest).display().to_string();
        }
        let needs_gpus =
            spec.engine.kind == EngineKind::Vllm && spec.engine.device == topology::Device::Cuda;
        let (version, version_source, version_note) = resolve_version(&t, &mut spec);
        // Which connectors the installed vLLM's own source lets start on its CPU build: read
        // here, where this machine is looked at, not in the pure planner.
        if spec.engine.kind == EngineKind::Vllm
            && spec.engine.device == topology::Device::Cpu
            && let Some(dir) = crate::vllm::package_dir(&spec.engine.python)
        {
            spec.engine.cpu_ready = crate::connectors::cpu_ready(&dir);
        }
        let node = req.node.clone().unwrap_or_else(|| t.head.clone());
        crate::plan::build::check_node(&spec, &node)
            .map_err(|p| ResolveError::Topology(Box::new(t.locate(p))))?;
        let state_root = state_root(req.state_dir.as_deref())?;
        let state_dir = crate::plan::build::state_dir_for(&spec, &state_root, &node);
        Ok(Resolved {
            topology: t,
            source_note: String::new(),
            node,
            version_note,
            state_dir,
            spec,
            machine,
            needs_gpus,
            version,
            version_source,
            state_root,
            request: req.clone(),
        })
    }

    /// The cluster's name.
    pub fn cluster(&self) -> &str {
        &self.spec.cluster
    }

    /// The root of the per-cluster state dirs.
    pub fn state_root(&self) -> &Path {
        &self.state_root
    }

    /// The model this node's engines need fetched, or why none is.
    pub fn model_to_fetch(&self) -> Result<crate::model_fetch::Source, NothingToFetch> {
        model_to_fetch(&self.topology, &self.node)
    }

    /// The plan, programs resolved, with the topology it came from and its secret values
    /// for `up` to keep beside it.
    pub fn plan(self) -> Result<LoadedPlan, ResolveError> {
        let topology = self.topology.clone();
        let gpus = self.request.gpus.clone();
        let source_note = self.source_note.clone();
        let mut loaded = self.plan_programs_unresolved()?;
        check_client_key_reach(&topology, &loaded.plan)?;
        loaded.missing = resolve_programs(&mut loaded.plan);
        loaded.source_note = source_note;
        loaded.source = Some(ClusterSource::of(&topology, gpus));
        loaded.hidden_env = crate::plan::source::hidden_env_of(&topology.spec);
        Ok(loaded)
    }

    /// The plan with every program the bare name the planner wrote; the model's size read
    /// from its files now (engines sharing a GPU get their KV cache size from it).
    pub fn plan_programs_unresolved(self) -> Result<LoadedPlan, ResolveError> {
        let spec = &self.spec;
        let t = &self.topology;
        let (gpus, gpu_note) = match self.machine.gpus() {
            Ok(g) if self.needs_gpus => (g.to_vec(), None),
            Err(e) if self.needs_gpus => (Vec::new(), Some(e.reason.clone())),
            _ => (Vec::new(), None),
        };
        // Read here (headers only), not in the pure planner.
        let (model, fetch_note) = if self.needs_gpus {
            model_size(spec)
        } else {
            (Err("not needed: no engine runs on a GPU".to_string()), None)
        };
        let mut plan = build_plan(&PlanInput {
            topology: spec,
            head: &t.head,
            gpus: &gpus,
            gpu_note,
            model,
            version: self.version.clone(),
            version_source: self.version_source,
            state_root: self.state_root.clone(),
            local_node: Some(&self.node),
            held: self.request.held.clone(),
        })
        .map_err(|p| ResolveError::Topology(Box::new(t.locate(p))))?;
        plan.warnings.extend(fetch_note);
        plan.warnings.extend(self.pinned_note());
        plan.model_fetch = model_fetch_of(spec);
        Ok(LoadedPlan {
            plan,
            source_note: String::new(),
            missing: Vec::new(),
            node: self.node,
            version_note: self.version_note,
            machine: self.machine,
            source: None,
            hidden_env: Default::default(),
        })
    }

    /// The warning when `engine.vllm_version` pins a version the installed vLLM is not.
    fn pinned_note(&self) -> Option<String> {
        let spec = &self.spec;
        if self.version_source == VersionSource::Pinned
            && spec.engine.kind == EngineKind::Vllm
            && let Ok((python, installed)) = crate::vllm::find_python(&spec.engine.python)
            && Some(&installed) != self.version.as_ref()
        {
            return Some(format!(
                "engine.vllm_version pins {} but `{python}` has vLLM {installed}: the commands are planned for {}",
                spec.engine.vllm_version, spec.engine.vllm_version
            ));
        }
        None
    }
}

/// Why a node has no model to fetch (`pdctl pull` says it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NothingToFetch {
    #[error("the engines are simulated (engine.kind = \"sim\"): no model to fetch")]
    Simulated,
    #[error("{0} is a local directory: nothing to fetch")]
    LocalDirectory(String),
    #[error("node {0} runs no engine: nothing to fetch there")]
    NoEngineOn(String),
    #[error("{model} is in the Hugging Face cache ({}): nothing to fetch", dir.display())]
    Cached { model: String, dir: PathBuf },
}

/// The model `node`'s engines of topology `t` need fetched: a Hugging Face model their
/// cache lacks; or why there is none to fetch.
pub fn model_to_fetch(
    t: &LoadedTopology,
    node: &str,
) -> Result<crate::model_fetch::Source, NothingToFetch> {
    let spec = &t.spec;
    if spec.engine.kind != EngineKind::Vllm {
        return Err(NothingToFetch::Simulated);
    }
    let mut model = spec.model.name.clone();
    if let Some(rest) = model.strip_prefix("~/")
        && let Some(home) = std::env::var_os("HOME")
    {
        model = PathBuf::from(home).join(rest).display().to_string();
    }
    if !crate::model_files::is_hub_id(&model) {
        return Err(NothingToFetch::LocalDirectory(model));
    }
    if !runs_engines(spec, &t.head, node) {
        return Err(NothingToFetch::NoEngineOn(node.to_string()));
    }
    if let Ok(dir) = crate::model_files::cached(&model, &spec.engine.env) {
        return Err(NothingToFetch::Cached { model, dir });
    }
    Ok(crate::model_fetch::Source {
        model,
        python: crate::model_fetch::engine_python(&spec.engine.python),
        env: spec.engine.env.clone(),
    })
}

/// Whether `node` runs a prefill or decode instance of this topology.
fn runs_engines(spec: &topology::Topology, head: &str, node: &str) -> bool {
    let on = |r: &topology::RoleSection| {
        r.instances > 0
            && match (&r.node, &r.nodes) {
                (Some(n), _) => n == node,
                (None, Some(list)) => list.iter().any(|n| n == node),
                (None, None) => head == node,
            }
    };
    on(&spec.prefill) || on(&spec.decode)
}

/// Planning again from what a running cluster was made from: here, above `source.rs`,
/// which keeps the data and knows nothing of resolving.
impl ClusterSource {
    /// Plans the cluster again (programs resolved) for node `node` under `state_root`; the
    /// instances it keeps of a running cluster keep the GPUs and ports `held` says they hold.
    pub fn plan(
        &self,
        node: &str,
        state_root: &Path,
        held: &Holdings,
    ) -> Result<LoadedPlan, ResolveError> {
        let t = self.topology()?;
        let req = Request {
            node: Some(node.to_string()),
            gpus: self.gpus.clone(),
            state_dir: Some(state_root.to_path_buf()),
            held: held.clone(),
            ..Request::default()
        };
        let mut loaded =
            Resolved::of(t, &req, Machine::new(self.gpus.clone()))?.plan_programs_unresolved()?;
        loaded.missing = resolve_programs(&mut loaded.plan);
        loaded.source_note = format!("using {}", self.label);
        Ok(loaded)
    }
}

/// Reads the topology the request points at, and says which one was chosen and why.
pub fn load_topology(
    args: &Request,
    machine: &Machine,
) -> Result<(LoadedTopology, String), ResolveError> {
    if let Some(file) = &args.file {
        let t = topology::load_file(file)?;
        return Ok((t, format!("using {}", file.display())));
    }
    if let Some(name) = &args.profile {
        return Ok((load_profile(name)?, format!("using profile {name}")));
    }
    let local = Path::new("pdctl.toml");
    if local.exists() {
        return Ok((
            topology::load_file(local)?,
            "using ./pdctl.toml".to_string(),
        ));
    }
    let (name, why) = match machine.gpus() {
        Ok(gpus) if gpus.len() == 1 => (
            "1gpu-1p1d",
            "no ./pdctl.toml; 1 GPU found, so prefill and decode share it".to_string(),
        ),
        Ok(gpus) if !gpus.is_empty() => (
            "1p1d",
            format!("no ./pdctl.toml; {} GPU(s) found", gpus.len()),
        ),
        // NVML's own words are long; `pdctl gpus` shows them, this line says what matters.
        other => (
            "sim-1p1d",
            match other {
                Err(e) if e.kind == gpu::GpuErrorKind::NoDriver => {
                    "no ./pdctl.toml and no GPU found (no NVIDIA driver)".to_string()
                }
                _ => "no ./pdctl.toml and no GPU found".to_string(),
            },
        ),
    };
    Ok((load_profile(name)?, format!("using profile {name}: {why}")))
}

fn load_profile(name: &str) -> Result<LoadedTopology, ResolveError> {
    let p = profiles::get(name)
        .ok_or_else(|| ResolveError::UnknownProfile(profiles::unknown_message(name)))?;
    Ok(topology::load_str(
        p.text,
        Source::Profile(name.to_string()),
        format!("<profile {name}>"),
    )?)
}

/// Plans a loaded topology, leaving every program as the bare name the planner wrote
/// (`python3`, `pdctl`, `etcd`): what `export k8s` needs, since the programs run in images,
/// not on this machine.
pub fn plan_programs_unresolved(
    t: &LoadedTopology,
    args: &Request,
    machine: Machine,
) -> Result<LoadedPlan, ResolveError> {
    Resolved::of(t.clone(), args, machine)?.plan_programs_unresolved()
}

/// What the engines' nodes fetch (`Plan::model_fetch`): a Hugging Face model served by
/// vLLM, with `[engine.env]` less the hub tokens, and `engine.python` as written (each
/// node finds its own).
fn model_fetch_of(spec: &topology::Topology) -> Option<crate::model_fetch::Source> {
    if spec.engine.kind != EngineKind::Vllm || !crate::model_files::is_hub_id(&spec.model.name) {
        return None;
    }
    let mut env = spec.engine.env.clone();
    env.retain(|k, _| !crate::vocab::HUB_TOKEN_VARS.contains(&k.as_str()));
    Some(crate::model_fetch::Source {
        model: spec.model.name.clone(),
        python: spec.engine.python.clone(),
        env,
    })
}

/// The model's size for planning, read from its files; for a Hugging Face model the cache
/// lacks, when engines share a GPU (the only planning that needs it), from the hub's file
/// list instead, with the note that `up` fetches it first (None when it is there).
fn model_size(
    spec: &topology::Topology,
) -> (
    Result<crate::model_files::ModelSize, String>,
    Option<String>,
) {
    let name = &spec.model.name;
    let env = &spec.engine.env;
    let why = match crate::model_files::read(name, env) {
        Ok(m) => return (Ok(m), None),
        Err(why) => why,
    };
    if spec.engine.instances_per_gpu < 2 || !crate::model_files::is_hub_id(name) {
        return (Err(why), None);
    }
    let source = crate::model_fetch::Source {
        model: name.clone(),
        python: spec.engine.python.clone(),
        env: env.clone(),
    };
    match source.list(true) {
        Ok(listing) => (
            Ok(listing.size()),
            Some(format!(
                "{name} is not fetched yet: `up` fetches it first ({} from {}; `pdctl pull` fetches it alone), then starts the engines as planned here",
                crate::model_fetch::bytes(listing.total()),
                source.endpoint()
            )),
        ),
        Err(e) => (Err(format!("{why}; its size from the hub: {e}")), None),
    }
}

/// The vLLM version `spec` is planned for and where it came from (none for the
/// simulator), with the note and the refusal `up` gives when `auto` found no vLLM and the
/// plan assumed the newest templated one; `engine.python` becomes the python found.
fn resolve_version(
    t: &LoadedTopology,
    spec: &mut topology::Topology,
) -> (
    Option<crate::vocab::Version>,
    VersionSource,
    Option<VersionNote>,
) {
    let mut version_note = None;
    let (version, version_source) = match spec.engine.kind {
        EngineKind::Sim => (None, VersionSource::Pinned),
        EngineKind::Vllm => {
            let resolved = crate::vllm::resolve(
                &spec.engine.vllm_version,
                &spec.engine.python,
                &crate::connectors::NEWEST_TEMPLATED,
            )
            .expect("vllm_version is validated when loaded");
            if let Some(note) = resolved.assumed_note() {
                let why = resolved.not_found.as_ref().map(|e| e.reason());
                version_note = Some(VersionNote {
                    note,
                    refusal: t.locate(
                        topology::Problem::new(
                            "engine.vllm_version",
                            format!(
                                "\"auto\" found no vLLM to run: {}; the plan assumed vLLM {}, the newest pdctl has templates for",
                                why.unwrap_or_default(),
                                resolved.version
                            ),
                        )
                        .hint(
                            "install vLLM (./install.sh --with-vllm), set engine.python to the python that has it, or pin engine.vllm_version (then `up` starts it as pinned)",
                        ),
                    ),
                });
            }
            spec.engine.python = resolved.python;
            (Some(resolved.version), resolved.source)
        }
    };
    (version, version_source, version_note)
}

/// Replaces each service's `argv[0]` with its full path; returns the programs not found
/// (their argv is left as it was). The one program resolver: [`resolve`] calls it (or
/// `up --plan FILE` for a plan read back), and pre-flight reports what it did not find.
pub fn resolve_programs(plan: &mut Plan) -> Vec<MissingProgram> {
    let mut missing = Vec::new();
    for svc in &mut plan.services {
        let Some(prog) = svc.argv.first().cloned() else {
            continue;
        };
        match tools::find_program(&prog) {
            Some(path) => svc.argv[0] = path.display().to_string(),
            None => missing.push(MissingProgram {
                service: svc.name.clone(),
                program: prog,
            }),
        }
    }
    missing
}
