//! The Mooncake V1-style handoff: a prefill started with `--bootstrap-port` runs a second
//! HTTP server there with `GET /query` (its engine id) and
//! `GET /sim/transfer/{transfer_id}?wait_ms=N` (long poll for the KV of a transfer).
//! The proxy sends both legs at once; the decode checks the engine id, then waits for
//! the prefill to publish the transfer (bounded by `handoff_wait_ms`).

use super::{HandoffError, check_blocks, fetch, held_response, required};
use crate::error_text::chain;
use crate::sim::engine::Sim;
use crate::sim::openai::{ApiError, KvTransferParams};
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The bootstrap server's routes.
pub fn bootstrap_router(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/query", get(query))
        .route("/sim/transfer/{transfer_id}", get(transfer))
        .fallback(|| async {
            ApiError::status(
                StatusCode::NOT_FOUND,
                "no such route on the bootstrap server (it serves /query and /sim/transfer/{id})",
            )
        })
        .with_state(sim)
}

async fn query(State(sim): State<Arc<Sim>>) -> Response {
    if !sim.loaded() {
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is still loading",
        )
        .into_response();
    }
    axum::Json(json!({
        "0": {
            "engine_id": sim.engine_id,
            "host": sim.kv_host,
            "port": sim.args.port,
            "simulator": true,
        }
    }))
    .into_response()
}

#[derive(Deserialize)]
struct WaitQuery {
    wait_ms: Option<u64>,
}

async fn transfer(
    State(sim): State<Arc<Sim>>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Response {
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0).min(600_000));
    let held = sim.held.wait_take(&sim.metrics, &id, wait).await;
    held_response(&sim, &id, held)
}

/// The decode side: checks the prefill's engine id, then waits for the transfer.
pub async fn pull(
    sim: &Sim,
    kv: &KvTransferParams,
    hashes: &[u64],
) -> Result<String, HandoffError> {
    let given = required(kv.remote_bootstrap_addr.as_deref(), "remote_bootstrap_addr")?
        .trim_end_matches('/');
    // "host:port" is accepted as well as "http://host:port".
    let addr = if given.contains("://") {
        given.to_string()
    } else {
        format!("http://{given}")
    };
    let tid = required(kv.transfer_id.as_deref(), "transfer_id")?;
    let query_url = format!("{addr}/query");
    let q: serde_json::Value = sim
        .http
        .get(&query_url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| HandoffError::Query {
            url: query_url.clone(),
            cause: chain(&e),
        })?
        .json()
        .await
        .map_err(|e| HandoffError::Unreadable {
            url: query_url.clone(),
            cause: e.to_string(),
        })?;
    let engine = q["0"]["engine_id"].as_str().unwrap_or_default();
    if let Some(expected) = kv.remote_engine_id.as_deref() {
        if expected != engine {
            return Err(HandoffError::EngineMismatch {
                expected: expected.to_string(),
                found: format!("{query_url} says {engine} (was the prefill restarted?)"),
            });
        }
    }
    let wait = sim.args.model_params.handoff_wait_ms;
    let url = format!("{addr}/sim/transfer/{tid}?wait_ms={wait}");
    let blocks = fetch(sim, &url, Duration::from_millis(wait + 5_000)).await?;
    check_blocks(&blocks, Some(engine), hashes)?;
    Ok(format!("{engine} via {addr} (transfer {tid})"))
}
