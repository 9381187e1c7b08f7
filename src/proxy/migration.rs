//! Streams that go on: when a decode leg breaks off after part of its answer reached the
//! client (its connection reset or closed early, its instance found unreachable or drained
//! past its grace), the answer is continued on another decode, or on the same one once its
//! supervisor has it back. The continuation is a new request through the protocol's own
//! flow (prefill, then decode) whose prompt is the original prompt followed by everything
//! the client was sent, with `max_tokens` and `min_tokens` lowered by as many tokens. The
//! client sees one stream: the same id, model and created, no text repeated or lost, and a
//! final usage counting the original prompt and every token sent.
//!
//! Exact where the engine lets it be: each streamed decode leg asks for vLLM's
//! `return_token_ids` (the prompt's ids in the first chunk, each chunk's own after), so the
//! continuation's prompt is token ids, not re-tokenized text, and a greedy continuation is
//! the answer the dead decode would have given. A chat is continued as a completion of the
//! chat's own rendered prompt ids, its events written back as chat chunks. Where the ids
//! are not there (an engine without `return_token_ids`, a request with stop strings, whose
//! text the engine may hold back while its ids have gone out) the text sent is carried
//! instead: the prompt text plus the answer's text, or for a chat, the answer as a final
//! assistant message to continue (`continue_final_message`); the request's log line says
//! "text".
//!
//! Not continued, with the reason in the error the client gets: n > 1, guided decoding,
//! tools, logprobs, echo, beam search, a batch of prompts, past `--migration-limit` hops or
//! `--migration-max-tokens` tokens carried.

use super::errors::ProxyError;
use super::protocol::Body;
use super::request::ClientRequest;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// Metrics reasons of a migration: what broke the decode leg.
pub const BROKE_CONNECTION: &str = "connection";
/// The decode closed its stream without `[DONE]`.
pub const BROKE_ENDED_EARLY: &str = "ended_early";
/// The decode's instance (or its node) was found unreachable.
pub const BROKE_UNREACHABLE: &str = "unreachable";
/// The decode's instance was drained and its grace ran out.
pub const BROKE_DRAINED: &str = "drained";
/// The decode sent a server error as an event mid-stream (vLLM's engine core died).
pub const BROKE_ENGINE_ERROR: &str = "engine_error";

/// The message of a server error decode sent as an event in place of the answer's next
/// chunk (`{"error": {..., "code": 5xx}}`: vLLM's `EngineDeadError` when its engine core
/// died, or a generation error); `None` for any other event, a client error (4xx) too.
pub fn engine_error(data: &str) -> Option<String> {
    if !data.trim_start().starts_with("{\"error\"") {
        return None;
    }
    let v: Value = serde_json::from_str(data).ok()?;
    let e = v.get("error")?;
    let code = e.get("code").and_then(Value::as_u64).unwrap_or(500);
    (code >= 500).then(|| {
        e.get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message")
            .to_string()
    })
}

/// Why a request's answer cannot be continued on another decode, decided from its body
/// once, when it comes in (`None`: it can be).
pub fn refusal(body: &Body) -> Option<&'static str> {
    let num = |k: &str| body.get(k).and_then(Value::as_i64);
    let on = |k: &str| {
        body.get(k)
            .is_some_and(|v| !v.is_null() && v != &json!(false))
    };
    if num("n").is_some_and(|n| n > 1) || num("best_of").is_some_and(|n| n > 1) {
        return Some("n > 1: several answers share one prompt");
    }
    if let Some(Value::Array(items)) = body.get("prompt")
        && items.first().is_some_and(|i| !i.is_number())
        && items.len() > 1
    {
        return Some("a batch of prompts");
    }
    let format = body.get("response_format");
    let guided = format.is_some_and(|f| !f.is_null() && f.get("type") != Some(&json!("text")))
        || [
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ]
        .iter()
        .any(|k| on(k))
        || on("structured_outputs");
    if guided {
        return Some("guided decoding: the grammar's state cannot be carried");
    }
    let tools = body
        .get("tools")
        .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
        && body.get("tool_choice") != Some(&json!("none"));
    if tools {
        return Some("tools: a tool call's parser state cannot be carried");
    }
    if on("logprobs") || num("top_logprobs").is_some_and(|n| n > 0) || on("prompt_logprobs") {
        return Some("logprobs: the continuation's would not be the same request's");
    }
    if on("echo") {
        return Some("echo");
    }
    if on("use_beam_search") {
        return Some("beam search");
    }
    None
}

