//! The usage chunk of a streamed decode leg. Every streamed leg asks decode for it
//! (`stream_options.include_usage`), so each answer can be judged for a silent recompute
//! by its `cached_tokens`; a client that did not ask for it must not get it. vLLM's
//! streams differ with and without `include_usage` by that chunk (`choices: []` and the
//! usage object, right before `data: [DONE]`) and, in the vLLM versions that stamp a
//! `system_fingerprint`, by where it goes: on the usage chunk with `include_usage`, else
//! appended to each terminal chunk (one with a `finish_reason`). So the strip holds the
//! terminal chunks until the usage chunk comes, stamps them with its fingerprint, and
//! drops the usage chunk: the client gets, byte for byte, the stream it asked for.

use super::protocol::Body;
use super::recompute::judgment::{Expect, UsageSeen, usage_in};
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
    /// Events from the first terminal chunk on, held until the usage chunk (whose
    /// fingerprint they may need) or the end of the stream.
    held: Vec<Vec<u8>>,
    /// The usage of the chunk taken out, for judging the leg.
    pub usage: Option<UsageSeen>,
}

impl UsageStrip {
    /// The bytes of `chunk` (after what is held) to relay now: every complete event but
    /// the usage chunk, those from the first terminal chunk on once the usage chunk came
    /// (or `[DONE]` without one). Empty when nothing is ready yet.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut from = 0;
        while let Some(len) = event_len(&self.pending[from..]) {
            let event = self.pending[from..from + len].to_vec();
            from += len;
            if let Some((usage, fingerprint)) = usage_chunk(&event) {
                self.usage = Some(usage);
                self.release(fingerprint.as_deref(), &mut out);
            } else if !self.held.is_empty() || is_terminal(&event) {
                if is_done(&event) {
                    self.release(None, &mut out);
                    out.extend_from_slice(&event);
                } else {
                    self.held.push(event);
                }
            } else {
                out.extend_from_slice(&event);
            }
        }
        self.pending.drain(..from);
        Bytes::from(out)
    }

    /// What is held when the stream ends: events held back, and an event never
    /// completed, relayed as they came.
    pub fn finish(&mut self) -> Bytes {
        let mut out = Vec::new();
        self.release(None, &mut out);
        out.append(&mut self.pending);
        Bytes::from(out)
    }

    /// Moves the held events to `out`, terminal chunks stamped with `fingerprint`.
    fn release(&mut self, fingerprint: Option<&str>, out: &mut Vec<u8>) {
        for event in self.held.drain(..) {
            match fingerprint {
                Some(f) if is_terminal(&event) => out.extend_from_slice(&stamped(&event, f)),
                _ => out.extend_from_slice(&event),
            }
        }
    }
}

/// A terminal chunk with `"system_fingerprint": f` appended to its object, where vLLM
/// puts it without `include_usage` (the field comes after every other one a chunk sets);
/// unchanged when it has one already.
fn stamped(event: &[u8], f: &str) -> Vec<u8> {
    let has = event.windows(20).any(|w| w == b"\"system_fingerprint\"");
    match event.iter().rposition(|b| *b == b'}') {
        Some(end) if !has => {
            let value = serde_json::to_string(f).expect("a string serializes");
            let mut v = event[..end].to_vec();
            v.extend_from_slice(b",\"system_fingerprint\":");
            v.extend_from_slice(value.as_bytes());
            v.extend_from_slice(&event[end..]);
            v
        }
        _ => event.to_vec(),
    }
}

/// Whether an event is a chunk finishing a choice: a `"finish_reason"` with a string
/// value.
fn is_terminal(event: &[u8]) -> bool {
    const KEY: &[u8] = b"\"finish_reason\"";
    let mut at = 0;
    while let Some(p) = event[at..].windows(KEY.len()).position(|w| w == KEY) {
        at += p + KEY.len();
        let rest = event[at..].trim_ascii_start();
        if let Some(value) = rest.strip_prefix(b":")
            && value.trim_ascii_start().first() == Some(&b'"')
        {
            return true;
        }
    }
    false
}

/// Whether an event is `data: [DONE]`.
fn is_done(event: &[u8]) -> bool {
    event
        .trim_ascii()
        .strip_prefix(b"data:")
        .is_some_and(|d| d.trim_ascii() == b"[DONE]")
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

/// The usage of one event, and its `system_fingerprint`, when it is the usage chunk:
/// `data:` a JSON object with a usage object and no choices.
fn usage_chunk(event: &[u8]) -> Option<(UsageSeen, Option<String>)> {
    let data = event.trim_ascii().strip_prefix(b"data:")?;
    // The common case (no usage object) without parsing the chunk.
    let usage = usage_in(data)?;
    let v = serde_json::from_slice::<Value>(data.trim_ascii()).ok()?;
    let no_choices = v
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    let fingerprint = v["system_fingerprint"].as_str().map(str::to_string);
    no_choices.then_some((usage, fingerprint))
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
    fn a_fingerprint_on_the_usage_chunk_goes_back_on_the_terminal_chunks() {
        // vLLM (fingerprint mode "full"), chat with n = 2, as it streams without
        // include_usage: the fingerprint on each terminal chunk, after its other fields.
        let role = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"prompt_token_ids\":null}\n\n";
        let end0 = |fp: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" a\"}},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}}]{fp}}}\n\n"
            )
        };
        let mid1 = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\" b\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
        let end1 = |fp: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":1,\"delta\":{{\"content\":\" c\"}},\"logprobs\":null,\"finish_reason\": \"stop\",\"stop_reason\":null}}]{fp}}}\n\n"
            )
        };
        let fp = ",\"system_fingerprint\":\"vllm-0.32.0-1a2b3c4d\"";
        let usage = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":12,\"completion_tokens\":3},\"system_fingerprint\":\"vllm-0.32.0-1a2b3c4d\"}\n\n";
        let with = [
            &role[..],
            end0("").as_bytes(),
            mid1,
            end1("").as_bytes(),
            usage,
            DONE,
        ]
        .concat();
        let without = [
            &role[..],
            end0(fp).as_bytes(),
            mid1,
            end1(fp).as_bytes(),
            DONE,
        ]
        .concat();
        for size in [1, 5, 100, with.len()] {
            let mut strip = UsageStrip::default();
            let mut out = Vec::new();
            for chunk in with.chunks(size) {
                out.extend_from_slice(&strip.push(chunk));
            }
            out.extend_from_slice(&strip.finish());
            assert_eq!(
                String::from_utf8(out).unwrap(),
                String::from_utf8(without.clone()).unwrap(),
                "chunks of {size}"
            );
        }
        // Without a usage chunk (a cut stream) the held events go out as they came.
        let mut strip = UsageStrip::default();
        let cut = [&role[..], end0("").as_bytes()].concat();
        let mut out = strip.push(&cut).to_vec();
        assert_eq!(
            out,
            role.to_vec(),
            "the terminal chunk waits for the usage chunk"
        );
        out.extend_from_slice(&strip.finish());
        assert_eq!(out, cut);
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
