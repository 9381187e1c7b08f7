//! Least loaded: the instance with the fewest requests in flight (counted until the
//! response stream ends), optionally raised to what the engine itself reports.

use super::{Policy, RouteFacts};
use crate::proxy::instances::Instance;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Picks the lowest [`Instance::load`]; ties rotate so idle instances share the work.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    rotation: AtomicUsize,
}

impl LeastLoaded {
    /// The least loaded of `candidates`, ties broken by a rotating start.
    pub fn least(&self, candidates: &[Arc<Instance>]) -> Arc<Instance> {
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let n = candidates.len();
        (0..n)
            .map(|k| &candidates[(start + k) % n])
            .min_by_key(|i| i.load())
            .expect("candidates are never empty")
            .clone()
    }
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn pick(&self, candidates: &[Arc<Instance>], _facts: &RouteFacts) -> Arc<Instance> {
        self.least(candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::policy::test_instances;

    #[test]
    fn avoids_busy_instances_and_shares_among_idle_ones() {
        let c = test_instances(3);
        let _busy = c[0].begin();
        let p = LeastLoaded::default();
        let picks: Vec<usize> = (0..4)
            .map(|_| p.pick(&c, &RouteFacts::default()).index)
            .collect();
        assert!(!picks.contains(&0), "{picks:?}");
        assert!(picks.contains(&1) && picks.contains(&2), "{picks:?}");
    }

    #[test]
    fn engine_reported_load_counts() {
        let c = test_instances(2);
        c[1].set_engine_load(Some(10));
        let p = LeastLoaded::default();
        for _ in 0..3 {
            assert_eq!(p.pick(&c, &RouteFacts::default()).index, 0);
        }
    }
}
