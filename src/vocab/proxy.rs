//! How the proxy splits a request and picks instances, as names. Lives in `vocab` because
//! the connectors choose the protocol, a topology names the policies, the planner writes
//! both into the proxy's settings and the proxy acts on them.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// How one client request is split over a prefill and a decode instance. Chosen by the
/// connector (see `connectors`), never by the user directly in a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyProtocol {
    /// Prefill copy with max_tokens=1, wait, then the original to decode.
    TwoStep,
    /// kv_transfer_params handshake (NixlConnector): prefill's returned params go to decode.
    Nixl,
    /// Mooncake V1: a shared transfer_id, decode told the prefill's bootstrap address.
    Mooncake,
    /// NixlPushConnector: both legs at once, decode told where the prefill is (learned from
    /// that prefill's first answer), prefill writes the KV into decode's blocks.
    NixlPush,
}

impl ProxyProtocol {
    /// Whether the connector makes its handshake between a prefill and a decode lazily, on
    /// the pair's first request (vLLM's NIXL connectors, over their ZMQ side channel): the
    /// proxy then warms each pair's KV path with one small request before routing uses it,
    /// and the planner gives the proxy the time that takes to be ready.
    pub fn lazy_handshake(self) -> bool {
        matches!(self, ProxyProtocol::Nixl | ProxyProtocol::NixlPush)
    }
}

/// How long, at most, the proxy's `/health?warmed` waits for the prefill/decode pairs
/// usable at its start to have their KV path warmed (a failed warm-up is retried
/// meanwhile): three warm-ups of the proxy's 60 s. A NIXL handshake on a busy machine can
/// time out once and work the next time; `up` ending before that made a user's first
/// request wait for the warm-up and fail. Past it the proxy says ready all the same.
pub const WARMED_WITHIN_S: u64 = 180;

/// How an instance is picked for one leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    RoundRobin,
    Random,
    LeastLoaded,
    PrefixAware,
}

/// An admission limit of the proxy that cannot work, as a topology's `[proxy]` table or
/// `pdctl proxy`'s flags and config file may give it: [`check_admission`] is the one place
/// these rules are written, and each reader names the settings its own way.
#[derive(Debug, Clone, PartialEq)]
pub enum AdmissionError {
    /// `rate_limit` below zero, or not a number.
    NegativeRate(f64),
    /// A wait queue (`queue_size`, the value) with no concurrency limit to wait for.
    QueueWithoutLimit(usize),
}

impl AdmissionError {
    /// The setting at fault, as the config file and the topology's `[proxy]` table spell
    /// it (`queue_size`).
    pub fn setting(&self) -> &'static str {
        match self {
            AdmissionError::NegativeRate(_) => "rate_limit",
            AdmissionError::QueueWithoutLimit(_) => "queue_size",
        }
    }

    /// What is wrong with [`Self::setting`] (which the reader names before it, as its
    /// errors name a key or a flag), other settings named by `name` (`proxy.max_concurrent`,
    /// `--max-concurrent`).
    pub fn message(&self, name: impl Fn(&str) -> String) -> String {
        match self {
            AdmissionError::NegativeRate(v) => {
                format!("{v} must be >= 0 requests per second (0 = unlimited)")
            }
            AdmissionError::QueueWithoutLimit(n) => format!(
                "a wait queue of {n} needs {} > 0: without a concurrency limit nothing waits",
                name("max_concurrent")
            ),
        }
    }
}

/// Checks the proxy's admission limits: a token bucket of `rate_limit` requests per second
/// (0 = unlimited), `max_concurrent` requests in flight (0 = unlimited) and a queue of
/// `queue_size` waiting for a slot.
pub fn check_admission(
    rate_limit: f64,
    max_concurrent: usize,
    queue_size: usize,
) -> Result<(), AdmissionError> {
    if !(rate_limit.is_finite() && rate_limit >= 0.0) {
        return Err(AdmissionError::NegativeRate(rate_limit));
    }
    if queue_size > 0 && max_concurrent == 0 {
        return Err(AdmissionError::QueueWithoutLimit(queue_size));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_limits_that_cannot_work_are_named() {
        assert_eq!(check_admission(0.0, 0, 0), Ok(()));
        assert_eq!(check_admission(2.5, 4, 16), Ok(()));
        let e = check_admission(1.0, 0, 5).unwrap_err();
        assert_eq!(e, AdmissionError::QueueWithoutLimit(5));
        assert_eq!(e.setting(), "queue_size");
        assert_eq!(
            e.message(|k| format!("--{}", k.replace('_', "-"))),
            "a wait queue of 5 needs --max-concurrent > 0: without a concurrency limit nothing waits"
        );
        assert!(matches!(
            check_admission(f64::NAN, 1, 0),
            Err(AdmissionError::NegativeRate(_))
        ));
        assert_eq!(
            check_admission(-1.0, 0, 0)
                .unwrap_err()
                .message(|k| format!("proxy.{k}")),
            "-1 must be >= 0 requests per second (0 = unlimited)"
        );
    }
}
