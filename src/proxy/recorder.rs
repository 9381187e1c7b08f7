//! What the lower layers of the proxy tell the figures, and nothing of how they are kept.
//!
//! The request path, the limits and the routing policies count what happens to a request
//! (a retry, a 429, a KV handoff missed, how long a leg took) through a [`Recorder`]; the
//! figures (`metrics.rs`) implement it and write the counters `/metrics` shows. So a reader
//! follows a request from `server.rs` to the engines without opening the metrics code, and
//! the figures read from below instead of being reached into from below.

use super::leg::Leg;
use std::fmt::Debug;
use std::time::Duration;

/// Why the proxy refused a request with 429.
#[derive(Debug, Clone, Copy)]
pub enum LimitReason {
    /// The token bucket (--rate-limit) was empty.
    Rate,
    /// Every slot (--max-concurrent) was taken and the wait queue (--queue-size) full.
    Concurrency,
}

/// The events the proxy counts, as the code that sees them names them. One recorder is
/// shared by every request (`Proxy::recorder`); its methods only add to counters, so they
/// are cheap and never fail.
pub trait Recorder: Debug + Send + Sync {
    /// Adds `delta` to the client requests in flight.
    fn add_in_flight(&self, delta: i64);
    /// A client request ended with `status` on `route`.
    fn request_done(&self, route: &'static str, status: u16);
    /// A client went away before its answer was complete.
    fn client_disconnect(&self);
    /// The first byte of a client's answer went out `ttft` after the request came in.
    fn first_byte(&self, ttft: Duration);
    /// A prefill leg's answer was complete `took` after it was sent.
    fn prefill_done(&self, took: Duration);
    /// A decode leg's first byte came `took` after it was sent.
    fn decode_first_byte(&self, took: Duration);
    /// A KV handoff did not happen: decode recomputes the prompt, for `reason`.
    fn handoff_miss(&self, reason: &'static str);
    /// Decode's answer showed it computed `tokens` prompt tokens itself in a missed handoff.
    fn recomputed_tokens(&self, tokens: u64);
    /// Decode failed a request because its KV load failed (`kv_load_failure_policy = "fail"`).
    fn kv_load_failed(&self);
    /// A leg was retried on another instance.
    fn retry(&self, leg: Leg);
    /// A whole request was redone once (both legs) after it failed before any byte
    /// reached its client, for `reason` (see [`super::errors::LegFailure::redo_reason`]).
    fn redone(&self, reason: &'static str);
    /// A stream whose decode broke off for `reason` was continued on another decode.
    fn migrated(&self, reason: &'static str);
    /// A stream whose decode broke off could not be continued, for `reason`.
    fn migration_refused(&self, reason: &'static str);
    /// A request waited for an instance of `leg` the supervisor is bringing back.
    fn restart_wait(&self, leg: Leg);
    /// A request was refused with 429.
    fn rate_limited(&self, reason: LimitReason);
    /// A request had to wait for a concurrency slot.
    fn queued(&self);
    /// Moves the number of requests waiting for a slot.
    fn queue_depth(&self, delta: i64);
    /// One prefix-aware routing decision (`matched`, `cold` or `rebalanced`).
    fn prefix_routing(&self, leg: Leg, outcome: &'static str);
    /// The supervisor's revision of this proxy's spec whose settings are now in effect.
    fn settings_applied(&self, revision: u64);
    /// The head's rebalancer as the supervisor's last report showed it (None: it has none).
    fn rebalance_seen(&self, report: Option<&crate::vocab::RebalanceReport>);
}

/// A recorder that counts nothing: for legs that are no client traffic (warm-ups) and
/// for the inner account of a stream continued on another decode (the client's request
/// is counted once, by the relay's own record).
#[derive(Debug)]
pub struct Silent;

impl Recorder for Silent {
    fn add_in_flight(&self, _: i64) {}
    fn request_done(&self, _: &'static str, _: u16) {}
    fn client_disconnect(&self) {}
    fn first_byte(&self, _: Duration) {}
    fn prefill_done(&self, _: Duration) {}
    fn decode_first_byte(&self, _: Duration) {}
    fn handoff_miss(&self, _: &'static str) {}
    fn recomputed_tokens(&self, _: u64) {}
    fn kv_load_failed(&self) {}
    fn retry(&self, _: Leg) {}
    fn redone(&self, _: &'static str) {}
    fn migrated(&self, _: &'static str) {}
    fn migration_refused(&self, _: &'static str) {}
    fn restart_wait(&self, _: Leg) {}
    fn rate_limited(&self, _: LimitReason) {}
    fn queued(&self) {}
    fn queue_depth(&self, _: i64) {}
    fn prefix_routing(&self, _: Leg, _: &'static str) {}
    fn settings_applied(&self, _: u64) {}
    fn rebalance_seen(&self, _: Option<&crate::vocab::RebalanceReport>) {}
}
