//! Test doubles for the proxy tests: fake engines (small axum servers that record what
//! they receive and misbehave on demand), a fake supervisor control socket, and a
//! `pdctl proxy` process with its log captured.
#![allow(dead_code)]

use crate::common::{TempDir, free_port, pdctl_bin};
pub use crate::common::{eventually, strip_ansi};
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// What a fake engine does with the next generation requests.
#[derive(Clone, Debug)]
pub enum Behavior {
    /// Answers normally: a completion, or an SSE stream of three chunks then [DONE].
    Normal,
    /// Answers this status with this JSON body.
    Status(u16, Value),
    /// Waits, then answers this status with this JSON body.
    DelayedStatus(Duration, u16, Value),
    /// Never answers.
    Hang,
    /// Streams two chunks, then the connection breaks.
    DropMidStream,
    /// Streams one chunk, then waits for the notify before the rest.
    Hold(Arc<Notify>),
    /// Waits this long before answering normally.
    Delay(Duration),
    /// Answers a nixl prefill without kv_transfer_params (as vLLM does after an early EOS).
    NoKvParams,
    /// Streams normally, then keeps the connection open this long after `[DONE]`.
    LingerAfterDone(Duration),
}

/// One generation request a fake engine received.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
    pub at: Instant,
}

impl Received {
    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

/// What a fake engine saw and how it behaves; shared with its server.
pub struct FakeState {
    pub name: String,
    pub received: Mutex<Vec<Received>>,
    pub behavior: Mutex<Behavior>,
    pub health_status: AtomicU16,
    pub health_auth: Mutex<Vec<Option<String>>>,
    /// Generation requests whose answer was abandoned before it was complete.
    pub cancelled: AtomicUsize,
    pub completed: AtomicUsize,
    pub models: Mutex<Vec<String>>,
    pub metrics_text: Mutex<String>,
    /// Times `/metrics` was read (by the proxy's scraper: nothing else reads it).
    pub metrics_reads: AtomicUsize,
    pub bootstrap_queries: AtomicUsize,
    pub bootstrap_status: AtomicU16,
    pub engine_id: Mutex<String>,
}

/// A fake vLLM engine on 127.0.0.1 (and, for mooncake prefill, a bootstrap server).
pub struct FakeEngine {
    pub port: u16,
    pub url: String,
    pub host_port: String,
    pub bootstrap_port: u16,
    pub state: Arc<FakeState>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Counts a request as cancelled if dropped before `done` is called.
struct Tracker {
    state: Arc<FakeState>,
    done: bool,
}

impl Tracker {
    fn finish(mut self) {
        self.done = true;
        self.state.completed.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.state.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl FakeEngine {
    /// Starts a fake engine named `name` (used in its answers).
    pub async fn start(name: &str) -> FakeEngine {
        Self::start_at(name, "127.0.0.1:0").await
    }

    /// Starts a fake engine listening on `addr` (another loopback address such as
    /// 127.0.0.2, so several engines can share one port as pods behind one DNS name do).
    pub async fn start_at(name: &str, addr: &str) -> FakeEngine {
        let state = Arc::new(FakeState {
            name: name.to_string(),
            received: Mutex::new(Vec::new()),
            behavior: Mutex::new(Behavior::Normal),
            health_status: AtomicU16::new(200),
            health_auth: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            models: Mutex::new(vec!["fake-model".to_string()]),
            metrics_text: Mutex::new(String::new()),
            metrics_reads: AtomicUsize::new(0),
            bootstrap_queries: AtomicUsize::new(0),
            bootstrap_status: AtomicU16::new(200),
            engine_id: Mutex::new(format!("engine-{name}")),
        });
        let app = Router::new()
            .route("/v1/completions", post(generate))
            .route("/v1/chat/completions", post(generate))
            .route("/health", get(health))
            .route("/v1/models", get(models))
            .route("/metrics", get(metrics))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let local = listener.local_addr().unwrap();
        let port = local.port();
        let boot_app = Router::new()
            .route("/query", get(query))
            .with_state(state.clone());
        let boot_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let bootstrap_port = boot_listener.local_addr().unwrap().port();
        let tasks = vec![
            tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }),
            tokio::spawn(async move {
                let _ = axum::serve(boot_listener, boot_app).await;
            }),
        ];
        FakeEngine {
            port,
            url: format!("http://{local}"),
            host_port: local.to_string(),
            bootstrap_port,
            state,
            tasks,
        }
    }

