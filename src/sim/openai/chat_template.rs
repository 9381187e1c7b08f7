//! The fixed chat template that turns `messages` into prompt text:
//!
//! ```text
//! <|ROLE|>\nCONTENT\n      (for each message, in order)
//! <|assistant|>\n          (unless add_generation_prompt is false)
//! ```
//!
//! Conversations that share their first messages therefore share a prompt prefix and
//! so prefix-cache blocks, as with a real model's template.

use super::error::ApiError;
use super::fields::kind;
use serde_json::Value;

/// The prompt text for `messages` (a JSON array of `{role, content}` objects).
pub fn render(messages: &Value, add_generation_prompt: bool) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::bad_request(Some("messages"), m);
    let list = match messages {
        Value::Array(l) if !l.is_empty() => l,
        Value::Array(_) => return Err(bad("messages must not be empty".into())),
        other => {
            return Err(bad(format!(
                "messages must be a list of {{\"role\", \"content\"}} objects, got {}",
                kind(other)
            )));
        }
    };
    let mut text = String::with_capacity(64);
    for (i, m) in list.iter().enumerate() {
        let obj = m
            .as_object()
            .ok_or_else(|| bad(format!("messages[{i}] must be an object, got {}", kind(m))))?;
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(other) => {
                return Err(bad(format!(
                    "messages[{i}].role must be a string, got {}",
                    kind(other)
                )));
            }
            None => {
                return Err(bad(format!(
                    "messages[{i}] has no role (system, user, assistant or tool)"
                )));
            }
        };
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content[{j}]: the simulator takes only {{\"type\": \"text\", \"text\": ...}} parts"
                            )));
                        }
                    }
                }
            }
            Some(other) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of text parts, got {}",
                    kind(other)
                )));
            }
        }
        text.push('\n');
    }
    if add_generation_prompt {
        text.push_str("<|assistant|>\n");
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_roles_in_order() {
        let m = json!([{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}]);
        assert_eq!(
            render(&m, true).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
        );
        assert_eq!(
            render(&m, false).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi\n"
        );
    }

    #[test]
    fn shared_first_messages_share_a_prefix() {
        let a = render(&json!([{"role":"user","content":"one"}]), true).unwrap();
        let b = render(&json!([{"role":"user","content":"one"},{"role":"assistant","content":"x"},{"role":"user","content":"two"}]), true).unwrap();
        assert!(b.starts_with(a.trim_end_matches("<|assistant|>\n")));
    }

    #[test]
    fn bad_messages_are_explained() {
        assert!(
            render(&json!([]), true)
                .unwrap_err()
                .message
                .contains("empty")
        );
        assert!(
            render(&json!([{"content":"x"}]), true)
                .unwrap_err()
                .message
                .contains("no role")
        );
        assert!(
            render(&json!([{"role":"user","content":5}]), true)
                .unwrap_err()
                .message
                .contains("messages[0].content")
        );
        assert!(
            render(
                &json!([{"role":"user","content":[{"type":"image_url"}]}]),
                true
            )
            .unwrap_err()
            .message
            .contains("text")
        );
        assert!(
            render(&json!("hi"), true)
                .unwrap_err()
                .message
                .contains("list")
        );
    }
}
