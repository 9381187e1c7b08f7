//! The HTTP routes of a sim instance: vLLM's OpenAI-compatible surface plus `/sim/*`
//! routes for fault injection and KV pulls. Unknown routes and methods get JSON errors.

use super::completion;
use super::engine::Sim;
use super::faults::FaultRequest;
use super::handoff::held_response;
use super::job::exit_soon;
use super::openai::{ApiError, Endpoint};
use crate::spelling::value_name;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use std::sync::Arc;

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// All routes of the main port.
pub fn router(sim: Arc<Sim>) -> Router {
    // Like vLLM's --api-key (vllm/entrypoints/openai/server_utils.py): every route needs
    // the key but the ones vLLM leaves public for probes and scrapes (/health, /version,
    // /metrics of those the simulator has). Older vLLM guarded only /v1; the newer rule
    // is the stricter, and what a cluster of real engines gets from a current vLLM.
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/sim/fault", post(fault).get(fault_status))
        .route("/sim/kv/{request_id}", get(kv_pull))
        .route_layer(axum::middleware::from_fn_with_state(
            sim.clone(),
            require_key,
        ));
    Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::status(StatusCode::NOT_FOUND, "no such route (the simulator serves /v1/completions, /v1/chat/completions, /v1/models, /health, /version, /metrics, /sim/fault, /sim/kv/REQUEST_ID)") })
        .method_not_allowed_fallback(|| async { ApiError::status(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this route") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(sim)
}

/// vLLM's `--api-key` check, once for every guarded route.
async fn require_key(
    State(sim): State<Arc<Sim>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorized(&sim, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// Whether `Authorization: Bearer KEY` is there when a key is set.
fn authorized(sim: &Sim, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = sim.args.api_key.as_deref() else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // As vLLM, in time that says nothing of how much of the key a guess got right.
    if given.is_some_and(|g| crate::constant_time::equal(g.as_bytes(), key.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized: send Authorization: Bearer <the key given to --api-key / VLLM_API_KEY>",
        ))
    }
}

fn body_or_error(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        ApiError::status(
            r.status(),
            format!("cannot read the request body: {}", r.body_text()),
        )
    })
}

async fn completions(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(sim, Endpoint::Completions, headers, body).await
}

async fn chat(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(sim, Endpoint::Chat, headers, body).await
}

/// Both generation routes: the body, then the completion itself (the key was checked by
/// [`require_key`]).
async fn generate(
    sim: Arc<Sim>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body_or_error(body) {
        Ok(b) => completion::handle(sim, endpoint, headers, b).await,
        Err(e) => e.into_response(),
    }
}

async fn models(State(sim): State<Arc<Sim>>) -> Response {
    let m = &sim.args.model;
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": m,
            "object": "model",
            "created": sim.started_unix(),
            "owned_by": "pdctl-sim",
            "root": m,
            "parent": null,
            "max_model_len": sim.args.model_params.max_model_len,
            "permission": [],
        }]
    }))
    .into_response()
}

async fn health(State(sim): State<Arc<Sim>>) -> Response {
    let delay = sim.faults.health_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if !sim.loaded() {
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "loading the (simulated) model",
        )
        .into_response();
    }
    if !sim.faults.healthy(sim.uptime_ms()) {
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy (fault injection: unhealthy_ms)",
        )
        .into_response();
    }
    StatusCode::OK.into_response()
}

async fn version(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "pdctl-sim",
        "simulator": true,
        "role": value_name(sim.args.role),
        "handoff": value_name(sim.args.handoff),
        "engine_id": sim.engine_id,
    }))
    .into_response()
}

async fn metrics(State(sim): State<Arc<Sim>>) -> Response {
    let delay = sim.faults.metrics_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        sim.metrics.render(),
    )
        .into_response()
}

async fn fault(State(sim): State<Arc<Sim>>, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body_or_error(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let req: FaultRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(
                None,
                format!("bad fault request: {e}; fields: crash, exit, engine_dead, fail_next, hang_next, unhealthy_ms, stall_stream_after, fail_handoff_next, slow_metrics_ms, health_delay_ms, clear"),
            )
            .into_response();
        }
    };
    let now = sim.uptime_ms();
    tracing::warn!(
        "fault injection requested: {}",
        serde_json::to_string(&req).unwrap_or_default()
    );
    if let Some(status) = sim.faults.apply(&req, now) {
        if req.exit.is_some() {
            tracing::error!(
                "fault injection: exit requested: RuntimeError: the simulated engine core died; exiting with status {status}"
            );
        } else {
            tracing::error!("fault injection: crash requested, exiting with status {status}");
        }
        exit_soon(status);
    } else if req.engine_dead {
        tracing::error!(
            "fault injection: EngineDeadError: EngineCore encountered an issue; streams in flight end with it, the server exits in 0.5 s"
        );
        tokio::spawn(async {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            std::process::exit(1);
        });
    }
    axum::Json(json!({ "applied": req, "pending": sim.faults.pending(now) })).into_response()
}

async fn fault_status(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(sim.faults.pending(sim.uptime_ms())).into_response()
}

/// `?wait_ms=N` on `/sim/kv/{id}`: how long to wait for KV not held yet (nixl push).
#[derive(serde::Deserialize)]
struct KvWait {
    wait_ms: Option<u64>,
}

async fn kv_pull(
    State(sim): State<Arc<Sim>>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<KvWait>,
) -> Response {
    let held = match q.wait_ms {
        Some(ms) => {
            let wait = std::time::Duration::from_millis(ms.min(600_000));
            sim.held.wait_take(&sim.metrics, &id, wait).await
        }
        None => sim.held.take(&sim.metrics, &id),
    };
    held_response(&sim, &id, held)
}
