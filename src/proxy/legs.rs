//! One attempt of one leg on one instance: send it, apply its timeout, and read its
//! answer the way the pipeline needs it (prefill: whole and parsed; decode: whole, or up to
//! its first stream chunk).

use super::Proxy;
use super::errors::LegFailure;
use super::instances::{InFlight, Instance};
use super::pipeline::ClientRequest;
use super::protocol::Body;
use super::upstream::{MAX_ANSWER_BYTES, read_body, status_failure};
use axum::http::HeaderValue;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::Value;
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
    },
    /// A stream whose first chunk has arrived; `keep` holds what must live as long as it.
    Stream {
        first: Bytes,
        rest: BoxStream<'static, Result<Bytes, reqwest::Error>>,
        keep: Keep,
    },
}

/// What a relayed stream keeps alive: decode's in-flight count and, in a concurrent flow,
/// the prefill leg still running in the background (cancelled if the stream is dropped).
pub struct Keep {
    pub decode: InFlight,
    pub prefill: Option<AbortOnDrop>,
}

/// A background task cancelled when this handle is dropped.
pub struct AbortOnDrop(pub JoinHandle<Result<Value, LegFailure>>);

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
) -> Result<Value, LegFailure> {
    let _busy = inst.begin();
    let limit = proxy.settings.prefill_timeout;
    let deadline = Instant::now() + limit;
    let started = Instant::now();
    let bytes = Bytes::from(serde_json::to_vec(&body).expect("JSON values serialize"));
    let work = async {
        let resp = proxy
            .upstream
            .post_json(&format!("{}{path}", inst.url), bytes, &request_id)
            .await?;
        if !resp.status().is_success() {
            return Err(status_failure(resp, deadline).await);
        }
        read_body(resp, MAX_ANSWER_BYTES).await
    };
    let answer = tokio::time::timeout_at(deadline, work)
        .await
        .map_err(|_| LegFailure::Timeout(limit))??;
    proxy.metrics.prefill_duration.observe(started.elapsed());
    serde_json::from_slice(&answer)
        .map_err(|e| LegFailure::BadAnswer(format!("a prefill answer that is not JSON ({e})")))
}

/// One decode attempt. Streams: wait for the first chunk within --first-byte-timeout-s.
/// Non-streamed answers: read it all within the total deadline (vLLM sends nothing before
/// it has finished generating).
pub async fn decode_once(
    proxy: &Proxy,
    req: &ClientRequest,
    inst: Arc<Instance>,
    body: Bytes,
) -> Result<(Answer, Option<Duration>), LegFailure> {
    let guard = inst.begin();
    let url = format!("{}{}", inst.url, req.path);
    let sent = Instant::now();
    let (limit, deadline) = if req.stream {
        let limit = proxy.settings.first_byte_timeout;
        (limit, (sent + limit).min(req.deadline))
    } else {
        (proxy.settings.total_timeout, req.deadline)
    };
    let timed_out = |_| LegFailure::Timeout(limit);
    let resp = tokio::time::timeout_at(deadline, proxy.upstream.post_json(&url, body, &req.id))
        .await
        .map_err(timed_out)??;
    if !resp.status().is_success() {
        return Err(status_failure(resp, deadline).await);
    }
    if !req.stream {
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .cloned();
        let body = tokio::time::timeout_at(deadline, read_body(resp, MAX_ANSWER_BYTES))
            .await
            .map_err(timed_out)??;
        let took = sent.elapsed();
        return Ok((
            Answer::Full {
                status,
                content_type,
                body,
            },
            Some(took),
        ));
    }
    let mut rest = resp.bytes_stream().boxed();
    let first = loop {
        match tokio::time::timeout_at(deadline, rest.next()).await {
            Err(_) => return Err(LegFailure::Timeout(limit)),
            Ok(None) => {
                return Err(LegFailure::Body(
                    "it ended the stream without sending anything".into(),
                ));
            }
            Ok(Some(Err(e))) => return Err(LegFailure::Body(e.to_string())),
            Ok(Some(Ok(b))) if b.is_empty() => continue,
            Ok(Some(Ok(b))) => break b,
        }
    };
    let took = sent.elapsed();
    proxy.metrics.decode_ttft.observe(took);
    Ok((
        Answer::Stream {
            first,
            rest,
            keep: Keep {
                decode: guard,
                prefill: None,
            },
        },
        Some(took),
    ))
}
