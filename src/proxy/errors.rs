//! Every way a client request can fail, as OpenAI-style JSON errors that name the leg and
//! the instance involved, so a failed prefill is never swallowed or turned into an empty 200.

use super::leg::Leg;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;
use std::time::Duration;

/// What went wrong with one leg on one instance.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LegFailure {
    /// Refused, or no route there: nothing listens at that address (its process is gone,
    /// or its machine cannot be reached).
    #[error("could not connect: {0}")]
    Connect(String),
    /// No connection in time: the engine (or its machine) is busy or cut off, which says
    /// nothing of whether its process lives.
    #[error("could not connect in time: {0}")]
    ConnectTimeout(String),
    /// `raise` names the setting that bounds the wait (empty where none applies).
    #[error("no answer within {limit:?}{raise}")]
    Timeout {
        limit: Duration,
        raise: &'static str,
    },
    #[error("answered {status}: {message}")]
    Status {
        status: u16,
        message: String,
        /// The engine's own body and content type, passed through unchanged for 4xx.
        body: Bytes,
        content_type: Option<HeaderValue>,
    },
    #[error("the answer broke off: {0}")]
    Body(String),
    #[error("answered something the proxy cannot use: {0}")]
    BadAnswer(String),
    #[error("its mooncake bootstrap server {url} failed: {reason}")]
    Bootstrap { url: String, reason: String },
    /// Decode could not load the KV the prefill handed over and, under
    /// kv_load_failure_policy "fail", failed the request (vLLM says only `message`).
    #[error(
        "could not load the KV cache the prefill leg handed over (KV load failed), so it failed the request under kv_load_failure_policy = \"fail\" (it answered {status}: {message}); retry the request, look at the KV transfer between the two instances, or set connector.kv_load_failure_policy = \"recompute\" to have decode compute the prompt itself"
    )]
    KvLoad { status: u16, message: String },
    /// The instance was found unreachable while the leg waited on it (its node cut off):
    /// the leg ends in seconds rather than at its timeout.
    #[error("is unreachable ({0}): the leg was ended without waiting for its timeout")]
    Unreachable(String),
}

/// Why an engine refused a request at admission (vLLM's 503 for `--max-num-queued-reqs` /
/// `--max-num-queued-tokens`), as its `vllm:admission_rejections_total{reason}` says it;
/// None for any other answer. vLLM 0.33's messages (vllm/exceptions.py).
pub fn admission_reason(status: u16, message: &str) -> Option<&'static str> {
    if status != 503 {
        return None;
    }
    if message.contains("cannot accept new requests") {
        Some("max_num_queued_reqs")
    } else if message.contains("prefill token backlog limit") {
        Some("max_num_queued_tokens")
    } else {
        None
    }
}

/// Where to raise the prefill leg's limit.
pub const RAISE_PREFILL: &str =
    " (raise --prefill-timeout-s, or proxy.prefill_timeout_s in the topology)";
/// Where to raise the limit on decode's first byte.
pub const RAISE_FIRST_BYTE: &str =
    " (raise --first-byte-timeout-s, or proxy.first_byte_timeout_s in the topology)";
/// Where to raise the limit on a whole request.
pub const RAISE_TOTAL: &str =
    " (raise --total-timeout-s, or proxy.total_timeout_s in the topology)";

impl LegFailure {
    /// What a failed TCP connect says: a timeout (the kernel's or `--connect-timeout-ms`)
    /// is [`LegFailure::ConnectTimeout`], anything else [`LegFailure::Connect`].
    pub fn of_connect(e: &std::io::Error) -> LegFailure {
        if e.kind() == std::io::ErrorKind::TimedOut {
            LegFailure::ConnectTimeout(format!("{e} (--connect-timeout-ms)"))
        } else {
            LegFailure::Connect(e.to_string())
        }
    }

