//! Whole clusters through `pdctl up`: the planner, the supervisor, the simulated engines
//! and the embedded proxy together, as a user runs them. Each protocol against the
//! simulator's matching KV handoff; then a 4P4D sim with real etcd and mooncake_master for
//! designation, policies, failures, disconnects, limits and the benchmark's strategies.

use crate::common;
use crate::common::supervisor as suph;

use common::{TempDir, eventually};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use suph::{Cluster, sim_topology, text};

/// A running cluster brought up with `pdctl up -d -f`, taken down on drop.
struct Up {
    cluster: Cluster,
    _dir: TempDir,
    proxy: String,
    report: pdctl::control::StatusReport,
}

impl Up {
    fn start(tag: &str, topology_text: &str, proxy_port: u16) -> Up {
        let cluster = Cluster::new(tag);
        let dir = TempDir::new(tag);
        let file = dir.path().join("topology.toml");
        std::fs::write(&file, topology_text).unwrap();
        let out = cluster.run(&["up", "-d", "-f", file.to_str().unwrap()]);
        assert!(out.status.success(), "up -d failed:\n{}", text(&out));
        let report = cluster.status(&[]).expect("status after up");
        assert!(suph::all_healthy(&report), "not all healthy: {report:?}");
        Up {
            cluster,
            _dir: dir,
            proxy: format!("http://127.0.0.1:{proxy_port}"),
            report,
        }
    }

    fn urls(&self, role: pdctl::vocab::Role) -> Vec<String> {
        self.report
            .services
            .iter()
            .filter(|s| s.role == role)
            .map(|s| s.url.clone().unwrap())
            .collect()
    }

    fn pid(&self, name: &str) -> i32 {
        suph::svc(&self.cluster.status(&[]).unwrap(), name)
            .pid
            .unwrap() as i32
    }

