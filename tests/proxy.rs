//! `pdctl proxy` against fake engines that record every leg they receive: what each leg
//! carries per protocol, and every failure users of other PD routers complain about
//!: hangs, swallowed errors, silent KV misses, wrong SSE, stranded legs on
//! disconnect, broken request-id correlation, load counted only until headers, health
//! tripped by client 4xx, /v1/models failing with one instance down, keys not sent.

use crate::common;
use crate::common::proxy as fake;

use fake::{
    Behavior, FakeEngine, FakeSupervisor, ProxyProcess, eventually, metric_value, proxy_args,
    sse_events,
};
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::Notify;

const WAIT: Duration = Duration::from_secs(10);

fn client() -> reqwest::Client {
    // A generous timeout: a proxy that hangs fails the test instead of hanging it.
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post(p: &ProxyProcess, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", p.url))
        .json(body)
        .send()
        .await
        .unwrap()
}

fn completion(prompt: &str) -> Value {
    json!({"model": "fake-model", "prompt": prompt, "max_tokens": 20})
}

fn ids(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

// ---------------------------------------------------------------- protocols

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_step_prefills_a_one_token_copy_then_streams_the_original_from_decode() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    // Prefill takes a while to answer: decode must not be asked before it has.
    let prefill_time = Duration::from_millis(200);
    p.behave(Behavior::Delay(prefill_time));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let original = json!({
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50, "stream": true,
        "stream_options": {"include_usage": true}, "temperature": 0.5
    });
    let resp = post(&proxy, "/v1/chat/completions", &original).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks = ids(&events);
    assert!(
        chunks[..3].iter().all(|c| c["served_by"] == "D"),
        "{chunks:?}"
    );
    assert_eq!(
        chunks[3]["usage"]["completion_tokens"], 3,
        "decode's usage chunk is relayed as is"
    );

    let pr = p.received();
    let dr = d.received();
    assert_eq!((pr.len(), dr.len()), (1, 1));
    let pb = &pr[0].body;
    assert_eq!(pr[0].path, "/v1/chat/completions");
    assert_eq!(pb["max_tokens"], 1);
    assert_eq!(pb["max_completion_tokens"], 1);
    assert_eq!(pb["stream"], false);
    assert!(pb.get("stream_options").is_none());
    assert_eq!(pb["messages"], original["messages"]);
    // The original request, asking for token ids too: a stream whose decode breaks off
    // is continued elsewhere from the ids it sent (the client does not get them).
    let mut asked = original.clone();
    asked["return_token_ids"] = json!(true);
    assert_eq!(
        dr[0].body, asked,
        "decode gets the original request, ids asked"
    );
    assert!(
        dr[0].at >= pr[0].at + prefill_time,
        "decode was asked {:?} after prefill, before prefill answered",
        dr[0].at - pr[0].at
    );
    assert_eq!(pr[0].header("x-request-id").unwrap(), request_id);
    assert_eq!(dr[0].header("x-request-id").unwrap(), request_id);

    // One log line per request with where it went.
    assert!(
        eventually(WAIT, || async { proxy.log().contains(&request_id) }).await,
        "{}",
        proxy.log()
    );
    let line = proxy
        .log()
        .lines()
        .find(|l| l.contains(&request_id))
        .unwrap()
        .to_string();
    for part in [
        format!("prefill={}", p.url),
        format!("decode={}", d.url),
        "status=200".to_string(),
    ] {
        assert!(line.contains(&part), "{part} missing in {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_hands_prefills_kv_params_to_decode_unchanged_under_one_request_id() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--protocol", "nixl"])).await;
    let resp = post(&proxy, "/v1/completions", &completion("San Francisco is a")).await;
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["served_by"], "D");
    assert_eq!(answer["usage"]["total_tokens"], 10);

    let pb = &p.received()[0];
    assert_eq!(
        pb.body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    );
    assert_eq!(
        (&pb.body["max_tokens"], &pb.body["stream"]),
        (&json!(1), &json!(false))
    );
    let db = &d.received()[0];
    assert_eq!(
        db.body["kv_transfer_params"],
        json!({"do_remote_prefill": true, "do_remote_decode": false,
               "remote_block_ids": [1, 2, 3], "remote_engine_id": "engine-P",
               "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
               "remote_request_id": "from-prefill"})
    );
    assert_eq!(db.body["max_tokens"], 20);
    assert_eq!(pb.header("x-request-id").unwrap(), rid);
    assert_eq!(db.header("x-request-id").unwrap(), rid);
    let misses = proxy
        .metric("pdctl_proxy_kv_handoff_misses_total{reason=\"prefill_returned_no_kv_transfer_params\"}")
        .await;
    assert_eq!(misses, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_without_returned_params_is_a_counted_and_logged_handoff_miss() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    p.behave(Behavior::NoKvParams);
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--protocol", "nixl"])).await;
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(
        resp.status(),
        200,
        "decode recomputes; the answer is still fine"
    );
    assert!(d.received()[0].body.get("kv_transfer_params").is_none());
    let misses = proxy
        .metric("pdctl_proxy_kv_handoff_misses_total{reason=\"prefill_returned_no_kv_transfer_params\"}")
        .await;
    assert_eq!(misses, 1.0);
    assert!(proxy.log().contains("KV handoff missed"), "{}", proxy.log());
}

