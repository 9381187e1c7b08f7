//! `pdctl proxy` in front of real `pdctl sim` processes: each protocol with its matching
//! simulated KV handoff (the decode sim must report a KV hit, not a recompute), policies'
//! choices seen in the sims' own metrics, and failures and disconnects as the engines see
//! them (aborted requests, error events).

use crate::common;
use crate::common::proxy as fake;
use crate::common::sim;

use common::TempDir;
use fake::{ProxyProcess, eventually, sse_events};
use futures_util::StreamExt;
use serde_json::{Value, json};
use sim::{SimProc, prompt_of};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);
const ZERO: [&str; 10] = [
    "--itl-ms",
    "0",
    "--overhead-ms",
    "0",
    "--prefill-ms-per-token",
    "0",
    "--kv-load-ms-per-token",
    "0",
    "--log-stats-interval-ms",
    "0",
];

async fn start_sim(role: &str, handoff: &str, extra: &[&str]) -> SimProc {
    let mut a: Vec<&str> = ZERO.to_vec();
    a.extend(["--role", role, "--handoff", handoff]);
    a.extend_from_slice(extra);
    SimProc::start(&a).await
}

/// A decode sim that streams a token every 50 ms and logs no periodic stats.
async fn slow_decode() -> SimProc {
    SimProc::start(&[
        "--role",
        "decode",
        "--itl-ms",
        "50",
        "--log-stats-interval-ms",
        "0",
    ])
    .await
}

fn args(prefill: &[&SimProc], decode: &[&SimProc], extra: &[&str]) -> Vec<String> {
    let bases = |sims: &[&SimProc]| sims.iter().map(|s| s.base.clone()).collect();
    fake::proxy_args_for(bases(prefill), bases(decode), extra)
}

/// POSTs [`completion`] of `prompt` to the proxy's /v1/completions.
async fn complete(p: &ProxyProcess, prompt: &str, stream: bool) -> reqwest::Response {
    post(p, "/v1/completions", &completion(prompt, stream)).await
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 8, "stream": stream})
}

async fn post(p: &ProxyProcess, path: &str, body: &Value) -> reqwest::Response {
    sim::client()
        .post(format!("{}{path}", p.url))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Sends a streamed completion, a plain one and a chat one; each must answer in full.
async fn three_requests(proxy: &ProxyProcess, tag: &str) {
    let resp = complete(proxy, &prompt_of(64, tag), true).await;
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]", "{events:?}");
    let resp = complete(proxy, &prompt_of(48, &format!("{tag}b")), false).await;
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 8);
    let chat = json!({"model": "sim-model", "max_completion_tokens": 8,
        "messages": [{"role": "user", "content": prompt_of(40, &format!("{tag}c"))}]});
    let resp = post(proxy, "/v1/chat/completions", &chat).await;
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert!(common::chat_text(&answer).len() > 1, "{answer}");
}

/// Three handoffs of the test's requests, and `warmups` of the proxy's warm-up of the pair
/// (1 for the NIXL protocols, whose handshake is lazy; 0 for the others).
async fn assert_three_handoffs(p: &SimProc, d: &SimProc, proxy: &ProxyProcess, warmups: f64) {
    assert_eq!(
        d.metric("pdctl_sim_kv_handoffs_received_total").await,
        3.0 + warmups,
        "{}",
        d.log()
    );
    assert_eq!(
        d.metric("pdctl_sim_kv_handoffs_missed_total").await,
        0.0,
        "{}",
        d.log()
    );
    assert_eq!(
        p.metric("pdctl_sim_kv_handoffs_sent_total").await,
        3.0 + warmups
    );
    let metrics = proxy.metrics().await;
    assert!(
        !metrics.contains("pdctl_proxy_kv_handoff_misses_total{"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_step_over_a_shared_dir_makes_the_decode_sim_load_the_kv() {
    let dir = TempDir::new("kv");
    let kv = dir.path().display().to_string();
    let p = start_sim("prefill", "shared-dir", &["--kv-dir", &kv]).await;
    let d = start_sim("decode", "shared-dir", &["--kv-dir", &kv]).await;
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &[])).await;
    three_requests(&proxy, "twostep").await;
    assert_three_handoffs(&p, &d, &proxy, 0.0).await;
}

/// Misses estimated from decode's counters, for legs no answer judged (kept apart from the
/// misses counted one by one).
const ESTIMATED: &str = "pdctl_proxy_kv_handoff_misses_estimated_total";
const USAGE_LOW: &str = "pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"}";

