//! The proxy protocols: how one client request becomes a prefill leg and a decode leg for
//! a given KV connector. Each protocol only shapes bodies and says
//! whether the legs run one after the other or at once; sending, retrying, timing and
//! relaying are the pipeline's job, so each protocol stays a page long.

mod mooncake;
mod nixl;
mod nixl_push;
mod two_step;

use super::errors::LegFailure;
use super::instances::Instance;
use super::upstream::Upstream;
use crate::vocab::ProxyProtocol;
use futures_util::future::BoxFuture;
use serde_json::{Map, Value, json};

pub use mooncake::Mooncake;
pub use nixl::Nixl;
pub use nixl_push::NixlPush;
pub use two_step::TwoStep;

/// A request body: a JSON object.
pub type Body = Map<String, Value>;

/// In which order the legs are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Prefill first; decode only once prefill answered (its answer may feed decode).
    Sequential,
    /// Both at once; the prefill leg runs in the background (decode waits for the KV push).
    Concurrent,
}

/// What a protocol learned about the chosen prefill instance before the legs go out
/// (mooncake: the engine id its bootstrap server reports; nixl-push: where the prefill is).
#[derive(Debug, Clone, Default)]
pub struct Handshake {
    pub remote_engine_id: Option<Value>,
    /// nixl-push: the prefill's engine id, side-channel host and port, TP size.
    pub prefill_coordinates: Option<Value>,
    /// A concurrent protocol that does not know the prefill yet: this request runs
    /// prefill first and decode with its answer, as a sequential one does.
    pub learn_first: bool,
}

/// What the proxy keeps of a prefill answer: the fields a protocol hands on to decode.
/// Everything else is checked to be well-formed JSON and skipped without being built
/// (parsing whole answers into values was 5 % of the proxy's instructions per request).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
pub struct PrefillAnswer {
    /// NixlConnector's handshake: where decode pulls the KV blocks from.
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
}

/// The decode leg's body, and why no KV handoff will happen if none will.
#[derive(Debug, Clone)]
pub struct DecodeBody {
    /// The body; `None` means the client's request exactly as it arrived (byte for byte,
    /// and without re-encoding it).
    pub body: Option<Body>,
    /// Set when decode will recompute the prompt (counted in metrics, logged).
    pub handoff_miss: Option<&'static str>,
}

/// One proxy protocol.
pub trait Protocol: Send + Sync + std::fmt::Debug {
    /// The CLI name.
    fn name(&self) -> &'static str;

    /// Whether the legs go out in sequence or at once.
    fn flow(&self) -> Flow;

    /// Whether a request with n > 1 keeps its KV handoff. When false the proxy sends
    /// such requests to decode only, which recomputes the prompt (counted as a miss).
    fn handles_multiple_choices(&self) -> bool;

    /// Work that depends on the chosen prefill instance, done before any leg is sent.
    fn prepare<'a>(
        &'a self,
        _prefill: &'a Instance,
        _upstream: &'a Upstream,
    ) -> BoxFuture<'a, Result<Handshake, LegFailure>> {
        Box::pin(async { Ok(Handshake::default()) })
    }

    /// Drops anything cached about `prefill` after one of its legs failed (it may have
    /// restarted with new identity).
    fn forget(&self, _prefill: &Instance) {}

    /// Notes what a prefill answered (nixl-push learns where the prefill is from it).
    fn learned(&self, _prefill: &Instance, _answer: &PrefillAnswer) {}

    /// The prefill leg's body.
    fn prefill_body(&self, original: &Body, request_id: &str, handshake: &Handshake) -> Body;

    /// The decode leg's body. `prefill_answer` is what the prefill answered in a
    /// sequential flow, `None` in a concurrent one.
    fn decode_body(
        &self,
        original: &Body,
        request_id: &str,
        prefill: &Instance,
        handshake: &Handshake,
        prefill_answer: Option<&PrefillAnswer>,
    ) -> DecodeBody;
}

/// The protocol object for a CLI choice.
pub fn build(p: ProxyProtocol, bootstrap_timeout: std::time::Duration) -> Box<dyn Protocol> {
    match p {
        ProxyProtocol::TwoStep => Box::new(TwoStep),
        ProxyProtocol::Nixl => Box::new(Nixl),
        ProxyProtocol::Mooncake => Box::new(Mooncake::new(bootstrap_timeout)),
        ProxyProtocol::NixlPush => Box::new(NixlPush::default()),
    }
}

/// The prefill copy every protocol starts from: one output token, no streaming, one
/// choice, and the fields that would conflict with max_tokens = 1 removed.
pub fn prefill_copy(original: &Body) -> Body {
    let mut b = original.clone();
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    b.insert("stream".into(), json!(false));
    b.remove("stream_options");
    // min_tokens > 1 and best_of > n are rejected by vLLM once max_tokens / n are 1.
    b.remove("min_tokens");
    b.remove("best_of");
    if b.contains_key("n") {
        b.insert("n".into(), json!(1));
    }
    b
}

/// The `n` of a request (1 when absent or not a number).
pub fn choices(body: &Body) -> u64 {
    body.get("n").and_then(Value::as_u64).unwrap_or(1)
}

#[cfg(test)]
pub(crate) fn test_prefill() -> Instance {
    use super::instances::{Leg, parse_endpoint};
    Instance::new(
        Leg::Prefill,
        0,
        parse_endpoint("10.0.0.5:8100").unwrap(),
        Some(8998),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_copy_asks_for_one_token_and_nothing_that_contradicts_it() {
        let original = json!({
            "model": "m", "messages": [], "max_completion_tokens": 200, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 10, "n": 3, "best_of": 4,
            "temperature": 0.7
        });
        let copy = prefill_copy(original.as_object().unwrap());
        assert_eq!(copy["max_tokens"], 1);
        assert_eq!(copy["max_completion_tokens"], 1);
        assert_eq!(copy["stream"], false);
        assert_eq!(copy["n"], 1);
        assert_eq!(copy["temperature"], 0.7);
        for gone in ["stream_options", "min_tokens", "best_of"] {
            assert!(!copy.contains_key(gone), "{gone}");
        }
        let plain = prefill_copy(json!({"prompt": "x"}).as_object().unwrap());
        assert!(!plain.contains_key("max_completion_tokens") && !plain.contains_key("n"));
    }

    #[test]
    fn a_prefill_answer_keeps_kv_transfer_params_and_must_be_a_json_object() {
        let params =
            json!({"remote_block_ids": [1, 2], "remote_engine_id": "e", "new_field": {"a": [1]}});
        let answer = json!({
            "id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": null}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            "kv_transfer_params": params,
        });
        let parse = |b: &[u8]| serde_json::from_slice::<PrefillAnswer>(b);
        let kept = parse(answer.to_string().as_bytes()).unwrap();
        assert_eq!(kept.kv_transfer_params, Some(params));
        let none = parse(br#"{"choices": [], "kv_transfer_params": null}"#).unwrap();
        assert_eq!(none, PrefillAnswer::default());
        assert_eq!(parse(b"{}").unwrap(), PrefillAnswer::default());
        for bad in [&b"[1, 2]"[..], b"\"text\"", b"{\"choices\": [", b"not json"] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
