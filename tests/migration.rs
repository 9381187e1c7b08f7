//! Streams that go on: a decode killed (SIGKILL) while it streams costs its users a pause,
//! never an error. Sim 1P2D clusters brought up with `pdctl up`; every stream is compared
//! with the same request's answer on a cluster where nothing was killed (the simulator
//! continues exactly, as greedy decoding does: src/sim/generate.rs).

use crate::common;
use crate::common::supervisor as suph;

use common::TempDir;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use suph::{Cluster, sim_topology, text};

/// Streams in flight when decode-0 is killed, and the tokens each asks for.
const STREAMS: usize = 16;
const TOKENS: u32 = 120;

/// A 1P2D sim cluster `m-TAG` over `connector` (its extra lines in `connector_extra`),
/// brought up by `pdctl up`; the directory holds its topology file; the last item is the
/// proxy's base URL.
fn up_1p2d(tag: &str, connector: &str, connector_extra: &str) -> (Cluster, TempDir, String) {
    let sim = "[engine.sim]\nitl_ms = 25.0\n";
    let (t, port) = sim_topology(&format!("m-{tag}"), connector, 1, 2, sim);
    let kind = format!("[connector]\nkind = \"{connector}\"\n");
    let t = t.replacen(&kind, &format!("{kind}{connector_extra}"), 1);
    let cluster = Cluster::new(&format!("m{tag}"));
    let dir = TempDir::new(&format!("m{tag}-topo"));
    cluster.up_topology(dir.path(), &t);
    (cluster, dir, format!("http://127.0.0.1:{port}"))
}

/// What a client read of one streamed answer.
#[derive(Debug, Default, Clone)]
struct Read {
    text: String,
    /// Every `id` the events carried.
    ids: Vec<String>,
    models: Vec<String>,
    created: Vec<u64>,
    finish: Option<String>,
    error: Option<Value>,
    done: bool,
    usage: Option<Value>,
    events: u32,
}

impl Read {
    fn note(&mut self, data: &str, chat: bool) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        if v.get("error").is_some() {
            self.error = Some(v);
            return;
        }
        self.events += 1;
        self.ids.push(v["id"].as_str().unwrap_or("").to_string());
        self.models
            .push(v["model"].as_str().unwrap_or("").to_string());
        self.created.push(v["created"].as_u64().unwrap_or(0));
        if !v["usage"].is_null() {
            self.usage = Some(v["usage"].clone());
        }
        let Some(c) = v["choices"].get(0) else { return };
        assert!(
            c["token_ids"].is_null(),
            "ids the client did not ask for: {data}"
        );
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        self.text.push_str(piece.as_str().unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            self.finish = Some(f.to_string());
        }
    }

    /// The client's view is one stream: one id, model and created throughout.
    fn is_one_stream(&self) -> bool {
        let same = |v: &[String]| v.windows(2).all(|w| w[0] == w[1]);
        same(&self.ids) && same(&self.models) && self.created.windows(2).all(|w| w[0] == w[1])
    }
}

/// Streams `body` to `url`, counting events into `progress` as they come.
async fn stream(
    client: reqwest::Client,
    url: String,
    body: Value,
    progress: Arc<AtomicU32>,
) -> Read {
    let chat = url.ends_with("/chat/completions");
    let mut r = client.post(&url).json(&body).send().await.expect("sent");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let mut events = pdctl::sse::Events::default();
    let mut read = Read::default();
    while let Ok(Some(chunk)) = r.chunk().await {
        events.push(&chunk);
        while let Some(ev) = events.next_event() {
            read.note(&ev.data, chat);
            progress.store(read.events, Ordering::Relaxed);
        }
    }
    read
}

fn body_of(route: &str, i: usize, extra: &Value) -> Value {
    let mut b = if route.contains("chat") {
        json!({"model": "sim-model", "messages": [{"role": "user", "content": format!("stream number {i}, please go on")}]})
    } else {
        json!({"model": "sim-model", "prompt": format!("stream number {i}, please go on")})
    };
    b["max_tokens"] = json!(TOKENS);
    b["ignore_eos"] = json!(true);
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    for (k, v) in extra.as_object().into_iter().flatten() {
        b[k] = v.clone();
    }
    b
}

