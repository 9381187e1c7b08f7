//! The model fetch step (`pdctl pull`, and `pdctl up` before anything starts) against a
//! stand-in hub the test starts (tests/hub_server.py, HF_ENDPOINT pointed at it): what is
//! fetched and what not, progress, a second pull fetching nothing, a cut or stalled
//! download resumed, the refusals (gated, unknown, offline) with exit 2 before anything
//! starts, and the plan of a one-GPU pair sized from the hub's list, then from the files.
//!
//! Needs a Python with huggingface_hub (vLLM's; see `hub::hf_python`), no internet.

use crate::common;
use crate::common::hub;

use common::{TempDir, pdctl};
use hub::Hub;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A topology serving `model` from the stand-in hub at `endpoint`, its cache in `dir/hub`;
/// `extra` is added to `[engine]`.
fn topology(dir: &Path, model: &str, endpoint: &str, extra: &str) -> PathBuf {
    let file = dir.join("t.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"{model}\"\nmax_model_len = 4096\n[engine]\nvllm_version = \"0.26.0\"\npython = \"{}\"\n{extra}\n[engine.env]\nHF_ENDPOINT = \"{endpoint}\"\nHF_HUB_CACHE = \"{}\"\n[connector]\nkind = \"nixl\"\n",
            hub::hf_python(),
            dir.join("hub").display()
        ),
    )
    .unwrap();
    file
}

fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = pdctl(args);
    c.env("PDCTL_STATE_DIR", dir.join("state"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The snapshot the fetch made of `org/tiny`.
fn snapshot(dir: &Path) -> PathBuf {
    let snaps = dir.join("hub/models--org--tiny/snapshots");
    let mut all: Vec<PathBuf> = std::fs::read_dir(&snaps)
        .unwrap_or_else(|e| panic!("{}: {e}", snaps.display()))
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(all.len(), 1, "{all:?}");
    all.pop().unwrap()
}

#[test]
fn pull_fetches_what_vllm_loads_with_progress_resumes_a_cut_download_and_then_fetches_nothing() {
    let dir = TempDir::new("pull");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    // About 512 KiB/s, cut half-way through the first GET of each large file.
    let hub = Hub::start(
        dir.path(),
        &[("org/tiny", &repo)],
        &["--cut-once", "--rate", "524288"],
    );
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "pdctl: fetching org/tiny for node local from {} into {}",
            hub.endpoint(),
            dir.path().join("hub").display()
        )),
        "{stdout}"
    );
    // Progress lines: bytes done / total (the total is every file vLLM loads).
    let total: u64 = [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]
    .iter()
    .map(|f| std::fs::metadata(repo.join(f)).unwrap().len())
    .sum();
    let total_text = format!("{:.2} MiB", total as f64 / (1 << 20) as f64);
    let progress: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.starts_with("pdctl: fetching org/tiny: ") && l.contains(&format!(" / {total_text} ("))
        })
        .collect();
    assert!(progress.len() >= 2, "{stdout}");
    assert!(
        progress
            .iter()
            .any(|l| l.contains("/s, ") && l.contains(" left")),
        "a line with the rate and the time left: {stdout}"
    );
    // All of it fetched by this pull, none of it there before.
    assert!(
        stdout.contains("pdctl: fetched org/tiny 2.0 MiB (2.0 MiB fetched now) in "),
        "{stdout}"
    );
    // What vLLM loads is there, byte for byte; the .bin beside the safetensors and the
    // README stayed on the hub.
    let snap = snapshot(dir.path());
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(snap.join(f)).unwrap(),
            std::fs::read(repo.join(f)).unwrap(),
            "{f}"
        );
    }
    for f in ["pytorch_model.bin", "README.md"] {
        assert!(!snap.join(f).exists(), "{f} was fetched");
    }
    let commit = snap.file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("hub/models--org--tiny/refs/main")).unwrap(),
        commit
    );
    // The cut download was resumed where it stopped, not begun again.
    let requests = hub.requests();
    let cut_at = requests
        .iter()
        .find(|r| r["event"] == "cut")
        .and_then(|r| r["at"].as_u64())
        .unwrap_or_else(|| panic!("the server cut no download: {requests:?}"));
    assert!(
        requests.iter().any(
            |r| r["path"].as_str().unwrap().ends_with("/model.safetensors")
                && r["range"].as_str() == Some(&format!("bytes={cut_at}-"))
        ),
        "no request resumed at byte {cut_at}: {requests:?}"
    );
    assert!(
        !requests
            .iter()
            .any(|r| r["path"].as_str().unwrap().contains("pytorch_model.bin")),
        "{requests:?}"
    );

    // A second pull finds it and asks the hub nothing.
    let asked = hub.requests().len();
    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "pdctl: org/tiny is in the Hugging Face cache ({}): nothing to fetch",
            snap.display()
        )),
        "{stdout}"
    );
    assert_eq!(hub.requests().len(), asked);
}

