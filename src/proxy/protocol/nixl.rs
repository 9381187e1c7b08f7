//! NIXL (pull based): prefill is told to keep its KV for a remote decode and answers with
//! `kv_transfer_params` saying where the blocks are; decode gets those params unchanged
//! (same X-Request-Id on both legs) and pulls the blocks. No params back means decode will
//! recompute: counted and logged, never silent.

use super::{Body, DecodeBody, Flow, Handshake, PrefillAnswer, Protocol, prefill_copy};
use crate::proxy::instances::Instance;
use serde_json::json;

/// The NixlConnector protocol.
#[derive(Debug, Clone, Copy)]
pub struct Nixl;

/// Metrics reason: prefill answered without `kv_transfer_params`.
pub const MISS_NO_PARAMS: &str = "prefill_returned_no_kv_transfer_params";

impl Protocol for Nixl {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn flow(&self) -> Flow {
        Flow::Sequential
    }

    fn handles_multiple_choices(&self) -> bool {
        // Prefill's blocks can be pulled by one decode request only.
        false
    }

    fn prefill_body(&self, original: &Body, _request_id: &str, _h: &Handshake) -> Body {
        let mut b = prefill_copy(original);
        b.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
        b
    }

    fn decode_body(
        &self,
        original: &Body,
        _request_id: &str,
        _prefill: &Instance,
        _h: &Handshake,
        answer: Option<&PrefillAnswer>,
    ) -> DecodeBody {
        let mut body = original.clone();
        match answer
            .and_then(|a| a.kv_transfer_params.as_ref())
            .filter(|p| p.is_object())
        {
            Some(params) => {
                body.insert("kv_transfer_params".into(), params.clone());
                DecodeBody {
                    body: Some(body),
                    handoff_miss: None,
                }
            }
            None => {
                // A client-supplied kv_transfer_params must not reach decode as if it were prefill's.
                body.remove("kv_transfer_params");
                DecodeBody {
                    body: Some(body),
                    handoff_miss: Some(MISS_NO_PARAMS),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::protocol::test_prefill;

    #[test]
    fn prefill_is_asked_to_keep_its_blocks_for_a_remote_decode() {
        let b = Nixl.prefill_body(
            json!({"prompt": "p", "max_tokens": 9}).as_object().unwrap(),
            "r",
            &Handshake::default(),
        );
        let p = &b["kv_transfer_params"];
        assert_eq!(p["do_remote_decode"], true);
        assert_eq!(p["do_remote_prefill"], false);
        for k in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            assert!(
                p[k].is_null() && p.as_object().unwrap().contains_key(k),
                "{k}"
            );
        }
        assert_eq!(b["max_tokens"], 1);
    }

    #[test]
    fn returned_params_reach_decode_unchanged_and_absence_is_a_miss() {
        let original = json!({"prompt": "p", "max_tokens": 9, "stream": true});
        let params = json!({"remote_block_ids": [1, 2], "remote_engine_id": "e", "tp_size": 1, "x_future_field": {"a": 1}});
        let d = Nixl.decode_body(
            original.as_object().unwrap(),
            "r",
            &test_prefill(),
            &Handshake::default(),
            Some(&PrefillAnswer {
                kv_transfer_params: Some(params.clone()),
            }),
        );
        assert_eq!(d.body.as_ref().unwrap()["kv_transfer_params"], params);
        assert_eq!(d.body.as_ref().unwrap()["max_tokens"], 9);
        assert_eq!(d.body.as_ref().unwrap()["stream"], true);
        assert!(d.handoff_miss.is_none());
        let miss = Nixl.decode_body(
            original.as_object().unwrap(),
            "r",
            &test_prefill(),
            &Handshake::default(),
            Some(&PrefillAnswer::default()),
        );
        assert_eq!(miss.handoff_miss, Some(MISS_NO_PARAMS));
        assert!(
            !miss
                .body
                .as_ref()
                .unwrap()
                .contains_key("kv_transfer_params")
        );
    }
}
