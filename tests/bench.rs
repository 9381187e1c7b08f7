//! `pdctl bench` against simulated engines with known latencies: the figures it reports
//! must be the ones the simulator was configured with, its files must be usable, and bad
//! arguments must get clear errors.

use crate::common;
use crate::common::sim as simh;

use common::{TempDir, pdctl};
use serde_json::Value;
use simh::SimProc;

fn bench(args: &[&str]) -> std::process::Output {
    pdctl(&["bench"])
        .args(args)
        .output()
        .expect("run pdctl bench")
}

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("bench wrote its JSON")).unwrap()
}

/// TTFT is overhead + prompt tokens x prefill cost, TPOT is the inter-token latency: the
/// benchmark must report what the simulator was told to do (lower bounds tight, upper
/// bounds loose: a shared machine only ever makes things slower).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn figures_match_the_configured_latencies() {
    let sim = SimProc::timed("0.5", "5", "8", &["--batch-slowdown", "0"]).await;
    let dir = TempDir::new("bench-lat");
    let json = dir.path().join("run.json");
    let out = bench(&[
        "--url",
        &sim.base,
        "--model",
        "sim-model",
        "--input-len",
        "200",
        "--output-len",
        "20",
        "--num-prompts",
        "8",
        "--max-concurrency",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = read_json(&json);
    assert_eq!(r["completed"], 8);
    assert_eq!(r["failed"], 0);
    // What was run, at the top level as `vllm bench serve` writes it.
    assert_eq!(r["model"], "sim-model");
    assert_eq!(r["max_concurrency"], 1);
    assert_eq!(r["url"], sim.base.as_str());
    assert!(r["label"].as_str().is_some_and(|l| !l.is_empty()), "{r}");
    assert_eq!(r["total_output_tokens"], 8 * 20);
    let input = r["total_input_tokens"].as_u64().unwrap();
    assert!((8 * 200..=8 * 202).contains(&input), "input tokens {input}");
    let ttft = r["median_ttft_ms"].as_f64().unwrap();
    let expected = 5.0 + 200.0 * 0.5;
    assert!(
        ttft >= expected * 0.95 && ttft <= expected + 80.0,
        "median TTFT {ttft} ms, expected ~{expected}"
    );
    let tpot = r["median_tpot_ms"].as_f64().unwrap();
    assert!(
        (7.6..=16.0).contains(&tpot),
        "median TPOT {tpot} ms, expected ~8"
    );
    let itl = r["median_itl_ms"].as_f64().unwrap();
    assert!(
        (7.6..=16.0).contains(&itl),
        "median ITL {itl} ms, expected ~8"
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("Median TTFT (ms):") && table.contains("Successful requests:"),
        "{table}"
    );
    // One stream at a time over kept-alive connections: the TTFT above is the engine's,
    // not eight TCP handshakes, and the engine saw no client hang up after [DONE].
    let conns = sim.metric("pdctl_sim_connections_accepted_total").await;
    assert!(
        (1.0..=4.0).contains(&conns),
        "{conns} connections for 8 sequential requests (+ probes, + this scrape)"
    );
    assert_eq!(sim.metric("pdctl_sim_requests_aborted_total").await, 0.0);
}

/// Repeating one context on one engine: the cache figures come from the engine's /metrics
/// deltas, and a per-request rate at a fixed request rate is honoured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_dataset_reads_the_engines_hit_rate() {
    let sim = SimProc::timed("0", "0", "0", &[]).await;
    let dir = TempDir::new("bench-prefix");
    let json = dir.path().join("p.json");
    let out = bench(&[
        "--url",
        &sim.base,
        "--dataset",
        "prefix",
        "--prefix-groups",
        "1",
        "--prefix-len",
        "320",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-prompts",
        "20",
        "--request-rate",
        "200",
        "--prefill",
        &sim.base,
        // An engine that does not answer: left out of the figures, and said so.
        "--decode",
        "127.0.0.1:9",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot read http://127.0.0.1:9/metrics"),
        "{stderr}"
    );
    let r = read_json(&json);
    assert_eq!(r["completed"], 20);
    assert_eq!(r["prefix_cache"].as_array().unwrap().len(), 1);
    let rate = r["prefix_cache_hit_rate"]
        .as_f64()
        .expect("hit rate known when an engine is given");
    // 19 of 20 requests find the 320-token context (20 blocks) cached: well above 80 %.
    assert!(rate > 0.8, "hit rate {rate}");
    assert_eq!(r["prefix_cache"][0]["instance"], sim.base);
    // Poisson arrivals at 200/s: 20 requests take about 0.1 s, not 0.
    let d = r["duration"].as_f64().unwrap();
    assert!(d > 0.03, "duration {d}");
}

/// ShareGPT: the first human turn is the prompt, the reply's length caps the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_files_drive_the_run() {
    let sim = SimProc::timed("0", "0", "0", &[]).await;
    let dir = TempDir::new("bench-sharegpt");
    let data = dir.path().join("sharegpt.json");
    // A reply longer than the random datasets' default output length (64).
    let long_reply = vec!["word"; 70].join(" ");
    std::fs::write(
        &data,
        format!(
            r#"[{{"id":"1","conversations":[{{"from":"human","value":"Tell me about the absolute legend Roger Federer"}},{{"from":"gpt","value":"one two three four five six"}}]}},
            {{"id":"2","conversations":[{{"from":"system","value":"be brief"}},{{"from":"human","value":"San Francisco is a city in California"}},{{"from":"gpt","value":"{long_reply}"}}]}},
            {{"id":"3","conversations":[{{"from":"human","value":"too short"}}]}}]"#
        ),
    )
    .unwrap();
    let json = dir.path().join("s.json");
    let out = bench(&[
        "--url",
        &sim.base,
        "--dataset",
        "sharegpt",
        "--dataset-path",
        data.to_str().unwrap(),
        "--num-prompts",
        "4",
        "--endpoint",
        "chat",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = read_json(&json);
    assert_eq!(r["completed"], 4);
    // Two usable conversations, used twice each: replies of 6 and 70 words, whole.
    assert_eq!(r["total_output_tokens"], 2 * (6 + 70));
    assert_eq!(r["endpoint"], "chat");

    // --output-len caps each reply.
    let out = bench(&[
        "--url",
        &sim.base,
        "--dataset",
        "sharegpt",
        "--dataset-path",
        data.to_str().unwrap(),
        "--num-prompts",
        "4",
        "--output-len",
        "8",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read_json(&json)["total_output_tokens"], 2 * (6 + 8));
}

/// --json results compare side by side and plot as an SVG with both runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_compare_and_plot() {
    let fast = SimProc::timed("0", "0", "1", &[]).await;
    let slow = SimProc::timed("0", "200", "1", &[]).await;
    let dir = TempDir::new("bench-cmp");
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    for (sim, file, label) in [(&fast, &a, "fast"), (&slow, &b, "slow")] {
        let out = bench(&[
            "--url",
            &sim.base,
            "--num-prompts",
            "6",
            "--output-len",
            "4",
            "--input-len",
            "16",
            "--label",
            label,
            "--json",
            file.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let svg = dir.path().join("cmp.svg");
    let out = bench(&[
        "--compare",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    let header = table.lines().next().unwrap();
    assert!(
        header.contains("fast") && header.contains("slow") && header.contains("B/A"),
        "{table}"
    );
    let ttft_row = table
        .lines()
        .find(|l| l.starts_with("median TTFT"))
        .unwrap();
    let ratio: f64 = ttft_row.split_whitespace().last().unwrap().parse().unwrap();
    assert!(
        ratio > 2.0,
        "the slow run's TTFT should be several times the fast one's: {ttft_row}"
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg"));
    use pdctl::pictures::latency::{LINE_WIDTH, RUN_COLORS};
    for color in &RUN_COLORS[..2] {
        let lines = common::svg::polylines(&svg, color, LINE_WIDTH);
        // Six requests: a step line of 12 corners, in each of the two panels.
        let corners: Vec<usize> = lines.iter().map(Vec::len).collect();
        assert_eq!(corners, [12, 12], "two panels, one line each, for {color}");
    }
    let texts = common::svg::texts(&svg);
    assert!(
        texts.iter().any(|t| t == "Time to first token (CDF)"),
        "{texts:?}"
    );
    for run in ["fast: median TTFT", "slow: median TTFT"] {
        assert!(texts.iter().any(|t| t.starts_with(run)), "{run}: {texts:?}");
    }
}

/// Errors say what is wrong and exit 2 (bad input) or 1 (the server failed every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_urls_get_clear_errors() {
    let cases: [(&[&str], &str); 7] = [
        (&["--url", "localhost:8000"], "needs http://HOST:PORT"),
        (
            &["--url", "http://127.0.0.1:9", "--max-concurrency", "0"],
            "--max-concurrency 0",
        ),
        (
            &["--url", "http://127.0.0.1:9", "--request-rate", "0"],
            "--request-rate 0",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--dataset",
                "sharegpt",
            ],
            "--dataset-path",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--dataset",
                "prefix",
                "--strategy",
                "rr",
            ],
            "--prefill and --decode",
        ),
        (
            &["--compare", "/nonexistent/a.json", "/nonexistent/b.json"],
            "cannot read /nonexistent/a.json",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--prefill",
                "127.0.0.1:8100/v1",
            ],
            "--prefill 127.0.0.1:8100/v1: \"127.0.0.1:8100/v1\" has a path",
        ),
    ];
    for (args, needle) in cases {
        let out = bench(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: wanted {needle:?} in {err}");
    }
    let dir = TempDir::new("bench-none");
    let out = pdctl(&["bench", "--num-prompts", "1"])
        .env("PDCTL_STATE_DIR", dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no pdctl cluster is running"));
    // A server that answers nothing: no model to ask, a clear error naming the URL.
    let out = bench(&["--url", "http://127.0.0.1:9", "--num-prompts", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach http://127.0.0.1:9/v1/models")
    );
    // Every request failing is reported per error and exits 1.
    let sim = SimProc::start(&[]).await;
    let out = bench(&[
        "--url",
        &sim.base,
        "--model",
        "no-such-model",
        "--num-prompts",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("3 x HTTP 404"), "{table}");
}
