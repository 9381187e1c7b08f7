//! Sends the benchmark's requests (streamed, or whole answers with `--no-stream`) and times
//! each one: time to first token, the gaps between tokens, end to end, and the token counts
//! the server reports. An answer counts as completed only when it is whole: a stream that
//! ends with `[DONE]` and no error event, a JSON answer with its choices finished.

use super::args::{Endpoint, WorkloadArgs};
use super::dataset::BenchRequest;
use crate::error_text::chain;
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub ok: bool,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    /// Gaps between successive content chunks.
    pub itl_ms: Vec<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

/// How to send: where, which model, which route, how many at once, how fast.
#[derive(Debug, Clone)]
pub struct Load {
    pub url: String,
    pub model: String,
    pub endpoint: Endpoint,
    /// Streamed answers (SSE) or whole JSON ones.
    pub stream: bool,
    pub max_concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub seed: u64,
    pub timeout: Duration,
}

impl Load {
    /// How the runner sends `workload`'s requests to `url` (`model`: the one to name in
    /// them).
    pub fn of(workload: &WorkloadArgs, url: String, model: String, stream: bool) -> Load {
        Load {
            url,
            model,
            endpoint: workload.endpoint,
            stream,
            max_concurrency: workload.max_concurrency,
            request_rate: workload.request_rate,
            seed: workload.seed,
            timeout: Duration::from_secs(workload.timeout_s),
        }
    }
}

/// When each request is sent, in seconds from the start: Poisson arrivals at `rate`, or
/// all at once.
pub fn arrival_times(n: usize, rate: Option<f64>, seed: u64) -> Vec<f64> {
    let Some(rate) = rate.filter(|r| r.is_finite() && *r > 0.0) else {
        return vec![0.0; n];
    };
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let at = t;
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += -u.ln() / rate;
            at
        })
        .collect()
}

/// The JSON body of one request, streamed with usage or asking for a whole answer.
pub fn body(model: &str, endpoint: Endpoint, stream: bool, r: &BenchRequest) -> Value {
    let mut b = match endpoint {
        Endpoint::Completions => json!({ "model": model, "prompt": r.prompt }),
        Endpoint::Chat => {
            json!({ "model": model, "messages": [{ "role": "user", "content": r.prompt }] })
        }
    };
    b["max_tokens"] = r.max_tokens.into();
    b["temperature"] = 0.0.into();
    b["stream"] = stream.into();
    if stream {
        b["stream_options"] = json!({ "include_usage": true });
    }
    b["ignore_eos"] = true.into();
    if let Some(u) = &r.user {
        b["user"] = u.clone().into();
    }
    b
}

/// Runs every request, calling `progress` after each; returns outcomes in request order.
pub async fn run(
    client: &reqwest::Client,
    load: &Load,
    reqs: &[BenchRequest],
    progress: impl Fn(usize) + Send + Sync + 'static,
) -> (Vec<Outcome>, f64) {
    let limit = Arc::new(Semaphore::new(
        load.max_concurrency
            .unwrap_or(Semaphore::MAX_PERMITS)
            .max(1),
    ));
    let times = arrival_times(reqs.len(), load.request_rate, load.seed);
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let progress = Arc::new(progress);
    let start = Instant::now();
    let path = match load.endpoint {
        Endpoint::Completions => "/v1/completions",
        Endpoint::Chat => "/v1/chat/completions",
    };
    let url = format!("{}{path}", load.url.trim_end_matches('/'));
    let mut tasks = Vec::with_capacity(reqs.len());
    for (r, at) in reqs.iter().zip(times) {
        let wait = Duration::from_secs_f64(at).saturating_sub(start.elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let permit = limit.clone().acquire_owned().await.expect("semaphore open");
        let (client, url, body) = (
            client.clone(),
            url.clone(),
            body(&load.model, load.endpoint, load.stream, r),
        );
        let stream = load.stream;
        let (done, progress, timeout) = (done.clone(), progress.clone(), load.timeout);
        tasks.push(tokio::spawn(async move {
            let o = match tokio::time::timeout(timeout, one(&client, &url, &body, stream)).await {
                Ok(o) => o,
                Err(_) => Outcome {
                    error: Some(format!("no answer within {} s", timeout.as_secs())),
                    e2e_ms: timeout.as_secs_f64() * 1e3,
                    ..Outcome::default()
                },
            };
            drop(permit);
            progress(done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
            o
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("benchmark task failed: {e}")),
            ..Outcome::default()
        }));
    }
    (out, start.elapsed().as_secs_f64())
}

/// One request, timed.
async fn one(client: &reqwest::Client, url: &str, body: &Value, stream: bool) -> Outcome {
    let t0 = Instant::now();
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
    let mut o = Outcome::default();
    let resp = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("cannot reach {url}: {}", chain(&e)));
            o.e2e_ms = ms(Instant::now());
            return o;
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        o.error = Some(format!(
            "HTTP {status}: {}",
            crate::error_text::answer_message(text.as_bytes())
        ));
        o.e2e_ms = ms(Instant::now());
        return o;
    }
    if !stream {
        let text = resp.bytes().await;
        o.e2e_ms = ms(Instant::now());
        match text {
            Ok(bytes) => whole_answer(&bytes, &mut o),
            Err(e) => o.error = Some(format!("answer broke: {}", chain(&e))),
        }
        return o;
    }
    streamed_answer(resp, t0, &mut o).await;
    o.e2e_ms = ms(Instant::now());
    o
}

