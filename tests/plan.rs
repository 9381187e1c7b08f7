//! `pdctl plan`: located errors for bad topologies, golden plans for every profile, and the
//! flags of the usual hand-run setups carried into the generated commands.

use crate::common;

use common::{TempDir, pdctl};
use pdctl::child_config::proxy::ProxyArgs;
use pdctl::child_config::sim::SimArgs;
use pdctl::gpu::Gpu;
use pdctl::plan::{Plan, PlanInput, build_plan};
use pdctl::topology::{Source, load_str};
use pdctl::vocab::{ProxyProtocol, Role};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn manifest(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

/// Every file in tests/topologies/bad starts with `# expect: LINE:COL KEY: MESSAGE-START`;
/// `pdctl plan` must exit 2 and print exactly that location, key and message, the same on
/// a machine without vLLM and on one where `python3` on PATH has vLLM.
#[test]
fn every_bad_topology_gets_its_precise_error() {
    let dir = manifest("tests/topologies/bad");
    let state = TempDir::new("bad");
    let fake = TempDir::new("bad-fake-vllm");
    fake_python(&fake.path().join("python3"), "0.13.0");
    let path_with_vllm = format!(
        "{}:{}",
        fake.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 25,
        "the corpus has only {} files",
        files.len()
    );
    let mut failures = Vec::new();
    for (machine, vllm_on_path) in [("no vLLM", false), ("vLLM 0.13.0 on PATH", true)] {
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let expect = text
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("# expect: "))
                .unwrap_or_else(|| panic!("{} has no `# expect:` header", f.display()));
            let mut cmd = pdctl(&["plan", "-f", f.to_str().unwrap(), "--gpus", "0,1"]);
            cmd.arg("--state-dir").arg(state.path());
            if vllm_on_path {
                cmd.env_remove(pdctl::vllm::IGNORE_INSTALLED_ENV)
                    .env("PATH", &path_with_vllm);
            }
            let out = cmd.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            let (loc, rest) = expect.split_once(' ').unwrap();
            let wanted = format!("error: {}:{loc}: {rest}", f.display());
            if out.status.code() != Some(2) || !stderr.starts_with(&wanted) {
                failures.push(format!(
                    "{} ({machine}): exit {:?}\n  wanted: {wanted}\n  got:    {}",
                    f.display(),
                    out.status.code(),
                    stderr.lines().next().unwrap_or("")
                ));
            }
            assert!(
                out.stdout.is_empty(),
                "{}: a failed plan printed a plan",
                f.display()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `pdctl ARGS` with its state root in `dir`, run to completion.
fn run_in(dir: &Path, args: &[&str]) -> std::process::Output {
    pdctl(args).env("PDCTL_STATE_DIR", dir).output().unwrap()
}

/// Writes an executable that answers pdctl's version question as a python with vLLM
/// `version` would (it prints the version whatever it is asked).
fn fake_python(path: &Path, version: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\nprintf '%s' '{version}'\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The version a golden plan is made for: pinned profiles use theirs; "auto" ones a
/// current release (the CPU one a release whose ExampleConnector runs on CPU).
fn version_for(profile: &str, spec: &pdctl::topology::Topology) -> String {
    match spec.engine.vllm_version.as_str() {
        "auto" if profile == "cpu-1p1d" => "0.32.0".into(),
        // MooncakeConnector V1 with its bootstrap server came with 0.16.0.
        "auto" if profile == "mooncake-1p1d" => "0.33.0".into(),
        "auto" => "0.13.0".into(),
        v => v.into(),
    }
}

fn pure_plan(profile: &str) -> Plan {
    let p = pdctl::profiles::get(profile).unwrap();
    let t = load_str(p.text, Source::Profile(profile.into()), profile.into()).unwrap();
    let gpus: Vec<Gpu> = (0..8).map(Gpu::declared).collect();
    build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &gpus,
        gpu_note: None,
        model: Err("not read in this test".into()),
        version: Some(version_for(profile, &t.spec).parse().unwrap()),
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: "/state".into(),
        local_node: None,
        held: Default::default(),
    })
    .unwrap_or_else(|e| panic!("profile {profile} does not plan: {e}"))
}

/// Each profile's plan (8 GPUs, state root /state) equals tests/golden/<profile>.json.
/// Set PDCTL_UPDATE_GOLDEN=1 to rewrite them after an intended change, then review the diff.
#[test]
fn every_profile_plan_matches_its_golden_file() {
    let update = std::env::var_os("PDCTL_UPDATE_GOLDEN").is_some();
    let mut stale = Vec::new();
    for p in pdctl::profiles::ALL {
        let json = serde_json::to_string_pretty(&pure_plan(p.name)).unwrap() + "\n";
        let path = manifest(&format!("tests/golden/{}.json", p.name));
        if update {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &json).unwrap();
            continue;
        }
        let golden = std::fs::read_to_string(&path).unwrap_or_default();
        if golden != json {
            stale.push(p.name);
        }
    }
    assert!(
        stale.is_empty(),
        "plans differ from tests/golden for {stale:?}; if intended, rerun with PDCTL_UPDATE_GOLDEN=1 and review the diff"
    );
}

/// Each prefill/decode pair in tests/topologies/pairs that its connector maps although the
/// two sides differ (NIXL's and Mooncake's tensor-parallel ratios, NIXL's block-size ratio)
/// plans (8 GPUs, state root /state, the version the file pins) as
/// tests/golden/pairs/<name>.json says; PDCTL_UPDATE_GOLDEN=1 rewrites them.
#[test]
fn heterogeneous_pairs_the_connector_maps_plan_like_their_golden_files() {
    let update = std::env::var_os("PDCTL_UPDATE_GOLDEN").is_some();
    let dir = manifest("tests/topologies/pairs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "only {} pairs in {}",
        files.len(),
        dir.display()
    );
    let mut stale = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let t = inline(&text);
        let version = t.spec.engine.vllm_version.clone();
        let plan = try_plan_text(&text, &version, 8)
            .unwrap_or_else(|e| panic!("{} does not plan: {e}", f.display()));
        let tp = |role: &str| {
            services(&serde_json::to_value(&plan).unwrap(), role)
                .iter()
                .map(|s| {
                    flag(&argv(s), "--tensor-parallel-size")
                        .unwrap_or("1")
                        .to_string()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            [tp("prefill"), tp("decode")],
            [
                vec![t.spec.prefill.gpus_per_instance.to_string()],
                vec![t.spec.decode.gpus_per_instance.to_string()]
            ],
            "{}: each side runs its own tensor-parallel size",
            f.display()
        );
        let json = serde_json::to_string_pretty(&plan).unwrap() + "\n";
        let name = f.file_stem().unwrap().to_str().unwrap();
        let path = manifest(&format!("tests/golden/pairs/{name}.json"));
        if update {
            std::fs::write(&path, &json).unwrap();
        } else if std::fs::read_to_string(&path).unwrap_or_default() != json {
            stale.push(name.to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "plans differ from tests/golden/pairs for {stale:?}; if intended, rerun with PDCTL_UPDATE_GOLDEN=1 and review the diff"
    );
}

fn plan_json(args: &[&str]) -> Value {
    let state = TempDir::new("plan");
    let json = common::stdout_of(
        pdctl(args)
            .arg("--json")
            .arg("--state-dir")
            .arg(state.path()),
    );
    serde_json::from_str(&json).unwrap()
}

fn services<'a>(plan: &'a Value, role: &str) -> Vec<&'a Value> {
    plan["services"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["role"] == role)
        .collect()
}

fn argv(s: &Value) -> Vec<String> {
    s["argv"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn flag<'a>(argv: &'a [String], name: &str) -> Option<&'a str> {
    argv.iter()
        .position(|a| a == name)
        .map(|i| argv[i + 1].as_str())
}

fn kv_config(s: &Value) -> Value {
    serde_json::from_str(flag(&argv(s), "--kv-transfer-config").unwrap()).unwrap()
}

/// A topology written inline in a test.
fn inline(text: &str) -> pdctl::topology::LoadedTopology {
    load_str(text, Source::Profile("inline".into()), "inline.toml".into()).unwrap()
}

/// The plan of a topology written inline, for vLLM `version`, on a machine with `gpus`.
fn try_plan_text(text: &str, version: &str, gpus: u32) -> Result<Plan, pdctl::topology::Problem> {
    let t = inline(text);
    let gpus: Vec<Gpu> = (0..gpus).map(Gpu::declared).collect();
    build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &gpus,
        gpu_note: None,
        model: Err("not read in this test".into()),
        version: Some(version.parse().unwrap()),
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: "/state".into(),
        local_node: None,
        held: Default::default(),
    })
}

fn plan_text(text: &str, version: &str) -> Plan {
    try_plan_text(text, version, 0).unwrap_or_else(|e| panic!("does not plan: {e}"))
}

/// Real vLLM CPU 0.32: MooncakeConnector (alone, or inside multi) fails at engine start
/// ("Found no NVIDIA driver"), so a CPU topology asking for it is refused at plan time.
#[test]
fn cpu_engines_cannot_use_mooncake_connector() {
    let cpu = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\ndevice = \"cpu\"\n";
    let e = try_plan_text(
        &format!("{cpu}[connector]\nkind = \"mooncake\"\n"),
        "0.32.0",
        0,
    )
    .unwrap_err();
    assert_eq!(e.key, "connector.kind");
    assert!(e.message.contains("needs CUDA"), "{}", e.message);
    let e = try_plan_text(
        &format!("{cpu}[connector]\nkind = \"mooncake-store\"\nmulti = true\n"),
        "0.32.0",
        0,
    )
    .unwrap_err();
    assert_eq!(e.key, "connector.multi");
    assert!(e.hint.unwrap().contains("without multi"));
    // The same on GPUs plans.
    let gpu = cpu.replace("device = \"cpu\"", "device = \"cuda\"");
    try_plan_text(
        &format!("{gpu}[connector]\nkind = \"mooncake\"\n"),
        "0.32.0",
        2,
    )
    .unwrap();
    try_plan_text(
        &format!("{gpu}[connector]\nkind = \"mooncake-store\"\nmulti = true\n"),
        "0.32.0",
        2,
    )
    .unwrap();
}

/// A fake vLLM 0.32.0 package under `root` whose MooncakeConnector source is `connector`
/// (None: no such file), for a real python3 with `PYTHONPATH=root`.
fn fake_vllm_source(root: &Path, connector: Option<&str>) {
    let pkg = root.join("vllm");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(
        pkg.join("__init__.py"),
        "raise ImportError('not imported')\n",
    )
    .unwrap();
    std::fs::write(
        pkg.join("_version.py"),
        "__version__ = version = '0.32.0+cpu'\n",
    )
    .unwrap();
    if let Some(text) = connector {
        let dir = pkg.join("distributed/kv_transfer/kv_connector/v1/mooncake");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("mooncake_connector.py"), text).unwrap();
    }
}

