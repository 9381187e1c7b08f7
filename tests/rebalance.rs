//! The split follows the traffic (`[rebalance]`): on a 2P2D sim cluster under a
//! long-prompt load whose TTFT misses its objective, `advise` says it would move a decode
//! to prefill and changes nothing; switched to `act` with `pdctl rebalance act`, it moves
//! one instance (2P2D -> 3P1D) through the same change `scale` makes, keeps the move's
//! record in the state dir and `status --json`, and the load has 0 failed requests.

mod common;
#[path = "common/supervisor.rs"]
mod suph;

use common::TempDir;
use pdctl::control::StatusReport;
use pdctl::vocab::{RebalanceMode, Role};
use serde_json::Value;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use suph::{Cluster, sim_topology, text};

/// Long prompts (1024 tokens at 0.5 ms each: about half a second of prefill apiece)
/// against a TTFT objective of 200 ms; the inter-token objective is met (the sim's
/// default 10 ms gaps).
const REBALANCE: &str = "[engine.sim]\nprefill_ms_per_token = 0.5\n\
    [rebalance]\nttft_p90_ms = 200\nitl_p90_ms = 1000\nwindow_s = 4\ncooldown_s = 60\nmode = \"advise\"\n";

fn long_prompt_load(port: u16, prompts: usize, json: &std::path::Path) -> Child {
    load(port, prompts, "1024", "8", json)
}