/// A fake decode's /metrics as vLLM 0.26+ writes its prompt token counters and the count of
/// prompts it prefilled (its TTFT histogram's), and nothing else: no engine-specific miss
/// counter to lean on.
fn vllm_prompt_sources(compute: u64, external: u64, prefills: u64) -> String {
    let mut page = String::from(
        "# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n\
         # TYPE vllm:prompt_tokens_by_source counter\n",
    );
    for (source, n) in [
        ("local_compute", compute),
        ("local_cache_hit", 0),
        ("external_kv_transfer", external),
    ] {
        page.push_str(&format!(
            "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"{source}\"}} {n}.0\n"
        ));
    }
    page + "vllm:cache_config_info{block_size=\"16\",engine=\"0\"} 1.0\n"
        + &format!(
            "vllm:time_to_first_token_seconds_count{{engine=\"0\",model_name=\"m\"}} {prefills}.0\n"
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_whose_vllm_counters_show_the_prompt_computed_is_an_estimated_miss() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let set_page = |page: String| *d.state.metrics_text.lock().unwrap() = page;
    set_page(vllm_prompt_sources(0, 0, 0));
    // Without --scrape-metrics: decode counters are read anyway.
    let proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--health-interval-ms", "300"])).await;
    // Its answers show no cached tokens (and the proxy is not told decodes report them):
    // the counters' window check finds the miss, as an estimate kept apart from counts.
    let misses = "pdctl_proxy_kv_handoff_misses_estimated_total";
    let received = format!(
        "pdctl_proxy_decode_prompt_tokens_total{{instance=\"{}\",source=\"external_kv_transfer\"}}",
        d.url
    );
    // Let the scraper take its baseline.
    d.wait_scraped().await;
    // A working handoff: 64 tokens arrive, 3 of the last partial block are computed.
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("x"))
            .await
            .status(),
        200
    );
    set_page(vllm_prompt_sources(3, 64, 1));
    proxy.wait_metric(&received, 64.0).await;
    d.wait_scraped().await;
    assert_eq!(proxy.metric(misses).await, 0.0, "{}", proxy.metrics().await);
    // A silent recompute: decode answers normally but computed all 70 tokens itself.
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("y"))
            .await
            .status(),
        200
    );
    set_page(vllm_prompt_sources(73, 64, 2));
    proxy.wait_metric(misses, 1.0).await;
    assert_eq!(
        proxy
            .metric("pdctl_proxy_kv_handoff_unexplained_tokens_total")
            .await,
        70.0 - 16.0,
        "beyond the one block a handoff leaves"
    );
    assert_eq!(
        proxy
            .metric("pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"}")
            .await,
        0.0,
        "an estimate is not counted as a miss"
    );
    let log = proxy.log();
    assert!(
        log.contains(&format!("KV handoff missed: decode {} computed 54", d.url)),
        "{log}"
    );
    // Growth from a prompt that did not pass this proxy is not a miss.
    d.wait_scraped().await;
    set_page(vllm_prompt_sources(1073, 64, 3));
    d.wait_scraped().await;
    assert_eq!(proxy.metric(misses).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_above_one_recomputes_on_decode_for_nixl_and_prefills_once_for_two_step() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let nixl = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--protocol", "nixl"])).await;
    let mut body = completion("x");
    body["n"] = json!(2);
    assert_eq!(post(&nixl, "/v1/completions", &body).await.status(), 200);
    assert_eq!(
        p.count(),
        0,
        "no prefill leg: its KV could serve one choice only"
    );
    assert_eq!(d.received()[0].body, body);
    let reason = "pdctl_proxy_kv_handoff_misses_total{reason=\"n_gt_1_recomputed\"}";
    assert_eq!(nixl.metric(reason).await, 1.0);
    drop(nixl);

    let two = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    assert_eq!(post(&two, "/v1/completions", &body).await.status(), 200);
    assert_eq!(
        p.received()[0].body["n"],
        1,
        "prefill computes the prompt once"
    );
    assert_eq!(d.received()[1].body["n"], 2);
    assert_eq!(two.metric(reason).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_sends_both_legs_at_once_with_the_bootstrap_handshake() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    // Prefill never answers: decode is reached anyway, so the legs really go out together.
    // Decode takes a moment, as a real one pulling the KV does: a decode answering at once
    // could end the stream before a loaded machine has sent the prefill leg at all.
    p.behave(Behavior::Hang);
    d.behave(Behavior::Delay(Duration::from_millis(300)));
    let boot = p.bootstrap_port.to_string();
    let args = proxy_args(
        &[&p],
        &[&d],
        &["--protocol", "mooncake", "--bootstrap-port", &boot],
    );
    let proxy = ProxyProcess::start(&args).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");

    let pb = &p.received()[0];
    let db = &d.received()[0];
    let xfer = format!("xfer-{rid}");
    assert_eq!(
        pb.body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": xfer})
    );
    assert_eq!(
        (&pb.body["max_tokens"], &pb.body["stream"]),
        (&json!(1), &json!(false))
    );
    assert_eq!(
        db.body["kv_transfer_params"],
        json!({"do_remote_prefill": true, "do_remote_decode": false,
               "remote_bootstrap_addr": format!("http://127.0.0.1:{boot}"),
               "remote_engine_id": "engine-P", "transfer_id": xfer})
    );
    assert_eq!(db.body["stream"], true);
    // The stream is over, so the prefill still running in the background was dropped.
    assert!(eventually(WAIT, || async { p.cancelled() == 1 }).await);

    p.behave(Behavior::Normal);
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("y"))
            .await
            .status(),
        200
    );
    assert_eq!(
        p.state.bootstrap_queries.load(Ordering::SeqCst),
        1,
        "the engine id is cached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_prefill_failure_cancels_the_waiting_decode_and_answers_an_error() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    // Prefill fails once decode is already waiting for KV that will never come.
    p.behave(Behavior::DelayedStatus(
        Duration::from_millis(300),
        500,
        json!({"error": {"message": "KV pool exhausted"}}),
    ));
    d.behave(Behavior::Hang);
    let boot = p.bootstrap_port.to_string();
    let args = proxy_args(
        &[&p],
        &[&d],
        &[
            "--protocol",
            "mooncake",
            "--bootstrap-port",
            &boot,
            "--retries",
            "0",
        ],
    );
    let proxy = ProxyProcess::start(&args).await;
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "prefill");
    assert_eq!(err["error"]["instance"], p.url);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV pool exhausted")
    );
    assert_eq!(d.count(), 1, "decode was sent at once");
    assert!(
        eventually(WAIT, || async { d.cancelled() == 1 }).await,
        "the decode leg was cancelled"
    );

    // A failed prefill forgets its cached engine id (it may have restarted); an unreachable
    // bootstrap server is an error that names it.
    p.state.bootstrap_status.store(500, Ordering::SeqCst);
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("http://127.0.0.1:{boot}/query")),
        "{msg}"
    );
    // One query for the request before, one for this one, and no redo: `--retries 0` is
    // the whole budget of retries before the first byte, the request's redo included.
    assert_eq!(p.state.bootstrap_queries.load(Ordering::SeqCst), 2);
    assert_eq!(
        proxy
            .metric("pdctl_proxy_requests_redone_total{reason=\"handshake\"}")
            .await,
        0.0
    );
}

/// Mooncake sends decode at once; when decode streams before prefill has answered and
/// prefill then fails, the failure is still the prefill instance's: counted against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_prefill_failing_after_decode_streams_is_counted_against_prefill() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    p.behave(Behavior::DelayedStatus(
        Duration::from_millis(300),
        500,
        json!({"error": {"message": "KV pool exhausted"}}),
    ));
    let release = Arc::new(Notify::new());
    d.behave(Behavior::Hold(release.clone()));
    let boot = p.bootstrap_port.to_string();
    let args = proxy_args(
        &[&p],
        &[&d],
        &["--protocol", "mooncake", "--bootstrap-port", &boot],
    );
    let proxy = ProxyProcess::start(&args).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    let errors = format!(
        "pdctl_proxy_instance_errors_total{{leg=\"prefill\",instance=\"{}\",kind=\"status_5xx\"}}",
        p.url
    );
    assert!(
        eventually(WAIT, || async { proxy.metric(&errors).await == 1.0 }).await,
        "the prefill failure behind a streaming decode went uncounted"
    );
    release.notify_one();
    while stream.next().await.is_some() {}
}

