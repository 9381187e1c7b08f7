//! `pdctl tune` on simulated engines: over a budget of 4 instances it picks the split the
//! simulator's own model predicts, more prefill for a long-prompt workload than for a
//! long-output one, moving between splits live with 0 failed requests, and leaves the
//! cluster where it found it (or on the best split with `--apply`).

use crate::common;
use crate::common::supervisor as suph;

use common::TempDir;
use pdctl::vocab::Role;
use serde_json::Value;
use std::time::Duration;
use suph::{Cluster, free_port_run, run_bounded, text};

/// The simulator's timing model as the test topology sets it.
struct SimModel {
    prefill_ms_per_token: f64,
    overhead_ms: f64,
    itl_ms: f64,
    batch_slowdown: f64,
    max_concurrent_prefills: u32,
}

const SIM: SimModel = SimModel {
    prefill_ms_per_token: 0.1,
    overhead_ms: 1.0,
    itl_ms: 5.0,
    batch_slowdown: 1.0,
    max_concurrent_prefills: 1,
};

/// A closed-loop workload: `concurrency` clients, each sending the next request when its
/// answer is complete.
struct Workload {
    input_len: u32,
    output_len: u32,
    concurrency: u32,
    prompts: u32,
}

/// Requests per second split (p, d) can serve, by the simulator's documented model and
/// nothing of tune's: a prefill instance computes `max_concurrent_prefills` prompts at a
/// time at `prefill_ms_per_token`, so it serves that many prompts per
/// `input_len * prefill_ms_per_token`; a decode instance running `b` sequences takes
/// `itl * (1 + slowdown * (b - 1))` per step and each answer needs `output_len - 1` steps
/// after its first token, with at most every client's sequence spread over the `d`
/// instances. The split serves what its slower stage serves.
fn capacity(sim: &SimModel, w: &Workload, p: u32, d: u32) -> f64 {
    let prefill_ms = w.input_len as f64 * sim.prefill_ms_per_token;
    let prefill = p as f64 * sim.max_concurrent_prefills as f64 * 1000.0 / prefill_ms;
    let batch = (w.concurrency as f64 / d as f64).max(1.0);
    let step = sim.itl_ms * (1.0 + sim.batch_slowdown * (batch - 1.0));
    let steps = (w.output_len - 1).max(1) as f64;
    let decode = d as f64 * batch * 1000.0 / (step * steps);
    prefill.min(decode)
}

/// The split the model predicts for a budget of `n` instances, after checking that it is
/// clear-cut (at least 1.3 times any other split's capacity), so a loaded machine cannot
/// blur it.
fn predicted(sim: &SimModel, w: &Workload, n: u32) -> (u32, u32) {
    let mut splits: Vec<((u32, u32), f64)> = (1..n)
        .map(|p| ((p, n - p), capacity(sim, w, p, n - p)))
        .collect();
    splits.sort_by(|a, b| b.1.total_cmp(&a.1));
    assert!(
        splits[0].1 >= 1.3 * splits[1].1,
        "the workload does not make one split clearly best: {splits:?}"
    );
    splits[0].0
}

fn topology(cluster: &str) -> String {
    let run = free_port_run(9);
    format!(
        "cluster = \"{cluster}\"\n\
         [model]\nname = \"sim-model\"\n\
         [engine]\nkind = \"sim\"\n\
         [engine.sim]\nprefill_ms_per_token = {}\noverhead_ms = {}\nitl_ms = {}\n\
         batch_slowdown = {}\nmax_concurrent_prefills = {}\nkv_load_ms_per_token = 0.0\n\
         [connector]\nkind = \"example\"\n\
         [prefill]\ninstances = 2\nbase_port = {run}\n\
         [decode]\ninstances = 2\nbase_port = {}\n\
         [proxy]\nport = {}\nprefill_policy = \"least-loaded\"\ndecode_policy = \"least-loaded\"\n",
        SIM.prefill_ms_per_token,
        SIM.overhead_ms,
        SIM.itl_ms,
        SIM.batch_slowdown,
        SIM.max_concurrent_prefills,
        run + 4,
        run + 8,
    )
}