/// A hub whose file list has sizes but no blob ids (no `blobId`, no `lfs.sha256`), as
/// mirrors may answer: the cache's blobs are named by each file's ETag, as huggingface_hub
/// names them, and a second pull finds them. The reason of a failure is never a traceback.
#[test]
fn a_hub_that_lists_no_blob_ids_is_fetched_with_blobs_named_by_their_etag() {
    let dir = TempDir::new("pull-no-blob-ids");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--no-blob-ids"]);
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    let (stdout, stderr) = text(&out);
    assert!(
        !stdout.contains("Traceback") && !stderr.contains("Traceback"),
        "{stdout}\n{stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let snap = snapshot(dir.path());
    let blobs = dir.path().join("hub/models--org--tiny/blobs");
    for f in ["model.safetensors", "config.json"] {
        let data = std::fs::read(repo.join(f)).unwrap();
        assert_eq!(std::fs::read(snap.join(f)).unwrap(), data, "{f}");
        // The snapshot links to a blob named by the hub's ETag: the sha256 of an LFS file,
        // the git blob id (40 hex digits) of a small one.
        let target = std::fs::canonicalize(snap.join(f)).unwrap();
        assert_eq!(
            target.parent().unwrap(),
            blobs.canonicalize().unwrap(),
            "{f}"
        );
        let name = target.file_name().unwrap().to_str().unwrap().to_string();
        if f.ends_with(".safetensors") {
            assert_eq!(name, sha256_hex(&data), "{f}");
        } else {
            assert!(
                name.len() == 40 && name.bytes().all(|b| b.is_ascii_hexdigit()),
                "{f}: {name}"
            );
        }
    }
    let asked = hub.requests().len();
    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("nothing to fetch"), "{stdout}");
    assert_eq!(hub.requests().len(), asked, "a second pull asked the hub");
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(data))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_stalled_download_is_killed_and_resumed() {
    let dir = TempDir::new("pull-stall");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    // The first GET of the weights sends half, then nothing, never closing.
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--stall-once"]);
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    let out = run(
        dir.path(),
        &["pull", "-f", file.to_str().unwrap()],
        &[("PDCTL_FETCH_STALL_S", "2")],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let snap = snapshot(dir.path());
    assert_eq!(
        std::fs::read(snap.join("model.safetensors")).unwrap(),
        std::fs::read(repo.join("model.safetensors")).unwrap()
    );
    let requests = hub.requests();
    let at = requests
        .iter()
        .find(|r| r["event"] == "stall")
        .and_then(|r| r["at"].as_u64())
        .unwrap_or_else(|| panic!("no stall: {requests:?}"));
    // Resumed from what reached the disk before the stall (at most what was sent).
    let resumed_at = requests
        .iter()
        .filter_map(|r| {
            r["range"]
                .as_str()?
                .strip_prefix("bytes=")?
                .strip_suffix('-')?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or_else(|| panic!("not resumed: {requests:?}"));
    assert!(
        resumed_at > 0 && resumed_at <= at,
        "{resumed_at} of {at}: {requests:?}"
    );
    assert!(
        stdout.contains(
            "pdctl: fetching org/tiny: the try failed (no byte for 2 s); again in 1 s, resuming"
        ),
        "the stalled try is said: {stdout}"
    );
}

#[test]
fn a_gated_model_without_a_token_is_refused_before_anything_starts_and_fetched_with_one() {
    let dir = TempDir::new("pull-gated");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let token = "hf_test_secret_token_1234";
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--gated", token]);
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    let out = run(
        dir.path(),
        &["up", "-f", file.to_str().unwrap(), "--gpus", "0,1", "-d"],
        &[],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "error: org/tiny is gated or private: the hub at {} refused it without a token (HTTP 401); accept its terms at {}/org/tiny and set HF_TOKEN",
            hub.endpoint(),
            hub.endpoint()
        )),
        "{stderr}"
    );
    // Nothing started: no cluster to see.
    let status = run(dir.path(), &["status"], &[]);
    assert_eq!(status.status.code(), Some(3), "{:?}", text(&status));

    // With the token (in the environment) it is fetched, and the token is nowhere printed.
    let out = run(
        dir.path(),
        &["pull", "-f", file.to_str().unwrap()],
        &[("HF_TOKEN", token)],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(!stdout.contains(token) && !stderr.contains(token));
    assert!(snapshot(dir.path()).join("model.safetensors").is_file());
    assert!(hub.requests().iter().any(|r| r["authorized"] == true));
}

#[test]
fn an_unknown_model_and_an_offline_hub_are_refused_with_what_to_do() {
    let dir = TempDir::new("pull-refused");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &[]);
    let file = topology(dir.path(), "org/nope", &hub.endpoint(), "");
    // With a token the hub says "not found" (without one it answers 401, as for a gated model).
    let out = run(
        dir.path(),
        &["pull", "-f", file.to_str().unwrap()],
        &[("HF_TOKEN", "t")],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "error: model org/nope was not found on the hub at {} (HTTP 404): check [model] name against {}/org/nope",
            hub.endpoint(),
            hub.endpoint()
        )),
        "{stderr}"
    );
    // Without a token the hub answers 401 for an id it lacks, as for a private one.
    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("org/nope is gated or private")
            && stderr.contains("(HTTP 401) (or it does not exist")
            && stderr.contains("HF_TOKEN"),
        "{stderr}"
    );
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    let out = run(
        dir.path(),
        &["pull", "-f", file.to_str().unwrap()],
        &[("HF_HUB_OFFLINE", "1")],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "error: org/tiny is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE forbids fetching it",
            dir.path().join("hub").display()
        )),
        "{stderr}"
    );
    assert!(
        hub.requests()
            .iter()
            .all(|r| !r["path"].as_str().unwrap().contains("/resolve/"))
    );
}

