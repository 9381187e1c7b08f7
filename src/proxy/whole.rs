//! A whole (non-streamed) answer built from the events of a stream. A non-streamed request
//! whose answer may be continued on another decode ([`super::migration`]) has its decode leg
//! streamed, so that the proxy knows what was generated when the leg breaks off; the
//! client, which asked for one JSON body, gets the body the engine would have written:
//! the stream's id, model and created, each choice's text (a chat's message) put together,
//! its last finish and stop reason, and the final usage.

use serde_json::{Map, Value, json};

/// Why a stream's events could not be made into one answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AssembleError {
    /// An event that is not a JSON object (the engine's stream is not OpenAI's form).
    #[error("decode streamed an event that is not a JSON object: {0}")]
    NotAnObject(String),
    /// The stream carried no answer at all.
    #[error("decode's stream ended without any answer event")]
    Empty,
}

/// One choice as it is put together.
#[derive(Default)]
struct Choice {
    text: String,
    /// A chat's reasoning text, when the engine streamed any.
    reasoning: Option<String>,
    role: Option<Value>,
    /// The ids put together (an array), `null` while the stream wrote them as null.
    token_ids: Option<Value>,
    finish_reason: Value,
    stop_reason: Value,
    /// Members of the choice other than those above, as first seen (logprobs, ...).
    other: Map<String, Value>,
}

/// The JSON body of the whole answer whose stream events (client form, `data: ` lines with
/// `[DONE]` last) are `events`; `chat`: a chat completion's (else a completion's).
pub fn assemble(events: &[u8], chat: bool) -> Result<Vec<u8>, AssembleError> {
    let mut top: Option<Map<String, Value>> = None;
    let mut usage = Value::Null;
    let mut choices: Vec<(u64, Choice)> = Vec::new();
    for data in crate::sse::data_of(events) {
        if data.trim() == crate::sse::DONE {
            continue;
        }
        let Ok(Value::Object(mut event)) = serde_json::from_str::<Value>(&data) else {
            return Err(AssembleError::NotAnObject(data));
        };
        if let Some(u) = event.remove("usage").filter(|u| !u.is_null()) {
            usage = u;
        }
        if let Some(Value::Array(cs)) = event.remove("choices") {
            for c in cs {
                let Value::Object(c) = c else { continue };
                let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
                let at = match choices.iter().position(|(i, _)| *i == index) {
                    Some(at) => at,
                    None => {
                        choices.push((index, Choice::default()));
                        choices.len() - 1
                    }
                };
                add(&mut choices[at].1, c, chat);
            }
        }
        top.get_or_insert(event);
    }
    let mut body = top.ok_or(AssembleError::Empty)?;
    choices.sort_by_key(|(i, _)| *i);
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, c)| finish(index, c, chat))
        .collect();
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    body.insert("object".into(), json!(object));
    body.insert("choices".into(), Value::Array(choices));
    body.insert("usage".into(), usage);
    Ok(serde_json::to_vec(&Value::Object(body)).expect("JSON values serialize"))
}

/// Adds one streamed choice's piece to what is put together.
fn add(into: &mut Choice, mut c: Map<String, Value>, chat: bool) {
    let piece = if chat {
        let mut delta = match c.remove("delta") {
            Some(Value::Object(d)) => d,
            _ => Map::new(),
        };
        if let Some(r) = delta.remove("role").filter(|r| !r.is_null()) {
            into.role.get_or_insert(r);
        }
        if let Some(Value::String(r)) = delta.remove("reasoning_content") {
            into.reasoning.get_or_insert_with(String::new).push_str(&r);
        }
        delta.remove("content")
    } else {
        c.remove("text")
    };
    if let Some(Value::String(s)) = piece {
        into.text.push_str(&s);
    }
    match (c.remove("token_ids"), &mut into.token_ids) {
        (Some(Value::Array(ids)), Some(Value::Array(have))) => have.extend(ids),
        (Some(ids @ Value::Array(_)), slot) => *slot = Some(ids),
        (Some(Value::Null), slot @ None) => *slot = Some(Value::Null),
        _ => {}
    }
    for (key, slot) in [
        ("finish_reason", &mut into.finish_reason),
        ("stop_reason", &mut into.stop_reason),
    ] {
        if let Some(v) = c.remove(key).filter(|v| !v.is_null()) {
            *slot = v;
        }
    }
    c.remove("index");
    for (k, v) in c {
        into.other.entry(k).or_insert(v);
    }
}

