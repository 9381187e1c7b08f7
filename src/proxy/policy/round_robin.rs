//! Round robin: each usable instance in turn, as the usual hand-written Python proxies do.

use super::{Policy, RouteFacts};
use crate::proxy::instances::Instance;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Cycles through the candidates.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&self, candidates: &[Arc<Instance>], _facts: &RouteFacts) -> Arc<Instance> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        candidates[n % candidates.len()].clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::policy::test_instances;

    #[test]
    fn visits_every_instance_in_turn() {
        let c = test_instances(3);
        let p = RoundRobin::default();
        let picks: Vec<usize> = (0..6)
            .map(|_| p.pick(&c, &RouteFacts::default()).index)
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
