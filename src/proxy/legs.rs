//! One attempt of one leg on one instance: send it, apply its timeout, and read its
//! answer the way the pipeline needs it (prefill: whole and parsed; decode: whole, or up to
//! its first stream chunk).

use super::Proxy;
use super::errors::{LegFailure, RAISE_FIRST_BYTE, RAISE_PREFILL, RAISE_TOTAL};
use super::h1;
use super::instances::{InFlight, Instance};
use super::protocol::{Body, PrefillAnswer};
use super::recompute::judgment::{Expect, Judgment, leg_sent, usage_in};
use super::request::ClientRequest;
use super::upstream::MAX_ANSWER_BYTES;
use super::usage_chunk;
use axum::http::HeaderValue;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What decode answered.
pub enum Answer {
    /// A non-streamed answer, read completely.
    Full {
        status: u16,
        content_type: Option<HeaderValue>,
        body: Bytes,
        /// Set when its usage shows that decode recomputed the prompt (the miss reason).
        recompute: Option<&'static str>,
    },
    /// A stream whose first chunk has arrived; `rest` is decode's body after it, `keep`
    /// holds what must live as long as the stream.
    Stream {
        first: Bytes,
        rest: h1::Body,
        keep: Keep,
    },
}

/// What a relayed stream keeps alive: decode's in-flight count, in a concurrent flow the
/// prefill leg still running in the background (cancelled if the stream is dropped), the
/// leg's account for recompute detection (judged by the usage chunk, which every streamed
/// leg with a handoff due asks for; the leg counts as ended when it is taken or dropped),
/// whether the usage chunk is the proxy's to take out (the client did not ask for it),
/// and the signal that decode's instance was found unreachable (the stream then ends with
/// an error event rather than waiting on a silent peer).
pub struct Keep {
    pub decode: InFlight,
    pub prefill: Option<AbortOnDrop>,
    pub judgment: Option<Judgment>,
    pub strip_usage: bool,
    pub unreachable: Lost,
}

/// The bytes of a decode leg: `body` (`None`: the client's own), with the usage chunk
/// asked for when the proxy needs it to judge the leg ([`usage_chunk::adds_usage`]) and the
/// token ids when the stream may have to be continued elsewhere ([`super::migration`]).
/// The client's bytes go as they are when nothing is added.
pub fn decode_bytes(body: Option<Body>, req: &ClientRequest, expect: Expect) -> Bytes {
    let adds = usage_chunk::adds_usage(req.stream, &req.body, expect);
    // A whole answer read as a stream by the proxy ([`super::whole`]) needs its usage.
    let streamed_for_proxy = !req.stream && req.decode_streams();
    match body {
        None if !adds && !req.migrates() => req.raw.clone(),
        body => {
            let mut b = body.unwrap_or_else(|| req.body.clone());
            if streamed_for_proxy {
                b.insert("stream".into(), serde_json::Value::Bool(true));
            }
            if adds || streamed_for_proxy {
                usage_chunk::ask_usage(&mut b);
            }
            if req.migrates() {
                super::migration::ask_ids(&mut b);
            }
            Bytes::from(serde_json::to_vec(&b).expect("JSON values serialize"))
        }
    }
}

/// Resolves with the reason once an instance is found unreachable ([`super::reach`]).
pub type Lost = std::pin::Pin<Box<dyn Future<Output = String> + Send>>;

/// Runs one leg's `work` on `inst` until it ends or the instance is found unreachable,
/// whichever comes first.
async fn unless_unreachable<T>(
    inst: &Instance,
    work: impl Future<Output = Result<T, LegFailure>>,
) -> Result<T, LegFailure> {
    tokio::select! {
        done = work => done,
        why = inst.reach.lost() => Err(LegFailure::Unreachable(why)),
    }
}