/// Sends `n` streams to `url` and waits until every one has 20 events or more; the
/// clients, each giving what it read.
async fn streams_going(url: &str, n: usize, extra: &Value) -> Vec<tokio::task::JoinHandle<Read>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(90))
        .build()
        .unwrap();
    let progress: Vec<Arc<AtomicU32>> = (0..n).map(|_| Arc::new(AtomicU32::new(0))).collect();
    let route = url.rsplit("/v1").next().unwrap_or_default();
    let running = progress
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let body = body_of(route, i, extra);
            tokio::spawn(stream(client.clone(), url.to_string(), body, p.clone()))
        })
        .collect();
    let all_going = common::wait_until(Duration::from_secs(60), || {
        progress.iter().all(|p| p.load(Ordering::Relaxed) >= 20)
    });
    assert!(all_going, "the streams did not get going");
    running
}

/// How decode-0 dies under the streams.
#[derive(Clone, Copy)]
enum Death {
    /// SIGKILL: its connections reset.
    Killed,
    /// Its engine core dies: each stream gets vLLM's EngineDeadError as an error event and
    /// `[DONE]`, then the server exits (the sim's `engine_dead` fault).
    EngineCore,
}

/// Makes decode-0 of `cluster` die as `how` says.
async fn kill_decode0(cluster: &Cluster, how: Death) {
    let report = cluster.status(&[]).expect("the cluster is up");
    let decode0 = suph::svc(&report, "decode-0");
    match how {
        Death::Killed => {
            let pid = decode0.pid.expect("decode-0 runs");
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        }
        Death::EngineCore => {
            let url = decode0.url.clone().expect("decode-0's URL");
            let key = cluster.engine_key();
            let r = reqwest::Client::new()
                .post(format!("{url}/sim/fault"))
                .bearer_auth(key)
                .json(&json!({"engine_dead": true}))
                .send()
                .await
                .expect("the fault request");
            assert!(r.status().is_success(), "{:?}", r.text().await);
        }
    }
}

/// Sends `n` streams to `url` and, once every one has 20 events or more, kills
/// decode-0 with SIGKILL; what each client read.
async fn streams_with_a_kill(cluster: &Cluster, url: &str, n: usize, extra: &Value) -> Vec<Read> {
    streams_with_a_death(cluster, url, n, extra, Death::Killed).await
}

/// Sends `n` streams to `url` and, once every one has 20 events or more, makes decode-0
/// die as `how` says; what each client read.
async fn streams_with_a_death(
    cluster: &Cluster,
    url: &str,
    n: usize,
    extra: &Value,
    how: Death,
) -> Vec<Read> {
    let running = streams_going(url, n, extra).await;
    kill_decode0(cluster, how).await;
    let mut reads = Vec::new();
    for r in running {
        reads.push(r.await.unwrap());
    }
    reads
}

/// The answers of the same requests with nothing killed.
async fn unkilled(url: &str, n: usize, extra: &Value) -> Vec<Read> {
    let client = reqwest::Client::new();
    let route = url.rsplit("/v1").next().unwrap_or_default().to_string();
    let mut out = Vec::new();
    for i in 0..n {
        let body = body_of(&route, i, extra);
        out.push(stream(client.clone(), url.to_string(), body, Arc::default()).await);
    }
    out
}