/// `pdctl plan` of MooncakeConnector on vLLM's CPU build reads the installed vLLM's
/// mooncake_connector.py: refused (exit 2, the CUDA error) while it calls
/// `torch.accelerator.current_device_index()` unguarded or is not there, planned once the
/// call is behind `torch.accelerator.is_available()`.
#[test]
fn mooncake_on_the_cpu_build_is_refused_only_while_the_installed_source_needs_an_accelerator() {
    let dir = TempDir::new("cpu-mooncake-source");
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\ndevice = \"cpu\"\n[connector]\nkind = \"mooncake\"\ntransport = \"tcp\"\n",
    )
    .unwrap();
    let unpatched = "import torch\nclass W:\n    def __init__(self):\n        self.device_id = torch.accelerator.current_device_index()\n";
    let guarded = "import torch\nclass W:\n    def __init__(self):\n        self.device_id = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0\n";
    for (name, source, plans) in [
        ("unpatched", Some(unpatched), false),
        ("missing", None, false),
        ("guarded", Some(guarded), true),
    ] {
        let root = dir.path().join(name);
        fake_vllm_source(&root, source);
        let out = pdctl(&["plan", "-f", file.to_str().unwrap(), "--json"])
            .env_remove(pdctl::vllm::IGNORE_INSTALLED_ENV)
            .env("PYTHONPATH", &root)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PDCTL_STATE_DIR", dir.path().join("state"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if plans {
            assert_eq!(out.status.code(), Some(0), "{name}: {stderr}");
            let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(plan["vllm_version"], "0.32.0+cpu", "{name}");
            assert_eq!(
                kv_config(services(&plan, "decode")[0])["kv_connector"],
                "MooncakeConnector"
            );
        } else {
            assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
            assert!(
                stderr.contains("connector.kind: MooncakeConnector needs CUDA")
                    && stderr.contains("current_device_index()"),
                "{name}: {stderr}"
            );
        }
    }
}

/// Real vLLM CPU 0.32, MooncakeStoreConnector alone: 3-6 of 20-30 back-to-back two-step
/// requests reached decode before prefill's KV was in the store. The plan says so.
#[test]
fn mooncake_store_alone_on_v1_warns_that_decode_can_miss() {
    let base = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\ndevice = \"cpu\"\n[connector]\nkind = \"mooncake-store\"\n";
    let plan = plan_text(base, "0.32.0");
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("decode can miss") && w.contains("multi = true")),
        "{:?}",
        plan.warnings
    );
    let gpu = base.replace("device = \"cpu\"", "device = \"cuda\"");
    let multi = try_plan_text(&format!("{gpu}multi = true\n"), "0.32.0", 2).unwrap();
    assert!(!multi.warnings.iter().any(|w| w.contains("decode can miss")));
    // V0 (VLLM_USE_V1=0) is another implementation: no warning.
    let v0 = try_plan_text(&gpu, "0.9.2", 2).unwrap();
    assert!(!v0.warnings.iter().any(|w| w.contains("decode can miss")));
}

/// `connector.extra_config` reaches vLLM as kv_connector_extra_config with every connector
/// and version that has the field (the V0 templates once dropped it without a word).
#[test]
fn extra_config_reaches_every_connector_that_can_take_it() {
    for (kind, version) in [
        ("lmcache", "0.9.2"),
        ("lmcache", "0.11.0"),
        ("mooncake-store", "0.9.2"),
        ("mooncake-store", "0.21.0"),
        ("mooncake-te", "0.9.2"),
        ("example", "0.13.0"),
        ("nixl", "0.11.0"),
        ("mooncake", "0.21.0"),
    ] {
        let text = format!(
            "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\n[connector]\nkind = \"{kind}\"\n[connector.extra_config]\nmy_key = 7\n"
        );
        let plan = try_plan_text(&text, version, 2)
            .unwrap_or_else(|e| panic!("{kind} on {version} does not plan: {e}"));
        for s in plan
            .services
            .iter()
            .filter(|s| s.name.starts_with("prefill") || s.name.starts_with("decode"))
        {
            let at = s
                .argv
                .iter()
                .position(|a| a == "--kv-transfer-config")
                .unwrap();
            let cfg: Value = serde_json::from_str(&s.argv[at + 1]).unwrap();
            assert_eq!(
                cfg["kv_connector_extra_config"]["my_key"], 7,
                "{kind} on vLLM {version}, {}: {cfg}",
                s.name
            );
        }
    }
}

fn env_of<'a>(plan: &'a Plan, service: &str, key: &str) -> Option<&'a str> {
    let s = plan.services.iter().find(|s| s.name == service).unwrap();
    s.env.get(key).map(String::as_str)
}

/// Real vLLM CPU 0.32: without a KV cache size each instance claims 92% of RAM and a
/// second one cannot start; with `auto` binding instances on one machine share cores.
#[test]
fn cpu_engines_get_a_kv_cache_size_and_unpinned_threads() {
    let base = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\ndevice = \"cpu\"\n";
    let plan = plan_text(base, "0.32.0");
    for s in ["prefill-0", "decode-0"] {
        assert_eq!(env_of(&plan, s, "VLLM_CPU_KVCACHE_SPACE"), Some("4"), "{s}");
        assert_eq!(
            env_of(&plan, s, "VLLM_CPU_OMP_THREADS_BIND"),
            Some("nobind"),
            "{s}"
        );
        assert_eq!(env_of(&plan, s, "CUDA_VISIBLE_DEVICES"), None, "{s}");
    }
    // The topology's env wins.
    let plan = plan_text(
        &format!(
            "{base}env = {{ VLLM_CPU_KVCACHE_SPACE = \"1\", VLLM_CPU_OMP_THREADS_BIND = \"0-3\" }}\n"
        ),
        "0.32.0",
    );
    assert_eq!(
        env_of(&plan, "decode-0", "VLLM_CPU_KVCACHE_SPACE"),
        Some("1")
    );
    assert_eq!(
        env_of(&plan, "decode-0", "VLLM_CPU_OMP_THREADS_BIND"),
        Some("0-3")
    );
    // A size given another way is not overridden by the variable.
    for extra in [
        "args = [\"--kv-cache-memory-bytes=2000000000\"]\n",
        "gpu_memory_utilization = 0.3\n",
    ] {
        let plan = plan_text(&format!("{base}{extra}"), "0.32.0");
        assert_eq!(
            env_of(&plan, "prefill-0", "VLLM_CPU_KVCACHE_SPACE"),
            None,
            "{extra}"
        );
    }
    // Instances on their own machines keep vLLM's binding.
    let plan = plan_text(
        &format!(
            "{base}[connector]\nshared_storage_path = \"/mnt/kv\"\n[nodes]\na = \"10.0.0.1\"\nb = \"10.0.0.2\"\n[prefill]\nnode = \"a\"\n[decode]\nnode = \"b\"\n"
        ),
        "0.32.0",
    );
    assert_eq!(
        env_of(&plan, "prefill-0", "VLLM_CPU_OMP_THREADS_BIND"),
        None
    );
    assert_eq!(
        env_of(&plan, "prefill-0", "VLLM_CPU_KVCACHE_SPACE"),
        Some("4")
    );
}

/// The store-form 4P4D acceptance check, through the CLI as a user runs it.
#[test]
fn mooncake_store_4p4d_plans_like_seed_001() {
    let plan = plan_json(&[
        "plan",
        "-p",
        "mooncake-store-4p4d",
        "--gpus",
        "0,1,2,3,4,5,6,7",
    ]);
    let prefill = services(&plan, "prefill");
    let decode = services(&plan, "decode");
    assert_eq!((prefill.len(), decode.len()), (4, 4));
    let mut devices: Vec<&str> = prefill
        .iter()
        .chain(&decode)
        .map(|s| s["env"]["CUDA_VISIBLE_DEVICES"].as_str().unwrap())
        .collect();
    devices.sort();
    devices.dedup();
    assert_eq!(
        devices.len(),
        8,
        "CUDA_VISIBLE_DEVICES not distinct: {devices:?}"
    );
    let ports = |v: &[&Value]| -> Vec<String> {
        v.iter()
            .map(|s| flag(&argv(s), "--port").unwrap().to_string())
            .collect()
    };
    assert_eq!(ports(&prefill), ["8100", "8101", "8102", "8103"]);
    assert_eq!(ports(&decode), ["8200", "8201", "8202", "8203"]);
    for (list, role) in [(&prefill, "kv_producer"), (&decode, "kv_consumer")] {
        for s in list.iter() {
            let cfg = kv_config(s);
            assert_eq!(cfg["kv_connector"], "MooncakeStoreConnector");
            assert_eq!(cfg["kv_role"], role);
            assert_eq!(s["env"]["VLLM_USE_V1"], "0");
            assert!(argv(s).contains(&"--enable-prefix-caching".to_string()));
            let path = s["env"]["MOONCAKE_CONFIG_PATH"].as_str().unwrap();
            let file = s["files"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["path"] == path)
                .expect("config file generated");
            let mc: Value = serde_json::from_str(file["content"].as_str().unwrap()).unwrap();
            assert_eq!(mc["master_server_address"], "127.0.0.1:50001");
            assert_eq!(mc["metadata_server"], "etcd://127.0.0.1:2379");
            assert_eq!(mc["protocol"], "tcp");
            assert!(
                mc.get("local_hostname").is_some() && mc.get("prefill_url").is_none(),
                "store form expected"
            );
            let deps = common::strs(&s["depends_on"]);
            assert_eq!(deps, ["etcd", "mooncake-master"]);
        }
    }
    let master = &services(&plan, "mooncake-master")[0];
    assert_eq!(flag(&argv(master), "--rpc_port"), Some("50001"));
    let names = common::field_strs(&plan["services"], "name");
    assert_eq!(&names[..3], ["etcd", "mooncake-master", "prefill-0"]);
    assert_eq!(names.last(), Some(&"proxy"));
}

/// The hand-run transfer-engine setup: V0 MooncakeConnector with a transfer-engine mooncake.json shared by both.
#[test]
fn mooncake_te_1p1d_carries_the_seed_flags() {
    let plan = pure_plan("mooncake-te-1p1d");
    let p = plan.by_role(Role::Prefill).next().unwrap();
    let d = plan.by_role(Role::Decode).next().unwrap();
    let cfg = |s: &pdctl::vocab::Service| -> Value {
        let i = s
            .argv
            .iter()
            .position(|a| a == "--kv-transfer-config")
            .unwrap();
        serde_json::from_str(&s.argv[i + 1]).unwrap()
    };
    assert_eq!(cfg(p)["kv_role"], "kv_producer");
    assert_eq!(cfg(p)["kv_rank"], 0);
    assert_eq!(cfg(d)["kv_rank"], 1);
    assert_eq!(cfg(d)["kv_parallel_size"], 2);
    assert_eq!(p.env["MOONCAKE_CONFIG_PATH"], d.env["MOONCAKE_CONFIG_PATH"]);
    let te: Value = serde_json::from_str(&p.files[0].content).unwrap();
    assert_eq!(te["prefill_url"], "127.0.0.1:13003");
    assert_eq!(
        te["decode_url"], "127.0.0.1:13103",
        "shared host: decode gets +100"
    );
    assert_eq!(te["metadata_backend"], "etcd");
    assert!(p.argv.windows(2).any(|w| w == ["--max-model-len", "10000"]));
    assert_eq!(p.depends_on, ["etcd"]);
}

