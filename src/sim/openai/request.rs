//! Request bodies of `/v1/completions` and `/v1/chat/completions`, parsed and checked
//! into one [`GenRequest`], with errors that name the field at fault.

use super::chat_template;
use super::error::ApiError;
use super::fields::{LaxInteger, LaxNumber, parse_prompt, parse_stop};
use crate::sim::tokenizer;
use serde::Deserialize;
use serde_json::Value;

/// Which endpoint a request came in on (shapes the answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// The KV handoff instructions a proxy puts into a request (vLLM's `kv_transfer_params`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: Option<bool>,
    #[serde(default)]
    pub do_remote_prefill: Option<bool>,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_block_ids: Option<Value>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default)]
    pub remote_request_id: Option<String>,
    #[serde(default)]
    pub transfer_id: Option<String>,
    #[serde(default)]
    pub remote_bootstrap_addr: Option<String>,
}

impl KvTransferParams {
    /// This request is the prefill leg: keep the KV for a decode.
    pub fn remote_decode(&self) -> bool {
        self.do_remote_decode == Some(true)
    }
    /// This request is the decode leg: take the KV from a prefill.
    pub fn remote_prefill(&self) -> bool {
        self.do_remote_prefill == Some(true)
    }
}

/// A checked generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    /// The token ids of each prompt (a completions request may carry a batch).
    pub prompts: Vec<Vec<u32>>,
    /// Output cap per sequence; None means "up to the context length".
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub n: u32,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `return_token_ids`: the answer carries the prompt's and the output's token
    /// ids (in a stream: the prompt's in the first chunk, each chunk's own after).
    pub return_token_ids: bool,
    pub kv: Option<KvTransferParams>,
}

/// Limits the checks need from the engine's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_model_len: u32,
    pub max_n: u32,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The fields the simulator reads; any other field is accepted and ignored, as vLLM does.
#[derive(Deserialize)]
struct RawRequest {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Value>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    min_tokens: Option<i64>,
    n: Option<i64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    ignore_eos: Option<bool>,
    return_token_ids: Option<bool>,
    include_stop_str_in_output: Option<bool>,
    add_generation_prompt: Option<bool>,
    kv_transfer_params: Option<Value>,
    #[allow(dead_code)]
    user: Option<String>,
    /// Sampling fields the simulator does not use, checked as vLLM checks them so a client
    /// bug that vLLM answers with a 400 does not pass the simulator.
    temperature: Option<LaxNumber>,
    top_p: Option<LaxNumber>,
    top_k: Option<LaxInteger>,
    min_p: Option<LaxNumber>,
    #[allow(dead_code)] // its type is the check
    seed: Option<LaxInteger>,
    presence_penalty: Option<LaxNumber>,
    frequency_penalty: Option<LaxNumber>,
    repetition_penalty: Option<LaxNumber>,
}

/// Parses and checks a request body.
pub fn parse(endpoint: Endpoint, body: &[u8], limits: Limits) -> Result<GenRequest, ApiError> {
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::bad_request(
            None,
            "the body is not a valid JSON object: it must be {\"prompt\": ...} or {\"messages\": ...}",
        ));
    }
    // The fast parser first; only a failure pays for the one that names the field.
    let mut raw: RawRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(_) => return Err(explain(body)),
    };
    check_sampling(&raw)?;
    let prompts = prompts_of(endpoint, &mut raw)?;
    let lengths = Lengths::of(endpoint, &raw)?;
    let n = match raw.n {
        None => 1,
        Some(v) if v < 1 || v > i64::from(limits.max_n) => {
            return Err(ApiError::bad_request(
                Some("n"),
                format!(
                    "n must be between 1 and {} (--max-num-seqs), got {v}",
                    limits.max_n
                ),
            ));
        }
        Some(v) => v as u32,
    };
    let stream = raw.stream.unwrap_or(false);
    if raw.stream_options.is_some() && !stream {
        return Err(ApiError::bad_request(
            Some("stream_options"),
            "stream_options is only allowed together with \"stream\": true",
        ));
    }
    let kv = kv_params(raw.kv_transfer_params.take(), prompts.len())?;
    check_context(
        &prompts,
        lengths.max_tokens,
        limits.max_model_len,
        lengths.max_field,
    )?;
    Ok(GenRequest {
        endpoint,
        model: raw.model,
        prompts,
        max_tokens: lengths.max_tokens,
        min_tokens: lengths.min_tokens,
        n,
        stop: parse_stop(raw.stop)?,
        include_stop_str_in_output: raw.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: raw.ignore_eos.unwrap_or(false),
        return_token_ids: raw.return_token_ids.unwrap_or(false),
        stream,
        include_usage: raw
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        kv,
    })
}

