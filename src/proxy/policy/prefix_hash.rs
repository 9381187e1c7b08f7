//! Prompt prefix fingerprints for prefix-aware routing. The proxy has no tokenizer, so it
//! hashes the prompt text in fixed-size chunks, each hash chained to the one before it
//! (like vLLM's block hashes): two prompts share the first k hashes exactly when they
//! share the first k chunks of text.

use serde_json::{Map, Value};

/// Bytes per chunk: about 16 tokens of English text, one vLLM KV block.
pub const CHUNK_BYTES: usize = 64;
/// Longest prefix looked at (bounds the work per request: 256 KiB of prompt).
pub const MAX_CHUNKS: usize = 4096;

/// The prompt text of a completions (`prompt`) or chat (`messages`, rendered in order)
/// request, as bytes. Unknown shapes give what could be read (possibly nothing).
pub fn prompt_bytes(body: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                out.extend_from_slice(role.as_bytes());
                out.push(b'\n');
            }
            match m.get("content") {
                Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            out.extend_from_slice(t.as_bytes());
                        }
                    }
                }
                _ => {}
            }
            out.push(b'\n');
        }
    } else if let Some(prompt) = body.get("prompt") {
        append_prompt(prompt, &mut out);
    }
    out
}

fn append_prompt(prompt: &Value, out: &mut Vec<u8>) {
    match prompt {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        // Token ids: their decimal spelling is as good a fingerprint as the text.
        Value::Number(n) => {
            out.extend_from_slice(n.to_string().as_bytes());
            out.push(b' ');
        }
        // A batch of prompts (or of token ids): the first one decides routing.
        Value::Array(items) => match items.first() {
            Some(Value::Number(_)) => items.iter().for_each(|i| append_prompt(i, out)),
            Some(first) => append_prompt(first, out),
            None => {}
        },
        _ => {}
    }
}

/// Chained FNV-1a hashes of every full `CHUNK_BYTES` chunk of `bytes` (the partial tail
/// is left out: engines only cache full blocks).
pub fn chunk_hashes(bytes: &[u8]) -> Vec<u64> {
    let mut prev: u64 = 0xcbf2_9ce4_8422_2325;
    bytes
        .chunks_exact(CHUNK_BYTES)
        .take(MAX_CHUNKS)
        .map(|chunk| {
            let mut h = prev;
            for b in prev.to_le_bytes().iter().chain(chunk) {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            prev = h;
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn shared_prefixes_share_leading_hashes_only() {
        let context = "This is long context. ".repeat(20);
        let a = chunk_hashes(format!("{context}Question 0: Summarize.").as_bytes());
        let b = chunk_hashes(format!("{context}Question 1: Translate it.").as_bytes());
        let shared = context.len() / CHUNK_BYTES;
        assert!(shared >= 6);
        assert_eq!(a[..shared], b[..shared]);
        let c = chunk_hashes(format!("X{context}").as_bytes());
        assert_ne!(a[0], c[0]);
        // Same chunk text at another position hashes differently (chained).
        let rep = chunk_hashes(&[b'a'; 2 * CHUNK_BYTES]);
        assert_ne!(rep[0], rep[1]);
    }

    #[test]
    fn short_prompts_have_no_full_chunk() {
        assert!(chunk_hashes(b"San Francisco is a").is_empty());
    }

    #[test]
    fn chat_messages_render_in_order_with_roles() {
        let body = obj(json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        ]}));
        assert_eq!(prompt_bytes(&body), b"system\nbe brief\nuser\nhi\n");
    }

    #[test]
    fn completion_prompts_in_every_shape() {
        assert_eq!(prompt_bytes(&obj(json!({"prompt": "abc"}))), b"abc");
        assert_eq!(prompt_bytes(&obj(json!({"prompt": ["abc", "d"]}))), b"abc");
        assert_eq!(prompt_bytes(&obj(json!({"prompt": [1, 22]}))), b"1 22 ");
        assert!(prompt_bytes(&obj(json!({"prompt": null}))).is_empty());
    }
}