/// The proxy's view of a decode's `vllm:prompt_tokens_by_source_total` growth.
async fn proxy_seen(proxy: &ProxyProcess, d: &SimProc, source: &str) -> f64 {
    let series = format!(
        "pdctl_proxy_decode_prompt_tokens_total{{instance=\"{}\",source=\"{source}\"}}",
        d.base
    );
    proxy.metric(&series).await
}

/// Waits until the proxy has read `d`'s by-source counters (the baseline their growth is
/// counted from): its series of them shows from that page on.
async fn wait_watched(proxy: &ProxyProcess, d: &SimProc) {
    let series = format!(
        "pdctl_proxy_decode_prompt_tokens_total{{instance=\"{}\",source=\"local_compute\"}}",
        d.base
    );
    assert!(
        eventually(WAIT, || async { proxy.metrics().await.contains(&series) }).await,
        "the proxy never read {}'s prompt token counters:\n{}\n{}",
        d.base,
        proxy.metrics().await,
        proxy.log()
    );
}

/// What the pair's warm-up left on the decode sim's by-source counters, and in the proxy's
/// view of them: the tests' own requests count from here.
struct Base {
    local: f64,
    external: f64,
}

/// Waits until the proxy has warmed the pair's KV path (one request through both sims)
/// and has read the decode's counters after it; what they say then.
async fn warmed(proxy: &ProxyProcess, d: &SimProc) -> Base {
    let ready = eventually(WAIT, || async {
        let v = common::get_json(&format!("{}/health?ready", proxy.url)).await;
        v["pairs"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["state"] == "ready"))
    })
    .await;
    assert!(ready, "the pair was never warmed:\n{}", proxy.log());
    let base = Base {
        local: d.prompt_tokens("local_compute").await,
        external: d.prompt_tokens("external_kv_transfer").await,
    };
    assert!(base.external > 0.0, "the warm-up handed KV over");
    let seen = eventually(WAIT, || async {
        proxy_seen(proxy, d, "local_compute").await == base.local
            && proxy_seen(proxy, d, "external_kv_transfer").await == base.external
    })
    .await;
    assert!(seen, "the proxy never read the counters after the warm-up");
    base
}

