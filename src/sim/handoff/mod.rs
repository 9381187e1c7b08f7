//! KV handoff between a prefill sim and a decode sim, one mechanism per proxy protocol:
//! [`shared_dir`] (two-step), [`nixl`] (decode pulls from the prefill) and [`mooncake`]
//! (decode waits for a transfer id on the prefill's bootstrap server). A decode that
//! expected KV and got none recomputes and counts a miss; both sides log every handoff.
//! What arrived and what was recomputed also lands in the vLLM counters a real decode
//! keeps (`vllm:prompt_tokens_by_source_total`, `vllm:external_prefix_cache_*`, counted
//! by the job), so the proxy can find misses the same way on the sim and on vLLM.

pub mod held;
pub mod mooncake;
pub mod nixl;
pub mod shared_dir;

use super::engine::Sim;
use super::metrics::Finish;
use super::openai::KvTransferParams;
use crate::error_text::chain;
use crate::spelling::value_name;
use crate::vocab::{SimHandoff, SimRole};
use held::{Held, KvBlocks};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// What the decode side got for one prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// No handoff was expected (plain engine, or nothing beyond the local cache to load).
    NotExpected,
    /// These many prompt tokens' KV arrived and need not be computed.
    Received { tokens: u64 },
    /// A handoff was expected and failed: everything not cached is recomputed.
    Missed,
}

/// Where a decode expects its prompt's KV from.
enum How<'a> {
    /// From the prefill named in `kv_transfer_params` (nixl, mooncake).
    Pull(&'a KvTransferParams),
    /// From the shared directory (two-step).
    SharedDir,
}

/// The decode side: fetches the prompt's KV if this request or sim expects a handoff.
/// `hashes` are the blocks it may reuse (those before the prompt's last token);
/// `local_blocks` of them are already in the local prefix cache.
pub async fn receive(
    sim: &Arc<Sim>,
    kv: Option<&KvTransferParams>,
    tokens: &[u32],
    hashes: &[u64],
    local_blocks: usize,
    request_id: &str,
) -> Incoming {
    let bs = sim.args.model_params.block_size as usize;
    let how = match kv {
        Some(kv) if kv.remote_prefill() => How::Pull(kv),
        _ if sim.args.handoff == SimHandoff::SharedDir && sim.args.role == SimRole::Decode => {
            if local_blocks >= hashes.len() {
                return Incoming::NotExpected;
            }
            How::SharedDir
        }
        _ => return Incoming::NotExpected,
    };
    let result: Result<String, HandoffError> = if sim.faults.take_handoff_fault() {
        sim.metrics.faults_injected.fetch_add(1, Relaxed);
        Err(HandoffError::Injected)
    } else {
        match how {
            How::Pull(kv) => match sim.args.handoff {
                SimHandoff::Nixl => nixl::pull(sim, kv, hashes).await,
                SimHandoff::Mooncake => mooncake::pull(sim, kv, hashes).await,
                SimHandoff::NixlPush => nixl::wait_for_push(sim, kv, hashes, request_id).await,
                other => Err(HandoffError::NotThisHandoff(value_name(other))),
            },
            How::SharedDir => {
                let dir = sim.args.kv_dir.clone().unwrap_or_default();
                let (t, h) = (tokens.to_vec(), hashes.to_vec());
                let shown = dir.display().to_string();
                tokio::task::spawn_blocking(move || {
                    shared_dir::load(&dir, &t, &h, local_blocks, bs)
                })
                .await
                .unwrap_or_else(|e| Err(HandoffError::Loader(e.to_string())))
                .map(|()| shown)
            }
        }
    };
    let m = &sim.metrics;
    match result {
        Ok(from) => {
            let n = (hashes.len().saturating_sub(local_blocks) * bs) as u64;
            m.handoffs_received.fetch_add(1, Relaxed);
            m.handoff_tokens_received.fetch_add(n, Relaxed);
            tracing::info!(
                "KV handoff received {n} tokens from {from} ({local_blocks} blocks were cached here) for {request_id}"
            );
            Incoming::Received { tokens: n }
        }
        Err(reason) => {
            m.handoffs_missed.fetch_add(1, Relaxed);
            if matches!(sim.args.handoff, SimHandoff::Nixl | SimHandoff::NixlPush) {
                m.nixl_failed_transfers.fetch_add(1, Relaxed);
            }
            let n = tokens.len() - local_blocks * bs;
            tracing::warn!("KV handoff missed ({reason}): recomputing {n} tokens for {request_id}");
            Incoming::Missed
        }
    }
}

/// The prefill side of a request that hands its KV to a decode, kept while it runs.
pub struct Producer {
    sim: Arc<Sim>,
    key: String,
    kind: ProducerKind,
    blocks: KvBlocks,
    done: bool,
}

enum ProducerKind {
    Nixl,
    Mooncake,
    NixlPush,
}

