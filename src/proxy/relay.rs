//! Relays decode's SSE stream to the client chunk by chunk. Whatever must live as long as
//! the stream (decode's in-flight count, the admission slot, the request's account, a
//! background prefill) is owned by the stream, so it ends exactly when the client's
//! response ends, or when the client goes away (which drops, and so cancels, both legs).
//! A decode failure mid-stream becomes an SSE error event, then the stream closes.

use super::Proxy;
use super::errors::{LegError, LegFailure, ProxyError};
use super::h1;
use super::instances::{FailureKind, Leg};
use super::legs::{Answer, Keep};
use super::limits::Admission;
use super::migration::{self, Form, Out, Tracker};
use super::recompute::judgment::{UsageSeen, usage_in};
use super::record::{Outcome, RequestRecord};
use super::request::{ClientRequest, Migration};
use super::usage_chunk::UsageStrip;
use crate::sse::DoneTail;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::time::Sleep;

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
    /// Set when the answer may be continued on another decode ([`super::migration`]).
    carry: Option<Box<Carry>>,
    /// Why it may not, when the request is the reason, for the error a broken-off
    /// stream ends with, and the counter of refusals.
    refused: Option<(&'static str, Arc<dyn super::recorder::Recorder>)>,
    /// Set when the client asked for one body ([`whole_response`]): the stream is read by
    /// the proxy, and the error it ended with is kept for the client's error response.
    whole: Option<Option<ProxyError>>,
    /// Set when decode sent a server error as an event mid-stream (vLLM's engine core
    /// died): the leg is treated as broken off, what came after it is dropped.
    engine_error: Option<String>,
}

/// What continuing a stream on another decode needs: the client's request, what it was
/// sent so far, the current leg's events framed whole (so a continuation never follows
/// half an event), and the continuation being set up.
struct Carry {
    proxy: Arc<Proxy>,
    req: ClientRequest,
    tracker: Tracker,
    events: crate::sse::Events,
    /// The decode the current leg is on.
    decode: String,
    /// Resolves once that decode has been draining for `--drain-grace-s`.
    drained: Pin<Box<dyn Future<Output = ()> + Send>>,
    pending: Option<Continuing>,
}

/// A continuation on its way: its request through the protocol's flow, up to its first
/// chunk; what broke the leg before it; the form its events come in.
struct Continuing {
    answer: Pin<Box<dyn Future<Output = Continued> + Send>>,
    broke: ProxyError,
    form: Form,
    carried: u32,
    exact: bool,
}

/// What a continuation's request came to, and its own account (retries, instances).
type Continued = (Result<Answer, ProxyError>, RequestRecord);

/// The item type of the client's stream.
type Item = Poll<Option<Result<Bytes, std::convert::Infallible>>>;

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
    parts: (Bytes, h1::Body, Keep),
    rec: RequestRecord,
    (proxy, req): (&Arc<Proxy>, &ClientRequest),
    ties: Ties,
) -> Response {
    let relay = Relay::new(parts, rec, (proxy, req), ties);
    let request_id = relay.rec.id.clone();
    let mut r = Response::new(axum::body::Body::from_stream(relay));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    with_request_id(r, &request_id)
}

/// The response for a client that asked for one body and whose decode leg was streamed so
/// that its answer could be continued elsewhere ([`super::whole`]): the stream is read to
/// its end here (continued where it broke off) and the client gets the whole answer, or
/// the error the stream ended with, as an error response.
pub async fn whole_response(
    parts: (Bytes, h1::Body, Keep),
    rec: RequestRecord,
    (proxy, req): (&Arc<Proxy>, &ClientRequest),
    ties: Ties,
) -> Response {
    let mut relay = Relay::new(parts, rec, (proxy, req), ties);
    relay.whole = Some(None);
    let mut events = Vec::new();
    while let Some(Ok(chunk)) = std::future::poll_fn(|cx| Pin::new(&mut relay).poll_next(cx)).await
    {
        events.extend_from_slice(&chunk);
    }
    let id = relay.rec.id.clone();
    if let Some(Some(err)) = relay.whole.take() {
        relay.rec.fail(err.status().as_u16(), err.to_string());
        return with_request_id(axum::response::IntoResponse::into_response(err), &id);
    }
    let chat = req.path == "/v1/chat/completions";
    let ids = migration::asked_ids(&req.body);
    match super::whole::assemble(&events, chat, ids) {
        Ok(body) => {
            relay.rec.first_byte_sent();
            let mut r = Response::new(axum::body::Body::from(body));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            with_request_id(r, &id)
        }
        Err(e) => {
            let err: ProxyError = LegError {
                leg: Leg::Decode,
                instance: relay.keep.decode.instance().url.clone(),
                failure: LegFailure::BadAnswer(e.to_string()),
            }
            .into();
            relay.rec.fail(err.status().as_u16(), err.to_string());
            with_request_id(axum::response::IntoResponse::into_response(err), &id)
        }
    }
}

