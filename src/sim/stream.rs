//! Streaming answers: `text/event-stream` with one `data: {json}` event per choice and
//! step, the finish_reason on a choice's last chunk, an optional usage chunk
//! (`stream_options.include_usage`, the only difference it makes, as in vLLM), then
//! `data: [DONE]`. Headers go out at once; the
//! prefill runs inside the stream, so a client that leaves early aborts it.

use super::job::Job;
use super::openai::Endpoint;
use super::openai::response::{
    ChatChunkChoice, ChatDelta, CompletionChunkChoice, Envelope, ids_if,
};
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;

enum Phase {
    Prefill,
    Tokens,
    Done,
    End,
}

struct State {
    job: Job,
    phase: Phase,
    /// Fault injection: stop sending after this many steps.
    stall_after: Option<u64>,
    steps: u64,
}

/// The SSE answer for a streaming request.
pub fn response(job: Job) -> Response {
    let stall_after = job.sim.faults.take_stall();
    let st = State {
        job,
        phase: Phase::Prefill,
        stall_after,
        steps: 0,
    };
    let events = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            match st.phase {
                Phase::Prefill => {
                    st.job.prefill().await;
                    if st.job.kv_load_failed {
                        // vLLM's stream: the error as one event, then [DONE].
                        let err = st.job.fail_kv_load().body();
                        let mut out = Vec::with_capacity(160);
                        event(&mut out, &err);
                        out.extend_from_slice(b"data: [DONE]\n\n");
                        st.phase = Phase::End;
                        return Some((Ok(Bytes::from(out)), st));
                    }
                    st.phase = Phase::Tokens;
                }
                Phase::Tokens => {
                    if st.stall_after.is_some_and(|k| st.steps >= k) {
                        st.job.sim.metrics.faults_injected.fetch_add(1, Relaxed);
                        tracing::warn!(
                            "fault injection: stream {} stalls after {} tokens (stall_stream_after)",
                            st.job.id,
                            st.steps
                        );
                        std::future::pending::<()>().await;
                    }
                    if !st.job.step().await {
                        st.phase = Phase::Done;
                        continue;
                    }
                    if st.job.sim.faults.engine_dead() {
                        st.phase = Phase::End;
                        return Some((Ok(engine_dead_event()), st));
                    }
                    let first = st.steps == 0;
                    st.steps += 1;
                    let out = render_step(&mut st.job, first);
                    if !out.is_empty() {
                        return Some((Ok::<Bytes, Infallible>(Bytes::from(out)), st));
                    }
                }
                Phase::Done => {
                    st.job.finish();
                    let mut out = Vec::with_capacity(256);
                    if st.job.req.include_usage {
                        let usage = Some(Some(st.job.usage()));
                        let obj = object(st.job.req.endpoint);
                        let choices: Vec<CompletionChunkChoice> = Vec::new();
                        event(&mut out, &envelope(&st.job, obj, choices, usage));
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    st.phase = Phase::End;
                    return Some((Ok(Bytes::from(out)), st));
                }
                Phase::End => return None,
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response()
}

/// What vLLM's stream sends once its engine core died: `EngineDeadError` as one error
/// event (vLLM's `create_streaming_error_response`: a 500 InternalServerError), then
/// `[DONE]`.
fn engine_dead_event() -> Bytes {
    let err = super::openai::ApiError::status(
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    );
    let mut out = Vec::with_capacity(200);
    event(&mut out, &err.body());
    out.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(out)
}

fn object(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    }
}

fn envelope<'a, C: Serialize>(
    job: &'a Job,
    object: &'static str,
    choices: Vec<C>,
    usage: Option<Option<super::openai::response::Usage>>,
) -> Envelope<'a, C> {
    Envelope {
        id: &job.id,
        object,
        created: job.created,
        model: &job.sim.args.model,
        choices,
        usage,
        prompt_token_ids: None,
        kv_transfer_params: None,
    }
}

fn event(out: &mut Vec<u8>, value: &impl Serialize) {
    out.extend_from_slice(b"data: ");
    // Serialising plain structs into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
    out.extend_from_slice(b"\n\n");
}

/// The events of one step: a chunk per choice that has new text or just finished.
/// A chat stream's opening chunk for choice `index`: the assistant's role, no text (with
/// the prompt's ids when they are asked for).
fn role_chunk(out: &mut Vec<u8>, job: &Job, index: u32, prompt_ids: Option<&[u32]>) {
    let role = ChatChunkChoice {
        index,
        delta: ChatDelta {
            role: Some("assistant"),
            content: Some(""),
        },
        logprobs: None,
        finish_reason: None,
        stop_reason: None,
        token_ids: None,
    };
    let mut env = envelope(job, object(Endpoint::Chat), vec![role], None);
    env.prompt_token_ids = Some(prompt_ids);
    event(out, &env);
}

fn render_step(job: &mut Job, first: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 * job.seqs.len());
    let endpoint = job.req.endpoint;
    // As vLLM (0.32) writes its chunks, with or without include_usage alike: no usage
    // field (unset fields left out). A stream with the usage chunk differs from one
    // without by that chunk only.
    let no_usage = None;
    let hold = job.hold_back;
    let with_ids = job.req.return_token_ids;
    let n = job.req.n.max(1);
    let mut seqs = std::mem::take(&mut job.seqs);
    for s in seqs.iter_mut().filter(|s| !s.reported) {
        let index = s.index;
        let finish_reason = s.finish_reason();
        let prompt_ids = (with_ids && first)
            .then(|| job.req.prompts.get((index / n) as usize).map(Vec::as_slice))
            .flatten();
        if endpoint == Endpoint::Chat && first {
            role_chunk(&mut out, job, index, prompt_ids);
        }
        let range = s.take_delta(hold);
        if range.is_empty() && finish_reason.is_none() {
            continue;
        }
        let id_range = s.take_ids();
        let stop_reason = s.stop_reason.as_deref();
        let delta = &s.text[range];
        let ids = ids_if(with_ids, &s.ids[id_range]);
        match endpoint {
            Endpoint::Completions => {
                let c = CompletionChunkChoice {
                    index,
                    text: delta,
                    logprobs: None,
                    finish_reason,
                    stop_reason,
                    prompt_token_ids: Some(prompt_ids),
                    token_ids: ids,
                };
                event(
                    &mut out,
                    &envelope(job, object(endpoint), vec![c], no_usage),
                );
            }
            Endpoint::Chat => {
                let c = ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role: None,
                        content: Some(delta),
                    },
                    logprobs: None,
                    finish_reason,
                    stop_reason,
                    token_ids: ids,
                };
                event(
                    &mut out,
                    &envelope(job, object(endpoint), vec![c], no_usage),
                );
            }
        }
        if finish_reason.is_some() {
            s.reported = true;
        }
    }
    job.seqs = seqs;
    out
}
