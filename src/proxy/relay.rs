//! Relays decode's SSE stream to the client chunk by chunk. Whatever must live as long as
//! the stream (decode's in-flight count, the admission slot, the request's account, a
//! background prefill) is owned by the stream, so it ends exactly when the client's
//! response ends, or when the client goes away (which drops, and so cancels, both legs).
//! A decode failure mid-stream becomes an SSE error event, then the stream closes.

use super::errors::{LegError, LegFailure, ProxyError};
use super::h1;
use super::instances::{FailureKind, Leg};
use super::legs::Keep;
use super::limits::Admission;
use super::recompute::judgment::{UsageSeen, usage_in};
use super::record::{Outcome, RequestRecord};
use super::usage_chunk::UsageStrip;
use crate::sse::DoneTail;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::time::{Instant, Sleep};

/// The client-facing stream.
pub struct Relay {
    first: Option<Bytes>,
    rest: h1::Body,
    keep: Keep,
    rec: RequestRecord,
    deadline: Pin<Box<Sleep>>,
    total_limit: std::time::Duration,
    /// The end of what was relayed, to tell a complete stream from one cut short.
    end: DoneTail,
    /// The last usage seen in the stream (looked for only when `keep.judgment` is set).
    usage: Option<UsageSeen>,
    /// Takes out the usage chunk the proxy asked for and the client did not.
    strip: Option<UsageStrip>,
    finished: bool,
    ties: Ties,
}

/// What a stream holds until it ends: its admission slot and its place among the requests
/// in flight that a shutdown waits for; and the signal that cuts it (with an error event
/// and `[DONE]`) when the shutdown grace runs out.
pub struct Ties {
    /// Held, never read: dropping it frees the slot.
    #[allow(dead_code)]
    pub admission: Admission,
    /// Held, never read: dropping it tells a shutdown this request is over.
    #[allow(dead_code)]
    pub in_flight: super::drain::InFlight,
    pub cut: super::drain::CutSignal,
}

