//! Mooncake V1 (push based): both legs share a `transfer_id`; decode is told the prefill's
//! bootstrap address and engine id, which the proxy asks the prefill's bootstrap server
//! for (`GET /query`, cached per instance, dropped when a leg on it fails). Both legs go
//! out at once.

use super::{Body, DecodeBody, Flow, Handshake, PrefillAnswer, Protocol, prefill_copy};
use crate::proxy::errors::LegFailure;
use crate::proxy::instances::Instance;
use crate::proxy::upstream::Upstream;
use futures_util::future::BoxFuture;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// The MooncakeConnector (V1) protocol.
#[derive(Debug)]
pub struct Mooncake {
    engine_ids: Mutex<HashMap<usize, Value>>,
    query_timeout: Duration,
}

impl Mooncake {
    /// A protocol with an empty engine id cache; `/query` calls give up after `query_timeout`.
    pub fn new(query_timeout: Duration) -> Self {
        Mooncake {
            engine_ids: Mutex::new(HashMap::new()),
            query_timeout,
        }
    }

    fn cached(&self, prefill: &Instance) -> Option<Value> {
        let ids = self.engine_ids.lock().unwrap_or_else(|p| p.into_inner());
        ids.get(&prefill.index).cloned()
    }
}

/// `http://HOST:BOOTSTRAP_PORT` of a prefill instance.
pub fn bootstrap_addr(prefill: &Instance) -> String {
    let port = prefill
        .bootstrap_port
        .expect("config::pools gives every mooncake prefill a bootstrap port");
    format!("http://{}:{port}", prefill.host)
}

/// The transfer id both legs carry.
pub fn transfer_id(request_id: &str) -> String {
    format!("xfer-{request_id}")
}

/// The engine id in a `/query` answer: `{"0": {"engine_id": ...}}` (data-parallel rank 0,
/// or the lowest rank present).
fn engine_id_of(answer: &Value) -> Option<Value> {
    let ranks = answer.as_object()?;
    let rank = ranks.get("0").or_else(|| {
        let mut keys: Vec<&String> = ranks.keys().collect();
        keys.sort_by_key(|k| k.parse::<u64>().unwrap_or(u64::MAX));
        keys.first().and_then(|k| ranks.get(*k))
    })?;
    rank.get("engine_id").filter(|v| !v.is_null()).cloned()
}

impl Protocol for Mooncake {
    fn name(&self) -> &'static str {
        "mooncake"
    }

    fn flow(&self) -> Flow {
        Flow::Concurrent
    }

    fn handles_multiple_choices(&self) -> bool {
        false
    }

    fn prepare<'a>(
        &'a self,
        prefill: &'a Instance,
        upstream: &'a Upstream,
    ) -> BoxFuture<'a, Result<Handshake, LegFailure>> {
        Box::pin(async move {
            if let Some(id) = self.cached(prefill) {
                return Ok(Handshake {
                    remote_engine_id: Some(id),
                    ..Handshake::default()
                });
            }
            let url = format!("{}/query", bootstrap_addr(prefill));
            let fail = |reason: String| LegFailure::Bootstrap {
                url: url.clone(),
                reason,
            };
            let (status, body) = upstream
                .get(&url, self.query_timeout)
                .await
                .map_err(|e| fail(e.to_string()))?;
            if status != 200 {
                return Err(fail(format!("answered {status}")));
            }
            let answer: Value = serde_json::from_slice(&body)
                .map_err(|e| fail(format!("answered something that is not JSON ({e})")))?;
            let id = engine_id_of(&answer)
                .ok_or_else(|| fail(format!("has no engine_id in its answer {answer}")))?;
            self.engine_ids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(prefill.index, id.clone());
            Ok(Handshake {
                remote_engine_id: Some(id),
                ..Handshake::default()
            })
        })
    }

    fn forget(&self, prefill: &Instance) {
        self.engine_ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&prefill.index);
    }

    fn prefill_body(&self, original: &Body, request_id: &str, _h: &Handshake) -> Body {
        let mut b = prefill_copy(original);
        b.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "transfer_id": transfer_id(request_id),
            }),
        );
        b
    }

    fn decode_body(
        &self,
        original: &Body,
        request_id: &str,
        prefill: &Instance,
        handshake: &Handshake,
        _answer: Option<&PrefillAnswer>,
    ) -> DecodeBody {
        let mut body = original.clone();
        body.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_bootstrap_addr": bootstrap_addr(prefill),
                "remote_engine_id": handshake.remote_engine_id.clone().unwrap_or(Value::Null),
                "transfer_id": transfer_id(request_id),
            }),
        );
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

    #[test]
    fn engine_id_comes_from_rank_zero_or_the_lowest_rank() {
        assert_eq!(
            engine_id_of(&json!({"0": {"engine_id": "e0"}, "1": {"engine_id": "e1"}})),
            Some(json!("e0"))
        );
        assert_eq!(
            engine_id_of(&json!({"3": {"engine_id": "e3"}, "2": {"engine_id": "e2"}})),
            Some(json!("e2"))
        );
        assert_eq!(engine_id_of(&json!({"0": {}})), None);
        assert_eq!(engine_id_of(&json!([])), None);
    }

    #[test]
    fn both_legs_share_the_transfer_id_and_decode_knows_where_to_get_it() {
        let m = Mooncake::new(Duration::from_secs(1));
        let original = json!({"prompt": "p", "max_tokens": 5, "stream": true});
        let h = Handshake {
            remote_engine_id: Some(json!("engine-7")),
            ..Handshake::default()
        };
        let p = m.prefill_body(original.as_object().unwrap(), "abc", &h);
        assert_eq!(
            p["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-abc"})
        );
        assert_eq!(p["max_tokens"], 1);
        let d = m.decode_body(
            original.as_object().unwrap(),
            "abc",
            &test_prefill(),
            &h,
            None,
        );
        assert_eq!(
            d.body.as_ref().unwrap()["kv_transfer_params"],
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_bootstrap_addr": "http://10.0.0.5:8998", "remote_engine_id": "engine-7",
                "transfer_id": "xfer-abc"
            })
        );
        assert_eq!(d.body.as_ref().unwrap()["max_tokens"], 5);
    }
}
