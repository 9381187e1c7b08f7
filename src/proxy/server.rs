//! The client-facing HTTP routes, and the client port they are served on. Everything a
//! client can send is answered: bad input with a 4xx JSON error saying what to fix,
//! unknown routes with a 404 JSON, and the proxy stays up whatever arrives.
//!
//! What a client that cannot authenticate may hold is bounded ([`serve`]): a request's
//! headers must arrive within `--header-read-timeout-s` (also how long a kept-alive
//! connection may sit idle), at most `--max-client-connections` are open at once (one
//! more is answered 503 and closed), and the API key is checked on the headers, before
//! any body is read.

use super::Proxy;
use super::designate;
use super::errors::ProxyError;
use super::legs::Answer;
use super::models;
use super::pipeline::{self, ClientRequest};
use super::policy::{RouteFacts, prefix_hash};
use super::record::{Outcome, RequestRecord};
use super::relay;
use super::request::Migration;
use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What bounds the client port's connections (`[proxy]` `header_read_timeout_s`,
/// `max_client_connections`; docs/security.md says why each default).
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    /// How long a connection may take to send a request's headers, counted from when it
    /// opened or its last answer ended: the slow half-request and the idle keep-alive
    /// are both closed after it.
    pub header_read_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `stop` resolves, then lets the open connections end
/// their requests (each closes after its answer) and returns once all are closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ClientLimits,
    stop: impl std::future::Future<Output = ()>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let (closing, closed) = tokio::sync::watch::channel(false);
    let refusals = RefusalLog::default();
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, most likely: wait rather than spin.
                refusals.note(&format!("cannot accept a client connection: {e}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refuse(&stream, limits.max_connections);
            refusals.note(&format!(
                "refused a client connection: {} are open, the cap (max_client_connections)",
                limits.max_connections
            ));
            continue;
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle holds chunks back.
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(
            stream,
            app.clone(),
            limits,
            slot,
            closed.clone(),
        ));
    }
    let _ = closing.send(true);
    let every = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(every).await;
}