/// The LMCache demo: LMCache server, DeepSeek-V2-Lite with MLA disabled, chunk size 32.
#[test]
fn lmcache_1p1d_carries_the_seed_flags() {
    let plan = pure_plan("lmcache-1p1d");
    let server = plan.service("lmcache-server").unwrap();
    assert!(server.argv.contains(&"10080".to_string()));
    let p = plan.service("prefill-0").unwrap();
    assert_eq!(p.env["VLLM_MLA_DISABLE"], "1");
    assert_eq!(p.env["PYTHONHASHSEED"], "0");
    assert!(p.argv.contains(&"--trust-remote-code".to_string()));
    assert!(p.argv.contains(&"--enforce-eager".to_string()));
    let yaml = &p.files[0].content;
    assert!(yaml.contains("chunk_size: 32"), "{yaml}");
    assert!(
        yaml.contains("remote_url: \"lm://127.0.0.1:10080\""),
        "{yaml}"
    );
    assert!(yaml.contains("remote_serde: \"naive\""), "{yaml}");
    assert_eq!(
        p.env["LMCACHE_CONFIG_FILE"],
        p.files[0].path.display().to_string()
    );
    assert_eq!(plan.proxy_url.as_deref(), Some("http://127.0.0.1:8030"));
}

/// The shared-storage setup: shared storage at /mnt/pd_kv, proxy at 40 req/s and 100 concurrent.
#[test]
fn shared_storage_1p1d_carries_the_seed_flags() {
    let plan = pure_plan("shared-storage-1p1d");
    let p = plan.service("prefill-0").unwrap();
    let i = p
        .argv
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .unwrap();
    let cfg: Value = serde_json::from_str(&p.argv[i + 1]).unwrap();
    assert_eq!(
        cfg["kv_connector"], "ExampleConnector",
        "vLLM 0.13 renamed SharedStorageConnector"
    );
    assert_eq!(
        cfg["kv_connector_extra_config"]["shared_storage_path"],
        "/mnt/pd_kv"
    );
    assert_eq!(p.dirs, [PathBuf::from("/mnt/pd_kv")]);
    let proxy = proxy_settings(&plan);
    assert_eq!(proxy.rate_limit, 40.0, "{proxy:?}");
    assert_eq!(proxy.max_concurrent, 100);
    assert_eq!(proxy.protocol, ProxyProtocol::TwoStep);
}

/// The settings the plan gives its proxy: its config file (and flags) read back as the
/// proxy reads them at its start, which must be the plan's typed settings exactly.
fn proxy_settings(plan: &Plan) -> ProxyArgs {
    let s = plan.service("proxy").unwrap();
    let read: ProxyArgs = pdctl::child_config::from_service(&s.argv, files_of(s)).unwrap();
    let typed = plan.settings_of("proxy").and_then(|t| t.proxy()).unwrap();
    assert_eq!(
        &read, typed,
        "the proxy's config file and the plan's settings differ"
    );
    read
}

/// `[network]` reaches the proxy's settings (its legs' connections) and the plan (the
/// supervisors' probes of other nodes); at its defaults neither file mentions it.
#[test]
fn network_settings_reach_the_proxy_and_the_plan() {
    let base = "[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n";
    let plain = plan_text(base, "0.11.0");
    assert!(plain.tcp.is_default());
    assert_eq!(proxy_settings(&plain).tcp(), plain.tcp);
    let json = serde_json::to_string(&plain).unwrap();
    assert!(!json.contains("tcp_keepalive"), "{json}");
    let set = plan_text(
        &format!("{base}[network]\ntcp_keepalive_idle_s = 7\ntcp_user_timeout_s = 30\n"),
        "0.11.0",
    );
    assert_eq!(
        (
            set.tcp.tcp_keepalive_idle_s,
            set.tcp.tcp_user_timeout_s,
            set.tcp.tcp_keepalive_count
        ),
        (7, 30, 3)
    );
    assert_eq!(proxy_settings(&set).tcp(), set.tcp);
}

fn files_of(s: &pdctl::vocab::Service) -> impl Iterator<Item = (&Path, &str)> {
    s.files
        .iter()
        .map(|f| (f.path.as_path(), f.content.as_str()))
}

