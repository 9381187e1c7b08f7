//! `pdctl sim` driven over HTTP as a real process: both endpoints whole and streamed,
//! errors, metrics, the prefix cache, the three KV handoffs, faults, start-up delay and
//! cancellation. Run alone with `cargo test --test sim`.

use crate::common;
use crate::common::sim as simh;

use common::{TempDir, free_port, pdctl};
use serde_json::{Value, json};
use simh::{SimProc, client, prompt_of, sse_events};
use std::time::{Duration, Instant};

const ZERO: &[&str] = &[
    "--prefill-ms-per-token",
    "0",
    "--overhead-ms",
    "0",
    "--itl-ms",
    "0",
    "--batch-slowdown",
    "0",
];

/// `base` flag/value pairs with the flags in `more` added or overriding them.
fn args<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for pair in base.chunks(2) {
        if !more.contains(&pair[0]) {
            out.extend_from_slice(pair);
        }
    }
    out.extend_from_slice(more);
    out
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn completions_answer_like_vllm_and_the_same_on_every_instance() {
    let a = SimProc::start(ZERO).await;
    let b = SimProc::start(ZERO).await;
    let req = json!({"model": "sim-model", "prompt": "San Francisco is a", "max_tokens": 30, "temperature": 0});
    let (s, r) = a.post("/v1/completions", &req).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(r["model"], "sim-model");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["prompt_tokens"], 4);
    assert_eq!(r["usage"]["completion_tokens"], 30);
    assert_eq!(r["usage"]["total_tokens"], 34);
    let text = text_of(&r);
    assert_eq!(
        text.split_whitespace().count() + text.matches([',', '.']).count(),
        30,
        "{text}"
    );
    let (_, r2) = b.post("/v1/completions", &req).await;
    assert_eq!(
        text_of(&r2),
        text,
        "same prompt, same text on another process"
    );
    let (_, r3) = a
        .post(
            "/v1/completions",
            &json!({"prompt": "Tell me about Roger Federer", "max_tokens": 30}),
        )
        .await;
    assert_ne!(text_of(&r3), text);
}

#[tokio::test]
async fn chat_answers_like_vllm_and_honours_max_completion_tokens() {
    let sim = SimProc::start(ZERO).await;
    let msgs =
        json!([{"role": "user", "content": "Tell me about the absolute legend Roger Federer"}]);
    let (s, r) = sim
        .post(
            "/v1/chat/completions",
            &json!({"model": "sim-model", "messages": msgs, "max_tokens": 30}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 30);
    let content = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.starts_with(' '), "{content}");
    let (_, r2) = sim
        .post(
            "/v1/chat/completions",
            &json!({"messages": msgs, "max_tokens": 30, "max_completion_tokens": 5}),
        )
        .await;
    assert_eq!(r2["usage"]["completion_tokens"], 5);
    assert!(content.starts_with(r2["choices"][0]["message"]["content"].as_str().unwrap()));
}

#[tokio::test]
async fn streams_carry_the_same_text_with_sse_framing_and_usage() {
    let sim = SimProc::start(&args(ZERO, &["--itl-ms", "1"])).await;
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "San Francisco is a", "max_tokens": 12}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12}),
        ),
    ] {
        let chat = path.contains("chat");
        let (_, whole) = sim.post(path, &body).await;
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        sbody["stream_options"] = json!({"include_usage": true});
        let r = client()
            .post(sim.url(path))
            .json(&sbody)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        let events = sse_events(&r.text().await.unwrap());
        assert_eq!(events.last().unwrap(), &json!("[DONE]"), "{events:?}");
        let usage = &events[events.len() - 2];
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 12);
        assert_eq!(usage["usage"], whole["usage"]);
        let chunks = &events[..events.len() - 2];
        let mut text = String::new();
        for c in chunks {
            assert_eq!(
                c["object"],
                if chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }
            );
            assert_eq!(c["usage"], Value::Null);
            let ch = &c["choices"][0];
            text.push_str(if chat {
                ch["delta"]["content"].as_str().unwrap_or("")
            } else {
                ch["text"].as_str().unwrap()
            });
        }
        if chat {
            assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        }
        let expected = if chat {
            whole["choices"][0]["message"]["content"].clone()
        } else {
            whole["choices"][0]["text"].clone()
        };
        assert_eq!(json!(text), expected, "{path}");
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
        assert!(
            chunks[..chunks.len() - 1]
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null())
        );
        // Without include_usage: no usage chunk; the other chunks as with it (vLLM 0.32
        // writes no usage field in either).
        let mut plain = body.clone();
        plain["stream"] = json!(true);
        let r = client()
            .post(sim.url(path))
            .json(&plain)
            .send()
            .await
            .unwrap();
        let events = sse_events(&r.text().await.unwrap());
        assert_eq!(events.len(), chunks.len() + 1, "{events:?}");
        assert!(
            events[..events.len() - 1]
                .iter()
                .all(|e| e.get("usage").is_none() && !e["choices"].as_array().unwrap().is_empty())
        );
        assert!(
            chunks.iter().all(|c| c.get("usage").is_none()),
            "{chunks:?}"
        );
    }
}