/// A nixl pair and a proxy that scrapes the decode every 100 ms, its baseline taken and
/// the pair warmed.
async fn nixl_pair() -> (SimProc, SimProc, ProxyProcess, Base) {
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &[]).await;
    let proxy = ProxyProcess::start(&args(
        &[&p],
        &[&d],
        &["--protocol", "nixl", "--health-interval-ms", "100"],
    ))
    .await;
    wait_watched(&proxy, &d).await;
    let base = warmed(&proxy, &d).await;
    (p, d, proxy, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recompute_only_the_decode_sim_knows_of_still_shows_in_the_proxy() {
    // Misconfigured on purpose: prefill and decode do not share their KV directory.
    let (pdir, ddir) = (TempDir::new("kv-p"), TempDir::new("kv-d"));
    let (pkv, dkv) = (
        pdir.path().display().to_string(),
        ddir.path().display().to_string(),
    );
    let p = start_sim("prefill", "shared-dir", &["--kv-dir", &pkv]).await;
    let d = start_sim("decode", "shared-dir", &["--kv-dir", &dkv]).await;
    let proxy = ProxyProcess::start(&args(
        &[&p],
        &[&d],
        &["--scrape-metrics", "--health-interval-ms", "100"],
    ))
    .await;
    wait_watched(&proxy, &d).await;
    let resp = complete(&proxy, &prompt_of(64, "lost"), false).await;
    assert_eq!(resp.status(), 200, "the answer is right, only slower");
    assert_eq!(d.prompt_tokens("local_compute").await, 64.0);
    // The decode was never seen to report cached_tokens before (and this proxy is not told
    // by a plan that it does), so its usage only names the request in the log; its vLLM
    // counters estimate the miss.
    proxy.wait_metric(ESTIMATED, 1.0).await;
    assert_eq!(proxy.metric(USAGE_LOW).await, 0.0);
    let log = proxy.log();
    assert!(
        log.contains(&format!("KV handoff missed: decode {} computed 48", d.base)),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "KV handoff missed: decode {} computed 64 of 64",
            d.base
        )),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn working_handoffs_leave_misses_at_zero_and_the_prompt_arrives_by_kv_transfer() {
    let (_p, d, proxy, base) = nixl_pair().await;
    // 70-token prompts: 4 full blocks (64 tokens) are handed off, 6 tokens computed.
    let mut stream_usage = completion(&prompt_of(70, "oka"), true);
    stream_usage["stream_options"] = json!({"include_usage": true});
    for body in [
        completion(&prompt_of(70, "okb"), false),
        completion(&prompt_of(70, "okc"), true),
        stream_usage,
    ] {
        let resp = post(&proxy, "/v1/completions", &body).await;
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
    }
    assert_eq!(
        d.prompt_tokens("external_kv_transfer").await - base.external,
        3.0 * 64.0
    );
    assert_eq!(
        d.prompt_tokens("local_compute").await - base.local,
        3.0 * 6.0
    );
    assert!(
        eventually(WAIT, || async {
            proxy_seen(&proxy, &d, "external_kv_transfer").await - base.external == 3.0 * 64.0
        })
        .await,
        "{}",
        proxy.metrics().await
    );
    // A few more intervals to settle: still no miss of any kind. (A wait for nothing to
    // happen: no condition ends it sooner.)
    tokio::time::sleep(Duration::from_millis(400)).await;
    let metrics = proxy.metrics().await;
    assert!(
        !metrics.contains("pdctl_proxy_kv_handoff_misses_total{"),
        "{metrics}"
    );
    assert!(
        metrics.contains("pdctl_proxy_kv_handoff_recomputed_tokens_total 0\n"),
        "{metrics}"
    );
    assert!(
        !proxy.log().contains("KV handoff missed"),
        "{}",
        proxy.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_handoff_on_a_stream_without_usage_is_found_in_the_decode_counters() {
    let (p, d, proxy, base) = nixl_pair().await;
    let (s, _) = d.post("/sim/fault", &json!({"fail_handoff_next": 1})).await;
    assert_eq!(s, 200);
    let resp = complete(&proxy, &prompt_of(70, "lost"), true).await;
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert_eq!(
        events.last().unwrap(),
        "[DONE]",
        "the client sees nothing wrong"
    );
    assert!(
        events.iter().all(|e| !e.contains("\"choices\":[]")),
        "the usage chunk the proxy asked decode for is not the client's: {events:?}"
    );
    assert_eq!(d.prompt_tokens("local_compute").await - base.local, 70.0);
    // The warm-up's handoff, then this one.
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_sent_total").await, 2.0);
    proxy.wait_metric(ESTIMATED, 1.0).await;
    assert_eq!(
        proxy
            .metric("pdctl_proxy_kv_handoff_unexplained_tokens_total")
            .await,
        70.0 - 16.0
    );
    assert_eq!(
        proxy_seen(&proxy, &d, "local_compute").await - base.local,
        70.0
    );
    assert!(
        proxy
            .log()
            .contains(&format!("KV handoff missed: decode {} computed 54", d.base)),
        "{}",
        proxy.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_handoff_shows_in_the_decode_answer_usage_once_and_names_the_request() {
    let (_p, d, proxy, base) = nixl_pair().await;
    // A working handoff first: the decode is seen to report cached_tokens (64 of 70).
    let resp = complete(&proxy, &prompt_of(70, "first"), false).await;
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        64
    );
    d.post("/sim/fault", &json!({"fail_handoff_next": 1})).await;
    let resp = complete(&proxy, &prompt_of(70, "gone"), false).await;
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        proxy.metric(USAGE_LOW).await,
        1.0,
        "{}",
        proxy.metrics().await
    );
    let log = proxy.log();
    let line = log
        .lines()
        .find(|l| l.contains("KV handoff missed: decode") && l.contains(&rid))
        .unwrap_or_else(|| panic!("no miss line naming {rid}:\n{log}"));
    assert!(
        line.contains(&d.base) && line.contains("computed 70 of 70"),
        "{line}"
    );
    assert!(
        eventually(WAIT, || async {
            proxy
                .log()
                .lines()
                .any(|l| l.contains(&rid) && l.contains("kv_handoff=decode_cached_tokens_low"))
        })
        .await,
        "{}",
        proxy.log()
    );
    // The counters show the same 70 tokens: once the scraper has seen them, it must not
    // count the request a second time.
    assert!(
        eventually(WAIT, || async {
            proxy_seen(&proxy, &d, "local_compute").await - base.local == 6.0 + 70.0
        })
        .await
    );
    // A few more scrapes, to show none counts it again (a wait for nothing to happen).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(proxy.metric(ESTIMATED).await, 0.0, "{}", proxy.log());
    assert_eq!(
        proxy
            .metric("pdctl_proxy_kv_handoff_recomputed_tokens_total")
            .await,
        70.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_params_from_the_prefill_sim_let_the_decode_sim_pull_the_kv() {
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &[]).await;
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &["--protocol", "nixl"])).await;
    three_requests(&proxy, "nixl").await;
    assert_three_handoffs(&p, &d, &proxy, 1.0).await;
    assert_eq!(
        p.metric("pdctl_sim_kv_blocks_held").await,
        0.0,
        "every held block was taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_transfer_ids_let_the_decode_sim_receive_the_push() {
    let boot = common::free_port().to_string();
    let p = start_sim("prefill", "mooncake", &["--bootstrap-port", &boot]).await;
    let d = start_sim("decode", "mooncake", &[]).await;
    let proxy = ProxyProcess::start(&args(
        &[&p],
        &[&d],
        &["--protocol", "mooncake", "--bootstrap-port", &boot],
    ))
    .await;
    three_requests(&proxy, "mooncake").await;
    assert_three_handoffs(&p, &d, &proxy, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn designation_and_round_robin_show_in_the_sims_request_counts() {
    let mut sims = Vec::new();
    for role in ["prefill", "prefill", "decode", "decode"] {
        sims.push(start_sim(role, "none", &[]).await);
    }
    let (ps, ds) = sims.split_at(2);
    let proxy = ProxyProcess::start(&args(&[&ps[0], &ps[1]], &[&ds[0], &ds[1]], &[])).await;
    for i in 0..4 {
        let r = complete(&proxy, &format!("rr {i}"), false).await;
        assert_eq!(r.status(), 200);
    }
    let served = "vllm:request_success_total";
    for s in &sims {
        assert_eq!(s.metric(served).await, 2.0, "round robin spreads evenly");
    }
    let host_port = |s: &SimProc| format!("127.0.0.1:{}", s.port);
    let mut pinned = completion("pinned", false);
    pinned["user"] = json!(format!(
        "prefill={};decode={}",
        host_port(&ps[1]),
        host_port(&ds[0])
    ));
    for _ in 0..3 {
        assert_eq!(post(&proxy, "/v1/completions", &pinned).await.status(), 200);
    }
    let counts = [
        ps[0].metric(served).await,
        ps[1].metric(served).await,
        ds[0].metric(served).await,
        ds[1].metric(served).await,
    ];
    assert_eq!(counts, [2.0, 5.0, 5.0, 2.0]);
}

/// Four contexts, four questions each, sent context by context to four prefill sims; the
/// prefill sims' prefix cache hits (summed) for a policy.
async fn prefill_cache_hits(policy: &str) -> f64 {
    let mut prefills = Vec::new();
    for _ in 0..4 {
        prefills.push(start_sim("prefill", "none", &[]).await);
    }
    let d = start_sim("decode", "none", &[]).await;
    let refs: Vec<&SimProc> = prefills.iter().collect();
    let proxy = ProxyProcess::start(&args(&refs, &[&d], &["--prefill-policy", policy])).await;
    for c in 0..4 {
        let context = prompt_of(64, &format!("context{c}w"));
        for q in 0..4 {
            let body = completion(&format!("{context} question {q}"), false);
            assert_eq!(post(&proxy, "/v1/completions", &body).await.status(), 200);
        }
    }
    let mut hits = 0.0;
    for p in &prefills {
        hits += p.metric("vllm:prefix_cache_hits_total").await;
    }
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_routing_turns_repeated_contexts_into_prefix_cache_hits() {
    let round_robin = prefill_cache_hits("round-robin").await;
    let prefix_aware = prefill_cache_hits("prefix-aware").await;
    // Round robin sends each context's four questions to four different sims: no sim ever
    // sees a context twice. Prefix-aware keeps each context on one sim: 3 of 4 requests
    // reuse its 64-token (4-block) prefix.
    assert_eq!(round_robin, 0.0);
    assert_eq!(prefix_aware, 4.0 * 3.0 * 64.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_is_an_aborted_request_on_the_decode_sim() {
    let p = start_sim("prefill", "none", &[]).await;
    let d = slow_decode().await;
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &[])).await;
    let mut body = completion("stay a while", true);
    body["max_tokens"] = json!(200);
    let resp = post(&proxy, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    d.wait_metric("pdctl_sim_requests_aborted_total", 1.0).await;
    assert_eq!(d.metric("vllm:num_requests_running").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_prefill_is_an_aborted_request_on_the_prefill_sim() {
    let p = start_sim("prefill", "none", &[]).await;
    let d = start_sim("decode", "none", &[]).await;
    let (status, _) = p.post("/sim/fault", &json!({"hang_next": 1})).await;
    assert_eq!(status, 200);
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &[])).await;
    let url = format!("{}/v1/completions", proxy.url);
    let request = tokio::spawn(async move {
        sim::client()
            .post(url)
            .json(&completion("never mind", false))
            .send()
            .await
    });
    p.wait_metric("vllm:num_requests_running", 1.0).await;
    request.abort();
    p.wait_metric("pdctl_sim_requests_aborted_total", 1.0).await;
    assert_eq!(d.metric("vllm:request_success_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_sim_is_a_json_error_and_a_killed_decode_sim_an_error_event() {
    let p = start_sim("prefill", "none", &[]).await;
    let mut d = slow_decode().await;
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &["--health-interval-ms", "60000"])).await;
    p.post("/sim/fault", &json!({"fail_next": 1})).await;
    let resp = complete(&proxy, "x", true).await;
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "prefill");
    assert_eq!(err["error"]["instance"], p.base);

    let mut body = completion("a long answer", true);
    body["max_tokens"] = json!(200);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    let _ = d.child.0.kill();
    let mut rest = Vec::new();
    while let Some(Ok(c)) = stream.next().await {
        rest.extend_from_slice(&c);
    }
    let rest = String::from_utf8(rest).unwrap();
    // Its only decode is gone and nothing brings it back (no supervisor): the stream
    // cannot be continued, and its error event says so, then `[DONE]`.
    let events: Vec<&str> = rest.trim_end().split("\n\n").collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{rest}");
    let error = events[events.len() - 2].trim_start_matches("data: ");
    let event: Value = serde_json::from_str(error).unwrap();
    assert_eq!(event["error"]["leg"], "decode", "{rest}");
    assert_eq!(event["error"]["instance"], d.base);
    assert!(
        event["error"]["not_migrated"]
            .as_str()
            .is_some_and(|w| w.contains("continuation failed")),
        "{rest}"
    );
    let _ = d.wait_exit(WAIT);
}

const KV_LOAD_FAILED: &str =
    "pdctl_proxy_kv_handoff_failures_total{reason=\"decode_failed_the_request\"}";
const REDONE_KV_LOAD: &str = "pdctl_proxy_requests_redone_total{reason=\"kv_load_failed\"}";
const ENGINE_FAILED: &str =
    "pdctl_proxy_kv_handoff_failures_total{reason=\"engine_reported_failed_transfers\"}";

/// Under kv_load_failure_policy "fail" a lost handoff fails the request on the decode sim
/// (as vLLM: a bare "Internal server error"). Nothing had reached the client, so the proxy
/// redoes the request once (the only pair again) and the client gets its answer, the redo
/// counted by reason; when the redo loses its handoff too, the client gets an error naming
/// the decode leg, the instance and the KV load, whole or streamed, and the failure
/// counters rise (the one the proxy saw, and the one from the decode's
/// vllm:nixl_num_failed_transfers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_fail_policy_a_lost_handoff_reaches_the_client_as_a_kv_load_error() {
    let fail = ["--kv-load-failure-policy", "fail"];
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &fail).await;
    let mut extra = vec!["--protocol", "nixl", "--health-interval-ms", "100"];
    extra.extend(fail);
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &extra)).await;
    wait_watched(&proxy, &d).await;
    // A working handoff is untouched by the policy.
    let resp = complete(&proxy, &prompt_of(70, "fine"), false).await;
    assert_eq!(resp.status(), 200);

    // One lost handoff: redone once, answered.
    d.post("/sim/fault", &json!({"fail_handoff_next": 1})).await;
    let resp = complete(&proxy, &prompt_of(70, "lost-once"), false).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(proxy.metric(KV_LOAD_FAILED).await, 1.0);
    assert_eq!(proxy.metric(REDONE_KV_LOAD).await, 1.0);
    assert!(
        proxy.log().contains("request redone once (kv_load_failed)"),
        "{}",
        proxy.log()
    );

    // Two in a row: the redo fails too, and the client is told why.
    d.post("/sim/fault", &json!({"fail_handoff_next": 2})).await;
    let resp = complete(&proxy, &prompt_of(70, "lost-whole"), false).await;
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "decode", "{err}");
    assert_eq!(err["error"]["instance"], d.base.as_str(), "{err}");
    assert_eq!(err["error"]["type"], "kv_load_error", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("KV load failed") && msg.contains(&d.base),
        "{msg}"
    );
    assert_eq!(proxy.metric(KV_LOAD_FAILED).await, 3.0);
    assert_eq!(proxy.metric(REDONE_KV_LOAD).await, 2.0);

    d.post("/sim/fault", &json!({"fail_handoff_next": 2})).await;
    let resp = complete(&proxy, &prompt_of(70, "lost-stream"), true).await;
    assert_eq!(
        resp.status(),
        502,
        "the error came before any byte went out"
    );
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "kv_load_error", "{err}");
    assert_eq!(proxy.metric(KV_LOAD_FAILED).await, 5.0);
    assert_eq!(d.metric("pdctl_sim_kv_load_failures_total").await, 5.0);
    proxy.wait_metric(ENGINE_FAILED, 5.0).await;
    // Not a dead decode: the next request goes through it.
    let resp = complete(&proxy, &prompt_of(70, "after"), false).await;
    assert_eq!(resp.status(), 200);
    assert!(
        proxy.log().contains("could not load the KV handed over"),
        "{}",
        proxy.log()
    );
}