    /// Connect errors, 502/503 and an instance found unreachable are worth trying on
    /// another instance.
    pub fn is_retryable(&self) -> bool {
        match self {
            LegFailure::Connect(_)
            | LegFailure::ConnectTimeout(_)
            | LegFailure::Bootstrap { .. }
            | LegFailure::Unreachable(_) => true,
            LegFailure::Status { status, .. } => matches!(status, 502 | 503),
            _ => false,
        }
    }

    /// Why a request whose leg failed this way, before any byte reached its client, is
    /// worth redoing once on another pair: the KV load failed (vLLM's lazy NIXL handshake
    /// timing out does this), the connection was refused or reset, the instance was cut
    /// off, or a handshake (Mooncake's bootstrap) failed. None for the rest: an engine's
    /// error answer, a timeout (the client has waited already), a 4xx.
    pub fn redo_reason(&self) -> Option<&'static str> {
        match self {
            LegFailure::KvLoad { .. } => Some("kv_load_failed"),
            LegFailure::Connect(_) | LegFailure::ConnectTimeout(_) => Some("connect"),
            LegFailure::Body(_) => Some("reset"),
            LegFailure::Unreachable(_) => Some("unreachable"),
            LegFailure::Bootstrap { .. } => Some("handshake"),
            LegFailure::Status {
                status: 502 | 503, ..
            } => self.admission().is_none().then_some("unavailable"),
            _ => None,
        }
    }

    /// Whether this says something about the instance's health: a client's own 4xx never
    /// does, nor an engine's admission 503 (it is full, not dead), nor a failed KV load
    /// (the transfer failed, not the decode).
    pub fn blames_instance(&self) -> bool {
        match self {
            LegFailure::Status { status, .. } if *status < 500 => false,
            LegFailure::KvLoad { .. } => false,
            _ => self.admission().is_none(),
        }
    }

    /// The admission reason of an engine's 503 (see [`admission_reason`]).
    pub fn admission(&self) -> Option<&'static str> {
        match self {
            LegFailure::Status {
                status, message, ..
            } => admission_reason(*status, message),
            _ => None,
        }
    }
}

/// A leg that failed, with where.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{leg} leg failed: {instance} {failure}")]
pub struct LegError {
    pub leg: Leg,
    pub instance: String,
    pub failure: LegFailure,
}

/// Everything the proxy answers with an error status.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
    #[error("missing or wrong API key: send the header `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error(
        "no route {method} {path}: this proxy serves POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
    )]
    NotFound { method: String, path: String },
    #[error("the request body is larger than the limit of {limit} bytes (--max-body-bytes)")]
    PayloadTooLarge { limit: usize },
    #[error("{message}")]
    RateLimited { message: String, retry_after_s: u64 },
    #[error(
        "no usable {leg} instance: {detail}; GET /health?ready says when one is back, and the proxy's log says why each left"
    )]
    NoInstance { leg: Leg, detail: String },
    #[error(
        "the proxy is shutting down (pdctl down, restart or a drain): this request was not served; retry once it is back or on another proxy"
    )]
    ShuttingDown,
    #[error(
        "the proxy is shutting down: this stream was cut before the answer was complete; retry once it is back or on another proxy"
    )]
    CutByShutdown,
    #[error("{0}")]
    Leg(Box<LegError>),
    #[error("the request took longer than the total limit of {0:?} (--total-timeout-s)")]
    TotalTimeout(Duration),
    /// A stream whose decode broke off and that could not be continued on another decode.
    #[error(
        "{failed}; the answer was not continued on another decode: {why}; send the request again (its answer so far is incomplete)"
    )]
    NotContinued {
        failed: Box<ProxyError>,
        why: String,
    },
}

impl From<LegError> for ProxyError {
    fn from(e: LegError) -> Self {
        ProxyError::Leg(Box::new(e))
    }
}