#[tokio::test]
async fn stop_strings_min_tokens_eos_and_n() {
    let sim = SimProc::start(ZERO).await;
    let p = "San Francisco is a";
    let (_, base) = sim
        .post("/v1/completions", &json!({"prompt": p, "max_tokens": 20}))
        .await;
    let text = text_of(&base);
    // Stop on the 4th word onward: the text ends right before it.
    let stop_word = text
        .split(' ')
        .filter(|w| w.len() > 2 && !w.contains([',', '.']))
        .nth(3)
        .unwrap()
        .to_string();
    let stop = format!(" {stop_word}");
    let cut = text.find(&stop).unwrap();
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 20, "stop": [stop.clone(), "zzz"]}),
        )
        .await;
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_eq!(r["choices"][0]["stop_reason"], json!(stop));
    assert_eq!(text_of(&r), text[..cut]);
    // The same through a stream: the text held back never leaks the stop string.
    let s = client()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": p, "max_tokens": 20, "stop": stop, "stream": true}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&s.text().await.unwrap());
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text[..cut]);
    // include_stop_str_in_output keeps it.
    let (_, r) = sim.post("/v1/completions", &json!({"prompt": p, "max_tokens": 20, "stop": stop, "include_stop_str_in_output": true})).await;
    assert_eq!(text_of(&r), text[..cut + stop.len()]);
    // min_tokens beyond the stop point: the stop string is not checked until then.
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 20, "min_tokens": 20, "stop": stop}),
        )
        .await;
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(text_of(&r), text);
    // No max_tokens: the answer ends on its own (EOS) with finish_reason stop.
    let (_, r) = sim.post("/v1/completions", &json!({"prompt": p})).await;
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["choices"][0]["stop_reason"], Value::Null);
    let natural = r["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((48..256).contains(&natural), "{natural}");
    // ignore_eos runs to max_tokens; min_tokens pushes EOS out.
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 300, "ignore_eos": true}),
        )
        .await;
    assert_eq!(r["usage"]["completion_tokens"], 300);
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 300, "min_tokens": 280}),
        )
        .await;
    assert_eq!(r["usage"]["completion_tokens"], 280);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // n = 2 and a batch of two prompts.
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 5, "n": 2, "user": "alice"}),
        )
        .await;
    let ch = r["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 2);
    assert_eq!(
        (ch[0]["index"].as_u64(), ch[1]["index"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(r["usage"]["completion_tokens"], 10);
    assert_eq!(r["usage"]["prompt_tokens"], 4);
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": [p, "other words"], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r["choices"].as_array().unwrap().len(), 2);
    assert_eq!(r["usage"]["prompt_tokens"], 6);
    // Token-id prompts give the same answer as the text they encode.
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": [[1, 2, 3]], "max_tokens": 5}),
        )
        .await;
    let (_, r2) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 5}),
        )
        .await;
    assert_eq!(text_of(&r), text_of(&r2));
}

#[tokio::test]
async fn bad_requests_get_vllm_shaped_errors() {
    let sim = SimProc::start(&args(ZERO, &["--max-model-len", "64"])).await;
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "/v1/completions",
            "{\"prompt\": ".into(),
            400,
            "not a valid JSON",
        ),
        (
            "/v1/completions",
            "[1,2]".into(),
            400,
            "not a valid JSON object",
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string(),
            400,
            "prompt is required",
        ),
        (
            "/v1/chat/completions",
            json!({"prompt": "x"}).to_string(),
            400,
            "messages is required",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            "messages must be a list",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 3}]}).to_string(),
            400,
            "messages[0].content",
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}).to_string(),
            400,
            "prompt must be a string or a list",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "ten"}).to_string(),
            400,
            "max_tokens: invalid type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": "yes"}).to_string(),
            400,
            "stream: invalid type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}).to_string(),
            400,
            "at least 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 64}).to_string(),
            400,
            "exceed the context length of 64",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompt_of(70, "w")}).to_string(),
            400,
            "no room in the context length",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}).to_string(),
            400,
            "n must be between",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "min_tokens": 5, "max_tokens": 2}).to_string(),
            400,
            "min_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": 7}).to_string(),
            400,
            "stop must be",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": "gpt-4"}).to_string(),
            404,
            "`gpt-4` does not exist",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (s, r) = sim.post_raw(path, &body).await;
        assert_eq!(s, status, "{body} -> {r}");
        let e = &r["error"];
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{body}: {e}"
        );
        assert_eq!(e["code"], status, "{e}");
        assert!(e["type"].as_str().unwrap().ends_with("Error"), "{e}");
    }
    let (s, body) = sim.get("/v2/nothing").await;
    assert_eq!(s, 404);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        404
    );
    let r = client()
        .get(sim.url("/v1/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], 405);
    // The sim is still fine afterwards.
    let (s, _) = sim
        .post("/v1/completions", &json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(s, 200);
}

/// `[model] max_model_len` reaches the sim the planner starts, which then refuses what
/// vLLM would: a prompt (or prompt plus max_tokens) longer than 1024 tokens gets a 400.
#[tokio::test]
async fn a_planned_sim_refuses_prompts_beyond_the_models_max_model_len() {
    use pdctl::plan::{PlanInput, build_plan};
    use pdctl::topology::{Source, load_str};
    let port = free_port();
    let state = TempDir::new("planned-sim");
    let text = format!(
        "[model]\nname = \"sim-model\"\nmax_model_len = 1024\n[engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"nixl\"\n[decode]\nbase_port = {port}\n"
    );
    let t = load_str(
        &text,
        Source::Profile("inline".into()),
        "inline.toml".into(),
    )
    .unwrap();
    let plan = build_plan(&PlanInput {
        topology: &t.spec,
        head: &t.head,
        gpus: &[],
        gpu_note: None,
        model: Err("not read in this test".into()),
        version: None,
        version_source: pdctl::vocab::VersionSource::Pinned,
        state_root: state.path().to_path_buf(),
        local_node: None,
        held: Default::default(),
    })
    .unwrap();
    let svc = plan.service("decode-0").unwrap();
    // Its settings are in a generated file, written before the start as the supervisor does.
    for f in &svc.files {
        std::fs::create_dir_all(f.path.parent().unwrap()).unwrap();
        std::fs::write(&f.path, &f.content).unwrap();
    }
    let argv = &svc.argv;
    assert_eq!(argv[..2], ["pdctl", "sim"], "{argv:?}");
    let sim = SimProc::start_argv(port, &argv[2..]).await;
    let (s, r) = sim
        .post("/v1/completions", &json!({"prompt": prompt_of(1025, "w")}))
        .await;
    assert_eq!(s, 400, "{r}");
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("1025 tokens") && message.contains("context length of 1024"),
        "{r}"
    );
    let (s, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": prompt_of(1000, "w"), "max_tokens": 30}),
        )
        .await;
    assert_eq!(s, 400, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("1030 tokens exceed the context length of 1024"),
        "{r}"
    );
    let (s, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": prompt_of(1000, "w"), "max_tokens": 4}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 1000);
}

#[tokio::test]
async fn it_says_it_is_a_simulator_and_exposes_vllm_metric_names() {
    let sim = SimProc::start(ZERO).await;
    let (_, v) = sim.get("/version").await;
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["simulator"], true);
    assert_eq!(v["engine"], "pdctl-sim");
    let (_, m) = sim.get("/v1/models").await;
    let m: Value = serde_json::from_str(&m).unwrap();
    assert_eq!(m["data"][0]["id"], "sim-model");
    assert_eq!(m["data"][0]["owned_by"], "pdctl-sim");
    let first = sim.log().lines().next().unwrap_or_default().to_string();
    assert!(first.contains("SIMULATED engine, not vLLM"), "{first}");
    assert_eq!(sim.get("/health").await.0, 200);
    sim.post(
        "/v1/completions",
        &json!({"prompt": "a b c", "max_tokens": 3}),
    )
    .await;
    let (_, text) = sim.get("/metrics").await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:inter_token_latency_seconds_bucket",
        "pdctl_sim_kv_handoffs_received_total",
        "pdctl_sim_kv_handoffs_missed_total",
        "pdctl_sim_kv_handoffs_sent_total",
        "pdctl_sim_kv_blocks_held",
        "pdctl_sim_requests_aborted_total",
        "pdctl_sim_connections_accepted_total",
    ] {
        assert!(
            simh::metric_in(&text, name).is_some(),
            "{name} missing:\n{text}"
        );
    }
    assert_eq!(
        simh::metric_in(&text, "vllm:prompt_tokens_total"),
        Some(3.0)
    );
    assert_eq!(
        simh::metric_in(&text, "vllm:generation_tokens_total"),
        Some(3.0)
    );
    assert_eq!(
        simh::metric_in(&text, "vllm:request_success_total"),
        Some(1.0)
    );
    assert_eq!(
        simh::metric_in(&text, "vllm:time_to_first_token_seconds_count"),
        Some(1.0)
    );
    // Three tokens, two gaps between them.
    assert_eq!(
        simh::metric_in(&text, "vllm:inter_token_latency_seconds_count"),
        Some(2.0)
    );
}

