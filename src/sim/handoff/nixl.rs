//! The NIXL-style handoff: the prefill answers with `kv_transfer_params` naming itself
//! (engine id, host, port, request id, block ids); the decode pulls the blocks from
//! the prefill's HTTP port (`GET /sim/kv/{remote_request_id}`), which frees them.
//! Push mode (NixlPushConnector): the decode is sent at the same time as the prefill,
//! knowing only where the prefill is, and waits there for the KV of its own request id
//! (`GET /sim/kv/{id}?wait_ms=N`), as vLLM's decode waits for the prefill's WRITE.

use super::held::KvBlocks;
use super::{HandoffError, check_blocks, fetch, required};
use crate::sim::engine::Sim;
use crate::sim::openai::KvTransferParams;
use serde_json::{Value, json};
use std::time::Duration;

/// The `kv_transfer_params` a prefill returns, shaped as vLLM's NixlConnector's.
pub fn transfer_params(sim: &Sim, request_id: &str, blocks: &KvBlocks) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks.block_ids,
        "remote_engine_id": sim.engine_id,
        "remote_host": sim.kv_host,
        "remote_port": sim.args.port,
        "remote_request_id": request_id,
        "tp_size": 1,
    })
}

/// The decode side: pulls the blocks named in `kv`; Ok holds where they came from.
pub async fn pull(
    sim: &Sim,
    kv: &KvTransferParams,
    hashes: &[u64],
) -> Result<String, HandoffError> {
    let host = required(kv.remote_host.as_deref(), "remote_host")?;
    let port = required(kv.remote_port, "remote_port")?;
    let id = required(kv.remote_request_id.as_deref(), "remote_request_id")?;
    let host_part = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let url = format!("http://{host_part}:{port}/sim/kv/{id}");
    let timeout = Duration::from_millis(sim.args.model_params.handoff_wait_ms.max(1));
    let blocks = fetch(sim, &url, timeout).await?;
    check_blocks(&blocks, kv.remote_engine_id.as_deref(), hashes)?;
    Ok(format!("{} at {host_part}:{port}", blocks.engine_id))
}

/// The push decode side: waits on the prefill named in `kv` for the KV of this request,
/// bounded by `handoff_wait_ms`. Matched by the decode's own request id, which the shared
/// X-Request-Id makes the prefill leg's too, as vLLM's push prefill matches decode's
/// registration; `remote_request_id` (which vLLM's decode only puts in its lease
/// heartbeats) is not used.
pub async fn wait_for_push(
    sim: &Sim,
    kv: &KvTransferParams,
    hashes: &[u64],
    request_id: &str,
) -> Result<String, HandoffError> {
    let host = required(kv.remote_host.as_deref(), "remote_host")?;
    let port = required(kv.remote_port, "remote_port")?;
    let id = request_id;
    let host_part = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let wait = sim.args.model_params.handoff_wait_ms;
    let url = format!("http://{host_part}:{port}/sim/kv/{id}?wait_ms={wait}");
    let blocks = fetch(sim, &url, Duration::from_millis(wait + 5_000)).await?;
    check_blocks(&blocks, kv.remote_engine_id.as_deref(), hashes)?;
    Ok(format!(
        "{} at {host_part}:{port} (pushed)",
        blocks.engine_id
    ))
}