// ---------------------------------------------------------------- failures

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_is_a_json_error_naming_leg_and_instance_and_decode_is_not_called() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    p.behave(Behavior::Status(
        500,
        json!({"error": {"message": "CUDA out of memory"}}),
    ));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 502);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "prefill");
    assert_eq!(err["error"]["instance"], p.url);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("CUDA out of memory")
    );
    assert_eq!(d.count(), 0);
    assert_eq!(p.count(), 1, "a 500 is not retried");
    let errors = format!(
        "pdctl_proxy_instance_errors_total{{leg=\"prefill\",instance=\"{}\",kind=\"status_5xx\"}}",
        p.url
    );
    assert_eq!(proxy.metric(&errors).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_prefill_times_out_with_504_and_the_leg_is_dropped() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    p.behave(Behavior::Hang);
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--prefill-timeout-s", "1"])).await;
    let resp = post(
        &proxy,
        "/v1/chat/completions",
        &json!({"messages": [], "max_tokens": 5}),
    )
    .await;
    assert_eq!(resp.status(), 504);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "prefill");
    assert_eq!(err["error"]["type"], "timeout_error");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--prefill-timeout-s"), "{msg}");
    assert!(eventually(WAIT, || async { p.cancelled() == 1 }).await);
    assert_eq!(d.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_silent_past_the_first_byte_timeout_is_a_504_naming_decode() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::Hang);
    let proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--first-byte-timeout-s", "1"])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 504);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "decode");
    assert_eq!(err["error"]["instance"], d.url);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--first-byte-timeout-s"), "{msg}");
    assert!(eventually(WAIT, || async { d.cancelled() == 1 }).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_the_total_timeout_ends_with_an_error_event_and_frees_decode() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::Hold(Arc::new(Notify::new())));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--total-timeout-s", "1"])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert_eq!(events.len(), 2, "{events:?}");
    let last: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(last["error"]["type"], "timeout_error");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--total-timeout-s")
    );
    assert!(eventually(WAIT, || async { d.cancelled() == 1 }).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_4xx_reaches_the_client_unchanged_and_never_marks_the_instance_down() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let engine_error = json!({"object": "error", "message": "prompt is too long", "code": 400});
    p.behave(Behavior::Status(400, engine_error.clone()));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--retries", "3"])).await;
    for _ in 0..5 {
        let resp = post(&proxy, "/v1/completions", &completion("x")).await;
        assert_eq!(resp.status(), 400);
        // Which leg and instance said so, beside the engine's own body.
        assert_eq!(resp.headers()["x-pdctl-leg"], "prefill");
        assert_eq!(resp.headers()["x-pdctl-instance"], p.url.as_str());
        assert_eq!(resp.json::<Value>().await.unwrap(), engine_error);
    }
    assert_eq!(p.count(), 5, "4xx is not retried");
    let healthy = format!(
        "pdctl_proxy_instance_healthy{{leg=\"prefill\",instance=\"{}\"}}",
        p.url
    );
    assert_eq!(proxy.metric(&healthy).await, 1.0);
    let m = proxy.metrics().await;
    let errors: f64 = ["connect", "timeout", "status_5xx", "body"]
        .iter()
        .map(|k| {
            metric_value(
                &m,
                &format!(
                    "pdctl_proxy_instance_errors_total{{leg=\"prefill\",instance=\"{}\",kind=\"{k}\"}}",
                    p.url
                ),
            )
        })
        .sum();
    assert_eq!(errors, 0.0);
    p.behave(Behavior::Normal);
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("x"))
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dying_mid_stream_ends_the_stream_with_an_sse_error_event() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::DropMidStream);
    // Without continuations (tests/migration.rs has them): the stream ends with the error.
    let args = proxy_args(&[&p], &[&d], &["--migration-limit", "0"]);
    let proxy = ProxyProcess::start(&args).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert!(!events.contains(&"[DONE]".to_string()), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["leg"], "decode");
    assert_eq!(last["error"]["instance"], d.url);
    assert_eq!(
        events.len(),
        3,
        "two decode chunks, then the error: {events:?}"
    );
    let errors = format!(
        "pdctl_proxy_instance_errors_total{{leg=\"decode\",instance=\"{}\",kind=\"body\"}}",
        d.url
    );
    assert_eq!(proxy.metric(&errors).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_failing_before_its_first_byte_is_a_json_error_not_a_200_stream() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::Status(
        500,
        json!({"error": {"message": "engine dead"}}),
    ));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "decode");
    assert_eq!(err["error"]["instance"], d.url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_is_retried_on_another_instance_which_is_then_skipped() {
    let p = FakeEngine::start("P").await;
    let d = FakeEngine::start("D").await;
    // An engine that passes the start-up probe, then is gone.
    let gone = fake_gone_engine().await;
    let args = vec![
        "--prefill".to_string(),
        gone.url.clone(),
        "--prefill".into(),
        p.url.clone(),
        "--decode".into(),
        d.url.clone(),
        "--health-interval-ms".into(),
        "60000".into(),
    ];
    let proxy = ProxyProcess::start(&args).await;
    gone.kill().await;
    // Round robin starts with the first instance: the gone one.
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        proxy
            .metric("pdctl_proxy_retries_total{leg=\"prefill\"}")
            .await,
        1.0
    );
    let m = proxy.metrics().await;
    let series = |what: &str| format!("{what}{{leg=\"prefill\",instance=\"{}\"}}", gone.url);
    assert_eq!(
        metric_value(&m, &series("pdctl_proxy_instance_healthy")),
        0.0
    );
    let connect = format!(
        "pdctl_proxy_instance_errors_total{{leg=\"prefill\",instance=\"{}\",kind=\"connect\"}}",
        gone.url
    );
    assert_eq!(metric_value(&m, &connect), 1.0);
    for _ in 0..3 {
        assert_eq!(
            post(&proxy, "/v1/completions", &completion("x"))
                .await
                .status(),
            200
        );
    }
    assert_eq!(
        proxy
            .metric("pdctl_proxy_retries_total{leg=\"prefill\"}")
            .await,
        1.0,
        "the refusing instance is out of rotation"
    );
    assert_eq!(p.count(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_503_is_retried_on_the_other_decode() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    d1.behave(Behavior::Status(
        503,
        json!({"error": {"message": "overloaded"}}),
    ));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d1, &d2], &[])).await;
    for _ in 0..4 {
        let resp = post(&proxy, "/v1/completions", &completion("x")).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.json::<Value>().await.unwrap()["served_by"], "D2");
    }
    // Every attempt on D1 was retried on D2 (503 does not take D1 out of rotation).
    let retries = proxy
        .metric("pdctl_proxy_retries_total{leg=\"decode\"}")
        .await;
    assert!(d1.count() >= 1);
    assert_eq!(retries, d1.count() as f64);
}