#[tokio::test]
async fn repeating_a_request_makes_the_prefix_cache_hit_rate_climb() {
    let sim = SimProc::start(ZERO).await;
    let req = json!({"prompt": prompt_of(64, "w"), "max_tokens": 4});
    let mut rates = Vec::new();
    let mut cached = Vec::new();
    for _ in 0..4 {
        let (_, r) = sim.post("/v1/completions", &req).await;
        assert_eq!(r["usage"]["prompt_tokens"], 64);
        cached.push(
            r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
        let hits = sim.metric("vllm:prefix_cache_hits_total").await;
        let queries = sim.metric("vllm:prefix_cache_queries_total").await;
        rates.push((hits / queries * 10000.0).round() / 100.0);
    }
    // As vLLM: the prompt's last token is computed, so a prompt of four whole blocks
    // reuses three and computes the fourth.
    assert_eq!(cached, [0, 48, 48, 48]);
    assert_eq!(rates, [0.0, 37.5, 50.0, 56.25]);
    // A prompt sharing the first 32 tokens hits 2 blocks; its partial tail is computed.
    let mut other = prompt_of(32, "w");
    other.push_str(" different words here");
    let (_, r) = sim
        .post(
            "/v1/completions",
            &json!({"prompt": other, "max_tokens": 1}),
        )
        .await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    // A cache of 4 blocks forgets the oldest prompt.
    let small = SimProc::start(&args(ZERO, &["--cache-blocks", "4"])).await;
    let a = json!({"prompt": prompt_of(64, "a"), "max_tokens": 1});
    let b = json!({"prompt": prompt_of(64, "b"), "max_tokens": 1});
    small.post("/v1/completions", &a).await;
    small.post("/v1/completions", &b).await;
    let (_, r) = small.post("/v1/completions", &a).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let stats = SimProc::start(&args(ZERO, &["--log-stats-interval-ms", "100"])).await;
    stats.post("/v1/completions", &req).await;
    stats.post("/v1/completions", &req).await;
    assert!(
        stats
            .wait_log("Prefix cache hit rate: 37.50%", Duration::from_secs(5))
            .await,
        "{}",
        stats.log()
    );
}

#[tokio::test]
async fn prefill_cost_is_paid_for_uncached_tokens_only() {
    let sim = SimProc::start(&[
        "--prefill-ms-per-token",
        "2",
        "--overhead-ms",
        "0",
        "--itl-ms",
        "0",
    ])
    .await;
    let req = json!({"prompt": prompt_of(160, "t"), "max_tokens": 1});
    let t = Instant::now();
    let (_, r) = sim.post("/v1/completions", &req).await;
    let first = t.elapsed();
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(
        first >= Duration::from_millis(320),
        "160 tokens at 2 ms each took {first:?}"
    );
    let (_, r) = sim.post("/v1/completions", &req).await;
    // Ten whole blocks: the last one holds the prompt's last token and is computed again.
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 144);
    assert_eq!(
        sim.metric("vllm:time_to_first_token_seconds_count").await,
        2.0
    );
    // The histogram saw one request at >= 0.25 s and one well under it.
    let (_, text) = sim.get("/metrics").await;
    let le = |b: &str| -> f64 {
        text.lines()
            .find(|l| {
                l.starts_with("vllm:time_to_first_token_seconds_bucket")
                    && l.contains(&format!("le=\"{b}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap()
    };
    assert_eq!(le("0.25"), 1.0, "{text}");
    assert_eq!(le("0.5"), 2.0, "{text}");
}

#[tokio::test]
async fn max_num_seqs_makes_requests_wait() {
    let sim = SimProc::start(&[
        "--itl-ms",
        "20",
        "--max-num-seqs",
        "1",
        "--overhead-ms",
        "0",
    ])
    .await;
    let url = sim.url("/v1/completions");
    let body = json!({"prompt": "hi", "max_tokens": 15});
    let h1 = tokio::spawn(client().post(url.clone()).json(&body).send());
    let h2 = tokio::spawn(client().post(url).json(&body).send());
    let mut saw = (false, false);
    for _ in 0..100 {
        let (_, text) = sim.get("/metrics").await;
        saw.0 |= simh::metric_in(&text, "vllm:num_requests_running") == Some(1.0);
        saw.1 |= simh::metric_in(&text, "vllm:num_requests_waiting") == Some(1.0);
        if saw.0 && saw.1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(saw.0 && saw.1, "running 1 and waiting 1 seen: {saw:?}");
    assert_eq!(h1.await.unwrap().unwrap().status(), 200);
    assert_eq!(h2.await.unwrap().unwrap().status(), 200);
    // A client that gives up while waiting for a slot counts as aborted, and frees it.
    let slow = sim.url("/v1/completions");
    let h3 = tokio::spawn(client().post(slow).json(&body).send());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = reqwest::Client::new()
        .post(sim.url("/v1/completions"))
        .json(&body)
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(r.is_err());
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            sim.metric("pdctl_sim_requests_aborted_total").await == 1.0
        })
        .await
    );
    assert_eq!(h3.await.unwrap().unwrap().status(), 200);
    assert_eq!(sim.metric("vllm:num_requests_waiting").await, 0.0);
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
}

/// A decode answer must equal what a plain engine says for the same request.
async fn plain_answer(req: &Value) -> Value {
    let plain = SimProc::start(ZERO).await;
    plain.post("/v1/completions", req).await.1
}

#[tokio::test]
async fn shared_dir_handoff_two_step() {
    let dir = TempDir::new("kv");
    let d = dir.path().to_str().unwrap();
    let p = SimProc::start(&args(
        ZERO,
        &[
            "--role",
            "prefill",
            "--handoff",
            "shared-dir",
            "--kv-dir",
            d,
        ],
    ))
    .await;
    let dsim = SimProc::start(&args(
        ZERO,
        &["--role", "decode", "--handoff", "shared-dir", "--kv-dir", d],
    ))
    .await;
    let req = json!({"prompt": prompt_of(70, "s"), "max_tokens": 8});
    let mut first = req.clone();
    first["max_tokens"] = json!(1);
    let (s, _) = p.post("/v1/completions", &first).await;
    assert_eq!(s, 200);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        4,
        "4 full blocks of 16 tokens"
    );
    let (s, r) = dsim.post("/v1/completions", &req).await;
    assert_eq!(s, 200);
    assert_eq!(r["choices"], plain_answer(&req).await["choices"]);
    assert_eq!(
        dsim.metric("pdctl_sim_kv_handoffs_received_total").await,
        1.0
    );
    assert_eq!(
        dsim.metric("pdctl_sim_kv_handoff_tokens_received_total")
            .await,
        64.0
    );
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 0.0);
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_sent_total").await, 1.0);
    assert!(
        dsim.log().contains("KV handoff received 64 tokens from"),
        "{}",
        dsim.log()
    );
    // Broken handoff: the decode gets a prompt the prefill never saw.
    let (s, _) = dsim
        .post(
            "/v1/completions",
            &json!({"prompt": prompt_of(40, "never"), "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 1.0);
    assert!(
        dsim.log()
            .contains("KV handoff missed (block 1 of 2 is not in"),
        "{}",
        dsim.log()
    );
    assert!(dsim.log().contains("recomputing 40 tokens"));
}

/// What vLLM's decode counters would say, read from the sim's: prompt tokens by source
/// and the external prefix cache lookups.
async fn by_source(sim: &SimProc) -> [f64; 5] {
    [
        sim.prompt_tokens("local_compute").await,
        sim.prompt_tokens("local_cache_hit").await,
        sim.prompt_tokens("external_kv_transfer").await,
        sim.metric("vllm:external_prefix_cache_queries_total").await,
        sim.metric("vllm:external_prefix_cache_hits_total").await,
    ]
}

#[tokio::test]
async fn a_decode_counts_prompt_tokens_by_source_and_a_lost_handoff_as_local_compute() {
    let dir = TempDir::new("kv");
    let d = dir.path().to_str().unwrap();
    let role = |r| {
        args(
            ZERO,
            &["--role", r, "--handoff", "shared-dir", "--kv-dir", d],
        )
    };
    let p = SimProc::start(&role("prefill")).await;
    let dsim = SimProc::start(&role("decode")).await;
    let (s, _) = p
        .post(
            "/v1/completions",
            &json!({"prompt": prompt_of(70, "src"), "max_tokens": 1}),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(by_source(&dsim).await, [0.0; 5]);
    // Working handoff: 4 full blocks arrive, the 6-token tail is computed here.
    let req = json!({"prompt": prompt_of(70, "src"), "max_tokens": 2});
    let (_, r) = dsim.post("/v1/completions", &req).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    assert_eq!(by_source(&dsim).await, [6.0, 0.0, 64.0, 70.0, 64.0]);
    // The same prompt again: its blocks are in the decode's own cache now, no handoff.
    let (_, r) = dsim.post("/v1/completions", &req).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    assert_eq!(by_source(&dsim).await, [12.0, 64.0, 64.0, 70.0, 64.0]);
    // A lost handoff: the answer is normal, the whole prompt is computed locally.
    let (s, _) = dsim
        .post("/sim/fault", &json!({"fail_handoff_next": 1}))
        .await;
    assert_eq!(s, 200);
    let other = json!({"prompt": prompt_of(70, "other"), "max_tokens": 2});
    p.post("/v1/completions", &other).await;
    let (s, r) = dsim.post("/v1/completions", &other).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(by_source(&dsim).await, [82.0, 64.0, 64.0, 140.0, 64.0]);
    assert_eq!(dsim.metric("pdctl_sim_faults_injected_total").await, 1.0);
    assert!(
        dsim.log()
            .contains("KV handoff missed (fault injection (fail_handoff_next)"),
        "{}",
        dsim.log()
    );
    // The fault was used up: the next handoff of that prompt works again.
    let third = json!({"prompt": prompt_of(70, "third"), "max_tokens": 2});
    p.post("/v1/completions", &third).await;
    dsim.post("/v1/completions", &third).await;
    assert_eq!(by_source(&dsim).await, [88.0, 64.0, 128.0, 210.0, 128.0]);
    // A prompt of whole blocks, as on vLLM: the handoff brings the blocks before its last
    // token (48 of 64) and decode computes the last block.
    let whole = json!({"prompt": prompt_of(64, "whole"), "max_tokens": 2});
    p.post("/v1/completions", &whole).await;
    let (_, r) = dsim.post("/v1/completions", &whole).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 48);
    assert_eq!(by_source(&dsim).await, [104.0, 64.0, 176.0, 274.0, 176.0]);
}

async fn engine_id(sim: &SimProc) -> String {
    let v: Value = serde_json::from_str(&sim.get("/version").await.1).unwrap();
    v["engine_id"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn nixl_handoff_prefill_returns_params_and_decode_pulls() {
    let p = SimProc::start(&args(ZERO, &["--role", "prefill", "--handoff", "nixl"])).await;
    let dsim = SimProc::start(&args(ZERO, &["--role", "decode", "--handoff", "nixl"])).await;
    let req = json!({"prompt": prompt_of(64, "n"), "max_tokens": 6});
    let mut leg = req.clone();
    leg["max_tokens"] = json!(1);
    leg["stream"] = json!(false);
    leg["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let r = client()
        .post(p.url("/v1/completions"))
        .header("X-Request-Id", "abc-123")
        .json(&leg)
        .send()
        .await
        .unwrap();
    let r: Value = r.json().await.unwrap();
    let kv = r["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true, "{r}");
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(kv["remote_engine_id"], json!(engine_id(&p).await));
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert_eq!(kv["remote_port"], p.port);
    assert_eq!(kv["remote_request_id"], "cmpl-abc-123");
    assert_eq!(kv["remote_block_ids"].as_array().unwrap().len(), 4);
    assert_eq!(kv["tp_size"], 1);
    assert_eq!(p.metric("pdctl_sim_kv_blocks_held").await, 4.0);
    let mut dreq = req.clone();
    dreq["kv_transfer_params"] = kv.clone();
    let (s, r) = dsim.post("/v1/completions", &dreq).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"], plain_answer(&req).await["choices"]);
    assert!(r.get("kv_transfer_params").is_none());
    assert_eq!(
        dsim.metric("pdctl_sim_kv_handoffs_received_total").await,
        1.0
    );
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 0.0);
    assert_eq!(
        p.metric("pdctl_sim_kv_blocks_held").await,
        0.0,
        "pulled blocks are freed"
    );
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_sent_total").await, 1.0);
    assert!(
        dsim.log()
            .contains("KV handoff received 48 tokens from pdctl-sim-"),
        "{}",
        dsim.log()
    );
    // The same params again: the blocks are gone, so the decode recomputes and says so.
    let mut other = dreq.clone();
    other["prompt"] = json!(prompt_of(64, "m"));
    let (s, _) = dsim.post("/v1/completions", &other).await;
    assert_eq!(s, 200);
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 1.0);
    assert!(dsim.log().contains("KV handoff missed ("), "{}", dsim.log());
    // A prefill that is gone: a miss, not an error.
    drop(p);
    let mut gone = dreq.clone();
    gone["prompt"] = json!(prompt_of(64, "q"));
    let (s, _) = dsim.post("/v1/completions", &gone).await;
    assert_eq!(s, 200);
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 2.0);
    assert!(dsim.log().contains("cannot reach http://127.0.0.1:"));
}

#[tokio::test]
async fn nixl_prefill_that_ends_by_a_stop_string_offers_no_kv_and_held_kv_expires() {
    let p = SimProc::start(&args(
        ZERO,
        &[
            "--role",
            "prefill",
            "--handoff",
            "nixl",
            "--kv-hold-timeout-ms",
            "300",
        ],
    ))
    .await;
    let prompt = prompt_of(32, "x");
    let (_, plain) = p
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    let first_word = text_of(&plain);
    let kv = json!({"do_remote_decode": true});
    let (_, r) = p.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "stop": first_word, "kv_transfer_params": kv})).await;
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert!(r.get("kv_transfer_params").is_none(), "{r}");
    let (_, r) = p
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}),
        )
        .await;
    assert!(r["kv_transfer_params"].is_object());
    assert_eq!(
        p.metric("pdctl_sim_kv_blocks_held").await,
        2.0,
        "stranded until a decode pulls or it expires"
    );
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            p.metric("pdctl_sim_kv_blocks_held").await == 0.0
        })
        .await
    );
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_expired_total").await, 1.0);
    assert!(p.log().contains("expired: no decode took it in time"));
}