fn with_request_id(mut r: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

impl Relay {
    /// The relay of a decode stream whose first chunk has arrived.
    fn new(
        (first, rest, keep): (Bytes, h1::Body, Keep),
        mut rec: RequestRecord,
        (proxy, req): (&Arc<Proxy>, &ClientRequest),
        ties: Ties,
    ) -> Relay {
        rec.status = 200;
        let refused = match req.migration {
            Migration::Refused(why) => Some((why, proxy.recorder.clone())),
            Migration::On | Migration::Off => None,
        };
        let carry = req.migrates().then(|| {
            Box::new(Carry {
                proxy: proxy.clone(),
                req: req.clone(),
                tracker: Tracker::new(req),
                events: crate::sse::Events::default(),
                decode: keep.decode.instance().url.clone(),
                drained: Box::pin(
                    keep.decode
                        .instance()
                        .drained
                        .past(proxy.settings().drain_grace),
                ),
                pending: None,
            })
        });
        let strip = keep.strip_usage.then(UsageStrip::default);
        Relay {
            first: Some(first),
            rest,
            keep,
            rec,
            deadline: Box::pin(tokio::time::sleep_until(req.deadline)),
            total_limit: proxy.settings().total_timeout,
            end: DoneTail::default(),
            usage: None,
            strip,
            finished: false,
            ties,
            carry,
            refused,
            whole: None,
            engine_error: None,
        }
    }
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
        if let Some(kept) = self.whole.as_mut() {
            *kept = Some(err.clone());
        }
        self.rec.outcome = Outcome::Failed(err.to_string());
        match self.strip.as_mut().map(UsageStrip::finish) {
            Some(held) if !held.is_empty() => Bytes::from([&held[..], &error_event(&err)].concat()),
            _ => error_event(&err),
        }
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
                if this.whole.is_none() {
                    this.rec.first_byte_sent();
                }
                match this.relay_chunk(first) {
                    Some(out) => return Poll::Ready(Some(Ok(out))),
                    None => continue,
                }
            }
            if let Some(why) = this.engine_error.take() {
                let f = LegFailure::Body(format!("it sent an error event mid-stream ({why})"));
                if let Some(end) = this.broke(f, migration::BROKE_ENGINE_ERROR) {
                    return end;
                }
                continue;
            }
            if let Some(end) = this.interrupted(cx) {
                return end;
            }
            if this.carry.as_ref().is_some_and(|c| c.pending.is_some()) {
                match this.poll_continuation(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => continue,
                    Poll::Ready(Some(end)) => return end,
                }
            }
            match this.rest.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    if let Some(out) = this.relay_chunk(chunk) {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let f = LegFailure::Body(e.to_string());
                    if let Some(end) = this.broke(f, migration::BROKE_CONNECTION) {
                        return end;
                    }
                }
                Poll::Ready(None) => {
                    if let Some(end) = this.ended() {
                        return end;
                    }
                }
            }
        }
    }
}

impl Relay {
    /// What of decode's `chunk` goes to the client now: through the carry (whole events,
    /// noted and written in the client's form) when the answer may be continued, then
    /// through [`Relay::pass`].
    fn relay_chunk(&mut self, chunk: Bytes) -> Option<Bytes> {
        let Some(carry) = self.carry.as_mut() else {
            return self.pass(chunk);
        };
        carry.events.push(&chunk);
        let mut out = Vec::with_capacity(chunk.len() + 64);
        while let Some(ev) = carry.events.next_event() {
            if let Some(why) = migration::engine_error(&ev.data) {
                // The leg is over: what it sends after the error ([DONE]) is its own end.
                carry.events = crate::sse::Events::default();
                self.engine_error = Some(why);
                break;
            }
            let mut usage = None;
            match carry.tracker.event(&ev.data, &mut usage) {
                Out::Same => sse_event(&mut out, &ev.data),
                Out::Rewritten(data) => sse_event(&mut out, &data),
                Out::Dropped => {}
            }
            // A continuation's usage is rewritten for the client: its leg is judged by
            // its own here.
            if let Some(u) = usage.and_then(|u| serde_json::from_value(u).ok())
                && let Some(j) = self.keep.judgment.take()
                && let Some(reason) = j.judge(Some(u))
            {
                self.rec.handoff_miss = Some(reason);
            }
        }
        if out.is_empty() {
            return None;
        }
        self.pass(Bytes::from(out))
    }

