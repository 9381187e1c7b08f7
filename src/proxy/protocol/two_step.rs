//! Two-step: the protocol of the V0 connectors and Shared/ExampleConnector. Prefill gets
//! a one-token copy and is waited for (it writes the KV where decode will find it), then
//! decode gets the original request unchanged.

use super::{Body, DecodeBody, Flow, Handshake, Protocol, prefill_copy};
use crate::proxy::instances::Instance;
use serde_json::Value;

/// The two-step protocol.
#[derive(Debug, Clone, Copy)]
pub struct TwoStep;

impl Protocol for TwoStep {
    fn name(&self) -> &'static str {
        "two-step"
    }

    fn flow(&self) -> Flow {
        Flow::Sequential
    }

    fn handles_multiple_choices(&self) -> bool {
        // The KV is stored by prompt, so every decode choice finds it.
        true
    }

    fn prefill_body(&self, original: &Body, _request_id: &str, _h: &Handshake) -> Body {
        prefill_copy(original)
    }

    fn decode_body(
        &self,
        _original: &Body,
        _request_id: &str,
        _prefill: &Instance,
        _h: &Handshake,
        _answer: Option<&Value>,
    ) -> DecodeBody {
        DecodeBody {
            body: None,
            handoff_miss: None,
        }
    }
}