#[tokio::test]
async fn mooncake_handoff_with_both_legs_sent_at_once() {
    let boot = free_port();
    let bs = boot.to_string();
    let p = SimProc::start(&args(
        ZERO,
        &[
            "--role",
            "prefill",
            "--handoff",
            "mooncake",
            "--bootstrap-port",
            &bs,
            "--prefill-ms-per-token",
            "2",
        ],
    ))
    .await;
    let dsim = SimProc::start(&args(ZERO, &["--role", "decode", "--handoff", "mooncake"])).await;
    let q = common::get_json(&format!("http://127.0.0.1:{boot}/query")).await;
    let engine = q["0"]["engine_id"].as_str().unwrap().to_string();
    assert_eq!(engine, engine_id(&p).await);
    let req = json!({"prompt": prompt_of(48, "k"), "max_tokens": 5});
    let mut pleg = req.clone();
    pleg["max_tokens"] = json!(1);
    pleg["kv_transfer_params"] =
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"});
    let mut dleg = req.clone();
    dleg["kv_transfer_params"] = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_bootstrap_addr": format!("http://127.0.0.1:{boot}"), "remote_engine_id": engine, "transfer_id": "xfer-1"});
    let d_url = dsim.url("/v1/completions");
    let decode = tokio::spawn(client().post(d_url).json(&dleg).send());
    let (s, _) = p.post("/v1/completions", &pleg).await;
    assert_eq!(s, 200);
    let r: Value = decode.await.unwrap().unwrap().json().await.unwrap();
    assert_eq!(r["choices"], plain_answer(&req).await["choices"]);
    assert_eq!(
        dsim.metric("pdctl_sim_kv_handoffs_received_total").await,
        1.0
    );
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 0.0);
    assert_eq!(p.metric("pdctl_sim_kv_handoffs_sent_total").await, 1.0);
    assert_eq!(p.metric("pdctl_sim_kv_blocks_held").await, 0.0);
    assert!(
        dsim.log().contains("KV handoff received 32 tokens from"),
        "{}",
        dsim.log()
    );
    // Wrong engine id (a restarted prefill): a miss at once.
    let mut wrong = dleg.clone();
    wrong["kv_transfer_params"]["remote_engine_id"] = json!("someone-else");
    wrong["kv_transfer_params"]["transfer_id"] = json!("xfer-2");
    let (s, _) = dsim.post("/v1/completions", &wrong).await;
    assert_eq!(s, 200);
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 1.0);
    assert!(dsim.log().contains("engine id mismatch"));
}

