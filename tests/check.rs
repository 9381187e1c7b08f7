//! `pdctl check` on simulated engines: every pair's probe hands its KV over (exit 0); a
//! decode told to lose its next handoffs makes it exit 1 naming the pair; behind a client
//! key (`PDCTL_API_KEY`) it still passes and reports the model; each pair's sizes are
//! reported, and an engine running other sizes than its plan fails its pair; `up`'s pre-flight
//! refuses a pair whose block sizes differ, naming both sides.

use crate::common;
use crate::common::supervisor as suph;

use common::TempDir;
use std::time::Duration;
use suph::{Cluster, free_port_run, text};

fn topology(cluster: &str, prefill_args: &str) -> (String, u16) {
    let run = free_port_run(6);
    let text = format!(
        "cluster = \"{cluster}\"\n\
         [model]\nname = \"sim-model\"\n\
         [engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"example\"\n\
         [prefill]\ninstances = 1\nbase_port = {run}\n{prefill_args}\n\
         [decode]\ninstances = 2\nbase_port = {}\n\
         [proxy]\nport = {}\n",
        run + 2,
        run + 5,
    );
    (text, run + 2)
}

#[test]
fn check_proves_each_pair_and_names_the_one_that_lost_its_kv() {
    let cluster = Cluster::new("check");
    let dir = TempDir::new("check-topo");
    let (topo, decode0) = topology("check-sim", "");
    cluster.up_topology(dir.path(), &topo);

    let out = cluster.run(&["check"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    for pair in ["prefill-0 -> decode-0", "prefill-0 -> decode-1"] {
        let line = all
            .lines()
            .find(|l| l.starts_with(pair))
            .unwrap_or_else(|| panic!("no line for {pair}:\n{all}"));
        assert!(line.contains("moved"), "{line}");
    }
    assert!(all.contains("simulated shared-dir handoff"), "{all}");
    assert!(all.contains("every pair moved its KV (2 of 2)"), "{all}");
    // Each pair's sizes as the engines answer them (TP as planned: vLLM reports none).
    assert!(
        all.contains(
            "    sizes: prefill-0 TP 1 (planned), KV block 16, context 8192, KV dtype auto; decode-0 TP 1 (planned), KV block 16, context 8192, KV dtype auto"
        ),
        "{all}"
    );

    // decode-0 loses its next handoffs: it answers, but computes the prompt itself.
    // The engines answer only the cluster's engine key.
    let key = cluster.engine_key();
    let status = suph::post_json_with_key(
        decode0,
        "/sim/fault",
        r#"{"fail_handoff_next": 5}"#,
        Some(&key),
    );
    assert_eq!(status, 200);
    let out = cluster.run(&["check"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let bad = all
        .lines()
        .find(|l| l.starts_with("prefill-0 -> decode-0"))
        .unwrap();
    assert!(bad.contains("NOT"), "{all}");
    assert!(all.contains("the KV did NOT move: decode-0"), "{all}");
    assert!(
        all.contains("1 of 2 pairs did NOT move their KV: prefill-0 -> decode-0"),
        "{all}"
    );
    let good = all
        .lines()
        .find(|l| l.starts_with("prefill-0 -> decode-1"))
        .unwrap();
    assert!(good.contains("moved"), "{all}");

    // The plan now says decode-1 has KV blocks of 32 (as a plan whose engine was started
    // by hand with other settings would): check fails that pair, naming what differs.
    let plan_path = cluster.root().join("check-sim/plan.json");
    let mut plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plan_path).unwrap()).unwrap();
    let set = set_key(&mut plan["settings"]["decode-1"], "block_size", 32.into());
    assert!(
        set,
        "no block_size in decode-1's settings: {}",
        plan["settings"]
    );
    std::fs::write(&plan_path, serde_json::to_vec_pretty(&plan).unwrap()).unwrap();
    let out = cluster.run(&["check"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("    not as planned: decode-1 runs with KV block size 16, the plan says 32"),
        "{all}"
    );
    assert!(all.contains("prefill-0 -> decode-1"), "{all}");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// Sets every `key` inside `v` to `to`; false when there is none.
fn set_key(v: &mut serde_json::Value, key: &str, to: serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(m) => {
            let mut found = false;
            for (k, x) in m.iter_mut() {
                if k == key {
                    *x = to.clone();
                    found = true;
                } else {
                    found |= set_key(x, key, to.clone());
                }
            }
            found
        }
        serde_json::Value::Array(a) => {
            let mut found = false;
            for x in a.iter_mut() {
                found |= set_key(x, key, to.clone());
            }
            found
        }
        _ => false,
    }
}

#[test]
fn check_behind_the_client_and_engine_keys_passes_and_reports_the_model() {
    let cluster = Cluster::new("check-key");
    let dir = TempDir::new("check-key-topo");
    let (topo, _) = topology("check-key", "");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, topo).unwrap();
    const KEY: &str = "client-key-of-the-check-test";
    let keyed = |args: &[&str]| {
        let mut cmd = cluster.command(args);
        cmd.env("PDCTL_API_KEY", KEY);
        suph::run_bounded(cmd, Duration::from_secs(60))
    };
    let out = keyed(&["up", "-d", "-f", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));

    let out = keyed(&["check"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(
        all.contains("model (as the proxy lists it): sim-model"),
        "{all}"
    );
    for pair in ["prefill-0 -> decode-0", "prefill-0 -> decode-1"] {
        let line = all.lines().find(|l| l.starts_with(pair)).unwrap();
        assert!(
            line.contains("moved") && line.ends_with("sim-model"),
            "{line}"
        );
    }
    assert!(!all.contains("cannot compare the models"), "{all}");
    // Without the client key the proxy refuses check's requests: it fails, saying so.
    let out = cluster.run(&["check"]);
    let all = text(&out);
    assert_ne!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("401"), "{all}");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn up_refuses_a_pair_whose_block_sizes_differ() {
    let cluster = Cluster::new("check-pre");
    let dir = TempDir::new("check-pre-topo");
    let (topo, _) = topology("check-pre", "args = [\"--block-size\", \"32\"]");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, topo).unwrap();
    let out = suph::run_bounded(
        cluster.command(&["up", "-d", "-f", file.to_str().unwrap()]),
        Duration::from_secs(60),
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(
        all.contains(
            "prefill-0 (KV block size 32) and decode-0 (KV block size 16) differ in KV block size"
        ),
        "{all}"
    );
    assert!(cluster.status(&[]).is_none(), "nothing may start");
}
