//! NIXL push (vLLM's NixlPushConnector, 0.24.0 and later): decode registers the blocks it
//! allocated with the prefill named in its `kv_transfer_params`, and the prefill writes
//! the KV into them once its own leg is done; the two are matched by the request id (the
//! same X-Request-Id on both legs). So both legs go out at once, and decode must be told
//! beforehand where the prefill is: its engine id, side-channel host and port and TP size.
//!
//! Those are what the prefill returns in `kv_transfer_params` at the end of every leg, so
//! the proxy learns them from the first answer of each prefill instance (that first
//! request runs prefill first, then decode with the returned params, which vLLM's push
//! scheduler also serves: the prefill keeps finished blocks for its lease until decode's
//! registration arrives) and sends both legs at once from then on. Every answer refreshes
//! them (a restarted prefill has a new engine id); a failed leg on the prefill, or a decode
//! that could not load its KV, forgets them.

use super::{Body, DecodeBody, Flow, Handshake, PrefillAnswer, Protocol, prefill_copy};
use crate::proxy::errors::LegFailure;
use crate::proxy::instances::Instance;
use crate::proxy::upstream::Upstream;
use futures_util::future::BoxFuture;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::Mutex;

/// The fields of a prefill's returned params that decode needs to register with it.
const COORDINATES: [&str; 5] = [
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "pp_size",
];

/// The NixlPushConnector protocol, with what it learned of each prefill instance.
#[derive(Debug, Default)]
pub struct NixlPush {
    coordinates: Mutex<HashMap<usize, Map<String, Value>>>,
}

/// The coordinates in a prefill's returned params, when it has all decode needs.
fn coordinates_of(params: &Value) -> Option<Map<String, Value>> {
    let p = params.as_object()?;
    let mut out = Map::new();
    for k in COORDINATES {
        match p.get(k) {
            Some(v) if !v.is_null() => {
                out.insert(k.to_string(), v.clone());
            }
            // pp_size came later than the others; vLLM reads it with a default of 1.
            _ if k == "pp_size" => {}
            _ => return None,
        }
    }
    Some(out)
}

impl NixlPush {
    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Map<String, Value>>> {
        self.coordinates.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Protocol for NixlPush {
    fn name(&self) -> &'static str {
        "nixl-push"
    }

    fn flow(&self) -> Flow {
        Flow::Concurrent
    }

    fn handles_multiple_choices(&self) -> bool {
        // One decode registration per prefill request.
        false
    }

    fn prepare<'a>(
        &'a self,
        prefill: &'a Instance,
        _upstream: &'a Upstream,
    ) -> BoxFuture<'a, Result<Handshake, LegFailure>> {
        let known = self.cache().get(&prefill.index).cloned();
        Box::pin(async move {
            Ok(Handshake {
                learn_first: known.is_none(),
                prefill_coordinates: known.map(Value::Object),
                ..Handshake::default()
            })
        })
    }

    fn learned(&self, prefill: &Instance, answer: &PrefillAnswer) {
        if let Some(c) = answer.kv_transfer_params.as_ref().and_then(coordinates_of) {
            self.cache().insert(prefill.index, c);
        }
    }

    fn forget(&self, prefill: &Instance) {
        self.cache().remove(&prefill.index);
    }

    fn prefill_body(&self, original: &Body, _request_id: &str, _h: &Handshake) -> Body {
        let mut b = prefill_copy(original);
        b.insert(
            "kv_transfer_params".into(),
            json!({ "do_remote_decode": true, "do_remote_prefill": false }),
        );
        b
    }

    fn decode_body(
        &self,
        original: &Body,
        request_id: &str,
        prefill: &Instance,
        handshake: &Handshake,
        answer: Option<&PrefillAnswer>,
    ) -> DecodeBody {
        if answer.is_some() {
            // Learning a prefill's coordinates: decode gets its answer's params, as in pull.
            return super::nixl::Nixl.decode_body(original, request_id, prefill, handshake, answer);
        }
        let mut body = original.clone();
        let mut params = match &handshake.prefill_coordinates {
            Some(Value::Object(c)) => c.clone(),
            _ => Map::new(),
        };
        params.insert("do_remote_prefill".into(), json!(true));
        params.insert("do_remote_decode".into(), json!(false));
        // vLLM (0.32 at least) reads `remote_request_id` for every request it receives KV
        // for, push included, and dies on its absence (KeyError in the scheduler, found by
        // the CPU end-to-end run). Push does not match by it (the prefill matches decode's
        // registration by the request id's base, which the shared X-Request-Id makes
        // equal); only decode's lease heartbeats carry it, and the prefill's own id has a
        // random suffix no proxy can know before it answers, so the id both legs share is
        // the honest value.
        params.insert("remote_request_id".into(), json!(request_id));
        body.insert("kv_transfer_params".into(), Value::Object(params));
        DecodeBody {
            body: Some(body),
            handoff_miss: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::protocol::test_prefill;

    fn answer() -> PrefillAnswer {
        PrefillAnswer {
            kv_transfer_params: Some(json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [[1, 2]], "remote_engine_id": "e-1",
                "remote_request_id": "cmpl-r-0", "remote_host": "10.0.0.5",
                "remote_port": 5600, "tp_size": 1, "pp_size": 1, "transfer_mode": "push",
            })),
        }
    }

    #[test]
    fn the_first_request_to_a_prefill_learns_where_it_is_then_both_legs_go_at_once() {
        let p = NixlPush::default();
        let inst = test_prefill();
        let up =
            Upstream::new(std::time::Duration::from_secs(1), Default::default(), None).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let h = rt.block_on(p.prepare(&inst, &up)).unwrap();
        assert!(h.learn_first && h.prefill_coordinates.is_none());
        let original = json!({"prompt": "p", "max_tokens": 7, "stream": true});
        let original = original.as_object().unwrap();
        // Learning: decode gets the answer's params unchanged.
        let d = p.decode_body(original, "r", &inst, &h, Some(&answer()));
        assert_eq!(
            d.body.unwrap()["kv_transfer_params"],
            answer().kv_transfer_params.unwrap()
        );
        p.learned(&inst, &answer());
        let h = rt.block_on(p.prepare(&inst, &up)).unwrap();
        assert!(!h.learn_first);
        let pre = p.prefill_body(original, "r", &h);
        assert_eq!(
            pre["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false})
        );
        assert_eq!(pre["max_tokens"], 1);
        let d = p.decode_body(original, "r", &inst, &h, None);
        let body = d.body.unwrap();
        assert_eq!(
            body["kv_transfer_params"],
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": "e-1", "remote_host": "10.0.0.5",
                "remote_port": 5600, "tp_size": 1, "pp_size": 1,
                "remote_request_id": "r",
            })
        );
        assert_eq!(body["max_tokens"], 7);
        p.forget(&inst);
        assert!(rt.block_on(p.prepare(&inst, &up)).unwrap().learn_first);
    }

    #[test]
    fn params_without_the_prefill_coordinates_teach_nothing() {
        assert!(coordinates_of(&json!({"remote_engine_id": "e"})).is_none());
        assert!(coordinates_of(&json!(null)).is_none());
        let c = coordinates_of(&json!({
            "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 2
        }))
        .unwrap();
        assert!(!c.contains_key("pp_size"));
    }
}