/// "auto" with a python that has no vLLM still plans (for the newest version pdctl knows,
/// marked assumed, with one warning line saying where it looked); `up` refuses the same
/// file before starting anything, naming the key to pin and the version it assumed.
#[test]
fn auto_version_without_vllm_plans_for_the_newest_and_up_refuses() {
    let dir = TempDir::new("novllm");
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        "[model]\nname = \"m\"\n[engine]\npython = \"/nonexistent/python3\"\n",
    )
    .unwrap();
    let out = run_in(
        dir.path(),
        &[
            "plan",
            "-f",
            file.to_str().unwrap(),
            "--gpus",
            "0,1",
            "--json",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    let newest = pdctl::connectors::NEWEST_TEMPLATED.to_string();
    assert_eq!(plan["vllm_version"], newest.as_str());
    assert_eq!(plan["vllm_version_source"], "assumed");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("pdctl: warning: no vLLM found")
            && err.contains("/nonexistent/python3")
            && err.contains(&format!("vLLM {newest}"))
            && err.contains("pin engine.vllm_version"),
        "{err}"
    );

    let out = run_in(
        dir.path(),
        &["up", "-f", file.to_str().unwrap(), "--gpus", "0,1", "-d"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("t.toml:") && err.contains("engine.vllm_version"),
        "{err}"
    );
    assert!(
        err.contains("/nonexistent/python3") && err.contains(&newest) && err.contains("pin"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let status = run_in(dir.path(), &["status"]);
    assert_eq!(status.status.code(), Some(3), "a refused up left a cluster");
}

/// "auto" asks the python in engine.python (here a fake one) and says the version was read.
#[test]
fn auto_version_is_read_from_the_installed_vllm() {
    let dir = TempDir::new("fakevllm");
    let python = dir.path().join("python3");
    fake_python(&python, "0.12.0");
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"m\"\n[engine]\npython = \"{}\"\n[connector]\nkind = \"example\"\n",
            python.display()
        ),
    )
    .unwrap();
    let out = run_in(
        dir.path(),
        &[
            "plan",
            "-f",
            file.to_str().unwrap(),
            "--gpus",
            "0,1",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["vllm_version"], "0.12.0");
    assert_eq!(plan["vllm_version_source"], "installed");
    // 0.12 still calls the example connector SharedStorageConnector.
    assert_eq!(
        kv_config(services(&plan, "prefill")[0])["kv_connector"],
        "SharedStorageConnector"
    );
}

/// On a machine where no vLLM can be found, every built-in profile plans: the real-vLLM
/// ones with "auto" for an assumed version and a warning, the pinned ones as pinned, the
/// simulated ones with no version and nothing on stderr.
#[test]
fn every_profile_plans_on_a_machine_without_vllm() {
    let dir = TempDir::new("allprofiles");
    let empty_path = TempDir::new("emptypath");
    for p in pdctl::profiles::ALL {
        let out = pdctl(&["plan", "-p", p.name, "--json", "--gpus", "0,1,2,3,4,5,6,7"])
            .env("PDCTL_STATE_DIR", dir.path())
            .env("PATH", empty_path.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{}: {err}", p.name);
        let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
        let t = load_str(p.text, Source::Profile(p.name.into()), p.name.into()).unwrap();
        match (t.spec.engine.kind, t.spec.engine.vllm_version.as_str()) {
            (pdctl::topology::EngineKind::Sim, _) => {
                assert_eq!(plan["vllm_version_source"], Value::Null, "{}", p.name);
                assert!(err.is_empty(), "{}: {err}", p.name);
            }
            (_, "auto") => {
                assert_eq!(plan["vllm_version_source"], "assumed", "{}", p.name);
                assert_eq!(
                    plan["vllm_version"],
                    pdctl::connectors::NEWEST_TEMPLATED.to_string().as_str()
                );
                assert_eq!(err.lines().count(), 1, "{}: {err}", p.name);
                assert!(err.contains("warning: no vLLM found"), "{}: {err}", p.name);
            }
            (_, pinned) => {
                assert_eq!(plan["vllm_version_source"], "pinned", "{}", p.name);
                assert_eq!(plan["vllm_version"], pinned, "{}", p.name);
                assert!(err.is_empty(), "{}: {err}", p.name);
            }
        }
    }
}

/// `up` of a real-vLLM profile on a machine without vLLM refuses before anything starts.
#[test]
fn up_without_vllm_starts_nothing() {
    let dir = TempDir::new("upnovllm");
    let out = run_in(dir.path(), &["up", "-p", "1p1d", "--gpus", "0,1", "-d"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("engine.vllm_version") && err.contains("found no vLLM"),
        "{err}"
    );
    // No state dir was even created: no supervisor, no etcd, nothing to clean.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let status = run_in(dir.path(), &["status"]);
    assert_eq!(status.status.code(), Some(3));
}

/// The same profile on vLLM 0.12 uses the old class name.
#[test]
fn shared_storage_uses_the_old_name_before_0_13() {
    let dir = TempDir::new("ss12");
    let file = dir.path().join("t.toml");
    let text = pdctl::profiles::get("shared-storage-1p1d")
        .unwrap()
        .text
        .replace("\"auto\"", "\"0.12.0\"");
    std::fs::write(&file, text).unwrap();
    let plan = plan_json(&["plan", "-f", file.to_str().unwrap(), "--gpus", "0,1"]);
    let cfg = kv_config(services(&plan, "prefill")[0]);
    assert_eq!(cfg["kv_connector"], "SharedStorageConnector");
}

/// NIXL: side-channel host/port per engine, one port each from 0.12.
#[test]
fn nixl_instances_get_their_own_side_channel_ports() {
    let plan = pure_plan("4p4d");
    let mut ports: Vec<&str> = plan
        .services
        .iter()
        .filter(|s| s.role.is_engine())
        .map(|s| {
            assert_eq!(s.env["VLLM_NIXL_SIDE_CHANNEL_HOST"], s.host);
            s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"].as_str()
        })
        .collect();
    assert_eq!(ports.len(), 8);
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 8, "side-channel ports collide: {ports:?}");
    assert_eq!(proxy_settings(&plan).protocol, ProxyProtocol::Nixl);
}

/// `--max-model-len` of every engine of a plan (a simulated one's `max_model_len` in its
/// config file), by service name.
fn context_lengths(plan: &Plan) -> Vec<(String, Option<String>)> {
    plan.services
        .iter()
        .filter(|s| s.role.is_engine())
        .map(|s| {
            let v = if s.argv[1] == "sim" {
                let a: SimArgs = pdctl::child_config::from_service(&s.argv, files_of(s)).unwrap();
                let typed = plan.settings_of(&s.name).and_then(|t| t.sim()).unwrap();
                assert_eq!(
                    &a, typed,
                    "{}'s config file and the plan's settings differ",
                    s.name
                );
                Some(a.model_params.max_model_len.to_string())
            } else {
                flag(&s.argv, "--max-model-len").map(str::to_string)
            };
            (s.name.clone(), v)
        })
        .collect()
}

/// A sim stands in for vLLM, so it gets the model's context length from `[model]`, as
/// vLLM would, instead of its own default of 8192.
#[test]
fn simulated_engines_get_the_models_max_model_len() {
    let sim = "[model]\nname = \"m\"\nmax_model_len = 1024\n[engine]\nkind = \"sim\"\n\
               [prefill]\ninstances = 2\n[decode]\ninstances = 2\n";
    let lengths = context_lengths(&plan_text(sim, "0.13.0"));
    assert_eq!(lengths.len(), 4);
    for (name, len) in &lengths {
        assert_eq!(len.as_deref(), Some("1024"), "{name}: {lengths:?}");
    }
    // Without it, [engine.sim] decides, else the sim's default.
    let own =
        "[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n[engine.sim]\nmax_model_len = 2048\n";
    for (name, len) in context_lengths(&plan_text(own, "0.13.0")) {
        assert_eq!(len.as_deref(), Some("2048"), "{name}");
    }
    let bare = "[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n";
    for (name, len) in context_lengths(&plan_text(bare, "0.13.0")) {
        assert_eq!(len.as_deref(), Some("8192"), "{name}");
    }
    // The same value in both places is no contradiction.
    let both = sim.replace("[prefill]", "[engine.sim]\nmax_model_len = 1024\n[prefill]");
    for (name, len) in context_lengths(&plan_text(&both, "0.13.0")) {
        assert_eq!(len.as_deref(), Some("1024"), "{name}");
    }
}

/// Two nodes: each node's instances on its own address, the proxy on the head./// Two nodes: each node's instances on its own address, the proxy on the head.
#[test]
fn two_node_profile_places_roles_on_their_nodes() {
    let plan = pure_plan("2node-4p4d");
    for s in plan.by_role(Role::Prefill) {
        assert_eq!(
            (s.node.as_str(), s.host.as_str()),
            ("prefill-node", "10.0.13.1")
        );
    }
    for s in plan.by_role(Role::Decode) {
        assert_eq!(
            (s.node.as_str(), s.host.as_str()),
            ("decode-node", "10.0.14.1")
        );
    }
    let proxy = plan.service("proxy").unwrap();
    assert_eq!(proxy.node, "prefill-node");
    assert!(
        proxy_settings(&plan)
            .decode
            .contains(&"http://10.0.14.1:8203".to_string())
    );
    assert_eq!(
        plan.state_dir,
        PathBuf::from("/state/2node-4p4d-prefill-node")
    );
}

/// With no -f/-p, no ./pdctl.toml and no GPU, pdctl chooses sim-1p1d and says why.
#[test]
fn without_a_file_or_gpu_the_simulator_profile_is_chosen_and_explained() {
    let dir = TempDir::new("default");
    let stdout = common::stdout_of(
        pdctl(&["plan"])
            .current_dir(dir.path())
            .env_remove("PDCTL_GPUS")
            .env("PDCTL_STATE_DIR", dir.path()),
    );
    assert!(
        stdout.contains("using profile sim-1p1d: no ./pdctl.toml and no GPU found"),
        "{stdout}"
    );
    std::fs::write(
        dir.path().join("pdctl.toml"),
        "cluster = \"mine\"\n[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n",
    )
    .unwrap();
    let out = pdctl(&["plan"])
        .current_dir(dir.path())
        .env("PDCTL_STATE_DIR", dir.path())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("cluster mine (using ./pdctl.toml)"));
}

#[test]
fn unknown_profile_suggests_the_close_one() {
    let out = pdctl(&["plan", "-p", "sim-1pd1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("did you mean `sim-1p1d`?"));
}

#[test]
fn profiles_lists_every_profile_with_a_line() {
    let out = pdctl(&["profiles"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for p in pdctl::profiles::ALL {
        assert!(
            text.lines()
                .any(|l| l.starts_with(p.name) && l.len() > p.name.len() + 10),
            "{}",
            p.name
        );
    }
}

/// The seeds' Mooncake transfer engine has two profiles: `mooncake-1p1d`, today's
/// MooncakeConnector V1 (tcp, bootstrap server, transfer_id: proxy protocol `mooncake`),
/// and `mooncake-te-1p1d`, the seeds' own V0 form; `pdctl profiles` says which is which.
#[test]
fn the_mooncake_profiles_are_told_apart_and_v1_plans_over_tcp_with_its_bootstrap_server() {
    let out = pdctl(&["profiles"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no line for {name}: {text}"))
            .to_string()
    };
    assert!(line("mooncake-1p1d").contains("V1"), "{text}");
    assert!(line("mooncake-te-1p1d").contains("V0"), "{text}");
    let plan = pure_plan("mooncake-1p1d");
    assert_eq!(plan.protocol, "mooncake");
    let json = serde_json::to_value(&plan).unwrap();
    let prefill = services(&json, "prefill");
    let decode = services(&json, "decode");
    for s in prefill.iter().chain(&decode) {
        let kv = kv_config(s);
        assert_eq!(kv["kv_connector"], "MooncakeConnector", "{kv}");
        assert_eq!(
            kv["kv_connector_extra_config"]["mooncake_protocol"], "tcp",
            "{kv}"
        );
    }
    assert_eq!(
        prefill[0]["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"], "8998",
        "{}",
        prefill[0]
    );
    assert!(
        !plan
            .services
            .iter()
            .any(|s| s.name == "etcd" || s.name == "mooncake-master"),
        "V1 needs no metadata server"
    );
}

/// `pdctl gpus` on this machine: with an NVIDIA driver (`/dev/nvidiactl`), a table of its
/// GPUs and the same GPUs in `--json`; without one, one line saying so and how to plan
/// anyway (`--gpus`), and an empty list with the reason in `--json`. Either way the test
/// checks what the machine it runs on shows.
#[test]
fn gpus_lists_them_with_a_driver_and_says_why_not_in_one_line_without() {
    let out = pdctl(&["gpus", "--json"]).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    if std::path::Path::new("/dev/nvidiactl").exists() {
        assert_eq!(out.status.code(), Some(0), "{v}");
        assert!(v.get("error").is_none(), "{v}");
        let gpus = v["gpus"].as_array().expect("a list of GPUs");
        assert!(
            !gpus.is_empty(),
            "a machine with a driver lists its GPUs: {v}"
        );
        for (i, g) in gpus.iter().enumerate() {
            assert_eq!(g["index"], i, "{v}");
            assert!(g["memory_total_mib"].as_u64().is_some_and(|m| m > 0), "{v}");
        }
        let out = pdctl(&["gpus"]).output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines.len(),
            gpus.len() + 1,
            "a header and one line per GPU:\n{text}"
        );
        assert!(lines[0].starts_with("GPU"), "{text}");
        for (line, g) in lines[1..].iter().zip(gpus) {
            let uuid = g["uuid"].as_str().unwrap_or("?");
            assert!(line.contains(uuid), "{line} names {uuid}");
        }
        return;
    }
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(v["gpus"], Value::Array(vec![]));
    assert!(v["error"].is_string());
    let out = pdctl(&["gpus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--gpus"), "{err}");
}

/// The human plan shows the command a shell would run, quoted, with env in front.
#[test]
fn human_plan_shows_runnable_commands_and_files() {
    let dir = TempDir::new("human");
    let out = run_in(
        dir.path(),
        &["plan", "-p", "mooncake-te-1p1d", "--gpus", "0,1"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("CUDA_VISIBLE_DEVICES=0 "), "{text}");
    assert!(text.contains("--kv-transfer-config '{"), "{text}");
    assert!(
        text.contains("\"decode_url\": \"127.0.0.1:13103\""),
        "{text}"
    );
    assert!(text.contains("ready    GET http://127.0.0.1:2379/health -> 200 containing \"true\""));
}

/// The vLLM flag value of a planned service.
fn flag_of(s: &pdctl::vocab::Service, name: &str) -> Option<String> {
    s.argv
        .windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].clone())
}

/// One GPU: the one-GPU profile puts prefill and decode both on GPU 0, splits vLLM's memory
/// share between them, and starts decode once prefill is healthy.
#[test]
fn one_gpu_is_shared_by_prefill_and_decode() {
    let plan = plan_json(&["plan", "-p", "1gpu-1p1d", "--gpus", "0"]);
    let engines: Vec<&Value> = services(&plan, "prefill")
        .into_iter()
        .chain(services(&plan, "decode"))
        .collect();
    assert_eq!(engines.len(), 2);
    let mut total = 0.0;
    for e in &engines {
        assert_eq!(e["env"]["CUDA_VISIBLE_DEVICES"], "0", "{}", e["name"]);
        assert_eq!(e["gpus"], serde_json::json!([0]));
        assert_eq!(flag(&argv(e), "--gpu-memory-utilization"), Some("0.45"));
        total += e["gpu_memory_share"].as_f64().unwrap();
    }
    assert!(total <= 0.9, "shares add up to {total}");
    assert!(
        services(&plan, "decode")[0]["depends_on"]
            .as_array()
            .unwrap()
            .contains(&Value::from("prefill-0")),
        "decode must start after prefill on a shared GPU"
    );
    // The same profile on two GPUs gives each instance its own.
    let plan = plan_json(&["plan", "-p", "1gpu-1p1d", "--gpus", "0,1"]);
    assert_eq!(
        services(&plan, "prefill")[0]["env"]["CUDA_VISIBLE_DEVICES"],
        "0"
    );
    assert_eq!(
        services(&plan, "decode")[0]["env"]["CUDA_VISIBLE_DEVICES"],
        "1"
    );
    assert_eq!(
        flag(
            &argv(services(&plan, "decode")[0]),
            "--gpu-memory-utilization"
        ),
        None
    );
}

/// Eight instances on one GPU: shares within the topology's utilization, started one by
/// one; a fixed KV cache size lets them start together; one GPU per instance stays the
/// default.
#[test]
fn packing_splits_the_memory_and_a_fixed_kv_cache_starts_together() {
    let text = "[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.26.0\"\ninstances_per_gpu = 8\ngpu_memory_utilization = 0.8\n[connector]\nkind = \"nixl\"\n[prefill]\ninstances = 4\n[decode]\ninstances = 4\n";
    let plan = try_plan_text(text, "0.26.0", 1).unwrap();
    let engines: Vec<_> = plan
        .services
        .iter()
        .filter(|s| s.role.is_engine())
        .collect();
    assert_eq!(engines.len(), 8);
    let sum: f64 = engines.iter().map(|s| s.gpu_memory_share.unwrap()).sum();
    assert!(sum <= 0.8 && sum > 0.79, "shares add up to {sum}");
    for (i, s) in engines.iter().enumerate() {
        assert_eq!(s.env["CUDA_VISIBLE_DEVICES"], "0");
        assert_eq!(
            flag_of(s, "--gpu-memory-utilization").as_deref(),
            Some("0.1")
        );
        if i > 0 {
            assert!(
                s.depends_on.contains(&engines[i - 1].name),
                "{:?}",
                s.depends_on
            );
        }
    }

    let fixed = text.replace(
        "instances_per_gpu = 8\n",
        "instances_per_gpu = 8\nkv_cache_memory = \"1GB\"\n",
    );
    let plan = try_plan_text(&fixed, "0.26.0", 1).unwrap();
    for s in plan.services.iter().filter(|s| s.role.is_engine()) {
        assert_eq!(
            flag_of(s, "--kv-cache-memory-bytes").as_deref(),
            Some("1073741824")
        );
        assert!(
            !s.depends_on
                .iter()
                .any(|d| d.starts_with("prefill") || d.starts_with("decode")),
            "{}: {:?}",
            s.name,
            s.depends_on
        );
    }
    let old = fixed.replace("0.26.0", "0.9.2");
    let e = try_plan_text(&old, "0.9.2", 1).unwrap_err();
    assert_eq!(e.key, "engine.kv_cache_memory");

    let default = text.replace("instances_per_gpu = 8\n", "");
    let e = try_plan_text(&default, "0.26.0", 1).unwrap_err();
    assert!(e.message.contains("more GPUs than it has"), "{}", e.message);
}

/// A one-GPU 1P1D (NIXL, two instances on GPU 0) of `model`, pinned to vLLM `version`.
fn one_gpu_topology(model: &str, version: &str) -> String {
    format!(
        "[model]\nname = \"{model}\"\nmax_model_len = 4096\n[engine]\nvllm_version = \"{version}\"\ninstances_per_gpu = 2\nargs = [\"--dtype\", \"bfloat16\"]\n[connector]\nkind = \"nixl\"\n"
    )
}

/// The plan of `text` on one GPU, given the GPU and the model's size as data.
fn plan_one_gpu(
    text: &str,
    version: &str,
    gpu: Gpu,
    model: Result<pdctl::model_files::ModelSize, String>,
) -> Result<Plan, pdctl::topology::Problem> {
    let t = inline(text);
    build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &[gpu],
        gpu_note: None,
        model,
        version: Some(version.parse().unwrap()),
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: "/state".into(),
        local_node: None,
        held: Default::default(),
    })
}

/// Qwen2.5-0.5B's sizes: 494M parameters in bf16, 24 layers x 2 KV heads x 64.
fn half_b_model() -> pdctl::model_files::ModelSize {
    pdctl::model_files::ModelSize {
        parameters: 494_032_768,
        stored_bytes: 988_065_536,
        source: "safetensors headers of 1 file".into(),
        kv_elements_per_token: Some(2 * 24 * 2 * 64),
        max_position_embeddings: Some(32768),
        kv_heads: Some(2),
    }
}

/// One GPU shared by prefill and decode: where vLLM takes --kv-cache-memory-bytes (0.10.2
/// on), each engine gets its KV cache size from its share of the GPU's free memory less the
/// weights and a reserve, and both start at once; on an older vLLM, or with the GPU's
/// memory or the model's size unknown, decode still waits for prefill, and the plan says why.
#[test]
fn one_gpu_engines_start_together_with_their_kv_bytes_where_vllm_has_the_flag() {
    let text = one_gpu_topology("/models/qwen", "0.26.0");
    let gpu = |free_mib: u64| Gpu {
        index: 0,
        uuid: None,
        name: Some("H100".into()),
        memory_total_mib: Some(81559),
        memory_used_mib: Some(81559 - free_mib),
        processes: vec![],
    };
    let plan = plan_one_gpu(&text, "0.26.0", gpu(81000), Ok(half_b_model())).unwrap();
    let budget = ((81000u64 << 20) as f64 * 0.45) as u64;
    let gib = 1u64 << 30;
    let want = (budget - 988_065_536 - 2 * gib) / (64 << 20) * (64 << 20);
    for name in ["prefill-0", "decode-0"] {
        let s = plan.service(name).unwrap();
        assert_eq!(
            flag_of(s, "--kv-cache-memory-bytes"),
            Some(want.to_string()),
            "{name}"
        );
        assert_eq!(
            flag_of(s, "--gpu-memory-utilization").as_deref(),
            Some("0.45")
        );
        assert!(
            !s.depends_on
                .iter()
                .any(|d| d.starts_with("prefill") || d.starts_with("decode")),
            "{name} waits for {:?}",
            s.depends_on
        );
        let note = s.gpu_memory_note.as_deref().unwrap();
        assert!(
            note.starts_with(&format!(
                "KV cache {:.2} GiB: 0.45 of GPU 0's 79.10 GiB free is",
                want as f64 / gib as f64
            )) && note.contains("less the weights 942 MiB (safetensors headers of 1 file)")
                && note.contains("starts together with"),
            "{note}"
        );
    }
    let text_plan = pdctl::plan::render::render(&plan, "test", &[]);
    assert!(
        text_plan.contains("   memory   KV cache 32.62 GiB: 0.45 of GPU 0's 79.10 GiB free"),
        "{text_plan}"
    );

    // vLLM 0.10.1 has no --kv-cache-memory-bytes: decode starts once prefill is healthy.
    let old = one_gpu_topology("/models/qwen", "0.10.1");
    let plan = plan_one_gpu(&old, "0.10.1", gpu(81000), Ok(half_b_model())).unwrap();
    let decode = plan.service("decode-0").unwrap();
    assert!(decode.depends_on.contains(&"prefill-0".to_string()));
    assert_eq!(flag_of(decode, "--kv-cache-memory-bytes"), None);
    let note = decode.gpu_memory_note.as_deref().unwrap();
    assert!(
        note.contains("starts after prefill-0: vLLM 0.10.1 has no --kv-cache-memory-bytes (0.10.2 and later have it)"),
        "{note}"
    );
    // The same where the model's size or the GPU's memory is unknown.
    let plan = plan_one_gpu(
        &text,
        "0.26.0",
        gpu(81000),
        Err("/models/qwen is not a directory".into()),
    )
    .unwrap();
    let decode = plan.service("decode-0").unwrap();
    assert!(decode.depends_on.contains(&"prefill-0".to_string()));
    assert!(
        decode
            .gpu_memory_note
            .as_deref()
            .unwrap()
            .contains("the model's size is unknown: /models/qwen is not a directory"),
        "{:?}",
        decode.gpu_memory_note
    );
    let plan = plan_one_gpu(&text, "0.26.0", Gpu::declared(0), Ok(half_b_model())).unwrap();
    let decode = plan.service("decode-0").unwrap();
    assert!(decode.depends_on.contains(&"prefill-0".to_string()));
    assert!(
        decode
            .gpu_memory_note
            .as_deref()
            .unwrap()
            .contains("--gpus 0:80GiB gives it"),
        "{:?}",
        decode.gpu_memory_note
    );
}

/// The weights count in the dtype the engines load them in: `--dtype=float32` (the `=`
/// form too, after engine.args' bfloat16) doubles the weights of a bf16 model, so each
/// engine's KV cache is that much smaller than with bfloat16. (A prefill and a decode of
/// different dtypes are refused: tests/topologies/bad/65-dtype-differs.toml.)
#[test]
fn engines_are_sized_with_the_dtype_their_args_ask_for() {
    let gpu = Gpu::from_declared(&"0:80GiB".parse().unwrap());
    let bf16 = one_gpu_topology("/models/qwen", "0.26.0");
    let f32 = bf16.clone()
        + "[prefill]\nargs = [\"--dtype=float32\"]\n[decode]\nargs = [\"--dtype=float32\"]\n";
    let kv = |text: &str| -> u64 {
        let plan = plan_one_gpu(text, "0.26.0", gpu.clone(), Ok(half_b_model())).unwrap();
        flag_of(
            plan.service("prefill-0").unwrap(),
            "--kv-cache-memory-bytes",
        )
        .unwrap()
        .parse()
        .unwrap()
    };
    let step = 64u64 << 20;
    let extra = 988_065_536u64;
    let (small, big) = (kv(&f32), kv(&bf16));
    assert!(
        big - small >= extra / step * step,
        "float32 {small} bfloat16 {big}"
    );
    let plan = plan_one_gpu(&f32, "0.26.0", gpu, Ok(half_b_model())).unwrap();
    let note = plan
        .service("prefill-0")
        .unwrap()
        .gpu_memory_note
        .clone()
        .unwrap();
    assert!(note.contains("less the weights 1.84 GiB"), "{note}");
}

/// A share of the GPU that cannot hold the weights and a KV cache for one sequence is
/// refused before anything starts, with the numbers.
#[test]
fn a_gpu_share_without_room_for_the_kv_cache_is_refused() {
    let text = one_gpu_topology("/models/big", "0.26.0");
    let big = pdctl::model_files::ModelSize {
        parameters: 8_000_000_000,
        stored_bytes: 16_000_000_000,
        source: "safetensors headers of 4 files".into(),
        kv_elements_per_token: Some(2 * 32 * 8 * 128),
        max_position_embeddings: Some(131072),
        kv_heads: Some(8),
    };
    let gpu = Gpu::from_declared(&"0:24GiB".parse().unwrap());
    let e = plan_one_gpu(&text, "0.26.0", gpu, Ok(big)).unwrap_err();
    assert_eq!(e.key, "engine.instances_per_gpu");
    assert_eq!(
        e.message,
        "prefill-0 (shared with decode-0): 0.45 of GPU 0's 24.00 GiB free is 10.80 GiB, less the weights 14.90 GiB (safetensors headers of 4 files) and 2.00 GiB kept for activations and CUDA leaves 0 MiB for the KV cache, and one 4096-token sequence needs 512 MiB"
    );
}

/// Through the command line: `--gpus 0:80GiB` gives GPU 0's memory, the model's weights are
/// read from its safetensors header, and `pdctl plan` shows each engine's KV cache bytes.
#[test]
fn plan_reads_the_weights_and_takes_the_gpu_memory_from_gpus() {
    let dir = TempDir::new("kv-bytes");
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "max_position_embeddings": 2048}"#,
    )
    .unwrap();
    // One float32 tensor of 1M parameters (4 MB), the data zeros.
    let header = br#"{"w":{"dtype":"F32","shape":[1024,1024],"data_offsets":[0,4194304]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.resize(file.len() + 4_194_304, 0);
    std::fs::write(model.join("model.safetensors"), file).unwrap();
    let topo = dir.path().join("t.toml");
    std::fs::write(&topo, one_gpu_topology(model.to_str().unwrap(), "0.26.0")).unwrap();
    let plan = plan_json(&["plan", "-f", topo.to_str().unwrap(), "--gpus", "0:80GiB"]);
    // 0.45 of 80 GiB, less 2 MB of bf16 weights and the 2 GiB reserve, in 64 MiB steps.
    let want = ((80u64 << 30) as f64 * 0.45) as u64 - 2_097_152 - (2 << 30);
    let want = want / (64 << 20) * (64 << 20);
    for role in ["prefill", "decode"] {
        let e = services(&plan, role)[0];
        assert_eq!(
            flag(&argv(e), "--kv-cache-memory-bytes"),
            Some(want.to_string().as_str())
        );
        assert!(
            e["gpu_memory_note"]
                .as_str()
                .unwrap()
                .contains("(safetensors headers of 1 file)"),
            "{}",
            e["gpu_memory_note"]
        );
    }
    assert!(
        !services(&plan, "decode")[0]["depends_on"]
            .as_array()
            .unwrap()
            .contains(&Value::from("prefill-0"))
    );
    // PDCTL_GPUS takes the same form; 3 GiB leaves no room and is refused, exit 2.
    let out = pdctl(&["plan", "-f", topo.to_str().unwrap()])
        .env("PDCTL_GPUS", "0:3GiB")
        .env("PDCTL_STATE_DIR", dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "prefill-0 (shared with decode-0): 0.45 of GPU 0's 3.00 GiB free is 1.35 GiB"
        ),
        "{stderr}"
    );
}

