//! Reading vLLM's own counters from a decode's `/metrics` page: prompt tokens by where
//! their KV came from, prompts prefilled, and the KV block size. Nothing here knows of
//! legs or windows; [`super::windows`] judges what these say.

use crate::prometheus::{label_value, samples, sum};

/// vLLM's counter of prompt tokens by where their KV came from.
pub const BY_SOURCE: &str = "vllm:prompt_tokens_by_source_total";
/// The `source` label values of [`BY_SOURCE`], in [`PromptSources::as_array`] order.
pub const SOURCES: [&str; 3] = ["local_compute", "local_cache_hit", "external_kv_transfer"];
/// vLLM's info gauge whose `block_size` label is the engine's KV block size.
const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// One observation per prompt the engine prefilled, made in the same stats update that
/// adds the prompt to [`BY_SOURCE`]: how many prompts a window's token growth came from.
pub const PREFILLS: &str = "vllm:time_to_first_token_seconds_count";

/// Prompt tokens of one decode by where their KV came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptSources {
    /// Tokens the engine computed itself.
    pub local_compute: u64,
    /// Tokens found in its own prefix cache.
    pub local_cache_hit: u64,
    /// Tokens whose KV arrived through its KV connector (the handoff).
    pub external_kv_transfer: u64,
}

impl PromptSources {
    /// The counters on a `/metrics` page, summed over engines and models; `None` when the
    /// page has no [`BY_SOURCE`] (not vLLM, or a vLLM older than 0.26).
    pub fn read(text: &str) -> Option<PromptSources> {
        let mut sums = [0f64; 3];
        let mut found = false;
        for s in samples(text).filter(|s| s.name == BY_SOURCE) {
            found = true;
            let source = label_value(s.labels, "source");
            if let Some(i) = SOURCES.iter().position(|x| Some(*x) == source.as_deref()) {
                sums[i] += s.value.max(0.0);
            }
        }
        let [c, h, e] = sums.map(|v| v.round() as u64);
        found.then_some(PromptSources {
            local_compute: c,
            local_cache_hit: h,
            external_kv_transfer: e,
        })
    }

    /// The three counts in [`SOURCES`] order.
    pub fn as_array(self) -> [u64; 3] {
        [
            self.local_compute,
            self.local_cache_hit,
            self.external_kv_transfer,
        ]
    }

    /// All prompt tokens.
    pub fn total(self) -> u64 {
        self.as_array().iter().sum()
    }

    /// The growth since `before`; `None` when a counter went down (the engine restarted).
    pub fn since(self, before: PromptSources) -> Option<PromptSources> {
        Some(PromptSources {
            local_compute: self.local_compute.checked_sub(before.local_compute)?,
            local_cache_hit: self.local_cache_hit.checked_sub(before.local_cache_hit)?,
            external_kv_transfer: self
                .external_kv_transfer
                .checked_sub(before.external_kv_transfer)?,
        })
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: PromptSources) {
        self.local_compute += other.local_compute;
        self.local_cache_hit += other.local_cache_hit;
        self.external_kv_transfer += other.external_kv_transfer;
    }
}

/// The KV block size a vLLM page states in `vllm:cache_config_info{block_size="..."}`.
pub fn block_size(text: &str) -> Option<u32> {
    samples(text)
        .filter(|s| s.name == CACHE_CONFIG_INFO)
        .find_map(|s| label_value(s.labels, "block_size")?.parse().ok())
        .filter(|b| *b > 0)
}

/// What one read of a decode's `/metrics` gives the window check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeCounters {
    /// Prompt tokens by source ([`BY_SOURCE`]).
    pub sources: PromptSources,
    /// Prompts prefilled ([`PREFILLS`], summed over engines); `None` when the page lacks it.
    pub prefills: Option<u64>,
}

impl DecodeCounters {
    /// The counters on a `/metrics` page; `None` without [`BY_SOURCE`].
    pub fn read(text: &str) -> Option<DecodeCounters> {
        Some(DecodeCounters {
            sources: PromptSources::read(text)?,
            prefills: sum(text, &[PREFILLS]).map(|v| v.max(0.0).round() as u64),
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A vLLM page with one engine's prompt tokens by source.
    pub fn page(compute: u64, hit: u64, external: u64) -> String {
        let mut s = String::from(
            "# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n\
             # TYPE vllm:prompt_tokens_by_source counter\n",
        );
        for (source, n) in SOURCES.iter().zip([compute, hit, external]) {
            s.push_str(&format!(
                "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"{source}\"}} {n}.0\n"
            ));
        }
        s
    }

    #[test]
    fn vllm_counters_are_read_by_source_and_summed_over_engines() {
        let mut text = page(10, 20, 30);
        text.push_str(
            "vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"local_compute\"} 5\n\
             vllm:prompt_tokens_by_source_created{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 1.7e9\n\
             vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
             vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 7.0\n\
             vllm:time_to_first_token_seconds_count{engine=\"1\",model_name=\"m\"} 2.0\n",
        );
        let c = DecodeCounters::read(&text).unwrap();
        assert_eq!(
            c.sources,
            PromptSources {
                local_compute: 15,
                local_cache_hit: 20,
                external_kv_transfer: 30
            }
        );
        assert_eq!(c.prefills, Some(9));
        assert_eq!(block_size(&text), Some(32));
        assert_eq!(DecodeCounters::read(&page(1, 0, 0)).unwrap().prefills, None);
        assert_eq!(DecodeCounters::read("vllm:prompt_tokens_total 5\n"), None);
        assert_eq!(block_size("vllm:prompt_tokens_total 5\n"), None);
    }

    #[test]
    fn growth_is_none_when_a_counter_went_down() {
        let a = PromptSources::read(&page(10, 20, 30)).unwrap();
        let b = PromptSources::read(&page(15, 20, 94)).unwrap();
        assert_eq!(
            b.since(a),
            Some(PromptSources {
                local_compute: 5,
                local_cache_hit: 0,
                external_kv_transfer: 64
            })
        );
        assert_eq!(a.since(b), None);
        assert_eq!(b.total(), 129);
    }
}