#[tokio::test]
async fn mooncake_decode_waits_a_bounded_time_then_recomputes() {
    let boot = free_port();
    let bs = boot.to_string();
    let p = SimProc::start(&args(
        ZERO,
        &[
            "--role",
            "prefill",
            "--handoff",
            "mooncake",
            "--bootstrap-port",
            &bs,
        ],
    ))
    .await;
    let dsim = SimProc::start(&args(
        ZERO,
        &[
            "--role",
            "decode",
            "--handoff",
            "mooncake",
            "--handoff-wait-ms",
            "300",
        ],
    ))
    .await;
    // A bare host:port bootstrap address works too.
    let kv = |id: &str| json!({"do_remote_prefill": true, "remote_bootstrap_addr": format!("127.0.0.1:{boot}"), "transfer_id": id});
    let t = Instant::now();
    let (s, _) = dsim.post("/v1/completions", &json!({"prompt": prompt_of(20, "z"), "max_tokens": 2, "kv_transfer_params": kv("never")})).await;
    assert_eq!(s, 200);
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 1.0);
    // A prefill leg that ends by a stop string refuses the transfer: the decode learns
    // it at once instead of waiting.
    let prompt = prompt_of(20, "y");
    let (_, plain) = p
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    let (_, _) = p.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "stop": text_of(&plain), "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "stopped"}})).await;
    let (s, _) = dsim
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kv("stopped")}),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(dsim.metric("pdctl_sim_kv_handoffs_missed_total").await, 2.0);
    assert!(dsim.log().contains("stop condition"), "{}", dsim.log());
}

