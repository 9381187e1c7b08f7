//! The OpenAI-compatible surface: request parsing and checks, the chat template, answer
//! shapes and vLLM-shaped errors.

pub mod chat_template;
pub mod error;
pub mod fields;
pub mod request;
pub mod response;

pub use error::ApiError;
pub use request::{Endpoint, GenRequest, KvTransferParams, Limits};