/// A background task cancelled when this handle is dropped.
pub struct AbortOnDrop(pub JoinHandle<Result<PrefillAnswer, LegFailure>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One prefill attempt: send, read the whole answer within --prefill-timeout-s, parse it.
pub async fn prefill_once(
    proxy: Arc<Proxy>,
    inst: Arc<Instance>,
    path: &'static str,
    body: Body,
    request_id: String,
) -> Result<PrefillAnswer, LegFailure> {
    let _busy = inst.begin();
    let limit = proxy.settings().prefill_timeout;
    let deadline = Instant::now() + limit;
    let started = Instant::now();
    let bytes = serde_json::to_vec(&body).expect("JSON values serialize");
    let work = async {
        let client = proxy.upstream.legs();
        let resp = client
            .post_json(&inst.url, path, &bytes, &request_id)
            .await?;
        if !(200..300).contains(&resp.status) {
            return Err(status_failure(resp, deadline).await);
        }
        inst.note_answered();
        resp.body.read_all(MAX_ANSWER_BYTES).await
    };
    let answer = tokio::time::timeout_at(deadline, unless_unreachable(&inst, work))
        .await
        .map_err(|_| LegFailure::Timeout {
            limit,
            raise: RAISE_PREFILL,
        })??;
    proxy.recorder.prefill_done(started.elapsed());
    serde_json::from_slice(&answer).map_err(|e| {
        LegFailure::BadAnswer(format!("a prefill answer that is not a JSON object ({e})"))
    })
}

/// Turns a leg's non-2xx answer into a [`LegFailure::Status`] that keeps the engine's body
/// (for passing 4xx through) and a short message (for the proxy's own error).
async fn status_failure(resp: h1::Response, deadline: Instant) -> LegFailure {
    let body = tokio::time::timeout_at(deadline, resp.body.read_all(1024 * 1024))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    LegFailure::Status {
        status: resp.status,
        message: crate::error_text::answer_message(&body),
        body,
        content_type: resp.content_type,
    }
}

/// One decode attempt. Streams: wait for the first chunk within --first-byte-timeout-s.
/// Non-streamed answers: read it all within the total deadline (vLLM sends nothing before
/// it has finished generating), and check its usage for a recompute. `expect` says what
/// the proxy expects of decode's KV, for the recompute check (recompute.rs). Ends early,
/// [`LegFailure::Unreachable`], when the instance is found unreachable meanwhile.
pub async fn decode_once(
    proxy: &Proxy,
    req: &ClientRequest,
    inst: Arc<Instance>,
    body: Bytes,
    expect: Expect,
) -> Result<(Answer, Option<Duration>), LegFailure> {
    let reach = inst.clone();
    unless_unreachable(&reach, decode_attempt(proxy, req, inst, body, expect)).await
}

async fn decode_attempt(
    proxy: &Proxy,
    req: &ClientRequest,
    inst: Arc<Instance>,
    body: Bytes,
    expect: Expect,
) -> Result<(Answer, Option<Duration>), LegFailure> {
    let strip_usage = usage_chunk::adds_usage(req.stream, &req.body, expect);
    let usage_expected = !req.stream || strip_usage || usage_chunk::asks_usage(&req.body);
    let judgment = leg_sent(
        &proxy.recorder,
        &inst,
        expect,
        usage_expected,
        proxy.handoff,
        &req.id,
    );
    let guard = inst.begin();
    let sent = Instant::now();
    let (limit, raise, deadline) = decode_deadline(proxy, req, sent);
    let timed_out = |_| LegFailure::Timeout { limit, raise };
    let client = proxy.upstream.legs();
    let resp = tokio::time::timeout_at(
        deadline,
        client.post_json(&inst.url, req.path, &body, &req.id),
    )
    .await
    .map_err(timed_out)??;
    let load_may_fail = kv_load_may_fail(proxy, expect);
    if !(200..300).contains(&resp.status) {
        let f = status_failure(resp, deadline).await;
        return Err(match f {
            LegFailure::Status {
                status: 500,
                message,
                ..
            } if load_may_fail => kv_load_failed(proxy, &inst, &req.id, 500, message),
            f => f,
        });
    }
    inst.note_answered();
    if !req.decode_streams() {
        return whole_answer(resp, (limit, raise, deadline), judgment, sent).await;
    }
    let mut rest = resp.body;
    let first = tokio::time::timeout_at(deadline, first_chunk(&mut rest))
        .await
        .map_err(|_| LegFailure::Timeout { limit, raise })??;
    if load_may_fail && let Some(message) = error_event_message(&first) {
        return Err(kv_load_failed(proxy, &inst, &req.id, 500, message));
    }
    let took = sent.elapsed();
    if req.stream {
        proxy.recorder.decode_first_byte(took);
    }
    Ok((
        Answer::Stream {
            first,
            rest,
            keep: Keep {
                unreachable: Box::pin(inst.reach.lost()),
                decode: guard,
                prefill: None,
                judgment: Some(judgment),
                strip_usage,
            },
        },
        Some(took),
    ))
}

/// A decode leg's answer read whole (nothing of it goes to the client before its end)
/// by the leg's `deadline`, judged for a silent recompute from its usage.
async fn whole_answer(
    resp: h1::Response,
    (limit, raise, deadline): (Duration, &'static str, Instant),
    judgment: Judgment,
    sent: Instant,
) -> Result<(Answer, Option<Duration>), LegFailure> {
    let body = tokio::time::timeout_at(deadline, resp.body.read_all(MAX_ANSWER_BYTES))
        .await
        .map_err(|_| LegFailure::Timeout { limit, raise })??;
    let took = sent.elapsed();
    let recompute = judgment.judge(usage_in(&body));
    Ok((
        Answer::Full {
            status: resp.status,
            content_type: resp.content_type,
            body,
            recompute,
        },
        Some(took),
    ))
}

/// How long a decode leg sent at `sent` may wait for its answer (a stream: its first
/// byte), the setting that says so, and when the wait ends: whichever limit ends it first
/// is the one an error names.
fn decode_deadline(
    proxy: &Proxy,
    req: &ClientRequest,
    sent: Instant,
) -> (Duration, &'static str, Instant) {
    let first_byte = sent + proxy.settings().first_byte_timeout;
    if req.stream && first_byte <= req.deadline {
        (
            proxy.settings().first_byte_timeout,
            RAISE_FIRST_BYTE,
            first_byte,
        )
    } else {
        (proxy.settings().total_timeout, RAISE_TOTAL, req.deadline)
    }
}

/// The first chunk of a decode stream.
async fn first_chunk(rest: &mut h1::Body) -> Result<Bytes, LegFailure> {
    match rest.next().await {
        None => Err(LegFailure::Body(
            "it ended the stream without sending anything".into(),
        )),
        Some(Err(e)) => Err(LegFailure::Body(e.to_string())),
        Some(Ok(first)) => Ok(first),
    }
}

/// Whether a decode error may be a KV load that failed: the decode runs with
/// kv_load_failure_policy "fail" and this request was handed KV. vLLM then finishes the
/// request with finish reason "error" and answers its generic generation error (a 500
/// "Internal server error", or that error as the first event of a stream), which says
/// nothing of the KV; the proxy knows the handoff was due and names it.
fn kv_load_may_fail(proxy: &Proxy, expect: Expect) -> bool {
    proxy.kv_load_failure_policy == crate::topology::KvLoadFailurePolicy::Fail
        && matches!(expect, Expect::Handoff { .. })
}

/// Counts and logs a decode that failed a request it was handed KV for.
fn kv_load_failed(
    proxy: &Proxy,
    inst: &Instance,
    request_id: &str,
    status: u16,
    message: String,
) -> LegFailure {
    proxy.recorder.kv_load_failed();
    tracing::warn!(
        request_id = %request_id,
        "decode {} could not load the KV handed over and failed the request (kv_load_failure_policy fail; it said {status}: {message})",
        inst.url
    );
    LegFailure::KvLoad { status, message }
}

/// The message of an OpenAI-style error event (`data: {"error": {...}}`) that opens a
/// stream, as vLLM sends a generation error once the stream has begun.
fn error_event_message(chunk: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(chunk).ok()?;
    let data = text.trim_start().strip_prefix("data:")?;
    let data = data.split("\n\n").next()?.trim();
    let v: serde_json::Value = serde_json::from_str(data).ok()?;
    let e = v.get("error")?;
    Some(
        e.get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("(no message)")
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_event_opening_a_stream_is_found_and_tokens_are_not() {
        let ev = b"data: {\"error\": {\"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            error_event_message(ev).as_deref(),
            Some("Internal server error")
        );
        let tok = b"data: {\"id\":\"cmpl-1\",\"choices\":[{\"text\":\"error\"}]}\n\n";
        assert_eq!(error_event_message(tok), None);
        assert_eq!(error_event_message(b"data: [DONE]\n\n"), None);
    }
}
