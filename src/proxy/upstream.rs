//! The HTTP client the proxy talks to engines with: one connection pool for every
//! instance, the engines' API key on every call, and failures classified into
//! [`LegFailure`]s so the caller can tell connect errors, timeouts and statuses apart.

use super::errors::LegFailure;
use axum::http::{HeaderValue, header};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use std::time::Duration;
use tokio::time::Instant;

/// Largest engine answer body the proxy reads into memory (non-streamed answers, error
/// bodies, prefill answers). Streams are relayed without this limit.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// A pooled HTTP client for the engines.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: reqwest::Client,
    engine_key: Option<HeaderValue>,
}

impl Upstream {
    /// A client with the given connect timeout that sends `engine_key` as a bearer token.
    pub fn new(connect_timeout: Duration, engine_key: Option<&str>) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(60))
            .no_proxy()
            .build()?;
        let engine_key = engine_key
            .map(|k| HeaderValue::from_str(&format!("Bearer {k}")))
            .transpose()
            .map_err(|_| {
                anyhow::anyhow!(
                    "the engine API key contains characters not allowed in an HTTP header"
                )
            })?;
        Ok(Upstream { client, engine_key })
    }

    /// POSTs a JSON body with `X-Request-Id`; returns the response once its headers are in
    /// (any status), or why there is none.
    pub async fn post_json(
        &self,
        url: &str,
        body: Bytes,
        request_id: &str,
    ) -> Result<reqwest::Response, LegFailure> {
        let mut req = self
            .client
            .post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id)
            .body(body);
        if let Some(k) = &self.engine_key {
            req = req.header(header::AUTHORIZATION, k.clone());
        }
        req.send().await.map_err(|e| classify(&e))
    }

    /// GETs `url` (health probes, /v1/models, /metrics, mooncake /query) within `timeout`
    /// and returns status and body.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<(u16, Bytes), LegFailure> {
        let mut req = self.client.get(url).timeout(timeout);
        if let Some(k) = &self.engine_key {
            req = req.header(header::AUTHORIZATION, k.clone());
        }
        let work = async {
            let resp = req.send().await.map_err(|e| classify(&e))?;
            let status = resp.status().as_u16();
            let body = read_body(resp, MAX_ANSWER_BYTES).await?;
            Ok((status, body))
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(LegFailure::Timeout(timeout)),
        }
    }
}

/// Maps a client error to what the proxy reports and counts.
pub fn classify(e: &reqwest::Error) -> LegFailure {
    if e.is_connect() {
        // The innermost cause says "Connection refused" etc.; the outer ones only "error sending request".
        let mut cause: &dyn std::error::Error = e;
        while let Some(next) = cause.source() {
            cause = next;
        }
        LegFailure::Connect(cause.to_string())
    } else if e.is_timeout() {
        LegFailure::Timeout(Duration::ZERO)
    } else {
        LegFailure::Body(e.to_string())
    }
}

/// Reads a whole body, refusing more than `limit` bytes.
pub async fn read_body(resp: reqwest::Response, limit: usize) -> Result<Bytes, LegFailure> {
    let mut stream = resp.bytes_stream();
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| LegFailure::Body(e.to_string()))?;
        if buf.len() + chunk.len() > limit {
            return Err(LegFailure::BadAnswer(format!(
                "an answer larger than {limit} bytes"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// Turns a non-2xx response into a [`LegFailure::Status`] that keeps the engine's body
/// (for passing 4xx through) and a short message (for the proxy's own error).
pub async fn status_failure(resp: reqwest::Response, deadline: Instant) -> LegFailure {
    let status = resp.status().as_u16();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let body = tokio::time::timeout_at(deadline, read_body(resp, 1024 * 1024))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    LegFailure::Status {
        status,
        message: error_message(&body),
        body,
        content_type,
    }
}

/// The human part of an engine's error body: `error.message`, `message`, or the text.
fn error_message(body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str().map(str::to_string))
        });
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    let mut short: String = text.chars().take(300).collect();
    if short.is_empty() {
        short = "(empty body)".into();
    }
    short
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_error_messages_are_found_in_the_usual_places() {
        assert_eq!(
            error_message(br#"{"error":{"message":"too long"}}"#),
            "too long"
        );
        assert_eq!(
            error_message(br#"{"object":"error","message":"bad"}"#),
            "bad"
        );
        assert_eq!(
            error_message(b"Internal Server Error"),
            "Internal Server Error"
        );
        assert_eq!(error_message(b""), "(empty body)");
    }
}