/// With NVML's memory figures, engines that will not fit in a GPU's free memory are an
/// error naming the GPU, what is free and who holds the rest.
#[test]
fn engines_that_do_not_fit_the_free_memory_are_refused() {
    let t = inline(
        "[model]\nname = \"m\"\n[engine]\ninstances_per_gpu = 2\n[connector]\nkind = \"nixl\"\n",
    );
    let busy = Gpu {
        index: 0,
        uuid: None,
        name: Some("H100".into()),
        memory_total_mib: Some(81920),
        memory_used_mib: Some(40960),
        processes: vec![31337],
    };
    let input = |gpus: &[Gpu]| {
        build_plan(&PlanInput {
            topology: &t.spec,
            head: &t.head,
            gpus,
            gpu_note: None,
            model: Err("not read in this test".into()),
            version: Some("0.26.0".parse().unwrap()),
            version_source: pdctl::vocab::VersionSource::Pinned,
            state_root: "/state".into(),
            local_node: None,
            held: Default::default(),
        })
    };
    let e = input(std::slice::from_ref(&busy)).unwrap_err();
    assert_eq!(e.key, "engine.gpu_memory_utilization");
    assert!(
        e.message.contains("GPU 0 has 40960 MiB free of 81920 MiB")
            && e.message.contains("pid 31337"),
        "{}",
        e.message
    );
    let idle = Gpu {
        memory_used_mib: Some(512),
        processes: vec![],
        ..busy
    };
    assert!(input(&[idle]).is_ok());
}