fn load(port: u16, prompts: usize, input: &str, output: &str, json: &std::path::Path) -> Child {
    let url = format!("http://127.0.0.1:{port}");
    let prompts = prompts.to_string();
    common::pdctl(&[
        "bench",
        "--url",
        &url,
        "--num-prompts",
        &prompts,
        "--max-concurrency",
        "8",
        "--input-len",
        input,
        "--output-len",
        output,
        "--json",
        json.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

fn count(r: &StatusReport, role: Role) -> usize {
    r.services.iter().filter(|s| s.role == role).count()
}

/// Polls `status --json` until `check` holds on it (panics with the last one after
/// `limit`).
fn wait_for(
    cluster: &Cluster,
    limit: Duration,
    check: impl Fn(&StatusReport) -> bool,
) -> StatusReport {
    let start = Instant::now();
    loop {
        let r = cluster.status(&[]).expect("the cluster runs");
        if check(&r) {
            return r;
        }
        assert!(
            start.elapsed() < limit,
            "not within {limit:?}; the last status: {}",
            serde_json::to_string_pretty(&r).unwrap()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The `rebalance` line of `pdctl status`, for the test's log.
fn shown_line(cluster: &Cluster) -> String {
    let shown = text(&cluster.run(&["status"]));
    shown
        .lines()
        .find(|l| l.starts_with("rebalance"))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn advise_says_what_it_would_move_and_act_moves_one_instance_with_nothing_failed() {
    // Ports laid out for 4 prefill instances, 2 of them started: room to grow to 3.
    let (topology, port) = sim_topology("rebal", "nixl", 4, 2, REBALANCE);
    let topology = topology.replace("[prefill]\ninstances = 4\n", "[prefill]\ninstances = 2\n");
    assert!(
        topology.contains("[prefill]\ninstances = 2\n"),
        "{topology}"
    );
    let cluster = Cluster::new("rebal");
    let dir = TempDir::new("rebal-topo");
    cluster.up_topology(dir.path(), &topology);

    let r = cluster.status(&[]).unwrap();
    let rb = r.rebalance.as_ref().expect("status --json has `rebalance`");
    assert_eq!(rb.mode, RebalanceMode::Advise);

    let json = dir.path().join("bench.json");
    let load = long_prompt_load(port, 400, &json);
    // Advise: within two windows (and the first looks) it says what it would do...
    let r = wait_for(&cluster, Duration::from_secs(40), |r| {
        r.rebalance
            .as_ref()
            .is_some_and(|b| b.verdict.starts_with("would move 2P2D -> 3P1D: TTFT p90"))
    });
    let rb = r.rebalance.as_ref().unwrap();
    eprintln!("advise: {}", shown_line(&cluster));
    assert!(rb.figures.ttft_p90_ms.unwrap() > 200.0, "{rb:?}");
    assert!(rb.figures.requests > 0, "{rb:?}");
    // The decode engines' inter-token histogram is read too (met here).
    assert!(rb.figures.itl_p90_ms.is_some_and(|v| v < 1000.0), "{rb:?}");
    // ...and changes nothing.
    assert_eq!((count(&r, Role::Prefill), count(&r, Role::Decode)), (2, 2));
    assert_eq!(rb.moves_total, 0);
    let shown = text(&cluster.run(&["status"]));
    assert!(
        shown.contains("rebalance (advise, 2P2D over") && shown.contains("would move 2P2D -> 3P1D"),
        "{shown}"
    );
    std::thread::sleep(Duration::from_secs(5));
    let r = cluster.status(&[]).unwrap();
    assert_eq!(
        (count(&r, Role::Prefill), count(&r, Role::Decode)),
        (2, 2),
        "advise moved"
    );

    // Act, switched at run time: one decode becomes a prefill, through a scale change.
    let out = cluster.run(&["rebalance", "act"]);
    assert!(
        out.status.success() && text(&out).contains("mode act (was advise)"),
        "{}",
        text(&out)
    );
    let r = wait_for(&cluster, Duration::from_secs(90), |r| {
        r.rebalance.as_ref().is_some_and(|b| b.moves_total == 1)
    });
    let rb = r.rebalance.as_ref().unwrap();
    let record = &rb.moves[rb.moves.len() - 1];
    eprintln!("act: {}", serde_json::to_string(record).unwrap());
    assert_eq!(
        (record.from.to_string(), record.to.to_string()),
        ("2P2D".into(), "3P1D".into())
    );
    assert!(
        record
            .outcome
            .as_deref()
            .unwrap_or_default()
            .starts_with("done (0)"),
        "{record:?}"
    );
    assert!(record.figures.ttft_p90_ms.unwrap() > 200.0, "{record:?}");
    assert_eq!((count(&r, Role::Prefill), count(&r, Role::Decode)), (3, 1));
    assert!(
        r.operation
            .as_ref()
            .unwrap()
            .what
            .starts_with("scale prefill=3 decode=1"),
        "{:?}",
        r.operation
    );
    // The record stays in the state dir.
    let kept =
        std::fs::read_to_string(cluster.root().join("rebal").join("rebalance.jsonl")).unwrap();
    assert_eq!(kept.lines().count(), 1, "{kept}");
    // min_decode = 1 holds: no second move toward prefill.
    let out = cluster.run(&["rebalance", "off"]);
    assert!(out.status.success(), "{}", text(&out));

    let out = load.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["failed"].as_u64(), Some(0), "{v}");
    assert!(v["completed"].as_u64().unwrap() > 0, "{v}");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// Long outputs against a tight inter-token objective (the sim's 10 ms gaps, slower in
/// a batch, over 15 ms): advise would move a prefill to decode, and says so; `apply` of
/// the topology with a looser objective is taken in place and the verdict follows.
#[test]
fn advise_under_long_outputs_would_move_toward_decode() {
    let extra =
        "[rebalance]\nttft_p90_ms = 5000\nitl_p90_ms = 15\nwindow_s = 3\nmode = \"advise\"\n";
    let (topology, port) = sim_topology("rebal-itl", "nixl", 2, 2, extra);
    let cluster = Cluster::new("rebal-itl");
    let dir = TempDir::new("rebal-itl-topo");
    cluster.up_topology(dir.path(), &topology);
    let json = dir.path().join("bench.json");
    let load = load(port, 80, "32", "256", &json);
    let r = wait_for(&cluster, Duration::from_secs(40), |r| {
        r.rebalance
            .as_ref()
            .is_some_and(|b| b.verdict.starts_with("would move 2P2D -> 1P3D: ITL p90"))
    });
    let rb = r.rebalance.as_ref().unwrap();
    eprintln!("advise: {}", shown_line(&cluster));
    assert!(rb.figures.itl_p90_ms.unwrap() > 15.0, "{rb:?}");
    assert_eq!((count(&r, Role::Prefill), count(&r, Role::Decode)), (2, 2));
    assert_eq!(rb.moves_total, 0);
    // `apply` takes a changed table in place: a looser ITL objective is met.
    let file = dir.path().join("looser.toml");
    std::fs::write(
        &file,
        topology.replace("itl_p90_ms = 15", "itl_p90_ms = 1000"),
    )
    .unwrap();
    let out = cluster.run(&["apply", "-f", file.to_str().unwrap()]);
    assert!(
        out.status.success() && text(&out).contains("the [rebalance] table is kept"),
        "{}",
        text(&out)
    );
    let r = wait_for(&cluster, Duration::from_secs(30), |r| {
        r.rebalance
            .as_ref()
            .is_some_and(|b| b.verdict.starts_with("objectives met"))
    });
    eprintln!("after apply: {}", r.rebalance.as_ref().unwrap().verdict);
    let out = load.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// Act, following a shift and back: long prompts move 2P2D toward prefill (3P1D); then
/// long outputs, once the cool-down has passed, move it back toward decode; 0 failed
/// requests in either load.
#[test]
fn act_follows_a_shift_to_long_prompts_and_back_with_nothing_failed() {
    let extra = "[engine.sim]\nprefill_ms_per_token = 0.5\n\
        [rebalance]\nttft_p90_ms = 200\nitl_p90_ms = 15\nwindow_s = 3\ncooldown_s = 8\nmode = \"act\"\n";
    let (topology, port) = sim_topology("rebal-act", "nixl", 4, 4, extra);
    let topology = topology
        .replace("[prefill]\ninstances = 4\n", "[prefill]\ninstances = 2\n")
        .replace("[decode]\ninstances = 4\n", "[decode]\ninstances = 2\n");
    let cluster = Cluster::new("rebal-act");
    let dir = TempDir::new("rebal-act-topo");
    cluster.up_topology(dir.path(), &topology);

    let prompts_json = dir.path().join("prompts.json");
    let prompts = long_prompt_load(port, 200, &prompts_json);
    let r = wait_for(&cluster, Duration::from_secs(60), |r| {
        r.rebalance.as_ref().is_some_and(|b| b.moves_total >= 1)
    });
    let first = r.rebalance.as_ref().unwrap().moves[0].clone();
    eprintln!("first: {}", serde_json::to_string(&first).unwrap());
    assert_eq!(
        (first.from.to_string(), first.to.to_string()),
        ("2P2D".into(), "3P1D".into())
    );
    assert!(
        first
            .outcome
            .as_deref()
            .unwrap_or_default()
            .starts_with("done (0)"),
        "{first:?}"
    );
    assert!(first.reason.starts_with("TTFT p90"), "{first:?}");
    let out = prompts.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&prompts_json).unwrap()).unwrap();
    assert_eq!(v["failed"].as_u64(), Some(0), "long prompts: {v}");

    let outputs_json = dir.path().join("outputs.json");
    let outputs = load(port, 96, "32", "256", &outputs_json);
    let r = wait_for(&cluster, Duration::from_secs(60), |r| {
        r.rebalance.as_ref().is_some_and(|b| b.moves_total >= 2)
    });
    let rb = r.rebalance.as_ref().unwrap();
    let back = rb.moves[1].clone();
    eprintln!("back: {}", serde_json::to_string(&back).unwrap());
    assert_eq!(
        (back.from.to_string(), back.to.to_string()),
        ("3P1D".into(), "2P2D".into())
    );
    assert!(back.reason.starts_with("ITL p90"), "{back:?}");
    assert!(
        back.outcome
            .as_deref()
            .unwrap_or_default()
            .starts_with("done (0)"),
        "{back:?}"
    );
    // The move back waited out the cool-down after the first.
    assert!(back.at_ms - first.at_ms >= 8_000, "{first:?} {back:?}");
    let out = cluster.run(&["rebalance", "off"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = outputs.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&outputs_json).unwrap()).unwrap();
    assert_eq!(v["failed"].as_u64(), Some(0), "long outputs: {v}");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}