/// Reads a streamed answer into `o` (`t0`: when the request was sent): completed when
/// `[DONE]` ends it with no error event; the first content chunk gives the time to first
/// token, the gaps between the later ones the inter-token latencies.
async fn streamed_answer(resp: reqwest::Response, t0: Instant, o: &mut Outcome) {
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
    let mut stream = resp.bytes_stream();
    let mut events = crate::sse::Events::default();
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    'read: while let Some(item) = stream.next().await {
        let bytes = match item {
            Ok(b) => b,
            Err(e) => {
                o.error = Some(format!("stream broke: {}", chain(&e)));
                break;
            }
        };
        events.push(&bytes);
        while let Some(event) = events.next_event() {
            let now = Instant::now();
            let data = event.data.trim();
            if data == crate::sse::DONE {
                o.ok = o.error.is_none();
                break 'read;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(err) = v.get("error") {
                o.error = Some(format!(
                    "error event: {}",
                    err.get("message").and_then(Value::as_str).unwrap_or("?")
                ));
                break 'read;
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                o.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                o.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            }
            if has_content(&v) {
                chunks += 1;
                match last {
                    None => o.ttft_ms = Some(ms(now)),
                    Some(prev) => o.itl_ms.push(now.duration_since(prev).as_secs_f64() * 1e3),
                }
                last = Some(now);
            }
        }
    }
    if !o.ok && o.error.is_none() {
        o.error = Some("stream ended without [DONE]".into());
    }
    if o.output_tokens == 0 {
        o.output_tokens = chunks;
    }
}

/// Reads a whole JSON answer into `o`: completed when it parses, carries no error, and
/// every choice has content and a finish reason (a cut answer has none).
fn whole_answer(bytes: &[u8], o: &mut Outcome) {
    let v: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => {
            o.error = Some(format!("answer is not JSON: {e}"));
            return;
        }
    };
    if let Some(err) = v.get("error") {
        o.error = Some(format!(
            "error answer: {}",
            err.get("message").and_then(Value::as_str).unwrap_or("?")
        ));
        return;
    }
    let choices = v["choices"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if choices.is_empty() {
        o.error = Some("answer has no choices".into());
        return;
    }
    if let Some(c) = choices
        .iter()
        .find(|c| c["finish_reason"].as_str().is_none_or(str::is_empty))
    {
        o.error = Some(format!("choice {} has no finish reason", c["index"]));
        return;
    }
    if !has_content(&v) {
        o.error = Some("answer has no text".into());
        return;
    }
    o.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    o.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
    o.ok = true;
}

fn has_content(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            c["text"].as_str().is_some_and(|t| !t.is_empty())
                || c["message"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                || c["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_average_the_rate_and_repeat_with_the_seed() {
        let t = arrival_times(4000, Some(50.0), 1);
        let rate = (t.len() - 1) as f64 / t.last().unwrap();
        assert!((rate - 50.0).abs() < 5.0, "rate {rate}");
        assert_eq!(t, arrival_times(4000, Some(50.0), 1));
        assert_ne!(t, arrival_times(4000, Some(50.0), 2));
        assert!(arrival_times(3, None, 0).iter().all(|x| *x == 0.0));
    }

    #[test]
    fn bodies_stream_with_usage_and_carry_the_designation() {
        let r = BenchRequest {
            prompt: "hi there".into(),
            max_tokens: 8,
            user: Some("prefill=a:1;decode=b:2".into()),
            group: None,
        };
        let b = body("m", Endpoint::Chat, true, &r);
        assert_eq!(b["messages"][0]["content"], "hi there");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["user"], "prefill=a:1;decode=b:2");
        assert_eq!(
            body("m", Endpoint::Completions, true, &r)["prompt"],
            "hi there"
        );
        let whole = body("m", Endpoint::Completions, false, &r);
        assert_eq!(whole["stream"], false);
        assert!(whole.get("stream_options").is_none(), "{whole}");
    }

    fn read(answer: &str) -> Outcome {
        let mut o = Outcome::default();
        whole_answer(answer.as_bytes(), &mut o);
        o
    }

    #[test]
    fn a_whole_answer_counts_only_when_every_choice_finished_with_text() {
        let ok = read(
            r#"{"choices":[{"index":0,"message":{"content":"a b"},"finish_reason":"length"}],
                "usage":{"prompt_tokens":7,"completion_tokens":2}}"#,
        );
        assert!(ok.ok, "{ok:?}");
        assert_eq!((ok.prompt_tokens, ok.output_tokens), (7, 2));
        let cut = read(r#"{"choices":[{"index":0,"text":"a","finish_reason":null}]}"#);
        assert_eq!(cut.error.as_deref(), Some("choice 0 has no finish reason"));
        let err = read(r#"{"error":{"message":"decode leg failed: boom"}}"#);
        assert_eq!(
            err.error.as_deref(),
            Some("error answer: decode leg failed: boom")
        );
        assert!(!read("{}").ok);
        assert!(
            read("not json")
                .error
                .unwrap()
                .starts_with("answer is not JSON")
        );
    }
}