/// The token ids of the request's prompts: `prompt` (one or a batch) for completions, the
/// rendered `messages` for chat.
fn prompts_of(endpoint: Endpoint, raw: &mut RawRequest) -> Result<Vec<Vec<u32>>, ApiError> {
    match endpoint {
        Endpoint::Completions => parse_prompt(raw.prompt.take()),
        Endpoint::Chat => {
            let messages = raw.messages.take().ok_or_else(|| {
                ApiError::bad_request(
                    Some("messages"),
                    "messages is required: an array of {\"role\", \"content\"} objects",
                )
            })?;
            let text = chat_template::render(&messages, raw.add_generation_prompt.unwrap_or(true))?;
            Ok(vec![tokenizer::encode(&text)])
        }
    }
}

/// A request's output lengths, checked against each other.
struct Lengths {
    /// The field that caps the output (`max_completion_tokens` for chat when given), as
    /// errors name it.
    max_field: &'static str,
    max_tokens: Option<u32>,
    min_tokens: u32,
}

impl Lengths {
    fn of(endpoint: Endpoint, raw: &RawRequest) -> Result<Lengths, ApiError> {
        let max_field = match endpoint {
            Endpoint::Chat if raw.max_completion_tokens.is_some() => "max_completion_tokens",
            _ => "max_tokens",
        };
        let max_value = match endpoint {
            Endpoint::Chat => raw.max_completion_tokens.or(raw.max_tokens),
            Endpoint::Completions => raw.max_tokens,
        };
        let max_tokens = match max_value {
            None => None,
            Some(v) if v < 1 => {
                return Err(ApiError::bad_request(
                    Some(max_field),
                    format!("{max_field} must be at least 1, got {v}"),
                ));
            }
            Some(v) => Some(u32::try_from(v).unwrap_or(u32::MAX)),
        };
        let min_tokens = match raw.min_tokens {
            None => 0,
            Some(v) if v < 0 => {
                return Err(ApiError::bad_request(
                    Some("min_tokens"),
                    format!("min_tokens must be 0 or more, got {v}"),
                ));
            }
            Some(v) => u32::try_from(v).unwrap_or(u32::MAX),
        };
        if let Some(max) = max_tokens
            && min_tokens > max
        {
            return Err(ApiError::bad_request(
                Some("min_tokens"),
                format!("min_tokens ({min_tokens}) must not exceed {max_field} ({max})"),
            ));
        }
        Ok(Lengths {
            max_field,
            max_tokens,
            min_tokens,
        })
    }
}

/// The request's `kv_transfer_params` (null is none); a handoff carries one prompt.
fn kv_params(raw: Option<Value>, prompts: usize) -> Result<Option<KvTransferParams>, ApiError> {
    let kv = match raw {
        None | Some(Value::Null) => None,
        Some(v) => Some(serde_json::from_value::<KvTransferParams>(v).map_err(|e| {
            ApiError::bad_request(
                Some("kv_transfer_params"),
                format!("kv_transfer_params: {e}"),
            )
        })?),
    };
    if kv.is_some() && prompts > 1 {
        return Err(ApiError::bad_request(
            Some("kv_transfer_params"),
            "kv_transfer_params needs a single prompt, not a batch",
        ));
    }
    Ok(kv)
}

/// The ranges vLLM's SamplingParams enforce for the fields the simulator ignores.
fn check_sampling(raw: &RawRequest) -> Result<(), ApiError> {
    let out_of_range = |field: &str, rule: &str, v: f64| {
        Err(ApiError::bad_request(
            Some(field),
            format!("{field} must be {rule}, got {v}"),
        ))
    };
    if let Some(LaxNumber(t)) = raw.temperature
        && (t.is_nan() || t < 0.0)
    {
        return out_of_range("temperature", "non-negative", t);
    }
    if let Some(LaxNumber(p)) = raw.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return out_of_range("top_p", "in (0, 1]", p);
    }
    if let Some(LaxNumber(p)) = raw.min_p
        && !(0.0..=1.0).contains(&p)
    {
        return out_of_range("min_p", "in [0, 1]", p);
    }
    if let Some(LaxInteger(k)) = raw.top_k
        && k < -1
    {
        return out_of_range("top_k", "-1 (disable), 0 or at least 1", k as f64);
    }
    for (field, v) in [
        ("presence_penalty", raw.presence_penalty),
        ("frequency_penalty", raw.frequency_penalty),
    ] {
        if let Some(LaxNumber(x)) = v
            && !(-2.0..=2.0).contains(&x)
        {
            return out_of_range(field, "in [-2, 2]", x);
        }
    }
    if let Some(LaxNumber(r)) = raw.repetition_penalty
        && (r.is_nan() || r <= 0.0)
    {
        return out_of_range("repetition_penalty", "greater than 0", r);
    }
    Ok(())
}

