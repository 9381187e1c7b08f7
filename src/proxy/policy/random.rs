//! Random: a uniform pick, the `Random` strategy of hand-written proxies (stateless, no coordination).

use super::{Policy, RouteFacts};
use crate::proxy::instances::Instance;
use std::sync::Arc;

/// Picks uniformly at random.
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn pick(&self, candidates: &[Arc<Instance>], _facts: &RouteFacts) -> Arc<Instance> {
        candidates[rand::random_range(0..candidates.len())].clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::policy::test_instances;

    #[test]
    fn reaches_every_instance() {
        let c = test_instances(4);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[Random.pick(&c, &RouteFacts::default()).index] += 1;
        }
        // 400 draws over 4: each count is ~100; below 40 has probability < 1e-12.
        assert!(seen.iter().all(|&n| n > 40), "{seen:?}");
    }
}
