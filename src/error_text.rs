//! Errors turned into one line a person can act on: an error with its causes, and the
//! message inside an HTTP error answer (the proxy, the bench and the simulator all read
//! engines' answers).

/// An error with its causes on one line, e.g. "error sending request: connection refused"
/// (a cause already spelled out by the one before is not repeated).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// The human part of an error answer: OpenAI's `error.message`, vLLM's `message`,
/// FastAPI's `detail`, else the text itself; shortened, never empty.
pub fn answer_message(body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str().map(str::to_string))
        });
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    let short: String = text.chars().take(300).collect();
    if short.is_empty() {
        "(empty body)".into()
    } else {
        short
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_found_in_the_usual_places() {
        assert_eq!(
            answer_message(br#"{"error":{"message":"too long","type":"x"}}"#),
            "too long"
        );
        assert_eq!(
            answer_message(br#"{"object":"error","message":"bad"}"#),
            "bad"
        );
        assert_eq!(answer_message(br#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(
            answer_message(b"Internal Server Error"),
            "Internal Server Error"
        );
        assert_eq!(answer_message(b""), "(empty body)");
    }

    #[test]
    fn causes_are_chained_once_each() {
        #[derive(Debug)]
        struct Outer(std::io::Error, &'static str);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.1)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = || std::io::Error::other("connection refused");
        assert_eq!(
            chain(&Outer(refused(), "error sending request")),
            "error sending request: connection refused"
        );
        // A message that already carries its cause does not get it twice.
        assert_eq!(
            chain(&Outer(refused(), "send failed: connection refused")),
            "send failed: connection refused"
        );
    }
}