/// NIXL push: the first request to a prefill learns where it is (prefill first), the
/// next ones send both legs at once; the decode sim waits for the pushed KV and reports a
/// KV hit, not a recompute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_push_hands_the_kv_over_with_both_legs_at_once() {
    let p = start_sim("prefill", "nixl-push", &[]).await;
    let d = start_sim("decode", "nixl-push", &[]).await;
    let proxy = ProxyProcess::start(&args(
        &[&p],
        &[&d],
        &["--protocol", "nixl-push", "--health-interval-ms", "100"],
    ))
    .await;
    for (i, stream) in [false, true, false].into_iter().enumerate() {
        let resp = complete(&proxy, &prompt_of(70, &format!("push-{i}")), stream).await;
        assert_eq!(resp.status(), 200);
        if stream {
            assert_eq!(sse_events(resp).await.last().unwrap(), "[DONE]");
        } else {
            let a: Value = resp.json().await.unwrap();
            // Whole 16-token blocks arrived: all of the prompt but its last partial block.
            let prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                a["usage"]["prompt_tokens_details"]["cached_tokens"],
                prompt / 16 * 16,
                "{a}"
            );
        }
    }
    // Three, and the proxy's warm-up of the pair.
    assert_eq!(d.metric("pdctl_sim_kv_handoffs_received_total").await, 4.0);
    assert_eq!(d.metric("pdctl_sim_kv_handoffs_missed_total").await, 0.0);
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_sent_total").await, 4.0);
    assert!(d.log().contains("(pushed)"), "{}", d.log());
}

