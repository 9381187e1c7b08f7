//! A whole (non-streamed) answer built from the events of a stream. A non-streamed request
//! whose answer may be continued on another decode ([`super::migration`]) has its decode leg
//! streamed, so that the proxy knows what was generated when the leg breaks off; the
//! client, which asked for one JSON body, gets the body the engine would have written:
//! the stream's id, model and created, each choice's text (a chat's message) put together,
//! its last finish and stop reason, and the final usage.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

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

/// A JSON object's members left unparsed, borrowed from the event's text, in a list (an
/// object has a handful): an event is read once, and only the members put together are
/// made into values (the rest of the first event's only), which made a whole answer of 16
/// tokens cost a fraction of what parsing every event into a [`Value`] did.
#[derive(Default)]
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Members<'a> {
    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    fn remove(&mut self, key: &str) -> Option<&'a RawValue> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.swap_remove(at).1)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut m: M,
            ) -> Result<Self::Value, M::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(8));
                while let Some((Key(k), v)) = m.next_entry::<Key<'a>, &'a RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// A member's name, borrowed unless it has escapes.
#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

/// What of an event is put together: its choices and its usage.
#[derive(Deserialize)]
struct EventView<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<Members<'a>>>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

/// The JSON body of the whole answer whose stream events (client form, `data: ` lines with
/// `[DONE]` last) are `events`; `chat`: a chat completion's (else a completion's); `ids`:
/// the client asked for the token ids, else those there are written as `null`, as the
/// engine writes them unasked.
pub fn assemble(events: &[u8], chat: bool, ids: bool) -> Result<Vec<u8>, AssembleError> {
    let mut top: Option<Map<String, Value>> = None;
    let mut usage = Value::Null;
    let mut choices: Vec<(u64, Choice)> = Vec::new();
    for data in crate::sse::data_of(events) {
        if data.trim() == crate::sse::DONE {
            continue;
        }
        let Ok(event) = serde_json::from_str::<EventView>(&data) else {
            return Err(AssembleError::NotAnObject(data));
        };
        if top.is_none() {
            let Ok(Value::Object(mut first)) = serde_json::from_str::<Value>(&data) else {
                return Err(AssembleError::NotAnObject(data));
            };
            first.remove("choices");
            first.remove("usage");
            top = Some(first);
        }
        if let Some(u) = event.usage.and_then(value_of).filter(|u| !u.is_null()) {
            usage = u;
        }
        for c in event.choices.unwrap_or_default() {
            let index = member::<u64>(&c, "index").unwrap_or(0);
            let at = match choices.iter().position(|(i, _)| *i == index) {
                Some(at) => at,
                None => {
                    choices.push((index, Choice::default()));
                    choices.len() - 1
                }
            };
            add(&mut choices[at].1, c, chat, ids);
        }
    }
    let mut body = top.ok_or(AssembleError::Empty)?;
    choices.sort_by_key(|(i, _)| *i);
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, c)| finish(index, c, chat, ids))
        .collect();
    if !ids {
        null_ids(&mut body);
    }
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

/// A member parsed as `T`; `None` when it is missing or of another form.
fn member<'a, T: Deserialize<'a>>(m: &Members<'a>, key: &str) -> Option<T> {
    let raw = m.get(key)?;
    serde_json::from_str(raw.get()).ok()
}

/// A string member, borrowed from the event unless it has escapes; `None` for another value.
fn text_member<'a>(m: &Members<'a>, key: &str) -> Option<Cow<'a, str>> {
    text_of(m.get(key)?)
}

/// An unparsed string, borrowed unless it has escapes; `None` for any other value.
pub fn text_of(raw: &RawValue) -> Option<Cow<'_, str>> {
    match serde_json::from_str::<&str>(raw.get()) {
        Ok(t) => Some(Cow::Borrowed(t)),
        Err(_) => serde_json::from_str::<String>(raw.get())
            .ok()
            .map(Cow::Owned),
    }
}

/// An unparsed member as a value.
fn value_of(raw: &RawValue) -> Option<Value> {
    serde_json::from_str(raw.get()).ok()
}

fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}

