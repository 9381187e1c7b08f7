//! Changing a running cluster while it serves: `pdctl restart --drain` and `--rolling`
//! under continuous load from `pdctl bench`, with 0 failed requests.

mod common;
#[path = "common/supervisor.rs"]
mod suph;

use common::TempDir;
use pdctl::control::ServiceState;
use serde_json::Value;
use std::process::{Child, Stdio};
use std::time::Duration;
use suph::{Cluster, sim_topology, text};

/// `pdctl bench` against the proxy, 16 streams at a time, its JSON written to `json`.
fn bench(port: u16, prompts: usize, json: &std::path::Path) -> Child {
    common::pdctl(&[
        "bench",
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--num-prompts",
        &prompts.to_string(),
        "--max-concurrency",
        "16",
        "--input-len",
        "32",
        "--output-len",
        "32",
        "--json",
        json.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// The bench's result: (completed, failed).
fn finished(child: Child, json: &std::path::Path) -> (u64, u64) {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (
        v["completed"].as_u64().unwrap(),
        v["failed"].as_u64().unwrap(),
    )
}

/// A rolling restart of 4 decode instances while 16 streams run: every instance restarted
/// once and healthy, and the bench has 0 failed requests.
#[test]
fn a_rolling_restart_of_decode_under_load_fails_no_request() {
    let (t, port) = sim_topology("o-roll", "nixl", 1, 4, "[engine.sim]\nitl_ms = 4.0\n");
    let cluster = Cluster::new("oroll");
    let dir = TempDir::new("oroll-topo");
    cluster.up_topology(dir.path(), &t);
    let json = dir.path().join("bench.json");
    let load = bench(port, 1200, &json);
    std::thread::sleep(Duration::from_millis(800));
    let out = cluster.run(&["restart", "--rolling", "decode"]);
    assert!(out.status.success(), "{}", text(&out));
    for i in 0..4 {
        assert!(
            text(&out).contains(&format!("decode-{i} restarted after draining")),
            "{}",
            text(&out)
        );
    }
    let (completed, failed) = finished(load, &json);
    let report = cluster.status(&[]).unwrap();
    for i in 0..4 {
        let d = suph::svc(&report, &format!("decode-{i}"));
        assert_eq!(
            (d.restarts, d.state),
            (1, ServiceState::Healthy),
            "{report:?}"
        );
    }
    assert_eq!((completed, failed), (1200, 0));
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The only decode instance restarted with --drain while streams run: new requests wait
/// in the proxy while it restarts instead of failing; status shows `draining` meanwhile.
#[test]
fn draining_the_only_decode_instance_fails_no_request() {
    let (t, port) = sim_topology("o-drain", "example", 1, 1, "[engine.sim]\nitl_ms = 4.0\n");
    let cluster = Cluster::new("odrain");
    let dir = TempDir::new("odrain-topo");
    cluster.up_topology(dir.path(), &t);
    let json = dir.path().join("bench.json");
    let load = bench(port, 400, &json);
    std::thread::sleep(Duration::from_millis(500));
    let restart = cluster
        .command(&["restart", "--drain", "decode-0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen_draining = false;
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while !seen_draining && std::time::Instant::now() < end {
        seen_draining = cluster
            .status(&[])
            .is_some_and(|r| suph::svc(&r, "decode-0").state == ServiceState::Draining);
    }
    let out = restart.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(seen_draining, "status never showed decode-0 draining");
    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (400, 0));
    let d = suph::svc(&cluster.status(&[]).unwrap(), "decode-0").clone();
    assert_eq!((d.restarts, d.state), (1, ServiceState::Healthy));
    // --rolling is for roles.
    let out = cluster.run(&["restart", "--rolling", "decode-0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--rolling takes roles"),
        "{}",
        text(&out)
    );
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}