/// With no file, one GPU chooses the one-GPU profile and more choose 1p1d, each said.
#[test]
fn without_a_file_the_gpu_count_chooses_the_profile() {
    let dir = TempDir::new("default-gpus");
    for (gpus, profile, why) in [
        (
            "0",
            "1gpu-1p1d",
            "1 GPU found, so prefill and decode share it",
        ),
        ("0,1", "1p1d", "2 GPU(s) found"),
    ] {
        let out = pdctl(&["plan", "--gpus", gpus])
            .current_dir(dir.path())
            .env("PDCTL_STATE_DIR", dir.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("using profile {profile}: no ./pdctl.toml; {why}")),
            "{stdout}"
        );
    }
}

/// The shared-directory connector stores a prompt whole only without chunked prefill: the
/// producer gets it off and a batch token budget of the model length; decode is untouched.
#[test]
fn example_connector_producer_schedules_prompts_whole() {
    let text = "[model]\nname = \"m\"\nmax_model_len = 2048\n[connector]\nkind = \"example\"\n";
    for version in ["0.12.0", "0.26.0"] {
        let plan = try_plan_text(text, version, 2).unwrap();
        let prefill = plan.service("prefill-0").unwrap();
        let decode = plan.service("decode-0").unwrap();
        assert!(
            prefill
                .argv
                .contains(&"--no-enable-chunked-prefill".to_string()),
            "{version}"
        );
        assert_eq!(
            flag_of(prefill, "--max-num-batched-tokens").as_deref(),
            Some("2048")
        );
        assert!(
            !decode
                .argv
                .contains(&"--no-enable-chunked-prefill".to_string())
        );
        // The topology's own args come later, so a user can still override the choice.
        let at = |s: &str| prefill.argv.iter().position(|a| a == s);
        assert!(at("--no-enable-chunked-prefill") < at("--kv-transfer-config"));
    }
}

/// A CUDA_VISIBLE_DEVICES set in the topology is the GPU the plan (and so status) reports.
#[test]
fn a_cuda_visible_devices_of_the_topology_is_the_gpu_reported() {
    let text = "[model]\nname = \"m\"\n[connector]\nkind = \"nixl\"\n[decode.env]\nCUDA_VISIBLE_DEVICES = \"0\"\n";
    let plan = try_plan_text(text, "0.26.0", 2).unwrap();
    assert_eq!(plan.service("decode-0").unwrap().gpus, vec![0]);
    assert_eq!(plan.service("prefill-0").unwrap().gpus, vec![0]);
}

/// Pre-flight finds what would surely fail before anything is spawned: a python without
/// vLLM or the connector's package (also with the version pinned) and a local model path
/// without a model, each naming the key to fix; exit 2 and no cluster left.
#[test]
fn up_refuses_a_python_without_vllm_and_a_missing_model_before_starting() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("preflight");
    let python = dir.path().join("python3");
    // Answers every find_spec with "not found" (exit 3), as a python without vLLM does.
    std::fs::write(&python, "#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"/nonexistent/models/tiny\"\n[engine]\nvllm_version = \"0.26.0\"\npython = \"{}\"\n[connector]\nkind = \"nixl\"\n",
            python.display()
        ),
    )
    .unwrap();
    let out = run_in(
        dir.path(),
        &["up", "-f", file.to_str().unwrap(), "--gpus", "0,1", "-d"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "prefill-0, decode-0: /nonexistent/models/tiny/config.json does not exist; [model] name"
        ),
        "{err}"
    );
    assert!(
        err.contains("cannot import vllm") && err.contains("engine.python"),
        "{err}"
    );
    assert!(
        err.contains("cannot import nixl") && err.contains("connector.kind"),
        "{err}"
    );
    let status = run_in(dir.path(), &["status"]);
    assert_eq!(status.status.code(), Some(3), "a refused up left a cluster");

    // A python that has them and a real model directory: those checks pass (the port held
    // below is what stops this `up`, so nothing is started either way).
    fake_python(&python, "0.26.0");
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"{}\"\n[engine]\nvllm_version = \"0.26.0\"\npython = \"{}\"\n[connector]\nkind = \"nixl\"\n[proxy]\nport = {port}\n",
            model.display(),
            python.display()
        ),
    )
    .unwrap();
    let out = run_in(
        dir.path(),
        &["up", "-f", file.to_str().unwrap(), "--gpus", "0,1", "-d"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("port {port}")), "{err}");
    assert!(
        !err.contains("config.json") && !err.contains("cannot import"),
        "{err}"
    );
}

/// A pinned version that differs from the installed one plans as pinned, with a warning
/// naming both.
#[test]
fn a_pinned_version_other_than_the_installed_one_is_a_warning() {
    let dir = TempDir::new("pinned-differs");
    let python = dir.path().join("python3");
    fake_python(&python, "0.26.0");
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.13.0\"\npython = \"{}\"\n",
            python.display()
        ),
    )
    .unwrap();
    let plan = plan_json(&["plan", "-f", file.to_str().unwrap(), "--gpus", "0,1"]);
    assert_eq!(plan["vllm_version"], "0.13.0");
    assert_eq!(plan["vllm_version_source"], "pinned");
    let warnings = plan["warnings"].to_string();
    assert!(
        warnings.contains("pins 0.13.0") && warnings.contains("has vLLM 0.26.0"),
        "{warnings}"
    );
}

/// What vLLM 0.33.0's own source says its command line, KV transfer config, connector
/// registry and environment are (read from the wheel by scripts/vllm-surface.py).
fn vllm_surface(version: &str) -> Value {
    let text =
        std::fs::read_to_string(manifest(&format!("tests/data/vllm-{version}-surface.json")))
            .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn listed(surface: &Value, key: &str, name: &str) -> bool {
    surface[key]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v.as_str() == Some(name))
}

/// Checks one planned vLLM engine against what the wheel's source has: the module run,
/// every flag pdctl wrote (not the topology's `own` args), every kv_transfer_config key and connector class (inside a MultiConnector
/// too), every VLLM_* variable. Returns what does not exist there.
fn unknown_to_vllm(s: &pdctl::vocab::Service, surface: &Value, own: &[String]) -> Vec<String> {
    let mut bad = Vec::new();
    let module = &s.argv[2];
    if !listed(surface, "modules", module) {
        bad.push(format!("module {module}"));
    }
    for a in s
        .argv
        .iter()
        .filter(|a| a.starts_with("--") && !own.contains(a))
    {
        if !listed(surface, "flags", a) {
            bad.push(format!("flag {a}"));
        }
    }
    let i = s
        .argv
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .unwrap();
    let kv: Value = serde_json::from_str(&s.argv[i + 1]).unwrap();
    let mut configs = vec![kv.clone()];
    if kv["kv_connector"] == "MultiConnector" {
        configs.extend(
            kv["kv_connector_extra_config"]["connectors"]
                .as_array()
                .unwrap()
                .iter()
                .cloned(),
        );
    }
    for c in &configs {
        for k in c.as_object().unwrap().keys() {
            if !listed(surface, "kv_transfer_config_fields", k) {
                bad.push(format!("kv_transfer_config key {k}"));
            }
        }
        let class = c["kv_connector"].as_str().unwrap();
        if !listed(surface, "connectors", class) {
            bad.push(format!("connector {class}"));
        }
    }
    for k in s.env.keys().filter(|k| k.starts_with("VLLM_")) {
        if !listed(surface, "env", k) {
            bad.push(format!("env {k}"));
        }
    }
    bad
}