/// One client connection, HTTP/1.1, holding its `slot` until it closes.
async fn connection(
    stream: tokio::net::TcpStream,
    app: Router,
    limits: ClientLimits,
    _slot: tokio::sync::OwnedSemaphorePermit,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let service = hyper_util::service::TowerToHyperService::new(app);
    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = closing.wait_for(|c| *c) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Answers a connection past the cap with a 503 saying why (written only if the socket
/// takes it at once: a refused client is never waited for), then closes it.
fn refuse(stream: &tokio::net::TcpStream, cap: usize) {
    let body = json!({"error": {
        "message": format!("the proxy holds {cap} client connections, its cap ([proxy] max_client_connections, --max-client-connections): try again shortly, reuse a connection, or raise the cap"),
        "type": "service_unavailable", "param": null, "code": 503,
    }})
    .to_string();
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

/// Logs a refusal of the client port at most once per 10 s, with how many were not.
#[derive(Default)]
struct RefusalLog {
    state: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl RefusalLog {
    fn note(&self, what: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.0.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
            s.1 += 1;
            return;
        }
        let more = std::mem::take(&mut s.1);
        s.0 = Some(Instant::now());
        tracing::warn!("{what} (and {more} more since the last line)");
    }
}

/// The proxy's routes.
pub fn router(proxy: Arc<Proxy>) -> Router {
    // The client API key guards the OpenAI routes; health and metrics stay open for
    // probes and scrapers.
    let openai = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models::list))
        .route_layer(axum::middleware::from_fn_with_state(
            proxy.clone(),
            require_key,
        ));
    Router::new()
        .merge(openai)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(DefaultBodyLimit::disable())
        .with_state(proxy)
}

async fn not_found(method: Method, uri: Uri) -> Response {
    ProxyError::NotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_response()
}

/// The client API key check, once for every OpenAI route. A refused generation request is
/// recorded like any other failed one (metrics, access log, `x-request-id`).
async fn require_key(
    State(p): State<Arc<Proxy>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    if authorized(&p, request.headers()) {
        return next.run(request).await;
    }
    let route = match request.uri().path() {
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        _ => return ProxyError::Unauthorized.into_response(),
    };
    let mut rec = RequestRecord::new(route, new_request_id(), p.recorder.clone());
    error_response(ProxyError::Unauthorized, &mut rec)
}

// The handlers take the whole request: extracting `HeaderMap` would clone the headers.
async fn completions(State(p): State<Arc<Proxy>>, request: Request) -> Response {
    generate(p, "/v1/completions", request.into_body()).await
}

async fn chat_completions(State(p): State<Arc<Proxy>>, request: Request) -> Response {
    generate(p, "/v1/chat/completions", request.into_body()).await
}

/// A fresh request id in UUID v4 form (shared by both legs as X-Request-Id), from the
/// thread's own random generator: `Uuid::new_v4` asks the kernel (a `getrandom` call per
/// request).
fn new_request_id() -> String {
    uuid::Builder::from_random_bytes(rand::random())
        .into_uuid()
        .to_string()
}

/// Whether the client sent the proxy's API key (always true when none is configured).
fn authorized(p: &Proxy, headers: &HeaderMap) -> bool {
    let settings = p.settings();
    let Some(key) = &settings.api_key else {
        return true;
    };
    let sent = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    crate::constant_time::equal(sent.as_bytes(), key.as_bytes())
}

async fn generate(p: Arc<Proxy>, route: &'static str, body: Body) -> Response {
    let mut rec = RequestRecord::new(route, new_request_id(), p.recorder.clone());
    if p.drain.is_draining() {
        return error_response(ProxyError::ShuttingDown, &mut rec);
    }
    let in_flight = p.drain.enter();
    let mut cut = p.drain.cut_signal();
    let prepared = prepare(&p, route, body, &mut rec).await;
    let (req, admission) = match prepared {
        Ok(x) => x,
        Err(e) => return error_response(e, &mut rec),
    };
    let outcome = tokio::select! {
        o = tokio::time::timeout_at(req.deadline, pipeline::run(&p, &req, &mut rec)) => o,
        () = &mut cut => Ok(Err(ProxyError::ShuttingDown)),
    };
    let answer = match outcome {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => return error_response(e, &mut rec),
        Err(_) => {
            return error_response(
                ProxyError::TotalTimeout(p.settings().total_timeout),
                &mut rec,
            );
        }
    };
    match answer {
        Answer::Full {
            status,
            content_type,
            body,
            ..
        } => {
            rec.status = status;
            rec.outcome = Outcome::Complete;
            rec.first_byte_sent();
            let mut r = Response::new(Body::from(body));
            *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            let ct = content_type.unwrap_or(HeaderValue::from_static("application/json"));
            r.headers_mut().insert(header::CONTENT_TYPE, ct);
            with_request_id(r, &rec.id)
        }
        Answer::Stream { first, rest, keep } => {
            let ties = relay::Ties {
                admission,
                in_flight,
                cut,
            };
            let parts = (first, rest, keep);
            if req.stream {
                relay::stream_response(parts, rec, (&p, &req), ties)
            } else {
                relay::whole_response(parts, rec, (&p, &req), ties).await
            }
        }
    }
}

/// Body, JSON, admission, designation: everything before any leg is sent (the key was
/// checked by [`require_key`]).
async fn prepare(
    p: &Arc<Proxy>,
    route: &'static str,
    body: Body,
    rec: &mut RequestRecord,
) -> Result<(ClientRequest, super::limits::Admission), ProxyError> {
    let limit = p.settings().max_body_bytes;
    let bytes = match Limited::new(body, limit).collect().await {
        // A copy: the body as read is a slice of the connection's 8 KiB read buffer. Held
        // while the legs run, it made hyper's next read of the connection take a second
        // buffer, kept as long as the connection; copied, the first one is reused (8 KiB
        // less per client connection, docs/proxy.md, "Memory").
        Ok(c) => Bytes::copy_from_slice(&c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Err(ProxyError::PayloadTooLarge { limit });
        }
        Err(e) => {
            return Err(bad(format!("could not read the request body: {e}"), None));
        }
    };
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        bad(
            format!("the request body is not valid JSON ({e}); send an OpenAI {route} request"),
            None,
        )
    })?;
    let Value::Object(body) = value else {
        return Err(bad(
            format!("the request body must be a JSON object (an OpenAI {route} request)"),
            None,
        ));
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`stream` must be true or false".into(), Some("stream"))),
    };
    rec.stream = stream;
    let user = match body.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(bad("`user` must be a string".into(), Some("user"))),
    };
    let designation = designate::parse(user, &p.pools.snapshot())?;
    let admission = p.limits.admit().await?;
    let needs_prefix =
        p.policy(super::Leg::Prefill).needs_prefix() || p.policy(super::Leg::Decode).needs_prefix();
    let facts = RouteFacts {
        prefix_hashes: if needs_prefix {
            prefix_hash::chunk_hashes(&prefix_hash::prompt_bytes(&body))
        } else {
            Vec::new()
        },
    };
    let migration = if p.settings().migration_limit == 0 {
        Migration::Off
    } else {
        super::migration::refusal(&body).map_or(Migration::On, Migration::Refused)
    };
    let req = ClientRequest {
        migration,
        path: route,
        body,
        raw: bytes,
        stream,
        id: rec.id.clone(),
        designation,
        facts,
        deadline: Instant::now() + p.settings().total_timeout,
        avoid: Vec::new(),
    };
    Ok((req, admission))
}