/// `/health?warmed` of a proxy (`url`): its status, 0 when it does not answer.
async fn warmed_status(url: &str) -> u16 {
    sim::client()
        .get(format!("{url}/health?warmed"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// The warm-up states of the proxy's pairs, as `/health?ready` lists them.
async fn pair_states(proxy: &ProxyProcess) -> Vec<String> {
    let v = common::get_json(&format!("{}/health?ready", proxy.url)).await;
    v["pairs"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| p["state"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// `/health?warmed` (what `up` waits on) through a first warm-up that fails: a decode whose
/// first KV load fails under kv_load_failure_policy "fail" (a NIXL handshake that timed out
/// once) makes the first warm-up fail; the proxy says warmed only once the retry made the
/// pair ready. It used to say warmed as soon as the first warm-up ended, failed or not: on
/// two machines `up` ended there and the first request got 503. And a pair that never warms
/// holds it no longer than `--warmed-within-s`: then ready all the same, the pair failed and
/// the log saying which and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmed_waits_through_a_failed_first_warm_up_and_no_longer_than_its_time() {
    let fail = ["--kv-load-failure-policy", "fail"];
    let p = start_sim("prefill", "nixl", &[]).await;
    let mut first_fails = vec!["--fault-first-handshake-fails"];
    first_fails.extend(fail);
    let d = start_sim("decode", "nixl", &first_fails).await;
    let mut extra = vec!["--protocol", "nixl", "--health-interval-ms", "100"];
    extra.extend(fail);
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &extra)).await;
    let warmed = eventually(WAIT, || async { warmed_status(&proxy.url).await == 200 }).await;
    assert!(warmed, "never warmed:\n{}", proxy.log());
    assert_eq!(pair_states(&proxy).await, ["ready"], "{}", proxy.log());
    let log = proxy.log();
    assert!(
        log.contains("warm-up of pair") && log.contains("failed after"),
        "{log}"
    );
    assert!(log.contains("(attempt 2)"), "{log}");

    // A decode that fails every KV load: warmed after --warmed-within-s, the pair failed.
    let never = start_sim("decode", "nixl", &fail).await;
    let (s, _) = never
        .post("/sim/fault", &json!({"fail_handoff_next": 1000}))
        .await;
    assert_eq!(s, 200);
    extra.extend(["--warmed-within-s", "2"]);
    let proxy = ProxyProcess::start(&args(&[&p], &[&never], &extra)).await;
    let warmed = eventually(WAIT, || async { warmed_status(&proxy.url).await == 200 }).await;
    assert!(warmed, "the wait never ended:\n{}", proxy.log());
    assert_eq!(pair_states(&proxy).await, ["failed"], "{}", proxy.log());
    let log = proxy.log();
    assert!(
        log.contains("after 2 s the KV path of pair(s)") && log.contains("ready all the same"),
        "{log}"
    );
}

/// `/health?warmed` (what the supervisor waits on before `up` ends) of a proxy whose decode
/// is not up at its start, as a remote engine its node still calls starting: 503 until the
/// pair that decode makes has had its warm-up, then 200 with the pair ready. It said 200 at
/// once (no pair at the first look counted as every warm-up done): on two machines `up`
/// ended before the warm-up, and the first request waited 30 s for it and got 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmed_waits_for_the_pair_an_engine_coming_up_late_makes() {
    let p = start_sim("prefill", "nixl", &[]).await;
    let port = common::free_port();
    let proxy = ProxyProcess::start(&fake::proxy_args_for(
        vec![p.base.clone()],
        vec![format!("http://127.0.0.1:{port}")],
        &["--protocol", "nixl", "--health-interval-ms", "100"],
    ))
    .await;
    let warmed_status = || warmed_status(&proxy.url);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(warmed_status().await, 503, "{}", proxy.log());

    let mut a: Vec<&str> = ZERO.to_vec();
    a.extend(["--role", "decode", "--handoff", "nixl"]);
    let _d = SimProc::start_on(port, &a).await;
    let ok = eventually(WAIT, || async { warmed_status().await == 200 }).await;
    assert!(ok, "never warmed:\n{}", proxy.log());
    let v = common::get_json(&format!("{}/health?ready", proxy.url)).await;
    assert!(
        v["pairs"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["state"] == "ready")),
        "200 before the pair was warmed: {v}"
    );
}

/// How many warm-ups the proxy has started, by its log.
fn warm_ups_started(proxy: &ProxyProcess) -> usize {
    proxy
        .log()
        .matches("warming up the KV path of pair")
        .count()
}

/// Whether `/health?ready` lists the instance at `url` as usable.
async fn usable(proxy: &ProxyProcess, url: &str) -> bool {
    let v = common::get_json(&format!("{}/health?ready", proxy.url)).await;
    v["instances"]
        .as_array()
        .is_some_and(|is| is.iter().any(|i| i["url"] == url && i["usable"] == true))
}

/// A pair's NIXL handshake lives as long as its two engines' processes. A decode whose
/// connect timed out (its machine frozen, as two vLLM engines on two cores freeze it) is
/// the same process afterwards. On two machines a freeze took decode out of rotation as
/// if it had refused the connection, its pair was warmed again, and that warm-up, in the
/// next freeze, made eight streams wait 30 s and get 503. Now:
/// - proxy `a` (probes every second) sends a request during the freeze: the client is told
///   the connect timed out, and the decode is not taken for one that refused it;
/// - proxy `b` (probes every 100 ms) takes the decode out of rotation during the freeze and
///   back after it, and keeps its pair warmed;
/// - neither warms the pair again, and both route to it after the freeze.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_that_timed_out_keeps_the_decode_and_its_warmed_pair() {
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &[]).await;
    let gate = common::gate::Gate::open(&format!("127.0.0.1:{}", d.port));
    let args = |interval: &str| {
        fake::proxy_args_for(
            vec![p.base.clone()],
            vec![gate.base.clone()],
            &[
                "--protocol",
                "nixl",
                "--health-interval-ms",
                interval,
                "--connect-timeout-ms",
                "300",
            ],
        )
    };
    let a = ProxyProcess::start(&args("1000")).await;
    let b = ProxyProcess::start(&args("100")).await;
    for proxy in [&a, &b] {
        let warmed = eventually(WAIT, || async { warmed_status(&proxy.url).await == 200 }).await;
        assert!(warmed, "never warmed:\n{}", proxy.log());
        assert_eq!(warm_ups_started(proxy), 1, "{}", proxy.log());
    }

    gate.freeze().await;
    let r = complete(&a, &prompt_of(40, "frozen"), false).await;
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    let out = eventually(WAIT, || async { !usable(&b, &gate.base).await }).await;
    gate.thaw();
    assert_eq!(status, 502, "{body}\n{}", a.log());
    assert!(
        body.contains("could not connect in time") && body.contains("--connect-timeout-ms"),
        "{body}"
    );
    assert!(out, "the frozen decode stayed in rotation:\n{}", b.log());
    let back = eventually(WAIT, || async { usable(&b, &gate.base).await }).await;
    assert!(back, "the decode never came back:\n{}", b.log());
    for proxy in [&a, &b] {
        let r = complete(proxy, &prompt_of(40, "thawed"), false).await;
        assert_eq!(r.status(), 200, "{}", proxy.log());
        let log = proxy.log();
        assert!(!log.contains("refused a connection"), "{log}");
        assert_eq!(warm_ups_started(proxy), 1, "warmed again:\n{log}");
        assert_eq!(pair_states(proxy).await, ["ready"], "{log}");
    }
}