/// The prefill side: writes shared-dir blocks now, or returns a [`Producer`] that hands
/// the KV over when the request completes (nixl, mooncake).
pub async fn send(
    sim: &Arc<Sim>,
    kv: Option<&KvTransferParams>,
    tokens: &[u32],
    hashes: &[u64],
    request_id: &str,
) -> Option<Producer> {
    let bs = sim.args.model_params.block_size as usize;
    if let Some(kv) = kv.filter(|kv| kv.remote_decode()) {
        let kind = match (sim.args.handoff, &kv.transfer_id) {
            (SimHandoff::Nixl, _) => ProducerKind::Nixl,
            (SimHandoff::NixlPush, _) => ProducerKind::NixlPush,
            (SimHandoff::Mooncake, Some(_)) => ProducerKind::Mooncake,
            (SimHandoff::Mooncake, None) => {
                tracing::warn!(
                    "not handing off {request_id}: kv_transfer_params has no transfer_id (mooncake needs one)"
                );
                return None;
            }
            (other, _) => {
                tracing::warn!(
                    "not handing off {request_id}: kv_transfer_params asks for a remote decode, but this sim runs --handoff {}",
                    value_name(other)
                );
                return None;
            }
        };
        let key = match kind {
            ProducerKind::Nixl | ProducerKind::NixlPush => request_id.to_string(),
            ProducerKind::Mooncake => kv.transfer_id.clone().unwrap_or_default(),
        };
        return Some(Producer {
            blocks: KvBlocks {
                engine_id: sim.engine_id.clone(),
                block_hashes: hashes.to_vec(),
                block_ids: sim.held.new_block_ids(hashes.len()),
                num_tokens: (hashes.len() * bs) as u64,
            },
            sim: sim.clone(),
            key,
            kind,
            done: false,
        });
    }
    if sim.args.handoff == SimHandoff::SharedDir
        && sim.args.role == SimRole::Prefill
        && !hashes.is_empty()
    {
        let dir = sim.args.kv_dir.clone().unwrap_or_default();
        let (t, h) = (tokens.to_vec(), hashes.to_vec());
        let shown = dir.display().to_string();
        match tokio::task::spawn_blocking(move || shared_dir::save(&dir, &t, &h, bs)).await {
            Ok(Ok(written)) => {
                sim.metrics.handoffs_sent.fetch_add(1, Relaxed);
                tracing::info!(
                    "KV handoff sent: {} blocks ({} tokens) of {request_id} are in {shown} ({written} newly written)",
                    hashes.len(),
                    hashes.len() * bs
                );
            }
            Ok(Err(e)) => tracing::error!(
                "KV handoff not sent: cannot write blocks of {request_id} to {shown}: {e}"
            ),
            Err(e) => tracing::error!("KV handoff not sent: writer task failed: {e}"),
        }
    }
    None
}

impl Producer {
    /// The request ended with `finish`: hand the KV over if it ended by the length cap
    /// (as vLLM does); returns the `kv_transfer_params` for the answer (nixl only).
    pub fn complete(mut self, finish: Finish) -> Option<serde_json::Value> {
        self.done = true;
        let sim = &self.sim;
        let ttl = Duration::from_millis(sim.args.model_params.kv_hold_timeout_ms);
        if finish != Finish::Length {
            tracing::info!(
                "KV handoff not offered for {}: the prefill ended by a stop condition, not the length cap; the decode will recompute",
                self.key
            );
            self.refuse("the prefill ended by a stop condition");
            return None;
        }
        let n = self.blocks.block_hashes.len();
        let tokens = self.blocks.num_tokens;
        let params = match self.kind {
            ProducerKind::Nixl => Some(nixl::transfer_params(sim, &self.key, &self.blocks)),
            ProducerKind::NixlPush => {
                let mut p = nixl::transfer_params(sim, &self.key, &self.blocks);
                p["transfer_mode"] = "push".into();
                Some(p)
            }
            ProducerKind::Mooncake => None,
        };
        sim.held.hold(
            &sim.metrics,
            &self.key,
            Held::Ready(self.blocks.clone()),
            ttl,
        );
        sim.metrics.handoffs_sent.fetch_add(1, Relaxed);
        tracing::info!(
            "KV handoff sent: holding {n} blocks ({tokens} tokens) under {} until a decode takes them (at most {} ms)",
            self.key,
            ttl.as_millis()
        );
        params
    }
}