    /// The decode leg broke off (`failure`, counted as `reason`): the answer is continued
    /// on another decode when it may be (`None`: the continuation is on its way), else the
    /// stream ends with an error event saying why it was not.
    fn broke(&mut self, failure: LegFailure, reason: &'static str) -> Option<Item> {
        let inst = self.keep.decode.instance().clone();
        let kind = match failure {
            LegFailure::Unreachable(_) => FailureKind::Timeout,
            _ => FailureKind::Body,
        };
        // A drain's hand-over is no fault of the instance.
        if reason != migration::BROKE_DRAINED {
            inst.record_failure(kind);
        }
        let err: ProxyError = LegError {
            leg: Leg::Decode,
            instance: inst.url.clone(),
            failure,
        }
        .into();
        let Some(carry) = self.carry.as_mut() else {
            return Some(self.fail_after(err));
        };
        if carry.tracker.sent().finished {
            return Some(self.finish_locally());
        }
        let limit = carry.proxy.settings().migration_limit;
        if carry.tracker.hops >= limit {
            carry.proxy.recorder.migration_refused("limit");
            let why = format!("it was continued {limit} times already (--migration-limit)");
            return Some(self.fail_with(migration::not_continued(err, why)));
        }
        let cap = carry.proxy.settings().migration_max_tokens;
        let hop = carry.tracker.hops + 1;
        let (next, form) = match migration::continuation(&carry.req, carry.tracker.sent(), hop, cap)
        {
            Ok(x) => x,
            Err(why) => {
                carry.proxy.recorder.migration_refused("tokens");
                return Some(self.fail_with(migration::not_continued(err, why)));
            }
        };
        carry.tracker.hops = hop;
        carry.proxy.recorder.migrated(reason);
        let sent = carry.tracker.sent();
        let exact = matches!(form, Form::ChatViaCompletions { .. })
            || (sent.ids_exact() && next.body["prompt"].is_array());
        let carried = sent.tokens();
        tracing::warn!(
            request_id = %self.rec.id,
            "decode {} broke off mid-stream ({err}) after {carried} tokens; continuing the answer elsewhere (continuation {hop} of at most {limit}, carried as {})",
            carry.decode,
            if exact { "token ids" } else { "text" },
        );
        let mut avoid = vec![carry.decode.clone()];
        avoid.extend(next.avoid.iter().cloned());
        let mut next = next;
        next.avoid = avoid;
        let proxy = carry.proxy.clone();
        let answer = Box::pin(async move {
            let mut rec = RequestRecord::inner(next.path, next.id.clone());
            let out = super::pipeline::run(&proxy, &next, &mut rec).await;
            (out, rec)
        });
        carry.events = crate::sse::Events::default();
        carry.pending = Some(Continuing {
            answer,
            broke: err,
            form,
            carried,
            exact,
        });
        None
    }