    /// Changes how the next requests are answered.
    pub fn behave(&self, b: Behavior) {
        *self.state.behavior.lock().unwrap() = b;
    }

    /// Every generation request received so far.
    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    /// Generation requests received so far.
    pub fn count(&self) -> usize {
        self.state.received.lock().unwrap().len()
    }

    pub fn cancelled(&self) -> usize {
        self.state.cancelled.load(Ordering::SeqCst)
    }

    /// Waits (10 s at most) until the proxy's scraper has read `/metrics` twice more: it
    /// reads every engine, acts on the pages, then sleeps, so the second read means it has
    /// acted on a page read after this call began.
    pub async fn wait_scraped(&self) {
        let reads = || self.state.metrics_reads.load(Ordering::SeqCst);
        let want = reads() + 2;
        let seen =
            crate::common::eventually(Duration::from_secs(10), || async { reads() >= want }).await;
        assert!(
            seen,
            "{}'s /metrics was read {} times in 10 s, not {want}: is the proxy scraping it?",
            self.state.name,
            reads()
        );
    }

    /// The status `/health` answers; 0: it never answers (a machine cut off).
    pub fn set_health(&self, status: u16) {
        self.state.health_status.store(status, Ordering::SeqCst);
    }
}

async fn health(State(s): State<Arc<FakeState>>, headers: HeaderMap) -> StatusCode {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    s.health_auth.lock().unwrap().push(auth);
    match s.health_status.load(Ordering::SeqCst) {
        // No answer at all, as from a machine cut off.
        0 => std::future::pending().await,
        status => StatusCode::from_u16(status).unwrap(),
    }
}

async fn models(State(s): State<Arc<FakeState>>) -> Response {
    let data: Vec<Value> = s
        .models
        .lock()
        .unwrap()
        .iter()
        .map(|id| json!({"id": id, "object": "model", "owned_by": s.name}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(s): State<Arc<FakeState>>) -> String {
    s.metrics_reads.fetch_add(1, Ordering::SeqCst);
    s.metrics_text.lock().unwrap().clone()
}

async fn query(State(s): State<Arc<FakeState>>) -> Response {
    s.bootstrap_queries.fetch_add(1, Ordering::SeqCst);
    let status = s.bootstrap_status.load(Ordering::SeqCst);
    if status != 200 {
        return StatusCode::from_u16(status).unwrap().into_response();
    }
    let id = s.engine_id.lock().unwrap().clone();
    axum::Json(json!({"0": {"engine_id": id}})).into_response()
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

async fn generate(
    State(s): State<Arc<FakeState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let tracker = Tracker {
        state: s.clone(),
        done: false,
    };
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    s.received.lock().unwrap().push(Received {
        path: uri.path().to_string(),
        headers,
        body: body.clone(),
        at: Instant::now(),
    });
    let behavior = s.behavior.lock().unwrap().clone();
    let chat = uri.path().contains("chat");
    let stream = body["stream"].as_bool().unwrap_or(false);
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16);
    match &behavior {
        Behavior::Status(code, v) => {
            tracker.finish();
            return (StatusCode::from_u16(*code).unwrap(), axum::Json(v.clone())).into_response();
        }
        Behavior::DelayedStatus(wait, code, v) => {
            tokio::time::sleep(*wait).await;
            tracker.finish();
            return (StatusCode::from_u16(*code).unwrap(), axum::Json(v.clone())).into_response();
        }
        Behavior::Hang => {
            std::future::pending::<()>().await;
        }
        Behavior::Delay(d) => tokio::time::sleep(*d).await,
        _ => {}
    }
    let name = s.name.clone();
    let text = move |i: usize| format!("{name}-t{i}");
    let choice = move |t: String, finish: Option<&str>| {
        if chat {
            json!({"index": 0, "delta": {"content": t}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": t, "finish_reason": finish})
        }
    };
    if !stream {
        let tokens = max_tokens.min(3) as usize;
        let content: String = (0..tokens).map(text).collect();
        let mut answer = if chat {
            json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "fake-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}]})
        } else {
            json!({"id": "cmpl-1", "object": "text_completion", "model": "fake-model",
                "choices": [{"index": 0, "text": content, "finish_reason": "length"}]})
        };
        answer["usage"] =
            json!({"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens});
        answer["served_by"] = json!(s.name);
        let remote = body["kv_transfer_params"]["do_remote_decode"] == json!(true);
        if remote && !matches!(behavior, Behavior::NoKvParams) {
            answer["kv_transfer_params"] = json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [1, 2, 3], "remote_engine_id": format!("engine-{}", s.name),
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
                "remote_request_id": "from-prefill"
            });
        }
        tracker.finish();
        return axum::Json(answer).into_response();
    }
    let include_usage = body["stream_options"]["include_usage"] == json!(true);
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let served_by = s.name.clone();
    let stream = async_stream(move |tx| async move {
        let chunk = |c: Value| json!({"id": "x", "object": object, "model": "fake-model", "served_by": served_by, "choices": [c]});
        let _ = tx.send(Ok(sse(&chunk(choice(text(0), None))))).await;
        match &behavior {
            Behavior::Hold(n) => n.notified().await,
            Behavior::DropMidStream => {
                let _ = tx.send(Ok(sse(&chunk(choice(text(1), None))))).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = tx.send(Err(std::io::Error::other("engine died"))).await;
                return;
            }
            _ => {}
        }
        let _ = tx.send(Ok(sse(&chunk(choice(text(1), None))))).await;
        let _ = tx
            .send(Ok(sse(&chunk(choice(text(2), Some("length"))))))
            .await;
        if include_usage {
            let usage = json!({"id": "x", "object": object, "model": "fake-model", "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}});
            let _ = tx.send(Ok(sse(&usage))).await;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        if let Behavior::LingerAfterDone(d) = &behavior {
            tokio::time::sleep(*d).await;
        }
        tracker.finish();
    });
    Response::builder()
        .header("content-type", "text/event-stream; charset=utf-8")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// A stream fed by a task through a channel; the task is aborted when the stream is dropped
/// (so a client going away drops the producer and with it the request's tracker).
fn async_stream<F, Fut>(
    f: F,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel(4);
    let task = AbortOnDrop(tokio::spawn(f(tx)));
    futures_util::stream::poll_fn(move |cx| {
        let _keep = &task;
        rx.poll_recv(cx)
    })
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A running `pdctl proxy`, killed on drop; its log goes to a file.
pub struct ProxyProcess {
    pub port: u16,
    pub url: String,
    child: Child,
    log_dir: TempDir,
}

impl ProxyProcess {
    /// Starts `pdctl proxy` on a free port with these arguments and waits until it answers.
    pub async fn start(args: &[String]) -> ProxyProcess {
        Self::start_with_env(args, &[]).await
    }

    /// Like `start`, with extra environment variables.
    pub async fn start_with_env(args: &[String], env: &[(&str, &str)]) -> ProxyProcess {
        let port = free_port();
        let log_dir = TempDir::new("proxy-log");
        let log = std::fs::File::create(log_dir.path().join("proxy.log")).unwrap();
        let mut cmd = Command::new(pdctl_bin());
        cmd.args(["proxy", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("PDCTL_API_KEY")
            .env_remove("PDCTL_ENGINE_API_KEY")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log);
        let child = cmd.spawn().expect("spawn pdctl proxy");
        let p = ProxyProcess {
            port,
            url: format!("http://127.0.0.1:{port}"),
            child,
            log_dir,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = client.get(format!("{}/health", p.url)).send().await
                && r.status() == 200
            {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "pdctl proxy did not answer /health within 20 s; log:\n{}",
                p.log()
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// Everything the proxy logged so far, without terminal colour codes.
    pub fn log(&self) -> String {
        let raw =
            std::fs::read_to_string(self.log_dir.path().join("proxy.log")).unwrap_or_default();
        strip_ansi(&raw)
    }

    /// The proxy's /metrics text.
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of one metrics series (exact name with labels), 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// Waits up to 10 s for one metrics series to read `want`; fails showing the metrics
    /// and the log.
    pub async fn wait_metric(&self, series: &str, want: f64) {
        let wait = Duration::from_secs(10);
        let seen = eventually(wait, || async { self.metric(series).await == want }).await;
        assert!(
            seen,
            "{series} is not {want}:\n{}\n{}",
            self.metrics().await,
            self.log()
        );
    }

    /// The proxy's process id (to signal it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `series` (name with its exact label set) in a Prometheus text.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// The standard arguments for a proxy in front of these engines. Fakes make no NIXL
/// handshake and count every request they get, so no pair is warmed up first.
pub fn proxy_args(prefill: &[&FakeEngine], decode: &[&FakeEngine], extra: &[&str]) -> Vec<String> {
    let urls = |engines: &[&FakeEngine]| engines.iter().map(|e| e.url.clone()).collect();
    let mut args = proxy_args_for(urls(prefill), urls(decode), extra);
    args.push("--no-warmup".into());
    args
}

/// The arguments for a proxy in front of the engines at these base URLs.
pub fn proxy_args_for(prefill: Vec<String>, decode: Vec<String>, extra: &[&str]) -> Vec<String> {
    let mut v = Vec::new();
    for url in prefill {
        v.extend(["--prefill".to_string(), url]);
    }
    for url in decode {
        v.extend(["--decode".to_string(), url]);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Reads an SSE response to its end: the `data:` payloads in order.
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let body = resp.bytes().await.unwrap_or_default();
    pdctl::sse::data_of(&body)
}

/// A fake supervisor answering `Status` on a Unix socket with the given service states.
pub struct FakeSupervisor {
    pub path: std::path::PathBuf,
    pub services: Arc<Mutex<Vec<(String, String)>>>,
    _dir: TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeSupervisor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeSupervisor {
    /// Serves `(url, state)` pairs as decode/prefill services of a status report.
    pub fn start(services: Vec<(String, String)>) -> FakeSupervisor {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let dir = TempDir::new("fake-sup");
        let path = dir.path().join("control.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let services = Arc::new(Mutex::new(services));
        let shared = services.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    let (r, mut w) = stream.into_split();
                    let mut line = String::new();
                    if BufReader::new(r).read_line(&mut line).await.is_err() {
                        return;
                    }
                    let list: Vec<Value> = shared
                        .lock()
                        .unwrap()
                        .iter()
                        .enumerate()
                        .map(|(i, (url, state))| {
                            json!({"name": format!("svc-{i}"), "role": "decode", "node": "local",
                            "pid": null, "state": state, "gpus": [], "port": null, "url": url,
                            "restarts": 0, "uptime_s": null, "last_exit": null, "remote": false})
                        })
                        .collect();
                    let answer = json!({"reply": "status", "cluster": "t", "node": "local",
                        "proxy_url": null, "services": list});
                    let _ = w.write_all(format!("{answer}\n").as_bytes()).await;
                });
            }
        });
        FakeSupervisor {
            path,
            services,
            _dir: dir,
            task,
        }
    }

    /// Changes the state reported for `url`.
    pub fn set(&self, url: &str, state: &str) {
        for s in self.services.lock().unwrap().iter_mut() {
            if s.0 == url {
                s.1 = state.to_string();
            }
        }
    }
}