/// Adds one streamed choice's piece to what is put together; `ids`: the client asked for
/// the token ids (else they are not read: the answer has them as `null`).
fn add(into: &mut Choice, mut c: Members<'_>, chat: bool, ids: bool) {
    let piece: Option<Cow<str>> = if chat {
        let delta: Members = member(&c, "delta").unwrap_or_default();
        if let Some(r) = delta.get("role").filter(|r| !is_null(r)) {
            if into.role.is_none() {
                into.role = value_of(r);
            }
        }
        if let Some(r) = text_member(&delta, "reasoning_content") {
            into.reasoning.get_or_insert_with(String::new).push_str(&r);
        }
        text_member(&delta, "content")
    } else {
        text_member(&c, "text")
    };
    if let Some(s) = piece {
        into.text.push_str(&s);
    }
    for k in ["delta", "text", "index"] {
        c.remove(k);
    }
    match (c.remove("token_ids"), &mut into.token_ids) {
        (Some(_), slot) if !ids => *slot = Some(Value::Null),
        (Some(raw), slot) if raw.get().starts_with('[') => {
            if let Some(Value::Array(ids)) = value_of(raw) {
                match slot {
                    Some(Value::Array(have)) => have.extend(ids),
                    _ => *slot = Some(Value::Array(ids)),
                }
            }
        }
        (Some(raw), slot @ None) if is_null(raw) => *slot = Some(Value::Null),
        _ => {}
    }
    for (k, slot) in [
        ("finish_reason", &mut into.finish_reason),
        ("stop_reason", &mut into.stop_reason),
    ] {
        if let Some(v) = c.remove(k).filter(|v| !is_null(v)).and_then(value_of) {
            *slot = v;
        }
    }
    for (k, raw) in c.0 {
        if !into.other.contains_key(k.as_ref())
            && let Some(v) = value_of(raw)
        {
            into.other.insert(k.into_owned(), v);
        }
    }
}

/// One choice of the whole answer, in the engine's non-streamed form.
fn finish(index: u64, mut c: Choice, chat: bool, ids: bool) -> Value {
    if !ids {
        c.token_ids = c.token_ids.map(|_| Value::Null);
        null_ids(&mut c.other);
    }
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

/// Writes the prompt's ids, if there, as `null`.
fn null_ids(m: &mut Map<String, Value>) {
    if let Some(v) = m.get_mut("prompt_token_ids") {
        *v = Value::Null;
    }
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
        let v = parsed(assemble(&sse(&events), false, true).unwrap());
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
        let v = parsed(assemble(&sse(&events), true, true).unwrap());
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
        let v = parsed(assemble(&sse(&events), false, true).unwrap());
        assert_eq!(v["choices"][0]["token_ids"], json!([1, 2, 3]));
        assert_eq!(v["choices"][0]["text"], "xx");
        let unasked = [ev(Value::Null), ev(Value::Null)];
        let v = parsed(assemble(&sse(&unasked), false, true).unwrap());
        assert_eq!(v["choices"][0]["token_ids"], Value::Null);
        assert!(
            v["choices"][0]
                .as_object()
                .unwrap()
                .contains_key("token_ids")
        );
    }

    #[test]
    fn ids_the_client_did_not_ask_for_are_written_null_and_the_rest_is_kept() {
        let first = json!({"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [1],
                           "prompt_token_ids": [7, 8], "logprobs": null}]});
        let next = json!({"id": "c", "choices": [{"index": 0, "text": "b", "token_ids": [2],
                          "prompt_token_ids": null, "finish_reason": "length"}]});
        let v = parsed(assemble(&sse(&[first, next]), false, false).unwrap());
        let c = &v["choices"][0];
        assert_eq!(c["token_ids"], Value::Null, "{v}");
        assert_eq!(c["prompt_token_ids"], Value::Null, "{v}");
        assert_eq!(
            (&c["text"], &c["finish_reason"]),
            (&json!("ab"), &json!("length"))
        );
        let chat = json!({"id": "c", "prompt_token_ids": [7, 8],
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                                       "token_ids": [1]}]});
        let v = parsed(assemble(&sse(std::slice::from_ref(&chat)), true, false).unwrap());
        assert_eq!(v["prompt_token_ids"], Value::Null, "{v}");
        assert_eq!(v["choices"][0]["token_ids"], Value::Null, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], "hi");
        let v = parsed(assemble(&sse(&[chat]), true, true).unwrap());
        assert_eq!(v["prompt_token_ids"], json!([7, 8]), "{v}");
        assert_eq!(v["choices"][0]["token_ids"], json!([1]), "{v}");
    }

    #[test]
    fn a_stream_without_answer_events_or_with_a_foreign_one_is_an_error() {
        assert_eq!(
            assemble(b"data: [DONE]\n\n", false, true),
            Err(AssembleError::Empty)
        );
        assert!(matches!(
            assemble(b"data: not json\n\n", false, true),
            Err(AssembleError::NotAnObject(_))
        ));
    }
}