impl ProxyError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::NoInstance { .. }
            | ProxyError::ShuttingDown
            | ProxyError::CutByShutdown => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::TotalTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::NotContinued { failed, .. } => failed.status(),
            ProxyError::Leg(e) => match &e.failure {
                LegFailure::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                LegFailure::Status { status, .. } if *status < 500 || *status == 503 => {
                    StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
                }
                _ => StatusCode::BAD_GATEWAY,
            },
        }
    }

    /// The OpenAI error `type` field.
    fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest { .. } | ProxyError::PayloadTooLarge { .. } => {
                "invalid_request_error"
            }
            ProxyError::Unauthorized => "authentication_error",
            ProxyError::NotFound { .. } => "not_found_error",
            ProxyError::RateLimited { .. } => "rate_limit_error",
            ProxyError::NoInstance { .. }
            | ProxyError::ShuttingDown
            | ProxyError::CutByShutdown => "service_unavailable",
            ProxyError::TotalTimeout(_) => "timeout_error",
            ProxyError::NotContinued { failed, .. } => failed.kind(),
            ProxyError::Leg(e) => match e.failure {
                LegFailure::Timeout { .. } => "timeout_error",
                LegFailure::KvLoad { .. } => "kv_load_error",
                _ if e.failure.admission().is_some() => "engine_overloaded",
                _ => "upstream_error",
            },
        }
    }

    /// The JSON object (`{"error": {...}}`) describing this error, also used for SSE error events.
    pub fn to_json(&self) -> serde_json::Value {
        let mut error = json!({
            "message": self.to_string(),
            "type": self.kind(),
            "param": match self { ProxyError::BadRequest { param, .. } => *param, _ => None },
            "code": self.status().as_u16(),
        });
        match self {
            ProxyError::Leg(e) => {
                error["leg"] = json!(e.leg.as_str());
                error["instance"] = json!(e.instance);
                if let Some(reason) = e.failure.admission() {
                    error["reason"] = json!(reason);
                }
                if matches!(e.failure, LegFailure::KvLoad { .. }) {
                    error["kv_load_failure_policy"] = json!("fail");
                }
            }
            ProxyError::NoInstance { leg, .. } => error["leg"] = json!(leg.as_str()),
            ProxyError::NotContinued { failed, why } => {
                let inner = failed.to_json();
                for k in ["leg", "instance"] {
                    if let Some(v) = inner["error"].get(k) {
                        error[k] = v.clone();
                    }
                }
                error["not_migrated"] = json!(why);
            }
            _ => {}
        }
        json!({ "error": error })
    }
}

/// `retry-after` seconds on a 503 for "no usable instance".
pub const NO_INSTANCE_RETRY_AFTER_S: u64 = 5;