/// The engines of a plan, as JSON, and whether each has its KV cache bytes and waits for none
/// of the others.
fn engines_start_together(plan: &Value) -> Vec<(String, Option<u64>, bool)> {
    plan["services"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["role"] == "prefill" || s["role"] == "decode")
        .map(|s| {
            let argv: Vec<&str> = s["argv"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            let kv = argv
                .iter()
                .position(|a| *a == "--kv-cache-memory-bytes")
                .map(|i| argv[i + 1].parse().unwrap());
            let waits = s["depends_on"].as_array().unwrap().iter().any(|d| {
                d.as_str().unwrap().starts_with("prefill")
                    || d.as_str().unwrap().starts_with("decode")
            });
            (s["name"].as_str().unwrap().to_string(), kv, !waits)
        })
        .collect()
}

/// What the plan says of prefill-0's memory.
fn prefill_note(plan: &Value) -> String {
    plan["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "prefill-0")
        .unwrap()["gpu_memory_note"]
        .to_string()
}

#[test]
fn a_one_gpu_pair_is_sized_from_the_hubs_list_before_the_fetch_and_from_its_files_after() {
    let dir = TempDir::new("pull-plan");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &[]);
    let file = topology(
        dir.path(),
        "org/tiny",
        &hub.endpoint(),
        "instances_per_gpu = 2",
    );
    let plan_json = || {
        let out = run(
            dir.path(),
            &[
                "plan",
                "-f",
                file.to_str().unwrap(),
                "--gpus",
                "0:80GiB",
                "--json",
            ],
            &[],
        );
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
        serde_json::from_str::<Value>(&stdout).unwrap()
    };
    // Not fetched: sized from the hub's file list, and the plan says `up` fetches it first.
    let before = plan_json();
    let engines = engines_start_together(&before);
    assert_eq!(engines.len(), 2, "{engines:?}");
    for (name, kv, together) in &engines {
        assert!(kv.is_some() && *together, "{name}: {engines:?}");
    }
    let warnings = before["warnings"].to_string();
    assert!(
        warnings.contains("org/tiny is not fetched yet: `up` fetches it first")
            && warnings.contains(&hub.endpoint()),
        "{warnings}"
    );
    let note = prefill_note(&before);
    assert!(
        note.contains("the hub's file list: 1 weight file, not fetched yet"),
        "{note}"
    );

    let out = run(dir.path(), &["pull", "-f", file.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(0), "{:?}", text(&out));
    // Fetched: sized from its safetensors header, both engines start together with their
    // KV bytes; nothing said of a fetch.
    let after = plan_json();
    let engines = engines_start_together(&after);
    assert_eq!(engines.len(), 2, "{engines:?}");
    for (name, kv, together) in &engines {
        assert!(
            kv.is_some_and(|b| b > 30 << 30) && *together,
            "{name}: {engines:?}"
        );
    }
    assert!(!after["warnings"].to_string().contains("not fetched yet"));
    let note = prefill_note(&after);
    assert!(
        note.contains("safetensors headers of 1 file") && note.contains("starts together with"),
        "{note}"
    );
}

#[test]
fn status_shows_the_fetch_while_up_makes_it() {
    let dir = TempDir::new("pull-status");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    // 2 MiB at about 256 KiB/s: some eight seconds of fetching to look at.
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--rate", "262144"]);
    let file = topology(dir.path(), "org/tiny", &hub.endpoint(), "");
    // A port held here stops the `up` in pre-flight once the fetch is done: nothing starts.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let mut text_of = std::fs::read_to_string(&file).unwrap();
    text_of.push_str(&format!("[proxy]\nport = {port}\n"));
    std::fs::write(&file, text_of).unwrap();
    let mut up = pdctl(&["up", "-f", file.to_str().unwrap(), "--gpus", "0,1", "-d"]);
    up.env("PDCTL_STATE_DIR", dir.path().join("state"))
        .env_remove("HF_TOKEN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _up = common::ChildGuard(up.spawn().unwrap());
    let mut seen = None;
    common::wait_until(std::time::Duration::from_secs(30), || {
        let out = run(dir.path(), &["status", "--json"], &[]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let text = doc["step"]["text"].as_str().unwrap_or("").to_string();
        if text.starts_with("fetching model ") && doc["step"]["done"].as_u64() > Some(0) {
            seen = Some((out.status.code(), doc));
            return true;
        }
        false
    });
    let (code, doc) = seen.expect("status --json never showed the fetch");
    assert_eq!(code, Some(1));
    assert_eq!(doc["step"]["model"], "org/tiny");
    assert!(
        doc["step"]["text"]
            .as_str()
            .unwrap()
            .contains(" / 2.00 MiB ("),
        "{doc}"
    );
    assert_eq!(doc["services"], serde_json::json!([]));
    let out = run(dir.path(), &["status"], &[]);
    let (stdout, _) = text(&out);
    assert!(
        stdout.starts_with("cluster pd (node local): fetching model ")
            && stdout.contains("(org/tiny); no service started yet"),
        "{stdout}"
    );
}

/// A cluster `name` of `org/tiny` from the stand-in hub at `endpoint` on that stand-in
/// (CPU, one prefill and one decode, free ports), its cache in `dir/hub`.
fn fake_vllm_topology(dir: &Path, name: &str, endpoint: &str) -> PathBuf {
    fake_vllm_topology_with(dir, name, endpoint, "")
}

/// [`fake_vllm_topology`] with `env` added to [engine.env].
fn fake_vllm_topology_with(dir: &Path, name: &str, endpoint: &str, env: &str) -> PathBuf {
    let python = hub::fake_vllm(dir);
    let run = crate::common::supervisor::free_port_run(12);
    let file = dir.join("t.toml");
    std::fs::write(
        &file,
        format!(
            "cluster = \"{name}\"\n[model]\nname = \"org/tiny\"\nmax_model_len = 4096\n\
             [engine]\nvllm_version = \"0.26.0\"\ndevice = \"cpu\"\npython = \"{}\"\n\
             [engine.env]\nHF_ENDPOINT = \"{endpoint}\"\nHF_HUB_CACHE = \"{}\"\n{env}\n\
             [connector]\nkind = \"nixl\"\nside_channel_port = {}\n\
             [prefill]\ninstances = 1\nbase_port = {}\n\
             [decode]\ninstances = 1\nbase_port = {}\n\
             [proxy]\nport = {run}\n",
            python.display(),
            dir.join("hub").display(),
            run + 9,
            run + 1,
            run + 5,
        ),
    )
    .unwrap();
    file
}

/// How many GETs of the weights file the hub answered.
fn weight_gets(hub: &Hub) -> usize {
    hub.requests()
        .iter()
        .filter(|r| {
            r["method"] == "GET"
                && r["path"]
                    .as_str()
                    .is_some_and(|p| p.ends_with("model.safetensors"))
        })
        .count()
}

#[test]
fn scale_fetches_the_model_a_new_engines_node_lacks_before_it_starts() {
    let dir = TempDir::new("pull-scale");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--rate", "1048576"]);
    let file = fake_vllm_topology(dir.path(), "pullscale", &hub.endpoint());
    let cluster = crate::common::supervisor::Cluster::new("pullscale");
    let f = file.to_str().unwrap();
    let mut up = cluster.command(&["up", "-d", "-f", f]);
    up.env_remove("HF_TOKEN");
    let out = crate::common::supervisor::run_bounded(up, std::time::Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("pdctl: fetched org/tiny"), "{stdout}");
    assert_eq!(weight_gets(&hub), 1, "{:?}", hub.requests());

    // The cache loses the model (a node that never had it): the new engine waits for it.
    std::fs::remove_dir_all(dir.path().join("hub")).unwrap();
    let out = cluster.run(&["scale", "decode=2"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    // Fetched (with the lines `up` prints) before decode-1 starts; its start-up counts
    // nothing of it.
    let fetching = stdout
        .find("pdctl: fetching org/tiny for node local from")
        .unwrap_or_else(|| panic!("scale fetched nothing: {stdout}"));
    let fetched = stdout
        .find("pdctl: fetched org/tiny 2.0 MiB (2.0 MiB fetched now)")
        .unwrap_or_else(|| panic!("{stdout}"));
    let starting = stdout
        .find("pdctl: starting decode-1")
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(fetching < fetched && fetched < starting, "{stdout}");
    assert!(stdout.contains("pdctl: decode-1: healthy"), "{stdout}");
    assert_eq!(weight_gets(&hub), 2);
    snapshot(dir.path());

    // With the model there, the next scale fetches nothing.
    let out = cluster.run(&["scale", "decode=3"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(!stdout.contains("fetching org/tiny"), "{stdout}");
    assert_eq!(weight_gets(&hub), 2);
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out).0);
}

/// Issue 47's "done when": a download that takes longer than the engines'
/// `startup_timeout_s` still ends in a serving cluster, since the start-up limit counts
/// from the engine's start, after the fetch. 2 MiB at 256 KiB/s is about 8 s of fetching
/// against a limit of 3 s for each engine.
#[test]
fn a_fetch_longer_than_the_startup_timeout_still_ends_in_a_serving_cluster() {
    let dir = TempDir::new("pull-long");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--rate", "262144"]);
    let file = fake_vllm_topology(dir.path(), "pulllong", &hub.endpoint());
    let text_of = std::fs::read_to_string(&file).unwrap();
    let limited = text_of
        .replace(
            "[prefill]\ninstances = 1\n",
            "[prefill]\ninstances = 1\nstartup_timeout_s = 3\n",
        )
        .replace(
            "[decode]\ninstances = 1\n",
            "[decode]\ninstances = 1\nstartup_timeout_s = 3\n",
        );
    assert_eq!(
        limited.matches("startup_timeout_s = 3").count(),
        2,
        "{limited}"
    );
    std::fs::write(&file, limited).unwrap();
    let cluster = crate::common::supervisor::Cluster::new("pulllong");
    let mut up = cluster.command(&["up", "-d", "-f", file.to_str().unwrap()]);
    up.env_remove("HF_TOKEN");
    let started = std::time::Instant::now();
    let out = crate::common::supervisor::run_bounded(up, std::time::Duration::from_secs(120));
    let took = started.elapsed();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("pdctl: fetched org/tiny"), "{stdout}");
    assert!(
        took > std::time::Duration::from_secs(6),
        "the fetch was meant to outlast the 3 s limit; up took {took:?}"
    );
    let status = cluster.status(&[]).expect("status answers");
    assert!(
        crate::common::supervisor::all_healthy(&status),
        "{:?}",
        status.services
    );
    // The proxy among them: healthy only once its readiness (an engine of each role
    // usable) holds, so the cluster serves.
    assert!(
        status.services.iter().any(|s| s.name == "proxy"),
        "{:?}",
        status.services
    );
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out).0);
}

#[test]
fn apply_fetches_with_the_topologys_token_and_a_refusal_changes_nothing() {
    let dir = TempDir::new("pull-apply");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let token = "hf_applyTestToken_5678";
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &["--gated", token]);
    let env = format!("HF_TOKEN = \"{token}\"");
    let file = fake_vllm_topology_with(dir.path(), "pullapply", &hub.endpoint(), &env);
    let cluster = crate::common::supervisor::Cluster::new("pullapply");
    let mut up = cluster.command(&["up", "-d", "-f", file.to_str().unwrap()]);
    up.env_remove("HF_TOKEN");
    let out = crate::common::supervisor::run_bounded(up, std::time::Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("pdctl: fetched org/tiny"), "{stdout}");
    std::fs::remove_dir_all(dir.path().join("hub")).unwrap();

    // Another decode with a token the hub refuses: exit 2 before anything changes.
    let text_of = std::fs::read_to_string(&file).unwrap();
    let two = text_of.replace("[decode]\ninstances = 1", "[decode]\ninstances = 2");
    assert_ne!(two, text_of);
    let wrong = dir.path().join("wrong.toml");
    std::fs::write(&wrong, two.replace(token, "hf_notTheToken")).unwrap();
    let mut apply = cluster.command(&["apply", "-f", wrong.to_str().unwrap()]);
    apply.env_remove("HF_TOKEN");
    let out = crate::common::supervisor::run_bounded(apply, std::time::Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    let said = format!("{stdout}{stderr}");
    assert!(
        said.contains("org/tiny is gated or private") && said.contains("nothing was changed"),
        "{said}"
    );
    assert!(
        !said.contains("hf_notTheToken") && !said.contains(token),
        "{said}"
    );
    let r = cluster.status(&[]).expect("the cluster runs");
    assert!(!r.services.iter().any(|s| s.name == "decode-1"), "{r:?}");

    // With the topology's token it is fetched, then decode-1 starts, with the token.
    let right = dir.path().join("right.toml");
    std::fs::write(&right, &two).unwrap();
    let mut apply = cluster.command(&["apply", "-f", right.to_str().unwrap()]);
    apply.env_remove("HF_TOKEN");
    let out = crate::common::supervisor::run_bounded(apply, std::time::Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let fetched = stdout
        .find("pdctl: fetched org/tiny")
        .unwrap_or_else(|| panic!("{stdout}"));
    let starting = stdout
        .find("pdctl: starting decode-1")
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(fetched < starting, "{stdout}");
    assert!(hub.requests().iter().any(|r| r["authorized"] == true));
    let r = cluster.wait_status(std::time::Duration::from_secs(20), &[], |r| {
        r.services
            .iter()
            .any(|s| s.name == "decode-1" && s.pid.is_some())
    });
    let pid = crate::common::supervisor::svc(&r, "decode-1").pid.unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(
        String::from_utf8_lossy(&environ).contains(&format!("HF_TOKEN={token}")),
        "decode-1 lacks the token"
    );
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out).0);
}

#[test]
fn a_node_run_from_a_plan_file_fetches_the_model_first() {
    let dir = TempDir::new("pull-plan");
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    let hub = Hub::start(dir.path(), &[("org/tiny", &repo)], &[]);
    let file = fake_vllm_topology(dir.path(), "pullplan", &hub.endpoint());
    let cluster = crate::common::supervisor::Cluster::new("pullplan");
    // The plan names the model and where to fetch it from, never a token.
    let out = cluster.run(&["plan", "-f", file.to_str().unwrap(), "--json"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let plan: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(plan["model_fetch"]["model"], "org/tiny", "{plan}");
    assert_eq!(plan["model_fetch"]["env"]["HF_ENDPOINT"], hub.endpoint());
    let plan_file = dir.path().join("plan.json");
    std::fs::write(&plan_file, &stdout).unwrap();

    // What `pdctl node-up` runs on a node the head starts over SSH: `up` of a plan file.
    let mut up = cluster.command(&["up", "-d", "--plan", plan_file.to_str().unwrap()]);
    up.env_remove("HF_TOKEN");
    let out = crate::common::supervisor::run_bounded(up, std::time::Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let fetched = stdout
        .find("pdctl: fetched org/tiny 2.0 MiB")
        .unwrap_or_else(|| panic!("up --plan fetched nothing: {stdout}"));
    let started = stdout.find("is up").unwrap_or_else(|| panic!("{stdout}"));
    assert!(fetched < started, "{stdout}");
    assert!(snapshot(dir.path()).join("model.safetensors").is_file());
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out).0);
}