/// One choice of the whole answer, in the engine's non-streamed form.
fn finish(index: u64, c: Choice, chat: bool) -> Value {
    let mut out = Map::new();
    out.insert("index".into(), json!(index));
    if chat {
        let mut message = Map::new();
        message.insert("role".into(), c.role.unwrap_or(json!("assistant")));
        message.insert("content".into(), json!(c.text));
        if let Some(r) = c.reasoning {
            message.insert("reasoning_content".into(), json!(r));
        }
        message.insert("tool_calls".into(), json!([]));
        out.insert("message".into(), Value::Object(message));
    } else {
        out.insert("text".into(), json!(c.text));
    }
    out.insert(
        "logprobs".into(),
        c.other.get("logprobs").cloned().unwrap_or(Value::Null),
    );
    out.insert("finish_reason".into(), c.finish_reason);
    out.insert("stop_reason".into(), c.stop_reason);
    for (k, v) in c.other {
        out.entry(k).or_insert(v);
    }
    if let Some(ids) = c.token_ids {
        out.insert("token_ids".into(), ids);
    }
    if !chat {
        // Set on every whole completion choice by vLLM, not on its stream chunks.
        out.entry("prompt_logprobs").or_insert(Value::Null);
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(events: &[Value]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in events {
            out.extend_from_slice(format!("data: {e}\n\n").as_bytes());
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    fn parsed(b: Vec<u8>) -> Value {
        serde_json::from_slice(&b).unwrap()
    }

    #[test]
    fn a_completion_stream_becomes_one_text_completion_with_its_usage() {
        let ev = |text: &str, fin: Value| {
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": text, "logprobs": null,
                                "finish_reason": fin, "stop_reason": null}]})
        };
        let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
        let events = [
            ev("Hello", Value::Null),
            ev(" world", json!("length")),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [], "usage": usage}),
        ];
        let v = parsed(assemble(&sse(&events), false).unwrap());
        assert_eq!(v["id"], "cmpl-1");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["created"], 7);
        assert_eq!(v["choices"][0]["text"], "Hello world");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"], usage);
    }

    #[test]
    fn a_chat_stream_becomes_one_message_with_the_role_of_its_first_chunk() {
        let ev = |delta: Value, fin: Value| {
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                              "finish_reason": fin}]})
        };
        let events = [
            ev(json!({"role": "assistant", "content": ""}), Value::Null),
            ev(json!({"content": "Hi"}), Value::Null),
            ev(json!({"content": " there"}), json!("stop")),
        ];
        let v = parsed(assemble(&sse(&events), true).unwrap());
        assert_eq!(v["object"], "chat.completion");
        let c = &v["choices"][0];
        assert_eq!(c["message"]["role"], "assistant");
        assert_eq!(c["message"]["content"], "Hi there");
        assert_eq!(c["finish_reason"], "stop");
        assert!(c.get("delta").is_none(), "{c}");
        assert_eq!(v["usage"], Value::Null);
    }

    #[test]
    fn token_ids_are_kept_in_order_when_the_stream_carries_them() {
        let ev = |ids: Value| json!({"id": "c", "choices": [{"index": 0, "text": "x", "token_ids": ids}]});
        let events = [ev(json!([1, 2])), ev(json!([3]))];
        let v = parsed(assemble(&sse(&events), false).unwrap());
        assert_eq!(v["choices"][0]["token_ids"], json!([1, 2, 3]));
        assert_eq!(v["choices"][0]["text"], "xx");
        let unasked = [ev(Value::Null), ev(Value::Null)];
        let v = parsed(assemble(&sse(&unasked), false).unwrap());
        assert_eq!(v["choices"][0]["token_ids"], Value::Null);
        assert!(
            v["choices"][0]
                .as_object()
                .unwrap()
                .contains_key("token_ids")
        );
    }

    #[test]
    fn a_stream_without_answer_events_or_with_a_foreign_one_is_an_error() {
        assert_eq!(
            assemble(b"data: [DONE]\n\n", false),
            Err(AssembleError::Empty)
        );
        assert!(matches!(
            assemble(b"data: not json\n\n", false),
            Err(AssembleError::NotAnObject(_))
        ));
    }
}
