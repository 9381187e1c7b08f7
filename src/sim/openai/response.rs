//! Answer bodies in the shapes vLLM's OpenAI server gives them, for both endpoints,
//! whole and as stream chunks. Borrowed strings: nothing is copied to serialise.

use serde::Serialize;
use serde_json::Value;

/// Token counts of one request; `prompt_tokens_details.cached_tokens` is every prompt
/// token not computed here: prefix cache hits and KV that arrived by a handoff, as vLLM
/// counts them.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    pub completion_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Details of the prompt's tokens.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u64,
}

impl Usage {
    /// Usage from prompt, completion and cached token counts.
    pub fn new(prompt: u64, completion: u64, cached: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            total_tokens: prompt + completion,
            completion_tokens: completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// A token id member as vLLM 0.32 writes it: left out (`None`) where its server leaves the
/// field unset, `null` (`Some(None)`) where it sets the field without `return_token_ids`,
/// the ids where they were asked for. A proxy that drops the member, or leaves `null` out,
/// changes the engine's form; the sim writes it the same way so tests see that.
pub type Ids<'a> = Option<Option<&'a [u32]>>;

/// The member of a field vLLM sets on every such event: the ids when `asked`, else null.
pub fn ids_if(asked: bool, ids: &[u32]) -> Ids<'_> {
    Some(asked.then_some(ids))
}

/// One choice of a whole `/v1/completions` answer, its members in vLLM's order.
#[derive(Debug, Serialize)]
pub struct CompletionChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<&'a str>,
    /// `return_token_ids`: the output tokens' ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Ids<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Option<()>>,
    /// `return_token_ids`: the prompt's ids, on the choice as vLLM puts them for completions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Ids<'a>,
}

/// One choice of a `/v1/completions` stream chunk, its members in vLLM's order (not the
/// whole answer's).
#[derive(Debug, Serialize)]
pub struct CompletionChunkChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<&'a str>,
    /// `return_token_ids`: the prompt's ids (a stream's first chunk only, null after).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Ids<'a>,
    /// `return_token_ids`: the chunk's own output tokens' ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Ids<'a>,
}

/// The assistant's message in a chat answer.
#[derive(Debug, Serialize)]
pub struct ChatMessage<'a> {
    pub role: &'static str,
    pub content: &'a str,
    pub reasoning_content: Option<()>,
    pub tool_calls: [(); 0],
}

/// One choice of a whole chat answer.
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    pub message: ChatMessage<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<&'a str>,
    /// `return_token_ids`: the output tokens' ids (in a stream chunk, the chunk's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Ids<'a>,
}

/// The change a chat stream chunk brings to one choice.
#[derive(Debug, Serialize)]
pub struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// One choice of a chat stream chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice<'a> {
    pub index: u32,
    pub delta: ChatDelta<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<&'a str>,
    /// `return_token_ids`: the output tokens' ids (in a stream chunk, the chunk's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Ids<'a>,
}

/// A whole answer or a stream chunk: the envelope shared by both endpoints.
#[derive(Debug, Serialize)]
pub struct Envelope<'a, C: Serialize> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    /// Absent (None), null (Some(None)) or the counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    /// `return_token_ids` on a chat answer: the rendered prompt's ids (a stream's first
    /// chunk only), beside the choices as vLLM puts them for chat.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Ids<'a>,
    /// The KV handoff a prefill offers its decode (nixl), absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Value>,
}
