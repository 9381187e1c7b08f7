//! A client request once parsed and checked: what the pipeline routes and the legs send.
//! It sits below both, which both read it.

use super::designate::Designation;
use super::policy::RouteFacts;
use super::protocol::Body;
use bytes::Bytes;
use tokio::time::Instant;

/// A client request, parsed and checked.
#[derive(Debug, Clone)]
pub struct ClientRequest {
    /// Upstream path, the same as the client's (`/v1/completions`, `/v1/chat/completions`).
    pub path: &'static str,
    pub body: Body,
    /// The body exactly as the client sent it (forwarded as is when a leg needs no change).
    pub raw: Bytes,
    pub stream: bool,
    pub id: String,
    pub designation: Designation,
    pub facts: RouteFacts,
    /// When the whole request must be over (--total-timeout-s).
    pub deadline: Instant,
    /// Instances (URLs) routing picks only when no other is usable: those of a failed
    /// first attempt, when the request is redone once ([`super::pipeline::run`]).
    pub avoid: Vec<String>,
    /// Whether its answer may be continued on another decode if its decode breaks off
    /// mid-stream ([`super::migration`]), decided once when it comes in.
    pub migration: Migration,
}

/// Whether a request's stream may be continued on another decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migration {
    /// `--migration-limit 0`: nothing to say if its decode breaks off.
    Off,
    /// It may: its decode legs ask for token ids.
    On,
    /// The request itself cannot be carried (n > 1, guided decoding...): why, for the
    /// error its stream ends with if its decode breaks off.
    Refused(&'static str),
}

impl ClientRequest {
    /// Whether its answer may be continued elsewhere (its decode legs then ask for ids,
    /// and are streamed even when the client asked for one body: [`super::whole`]).
    pub fn migrates(&self) -> bool {
        self.migration == Migration::On
    }

    /// Whether its decode legs are streamed: the client asked for a stream, or its whole
    /// answer may have to be continued (the proxy then reads the stream itself).
    pub fn decode_streams(&self) -> bool {
        self.stream || self.migrates()
    }
}