/// Where the continuation's events come from, for writing them back in the client's form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The client's own leg: its events pass as they are (less the ids the client did
    /// not ask for).
    Original,
    /// A continuation in the client's own endpoint (completions, or a chat continued
    /// by text): ids and the usage rewritten, a chat's new role chunk dropped.
    Same { carried: u32 },
    /// A chat continued as a completion of its rendered prompt's ids: each event
    /// written back as a chat chunk.
    ChatViaCompletions { carried: u32 },
}

/// What the client has been sent of the answer so far.
#[derive(Debug, Default)]
pub struct Sent {
    id: Option<Value>,
    model: Option<Value>,
    created: Option<Value>,
    /// The prompt's token ids, from the first chunk (`return_token_ids`).
    pub prompt_ids: Option<Vec<u32>>,
    /// The answer's token ids, while every chunk with text carried its own.
    pub ids: Vec<u32>,
    ids_whole: bool,
    pub text: String,
    /// Chunks with text (the token count where no ids came).
    text_chunks: u32,
    /// A finish_reason went out: only the end of the stream is missing.
    pub finished: bool,
    seen_any: bool,
}

impl Sent {
    /// Tokens sent: exact with ids, else one per chunk with text (vLLM sends one token
    /// per chunk unless a stop string holds text back).
    pub fn tokens(&self) -> u32 {
        if self.ids_exact() {
            self.ids.len() as u32
        } else {
            self.text_chunks
        }
    }

    /// Whether the answer so far is known as token ids, and the prompt too.
    pub fn ids_exact(&self) -> bool {
        (self.ids_whole || self.text.is_empty()) && self.prompt_ids.is_some()
    }

    fn note(&mut self, v: &ChunkView, chat: bool, form: Form) {
        if !self.seen_any {
            self.seen_any = true;
            self.ids_whole = true;
            let value =
                |raw: Option<&RawValue>| raw.and_then(|r| serde_json::from_str(r.get()).ok());
            self.id = value(v.id);
            self.model = value(v.model);
            self.created = value(v.created);
        }
        let Some(choice) = v.choices.as_ref().and_then(|c| c.first()) else {
            return;
        };
        if form == Form::Original && self.prompt_ids.is_none() {
            let at = if chat {
                &v.prompt_token_ids
            } else {
                &choice.prompt_token_ids
            };
            self.prompt_ids = at.and_then(ids_of);
        }
        let text = if chat && !matches!(form, Form::ChatViaCompletions { .. }) {
            choice.delta.as_ref().and_then(|d| d.content)
        } else {
            choice.text
        };
        let text = text.and_then(super::whole::text_of).unwrap_or_default();
        let ids = choice.token_ids.and_then(ids_of);
        if !text.is_empty() {
            self.text.push_str(&text);
            self.text_chunks += 1;
            if ids.as_ref().is_none_or(Vec::is_empty) {
                self.ids_whole = false;
            }
        }
        if let Some(ids) = ids {
            self.ids.extend(ids);
        }
        if choice.finish_reason.is_some() {
            self.finished = true;
        }
    }
}

/// The members of a streamed chunk that [`Sent`] notes, borrowed from the event's text:
/// read once per event without building a [`Value`] of it (for each token of every
/// answer that may be continued, which is every answer by default).
#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    created: Option<&'a RawValue>,
    /// A chat chunk's (at the top).
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<Vec<ChoiceView<'a>>>,
}