/// A decode that restarted is a new run of the engine, with no handshake: its pair is
/// warmed again before routing sends it a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_decode_is_warmed_again_before_it_is_routed_to() {
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &[]).await;
    let (port, url) = (d.port, d.base.clone());
    let proxy = ProxyProcess::start(&args(
        &[&p],
        &[&d],
        &["--protocol", "nixl", "--health-interval-ms", "100"],
    ))
    .await;
    let warmed = eventually(WAIT, || async { warmed_status(&proxy.url).await == 200 }).await;
    assert!(warmed, "never warmed:\n{}", proxy.log());

    drop(d);
    let gone = eventually(WAIT, || async { !usable(&proxy, &url).await }).await;
    assert!(gone, "the stopped decode stayed usable:\n{}", proxy.log());
    let mut a: Vec<&str> = ZERO.to_vec();
    a.extend(["--role", "decode", "--handoff", "nixl"]);
    let d = SimProc::start_on(port, &a).await;
    let again = eventually(WAIT, || async {
        warm_ups_started(&proxy) == 2 && pair_states(&proxy).await == ["ready"]
    })
    .await;
    assert!(
        again,
        "the restarted decode's pair was not warmed again:\n{}",
        proxy.log()
    );
    let r = complete(&proxy, &prompt_of(40, "after the restart"), false).await;
    assert_eq!(r.status(), 200, "{}", proxy.log());
    assert!(
        d.prompt_tokens("external_kv_transfer").await > 0.0,
        "no KV handed over"
    );
}