// ---------------------------------------------------------------- streaming, load, disconnects

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_chunk_reaches_the_client_while_decode_is_still_generating() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let release = Arc::new(Notify::new());
    d.behave(Behavior::Hold(release.clone()));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(
        std::str::from_utf8(&first).unwrap().contains("D-t0"),
        "the first chunk arrived while decode holds the rest"
    );
    release.notify_one();
    let mut rest = Vec::new();
    while let Some(c) = stream.next().await {
        rest.extend_from_slice(&c.unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(
        rest.contains("D-t2") && rest.ends_with("data: [DONE]\n\n"),
        "{rest}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_is_counted_until_the_stream_ends_so_least_loaded_avoids_a_long_stream() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    let release = Arc::new(Notify::new());
    d1.behave(Behavior::Hold(release.clone()));
    d2.behave(Behavior::Hold(release.clone()));
    // The fake holds every stream it writes; whole answers are read whole when they may
    // not be continued (`--migration-limit 0`), so only the client's stream is held.
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d1, &d2],
        &["--decode-policy", "least-loaded", "--migration-limit", "0"],
    ))
    .await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    let first = String::from_utf8(stream.next().await.unwrap().unwrap().to_vec()).unwrap();
    let (busy, idle) = if first.contains("D1") {
        (&d1, &d2)
    } else {
        (&d2, &d1)
    };
    let in_flight = |d: &FakeEngine| {
        format!(
            "pdctl_proxy_instance_in_flight{{leg=\"decode\",instance=\"{}\"}}",
            d.url
        )
    };
    assert_eq!(
        proxy.metric(&in_flight(busy)).await,
        1.0,
        "headers are long gone, the stream is not"
    );
    for _ in 0..3 {
        let r = post(&proxy, "/v1/completions", &completion("y")).await;
        assert_eq!(
            r.json::<Value>().await.unwrap()["served_by"],
            idle.state.name
        );
    }
    release.notify_one();
    while stream.next().await.is_some() {}
    assert!(
        eventually(WAIT, || async {
            proxy.metric(&in_flight(busy)).await == 0.0
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_prefill_cancels_the_prefill_leg() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    p.behave(Behavior::Hang);
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let url = format!("{}/v1/completions", proxy.url);
    let request =
        tokio::spawn(async move { client().post(url).json(&completion("x")).send().await });
    assert!(eventually(WAIT, || async { p.count() == 1 }).await);
    request.abort();
    assert!(
        eventually(WAIT, || async { p.cancelled() == 1 }).await,
        "prefill leg still running after the client left"
    );
    assert_eq!(d.count(), 0);
    assert!(
        eventually(WAIT, || async {
            proxy.metric("pdctl_proxy_client_disconnects_total").await == 1.0
        })
        .await
    );
    let gone = "pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"499\"}";
    assert_eq!(proxy.metric(gone).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_cancels_the_decode_leg() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let release = Arc::new(Notify::new());
    d.behave(Behavior::Hold(release.clone()));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    assert!(
        eventually(WAIT, || async { d.cancelled() == 1 }).await,
        "decode still streaming to nobody"
    );
    let in_flight = format!(
        "pdctl_proxy_instance_in_flight{{leg=\"decode\",instance=\"{}\"}}",
        d.url
    );
    assert!(eventually(WAIT, || async { proxy.metric(&in_flight).await == 0.0 }).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_closing_after_done_completed_even_if_decode_lingers() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::LingerAfterDone(Duration::from_secs(5)));
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &[])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("data: [DONE]") {
        let chunk = stream.next().await.expect("stream ended before [DONE]");
        seen.extend_from_slice(&chunk.unwrap());
    }
    drop(stream);
    let ok = "pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"200\"}";
    assert!(
        eventually(WAIT, || async { proxy.metric(ok).await == 1.0 }).await,
        "a stream read to [DONE] was not counted as a success"
    );
    assert_eq!(
        proxy.metric("pdctl_proxy_client_disconnects_total").await,
        0.0
    );
    let gone = "pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"499\"}";
    assert_eq!(proxy.metric(gone).await, 0.0);
}

// ---------------------------------------------------------------- routing

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_field_pins_the_pair_and_an_unknown_instance_is_named() {
    let (p1, p2) = (FakeEngine::start("P1").await, FakeEngine::start("P2").await);
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    let proxy = ProxyProcess::start(&proxy_args(&[&p1, &p2], &[&d1, &d2], &[])).await;
    let mut body = completion("x");
    body["user"] = json!(format!("prefill={};decode={}", p2.host_port, d1.host_port));
    for _ in 0..3 {
        assert_eq!(post(&proxy, "/v1/completions", &body).await.status(), 200);
    }
    assert_eq!(
        (p1.count(), p2.count(), d1.count(), d2.count()),
        (0, 3, 3, 0)
    );

    body["user"] = json!(format!("decode={}", d2.host_port));
    assert_eq!(post(&proxy, "/v1/completions", &body).await.status(), 200);
    assert_eq!(d2.count(), 1);

    body["user"] = json!("prefill=127.0.0.1:1;decode=127.0.0.1:2");
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["param"], "user");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("127.0.0.1:1") && msg.contains(&p1.host_port),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_and_random_choices_show_in_the_metrics() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    let rr = ProxyProcess::start(&proxy_args(&[&p], &[&d1, &d2], &[])).await;
    for _ in 0..4 {
        post(&rr, "/v1/completions", &completion("x")).await;
    }
    let selected = |d: &FakeEngine| {
        format!(
            "pdctl_proxy_instance_selected_total{{leg=\"decode\",instance=\"{}\"}}",
            d.url
        )
    };
    let m = rr.metrics().await;
    assert_eq!(
        (
            metric_value(&m, &selected(&d1)),
            metric_value(&m, &selected(&d2))
        ),
        (2.0, 2.0)
    );
    drop(rr);
    let random =
        ProxyProcess::start(&proxy_args(&[&p], &[&d1, &d2], &["--policy", "random"])).await;
    for _ in 0..40 {
        post(&random, "/v1/completions", &completion("x")).await;
    }
    let m = random.metrics().await;
    let (a, b) = (
        metric_value(&m, &selected(&d1)),
        metric_value(&m, &selected(&d2)),
    );
    // 40 fair coin flips all landing on one side: probability 2^-39.
    assert!(a > 0.0 && b > 0.0 && a + b == 40.0, "{a} {b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_keeps_a_shared_prefix_together_until_its_instance_is_overloaded() {
    let ps = [
        FakeEngine::start("P1").await,
        FakeEngine::start("P2").await,
        FakeEngine::start("P3").await,
    ];
    let ds = [
        FakeEngine::start("D1").await,
        FakeEngine::start("D2").await,
        FakeEngine::start("D3").await,
    ];
    let proxy = ProxyProcess::start(&proxy_args(
        &ps.iter().collect::<Vec<_>>(),
        &ds.iter().collect::<Vec<_>>(),
        &[
            "--policy",
            "prefix-aware",
            "--scrape-metrics",
            "--health-interval-ms",
            "100",
        ],
    ))
    .await;
    let context = "Shared context #0: This is long context. ".repeat(12);
    for q in 0..6 {
        let body = completion(&format!("{context}Question {q}: Summarize the context."));
        assert_eq!(post(&proxy, "/v1/completions", &body).await.status(), 200);
    }
    let owner = ps.iter().find(|p| p.count() > 0).unwrap();
    assert_eq!(
        owner.count(),
        6,
        "every request with the shared prefix went to one prefill"
    );
    assert_eq!(ds.iter().filter(|d| d.count() > 0).count(), 1);
    assert_eq!(
        proxy
            .metric("pdctl_proxy_prefix_routing_total{leg=\"prefill\",outcome=\"matched\"}")
            .await,
        5.0
    );

    // The owner's engine reports a long queue: load wins and the prefix moves.
    *owner.state.metrics_text.lock().unwrap() =
        "vllm:num_requests_running 40\nvllm:num_requests_waiting 10\n".into();
    let load = format!(
        "pdctl_proxy_instance_engine_load{{leg=\"prefill\",instance=\"{}\"}}",
        owner.url
    );
    assert!(eventually(WAIT, || async { proxy.metric(&load).await == 50.0 }).await);
    let body = completion(&format!("{context}Question 9"));
    assert_eq!(post(&proxy, "/v1/completions", &body).await.status(), 200);
    assert_eq!(owner.count(), 6);
    assert_eq!(
        proxy
            .metric("pdctl_proxy_prefix_routing_total{leg=\"prefill\",outcome=\"rebalanced\"}")
            .await,
        1.0
    );
}

// ---------------------------------------------------------------- limits and input

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_answers_429_with_retry_after() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let proxy = ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--rate-limit", "0.5"])).await;
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("x"))
            .await
            .status(),
        200
    );
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(resp.status(), 429);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error");
    assert_eq!(p.count(), 1);
    assert_eq!(
        proxy
            .metric("pdctl_proxy_rate_limited_total{reason=\"rate\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_queues_a_bounded_number_then_refuses() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let release = Arc::new(Notify::new());
    d.behave(Behavior::Hold(release.clone()));
    // The fake holds every stream it writes; with `--migration-limit 0` the queued whole
    // answer is read whole, so only the client's stream is held.
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d],
        &[
            "--max-concurrent",
            "1",
            "--queue-size",
            "1",
            "--migration-limit",
            "0",
        ],
    ))
    .await;
    let mut streaming = completion("x");
    streaming["stream"] = json!(true);
    let holder = post(&proxy, "/v1/completions", &streaming).await;
    let mut held = holder.bytes_stream();
    held.next().await.unwrap().unwrap();
    let url = format!("{}/v1/completions", proxy.url);
    let queued =
        tokio::spawn(async move { client().post(url).json(&completion("q")).send().await });
    assert!(
        eventually(WAIT, || async {
            proxy.metric("pdctl_proxy_queue_depth").await == 1.0
        })
        .await
    );
    let refused = post(&proxy, "/v1/completions", &completion("r")).await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(
        proxy
            .metric("pdctl_proxy_rate_limited_total{reason=\"concurrency\"}")
            .await,
        1.0
    );
    release.notify_one();
    while held.next().await.is_some() {}
    let queued = queued.await.unwrap().unwrap();
    assert_eq!(
        queued.status(),
        200,
        "the queued request ran once the slot was free"
    );
    assert_eq!(proxy.metric("pdctl_proxy_queued_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_4xx_json_error_and_the_proxy_stays_up() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let mut proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--max-body-bytes", "2000"])).await;
    let c = client();
    let raw = |body: Vec<u8>| {
        c.post(format!("{}/v1/completions", proxy.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{not json".to_vec(), 400, "not valid JSON"),
        (b"[1, 2]".to_vec(), 400, "JSON object"),
        (vec![0xff, 0xfe, 0x00], 400, "not valid JSON"),
        (
            br#"{"prompt": "x", "stream": "yes"}"#.to_vec(),
            400,
            "`stream`",
        ),
        (br#"{"prompt": "x", "user": 5}"#.to_vec(), 400, "`user`"),
        (vec![b' '; 5000], 413, "--max-body-bytes"),
    ];
    for (body, status, says) in cases {
        let resp = raw(body).await.unwrap();
        assert_eq!(resp.status(), status);
        let err: Value = resp.json().await.unwrap();
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{msg}");
    }
    for (method, path) in [
        ("GET", "/v1/completions"),
        ("GET", "/nope"),
        ("POST", "/v1/embeddings"),
    ] {
        let resp = c
            .request(method.parse().unwrap(), format!("{}{path}", proxy.url))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 404, "{method} {path}");
        let err: Value = resp.json().await.unwrap();
        assert!(err["error"]["message"].as_str().unwrap().contains(path));
    }
    assert_eq!(p.count() + d.count(), 0, "nothing bad reached an engine");
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("x"))
            .await
            .status(),
        200
    );
    assert!(proxy.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_required_from_clients_and_the_engine_key_is_sent_on_legs_and_probes() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let proxy = ProxyProcess::start_with_env(
        &proxy_args(&[&p], &[&d], &[]),
        &[
            ("PDCTL_API_KEY", "client-secret"),
            ("PDCTL_ENGINE_API_KEY", "engine-secret"),
        ],
    )
    .await;
    let url = format!("{}/v1/completions", proxy.url);
    let c = client();
    let none = c.post(&url).json(&completion("x")).send().await.unwrap();
    assert_eq!(none.status(), 401);
    assert_eq!(
        none.json::<Value>().await.unwrap()["error"]["type"],
        "authentication_error"
    );
    let wrong = c
        .post(&url)
        .bearer_auth("client-secreT")
        .json(&completion("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let models = c
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    let ok = c
        .post(&url)
        .bearer_auth("client-secret")
        .json(&completion("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    for r in p.received().iter().chain(d.received().iter()) {
        assert_eq!(r.header("authorization").unwrap(), "Bearer engine-secret");
    }
    let probes = p.state.health_auth.lock().unwrap().clone();
    assert!(!probes.is_empty());
    assert!(
        probes
            .iter()
            .all(|a| a.as_deref() == Some("Bearer engine-secret")),
        "{probes:?}"
    );
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(
        c.get(format!("{}/health", proxy.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(format!("{}/metrics", proxy.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_metrics_cannot_be_scraped_is_named_once_per_outage() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let gone = fake_gone_engine().await;
    let args = vec![
        "--prefill".to_string(),
        p.url.clone(),
        "--decode".into(),
        d.url.clone(),
        "--decode".into(),
        gone.url.clone(),
        "--scrape-metrics".into(),
        "--health-interval-ms".into(),
        "100".into(),
    ];
    let proxy = ProxyProcess::start(&args).await;
    gone.kill().await;
    let said = format!("cannot read {}/metrics", gone.url);
    assert!(
        eventually(WAIT, || async { proxy.log().contains(&said) }).await,
        "a failing scrape was silent:\n{}",
        proxy.log()
    );
    // Ten more scrape rounds: still said once.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(proxy.log().matches(&said).count(), 1, "{}", proxy.log());
}

// ---------------------------------------------------------------- health, models

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_merged_and_an_unreachable_instance_does_not_fail_the_list() {
    let p = FakeEngine::start("P").await;
    let d = FakeEngine::start("D").await;
    *d.state.models.lock().unwrap() = vec!["fake-model".into(), "lora-a".into()];
    let gone = fake_gone_engine().await;
    let args = vec![
        "--prefill".to_string(),
        p.url.clone(),
        "--decode".into(),
        d.url.clone(),
        "--decode".into(),
        gone.url.clone(),
        "--health-interval-ms".into(),
        "60000".into(),
    ];
    let proxy = ProxyProcess::start(&args).await;
    gone.kill().await;
    let resp = client()
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let list: Value = resp.json().await.unwrap();
    let ids = common::field_strs(&list["data"], "id");
    assert_eq!(ids, ["fake-model", "lora-a"]);
}

/// An instance whose legs are answered needs no probe as well: each answer is as good as
/// a probe that passed, so under load the proxy sends no probes (their cost would grow with
/// the cluster). Once the requests stop, the probes come back at their interval, and an
/// instance that fails them is still taken out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_that_answer_requests_are_not_probed_until_the_requests_stop() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--health-interval-ms", "100"])).await;
    let probes = |e: &FakeEngine| e.state.health_auth.lock().unwrap().len();
    // Requests for 1.5 s (15 rounds): each round finds both instances answered since
    // the last, but for the round that may run before the first answer.
    let (p0, d0) = (probes(&p), probes(&d));
    let until = std::time::Instant::now() + Duration::from_millis(1500);
    let mut answered = 0;
    while std::time::Instant::now() < until {
        let resp = post(&proxy, "/v1/completions", &completion("x")).await;
        assert_eq!(resp.status(), 200);
        answered += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (p_load, d_load) = (probes(&p) - p0, probes(&d) - d0);
    assert!(answered >= 20, "only {answered} requests in 1.5 s");
    assert!(
        p_load <= 1 && d_load <= 1,
        "probed under load: prefill {p_load}, decode {d_load} times in 15 rounds"
    );
    // Idle: probed again.
    let (p1, d1) = (probes(&p), probes(&d));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (p_idle, d_idle) = (probes(&p) - p1, probes(&d) - d1);
    assert!(
        p_idle >= 5 && d_idle >= 5,
        "idle for 10 rounds, probed only {p_idle} (prefill), {d_idle} (decode) times"
    );
    d.set_health(503);
    let healthy = format!(
        "pdctl_proxy_instance_healthy{{leg=\"decode\",instance=\"{}\"}}",
        d.url
    );
    assert_eq!(proxy.metric(&healthy).await, 1.0);
    assert!(
        eventually(WAIT, || async { proxy.metric(&healthy).await == 0.0 }).await,
        "a decode failing its probes stayed in rotation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_own_probes_and_names_the_missing_leg() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--health-interval-ms", "50"])).await;
    let ready = || async {
        client()
            .get(format!("{}/health?ready", proxy.url))
            .send()
            .await
            .unwrap()
    };
    assert_eq!(ready().await.status(), 200);
    d.set_health(503);
    assert!(eventually(WAIT, || async { ready().await.status() == 503 }).await);
    let body: Value = ready().await.json().await.unwrap();
    assert_eq!(body["missing"], json!(["decode"]));
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode")
    );
    let live = client()
        .get(format!("{}/health", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200, "liveness is the proxy's own");
    let resp = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(resp.status(), 503);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["leg"], "decode");
    // It names the instance, why it is out, and where to look.
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{} (health probe failed", d.url)),
        "{msg}"
    );
    assert!(msg.contains("/health?ready"), "{msg}");
    d.set_health(200);
    assert!(eventually(WAIT, || async { ready().await.status() == 200 }).await);
    assert_eq!(
        post(&proxy, "/v1/completions", &completion("x"))
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_supervisor_decides_usability_and_own_probes_take_over_when_it_is_gone() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    let sup = FakeSupervisor::start(vec![
        (p.url.clone(), "healthy".into()),
        (d1.url.clone(), "healthy".into()),
        (format!("{}/", d2.url), "failed".into()),
    ]);
    let sock = sup.path.display().to_string();
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d1, &d2],
        &["--supervisor-socket", &sock, "--health-interval-ms", "100"],
    ))
    .await;
    for _ in 0..4 {
        post(&proxy, "/v1/completions", &completion("x")).await;
    }
    assert_eq!(
        (d1.count(), d2.count()),
        (4, 0),
        "failed per the supervisor, though its /health is 200"
    );
    sup.set(&format!("{}/", d2.url), "healthy");
    let healthy = format!(
        "pdctl_proxy_instance_healthy{{leg=\"decode\",instance=\"{}\"}}",
        d2.url
    );
    assert!(eventually(WAIT, || async { proxy.metric(&healthy).await == 1.0 }).await);
    sup.set(&d1.url, "unhealthy");
    let d1_healthy = format!(
        "pdctl_proxy_instance_healthy{{leg=\"decode\",instance=\"{}\"}}",
        d1.url
    );
    assert!(eventually(WAIT, || async { proxy.metric(&d1_healthy).await == 0.0 }).await);
    drop(sup);
    // Supervisor gone: own probes see D1 answering /health, so it comes back.
    assert!(eventually(WAIT, || async { proxy.metric(&d1_healthy).await == 1.0 }).await);
    assert!(proxy.log().contains("unreachable"), "{}", proxy.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_exit_2_with_the_flag_to_fix() {
    let out = common::pdctl(&[
        "proxy",
        "--prefill",
        "h:1",
        "--decode",
        "h:2",
        "--protocol",
        "mooncake",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--bootstrap-port"), "{err}");
    let out = common::pdctl(&["proxy", "--prefill", "https://h:1", "--decode", "h:2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prefill"));
    let out = common::pdctl(&["proxy", "--prefill", "h:1", "--decode", "h:2"])
        .env("PDCTL_ENGINE_API_KEY", "line\nbreak")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PDCTL_ENGINE_API_KEY"), "{err}");
}

// ---------------------------------------------------------------- helpers

/// An engine that answers its start-up health probe, then refuses connections.
struct GoneEngine {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl GoneEngine {
    async fn kill(&self) {
        self.task.abort();
        // Wait until the port really refuses.
        let addr = self.url.trim_start_matches("http://").to_string();
        assert!(
            eventually(WAIT, || async {
                tokio::net::TcpStream::connect(&addr).await.is_err()
            })
            .await
        );
    }
}

async fn fake_gone_engine() -> GoneEngine {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await;
        }
    });
    GoneEngine { url, task }
}

/// With the only decode instance restarting, a request waits for it (up to
/// --restart-wait-s) and is answered once it is back; with it failed, or with no wait
/// allowed, the client gets the 503 JSON error with retry-after at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_for_an_instance_that_is_restarting() {
    let p = FakeEngine::start("P").await;
    let d = FakeEngine::start("D").await;
    let sup = FakeSupervisor::start(vec![
        (p.url.clone(), "healthy".into()),
        (d.url.clone(), "healthy".into()),
    ]);
    let sock = sup.path.display().to_string();
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d],
        &["--supervisor-socket", &sock, "--restart-wait-s", "20"],
    ))
    .await;
    let healthy = format!(
        "pdctl_proxy_instance_healthy{{leg=\"decode\",instance=\"{}\"}}",
        d.url
    );
    sup.set(&d.url, "restarting");
    assert!(eventually(WAIT, || async { proxy.metric(&healthy).await == 0.0 }).await);
    let started = std::time::Instant::now();
    let waiting = tokio::spawn({
        let url = proxy.url.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&completion("x"))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        !waiting.is_finished(),
        "the request did not wait for the restart"
    );
    sup.set(&d.url, "healthy");
    assert_eq!(waiting.await.unwrap(), 200);
    assert!(started.elapsed() >= Duration::from_millis(800));
    assert_eq!(
        proxy
            .metric("pdctl_proxy_restart_waits_total{leg=\"decode\"}")
            .await,
        1.0
    );

    // Failed: nothing to wait for.
    sup.set(&d.url, "failed");
    assert!(eventually(WAIT, || async { proxy.metric(&healthy).await == 0.0 }).await);
    let r = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["leg"], "decode");
}

/// --restart-wait-s 0: a restarting instance is not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_restart_wait_fails_at_once() {
    let p = FakeEngine::start("P").await;
    let d = FakeEngine::start("D").await;
    let sup = FakeSupervisor::start(vec![
        (p.url.clone(), "healthy".into()),
        (d.url.clone(), "restarting".into()),
    ]);
    let sock = sup.path.display().to_string();
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d],
        &["--supervisor-socket", &sock, "--restart-wait-s", "0"],
    ))
    .await;
    let started = std::time::Instant::now();
    let r = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// SIGTERM (what `pdctl down` sends): new requests get a 503 JSON with retry-after, a