/// What [`ChunkView`] reads of a choice. Members that may hold anything are left raw, so
/// that an unexpected form is read as nothing, as it was when events were values.
#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delta: Option<DeltaView<'a>>,
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    token_ids: Option<&'a RawValue>,
    /// Present only when not null.
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

/// A chat chunk's delta, as far as [`Sent`] reads it.
#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

fn ids_of(raw: &RawValue) -> Option<Vec<u32>> {
    serde_json::from_str(raw.get()).ok()
}

/// Reads and rewrites the events of a stream that may be continued: every complete event
/// of the current decode leg goes through [`Tracker::event`].
#[derive(Debug)]
pub struct Tracker {
    /// Read through [`Tracker::sent`], which notes the events held back first.
    sent: Sent,
    /// The first leg's events of a whole answer, not noted yet: they are noted only if
    /// the leg breaks off (the answer is put together from them anyway, at its end), which
    /// spares parsing every token twice.
    unnoted: Vec<String>,
    chat: bool,
    /// The client asked for `return_token_ids` itself: the ids stay in its events.
    client_ids: bool,
    /// The client asked for one body: its events are put together by
    /// [`super::whole::assemble`], which writes the ids it did not ask for as `null` once,
    /// so the first leg's events pass as they came.
    whole: bool,
    /// The client asked for the usage chunk.
    client_usage: bool,
    pub form: Form,
    /// Continuations so far.
    pub hops: u32,
}

/// What an event of the current leg becomes for the client.
pub enum Out {
    /// The event's data as it came.
    Same,
    /// Other data.
    Rewritten(String),
    /// Nothing (a continuation's role chunk, or a usage chunk the client did not ask for).
    Dropped,
}

impl Tracker {
    /// A tracker for `req`'s stream.
    pub fn new(req: &ClientRequest) -> Tracker {
        Tracker {
            sent: Sent::default(),
            unnoted: Vec::new(),
            chat: req.path == "/v1/chat/completions",
            client_ids: asked_ids(&req.body),
            whole: !req.stream,
            // A whole answer's body always has its usage.
            client_usage: !req.stream || super::usage_chunk::asks_usage(&req.body),
            form: Form::Original,
            hops: 0,
        }
    }