/// The 400 for a body the fast parser refused, naming the field at fault.
fn explain(body: &[u8]) -> ApiError {
    let de = &mut serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, RawRequest>(de) {
        Ok(_) => ApiError::bad_request(None, "the body could not be read as a request"),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() || path == "." {
                ApiError::bad_request(
                    None,
                    format!("the body is not a valid JSON object: {inner}"),
                )
            } else {
                ApiError::bad_request(Some(&path), format!("{path}: {inner}"))
            }
        }
    }
}

fn check_context(
    prompts: &[Vec<u32>],
    max_tokens: Option<u32>,
    max_model_len: u32,
    max_field: &str,
) -> Result<(), ApiError> {
    for (i, p) in prompts.iter().enumerate() {
        let len = p.len() as u64;
        let which = if prompts.len() > 1 {
            format!("prompt {i}")
        } else {
            "the prompt".to_string()
        };
        match max_tokens {
            Some(m) if len + u64::from(m) > u64::from(max_model_len) => {
                return Err(ApiError::bad_request(
                    Some(max_field),
                    format!(
                        "{which} has {len} tokens and {max_field} is {m}: {} tokens exceed the context length of {max_model_len} (--max-model-len); shorten the prompt or lower {max_field}",
                        len + u64::from(m)
                    ),
                ));
            }
            None if len >= u64::from(max_model_len) => {
                return Err(ApiError::bad_request(
                    Some("prompt"),
                    format!(
                        "{which} has {len} tokens, leaving no room in the context length of {max_model_len} (--max-model-len); shorten the prompt"
                    ),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_model_len: 100,
        max_n: 8,
    };

    fn completions(body: &str) -> Result<GenRequest, ApiError> {
        parse(Endpoint::Completions, body.as_bytes(), L)
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(
            completions(r#"{"prompt":"San Francisco is a"}"#)
                .unwrap()
                .prompts[0]
                .len(),
            4
        );
        assert_eq!(
            completions(r#"{"prompt":[1,2,3]}"#).unwrap().prompts,
            vec![vec![1, 2, 3]]
        );
        assert_eq!(
            completions(r#"{"prompt":["a b","c"]}"#)
                .unwrap()
                .prompts
                .len(),
            2
        );
        assert_eq!(
            completions(r#"{"prompt":[[1],[2,3]]}"#).unwrap().prompts[1],
            vec![2, 3]
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = completions(r#"{"prompt":"x","max_tokens":"ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = completions(r#"{"max_tokens":3}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = completions(r#"{"prompt":"x","max_tokens":0}"#).unwrap_err();
        assert!(e.message.contains("at least 1"));
        let e = completions(r#"{"prompt":[1,-2]}"#).unwrap_err();
        assert!(e.message.contains("prompt[1]"), "{}", e.message);
        let e = completions("{\"prompt\": ").unwrap_err();
        assert!(e.message.contains("not a valid JSON"), "{}", e.message);
        let e = completions(r#"{"prompt":"x","stop":[1]}"#).unwrap_err();
        assert!(e.message.contains("stop[0]"));
        let e = completions(r#"{"prompt":"x","n":9}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e =
            completions(r#"{"prompt":"x","stream_options":{"include_usage":true}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        let e = completions(r#"{"prompt":"","max_tokens":1}"#).unwrap_err();
        assert!(e.message.contains("empty"));
    }

    #[test]
    fn context_length_is_enforced() {
        let e = completions(r#"{"prompt":"a b c d","max_tokens":97}"#).unwrap_err();
        assert!(
            e.message
                .contains("101 tokens exceed the context length of 100"),
            "{}",
            e.message
        );
        assert!(completions(r#"{"prompt":"a b c d","max_tokens":96}"#).is_ok());
        let long: Vec<u32> = (0..100).collect();
        let body = serde_json::json!({ "prompt": long }).to_string();
        assert!(completions(&body).unwrap_err().message.contains("no room"));
    }

    #[test]
    fn chat_prefers_max_completion_tokens() {
        let r = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"max_completion_tokens":7}"#,
            L,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(7));
        let e = parse(Endpoint::Chat, br#"{"prompt":"hi"}"#, L).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn kv_transfer_params_are_read() {
        let r = completions(r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true,"remote_engine_id":null}}"#).unwrap();
        assert!(r.kv.unwrap().remote_decode());
        let e = completions(r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":"yes"}}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params"));
    }
}
