//! Errors in the shape vLLM's OpenAI server gives them:
//! `{"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}`.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

/// An error answer to an API request.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// 400: the request is wrong; `param` names the field at fault.
    pub fn bad_request(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    /// Any status with a message and no field at fault.
    pub fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            s if s.is_server_error() => "InternalServerError",
            _ => "Error",
        }
    }

    /// The JSON body of this error.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}