/// Every real-vLLM profile, and the connector settings the profiles do not show (NIXL
/// push, the load failure policy, Mooncake store inside MultiConnector), planned for vLLM
/// 0.33.0 pinned: each flag, class, key and variable exists in 0.33.0's own source.
#[test]
fn every_real_vllm_plan_for_0_33_uses_only_what_vllm_0_33_has() {
    let surface = vllm_surface("0.33.0");
    assert_eq!(surface["version"], "0.33.0");
    let mut texts: Vec<(String, String)> = pdctl::profiles::ALL
        .iter()
        .map(|p| (p.name.to_string(), p.text.to_string()))
        .filter(|(_, text)| {
            let t = load_str(text, Source::Profile("x".into()), "x".into()).unwrap();
            t.spec.engine.kind == pdctl::topology::EngineKind::Vllm
        })
        .collect();
    assert!(texts.len() >= 8, "{}", texts.len());
    let gpu = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\n[prefill]\ninstances = 2\n[decode]\ninstances = 2\n";
    for extra in [
        "[connector]\nkind = \"nixl\"\nnixl_mode = \"push\"\nkv_load_failure_policy = \"fail\"\n",
        "[connector]\nkind = \"mooncake-store\"\nmulti = true\nkv_load_failure_policy = \"recompute\"\n",
        "[connector]\nkind = \"mooncake\"\n",
        "[connector]\nkind = \"lmcache\"\n",
    ] {
        texts.push((extra.to_string(), format!("{gpu}{extra}")));
    }
    let v: pdctl::vocab::Version = "0.33.0".parse().unwrap();
    for (name, text) in texts {
        let t = load_str(&text, Source::Profile("x".into()), "x.toml".into()).unwrap();
        let gpus: Vec<Gpu> = (0..8).map(Gpu::declared).collect();
        let plan = build_plan(&PlanInput {
            topology: &t.spec,
            head: &t.head,
            gpus: &gpus,
            gpu_note: None,
            model: Err("not read in this test".into()),
            version: Some(v.clone()),
            version_source: pdctl::vocab::VersionSource::Pinned,
            state_root: "/state".into(),
            local_node: None,
            held: Default::default(),
        });
        let plan = match plan {
            Ok(plan) => plan,
            // The V0 transfer-engine connector ended with vLLM 0.10.0: refused, by name.
            Err(e) if t.spec.connector.kind == pdctl::topology::ConnectorKind::MooncakeTe => {
                assert!(e.message.contains("has no `mooncake-te`"), "{e}");
                continue;
            }
            Err(e) => panic!("{name} does not plan for vLLM 0.33.0: {e}"),
        };
        let engines: Vec<_> = plan
            .services
            .iter()
            .filter(|s| matches!(s.role, Role::Prefill | Role::Decode))
            .collect();
        assert!(!engines.is_empty(), "{name}");
        for s in engines {
            // The topology's own args are the user's, written for the version it pins
            // (lmcache-1p1d's `--swap-space` is 0.9.2's); pdctl's are what is checked.
            let own: Vec<String> = [
                &t.spec.engine.args,
                &t.spec.prefill.args,
                &t.spec.decode.args,
            ]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
            let bad = unknown_to_vllm(s, &surface, &own);
            assert!(
                bad.is_empty(),
                "{name} {}: not in vLLM 0.33.0: {bad:?}",
                s.name
            );
        }
    }
}

/// The load failure policy reaches kv_transfer_config where vLLM has it, push mode names
/// NixlPushConnector and the nixl-push proxy protocol, and a version without either gets a
/// located error naming the versions that have it.
#[test]
fn kv_load_failure_policy_and_nixl_push_are_planned_where_vllm_has_them() {
    let base = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\n[connector]\nkind = \"nixl\"\n";
    let text = format!("{base}nixl_mode = \"push\"\nkv_load_failure_policy = \"fail\"\n");
    let plan = try_plan_text(&text, "0.33.0", 2).unwrap();
    let v = serde_json::to_value(&plan).unwrap();
    for role in ["prefill", "decode"] {
        let kv = kv_config(services(&v, role)[0]);
        assert_eq!(kv["kv_connector"], "NixlPushConnector");
        assert_eq!(kv["kv_load_failure_policy"], "fail");
        let want = if role == "prefill" {
            "kv_producer"
        } else {
            "kv_consumer"
        };
        assert_eq!(kv["kv_role"], want);
    }
    assert_eq!(v["protocol"], "nixl-push");
    let e = try_plan_text(&text, "0.23.0", 2).unwrap_err();
    assert_eq!(e.key, "connector.nixl_mode");
    assert!(e.message.contains("0.24.0"), "{}", e.message);
    let text = format!("{base}kv_load_failure_policy = \"recompute\"\n");
    let e = try_plan_text(&text, "0.12.0", 2).unwrap_err();
    assert_eq!(e.key, "connector.kv_load_failure_policy");
    assert!(e.message.contains("0.13.0"), "{}", e.message);
    let e = try_plan_text(
        "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\n[connector]\nkind = \"example\"\nnixl_mode = \"push\"\n",
        "0.33.0",
        2,
    )
    .unwrap_err();
    assert_eq!(e.key, "connector.nixl_mode");
    // Unset: nothing is passed, vLLM keeps its own default.
    let plan = try_plan_text(base, "0.33.0", 2).unwrap();
    let v = serde_json::to_value(&plan).unwrap();
    assert!(
        kv_config(services(&v, "decode")[0])
            .get("kv_load_failure_policy")
            .is_none()
    );
}

/// NixlConnector (pull) roles per vLLM version, as the planned commands carry them: kv_both
/// up to 0.22.1; from 0.23.0 (which warns that kv_both is deprecated for NIXL) prefill
/// kv_producer and decode kv_consumer, with the same nixl proxy protocol.
#[test]
fn nixl_pull_roles_are_planned_per_vllm_version() {
    let text = "[model]\nname = \"/m\"\n[engine]\nkind = \"vllm\"\n[connector]\nkind = \"nixl\"\n";
    for (version, prefill, decode) in [
        ("0.13.0", "kv_both", "kv_both"),
        ("0.22.1", "kv_both", "kv_both"),
        ("0.23.0", "kv_producer", "kv_consumer"),
        ("0.32.0", "kv_producer", "kv_consumer"),
    ] {
        let plan = try_plan_text(text, version, 2).unwrap();
        let v = serde_json::to_value(&plan).unwrap();
        assert_eq!(v["protocol"], "nixl", "{version}");
        for (role, want) in [("prefill", prefill), ("decode", decode)] {
            let kv = kv_config(services(&v, role)[0]);
            assert_eq!(kv["kv_connector"], "NixlConnector", "{version} {role}");
            assert_eq!(kv["kv_role"], want, "{version} {role}");
        }
    }
}

/// Every address a service of `plan` binds, as its command line, environment and
/// generated files say, with what says it.
fn binds(svc: &pdctl::vocab::Service) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let flags = [
        "--host",
        "--listen-client-urls",
        "--listen-peer-urls",
        "--rpc_address",
        "--metrics_host",
        "--http_metadata_server_host",
    ];
    for w in svc.argv.windows(2) {
        if flags.contains(&w[0].as_str()) {
            let addr = w[1]
                .trim_start_matches("http://")
                .rsplit_once(':')
                .map_or(w[1].as_str(), |(h, _)| h);
            out.push((w[0].clone(), addr.to_string()));
        }
    }
    for var in ["VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_HOST_IP"] {
        if let Some(v) = svc.env.get(var) {
            out.push((var.to_string(), v.clone()));
        }
    }
    for f in &svc.files {
        if let Ok(Value::Object(doc)) = toml::from_str::<Value>(&f.content)
            && let Some(Value::String(h)) = doc.get("host")
        {
            out.push((format!("{} host", f.path.display()), h.clone()));
        }
    }
    out
}

/// Issue 30, item 2: in plans over two nodes nothing listens on 0.0.0.0, and only what
/// the other node (or, for the proxy, a client) reaches listens on the node's address.
#[test]
fn two_node_plans_bind_only_what_the_other_node_reaches() {
    let sim_two_nodes = r#"
cluster = "two"
head = "a"
[nodes]
a = "10.0.0.1"
b = "10.0.0.2"
[model]
name = "m"
[engine]
kind = "sim"
[connector]
kind = "mooncake-store"
metadata = "etcd"
multi = true
[prefill]
node = "a"
[decode]
node = "b"
"#;
    let t = load_str(
        sim_two_nodes,
        Source::Profile("two".into()),
        "two.toml".into(),
    )
    .unwrap();
    let sim = build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &[],
        gpu_note: None,
        model: Err("not read in this test".into()),
        version: None,
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: "/state".into(),
        local_node: None,
        held: Default::default(),
    })
    .unwrap();
    // (plan, node address -> the binds expected on it; everything else on loopback)
    let cases: Vec<(Plan, Vec<(&str, &str)>)> = vec![
        (
            pure_plan("2node-4p4d"),
            // Prefill HTTP serves only the proxy beside it; decode HTTP the proxy on the
            // other node; the side channels the other node's engines.
            vec![
                ("prefill-0", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
                ("prefill-3", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
                ("decode-0", "--host"),
                ("decode-0", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
                ("decode-3", "--host"),
                ("proxy", "proxy.toml host"),
            ],
        ),
        (
            sim,
            // etcd's clients and the master's RPC serve the engines on b; the sim prefill's
            // HTTP the decode on b (Mooncake's bootstrap host is the prefill's URL's); the
            // peer and metrics ports nobody elsewhere.
            vec![
                ("etcd", "--listen-client-urls"),
                ("mooncake-master", "--rpc_address"),
                ("prefill-0", "prefill-0.sim.toml host"),
                ("decode-0", "decode-0.sim.toml host"),
                ("proxy", "proxy.toml host"),
            ],
        ),
    ];
    for (plan, wide) in cases {
        let json = serde_json::to_string(&plan).unwrap();
        assert!(
            !json.contains("0.0.0.0"),
            "{}: something binds 0.0.0.0",
            plan.cluster
        );
        for s in &plan.services {
            let node_addr = &plan.nodes[&s.node];
            let found = binds(s);
            assert!(
                !found.is_empty() || s.name == "lmcache-server",
                "{}: {} binds nothing the test can read",
                plan.cluster,
                s.name
            );
            for (what, addr) in found {
                let expected_wide = wide.iter().any(|(n, w)| *n == s.name && what.ends_with(w))
                    || (wide.iter().any(|(n, w)| {
                        // prefill-0 and prefill-3 stand for every instance between.
                        n.split('-').next() == s.name.split('-').next()
                            && n.contains('-')
                            && s.name.contains('-')
                            && what.ends_with(w)
                    }));
                let want = if expected_wide {
                    node_addr.as_str()
                } else {
                    "127.0.0.1"
                };
                assert_eq!(
                    addr, want,
                    "{}: {} {what} binds {addr}, expected {want}",
                    plan.cluster, s.name
                );
            }
        }
    }
    let two = pure_plan("2node-4p4d");
    let warning = two
        .warnings
        .iter()
        .find(|w| w.contains("no authentication"))
        .expect("a two-node plan says what stays open");
    assert!(
        warning.contains("NIXL side channels (port 5600-5603)"),
        "{warning}"
    );
    assert!(warning.contains("private network"), "{warning}");
    assert!(
        pure_plan("sim-1p1d")
            .warnings
            .iter()
            .all(|w| !w.contains("no authentication")),
        "one node: nothing is open to other machines"
    );
}

// ---- A change keeps each instance that stays on the GPUs it runs on (plan::held) ----

/// A NIXL vLLM topology of `p` prefill and `d` decode instances, one GPU each, with
/// `engine` lines added to `[engine]`.
fn sticky_topology(p: u32, d: u32, engine: &str) -> String {
    format!(
        "[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.26.0\"\n{engine}[connector]\nkind = \"nixl\"\n[prefill]\ninstances = {p}\n[decode]\ninstances = {d}\n"
    )
}

/// The plan of `text` on `gpus` GPUs, the instances of `running` keeping their GPUs
/// (None: planned afresh, as `pdctl up` plans).
fn plan_keeping(text: &str, gpus: u32, running: Option<&Plan>) -> Plan {
    let t = inline(text);
    let inventory: Vec<Gpu> = (0..gpus).map(Gpu::declared).collect();
    build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &inventory,
        gpu_note: None,
        model: Err("not read in this test".into()),
        version: Some("0.26.0".parse().unwrap()),
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: "/state".into(),
        local_node: None,
        held: running.map(pdctl::plan::Holdings::of).unwrap_or_default(),
    })
    .unwrap_or_else(|e| panic!("does not plan: {e}"))
}

