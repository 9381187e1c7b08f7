//! Readers for the request fields that take several shapes (`prompt`, `stop`), with
//! errors that say which element is wrong and what was expected.

use super::error::ApiError;
use crate::sim::tokenizer;
use serde_json::Value;

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
pub fn parse_prompt(v: Option<Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: String| ApiError::bad_request(Some("prompt"), m);
    let prompts = match v {
        None | Some(Value::Null) => {
            return Err(bad(
                "prompt is required: a string, a list of strings, or a list of token ids".into(),
            ));
        }
        Some(Value::String(s)) => vec![tokenizer::encode(&s)],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(bad("prompt must not be an empty list".into()));
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![token_ids(&items, "prompt")?]
        }
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(tokenizer::encode(s)),
                Value::Array(ids) => token_ids(ids, &format!("prompt[{i}]")),
                other => Err(bad(format!(
                    "prompt[{i}] must be a string or a list of token ids, got {}",
                    kind(other)
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(bad(format!(
                "prompt must be a string or a list, got {}",
                kind(&other)
            )));
        }
    };
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        let which = if prompts.len() > 1 {
            format!("prompt[{i}]")
        } else {
            "prompt".into()
        };
        return Err(bad(format!("{which} is empty: give at least one token")));
    }
    Ok(prompts)
}

fn token_ids(items: &[Value], what: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&t| t < u64::from(tokenizer::VOCAB_SIZE))
                .map(|t| t as u32)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        Some("prompt"),
                        format!(
                            "{what}[{i}] must be a token id in 0..{}, got {v}",
                            tokenizer::VOCAB_SIZE
                        ),
                    )
                })
        })
        .collect()
}

/// `stop`: a string or a list of strings (empty strings are ignored).
pub fn parse_stop(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s),
                other => Err(ApiError::bad_request(
                    Some("stop"),
                    format!("stop[{i}] must be a string, got {}", kind(&other)),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::bad_request(
                Some("stop"),
                format!(
                    "stop must be a string or a list of strings, got {}",
                    kind(&other)
                ),
            ));
        }
    };
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

/// A JSON value's kind, for error messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A number as vLLM's request models take it (pydantic's lax mode): a JSON number, or a
/// string that reads as one (`"0.7"`); anything else (`"hot"`, `true`) is a 400.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaxNumber(pub f64);

impl<'de> serde::Deserialize<'de> for LaxNumber {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Number(n) => Ok(LaxNumber(n.as_f64().unwrap_or(f64::NAN))),
            Value::String(s) => s.trim().parse::<f64>().map(LaxNumber).map_err(|_| {
                serde::de::Error::custom(format!("input should be a valid number, got \"{s}\""))
            }),
            other => Err(serde::de::Error::custom(format!(
                "input should be a valid number, got {other}"
            ))),
        }
    }
}

/// An integer as vLLM's request models take it: a JSON integer, a float with no fraction,
/// or a string that reads as one (`"42"`); anything else is a 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaxInteger(pub i64);

impl<'de> serde::Deserialize<'de> for LaxInteger {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let n = match &v {
            Value::Number(n) => n
                .as_i64()
                .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64)),
            Value::String(s) => s.trim().parse::<i64>().ok(),
            _ => None,
        };
        n.map(LaxInteger).ok_or_else(|| {
            serde::de::Error::custom(format!("input should be a valid integer, got {v}"))
        })
    }
}