/// stream still open when the supervisor's deadline nears ends with an error event and
/// `data: [DONE]`, and the proxy is gone before that deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_requests_and_ends_cut_streams_with_an_error_and_done() {
    let p = FakeEngine::start("P").await;
    let d = FakeEngine::start("D").await;
    d.behave(Behavior::Hold(Arc::new(tokio::sync::Notify::new())));
    let dir = common::TempDir::new("proxy-stop");
    let deadline_file = dir.path().join("stop-by");
    let proxy = ProxyProcess::start_with_env(
        &proxy_args(&[&p], &[&d], &[]),
        &[(
            pdctl::control::STOP_DEADLINE_ENV,
            deadline_file.to_str().unwrap(),
        )],
    )
    .await;
    let mut stream = reqwest::Client::new()
        .post(format!("{}/v1/completions", proxy.url))
        .json(&json!({"model": "m", "prompt": "x", "stream": true, "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));

    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    std::fs::write(&deadline_file, (now_ms + 2_000).to_string()).unwrap();
    let sent = std::time::Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(proxy.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // The drain has begun once the proxy's own /health says so.
    let health = format!("{}/health", proxy.url);
    assert!(
        eventually(WAIT, || async {
            reqwest::get(&health).await.is_ok_and(|r| r.status() == 503)
        })
        .await,
        "SIGTERM did not start the drain:\n{}",
        proxy.log()
    );
    let refused = post(&proxy, "/v1/completions", &completion("x")).await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "5");
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{body}"
    );

    let mut rest = String::new();
    while let Ok(Some(chunk)) = stream.chunk().await {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    let waited = sent.elapsed();
    assert!(
        waited < Duration::from_millis(2_000),
        "cut after {waited:?}, past the deadline"
    );
    assert!(
        waited >= Duration::from_millis(1_000),
        "cut after {waited:?}: in-flight requests get the grace"
    );
    let events: Vec<&str> = rest.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{rest}");
    let err: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], 503, "{err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("cut"),
        "{err}"
    );
    assert_eq!(events[1], "data: [DONE]");
}