/// Each engine's CUDA_VISIBLE_DEVICES, `name=list`, in plan order.
fn visible(p: &Plan) -> Vec<String> {
    p.services
        .iter()
        .filter(|s| s.role.is_engine())
        .map(|s| format!("{}={}", s.name, s.env["CUDA_VISIBLE_DEVICES"]))
        .collect()
}

/// The names the diff restarts with new settings.
fn rolled(running: &Plan, wanted: &Plan) -> Vec<String> {
    let d = pdctl::plan::diff::diff(running, wanted);
    d.rolled.into_iter().map(|(name, _)| name).collect()
}

/// The removals that go before the new capacity, each as its sentence.
fn first_lines(running: &Plan, wanted: &Plan) -> Vec<String> {
    let d = pdctl::plan::diff::diff(running, wanted);
    pdctl::plan::order::free_first(running, wanted, &d)
        .iter()
        .map(|f| f.line())
        .collect()
}

#[test]
fn scaling_up_keeps_every_running_instance_on_its_gpus() {
    let running = plan_keeping(&sticky_topology(1, 2, ""), 4, None);
    assert_eq!(
        visible(&running),
        ["prefill-0=0", "decode-0=1", "decode-1=2"]
    );
    // Planned afresh, prefill-1 would take GPU 1 and push both decodes along (restarted
    // onto GPUs another instance still runs on).
    let fresh = plan_keeping(&sticky_topology(2, 2, ""), 4, None);
    assert_eq!(rolled(&running, &fresh), ["decode-0", "decode-1"]);
    let wanted = plan_keeping(&sticky_topology(2, 2, ""), 4, Some(&running));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=0", "prefill-1=3", "decode-0=1", "decode-1=2"]
    );
    assert_eq!(rolled(&running, &wanted), Vec::<String>::new());
    assert_eq!(first_lines(&running, &wanted), Vec::<String>::new());
    // Its NIXL side-channel port is none a running instance listens on (planned afresh it
    // took decode-0's, which moved on to decode-1's).
    let side = |p: &Plan, name: &str| p.service(name).unwrap().ports["side-channel"];
    let running_ports: Vec<u16> = ["prefill-0", "decode-0", "decode-1"]
        .iter()
        .map(|n| side(&running, n))
        .collect();
    assert!(
        !running_ports.contains(&side(&wanted, "prefill-1")),
        "{running_ports:?}"
    );
    assert!(running_ports.contains(&side(&fresh, "prefill-1")));
}

#[test]
fn scaling_down_leaves_the_others_where_they_run() {
    let running = plan_keeping(&sticky_topology(2, 2, ""), 4, None);
    let wanted = plan_keeping(&sticky_topology(1, 2, ""), 4, Some(&running));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=0", "decode-0=2", "decode-1=3"]
    );
    let d = pdctl::plan::diff::diff(&running, &wanted);
    assert_eq!(
        (d.added.len(), d.removed, d.rolled.len()),
        (0, vec!["prefill-1".to_string()], 0)
    );
}

#[test]
fn moving_an_instance_between_roles_frees_the_leaving_ones_gpu_first() {
    let running = plan_keeping(&sticky_topology(2, 2, ""), 4, None);
    // 2P2D -> 3P1D: prefill-2 gets what decode-1 leaves, decode-0 stays on GPU 2 (planned
    // afresh it moved to GPU 3 while decode-1 still ran there, and prefill-2 took GPU 2
    // while decode-0 still ran there).
    let fresh = plan_keeping(&sticky_topology(3, 1, ""), 4, None);
    assert_eq!(
        visible(&fresh),
        ["prefill-0=0", "prefill-1=1", "prefill-2=2", "decode-0=3"]
    );
    let wanted = plan_keeping(&sticky_topology(3, 1, ""), 4, Some(&running));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=0", "prefill-1=1", "prefill-2=3", "decode-0=2"]
    );
    assert_eq!(rolled(&running, &wanted), Vec::<String>::new());
    assert_eq!(
        first_lines(&running, &wanted),
        [
            "decode-1 is drained, stopped and removed before prefill-2 starts: prefill-2 takes its GPU 3 (one instance fewer serves meanwhile)"
        ]
    );
    // And the other way, 2P2D -> 1P3D: decode-2 gets prefill-1's GPU 1.
    let wanted = plan_keeping(&sticky_topology(1, 3, ""), 4, Some(&running));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=0", "decode-0=2", "decode-1=3", "decode-2=1"]
    );
    assert_eq!(
        first_lines(&running, &wanted),
        [
            "prefill-1 is drained, stopped and removed before decode-2 starts: decode-2 takes its GPU 1 (one instance fewer serves meanwhile)"
        ]
    );
}

#[test]
fn shared_gpus_keep_their_holders_and_their_shares() {
    let two = "instances_per_gpu = 2\n";
    let running = plan_keeping(&sticky_topology(2, 2, two), 2, None);
    assert_eq!(
        visible(&running),
        ["prefill-0=0", "prefill-1=1", "decode-0=0", "decode-1=1"]
    );
    // Afresh, 3P1D puts prefill-2 beside prefill-0 and moves decode-0 to GPU 1, where
    // two instances still run.
    let fresh = plan_keeping(&sticky_topology(3, 1, two), 2, None);
    assert_eq!(
        visible(&fresh),
        ["prefill-0=0", "prefill-1=1", "prefill-2=0", "decode-0=1"]
    );
    let wanted = plan_keeping(&sticky_topology(3, 1, two), 2, Some(&running));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=0", "prefill-1=1", "prefill-2=1", "decode-0=0"]
    );
    // Each still holds half of vLLM's 0.9 of its GPU: nothing kept is restarted.
    let share = |p: &Plan, name: &str| {
        flag(&p.service(name).unwrap().argv, "--gpu-memory-utilization").map(str::to_string)
    };
    assert_eq!(share(&wanted, "prefill-2").as_deref(), Some("0.45"));
    assert_eq!(share(&wanted, "decode-0"), share(&running, "decode-0"));
    assert_eq!(rolled(&running, &wanted), Vec::<String>::new());
    // GPU 1 holds two already (prefill-1 and decode-1): decode-1 goes first.
    assert_eq!(
        first_lines(&running, &wanted),
        [
            "decode-1 is drained, stopped and removed before prefill-2 starts: prefill-2 takes its GPU 1 (one instance fewer serves meanwhile)"
        ]
    );
}

#[test]
fn an_instance_that_comes_to_share_its_gpu_is_restarted_with_its_half_first() {
    let two = "instances_per_gpu = 2\n";
    let running = plan_keeping(&sticky_topology(2, 2, two), 4, None);
    assert_eq!(
        visible(&running),
        ["prefill-0=0", "prefill-1=1", "decode-0=2", "decode-1=3"]
    );
    // 3P2D on 4 GPUs: prefill-2 shares GPU 0 with prefill-0, which holds 0.9 of it until
    // it is restarted with 0.45; prefill-2 starts after that.
    let wanted = plan_keeping(&sticky_topology(3, 2, two), 4, Some(&running));
    assert_eq!(
        visible(&wanted),
        [
            "prefill-0=0",
            "prefill-1=1",
            "prefill-2=0",
            "decode-0=2",
            "decode-1=3"
        ]
    );
    assert_eq!(rolled(&running, &wanted), ["prefill-0"]);
    assert_eq!(
        first_lines(&running, &wanted),
        [
            "prefill-0 is drained and restarted with 0.45 of its GPUs before prefill-2 starts: prefill-2 shares its GPU 0 (one instance fewer serves meanwhile)"
        ]
    );
}

#[test]
fn an_instance_whose_shared_gpu_is_left_to_it_is_restarted_after_the_other_leaves() {
    let two = "instances_per_gpu = 2\n";
    let running = plan_keeping(&sticky_topology(1, 2, two), 2, None);
    assert_eq!(
        visible(&running),
        ["prefill-0=0", "decode-0=1", "decode-1=0"]
    );
    // 1P1D: prefill-0 has GPU 0 to itself again (vLLM's 0.9, not half of it), so it is
    // restarted, and decode-1 must have left GPU 0 first.
    let wanted = plan_keeping(&sticky_topology(1, 1, two), 2, Some(&running));
    assert_eq!(visible(&wanted), ["prefill-0=0", "decode-0=1"]);
    assert_eq!(rolled(&running, &wanted), ["prefill-0"]);
    assert_eq!(
        first_lines(&running, &wanted),
        [
            "decode-1 is drained, stopped and removed before prefill-0 starts: prefill-0 takes its GPU 0 (one instance fewer serves meanwhile)"
        ]
    );
}

#[test]
fn a_kept_instance_whose_gpu_is_no_longer_allowed_gets_a_free_one() {
    let running = plan_keeping(&sticky_topology(1, 1, ""), 4, None);
    assert_eq!(visible(&running), ["prefill-0=0", "decode-0=1"]);
    let text = sticky_topology(1, 1, "").replace(
        "[decode]\ninstances = 1\n",
        "[decode]\ninstances = 1\ngpus = [2, 3]\n",
    );
    let wanted = plan_keeping(&text, 4, Some(&running));
    assert_eq!(visible(&wanted), ["prefill-0=0", "decode-0=2"]);
    assert_eq!(rolled(&running, &wanted), ["decode-0"]);
    assert!(
        wanted
            .warnings
            .iter()
            .all(|w| !w.contains("handed out anew"))
    );
}

#[test]
fn when_what_is_left_cannot_hold_them_gpus_are_handed_out_anew_with_a_warning() {
    let running = plan_keeping(&sticky_topology(2, 2, ""), 4, None);
    // The prefills are given the decodes' GPUs: nothing is left for them beside the kept
    // decodes, so the plan is the fresh one, and says so.
    let text = sticky_topology(2, 2, "").replace(
        "[prefill]\ninstances = 2\n",
        "[prefill]\ninstances = 2\ngpus = [2, 3]\n",
    );
    let wanted = plan_keeping(&text, 4, Some(&running));
    assert_eq!(visible(&wanted), visible(&plan_keeping(&text, 4, None)));
    assert_eq!(
        visible(&wanted),
        ["prefill-0=2", "prefill-1=3", "decode-0=0", "decode-1=1"]
    );
    assert!(
        wanted
            .warnings
            .iter()
            .any(|w| w.contains("handed out anew")),
        "{:?}",
        wanted.warnings
    );
}