/// The response for a decode stream whose first chunk has arrived.
pub fn stream_response(
    first: Bytes,
    rest: h1::Body,
    keep: Keep,
    mut rec: RequestRecord,
    deadline: Instant,
    total_limit: std::time::Duration,
    ties: Ties,
) -> Response {
    rec.status = 200;
    let request_id = rec.id.clone();
    let strip = keep.strip_usage.then(UsageStrip::default);
    let relay = Relay {
        first: Some(first),
        rest,
        keep,
        rec,
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        total_limit,
        end: DoneTail::default(),
        usage: None,
        strip,
        finished: false,
        ties,
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

/// An error event followed by `data: [DONE]`, so a client reading to `[DONE]` stops there
/// and knows why the answer is short.
fn with_done(event: &[u8]) -> Bytes {
    let mut both = Vec::with_capacity(event.len() + 14);
    both.extend_from_slice(event);
    both.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(both)
}

/// An SSE event carrying an OpenAI-style error object.
pub fn error_event(err: &ProxyError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", err.to_json()))
}

impl Relay {
    /// Ends the stream with an error event for the client.
    fn fail(&mut self, err: ProxyError) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        Poll::Ready(Some(Ok(self.last_event(err))))
    }

    /// Records the stream as failed and gives its last event: the error, after what the
    /// usage strip still held.
    fn last_event(&mut self, err: ProxyError) -> Bytes {
        tracing::warn!(request_id = %self.rec.id, "stream to the client ends with an error: {err}");
        self.finished = true;
        self.rec.outcome = Outcome::Failed(err.to_string());
        match self.strip.as_mut().map(UsageStrip::finish) {
            Some(held) if !held.is_empty() => Bytes::from([&held[..], &error_event(&err)].concat()),
            _ => error_event(&err),
        }
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

impl Relay {
    /// Ends a stream whose decode instance was found unreachable: an error event naming
    /// it, then `[DONE]`, as a shutdown's cut does.
    fn cut_off(&mut self, why: String) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        let inst = self.keep.decode.instance().clone();
        inst.record_failure(FailureKind::Timeout);
        let event = self.last_event(
            LegError {
                leg: Leg::Decode,
                instance: inst.url.clone(),
                failure: LegFailure::Unreachable(why),
            }
            .into(),
        );
        Poll::Ready(Some(Ok(with_done(&event))))
    }

    /// What of decode's `chunk` goes to the client now (`None`: nothing yet), noted: the
    /// usage chunk the client did not ask for is taken out, and the usage is kept for
    /// judging the leg.
    fn pass(&mut self, chunk: Bytes) -> Option<Bytes> {
        let out = match &mut self.strip {
            Some(strip) => strip.push(&chunk),
            None => {
                if self.keep.judgment.is_some()
                    && let Some(u) = usage_in(&chunk)
                {
                    self.usage = Some(u);
                }
                chunk
            }
        };
        if out.is_empty() {
            return None;
        }
        self.push(&out);
        Some(out)
    }

    /// Notes a chunk handed to the client. Once the last event is `[DONE]` the client has
    /// the whole answer: a client that closes then (most do, at once) completed, it did not
    /// disconnect, even if decode has not closed its end yet.
    fn push(&mut self, chunk: &[u8]) {
        self.end.push(chunk);
        if self.end.is_done() {
            self.rec.outcome = Outcome::Complete;
            // The usage chunk comes right before [DONE]: judge decode's KV once.
            let usage = self.usage.or(self.strip.as_ref().and_then(|s| s.usage));
            if let Some(j) = self.keep.judgment.take()
                && let Some(reason) = j.judge(usage)
            {
                self.rec.handoff_miss = Some(reason);
            }
        } else if self.rec.outcome == Outcome::Complete {
            // Events after [DONE]: not complete after all.
            self.rec.outcome = Outcome::Pending;
        }
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.finished {
                return Poll::Ready(None);
            }
            if let Some(first) = this.first.take() {
                this.rec.first_byte_sent();
                match this.pass(first) {
                    Some(out) => return Poll::Ready(Some(Ok(out))),
                    None => continue,
                }
            }
            if let Some(end) = this.interrupted(cx) {
                return end;
            }
            match this.rest.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    if let Some(out) = this.pass(chunk) {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    return this.decode_failed(LegFailure::Body(e.to_string()));
                }
                Poll::Ready(None) => return this.ended(),
            }
        }
    }
}

impl Relay {
    /// Ends the stream early when its deadline passed, its decode was found unreachable,
    /// or a shutdown's grace ran out; `None` while none of them happened.
    fn interrupted(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Option<Poll<Option<Result<Bytes, std::convert::Infallible>>>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            let limit = self.total_limit;
            return Some(self.fail(ProxyError::TotalTimeout(limit)));
        }
        if let Poll::Ready(why) = self.keep.unreachable.as_mut().poll(cx) {
            return Some(self.cut_off(why));
        }
        if self.ties.cut.as_mut().poll(cx).is_ready() {
            // Like vLLM's own error ends: the error event, then [DONE], so a client reading
            // to [DONE] stops there and knows why the answer is short.
            let event = self.last_event(ProxyError::CutByShutdown);
            return Some(Poll::Ready(Some(Ok(with_done(&event)))));
        }
        None
    }

    /// Decode closed its stream: what the strip still holds goes out first, then the
    /// stream ends, complete if it ended with `[DONE]`.
    fn ended(&mut self) -> Poll<Option<Result<Bytes, std::convert::Infallible>>> {
        let held = self.strip.as_mut().map(UsageStrip::finish);
        if let Some(tail) = held.filter(|t| !t.is_empty()) {
            self.push(&tail);
            return Poll::Ready(Some(Ok(tail)));
        }
        if !self.end.is_done() {
            return self.decode_failed(LegFailure::Body(
                "it closed the stream without the final `data: [DONE]`".into(),
            ));
        }
        self.finished = true;
        self.rec.outcome = Outcome::Complete;
        Poll::Ready(None)
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