#[tokio::test]
async fn faults_fail_hang_unhealthy_and_crash() {
    let mut sim = SimProc::start(&args(ZERO, &["--itl-ms", "5"])).await;
    let req = json!({"prompt": "a", "max_tokens": 2});
    let (s, _) = sim.post("/sim/fault", &json!({"fail_next": 2})).await;
    assert_eq!(s, 200);
    for _ in 0..2 {
        let (s, r) = sim.post("/v1/completions", &req).await;
        assert_eq!(s, 500);
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("fault injection")
        );
    }
    assert_eq!(sim.post("/v1/completions", &req).await.0, 200);
    // hang_next: never answered; the client gives up, and the sim counts an abort.
    sim.post("/sim/fault", &json!({"hang_next": 1})).await;
    let r = reqwest::Client::new()
        .post(sim.url("/v1/completions"))
        .json(&req)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            sim.metric("pdctl_sim_requests_aborted_total").await == 1.0
        })
        .await
    );
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
    // unhealthy_ms: /health 503 for a while, then 200 again.
    sim.post("/sim/fault", &json!({"unhealthy_ms": 1000})).await;
    assert_eq!(sim.get("/health").await.0, 503);
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            sim.get("/health").await.0 == 200
        })
        .await
    );
    // A bad fault body is explained.
    let (s, r) = sim.post("/sim/fault", &json!({"explode": true})).await;
    assert_eq!(s, 400);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("fail_next")
    );
    // crash: exit status 1.
    sim.post("/sim/fault", &json!({"crash": true})).await;
    assert_eq!(sim.wait_exit(Duration::from_secs(5)), Some(1));
}

