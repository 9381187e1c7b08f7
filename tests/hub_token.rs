//! A Hugging Face token written in the topology (`[engine.env]`, a role's `env`) reaches
//! the engines' environment and nothing else: not `pdctl plan`'s output, not plan.json,
//! the kept topology, the journal or any other file of the state dir but the one private
//! file (mode 0600) the supervisor reads at each start; `scale` starts new engines with it.

use crate::common::supervisor::{self as suph, Cluster, sim_topology, text};
use crate::common::{TempDir, wait_until};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TOKEN: &str = "hf_pdctlTestTokenNeverInAPlan0123456789";
const DECODE_TOKEN: &str = "hf_pdctlDecodeOnlyToken9876543210";

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out
}

/// The environment of process `pid`, as `NAME=VALUE` entries.
fn environ(pid: u32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|b| *b == 0)
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect()
}

#[test]
fn a_hub_token_in_the_topology_reaches_the_engines_only() {
    let extra = format!(
        "[engine.env]\nHF_TOKEN = \"{TOKEN}\"\nOTHER = \"plain\"\n[decode.env]\nHUGGING_FACE_HUB_TOKEN = '{DECODE_TOKEN}'\n"
    );
    let (topology, _) = sim_topology("hubtoken", "nixl", 1, 1, &extra);
    let cluster = Cluster::new("hubtoken");
    let dir = TempDir::new("hubtoken-topo");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let f = file.to_str().unwrap();

    // The plan names the variables, never their values.
    for args in [vec!["plan", "-f", f], vec!["plan", "-f", f, "--json"]] {
        let out = cluster.run(&args);
        let shown = text(&out);
        assert!(out.status.success(), "{shown}");
        assert!(
            !shown.contains(TOKEN) && !shown.contains(DECODE_TOKEN),
            "{args:?}: {shown}"
        );
        assert!(shown.contains("HF_TOKEN"), "{args:?}: {shown}");
    }
    let out = cluster.run(&["plan", "-f", f]);
    let shown = text(&out);
    assert!(shown.contains("HF_TOKEN=\"$HF_TOKEN\""), "{shown}");
    assert!(shown.contains("OTHER=plain"), "{shown}");

    cluster.up_topology(dir.path(), &topology);
    let r = cluster.wait_status(Duration::from_secs(30), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    let env_of = |r: &pdctl::control::StatusReport, name: &str| {
        environ(suph::svc(r, name).pid.expect("the engine runs"))
    };
    let prefill = env_of(&r, "prefill-0");
    let decode = env_of(&r, "decode-0");
    assert!(
        prefill.contains(&format!("HF_TOKEN={TOKEN}")),
        "{prefill:?}"
    );
    assert!(prefill.contains(&"OTHER=plain".to_string()), "{prefill:?}");
    assert!(
        !prefill.iter().any(|e| e.contains(DECODE_TOKEN)),
        "the decode role's token reached prefill: {prefill:?}"
    );
    assert!(decode.contains(&format!("HF_TOKEN={TOKEN}")), "{decode:?}");
    assert!(
        decode.contains(&format!("HUGGING_FACE_HUB_TOKEN={DECODE_TOKEN}")),
        "{decode:?}"
    );
    let proxy = env_of(&r, "proxy");
    assert!(
        !proxy.iter().any(|e| e.contains(TOKEN)),
        "the proxy got the token: {proxy:?}"
    );

    // `scale` plans again from the kept topology: the new engine is started with it too.
    let out = cluster.run(&["scale", "decode=2"]);
    assert!(out.status.success(), "scale: {}", text(&out));
    let r = cluster.wait_status(Duration::from_secs(30), &[], |r| {
        suph::all_healthy(r) && r.services.iter().any(|s| s.name == "decode-1")
    });
    let decode1 = env_of(&r, "decode-1");
    assert!(
        decode1.contains(&format!("HF_TOKEN={TOKEN}")),
        "{decode1:?}"
    );
    assert!(
        decode1.contains(&format!("HUGGING_FACE_HUB_TOKEN={DECODE_TOKEN}")),
        "{decode1:?}"
    );

    // No file of the state dir holds a value, but the one private file the supervisor
    // reads them from.
    let mut private = 0;
    for path in files_under(cluster.root()) {
        let Ok(content) = std::fs::read(&path) else {
            continue;
        };
        let content = String::from_utf8_lossy(&content);
        if path.file_name().unwrap() == pdctl::control::hidden_env::HIDDEN_ENV_FILE {
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", path.display());
            assert!(content.contains(TOKEN), "{}", path.display());
            private += 1;
            continue;
        }
        assert!(
            !content.contains(TOKEN) && !content.contains(DECODE_TOKEN),
            "{} holds the token",
            path.display()
        );
    }
    assert_eq!(private, 1, "one private file of the values");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(wait_until(Duration::from_secs(10), || cluster
        .status(&[])
        .is_none()));
}
