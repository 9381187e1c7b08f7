//! Which prefill/decode differences a connector can carry KV across, per vLLM version.
//!
//! A prefill and a decode that do not match start fine and fail on the first request, or
//! answer with wrong KV (vLLM issues 50765, 42895). pdctl plans both sides from one file,
//! so `pdctl plan` refuses a pair its connector cannot serve before anything starts. Each
//! connector file says what it maps ([`super::Connector::pairing`]); what no connector
//! maps (the model, its revision, dtypes, the context length) is refused for all of them.
//! Where each rule was read in vLLM's source: docs/connectors.md ("Prefill/decode pairs").

use crate::vocab::Role;

/// How a connector maps the tensor-parallel sizes of the two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpRule {
    /// Only the same size on both sides (rank i hands its KV to rank i).
    Equal,
    /// A decode size that is a multiple of the prefill's (each prefill rank's heads are
    /// read by that many decode ranks).
    DecodeMultiple,
    /// Any two sizes of which one divides the other.
    EitherDivides,
}

impl TpRule {
    /// Whether a prefill of `p` ranks and a decode of `d` ranks can be paired.
    pub fn allows(self, p: u32, d: u32) -> bool {
        let (p, d) = (p.max(1), d.max(1));
        match self {
            TpRule::Equal => p == d,
            TpRule::DecodeMultiple => d % p == 0,
            TpRule::EitherDivides => d % p == 0 || p % d == 0,
        }
    }

    /// What the connector maps, for messages.
    pub fn says(self) -> &'static str {
        match self {
            TpRule::Equal => "only the same tensor-parallel size on both sides",
            TpRule::DecodeMultiple => {
                "a decode tensor-parallel size that is a multiple of the prefill's"
            }
            TpRule::EitherDivides => "tensor-parallel sizes of which one divides the other",
        }
    }
}

/// What a connector takes of pipeline parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PpRule {
    /// No pipeline parallelism on either side.
    OnlyOne,
    /// The same pipeline-parallel size on both sides.
    Equal,
    /// Any on the prefill, none on the decode.
    DecodeOne,
}

impl PpRule {
    /// Whether pipeline-parallel sizes `p` (prefill) and `d` (decode) can be paired.
    pub fn allows(self, p: u32, d: u32) -> bool {
        match self {
            PpRule::OnlyOne => p <= 1 && d <= 1,
            PpRule::Equal => p.max(1) == d.max(1),
            PpRule::DecodeOne => d <= 1,
        }
    }

    /// What the connector takes, for messages.
    pub fn says(self) -> &'static str {
        match self {
            PpRule::OnlyOne => "no pipeline parallelism (pipeline-parallel size 1 on both sides)",
            PpRule::Equal => "the same pipeline-parallel size on both sides",
            PpRule::DecodeOne => "pipeline parallelism on the prefill only (decode size 1)",
        }
    }
}

/// How a connector maps the KV block sizes (tokens per block) of the two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRule {
    /// The same block size on both sides.
    Equal,
    /// A decode block size that is a multiple of the prefill's (decode reads and splits).
    DecodeMultiple,
    /// A prefill block size that is a multiple of the decode's (prefill writes and splits).
    PrefillMultiple,
}

impl BlockRule {
    /// Whether KV block sizes `p` (prefill) and `d` (decode) can be paired.
    pub fn allows(self, p: u32, d: u32) -> bool {
        let (p, d) = (p.max(1), d.max(1));
        match self {
            BlockRule::Equal => p == d,
            BlockRule::DecodeMultiple => d % p == 0,
            BlockRule::PrefillMultiple => p % d == 0,
        }
    }

    /// What the connector maps, for messages.
    pub fn says(self) -> &'static str {
        match self {
            BlockRule::Equal => "only the same KV block size on both sides",
            BlockRule::DecodeMultiple => {
                "a decode KV block size that is a multiple of the prefill's"
            }
            BlockRule::PrefillMultiple => {
                "a prefill KV block size that is a multiple of the decode's"
            }
        }
    }
}

/// What one connector, on one vLLM version, can carry KV across.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pairing {
    /// The vLLM class the rules are for (`NixlConnector`), for messages.
    pub class: &'static str,
    pub tp: TpRule,
    pub pp: PpRule,
    pub block: BlockRule,
    /// The side whose tensor-parallel size, where it is the larger one, may not exceed the
    /// model's KV heads (vLLM asserts it does not replicate them): NIXL's remote side.
    pub larger_within_kv_heads: Option<Role>,
}

impl Pairing {
    /// Everything the same, no pipeline parallelism: what a connector maps when its code
    /// pairs rank i with rank i and copies blocks one to one.
    pub fn same(class: &'static str) -> Pairing {
        Pairing {
            class,
            tp: TpRule::Equal,
            pp: PpRule::OnlyOne,
            block: BlockRule::Equal,
            larger_within_kv_heads: None,
        }
    }
}

/// The sizes from 1 to `max` a decode may take beside a prefill of `p` (or, with
/// `for_prefill`, a prefill beside a decode of `p`), for "what would work" hints.
pub fn sizes_that_work(rule: TpRule, p: u32, max: u32, for_prefill: bool) -> Vec<u32> {
    (1..=max)
        .filter(|&x| {
            if for_prefill {
                rule.allows(x, p)
            } else {
                rule.allows(p, x)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_rules_pair_what_the_connectors_map() {
        assert!(TpRule::Equal.allows(2, 2) && !TpRule::Equal.allows(1, 2));
        assert!(TpRule::DecodeMultiple.allows(1, 2) && TpRule::DecodeMultiple.allows(2, 4));
        assert!(!TpRule::DecodeMultiple.allows(4, 2) && !TpRule::DecodeMultiple.allows(2, 3));
        assert!(TpRule::EitherDivides.allows(4, 2) && TpRule::EitherDivides.allows(2, 8));
        assert!(!TpRule::EitherDivides.allows(2, 3) && !TpRule::EitherDivides.allows(4, 6));
        assert_eq!(
            sizes_that_work(TpRule::DecodeMultiple, 2, 8, false),
            [2, 4, 6, 8]
        );
        assert_eq!(
            sizes_that_work(TpRule::EitherDivides, 4, 8, false),
            [1, 2, 4, 8]
        );
        assert_eq!(
            sizes_that_work(TpRule::DecodeMultiple, 4, 8, true),
            [1, 2, 4]
        );
    }

    #[test]
    fn block_and_pipeline_rules_say_which_side_may_differ() {
        assert!(
            BlockRule::DecodeMultiple.allows(16, 32) && !BlockRule::DecodeMultiple.allows(32, 16)
        );
        assert!(
            BlockRule::PrefillMultiple.allows(32, 16) && !BlockRule::PrefillMultiple.allows(16, 32)
        );
        assert!(!BlockRule::Equal.allows(16, 32));
        assert!(PpRule::DecodeOne.allows(2, 1) && !PpRule::DecodeOne.allows(1, 2));
        assert!(PpRule::Equal.allows(2, 2) && !PpRule::Equal.allows(2, 1));
        assert!(!PpRule::OnlyOne.allows(2, 2) && PpRule::OnlyOne.allows(1, 1));
    }
}