#[tokio::test]
async fn stalled_stream_sends_k_tokens_then_nothing_and_counts_an_abort() {
    let sim = SimProc::start(&args(ZERO, &["--itl-ms", "1"])).await;
    sim.post("/sim/fault", &json!({"stall_stream_after": 2}))
        .await;
    let mut r = client()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": "a", "max_tokens": 50, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = String::new();
    let end = Instant::now() + Duration::from_millis(600);
    while Instant::now() < end {
        match tokio::time::timeout_at(end.into(), r.chunk()).await {
            Ok(Ok(Some(c))) => body.push_str(&String::from_utf8_lossy(&c)),
            Ok(_) => panic!("the stream ended instead of stalling: {body}"),
            Err(_) => break,
        }
    }
    assert_eq!(sse_events(&body).len(), 2, "{body}");
    assert_eq!(sim.metric("vllm:num_requests_running").await, 1.0);
    drop(r);
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            sim.metric("pdctl_sim_requests_aborted_total").await == 1.0
        })
        .await
    );
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
    // The next stream is normal again.
    let r = client()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": "a", "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        sse_events(&r.text().await.unwrap()).last().unwrap(),
        &json!("[DONE]")
    );
}

/// `{"exit": 0}` plays a vLLM API server whose engine core died: an error line in the
/// log, then a clean exit status.
#[tokio::test]
async fn exit_fault_logs_an_error_and_exits_with_the_status_asked_for() {
    let mut sim = SimProc::start(ZERO).await;
    let (s, r) = sim.post("/sim/fault", &json!({"exit": 0})).await;
    assert_eq!(s, 200, "the request is answered before the exit: {r}");
    assert_eq!(sim.wait_exit(Duration::from_secs(5)), Some(0));
    let log = sim.log();
    let line = log
        .lines()
        .find(|l| l.contains("exit requested"))
        .unwrap_or_else(|| panic!("no exit line in:\n{log}"));
    assert!(
        line.contains("ERROR")
            && line.contains("RuntimeError: the simulated engine core died")
            && line.ends_with("exiting with status 0"),
        "{line}"
    );
    let mut sim = SimProc::start(ZERO).await;
    let (s, r) = sim.post("/sim/fault", &json!({"exit": 256})).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(sim.post("/sim/fault", &json!({"exit": 7})).await.0, 200);
    assert_eq!(sim.wait_exit(Duration::from_secs(5)), Some(7));
}

#[tokio::test]
async fn fault_exit_after_n_requests() {
    let mut sim = SimProc::start(&args(ZERO, &["--fault-exit-after", "2"])).await;
    let req = json!({"prompt": "a", "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", &req).await.0, 200);
    assert_eq!(
        sim.post("/v1/completions", &req).await.0,
        200,
        "the second answer still goes out"
    );
    assert_eq!(sim.wait_exit(Duration::from_secs(5)), Some(1));
    assert!(sim.log().contains("--fault-exit-after"));
}

#[tokio::test]
async fn startup_delay_answers_503_until_loaded() {
    let sim = SimProc::start(&args(ZERO, &["--startup-ms", "700"])).await;
    let (s, body) = sim.get("/health").await;
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("loading"));
    let (s, r) = sim
        .post("/v1/completions", &json!({"prompt": "a", "max_tokens": 1}))
        .await;
    assert_eq!(s, 503);
    assert!(r["error"]["message"].as_str().unwrap().contains("loading"));
    assert!(
        sim.log()
            .contains("loading the simulated model: /health answers 503 for 700 ms")
    );
    let t = Instant::now();
    while sim.get("/health").await.0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        sim.wait_log("ready: serving sim-model", Duration::from_secs(2))
            .await
    );
    assert_eq!(
        sim.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 1}))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    let sim = SimProc::start(&["--itl-ms", "50", "--overhead-ms", "0"]).await;
    let body = json!({"prompt": "a", "max_tokens": 100});
    let r = reqwest::Client::new()
        .post(sim.url("/v1/completions"))
        .json(&body)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(r.is_err());
    let mut r = client().post(sim.url("/v1/chat/completions")).json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": true})).send().await.unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    drop(r);
    let end = Instant::now() + Duration::from_secs(3);
    while sim.metric("pdctl_sim_requests_aborted_total").await < 2.0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sim.metric("pdctl_sim_requests_aborted_total").await, 2.0);
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
    assert_eq!(sim.metric("vllm:request_success_total").await, 0.0);
}

/// `--instances 3`: three engines in one process on consecutive ports, each with its own
/// state: a request to one counts on that one only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_in_one_process_serve_consecutive_ports_each_with_its_own_state() {
    let port = common::own_port_run(3);
    let first = SimProc::start_on(port, &["--instances", "3", "--role", "decode"]).await;
    let base = |i: u16| format!("http://127.0.0.1:{}", port + i);
    let body = json!({"model": "sim-model", "prompt": "hello there", "max_tokens": 2});
    for _ in 0..2 {
        let r = client()
            .post(format!("{}/v1/completions", base(1)))
            .json(&body)
            .send();
        assert_eq!(r.await.unwrap().status(), 200);
    }
    let mut done = Vec::new();
    for i in 0..3 {
        let text = client()
            .get(format!("{}/metrics", base(i)))
            .send()
            .await
            .unwrap();
        let text = text.text().await.unwrap();
        done.push(simh::metric_in(&text, "vllm:request_success_total").unwrap_or(-1.0));
    }
    assert_eq!(done, [0.0, 2.0, 0.0], "{}", first.log());
    let log = first.log();
    assert_eq!(log.matches("a SIMULATED engine").count(), 3, "{log}");
}