    /// Notes one event's data and says what the client gets of it; `usage` is set to the
    /// leg's own usage when the event carries one (for judging the leg's KV).
    pub fn event(&mut self, data: &str, usage: &mut Option<Value>) -> Out {
        if data.trim() == crate::sse::DONE {
            return Out::Same;
        }
        if self.form == Form::Original && self.whole {
            self.unnoted.push(data.to_owned());
            return Out::Same;
        }
        self.note_held_back();
        if self.form == Form::Original {
            let Ok(view) = serde_json::from_str::<ChunkView>(data) else {
                return Out::Same;
            };
            self.sent.note(&view, self.chat, self.form);
            if self.client_ids {
                return Out::Same;
            }
            // Cut out of the text as it came, so the rest of the event stays byte for
            // byte the engine's (its keys in the engine's order).
            return match without_ids(data) {
                Some(cut) => Out::Rewritten(cut),
                None => Out::Same,
            };
        }
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(data) else {
            return Out::Same;
        };
        let Ok(view) = serde_json::from_str::<ChunkView>(data) else {
            return Out::Same;
        };
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            *usage = Some(u.clone());
        }
        if self.is_role_chunk(&v) {
            return Out::Dropped;
        }
        self.sent.note(&view, self.chat, self.form);
        let is_usage_chunk = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
            && v.get("usage").is_some_and(|u| !u.is_null());
        if is_usage_chunk && !self.client_usage {
            return Out::Dropped;
        }
        self.rewrite(&mut v);
        Out::Rewritten(Value::Object(v).to_string())
    }

    /// What the client has been sent so far.
    pub fn sent(&mut self) -> &Sent {
        self.note_held_back();
        &self.sent
    }

    fn note_held_back(&mut self) {
        for data in std::mem::take(&mut self.unnoted) {
            if let Ok(view) = serde_json::from_str::<ChunkView>(&data) {
                self.sent.note(&view, self.chat, Form::Original);
            }
        }
    }

    /// A chat continuation's opening chunk (the role, no text): the client had it.
    fn is_role_chunk(&self, v: &Map<String, Value>) -> bool {
        let Some(delta) = v.get("choices").and_then(|c| c.pointer("/0/delta")) else {
            return false;
        };
        delta.get("role").is_some()
            && delta
                .get("content")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
    }

    /// A continuation's event in the client's form: the first leg's id, model and
    /// created, the totals in the usage, a chat chunk for a chat continued as a completion.
    fn rewrite(&self, v: &mut Map<String, Value>) {
        let s = &self.sent;
        for (k, val) in [("id", &s.id), ("model", &s.model), ("created", &s.created)] {
            if let Some(val) = val {
                v.insert(k.into(), val.clone());
            }
        }
        // The client had the prompt's ids (when it asked) in the first leg's first chunk;
        // the continuation's prompt is not the client's.
        null_member(v, "prompt_token_ids");
        if let Some(Value::Array(choices)) = v.get_mut("choices") {
            for c in choices.iter_mut().filter_map(Value::as_object_mut) {
                null_member(c, "prompt_token_ids");
                if matches!(self.form, Form::ChatViaCompletions { .. }) {
                    // A chat chunk's choice has no such member.
                    c.remove("prompt_token_ids");
                    let text = c.remove("text").unwrap_or(json!(""));
                    c.insert("delta".into(), json!({ "content": text }));
                }
            }
        }
        if matches!(self.form, Form::ChatViaCompletions { .. }) {
            v.insert("object".into(), json!("chat.completion.chunk"));
        }
        let carried = match self.form {
            Form::Same { carried } | Form::ChatViaCompletions { carried } => carried,
            Form::Original => 0,
        };
        if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
            total_usage(u, carried, s.prompt_ids.as_ref().map(Vec::len));
        }
        if !self.client_ids {
            strip_ids(v);
        }
    }
}

/// A continuation's usage as the client's whole answer's: the original prompt, every
/// token sent (those carried and the continuation's own).
fn total_usage(u: &mut Map<String, Value>, carried: u32, prompt_len: Option<usize>) {
    let get = |u: &Map<String, Value>, k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let carried = u64::from(carried);
    let prompt = prompt_len
        .map(|n| n as u64)
        .unwrap_or_else(|| get(u, "prompt_tokens").saturating_sub(carried));
    let completion = get(u, "completion_tokens") + carried;
    u.insert("prompt_tokens".into(), json!(prompt));
    u.insert("completion_tokens".into(), json!(completion));
    u.insert("total_tokens".into(), json!(prompt + completion));
    if let Some(d) = u
        .get_mut("prompt_tokens_details")
        .and_then(Value::as_object_mut)
        && let Some(c) = d.get("cached_tokens").and_then(Value::as_u64)
    {
        d.insert("cached_tokens".into(), json!(c.min(prompt)));
    }
}

/// `data` (one event's JSON) with the ids of its `token_ids` and `prompt_token_ids`
/// members (flat arrays of numbers) replaced by `null`, which is how the engine writes
/// them when they were not asked for (vLLM 0.32 sets both fields on every completion
/// chunk); `None` when it has no ids. The rest is left as the engine wrote it.
fn without_ids(data: &str) -> Option<String> {
    let mut out = data.to_string();
    let mut cut_any = false;
    for key in ["\"prompt_token_ids\":", "\"token_ids\":"] {
        let mut from = 0;
        while let Some(at) = find_member(&out[from..], key).map(|i| from + i) {
            let value_from = at + key.len();
            let rest = &out[value_from..];
            let lead = rest.len() - rest.trim_start().len();
            let value = &rest[lead..];
            let value_len = match value.as_bytes().first() {
                Some(b'[') => value.find(']')? + 1,
                Some(b'n') if value.starts_with("null") => 0,
                _ => return None,
            };
            let start = value_from + lead;
            if value_len > 0 {
                out.replace_range(start..start + value_len, "null");
                cut_any = true;
            }
            from = start + 4;
        }
    }
    cut_any.then_some(out)
}