// ---------------------------------------------------------------- instances found by DNS

/// Writes the hosts file the proxy reads before the system resolver (PDCTL_PROXY_HOSTS_FILE).
fn write_hosts(path: &std::path::Path, lines: &[&str]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// What `/health?ready` lists for one leg: the instance URLs.
async fn listed(proxy: &ProxyProcess, leg: &str) -> Vec<String> {
    let body = common::get_json(&format!("{}/health?ready", proxy.url)).await;
    let mut urls: Vec<String> = body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["leg"] == leg)
        .map(|i| i["url"].as_str().unwrap().to_string())
        .collect();
    urls.sort();
    urls
}

/// The proxy as `pdctl export k8s` runs it: prefill and decode given as names (headless
/// Services) that do not resolve when it starts. It serves 503 until they do, then routes
/// to every address a name lists, and follows addresses that come and go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_resolve_later_become_instances_and_follow_their_addresses() {
    let p1 = FakeEngine::start_at("P1", "127.0.0.2:0").await;
    let p2 = FakeEngine::start_at("P2", &format!("127.0.0.3:{}", p1.port)).await;
    let d = FakeEngine::start("D").await;
    let dir = common::TempDir::new("proxy-hosts");
    let hosts = dir.path().join("hosts");
    write_hosts(&hosts, &["# nothing resolves yet"]);
    let prefill_name = "prefill.pdctl-test.invalid";
    let decode_name = "decode.pdctl-test.invalid";
    let args: Vec<String> = [
        "--prefill-dns",
        &format!("{prefill_name}:{}", p1.port),
        "--decode-dns",
        &format!("{decode_name}:{}", d.port),
        "--health-interval-ms",
        "100",
        "--restart-wait-s",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let proxy = ProxyProcess::start_with_env(
        &args,
        &[("PDCTL_PROXY_HOSTS_FILE", hosts.to_str().unwrap())],
    )
    .await;

    // Nothing resolves: the proxy is up, not ready, and says so for a request.
    let resp = post(&proxy, "/v1/completions", &completion("hello")).await;
    assert_eq!(resp.status(), 503, "no instance yet must be a 503");
    assert!(listed(&proxy, "prefill").await.is_empty());

    // The names resolve: one prefill, one decode.
    write_hosts(
        &hosts,
        &[
            &format!("127.0.0.2 {prefill_name}"),
            &format!("127.0.0.1 {decode_name}"),
        ],
    );
    let ready = || async {
        client()
            .get(format!("{}/health?ready", proxy.url))
            .send()
            .await
            .unwrap()
            .status()
            == 200
    };
    assert!(
        eventually(WAIT, ready).await,
        "the proxy never became ready after the names resolved:\n{}",
        proxy.log()
    );
    let resp = post(&proxy, "/v1/completions", &completion("hello")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!((p1.count(), d.count()), (1, 1));

    // A second pod behind the prefill name: both take requests.
    write_hosts(
        &hosts,
        &[
            &format!("127.0.0.2 {prefill_name}"),
            &format!("127.0.0.3 {prefill_name}"),
            &format!("127.0.0.1 {decode_name}"),
        ],
    );
    assert!(
        eventually(WAIT, || async {
            listed(&proxy, "prefill").await == [p1.url.clone(), p2.url.clone()]
        })
        .await,
        "the second address never became an instance:\n{}",
        proxy.log()
    );
    assert!(
        eventually(WAIT, || async {
            post(&proxy, "/v1/completions", &completion("again")).await;
            p2.count() > 0
        })
        .await,
        "the new instance never got a request"
    );

    // The first pod goes away: it leaves routing, the other takes everything.
    write_hosts(
        &hosts,
        &[
            &format!("127.0.0.3 {prefill_name}"),
            &format!("127.0.0.1 {decode_name}"),
        ],
    );
    assert!(
        eventually(WAIT, || async {
            listed(&proxy, "prefill").await == [p2.url.clone()]
        })
        .await,
        "the vanished address stayed an instance:\n{}",
        proxy.log()
    );
    let before = p1.count();
    for _ in 0..4 {
        assert_eq!(
            post(&proxy, "/v1/completions", &completion("more"))
                .await
                .status(),
            200
        );
    }
    assert_eq!(
        p1.count(),
        before,
        "a request went to the address that left"
    );
    assert!(
        proxy.log().contains("no longer lists it"),
        "{}",
        proxy.log()
    );
}

// ---------------------------------------------------------------- an instance cut off

/// A decode the supervisor reports `unreachable` (its node cut off) while a streamed
/// request waits for its first byte: the leg ends at once, not at the first-byte timeout,
/// and the request is served whole by the other decode, its prefill redone (the KV handed
/// to the lost decode may be gone); the client sees one answer, never a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_cut_off_before_its_first_byte_is_redone_with_its_prefill_elsewhere() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    d1.behave(Behavior::Hang);
    let sup = FakeSupervisor::start(vec![
        (p.url.clone(), "healthy".into()),
        (d1.url.clone(), "healthy".into()),
        (d2.url.clone(), "starting".into()),
    ]);
    let sock = sup.path.display().to_string();
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d1, &d2],
        &["--supervisor-socket", &sock],
    ))
    .await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let started = std::time::Instant::now();
    let waiting = tokio::spawn({
        let url = proxy.url.clone();
        async move {
            let resp = client()
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), sse_events(resp).await)
        }
    });
    assert!(eventually(WAIT, || async { d1.count() == 1 }).await);
    sup.set(&d2.url, "healthy");
    sup.set(&d1.url, "unreachable");
    let (status, events) = waiting.await.unwrap();
    let took = started.elapsed();
    assert_eq!(status, 200);
    let served: Vec<String> = ids(&events)
        .iter()
        .map(|e| e["served_by"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(served, ["D2", "D2", "D2"], "one whole answer: {events:?}");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!((p.count(), d2.count()), (2, 1), "prefill redone once");
    assert!(eventually(WAIT, || async { d1.cancelled() == 1 }).await);
    assert!(proxy.log().contains("is unreachable"), "{}", proxy.log());
}

/// A stream already relaying when its decode is found unreachable ends with an SSE error
/// event naming the instance and "unreachable", then `data: [DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_decode_is_cut_off_ends_with_an_error_event_then_done() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    d.behave(Behavior::Hold(Arc::new(Notify::new())));
    let sup = FakeSupervisor::start(vec![
        (p.url.clone(), "healthy".into()),
        (d.url.clone(), "healthy".into()),
    ]);
    let sock = sup.path.display().to_string();
    let proxy =
        ProxyProcess::start(&proxy_args(&[&p], &[&d], &["--supervisor-socket", &sock])).await;
    let mut body = completion("x");
    body["stream"] = json!(true);
    let resp = post(&proxy, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    sup.set(&d.url, "unreachable");
    let mut rest = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        while let Some(chunk) = stream.next().await {
            rest.extend_from_slice(&chunk.unwrap());
        }
    })
    .await;
    assert!(read.is_ok(), "the stream ends soon after the finding");
    let text = String::from_utf8(rest).unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.trim_start_matches("data: "))
        .collect();
    assert_eq!(events.len(), 2, "{text}");
    let err: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(err["error"]["instance"], d.url);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&d.url) && msg.contains("unreachable"), "{msg}");
    assert_eq!(events[1], "[DONE]");
    assert!(eventually(WAIT, || async { d.cancelled() == 1 }).await);
}