/// On an engine's own error passed through: which leg answered it.
pub const LEG_HEADER: &str = "x-pdctl-leg";
/// On an engine's own error passed through: which instance answered it.
pub const INSTANCE_HEADER: &str = "x-pdctl-instance";

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        // An engine's own 4xx goes to the client exactly as the engine wrote it, with
        // headers saying which leg and instance wrote it (a 400 to the prefill copy is about
        // a request the client never sent as such).
        if let ProxyError::Leg(e) = &self
            && let LegFailure::Status {
                status,
                body,
                content_type,
                ..
            } = &e.failure
            && *status < 500
            && !body.is_empty()
        {
            let mut r = Response::new(axum::body::Body::from(body.clone()));
            *r.status_mut() = self.status();
            let h = r.headers_mut();
            if let Some(ct) = content_type {
                h.insert(header::CONTENT_TYPE, ct.clone());
            }
            h.insert(LEG_HEADER, HeaderValue::from_static(e.leg.as_str()));
            if let Ok(v) = HeaderValue::from_str(&e.instance) {
                h.insert(INSTANCE_HEADER, v);
            }
            return r;
        }
        let mut r = (self.status(), axum::Json(self.to_json())).into_response();
        let retry_after = match &self {
            ProxyError::RateLimited { retry_after_s, .. } => Some(*retry_after_s),
            // An engine full at admission: vLLM's own advice is to come back later.
            ProxyError::Leg(e) if e.failure.admission().is_some() => Some(1),
            // An instance may be back soon (a restart, a start-up): ask clients to come back.
            ProxyError::NoInstance { .. } | ProxyError::ShuttingDown => {
                Some(NO_INSTANCE_RETRY_AFTER_S)
            }
            _ => None,
        };
        if let Some(s) = retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(failure: LegFailure) -> ProxyError {
        LegError {
            leg: Leg::Prefill,
            instance: "http://10.0.0.1:8100".into(),
            failure,
        }
        .into()
    }

    fn status(code: u16) -> LegFailure {
        LegFailure::Status {
            status: code,
            message: "x".into(),
            body: Bytes::new(),
            content_type: None,
        }
    }

    #[test]
    fn upstream_statuses_map_to_what_a_client_can_act_on() {
        assert_eq!(leg(status(400)).status(), 400);
        assert_eq!(leg(status(503)).status(), 503);
        assert_eq!(leg(status(500)).status(), 502);
        assert_eq!(leg(LegFailure::Connect("refused".into())).status(), 502);
        assert_eq!(
            leg(LegFailure::Timeout {
                limit: Duration::from_secs(1),
                raise: "",
            })
            .status(),
            504
        );
    }

    #[test]
    fn the_error_body_names_leg_and_instance() {
        let j = leg(status(500)).to_json();
        assert_eq!(j["error"]["leg"], "prefill");
        assert_eq!(j["error"]["instance"], "http://10.0.0.1:8100");
        assert_eq!(j["error"]["code"], 502);
        let msg = j["error"]["message"].as_str().unwrap();
        assert!(msg.contains("prefill") && msg.contains("http://10.0.0.1:8100"));
    }

    #[test]
    fn an_admission_503_keeps_its_reason_and_does_not_blame_the_engine() {
        let busy = LegFailure::Status {
            status: 503,
            message: "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.".into(),
            body: Bytes::new(),
            content_type: None,
        };
        assert!(busy.is_retryable() && !busy.blames_instance());
        let e = leg(busy);
        assert_eq!(e.status(), 503);
        let j = e.to_json();
        assert_eq!(j["error"]["reason"], "max_num_queued_reqs");
        assert_eq!(j["error"]["type"], "engine_overloaded");
        assert!(j["error"]["message"].as_str().unwrap().contains("busy"));
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            admission_reason(
                503,
                "The engine has reached its prefill token backlog limit."
            ),
            Some("max_num_queued_tokens")
        );
        // Any other 503 (an engine shutting down) still counts against the instance.
        assert!(status(503).blames_instance());
    }

    #[test]
    fn a_failed_kv_load_names_decode_the_instance_and_the_kv_load() {
        let e: ProxyError = LegError {
            leg: Leg::Decode,
            instance: "http://10.0.0.2:8200".into(),
            failure: LegFailure::KvLoad {
                status: 500,
                message: "Internal server error".into(),
            },
        }
        .into();
        let j = e.to_json();
        assert_eq!(j["error"]["leg"], "decode");
        assert_eq!(j["error"]["instance"], "http://10.0.0.2:8200");
        assert_eq!(j["error"]["type"], "kv_load_error");
        let msg = j["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("decode leg") && msg.contains("KV load"),
            "{msg}"
        );
        assert_eq!(e.status(), 502);
    }

    #[test]
    fn only_connect_errors_and_502_503_are_retried_and_4xx_never_blames() {
        assert!(LegFailure::Connect("x".into()).is_retryable());
        assert!(status(502).is_retryable() && status(503).is_retryable());
        assert!(!status(500).is_retryable() && !status(400).is_retryable());
        assert!(!status(400).blames_instance() && !status(429).blames_instance());
        assert!(status(500).blames_instance());
    }
}