#[test]
fn bad_command_lines_exit_2_with_a_reason() {
    let port = free_port().to_string();
    let cases: [(&[&str], &str); 6] = [
        (
            &["--handoff", "shared-dir"],
            "--handoff shared-dir needs --kv-dir",
        ),
        (
            &["--handoff", "mooncake", "--role", "prefill"],
            "needs --bootstrap-port",
        ),
        (
            &["--bootstrap-port", "9", "--handoff", "nixl"],
            "only used with --handoff mooncake",
        ),
        (&["--itl-ms=-1"], "--itl-ms must be a finite number"),
        (
            &["--instances", "2", "--instance", "prefill-0"],
            "--instances 2 takes neither --bootstrap-port nor --instance",
        ),
        (&["--instances", "0"], "--instances must be at least 1"),
    ];
    for (extra, needle) in cases {
        let out = pdctl(&["sim", "--port", &port])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = taken.local_addr().unwrap().port().to_string();
    let out = pdctl(&["sim", "--port", &p]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("cannot listen on 127.0.0.1:{p}"))
    );
}

#[test]
fn the_official_openai_client_works_against_the_sim() {
    // install.sh's tools venv: system-wide as root, per user otherwise.
    let python = std::env::var("PDCTL_TEST_PYTHON").unwrap_or_else(|_| {
        let system = format!("{}/bin/python", pdctl::tools::SYSTEM_VENV);
        let user = std::env::var("HOME")
            .map(|h| format!("{h}/.local/share/pdctl/venv/bin/python"))
            .unwrap_or_default();
        if std::path::Path::new(&system).exists() || user.is_empty() {
            system
        } else {
            user
        }
    });
    let probe = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{python} cannot import openai ({}). Install it with `install.sh --with-test-deps`, point PDCTL_TEST_PYTHON at a python that has it, or leave this test out by name (cargo test -- --skip the_official_openai_client)",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!(
            "cannot run {python}: {e}. Install it with `install.sh --with-test-deps`, set PDCTL_TEST_PYTHON, or leave this test out by name (cargo test -- --skip the_official_openai_client)"
        ),
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sim = rt.block_on(SimProc::start(&args(ZERO, &["--itl-ms", "1"])));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client_check.py");
    let stdout = common::stdout_of(
        std::process::Command::new(&python).args([script, &format!("{}/v1", sim.base)]),
    );
    assert!(
        stdout.contains("openai client checks passed: 4"),
        "{stdout}"
    );
}

#[tokio::test]
async fn sigterm_stops_it_with_status_0_even_with_a_request_in_flight() {
    let mut sim = SimProc::start(&["--itl-ms", "1000", "--overhead-ms", "0"]).await;
    let url = sim.url("/v1/completions");
    let pending = tokio::spawn(
        client()
            .post(url)
            .json(&json!({"prompt": "a", "max_tokens": 100}))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = nix::unistd::Pid::from_raw(sim.child.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_eq!(
        sim.wait_exit(Duration::from_secs(5)),
        Some(0),
        "{}",
        sim.log()
    );
    assert!(sim.log().contains("shutting down"));
    let _ = pending.await;
}

#[tokio::test]
async fn api_key_guards_the_v1_routes_only() {
    let mut cmd_args = ZERO.to_vec();
    cmd_args.extend(["--log-stats-interval-ms", "0"]);
    // The key comes from the environment, as vLLM's VLLM_API_KEY.
    let port = free_port();
    let dir = TempDir::new("sim-key");
    let mut cmd = pdctl(&["sim", "--port", &port.to_string()]);
    cmd.args(&cmd_args).env("VLLM_API_KEY", "s3cret");
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("log")).unwrap());
    let _child = common::ChildGuard(cmd.spawn().unwrap());
    let base = format!("http://127.0.0.1:{port}");
    let c = client();
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            c.get(format!("{base}/health"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await
    );
    let body = json!({"prompt": "a", "max_tokens": 1});
    let r = c
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], 401);
    let r = c
        .post(format!("{base}/v1/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(format!("{base}/v1/completions"))
        .bearer_auth("s3cret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        c.get(format!("{base}/v1/models"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    for open in ["/health", "/metrics", "/version"] {
        assert_eq!(
            c.get(format!("{base}{open}"))
                .send()
                .await
                .unwrap()
                .status(),
            200,
            "{open}"
        );
    }
}

/// Sampling fields of the wrong type or out of vLLM's range get vLLM's 400 naming the
/// field; numbers written as strings pass, as vLLM's lax parsing lets them.
#[tokio::test]
async fn sampling_fields_are_checked_as_vllm_checks_them() {
    let sim = SimProc::start(&args(ZERO, &[])).await;
    for (field, bad, needle) in [
        ("temperature", json!("hot"), "temperature"),
        ("top_p", json!("abc"), "top_p"),
        ("seed", json!("s"), "seed"),
        ("top_k", json!(1.5), "top_k"),
        ("presence_penalty", json!(true), "presence_penalty"),
        ("temperature", json!(-1), "temperature must be non-negative"),
        ("top_p", json!(0), "top_p must be in (0, 1]"),
        (
            "frequency_penalty",
            json!(3),
            "frequency_penalty must be in [-2, 2]",
        ),
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let mut body = json!({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
            body[field] = bad.clone();
            let (s, r) = sim.post(path, &body).await;
            assert_eq!(s, 400, "{path} {body} -> {r}");
            let msg = r["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{path} {body}: {msg}");
            assert_eq!(r["error"]["type"], "BadRequestError", "{r}");
        }
    }
    let ok = json!({"prompt": "x", "max_tokens": 2, "temperature": "0.7", "top_p": 0.9,
                    "seed": "42", "top_k": 5.0, "repetition_penalty": 1.1});
    let (s, r) = sim.post("/v1/completions", &ok).await;
    assert_eq!(s, 200, "{r}");
}
