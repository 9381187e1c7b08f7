//! The usage chunk of a streamed decode leg. Every streamed leg asks decode for it
//! (`stream_options.include_usage`), so each answer can be judged for a silent recompute
//! by its `cached_tokens`; a client that did not ask for it must not get it. vLLM's
//! streams differ with and without `include_usage` only by that chunk (`choices: []` and
//! the usage object, right before `data: [DONE]`), so taking that one event out gives
//! the client, byte for byte, the stream it asked for.

use super::protocol::Body;
use super::recompute::{Expect, UsageSeen, usage_in};
use bytes::Bytes;
use serde_json::{Value, json};

/// Whether a streamed request asked for the usage chunk (`stream_options.include_usage`).
pub fn asks_usage(body: &Body) -> bool {
    body.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true)
}

/// Whether the proxy adds `include_usage` to this request's decode leg (and so strips the
/// usage chunk from the client's stream): a stream whose client did not ask for usage,
/// on a leg with a handoff due (a leg the proxy knows recomputes needs no judging).
pub fn adds_usage(stream: bool, client: &Body, expect: Expect) -> bool {
    stream && !asks_usage(client) && matches!(expect, Expect::Handoff { .. })
}

/// Asks for the usage chunk in a decode leg's body. `continuous_usage_stats` goes: with
/// `include_usage` off it did nothing, and on it would put usage into every chunk.
pub fn ask_usage(body: &mut Body) {
    let opts = body.entry("stream_options").or_insert_with(|| json!({}));
    if !opts.is_object() {
        *opts = json!({});
    }
    if let Some(o) = opts.as_object_mut() {
        o.remove("continuous_usage_stats");
        o.insert("include_usage".into(), Value::Bool(true));
    }
}

/// Takes the usage chunk out of a stream, whatever the boundaries of the chunks it comes
/// in: complete events pass as they are, in order; the bytes of an event not yet complete
/// are held until it is (or the stream ends).
#[derive(Debug, Default)]
pub struct UsageStrip {
    pending: Vec<u8>,
    /// The usage of the chunk taken out, for judging the leg.
    pub usage: Option<UsageSeen>,
}

impl UsageStrip {
    /// The bytes of `chunk` (after what is held) to relay now: every complete event but
    /// the usage chunk. Empty when nothing is complete yet, or only the usage chunk was.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut from = 0;
        while let Some(len) = event_len(&self.pending[from..]) {
            let event = &self.pending[from..from + len];
            match usage_chunk(event) {
                Some(u) => self.usage = Some(u),
                None => out.extend_from_slice(event),
            }
            from += len;
        }
        self.pending.drain(..from);
        Bytes::from(out)
    }

    /// What is held when the stream ends: an event never completed, relayed as it came.
    pub fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }
}

/// The length of the first complete event of `bytes` (through the empty line that ends
/// it), if there is one.
fn event_len(bytes: &[u8]) -> Option<usize> {
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = bytes.windows(3).position(|w| w == b"\n\r\n").map(|p| p + 3);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The usage of one event when it is the usage chunk: `data:` a JSON object with a usage
/// object and no choices.
fn usage_chunk(event: &[u8]) -> Option<UsageSeen> {
    let data = event.trim_ascii().strip_prefix(b"data:")?;
    // The common case (no usage object) without parsing the chunk.
    let usage = usage_in(data)?;
    let v = serde_json::from_slice::<Value>(data.trim_ascii()).ok()?;
    v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
        .then_some(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: &[u8] = b"data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" a\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n\
        data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" b\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":null}\n\n";
    const USAGE: &[u8] = b"data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":495,\"total_tokens\":497,\"completion_tokens\":2}}\n\n";
    const DONE: &[u8] = b"data: [DONE]\n\n";

    fn stream(with_usage: bool) -> Vec<u8> {
        let mut s = TOKENS.to_vec();
        if with_usage {
            s.extend_from_slice(USAGE);
        }
        s.extend_from_slice(DONE);
        s
    }

    #[test]
    fn the_stream_without_its_usage_chunk_is_the_one_asked_for_byte_for_byte() {
        let asked = stream(true);
        // Whatever the chunk boundaries, one byte at a time included.
        for size in [1, 2, 7, 64, 300, asked.len()] {
            let mut strip = UsageStrip::default();
            let mut out = Vec::new();
            for chunk in asked.chunks(size) {
                out.extend_from_slice(&strip.push(chunk));
            }
            out.extend_from_slice(&strip.finish());
            assert_eq!(out, stream(false), "chunks of {size}");
        }
    }

    #[test]
    fn only_a_usage_object_without_choices_is_taken_out() {
        let mut strip = UsageStrip::default();
        // Continuous usage (every chunk with choices) and null usage pass.
        let continuous =
            b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":{\"prompt_tokens\":3}}\n\n";
        assert_eq!(&strip.push(continuous)[..], continuous);
        let err = b"data: {\"error\":{\"message\":\"usage\"}}\n\n";
        assert_eq!(&strip.push(err)[..], err);
        assert!(strip.push(USAGE).is_empty());
        assert_eq!(strip.usage.map(|u| u.prompt_tokens), Some(495));
        // An event never completed is relayed at the end as it came.
        assert!(strip.push(b"data: {\"choices\":[]").is_empty());
        assert_eq!(&strip.finish()[..], b"data: {\"choices\":[]");
        // CRLF line ends end events too.
        let crlf =
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\r\n\r\ndata: [DONE]\r\n\r\n";
        assert_eq!(&strip.push(crlf)[..], b"data: [DONE]\r\n\r\n");
    }

    #[test]
    fn usage_is_added_only_to_streams_that_did_not_ask_and_whose_handoff_is_judged() {
        let body = |v: Value| v.as_object().unwrap().clone();
        let one = Expect::Handoff {
            prompts: 1,
            own_usage: true,
        };
        let plain = body(json!({"stream": true}));
        let asked = body(json!({"stream": true, "stream_options": {"include_usage": true}}));
        assert!(asks_usage(&asked) && !asks_usage(&plain));
        assert!(adds_usage(true, &plain, one));
        assert!(!adds_usage(true, &asked, one));
        assert!(!adds_usage(false, &plain, one));
        assert!(!adds_usage(true, &plain, Expect::Recompute));
        let mut b = body(json!({"stream": true,
            "stream_options": {"continuous_usage_stats": true, "other": 1}}));
        ask_usage(&mut b);
        assert_eq!(
            Value::Object(b),
            json!({"stream": true, "stream_options": {"include_usage": true, "other": 1}})
        );
        let mut b = body(json!({"stream": true, "stream_options": null}));
        ask_usage(&mut b);
        assert!(asks_usage(&b));
    }
}