impl Producer {
    /// Mooncake's and NIXL push's decode is already waiting for the KV: tell it why
    /// no KV will come rather than let it time out. (Nixl pull's decode never asks.)
    fn refuse(&self, why: &str) {
        if let ProducerKind::Mooncake | ProducerKind::NixlPush = self.kind {
            let ttl = Duration::from_millis(self.sim.args.model_params.kv_hold_timeout_ms);
            self.sim
                .held
                .hold(&self.sim.metrics, &self.key, Held::Refused(why.into()), ttl);
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if !self.done {
            self.refuse("the prefill request was aborted");
        }
    }
}

/// Why a KV handoff did not arrive, the reason a decode sim logs before it recomputes.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("fault injection (fail_handoff_next): this KV is treated as lost")]
    Injected,
    #[error("kv_transfer_params asks for a remote prefill, but this sim runs --handoff {0}")]
    NotThisHandoff(String),
    #[error("kv_transfer_params has no {0}")]
    MissingParam(&'static str),
    #[error("cannot reach {url}: {cause}")]
    Unreachable { url: String, cause: String },
    #[error("reading {url}: {cause}")]
    Read { url: String, cause: String },
    #[error("{url} answered {status}: {message}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        message: String,
    },
    #[error("{url} sent an unreadable answer: {cause}")]
    Unreadable { url: String, cause: String },
    #[error("cannot query {url}: {cause}")]
    Query { url: String, cause: String },
    /// `found` says who answered with which id.
    #[error("engine id mismatch: expected {expected}, {found}")]
    EngineMismatch { expected: String, found: String },
    #[error("the prefill's KV ({have} blocks) is for another prompt than this one ({want} blocks)")]
    OtherPrompt { have: usize, want: usize },
    #[error("block {index} of {of} is not in {dir}: {cause}")]
    MissingBlock {
        index: usize,
        of: usize,
        dir: String,
        cause: std::io::Error,
    },
    #[error("{path} holds other tokens than this prompt's block {index}")]
    OtherTokens { path: String, index: usize },
    #[error("loader task failed: {0}")]
    Loader(String),
}

/// GETs a held entry from a prefill sim (`/sim/kv/..` or `/sim/transfer/..`), with this
/// engine's key.
pub(crate) async fn fetch(
    sim: &Sim,
    url: &str,
    timeout: Duration,
) -> Result<KvBlocks, HandoffError> {
    // The prefill requires the cluster's engine key on /sim/kv as on every route that
    // is not a probe's; every engine of a cluster has the same key.
    let mut request = sim.http.get(url).timeout(timeout);
    if let Some(key) = &sim.args.api_key {
        request = request.bearer_auth(key);
    }
    let resp = request
        .send()
        .await
        .map_err(|e| HandoffError::Unreachable {
            url: url.to_string(),
            cause: chain(&e),
        })?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| HandoffError::Read {
        url: url.to_string(),
        cause: chain(&e),
    })?;
    if !status.is_success() {
        return Err(HandoffError::Status {
            url: url.to_string(),
            status,
            message: crate::error_text::answer_message(&body),
        });
    }
    serde_json::from_slice(&body).map_err(|e| HandoffError::Unreadable {
        url: url.to_string(),
        cause: e.to_string(),
    })
}

/// Checks that KV from a prefill is this prompt's.
pub(crate) fn check_blocks(
    blocks: &KvBlocks,
    expected_engine: Option<&str>,
    hashes: &[u64],
) -> Result<(), HandoffError> {
    if let Some(e) = expected_engine {
        if e != blocks.engine_id {
            return Err(HandoffError::EngineMismatch {
                expected: e.to_string(),
                found: format!("the prefill is {} (was it restarted?)", blocks.engine_id),
            });
        }
    }
    // The prefill holds every whole block of the prompt; a decode needs those before the
    // prompt's last token (all of them unless the prompt is whole blocks).
    if !blocks.block_hashes.starts_with(hashes) {
        return Err(HandoffError::OtherPrompt {
            have: blocks.block_hashes.len(),
            want: hashes.len(),
        });
    }
    Ok(())
}

/// The answer of a route that serves held KV.
pub(crate) fn held_response(sim: &Sim, key: &str, held: Option<Held>) -> axum::response::Response {
    use super::openai::ApiError;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    match held {
        Some(Held::Ready(b)) => {
            tracing::info!(
                "KV handoff {key}: {} blocks taken by a decode and freed here",
                b.block_hashes.len()
            );
            axum::Json(b).into_response()
        }
        Some(Held::Refused(reason)) => {
            ApiError::status(StatusCode::CONFLICT, format!("no KV for {key}: {reason}"))
                .into_response()
        }
        None => ApiError::status(
            StatusCode::NOT_FOUND,
            format!(
                "no KV held for {key} on engine {} (never produced, already taken, or expired)",
                sim.engine_id
            ),
        )
        .into_response(),
    }
}

/// Drops held KV nobody pulled in time; runs for the life of the process.
pub async fn expire_loop(sim: Arc<Sim>) {
    let period =
        Duration::from_millis((sim.args.model_params.kv_hold_timeout_ms / 4).clamp(10, 1000));
    loop {
        tokio::time::sleep(period).await;
        for (key, blocks) in sim.held.expire(&sim.metrics) {
            sim.metrics.handoffs_expired.fetch_add(1, Relaxed);
            tracing::warn!(
                "KV held under {key} ({blocks} blocks) expired: no decode took it in time"
            );
        }
    }
}
/// The `kv_transfer_params` field `name`, which a pull cannot do without.
fn required<T>(value: Option<T>, name: &'static str) -> Result<T, HandoffError> {
    value.ok_or(HandoffError::MissingParam(name))
}
