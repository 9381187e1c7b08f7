//! Relays decode's SSE stream to the client chunk by chunk. Whatever must live as long as
//! the stream (decode's in-flight count, the admission slot, the request's account, a
//! background prefill) is owned by the stream, so it ends exactly when the client's
//! response ends, or when the client goes away (which drops, and so cancels, both legs).
//! A decode failure mid-stream becomes an SSE error event, then the stream closes.

use super::errors::{LegError, LegFailure, ProxyError};
use super::instances::{FailureKind, Leg};
use super::legs::Keep;
use super::limits::Admission;
use super::record::{Outcome, RequestRecord};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use futures_util::stream::BoxStream;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::time::{Instant, Sleep};

/// The marker vLLM ends every stream with.
const DONE_MARKER: &[u8] = b"data: [DONE]";

/// The client-facing stream.
pub struct Relay {
    first: Option<Bytes>,
    rest: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    keep: Keep,
    rec: RequestRecord,
    _admission: Admission,
    deadline: Pin<Box<Sleep>>,
    total_limit: std::time::Duration,
    /// Last bytes seen, to find the [DONE] marker across chunk boundaries.
    tail: Vec<u8>,
    saw_done: bool,
    finished: bool,
}

/// The response for a decode stream whose first chunk has arrived.
pub fn stream_response(
    first: Bytes,
    rest: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    keep: Keep,
    mut rec: RequestRecord,
    admission: Admission,
    deadline: Instant,
    total_limit: std::time::Duration,
) -> Response {
    rec.status = 200;
    let request_id = rec.id.clone();
    let relay = Relay {
        first: Some(first),
        rest,
        keep,
        rec,
        _admission: admission,
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        total_limit,
        tail: Vec::new(),
        saw_done: false,
        finished: false,
    };
    let mut r = Response::new(axum::body::Body::from_stream(relay));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        h.insert("x-request-id", v);
    }
    r
}

/// An SSE event carrying an OpenAI-style error object.
pub fn error_event(err: &ProxyError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", err.to_json()))
}

impl Relay {
    fn note(&mut self, chunk: &[u8]) {
        if self.saw_done {
            return;
        }
        self.tail.extend_from_slice(chunk);
        if self
            .tail
            .windows(DONE_MARKER.len())
            .any(|w| w == DONE_MARKER)
        {
            self.saw_done = true;
        }
        let keep_from = self.tail.len().saturating_sub(DONE_MARKER.len());
        self.tail.drain(..keep_from);
    }

    /// Ends the stream with an error event for the client.
    fn fail(&mut self, err: ProxyError) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        tracing::warn!(request_id = %self.rec.id, "stream to the client ends with an error: {err}");
        self.finished = true;
        self.rec.outcome = Outcome::Failed(err.to_string());
        Poll::Ready(Some(Ok(error_event(&err))))
    }

    fn decode_failed(
        &mut self,
        failure: LegFailure,
    ) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        let inst = self.keep.decode.instance().clone();
        inst.record_failure(FailureKind::Body);
        self.fail(
            LegError {
                leg: Leg::Decode,
                instance: inst.url.clone(),
                failure,
            }
            .into(),
        )
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready(None);
        }
        if let Some(first) = this.first.take() {
            this.rec.first_byte_sent();
            this.note(&first);
            return Poll::Ready(Some(Ok(first)));
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            let limit = this.total_limit;
            return this.fail(ProxyError::TotalTimeout(limit));
        }
        match this.rest.as_mut().poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(chunk))) => {
                this.note(&chunk);
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                let mut cause: &dyn std::error::Error = &e;
                while let Some(next) = cause.source() {
                    cause = next;
                }
                let msg = format!("the stream broke off: {cause}");
                this.decode_failed(LegFailure::Body(msg))
            }
            Poll::Ready(None) if !this.saw_done => this.decode_failed(LegFailure::Body(
                "it closed the stream without the final `data: [DONE]`".into(),
            )),
            Poll::Ready(None) => {
                this.finished = true;
                this.rec.outcome = Outcome::Complete;
                Poll::Ready(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_event_is_one_sse_data_line_with_an_error_object() {
        let e: ProxyError = LegError {
            leg: Leg::Decode,
            instance: "http://h:1".into(),
            failure: LegFailure::Body("reset".into()),
        }
        .into();
        let ev = error_event(&e);
        let text = std::str::from_utf8(&ev).unwrap();
        assert!(text.starts_with("data: {\"error\":"), "{text}");
        assert!(text.ends_with("\n\n"));
        let v: serde_json::Value =
            serde_json::from_str(text.trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(v["error"]["leg"], "decode");
    }
}
