//! Silent recomputes: a decode that was due a prompt's KV from its prefill but computed the
//! prompt itself. The answer is right, only its time to first token was not disaggregated,
//! so nothing fails and nobody notices unless it is counted. Two ways to see one, both from
//! what vLLM itself reports, never from anything only the simulator has:
//!
//! - per request ([`judgment`]), decode's `usage.prompt_tokens_details.cached_tokens`
//!   (vLLM with `--enable-prompt-tokens-details`, which the plan gives decode instances):
//!   vLLM counts the prompt tokens it did not compute, from its prefix cache and from its
//!   KV connector alike, so a handed-off prompt shows all but what the connector leaves to
//!   compute (the plan's allowance, [`HandoffSettings`]). Far fewer means decode computed
//!   them. Every streamed leg asks decode for its usage chunk, which the client gets only
//!   if it asked (`usage_chunk.rs`), so every single-prompt leg is judged this way, under
//!   any load. Not when the decode request carries
//!   `kv_transfer_params.remote_prefill_cached_tokens` (NixlConnector, vLLM 0.32+): vLLM
//!   then reports the prefill's own cache hits there instead, which say nothing of the
//!   handoff.
//! - per window between two scrapes ([`windows`]), decode's own counters ([`counters`]):
//!   for the legs no answer judged. What a window cannot attribute is counted as unchecked,
//!   and how many requests its excess tokens make is an estimate, kept apart from the
//!   counted misses.
//!
//! Each leg is counted by one of them only: one the proxy judges by its own answer is taken
//! out of the window's growth (its computed tokens explained) before the window is judged.
//! The [`ledger`] on each decode instance is where the two meet.
//!
//! Its files sit in three of the proxy's layers (proxy/mod.rs, `# Layout`): [`ledger`] and
//! [`counters`] with the instances that carry them, [`judgment`] on the request path (it
//! counts through the recorder, not the metrics), [`windows`] and this file with the
//! figures. The request path names `recompute::judgment::...`, never what is re-exported
//! here.

pub mod counters;
pub mod judgment;
pub mod ledger;
mod windows;

pub use counters::{BY_SOURCE, DecodeCounters, PREFILLS, SOURCES, block_size};
pub use judgment::HandoffSettings;
pub use ledger::LedgerSnapshot;
pub use windows::{DecodeWatch, MAX_MERGED, Unjudged};
