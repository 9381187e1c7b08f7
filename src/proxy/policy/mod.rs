//! Routing policies: how one instance of a leg is picked among the usable ones. Prefill
//! and decode each get their own policy object (and so their own state).

mod least_loaded;
mod prefix_aware;
pub mod prefix_hash;
mod random;
mod round_robin;

use super::instances::{Instance, Leg};
use super::recorder::Recorder;
use crate::vocab::PolicyName;
use std::sync::Arc;

pub use least_loaded::LeastLoaded;
pub use prefix_aware::PrefixAware;
pub use random::Random;
pub use round_robin::RoundRobin;

/// What a policy may look at besides the instances: computed once per request.
#[derive(Debug, Default, Clone)]
pub struct RouteFacts {
    /// Chained hashes of the prompt's fixed-size chunks (see [`prefix_hash`]); empty
    /// unless a policy asked for them.
    pub prefix_hashes: Vec<u64>,
}

/// Picks one instance for a leg.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The policy's CLI name, for logs.
    fn name(&self) -> &'static str;

    /// Whether [`RouteFacts::prefix_hashes`] must be computed for this policy.
    fn needs_prefix(&self) -> bool {
        false
    }

    /// Picks one of `candidates`, which is never empty and holds only usable instances.
    fn pick(&self, candidates: &[Arc<Instance>], facts: &RouteFacts) -> Arc<Instance>;
}

/// The policy object for `name` on `leg`.
pub fn build(name: PolicyName, leg: Leg, recorder: Arc<dyn Recorder>) -> Box<dyn Policy> {
    match name {
        PolicyName::RoundRobin => Box::new(RoundRobin::default()),
        PolicyName::Random => Box::new(Random),
        PolicyName::LeastLoaded => Box::new(LeastLoaded::default()),
        PolicyName::PrefixAware => Box::new(PrefixAware::new(leg, recorder)),
    }
}

#[cfg(test)]
pub(crate) fn test_instances(n: usize) -> Vec<Arc<Instance>> {
    use super::instances::parse_endpoint;
    (0..n)
        .map(|i| {
            Arc::new(Instance::new(
                Leg::Decode,
                i,
                parse_endpoint(&format!("127.0.0.1:{}", 9000 + i)).unwrap(),
                None,
            ))
        })
        .collect()
}