fn bad(message: String, param: Option<&'static str>) -> ProxyError {
    ProxyError::BadRequest { message, param }
}

fn error_response(e: ProxyError, rec: &mut RequestRecord) -> Response {
    rec.fail(e.status().as_u16(), e.to_string());
    with_request_id(e.into_response(), &rec.id)
}

fn with_request_id(mut r: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

/// `/health`: the proxy's own liveness; `/health?warmed`: the same once the pairs usable
/// at start have had their first KV path warm-up (what the supervisor waits for, so `up`
/// shows the step); `/health?ready`: 200 only when at least one prefill and one decode
/// instance are usable (and, where pairs are warmed, one pair is), else 503 naming what
/// is missing; both list the pairs' warm-up states.
async fn health(State(p): State<Arc<Proxy>>, uri: Uri) -> Response {
    let asked = |name: &str| {
        uri.query()
            .is_some_and(|q| q.split('&').any(|kv| kv.split('=').next() == Some(name)))
    };
    let ready = asked("ready");
    if p.drain.is_draining() {
        return ProxyError::ShuttingDown.into_response();
    }
    if asked("warmed") && !p.warmup.settled() {
        let body = json!({
            "status": "warming-up",
            "pairs": p.warmup.views(),
            "error": {"message": "warming up the KV path of each prefill/decode pair", "type": "service_unavailable", "param": null, "code": 503},
        });
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    if !ready {
        return axum::Json(json!({"status": "ok"})).into_response();
    }
    let pools = p.pools.snapshot();
    let usable = |leg| pools.of(leg).iter().filter(|i| i.is_usable()).count();
    let (prefill, decode) = (usable(super::Leg::Prefill), usable(super::Leg::Decode));
    let mut missing = Vec::new();
    if prefill == 0 {
        missing.push("prefill");
    }
    if decode == 0 {
        missing.push("decode");
    }
    let pairs = p.warmup.views();
    if missing.is_empty() && p.warmup.needed() && !pairs.iter().any(|v| v.state == "ready") {
        missing.push("warmed prefill/decode pair");
    }
    let instances: Vec<Value> = pools
        .all()
        .map(|i| json!({"leg": i.leg.as_str(), "url": i.url, "usable": i.is_usable()}))
        .collect();
    if missing.is_empty() {
        return axum::Json(json!({"status": "ready", "usable_prefill": prefill, "usable_decode": decode, "instances": instances, "pairs": pairs})).into_response();
    }
    let msg = format!(
        "not ready: no usable {} instance",
        missing.join(" and no usable ")
    );
    let body = json!({
        "status": "not-ready",
        "missing": missing,
        "instances": instances,
        "pairs": pairs,
        "error": {"message": msg, "type": "service_unavailable", "param": null, "code": 503},
    });
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let text = p.metrics_page();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_look_like_uuid_v4_and_differ() {
        let a = new_request_id();
        let b = new_request_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'), "{a}");
        assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"), "{a}");
        assert!(
            a.chars()
                .all(|c| c == '-' || matches!(c, '0'..='9' | 'a'..='f')),
            "{a}"
        );
    }
}