/// `raw` (an answer's text) with the values of its `id` and `created` members blanked:
/// what differs between two runs of the same request.
fn without_run_stamps(raw: &str) -> String {
    let mut out = raw.to_string();
    for key in ["\"id\":", "\"created\":"] {
        let mut from = 0;
        while let Some(at) = out[from..].find(key).map(|i| from + i + key.len()) {
            let end = at + out[at..].find([',', '}']).unwrap_or(out.len() - at);
            out.replace_range(at..end, "_");
            from = at + 1;
        }
    }
    out
}

/// The proxy asks decode for token ids and a usage chunk, for itself (to continue a
/// broken-off stream elsewhere, to judge the KV handoff). A client that asked for neither
/// gets decode's own stream all the same: every event byte for byte but for its id and
/// creation time, with the `null` ids decode writes when nobody asked (dropping those
/// members is a change a strict client sees). A whole answer, which the proxy puts
/// together from a stream, has decode's text, ends and id members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_proxy_asks_of_decode_for_itself_is_not_in_the_clients_answer() {
    let p = start_sim("prefill", "nixl", &[]).await;
    let d = start_sim("decode", "nixl", &[]).await;
    let proxy = ProxyProcess::start(&args(&[&p], &[&d], &["--protocol", "nixl"])).await;
    let chat = |stream: bool| {
        json!({"model": "sim-model", "max_completion_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": prompt_of(40, "form-chat")}]})
    };
    let cases = [
        ("/v1/completions", completion(&prompt_of(48, "form"), true)),
        ("/v1/chat/completions", chat(true)),
        ("/v1/completions", completion(&prompt_of(48, "form"), false)),
        ("/v1/chat/completions", chat(false)),
    ];
    for (path, body) in cases {
        let through = post(&proxy, path, &body).await.text().await.unwrap();
        let direct = sim::client()
            .post(format!("{}{path}", d.base))
            .json(&body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let case = format!("{path}, stream {}", body["stream"]);
        if body["stream"] == true {
            assert!(direct.contains("\"token_ids\":null"), "{case}: {direct}");
            assert_eq!(
                without_run_stamps(&through),
                without_run_stamps(&direct),
                "{case}: through the proxy, then from decode"
            );
            continue;
        }
        // The members the proxy reads or asks for, whether there and their values.
        let answer = |raw: &str| {
            let v: Value = serde_json::from_str(raw).unwrap_or_else(|e| panic!("{e}: {raw}"));
            let c = &v["choices"][0];
            let member = |v: &Value, k: &str| v.get(k).cloned();
            [
                member(&v, "prompt_token_ids"),
                member(c, "prompt_token_ids"),
                member(c, "token_ids"),
                member(c, "text"),
                c.get("message").and_then(|m| member(m, "content")),
                member(c, "finish_reason"),
                member(c, "stop_reason"),
            ]
        };
        assert_eq!(answer(&through), answer(&direct), "{case}");
    }
}
