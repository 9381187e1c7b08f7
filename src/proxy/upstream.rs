//! The HTTP clients the proxy talks to engines with, both sending the engines' API key on
//! every call and classifying failures into [`LegFailure`]s so the caller can tell connect
//! errors, timeouts and statuses apart: the legs of client requests go through the
//! proxy's own HTTP/1.1 client ([`Upstream::legs`], h1.rs), which relays a streamed body
//! without hyper's per-chunk hand-over; the proxy's own calls (health probes, /v1/models,
//! /metrics, mooncake's /query) through the pooled client below ([`Upstream::get`]).
//!
//! The pooled client is hyper's used directly rather than through reqwest: per request
//! reqwest parses the URL twice (once more for its redirect policy) and wraps request and
//! body in several layers, about a sixth of the proxy's own instructions per request
//! (callgrind, docs/proxy.md "Overhead"); the proxy needs none of what those layers add.

use super::errors::LegFailure;
use crate::vocab::TcpLiveness;
use axum::http::{HeaderValue, Request, Uri, header};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;

/// Largest engine answer body the proxy reads into memory (non-streamed answers, error
/// bodies, prefill answers). Streams are relayed without this limit.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// How long an unused pooled connection to an engine is kept open: under vLLM's
/// VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), after which its server closes an idle connection. A
/// connection kept longer may be taken for a request just as the server closes it, and that
/// request fails for nothing.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Idle connections kept per engine: enough for every stream of a busy proxy to find one.
const POOL_MAX_IDLE_PER_ENGINE: usize = 1024;

/// An engine's answer: status and headers have arrived, the body is still to be read.
pub type EngineResponse = axum::http::Response<Incoming>;

/// A pooled HTTP client for the engines.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    engine_key: Option<HeaderValue>,
    /// The client of the prefill and decode legs (h1.rs), same timeout, keepalive and key.
    legs: super::h1::Client,
}

impl Upstream {
    /// A client with the given connect timeout that sends `engine_key` as a bearer token.
    /// `tcp` (keepalive and user timeout) makes a connection to an engine host that went
    /// silent, without closing its sockets, fail within seconds (about 10 by default).
    pub fn new(
        connect_timeout: Duration,
        tcp: TcpLiveness,
        engine_key: Option<&str>,
    ) -> Result<Self, super::config::ConfigError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(tcp.keepalive_idle()));
        connector.set_keepalive_interval(Some(tcp.keepalive_interval()));
        connector.set_keepalive_retries(Some(tcp.tcp_keepalive_count));
        connector.set_tcp_user_timeout(Some(tcp.user_timeout()));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_ENGINE)
            .pool_timer(TokioTimer::new())
            .build(connector);
        let engine_key = engine_key
            .map(|k| HeaderValue::from_str(&format!("Bearer {k}")))
            .transpose()
            .map_err(|_| super::config::ConfigError::EngineKey)?;
        let legs = super::h1::Client::new(connect_timeout, tcp, engine_key.as_ref());
        Ok(Upstream {
            client,
            engine_key,
            legs,
        })
    }

    /// The client the legs of client requests are sent with.
    pub fn legs(&self) -> &super::h1::Client {
        &self.legs
    }

    /// Sends a request with the engine key; returns the response once its headers are in.
    async fn send(&self, mut req: Request<Full<Bytes>>) -> Result<EngineResponse, LegFailure> {
        if let Some(k) = &self.engine_key {
            req.headers_mut().insert(header::AUTHORIZATION, k.clone());
        }
        self.client.request(req).await.map_err(|e| classify(&e))
    }

    /// GETs `url` (health probes, /v1/models, /metrics, mooncake /query) within `timeout`
    /// and returns status and body.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<(u16, Bytes), LegFailure> {
        let mut req = Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = parse_uri(url)?;
        let work = async {
            let resp = self.send(req).await?;
            let status = resp.status().as_u16();
            let body = read_body(resp, MAX_ANSWER_BYTES).await?;
            Ok((status, body))
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(LegFailure::Timeout {
                limit: timeout,
                raise: "",
            }),
        }
    }
}

/// An engine URL as a request target (they are checked at startup, so this fails only on
/// a bug).
fn parse_uri(url: &str) -> Result<Uri, LegFailure> {
    url.parse()
        .map_err(|e| LegFailure::BadAnswer(format!("cannot request {url}: {e}")))
}

/// Maps a client error to what the proxy reports and counts.
pub fn classify(e: &hyper_util::client::legacy::Error) -> LegFailure {
    if e.is_connect() {
        // The innermost cause says "Connection refused" etc.; the outer ones only "client
        // error (Connect)". The connector's own timeout is an io::Error of kind TimedOut.
        let mut cause: &(dyn std::error::Error + 'static) = e;
        while let Some(next) = cause.source() {
            if let Some(io) = next.downcast_ref::<std::io::Error>() {
                return LegFailure::of_connect(io);
            }
            cause = next;
        }
        LegFailure::Connect(innermost_cause(e))
    } else {
        LegFailure::Body(format!("{e}: {}", innermost_cause(e)))
    }
}

/// The message of the deepest error in `e`'s chain of sources (the one that says what
/// really happened, e.g. "Connection reset by peer").
pub fn innermost_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// Reads a whole body, refusing more than `limit` bytes.
pub async fn read_body(resp: EngineResponse, limit: usize) -> Result<Bytes, LegFailure> {
    let mut body = resp.into_body();
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| LegFailure::Body(innermost_cause(&e)))?;
        let Ok(chunk) = frame.into_data() else {
            continue; // trailers
        };
        if buf.len() + chunk.len() > limit {
            return Err(LegFailure::BadAnswer(format!(
                "an answer larger than {limit} bytes"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}
