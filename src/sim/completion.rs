//! `POST /v1/completions` and `POST /v1/chat/completions`: checks, faults, then a whole
//! JSON answer or an SSE stream.

use super::engine::Sim;
use super::faults::RequestFault;
use super::job::Job;
use super::openai::response::{ChatChoice, ChatMessage, CompletionChoice, Envelope, ids_if};
use super::openai::{ApiError, Endpoint, Limits, request};
use super::stream;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Answers one generation request.
pub async fn handle(
    sim: Arc<Sim>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match run(sim, endpoint, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    sim: Arc<Sim>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    if !sim.loaded() {
        return Err(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading (simulated start-up, --startup-ms); wait for /health to answer 200",
        ));
    }
    let m = &sim.args.model_params;
    let limits = Limits {
        max_model_len: m.max_model_len,
        max_n: m.max_num_seqs.min(128),
    };
    let req = request::parse(endpoint, body, limits)?;
    if let Some(model) = req.model.as_deref() {
        if model != sim.args.model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "The model `{model}` does not exist: this simulator serves `{}` (see /v1/models)",
                    sim.args.model
                ),
                param: Some("model".into()),
            });
        }
    }
    match sim.faults.take_request_fault() {
        RequestFault::None => {}
        RequestFault::Fail => {
            sim.metrics.faults_injected.fetch_add(1, Relaxed);
            tracing::warn!("fault injection: failing this request with 500 (fail_next)");
            return Err(ApiError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "simulated engine failure (fault injection: fail_next)",
            ));
        }
        RequestFault::Hang => {
            sim.metrics.faults_injected.fetch_add(1, Relaxed);
            tracing::warn!("fault injection: this request will never be answered (hang_next)");
            let _running = sim.admit(1).await;
            std::future::pending::<()>().await;
        }
    }
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let client_id = headers.get("x-request-id").and_then(|v| v.to_str().ok());
    let id = sim.request_id(prefix, client_id);
    let stream = req.stream;
    let job = Job::new(sim, req, id, arrived);
    if stream {
        return Ok(stream::response(job));
    }
    Ok(whole(job).await)
}

/// Runs the job to its end and answers with one JSON body.
async fn whole(mut job: Job) -> Response {
    job.prefill().await;
    if job.kv_load_failed {
        return job.fail_kv_load().into_response();
    }
    while job.step().await {}
    let kv = job.finish();
    let usage = Some(Some(job.usage()));
    let model = job.sim.args.model.as_str();
    let ids = job.req.return_token_ids;
    let n = job.req.n.max(1);
    // Set, null unless asked, as vLLM 0.32 sets them on whole answers.
    let prompt_ids = |index: u32| {
        Some(
            ids.then(|| job.req.prompts.get((index / n) as usize).map(Vec::as_slice))
                .flatten(),
        )
    };
    let body = match job.req.endpoint {
        Endpoint::Completions => serde_json::to_vec(&Envelope {
            id: &job.id,
            object: "text_completion",
            created: job.created,
            model,
            choices: job
                .seqs
                .iter()
                .map(|s| CompletionChoice {
                    index: s.index,
                    text: &s.text,
                    logprobs: None,
                    finish_reason: s.finish_reason(),
                    stop_reason: s.stop_reason.as_deref(),
                    token_ids: ids_if(ids, &s.ids[..]),
                    prompt_logprobs: Some(None),
                    prompt_token_ids: prompt_ids(s.index),
                })
                .collect(),
            usage,
            prompt_token_ids: None,
            kv_transfer_params: kv,
        }),
        Endpoint::Chat => serde_json::to_vec(&Envelope {
            id: &job.id,
            object: "chat.completion",
            created: job.created,
            model,
            choices: job
                .seqs
                .iter()
                .map(|s| ChatChoice {
                    index: s.index,
                    message: ChatMessage {
                        role: "assistant",
                        content: &s.text,
                        reasoning_content: None,
                        tool_calls: [],
                    },
                    logprobs: None,
                    finish_reason: s.finish_reason(),
                    stop_reason: s.stop_reason.as_deref(),
                    token_ids: ids_if(ids, &s.ids[..]),
                })
                .collect(),
            usage,
            prompt_token_ids: prompt_ids(0),
            kv_transfer_params: kv,
        }),
    };
    match body {
        Ok(b) => ([(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => ApiError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot serialise the answer: {e}"),
        )
        .into_response(),
    }
}