    /// Polls the continuation on its way: `Ready(None)` once its leg is in place (its
    /// first chunk next), `Ready(Some(..))` when it failed and the stream ends.
    fn poll_continuation(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let Some(carry) = self.carry.as_mut() else {
            return Poll::Ready(None);
        };
        let Some(pending) = carry.pending.as_mut() else {
            return Poll::Ready(None);
        };
        let (out, inner) = match pending.answer.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(done) => done,
        };
        let pending = carry.pending.take().expect("polled above");
        self.rec.retries += inner.retries;
        let (first, rest, keep) = match out {
            Ok(Answer::Stream { first, rest, keep }) => (first, rest, keep),
            Ok(Answer::Full { status, .. }) => {
                let why = format!("the continuation was answered whole ({status}), not streamed");
                carry.proxy.recorder.migration_refused("failed");
                let err = migration::not_continued(pending.broke, why);
                return Poll::Ready(Some(self.fail_with(err)));
            }
            Err(e) => {
                carry.proxy.recorder.migration_refused("failed");
                let err = migration::not_continued(
                    pending.broke,
                    format!("the continuation failed: {e}"),
                );
                return Poll::Ready(Some(self.fail_with(err)));
            }
        };
        let new = keep.decode.instance().url.clone();
        tracing::info!(
            request_id = %self.rec.id,
            "stream continued: decode {} -> decode {new}, {} tokens carried as {} (continuation {})",
            carry.decode,
            pending.carried,
            if pending.exact { "token ids" } else { "text" },
            carry.tracker.hops,
        );
        carry.decode = new.clone();
        let grace = carry.proxy.settings().drain_grace;
        carry.drained = Box::pin(keep.decode.instance().drained.past(grace));
        carry.tracker.form = pending.form;
        self.rec.decode = Some(new);
        self.rec.migrations += 1;
        self.rest = rest;
        self.keep = keep;
        self.first = Some(first);
        Poll::Ready(None)
    }

    /// A decode that broke off after the answer's last token (only `[DONE]` was missing):
    /// the proxy ends the stream itself.
    fn finish_locally(&mut self) -> Item {
        tracing::info!(
            request_id = %self.rec.id,
            "decode broke off after the answer's last token; the proxy ends the stream"
        );
        let mut out = Vec::new();
        sse_event(&mut out, crate::sse::DONE);
        match self.pass(Bytes::from(out)) {
            Some(b) => {
                self.finished = self.end.is_done();
                Poll::Ready(Some(Ok(b)))
            }
            None => Poll::Ready(None),
        }
    }

    /// Ends the stream with `err` (an error event, then `[DONE]`).
    fn fail_with(&mut self, err: ProxyError) -> Item {
        let event = self.last_event(err);
        Poll::Ready(Some(Ok(with_done(&event))))
    }

    /// A leg that broke off in a stream that is not continued: the error says why not
    /// when the request itself is the reason (n > 1, guided decoding...).
    fn fail_after(&mut self, err: ProxyError) -> Item {
        if let Some((why, recorder)) = &self.refused {
            recorder.migration_refused("not_migratable");
            let why = why.to_string();
            return self.fail_with(migration::not_continued(err, why));
        }
        self.fail(err)
    }

    /// Ends the stream early when its deadline passed, its decode was found unreachable,
    /// or a shutdown's grace ran out; `None` while none of them happened.
    fn interrupted(&mut self, cx: &mut Context<'_>) -> Option<Item> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            let limit = self.total_limit;
            return Some(self.fail(ProxyError::TotalTimeout(limit)));
        }
        if self.ties.cut.as_mut().poll(cx).is_ready() {
            // Like vLLM's own error ends: the error event, then [DONE], so a client reading
            // to [DONE] stops there and knows why the answer is short.
            let event = self.last_event(ProxyError::CutByShutdown);
            return Some(Poll::Ready(Some(Ok(with_done(&event)))));
        }
        let continuing = self.carry.as_ref().is_some_and(|c| c.pending.is_some());
        if !continuing
            && let Some(carry) = self.carry.as_mut()
            && carry.drained.as_mut().poll(cx).is_ready()
        {
            let grace = carry.proxy.settings().drain_grace;
            let f = LegFailure::Body(format!(
                "its instance was drained and the stream still ran after {grace:?} (--drain-grace-s)"
            ));
            return self.broke(f, migration::BROKE_DRAINED);
        }
        if !continuing && let Poll::Ready(why) = self.keep.unreachable.as_mut().poll(cx) {
            if self.carry.is_some() {
                return self.broke(LegFailure::Unreachable(why), migration::BROKE_UNREACHABLE);
            }
            return Some(self.cut_off(why));
        }
        None
    }

    /// Decode closed its stream: what the strip still holds goes out first, then the
    /// stream ends, complete if it ended with `[DONE]`; a stream cut short before it is
    /// continued where it may be.
    fn ended(&mut self) -> Option<Item> {
        let held = self.strip.as_mut().map(UsageStrip::finish);
        if let Some(tail) = held.filter(|t| !t.is_empty()) {
            self.push(&tail);
            return Some(Poll::Ready(Some(Ok(tail))));
        }
        if !self.end.is_done() {
            let f =
                LegFailure::Body("it closed the stream without the final `data: [DONE]`".into());
            return self.broke(f, migration::BROKE_ENDED_EARLY);
        }
        self.finished = true;
        self.rec.outcome = Outcome::Complete;
        Some(Poll::Ready(None))
    }
}

/// One SSE event with `data` as its data.
fn sse_event(out: &mut Vec<u8>, data: &str) {
    for line in data.split('\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
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