/// The proxy's counter `pdctl_proxy_migrations_total`, all reasons.
async fn migrations(base: &str) -> f64 {
    let page = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    page.lines()
        .filter(|l| l.starts_with("pdctl_proxy_migrations_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every stream complete and equal to its unkilled answer, as one stream, with the usage
/// of the whole answer; the migrations counted.
async fn check_every_stream_goes_on(cluster: &Cluster, base: &str, route: &str, how: Death) {
    let url = format!("{base}{route}");
    let none = json!({});
    let want = unkilled(&url, STREAMS, &none).await;
    let got = streams_with_a_death(cluster, &url, STREAMS, &none, how).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.error.is_none(),
            "stream {i} ended with an error: {:?}",
            g.error
        );
        assert!(g.done, "stream {i} has no [DONE]: {g:?}");
        assert_eq!(
            g.text, w.text,
            "stream {i}: the text differs from the unkilled answer"
        );
        assert_eq!(g.finish.as_deref(), Some("length"), "stream {i}");
        assert!(
            g.is_one_stream(),
            "stream {i} changed id, model or created: {g:?}"
        );
        let usage = g.usage.as_ref().expect("usage asked for");
        let want_usage = w.usage.as_ref().unwrap();
        assert_eq!(usage["completion_tokens"], TOKENS, "stream {i}: {usage}");
        assert_eq!(
            usage["prompt_tokens"], want_usage["prompt_tokens"],
            "stream {i}"
        );
    }
    let moved = migrations(base).await;
    assert!(moved >= 1.0, "no migration counted: {moved}");
    let out = cluster.run(&["logs", "proxy"]);
    assert!(
        text(&out).contains("stream continued: decode"),
        "{}",
        text(&out)
    );
}

/// A 1P2D cluster over `connector` in which decode-0 is killed under 16 streams to
/// `route`: every stream goes on ([`check_every_stream_goes_on`]); then down.
async fn goes_on(tag: &str, connector: &str, connector_extra: &str, route: &str) {
    goes_on_after(tag, connector, connector_extra, route, Death::Killed).await;
}

/// [`goes_on`] with decode-0 dying as `how` says.
async fn goes_on_after(tag: &str, connector: &str, extra: &str, route: &str, how: Death) {
    let (cluster, _t, base) = up_1p2d(tag, connector, extra);
    check_every_stream_goes_on(&cluster, &base, route, how).await;
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_killed_mid_stream_costs_its_completions_streams_a_pause_never_an_error() {
    goes_on("nixl", "nixl", "", "/v1/completions").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_killed_mid_stream_costs_its_chat_streams_a_pause_never_an_error() {
    goes_on("chat", "nixl", "", "/v1/chat/completions").await;
}

/// vLLM's API server whose engine core dies writes `EngineDeadError` into each stream as
/// an error event, then `[DONE]`, and exits: the streams go on all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_whose_engine_core_dies_mid_stream_costs_its_streams_a_pause_never_an_error() {
    goes_on_after("core", "nixl", "", "/v1/completions", Death::EngineCore).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_go_on_under_the_push_and_mooncake_protocols_too() {
    goes_on("push", "nixl", "nixl_mode = \"push\"\n", "/v1/completions").await;
    goes_on("mc", "mooncake", "", "/v1/completions").await;
}

/// A stream that cannot be continued (n = 2: two answers share one prompt) ends with a
/// JSON error event that says why, then `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_cannot_be_continued_says_why() {
    let (cluster, _t, base) = up_1p2d("n2", "nixl", "");
    let url = format!("{base}/v1/completions");
    let reads = streams_with_a_kill(&cluster, &url, 4, &json!({"n": 2})).await;
    let failed: Vec<&Read> = reads.iter().filter(|r| r.error.is_some()).collect();
    assert!(!failed.is_empty(), "no stream was on decode-0: {reads:?}");
    for r in failed {
        let e = &r.error.as_ref().unwrap()["error"];
        let why = e["not_migrated"].as_str().unwrap_or_default();
        assert!(why.contains("n > 1"), "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("not continued"),
            "{e}"
        );
        assert!(r.done, "no [DONE] after the error");
    }
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// `scale decode=1` while long streams run on both decodes: the drained decode's streams
/// move to the decode left once `drain_grace_s` (2 s) has passed, instead of holding the
/// drain until they end (15 s) or being cut: the scale is over within the grace plus
/// 5 s, and every stream equals its unkilled answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_hands_its_streams_over_after_the_grace_and_loses_none() {
    let sim = "[engine.sim]\nitl_ms = 25.0\n";
    let (t, port) = sim_topology("m-drain", "nixl", 1, 2, sim);
    let t = format!("{t}drain_grace_s = 2\n");
    let cluster = Cluster::new("mdrain");
    let dir = TempDir::new("mdrain-topo");
    cluster.up_topology(dir.path(), &t);
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    let long = json!({"max_tokens": 600});
    let want = unkilled(&url, 8, &long).await;
    let running = streams_going(&url, 8, &long).await;
    let started = std::time::Instant::now();
    let out = cluster.run(&["scale", "decode=1"]);
    let took = started.elapsed();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        took < Duration::from_secs(2 + 5),
        "the drain took {took:?}:\n{}",
        text(&out)
    );
    for (i, (r, w)) in running.into_iter().zip(&want).enumerate() {
        let got = r.await.unwrap();
        assert!(got.error.is_none(), "stream {i}: {:?}", got.error);
        assert!(got.done, "stream {i} has no [DONE]");
        assert_eq!(got.text, w.text, "stream {i}");
    }
    let page = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("pdctl_proxy_migrations_total{reason=\"drained\"}"),
        "no stream moved for the drain"
    );
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// A sum over the lines of `name` (its every label set) on the `/metrics` page at `base`.
async fn metric_sum(base: &str, name: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("{base}/metrics")).await else {
        return 0.0;
    };
    let page = r.text().await.unwrap_or_default();
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends `n` requests for whole (non-streamed) answers to `url` and, once decode-0 runs
/// some of them and has generated 20 tokens or more for each, kills it with SIGKILL; each
/// answer's status and body.
async fn whole_answers_with_a_kill(cluster: &Cluster, url: &str, n: usize) -> Vec<(u16, Value)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(90))
        .build()
        .unwrap();
    let route = url.rsplit("/v1").next().unwrap_or_default().to_string();
    let report = cluster.status(&[]).expect("the cluster is up");
    let decode0 = suph::svc(&report, "decode-0");
    let base0 = decode0.url.clone().expect("decode-0 has its URL");
    // The counter is cumulative: what decode-0 made before (the reference answers) is not
    // these answers being written, and a kill before their first byte is no migration.
    let before = metric_sum(&base0, "vllm:generation_tokens_total").await;
    let running: Vec<_> = (0..n)
        .map(|i| {
            let body = whole_body(&route, i);
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let r = client.post(&url).json(&body).send().await.expect("sent");
                let status = r.status().as_u16();
                (status, r.json::<Value>().await.expect("a JSON body"))
            })
        })
        .collect();
    let going = async {
        for _ in 0..600 {
            let on0 = metric_sum(&base0, "vllm:num_requests_running").await;
            let made = metric_sum(&base0, "vllm:generation_tokens_total").await - before;
            if on0 >= 1.0 && made >= 20.0 * on0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    assert!(going.await, "decode-0 never ran the requests");
    let pid = decode0.pid.expect("decode-0 runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let mut out = Vec::new();
    for r in running {
        out.push(r.await.unwrap());
    }
    out
}

/// The body of whole answer `i` to `route`.
fn whole_body(route: &str, i: usize) -> Value {
    let mut b = body_of(route, i, &json!({}));
    let b = b.as_object_mut().unwrap();
    b.remove("stream");
    b.remove("stream_options");
    Value::Object(b.clone())
}

/// The text of a whole answer (a completion's, or a chat's message).
fn whole_text(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or(c["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// Whole answers whose decode was killed while it generated them are continued, not
/// started over: each equals the answer of the same request on a cluster where nothing
/// was killed, in its own form, with the usage of the whole answer.
async fn whole_answers_go_on(tag: &str, route: &str) {
    let (cluster, _t, base) = up_1p2d(tag, "nixl", "");
    let url = format!("{base}{route}");
    let client = reqwest::Client::new();
    let mut want = Vec::new();
    for i in 0..8 {
        let r = client.post(&url).json(&whole_body(route, i)).send();
        want.push(r.await.unwrap().json::<Value>().await.unwrap());
    }
    let got = whole_answers_with_a_kill(&cluster, &url, 8).await;
    let object = if route.contains("chat") {
        "chat.completion"
    } else {
        "text_completion"
    };
    for (i, ((status, g), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(*status, 200, "answer {i}: {g}");
        assert_eq!(g["object"], object, "answer {i}: {g}");
        assert_eq!(whole_text(g), whole_text(w), "answer {i}: the text differs");
        assert_eq!(g["choices"][0]["finish_reason"], "length", "answer {i}");
        assert_eq!(g["usage"]["completion_tokens"], TOKENS, "answer {i}: {g}");
        assert_eq!(
            g["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"],
            "answer {i}"
        );
        assert!(
            g["choices"][0]["token_ids"].is_null(),
            "ids not asked for: {g}"
        );
    }
    assert!(migrations(&base).await >= 1.0, "no migration counted");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_killed_while_it_writes_whole_answers_costs_them_a_pause_never_an_error() {
    whole_answers_go_on("whole", "/v1/completions").await;
    whole_answers_go_on("wchat", "/v1/chat/completions").await;
}