/// Without a supervisor, a decode whose /health hangs while its port still takes TCP
/// connections is busy, not cut off (a saturated vLLM's /health is slow): the leg waiting on
/// it is neither ended nor redone elsewhere, and nothing calls it unreachable. (Where the port
/// takes no connection either, the instance is unreachable and its legs end: the partition
/// tests cut a link for that.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_a_decode_whose_health_hangs_but_takes_connections_keeps_its_legs() {
    let p = FakeEngine::start("P").await;
    let (d1, d2) = (FakeEngine::start("D1").await, FakeEngine::start("D2").await);
    d1.behave(Behavior::Hang);
    d2.set_health(503);
    let proxy = ProxyProcess::start(&proxy_args(
        &[&p],
        &[&d1, &d2],
        &["--health-interval-ms", "200"],
    ))
    .await;
    let waiting = tokio::spawn({
        let url = proxy.url.clone();
        async move {
            client()
                .post(format!("{url}/v1/completions"))
                .json(&completion("x"))
                .send()
                .await
        }
    });
    assert!(eventually(WAIT, || async { d1.count() == 1 }).await);
    d2.set_health(200);
    d1.set_health(0);
    // Several probe intervals (a wait for nothing to happen: no condition ends it sooner).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiting.is_finished(),
        "the leg on the busy decode was ended"
    );
    assert_eq!(p.count(), 1, "prefill not redone");
    assert_eq!(d2.count(), 0, "not redone on the other decode");
    assert!(!proxy.log().contains("unreachable"), "{}", proxy.log());
    waiting.abort();
}