/// Where `key` (a quoted member name with its colon) stands as a member, not inside a
/// string (a quote inside a JSON string is escaped).
fn find_member(text: &str, key: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memmem::find(&text.as_bytes()[from..], key.as_bytes()) {
        let at = from + i;
        if at == 0 || text.as_bytes()[at - 1] != b'\\' {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Sets the token id fields the proxy asked for to `null`, as the engine writes them
/// unasked; whether there were any.
fn strip_ids(v: &mut Map<String, Value>) -> bool {
    let mut any = null_member(v, "prompt_token_ids");
    if let Some(Value::Array(choices)) = v.get_mut("choices") {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            any |= null_member(c, "token_ids");
            any |= null_member(c, "prompt_token_ids");
        }
    }
    any
}

/// Sets member `key` of `v` to `null` if it is there and not null already.
fn null_member(v: &mut Map<String, Value>, key: &str) -> bool {
    match v.get_mut(key) {
        Some(val) if !val.is_null() => {
            *val = Value::Null;
            true
        }
        _ => false,
    }
}

/// Whether the client asked for the token ids itself (`return_token_ids`).
pub fn asked_ids(body: &Body) -> bool {
    body.get("return_token_ids") == Some(&Value::Bool(true))
}

/// Asks decode for the token ids of what it sends (vLLM's `return_token_ids`; an engine
/// that does not know the field ignores it, and the answer is then carried as text).
pub fn ask_ids(body: &mut Body) {
    body.insert("return_token_ids".into(), Value::Bool(true));
}

/// Keys of a chat request that a completion request does not take.
const CHAT_ONLY: [&str; 11] = [
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "max_completion_tokens",
    "reasoning_effort",
];

/// The continuation of `req` after what `sent` holds, as a request of its own, and the
/// form its events come back in. Err: why it cannot be made.
pub fn continuation(
    req: &ClientRequest,
    sent: &Sent,
    hop: u32,
    max_tokens_carried: u32,
) -> Result<(ClientRequest, Form), String> {
    let carried = sent.tokens();
    if carried > max_tokens_carried {
        return Err(format!(
            "it would carry {carried} tokens, more than --migration-max-tokens {max_tokens_carried}"
        ));
    }
    let chat = req.path == "/v1/chat/completions";
    let mut body = req.body.clone();
    lower(&mut body, "max_tokens", carried)?;
    lower(&mut body, "max_completion_tokens", carried)?;
    if let Some(m) = body.get("min_tokens").and_then(Value::as_u64) {
        body.insert(
            "min_tokens".into(),
            json!(m.saturating_sub(u64::from(carried))),
        );
    }
    ask_ids(&mut body);
    let exact = sent.ids_exact() && body.get("stop").is_none_or(no_stop);
    let (path, form) = match (chat, exact) {
        (false, true) | (true, true) => {
            let mut prompt = sent.prompt_ids.clone().unwrap_or_default();
            prompt.extend_from_slice(&sent.ids);
            if chat {
                if let Some(m) = body.remove("max_completion_tokens") {
                    body.insert("max_tokens".into(), m);
                }
                for k in CHAT_ONLY {
                    body.remove(k);
                }
            }
            body.insert("prompt".into(), json!(prompt));
            let form = if chat {
                Form::ChatViaCompletions { carried }
            } else {
                Form::Same { carried }
            };
            ("/v1/completions", form)
        }
        (false, false) => {
            let Some(Value::String(p)) = body.get("prompt") else {
                return Err("the answer came without token ids and the prompt is not text".into());
            };
            let prompt = format!("{p}{}", sent.text);
            body.insert("prompt".into(), json!(prompt));
            ("/v1/completions", Form::Same { carried })
        }
        (true, false) => {
            let Some(Value::Array(msgs)) = body.get_mut("messages") else {
                return Err("a chat request without messages".into());
            };
            msgs.push(json!({"role": "assistant", "content": sent.text}));
            body.insert("continue_final_message".into(), json!(true));
            body.insert("add_generation_prompt".into(), json!(false));
            ("/v1/chat/completions", Form::Same { carried })
        }
    };
    let raw = bytes::Bytes::from(serde_json::to_vec(&body).expect("JSON values serialize"));
    let mut next = req.clone();
    next.path = path;
    next.body = body;
    next.raw = raw;
    next.id = format!("{}-m{hop}", req.id);
    next.designation.decode = None;
    Ok((next, form))
}

fn no_stop(stop: &Value) -> bool {
    match stop {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Lowers a length key by the tokens carried; Err when nothing would be left (the caller
/// then ends the answer itself).
fn lower(body: &mut Body, key: &str, by: u32) -> Result<(), String> {
    if let Some(m) = body.get(key).and_then(Value::as_u64) {
        let left = m.saturating_sub(u64::from(by));
        if left == 0 {
            return Err(format!("{key} {m} were all sent"));
        }
        body.insert(key.into(), json!(left));
    }
    Ok(())
}

/// The error a client gets when its answer broke off and could not be continued.
pub fn not_continued(failed: ProxyError, why: String) -> ProxyError {
    ProxyError::NotContinued {
        failed: Box::new(failed),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Body {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn request(path: &'static str, v: Value) -> ClientRequest {
        let raw = bytes::Bytes::from(v.to_string());
        ClientRequest {
            path,
            body: body(v),
            raw,
            stream: true,
            id: "r".into(),
            designation: Default::default(),
            facts: Default::default(),
            deadline: tokio::time::Instant::now(),
            avoid: Vec::new(),
            migration: crate::proxy::request::Migration::On,
        }
    }

    #[test]
    fn a_server_error_event_breaks_the_leg_and_a_client_error_or_a_token_does_not() {
        let dead = r#"{"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "param": null, "code": 500}}"#;
        assert_eq!(
            engine_error(dead).as_deref(),
            Some("EngineCore encountered an issue.")
        );
        let client = r#"{"error": {"message": "bad", "type": "BadRequestError", "code": 400}}"#;
        assert_eq!(engine_error(client), None);
        assert_eq!(
            engine_error(r#"{"id": "c", "choices": [{"text": "error"}]}"#),
            None
        );
        assert_eq!(engine_error("[DONE]"), None);
    }

    #[test]
    fn what_cannot_be_carried_is_refused_with_its_reason() {
        assert!(
            refusal(&body(json!({"prompt": "a", "n": 2})))
                .unwrap()
                .contains("n > 1")
        );
        let guided = json!({"messages": [], "response_format": {"type": "json_object"}});
        assert!(refusal(&body(guided)).unwrap().contains("guided"));
        assert!(refusal(&body(json!({"prompt": "a", "logprobs": 1}))).is_some());
        assert!(refusal(&body(json!({"prompt": ["a", "b"]}))).is_some());
        assert_eq!(refusal(&body(json!({"prompt": [1, 2, 3]}))), None);
        assert_eq!(
            refusal(&body(json!({"messages": [], "logprobs": false}))),
            None
        );
        let plain = json!({"messages": [], "response_format": {"type": "text"}});
        assert_eq!(refusal(&body(plain)), None);
    }

    #[test]
    fn the_ids_are_nulled_as_the_engine_writes_them_unasked_and_the_rest_stays_as_it_was() {
        let ev = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":" \"token_ids\": x","logprobs":null,"finish_reason":null,"prompt_token_ids":[1,2],"token_ids":[5, 6]}],"model":"m"}"#;
        let want = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":" \"token_ids\": x","logprobs":null,"finish_reason":null,"prompt_token_ids":null,"token_ids":null}],"model":"m"}"#;
        assert_eq!(without_ids(ev).as_deref(), Some(want));
        let first = r#"{"choices":[{"token_ids": [],"index":0}],"prompt_token_ids":null}"#;
        assert_eq!(
            without_ids(first).as_deref(),
            Some(r#"{"choices":[{"token_ids": null,"index":0}],"prompt_token_ids":null}"#)
        );
        let unasked = r#"{"choices":[{"prompt_token_ids":null,"token_ids":null}]}"#;
        assert_eq!(without_ids(unasked), None);
        assert_eq!(without_ids(r#"{"choices":[]}"#), None);
    }

    #[test]
    fn usage_of_a_continuation_counts_the_original_prompt_and_every_token_sent() {
        let mut u = body(
            json!({"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
            "prompt_tokens_details": {"cached_tokens": 28}}),
        );
        total_usage(&mut u, 20, Some(10));
        assert_eq!(u["prompt_tokens"], 10);
        assert_eq!(u["completion_tokens"], 25);
        assert_eq!(u["total_tokens"], 35);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 10);
    }

    #[test]
    fn the_original_legs_ids_are_noted_and_taken_out_when_the_client_did_not_ask() {
        let req = request("/v1/completions", json!({"prompt": "a b", "stream": true}));
        let mut t = Tracker::new(&req);
        let mut usage = None;
        let first = r#"{"id":"cmpl-1","created":7,"model":"m","choices":[{"index":0,"text":" x","token_ids":[5],"prompt_token_ids":[1,2]}]}"#;
        let Out::Rewritten(out) = t.event(first, &mut usage) else {
            panic!("ids not taken out")
        };
        assert!(
            out.contains(r#""token_ids":null,"prompt_token_ids":null"#),
            "{out}"
        );
        assert_eq!(t.sent().prompt_ids, Some(vec![1, 2]));
        assert_eq!(t.sent().ids, vec![5]);
        assert_eq!(t.sent().tokens(), 1);
        let (next, form) = continuation(&req, t.sent(), 1, 100).unwrap();
        assert_eq!(next.body["prompt"], json!([1, 2, 5]));
        assert_eq!(form, Form::Same { carried: 1 });
    }

    #[test]
    fn a_chat_is_continued_as_a_completion_of_its_ids_and_written_back_as_chat() {
        let req = request(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_completion_tokens": 10}),
        );
        let mut t = Tracker::new(&req);
        let mut usage = None;
        let role = r#"{"id":"chatcmpl-1","created":7,"model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let tok = r#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" x"},"token_ids":[9]}]}"#;
        t.event(role, &mut usage);
        t.event(tok, &mut usage);
        let (next, form) = continuation(&req, t.sent(), 1, 100).unwrap();
        assert_eq!(next.path, "/v1/completions");
        assert_eq!(next.body["prompt"], json!([1, 2, 9]));
        assert_eq!(next.body["max_tokens"], 9);
        assert!(next.body.get("messages").is_none());
        t.form = form;
        let cont = r#"{"id":"cmpl-9","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":" y","prompt_token_ids":null,"token_ids":[4],"finish_reason":"length"}]}"#;
        let Out::Rewritten(out) = t.event(cont, &mut usage) else {
            panic!()
        };
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["id"], "chatcmpl-1");
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"][0]["delta"]["content"], " y");
        assert_eq!(v["choices"][0]["token_ids"], Value::Null, "{v}");
        assert!(v["choices"][0].get("prompt_token_ids").is_none(), "{v}");
        assert_eq!(t.sent().text, " x y");
    }

    #[test]
    fn without_ids_the_text_is_carried() {
        let req = request(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
        );
        let mut t = Tracker::new(&req);
        let mut usage = None;
        t.event(
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"Hello"}}]}"#,
            &mut usage,
        );
        let (next, form) = continuation(&req, t.sent(), 1, 100).unwrap();
        assert_eq!(next.path, "/v1/chat/completions");
        assert_eq!(
            next.body["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(next.body["continue_final_message"], true);
        assert_eq!(form, Form::Same { carried: 1 });
    }
}