    fn down(&self) {
        let out = self.cluster.run(&["down"]);
        assert!(out.status.success(), "down failed:\n{}", text(&out));
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.cluster.run(&["down", "-t", "5"]);
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn metric(base: &str, name: &str) -> f64 {
    let text = common::get_text(&format!("{base}/metrics")).await;
    pdctl::prometheus::sum(&text, &[name]).unwrap_or_else(|| panic!("{base} has no {name}"))
}

async fn post(url: &str, body: &Value) -> (u16, String, String) {
    let r = client().post(url).json(body).send().await.expect("request");
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, ctype, r.text().await.unwrap())
}

fn long_prompt(tag: &str) -> String {
    (0..200)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Completions and chat, whole and streamed, through the proxy; the decode engine must
/// report every one as a KV handoff received (not a recompute).
/// Brings up 1P1D sim cluster `cluster` with `connector` and checks that four requests
/// all hand their KV over (see [`four_requests_all_hand_off`]).
async fn hand_off_on_1p1d(cluster: &str, connector: &str, tag: &str) -> Up {
    let (t, port) = sim_topology(cluster, connector, 1, 1, "");
    let up = Up::start(tag, &t, port);
    four_requests_all_hand_off(&up).await;
    up
}

async fn four_requests_all_hand_off(up: &Up) {
    let decode = &up.urls(pdctl::vocab::Role::Decode)[0];
    let received0 = metric(decode, "pdctl_sim_kv_handoffs_received_total").await;
    let missed0 = metric(decode, "pdctl_sim_kv_handoffs_missed_total").await;
    let completions = format!("{}/v1/completions", up.proxy);
    let chat = format!("{}/v1/chat/completions", up.proxy);
    let p = long_prompt("w");
    let (s, ct, body) = post(
        &completions,
        &json!({"model": "sim-model", "prompt": p, "max_tokens": 8}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(ct.starts_with("application/json"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    // The answer through PD equals the answer of one engine doing both (deterministic sim),
    // asked straight with the cluster's engine key.
    let direct = format!("{}/v1/completions", up.urls(pdctl::vocab::Role::Prefill)[0]);
    let alone: Value = client()
        .post(&direct)
        .bearer_auth(up.cluster.engine_key())
        .json(&json!({"model": "sim-model", "prompt": p, "max_tokens": 8}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["text"], alone["choices"][0]["text"]);
    let (s, ct, body) = post(
        &completions,
        &json!({"model": "sim-model", "prompt": long_prompt("s"), "max_tokens": 8, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(body.contains("\"completion_tokens\":8"), "{body}");
    let msgs = json!([{"role": "user", "content": long_prompt("c")}]);
    let (s, _, body) = post(
        &chat,
        &json!({"model": "sim-model", "messages": msgs, "max_tokens": 5}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(common::chat_text(&v).len() > 3, "{v}");
    let msgs = json!([{"role": "user", "content": long_prompt("d")}]);
    let (s, ct, body) = post(
        &chat,
        &json!({"model": "sim-model", "messages": msgs, "max_tokens": 5, "stream": true}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(
        ct.starts_with("text/event-stream") && body.contains("\"delta\""),
        "{body}"
    );
    let received = metric(decode, "pdctl_sim_kv_handoffs_received_total").await - received0;
    let missed = metric(decode, "pdctl_sim_kv_handoffs_missed_total").await - missed0;
    assert_eq!(
        (received, missed),
        (4.0, 0.0),
        "decode recomputed instead of receiving KV"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_step_protocol_hands_kv_over_through_a_shared_directory() {
    let up = hand_off_on_1p1d("c-two-step", "example", "c2s").await;
    // `pdctl restart ROLE` restarts every instance of it; they come back healthy.
    let out = up.cluster.run(&["restart", "decode"]);
    assert!(out.status.success(), "{}", text(&out));
    let r = up.cluster.wait_status(Duration::from_secs(20), &[], |r| {
        let d = suph::svc(r, "decode-0");
        d.restarts >= 1 && d.state == pdctl::control::ServiceState::Healthy
    });
    assert_eq!(suph::svc(&r, "decode-0").restarts, 1, "{r:?}");
    let out = up.cluster.run(&["restart", "decoder"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("services: prefill-0, decode-0, proxy"),
        "{}",
        text(&out)
    );
    up.down();
    assert!(
        up.cluster.status(&[]).is_none(),
        "status after down should say nothing runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_protocol_hands_kv_over_by_kv_transfer_params() {
    let up = hand_off_on_1p1d("c-nixl", "nixl", "cnx").await;
    // `status --json` gives what each local service's processes use, as the supervisor
    // samples it every 2 s: a running sim engine holds memory and has a CPU figure.
    let r = up.cluster.wait_status(Duration::from_secs(30), &[], |r| {
        let d = suph::svc(r, "decode-0");
        d.rss_bytes.is_some() && d.cpu_percent.is_some()
    });
    let d = suph::svc(&r, "decode-0");
    assert!(d.rss_bytes.is_some_and(|b| b > 1 << 20), "{d:?}");
    assert!(d.cpu_percent.is_some_and(|c| c >= 0.0), "{d:?}");
    // No NVML for the tests (PDCTL_IGNORE_INSTALLED): no GPU figure.
    assert_eq!(d.gpu_memory_bytes, None, "{d:?}");
    let table = text(&up.cluster.run(&["status"]));
    assert!(
        table
            .lines()
            .find(|l| l.starts_with("SERVICE"))
            .is_some_and(|h| h
                .split_whitespace()
                .collect::<Vec<_>>()
                .windows(3)
                .any(|w| w == ["CPU", "MEM", "GPU-MEM"])),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_protocol_hands_kv_over_by_transfer_id() {
    hand_off_on_1p1d("c-mooncake", "mooncake", "cmc").await;
}

/// Issue 30: an engine of a running cluster refuses a request without the engine key
/// (401), takes it with the key, leaves its probes and scrapes open, and the proxy's
/// answers are unchanged; the key is in no plan, log line or status output, and only the
/// engines and the proxy have it in their environment.
#[tokio::test(flavor = "multi_thread")]
async fn engines_refuse_requests_without_the_engine_key_and_the_key_shows_nowhere() {
    let up = hand_off_on_1p1d("keys", "nixl", "keys").await;
    let key = up.cluster.engine_key();
    assert_eq!(key.len(), 64, "a derived key is 64 hex digits: {key:?}");
    let body = json!({"model": "sim-model", "prompt": "straight to an engine", "max_tokens": 2});
    let mut engines = up.urls(pdctl::vocab::Role::Prefill);
    engines.extend(up.urls(pdctl::vocab::Role::Decode));
    for url in &engines {
        let (s, _, b) = post(&format!("{url}/v1/completions"), &body).await;
        assert_eq!(s, 401, "{url} answered without the engine key: {b}");
        let wrong = client()
            .post(format!("{url}/v1/completions"))
            .bearer_auth("not-the-engine-key-0123456789")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status().as_u16(), 401, "{url} took a wrong key");
        let models = client()
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap();
        assert_eq!(models.status().as_u16(), 401, "{url}/v1/models is open");
        for open in ["/health", "/metrics"] {
            let r = client().get(format!("{url}{open}")).send().await.unwrap();
            assert_eq!(
                r.status().as_u16(),
                200,
                "{url}{open} needs no key (probes, scrapes)"
            );
        }
        let with_key = client()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(with_key.status().as_u16(), 200, "{url} refused its own key");
    }
    // Through the proxy, with no key at all, as before.
    let (s, _, b) = post(&format!("{}/v1/completions", up.proxy), &body).await;
    assert_eq!(s, 200, "{b}");

    // Nowhere to be read: plan, generated files, logs, status, the plan as printed.
    let state = up.cluster.root().join("keys");
    let mut files = vec![state.join("plan.json")];
    for dir in [state.join("logs"), state.join("files")] {
        for e in std::fs::read_dir(&dir).unwrap() {
            files.push(e.unwrap().path());
        }
    }
    for f in &files {
        let content = std::fs::read(f).unwrap();
        assert!(
            !String::from_utf8_lossy(&content).contains(&key),
            "the engine key is in {}",
            f.display()
        );
    }
    let status = up.cluster.run(&["status", "--json"]);
    assert!(!String::from_utf8_lossy(&status.stdout).contains(&key));
    let topology = up._dir.path().join("topology.toml");
    let printed = up.cluster.run(&["plan", "-f", topology.to_str().unwrap()]);
    let printed = text(&printed);
    assert!(
        printed.contains("VLLM_API_KEY=\"$(pdctl secret --engine-key)\""),
        "{printed}"
    );
    assert!(!printed.contains(&key), "pdctl plan shows the key");

    // The engines and the proxy have it in their environment, the way their plan says;
    // none inherited the cluster's secret.
    let report = up.cluster.status(&[]).unwrap();
    for s in &report.services {
        let environ = std::fs::read(format!("/proc/{}/environ", s.pid.unwrap())).unwrap();
        let vars: Vec<String> = environ
            .split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        let var = if s.role == pdctl::vocab::Role::Proxy {
            "PDCTL_ENGINE_API_KEY"
        } else {
            "VLLM_API_KEY"
        };
        assert!(
            vars.contains(&format!("{var}={key}")),
            "{} has no {var} with the engine key",
            s.name
        );
        assert!(
            !vars.iter().any(|v| v.starts_with("PDCTL_CLUSTER_SECRET=")),
            "{} inherited the cluster secret",
            s.name
        );
    }
    up.down();
}

/// Limits configured in the topology reach the embedded proxy: with one request allowed
/// in flight and no queue, a second concurrent request gets 429 with retry-after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_limits_from_the_topology_answer_429() {
    let (t, port) = sim_topology("c-limits", "example", 1, 1, "[engine.sim]\nitl_ms = 40.0\n");
    let t = t.replace("[proxy]\n", "[proxy]\nmax_concurrent = 1\n");
    let up = Up::start("clim", &t, port);
    let url = format!("{}/v1/completions", up.proxy);
    let slow =
        json!({"model": "sim-model", "prompt": "hello there", "max_tokens": 25, "stream": true});
    let first = tokio::spawn({
        let (url, slow) = (url.clone(), slow.clone());
        async move { post(&url, &slow).await }
    });
    // The first one holds the only slot (a 25-token stream at 40 ms a token) once counted.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&up.proxy, "pdctl_proxy_requests_in_flight").await < 1.0 {
        assert!(Instant::now() < deadline, "the first request never got in");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = client().post(&url).json(&slow).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert_eq!(
        first.await.unwrap().0,
        200,
        "the admitted request still completes"
    );
}

/// 4P4D sims with real etcd + mooncake_master behind a prefix-aware proxy.
fn four_by_four(tag: &str, extra: &str) -> Up {
    let (t, port) = sim_topology(&format!("c-4p4d-{tag}"), "mooncake-store", 4, 4, extra);
    let t = t.replace(
        "[proxy]\n",
        "[proxy]\nprefill_policy = \"prefix-aware\"\ndecode_policy = \"least-loaded\"\n",
    );
    Up::start(tag, &t, port)
}

async fn successes(urls: &[String]) -> Vec<f64> {
    let mut out = Vec::new();
    for u in urls {
        out.push(metric(u, "vllm:request_success_total").await);
    }
    out
}

fn host_port(url: &str) -> &str {
    url.trim_start_matches("http://")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_by_four_routes_designates_and_survives_failures() {
    let up = four_by_four(
        "r",
        "[engine.sim]\nitl_ms = 20.0\nprefill_ms_per_token = 0.02\n",
    );
    let prefill = up.urls(pdctl::vocab::Role::Prefill);
    let decode = up.urls(pdctl::vocab::Role::Decode);
    assert_eq!((prefill.len(), decode.len()), (4, 4));
    assert!(
        up.report.services.iter().any(|s| s.name == "etcd")
            && up
                .report
                .services
                .iter()
                .any(|s| s.name == "mooncake-master")
    );
    let url = format!("{}/v1/completions", up.proxy);

    // Designation through `user`, as hand-written PD proxies take it: only the named pair works.
    let (p0, d0) = (successes(&prefill).await, successes(&decode).await);
    let user = format!(
        "prefill={};decode={}",
        host_port(&prefill[2]),
        host_port(&decode[3])
    );
    for i in 0..3 {
        let (s, _, b) = post(&url, &json!({"model": "sim-model", "prompt": format!("designated {i}"), "max_tokens": 2, "user": user})).await;
        assert_eq!(s, 200, "{b}");
    }
    let (p1, d1) = (successes(&prefill).await, successes(&decode).await);
    let dp: Vec<f64> = p1.iter().zip(&p0).map(|(a, b)| a - b).collect();
    let dd: Vec<f64> = d1.iter().zip(&d0).map(|(a, b)| a - b).collect();
    assert_eq!(dp, [0.0, 0.0, 3.0, 0.0], "prefill requests per instance");
    assert_eq!(dd, [0.0, 0.0, 0.0, 3.0], "decode requests per instance");
    let (s, _, b) = post(&url, &json!({"model": "sim-model", "prompt": "x", "max_tokens": 2, "user": "prefill=127.0.0.1:1"})).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b.contains("127.0.0.1:1"),
        "the error names the unknown instance: {b}"
    );

    // Prefix-aware prefill policy: one long shared prompt keeps going to one instance.
    let p0 = successes(&prefill).await;
    let shared = long_prompt("shared");
    for _ in 0..6 {
        let (s, _, _) = post(
            &url,
            &json!({"model": "sim-model", "prompt": shared, "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200);
    }
    let dp: Vec<f64> = successes(&prefill)
        .await
        .iter()
        .zip(&p0)
        .map(|(a, b)| a - b)
        .collect();
    assert_eq!(
        dp.iter().filter(|x| **x > 0.0).count(),
        1,
        "prefix-aware sent one prefix to several prefills: {dp:?}"
    );

    // A failing prefill: a JSON error naming the leg, quickly; the proxy stays up.
    let fault = client()
        .post(format!("{}/sim/fault", prefill[1]))
        .bearer_auth(up.cluster.engine_key())
        .json(&json!({"fail_next": 1}))
        .send()
        .await
        .unwrap();
    assert!(fault.status().is_success());
    let user = format!("prefill={}", host_port(&prefill[1]));
    let t0 = Instant::now();
    let (s, ct, b) = post(
        &url,
        &json!({"model": "sim-model", "prompt": "boom", "max_tokens": 2, "user": user}),
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "a failed prefill must not hang"
    );
    assert!(s >= 500 && ct.starts_with("application/json"), "{s} {b}");
    assert!(
        b.contains("prefill") && b.contains(host_port(&prefill[1])),
        "{b}"
    );

    // Malformed input: 4xx, and the proxy keeps serving.
    for bad in ["{not json", "[]", "{\"model\": \"sim-model\"}"] {
        let r = client()
            .post(&url)
            .header("content-type", "application/json")
            .body(bad)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_client_error(), "{bad}: {}", r.status());
    }
    let r = client()
        .get(format!("{}/nope", up.proxy))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);

    // A decode killed mid-stream: the answer goes on on another decode (the designation
    // was for the dead one), one stream to the end.
    let user = format!("decode={}", host_port(&decode[0]));
    let resp = client()
        .post(&url)
        .json(&json!({"model": "sim-model", "prompt": "stream then die", "max_tokens": 200, "stream": true, "user": user}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let pid = up.pid("decode-0");
    let mut stream = resp.bytes_stream();
    use futures_util::StreamExt;
    let mut seen = String::new();
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Ok(Some(chunk)) = tokio::time::timeout_at(deadline.into(), stream.next()).await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap_or_default()));
        if !killed && seen.contains("data: {") {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
            killed = true;
        }
    }
    assert!(killed, "no chunk arrived before the kill: {seen}");
    assert!(
        !seen.contains("\"error\""),
        "the stream ended with an error when its decode died: {seen}"
    );
    assert!(
        seen.trim_end().ends_with("data: [DONE]"),
        "the stream did not go on to its end: {seen}"
    );
    // The supervisor restarts decode-0.
    let r = up.cluster.wait_status(Duration::from_secs(30), &[], |r| {
        let s = suph::svc(r, "decode-0");
        s.restarts >= 1 && s.state == pdctl::control::ServiceState::Healthy
    });
    assert!(suph::svc(&r, "decode-0").restarts >= 1, "{r:?}");
}

/// A client that goes away cancels both legs: the prefill engine aborts its leg when the
/// client leaves during prefill, and decode its stream when the client leaves during decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnects_cancel_both_legs() {
    let (t, port) = sim_topology(
        "c-cancel",
        "example",
        1,
        1,
        "[engine.sim]\nprefill_ms_per_token = 10.0\nitl_ms = 50.0\n",
    );
    let up = Up::start("ccan", &t, port);
    let prefill = &up.urls(pdctl::vocab::Role::Prefill)[0];
    let decode = &up.urls(pdctl::vocab::Role::Decode)[0];
    let url = format!("{}/v1/completions", up.proxy);
    let aborted = "pdctl_sim_requests_aborted_total";
    let (pa0, da0) = (
        metric(prefill, aborted).await,
        metric(decode, aborted).await,
    );
    // 300 tokens x 10 ms: the prefill leg runs 3 s; the client gives up after 0.5 s.
    let slow_prefill = json!({"model": "sim-model", "prompt": long_prompt("p").split(' ').take(300).collect::<Vec<_>>().join(" "), "max_tokens": 5});
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    assert!(quick.post(&url).json(&slow_prefill).send().await.is_err());
    let ok = eventually(Duration::from_secs(4), || async {
        metric(prefill, aborted).await > pa0
    })
    .await;
    assert!(ok, "the prefill leg was not cancelled when the client left");
    // Short prompt, long stream: leave after the first chunk.
    let resp = client()
        .post(&url)
        .json(&json!({"model": "sim-model", "prompt": "hi", "max_tokens": 100, "stream": true}))
        .send()
        .await
        .unwrap();
    use futures_util::StreamExt;
    let mut s = resp.bytes_stream();
    let _ = s.next().await;
    drop(s);
    let ok = eventually(Duration::from_secs(4), || async {
        metric(decode, aborted).await > da0
    })
    .await;
    assert!(
        ok,
        "the decode stream was not cancelled when the client left"
    );
}

/// The prefix-caching experiment on a 4P4D sim: 3 groups sharing long contexts,
/// engines whose cache holds about one context. Designating a group to one pair keeps its
/// context cached; round-robin and random spread every group over every instance and
/// evict each other's blocks. The benchmark reads the hit rate from the engines' /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_strategies_show_what_routing_does_to_the_hit_rate() {
    let up = four_by_four(
        "b",
        "[engine.sim]\nitl_ms = 1.0\nprefill_ms_per_token = 0.0\ncache_blocks = 24\n",
    );
    let dir = TempDir::new("strategies");
    let prefill = up.urls(pdctl::vocab::Role::Prefill);
    let mut rates = std::collections::BTreeMap::new();
    let mut prefill_rates = std::collections::BTreeMap::new();
    for strategy in ["designate", "rr", "random", "none"] {
        let json_path = dir.path().join(format!("{strategy}.json"));
        let out = up.cluster.run(&[
            "bench",
            "--dataset",
            "prefix",
            "--strategy",
            strategy,
            "--prefix-groups",
            "3",
            "--prefix-len",
            "256",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-prompts",
            "48",
            "--max-concurrency",
            "1",
            "--json",
            json_path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "bench {strategy}:\n{}", text(&out));
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(v["completed"], 48, "{strategy}: {v}");
        rates.insert(
            strategy,
            v["prefix_cache_hit_rate"]
                .as_f64()
                .expect("hit rate from the cluster's engines"),
        );
        let (q, h) = v["prefix_cache"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| prefill.iter().any(|p| c["instance"] == p.as_str()))
            .fold((0.0, 0.0), |(q, h), c| {
                (
                    q + c["queries"].as_f64().unwrap(),
                    h + c["hits"].as_f64().unwrap(),
                )
            });
        prefill_rates.insert(strategy, h / q);
    }
    let (d, rr, rnd) = (rates["designate"], rates["rr"], rates["random"]);
    assert!(d > 0.6, "designate {d}: {rates:?}");
    assert!(
        d - rr > 0.4 && d - rnd > 0.4,
        "designate should be far above rr/random: {rates:?}"
    );
    // With no designation the proxy's prefix-aware prefill policy keeps each group on one
    // prefill instance, as designation does (its decode policy is least-loaded, so only
    // the prefill side is compared).
    let (pd, pnone) = (prefill_rates["designate"], prefill_rates["none"]);
    assert!(
        pnone > 0.6 && pnone > pd - 0.15,
        "prefix-aware prefill {pnone} vs designate {pd}: {prefill_rates:?}"
    );
}
