//! One request's account: where it went, how long each stage took, how it ended. It lives
//! as long as the request (into the response stream), so when it is dropped it knows the
//! real outcome, including a client that went away, and writes the one log line and the
//! request counters then.

use super::leg::Leg;
use super::recorder::Recorder;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Status logged and counted for a client that disconnected before its answer was complete
/// (nginx's convention).
pub const CLIENT_CLOSED: u16 = 499;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Still being served (if dropped like this, the client went away).
    Pending,
    /// The full answer was sent.
    Complete,
    /// An error answer (or an error event in a stream) was sent.
    Failed(String),
}

/// The account of one client request.
#[derive(Debug)]
pub struct RequestRecord {
    pub id: String,
    pub route: &'static str,
    pub stream: bool,
    pub received: Instant,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    /// HTTP status sent to the client (0 until decided).
    pub status: u16,
    pub prefill_time: Option<Duration>,
    pub decode_first_byte: Option<Duration>,
    pub ttft: Option<Duration>,
    pub retries: u32,
    /// Continuations of its stream on another decode ([`super::migration`]).
    pub migrations: u32,
    /// The inner account of a continuation: counted and logged by the client's record,
    /// not by itself.
    quiet: bool,
    /// Why decode had to recompute, if it did: known when the leg was sent, or seen in
    /// decode's usage (`cached_tokens`) when its answer came (recompute.rs).
    pub handoff_miss: Option<&'static str>,
    pub outcome: Outcome,
    recorder: Arc<dyn Recorder>,
}

impl RequestRecord {
    /// Starts the account of a request just received (counted in flight from now).
    pub fn new(route: &'static str, id: String, recorder: Arc<dyn Recorder>) -> Self {
        recorder.add_in_flight(1);
        RequestRecord {
            id,
            route,
            stream: false,
            received: Instant::now(),
            prefill: None,
            decode: None,
            status: 0,
            prefill_time: None,
            decode_first_byte: None,
            ttft: None,
            retries: 0,
            migrations: 0,
            quiet: false,
            handoff_miss: None,
            outcome: Outcome::Pending,
            recorder,
        }
    }

    /// The account of a continuation's own request ([`super::migration`]): its retries
    /// and instances go to the client's record; nothing is counted or logged for it.
    pub fn inner(route: &'static str, id: String) -> Self {
        let mut rec = RequestRecord::new(route, id, Arc::new(super::recorder::Silent));
        rec.quiet = true;
        rec
    }

    /// Notes the instance a leg is being sent to (the last one tried is what gets logged).
    pub fn set_instance(&mut self, leg: Leg, url: &str) {
        let slot = match leg {
            Leg::Prefill => &mut self.prefill,
            Leg::Decode => &mut self.decode,
        };
        *slot = Some(url.to_string());
    }

    /// Notes that the first byte of the answer is going out now.
    pub fn first_byte_sent(&mut self) {
        if self.ttft.is_none() {
            let t = self.received.elapsed();
            self.ttft = Some(t);
            self.recorder.first_byte(t);
        }
    }

    /// Ends the request with an error sent to the client.
    pub fn fail(&mut self, status: u16, message: String) {
        self.status = status;
        self.outcome = Outcome::Failed(message);
    }
}

/// A stage's duration in the log line: milliseconds with one decimal, `-` when unknown
/// (written straight into the line, no string of its own).
struct Ms(Option<Duration>);

impl std::fmt::Display for Ms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{:.1}", d.as_secs_f64() * 1e3),
            None => f.write_str("-"),
        }
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.recorder.add_in_flight(-1);
        if self.outcome == Outcome::Pending {
            self.recorder.client_disconnect();
            self.status = CLIENT_CLOSED;
        }
        self.recorder.request_done(self.route, self.status);
        if self.quiet {
            return;
        }
        // "ok" only for a request that went through prefill and completed.
        let handoff_ok = if self.prefill.is_some() && self.outcome == Outcome::Complete {
            "ok"
        } else {
            "-"
        };
        let outcome = match &self.outcome {
            Outcome::Pending => "client disconnected; both legs cancelled",
            Outcome::Complete => "ok",
            Outcome::Failed(m) => m.as_str(),
        };
        tracing::info!(
            request_id = %self.id,
            route = %self.route,
            stream = self.stream,
            prefill = %self.prefill.as_deref().unwrap_or("-"),
            decode = %self.decode.as_deref().unwrap_or("-"),
            status = self.status,
            prefill_ms = %Ms(self.prefill_time),
            decode_first_byte_ms = %Ms(self.decode_first_byte),
            ttft_ms = %Ms(self.ttft),
            total_ms = %Ms(Some(self.received.elapsed())),
            retries = self.retries,
            migrations = self.migrations,
            kv_handoff = %self.handoff_miss.unwrap_or(handoff_ok),
            "request {outcome}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::metrics::Metrics;

    #[test]
    fn a_dropped_pending_request_counts_as_a_client_disconnect() {
        let m = Arc::new(Metrics::default());
        let r = RequestRecord::new("/v1/completions", "id".into(), m.clone());
        drop(r);
        assert_eq!(m.requests("/v1/completions", CLIENT_CLOSED), 1);
        let mut r = RequestRecord::new("/v1/completions", "id".into(), m.clone());
        r.status = 200;
        r.outcome = Outcome::Complete;
        drop(r);
        assert_eq!(m.requests("/v1/completions", 200), 1);
    }
}