/// `pdctl tune --budget 4` with the workload's flags; returns its JSON and stdout.
fn tune(
    cluster: &Cluster,
    dir: &TempDir,
    name: &str,
    w: &Workload,
    extra: &[&str],
) -> (Value, String) {
    let json = dir.path().join(format!("{name}.json"));
    let (input, output, conc, prompts) = (
        w.input_len.to_string(),
        w.output_len.to_string(),
        w.concurrency.to_string(),
        w.prompts.to_string(),
    );
    let mut args = vec![
        "tune",
        "--budget",
        "4",
        "--input-len",
        &input,
        "--output-len",
        &output,
        "--max-concurrency",
        &conc,
        "--num-prompts",
        &prompts,
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = run_bounded(cluster.command(&args), Duration::from_secs(400));
    assert!(out.status.success(), "tune {name}:\n{}", text(&out));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (v, String::from_utf8_lossy(&out.stdout).into_owned())
}

fn split(v: &Value) -> (u32, u32) {
    (
        v["prefill"].as_u64().unwrap() as u32,
        v["decode"].as_u64().unwrap() as u32,
    )
}

/// The running split and the proxy's pid.
fn running(cluster: &Cluster) -> ((u32, u32), Option<u32>) {
    let r = cluster.status(&[]).expect("the cluster runs");
    let count = |role| r.services.iter().filter(|s| s.role == role).count() as u32;
    let proxy = r
        .services
        .iter()
        .find(|s| s.role == Role::Proxy)
        .and_then(|s| s.pid);
    ((count(Role::Prefill), count(Role::Decode)), proxy)
}

/// Every split measured with every request completed.
fn assert_no_failures(v: &Value, prompts: u32) {
    let splits = v["splits"].as_array().unwrap();
    let measured: Vec<(u32, u32)> = splits.iter().map(split).collect();
    assert_eq!(measured, [(1, 3), (2, 2), (3, 1)], "{v}");
    for s in splits {
        assert_eq!(s["failed"], 0, "{s}");
        assert_eq!(s["completed"], prompts, "{s}");
    }
}

#[test]
fn tune_picks_the_split_the_sim_model_predicts() {
    let long_prompt = Workload {
        input_len: 1000,
        output_len: 2,
        concurrency: 6,
        prompts: 36,
    };
    let long_output = Workload {
        input_len: 32,
        output_len: 32,
        concurrency: 12,
        prompts: 36,
    };
    let want_prompt = predicted(&SIM, &long_prompt, 4);
    let want_output = predicted(&SIM, &long_output, 4);
    assert!(
        want_prompt.0 > want_output.0,
        "{want_prompt:?} {want_output:?}"
    );

    let cluster = Cluster::new("tune");
    let dir = TempDir::new("tune-topo");
    cluster.up_topology(dir.path(), &topology("tune-sim"));
    let (start, proxy_pid) = running(&cluster);
    assert_eq!(start, (2, 2));

    let plot = dir.path().join("prompt.svg");
    let (v, stdout) = tune(
        &cluster,
        &dir,
        "long-prompt",
        &long_prompt,
        &["--plot", plot.to_str().unwrap()],
    );
    assert_no_failures(&v, long_prompt.prompts);
    assert_eq!(
        split(&v["best"]),
        want_prompt,
        "long prompts:\n{stdout}\n{v}"
    );
    assert!(
        stdout.contains(&format!(
            "best split: {}P:{}D",
            want_prompt.0, want_prompt.1
        )),
        "{stdout}"
    );
    // Without --apply the cluster is back where it was, through the same proxy.
    assert_eq!(running(&cluster), (start, proxy_pid));
    let svg = std::fs::read_to_string(&plot).unwrap();
    let legend = common::svg::texts(&svg);
    for split in ["1P:3D", "3P:1D"] {
        assert!(
            legend.iter().any(|t| t.contains(split)),
            "{split}: {legend:?}"
        );
    }

    let (v, stdout) = tune(&cluster, &dir, "long-output", &long_output, &["--apply"]);
    assert_no_failures(&v, long_output.prompts);
    assert_eq!(
        split(&v["best"]),
        want_output,
        "long outputs:\n{stdout}\n{v}"
    );
    // --apply leaves the cluster on the best split, still through the same proxy.
    assert_eq!(running(&cluster), (want_output, proxy_pid));
    assert_eq!(split(&v["left_on"]), want_output);

    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn tune_refuses_a_budget_without_a_split_before_it_moves_anything() {
    let cluster = Cluster::new("tune-bad");
    let dir = TempDir::new("tune-bad-topo");
    cluster.up_topology(dir.path(), &topology("tune-bad"));
    let out = cluster.run(&["tune", "--budget", "1", "--num-prompts", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("a budget of 1 instance leaves no split"),
        "{}",
        text(&out)
    );
    let out = cluster.run(&["tune", "--gpu-budget", "4"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("hold no GPU"), "{}", text(&out));
    assert_eq!(running(&cluster).0, (2, 2));
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}
