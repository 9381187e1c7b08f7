//! Prefix-aware routing: a request goes to the instance that already served the longest
//! prefix of its prompt (whose prefix cache then hits), unless that instance is busier than
//! the least loaded one by more than a threshold, in which case load wins and the chosen
//! instance learns the prefix instead.

use super::least_loaded::LeastLoaded;
use super::{Policy, RouteFacts};
use crate::proxy::instances::{Instance, Leg};
use crate::proxy::recorder::Recorder;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How many more requests in flight than the least loaded instance the prefix owner may
/// have before load wins over cache affinity.
pub const BALANCE_THRESHOLD: usize = 8;
/// Chunk hashes remembered per generation (two generations: at most twice this).
pub const TABLE_GENERATION: usize = 262_144;

/// Chunk hash -> index of the instance that last served it, bounded like an LRU: entries
/// live in a current and a previous generation; a hit moves an entry to the current one,
/// and when the current one is full the previous one (the least recently used half) is
/// dropped. O(1) per operation, no per-entry bookkeeping.
#[derive(Debug)]
struct PrefixTable {
    current: HashMap<u64, u32>,
    previous: HashMap<u64, u32>,
    generation: usize,
}

impl PrefixTable {
    fn new(generation: usize) -> Self {
        PrefixTable {
            current: HashMap::new(),
            previous: HashMap::new(),
            generation,
        }
    }

    fn get(&mut self, h: u64) -> Option<u32> {
        if let Some(v) = self.current.get(&h) {
            return Some(*v);
        }
        let v = self.previous.remove(&h)?;
        self.insert(h, v);
        Some(v)
    }

    fn insert(&mut self, h: u64, v: u32) {
        self.current.insert(h, v);
        if self.current.len() >= self.generation {
            self.previous = std::mem::take(&mut self.current);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

/// The prefix-aware policy of one leg.
#[derive(Debug)]
pub struct PrefixAware {
    leg: Leg,
    table: Mutex<PrefixTable>,
    fallback: LeastLoaded,
    recorder: Arc<dyn Recorder>,
}

impl PrefixAware {
    /// A policy with an empty table.
    pub fn new(leg: Leg, recorder: Arc<dyn Recorder>) -> Self {
        Self::with_generation(leg, recorder, TABLE_GENERATION)
    }

    fn with_generation(leg: Leg, recorder: Arc<dyn Recorder>, generation: usize) -> Self {
        PrefixAware {
            leg,
            table: Mutex::new(PrefixTable::new(generation)),
            fallback: LeastLoaded::default(),
            recorder,
        }
    }
}

impl Policy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix-aware"
    }

    fn needs_prefix(&self) -> bool {
        true
    }

    fn pick(&self, candidates: &[Arc<Instance>], facts: &RouteFacts) -> Arc<Instance> {
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        // Walk the chain while it is known; remember the deepest chunk whose owner may be used.
        let mut owner: Option<&Arc<Instance>> = None;
        for h in &facts.prefix_hashes {
            let Some(idx) = table.get(*h) else { break };
            if let Some(i) = candidates.iter().find(|c| c.index == idx as usize) {
                owner = Some(i);
            }
        }
        let least = self.fallback.least(candidates);
        let chosen = match owner {
            Some(o) if o.load() <= least.load() + BALANCE_THRESHOLD => {
                self.recorder.prefix_routing(self.leg, "matched");
                o.clone()
            }
            Some(_) => {
                self.recorder.prefix_routing(self.leg, "rebalanced");
                least
            }
            None => {
                self.recorder.prefix_routing(self.leg, "cold");
                least
            }
        };
        for h in &facts.prefix_hashes {
            table.insert(*h, chosen.index as u32);
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::metrics::Metrics;
    use crate::proxy::policy::prefix_hash::chunk_hashes;
    use crate::proxy::policy::test_instances;

    fn facts(text: &str) -> RouteFacts {
        RouteFacts {
            prefix_hashes: chunk_hashes(text.as_bytes()),
        }
    }

    #[test]
    fn a_shared_prefix_returns_to_its_instance() {
        let c = test_instances(4);
        let p = PrefixAware::new(Leg::Decode, Arc::new(Metrics::default()));
        let ctx = "Shared context #0: This is long context. ".repeat(10);
        let first = p.pick(&c, &facts(&format!("{ctx}Question 0")));
        // Make the first instance a little busier than the rest: affinity still wins.
        let _busy = first.begin();
        for q in 1..5 {
            let again = p.pick(&c, &facts(&format!("{ctx}Question {q}")));
            assert_eq!(again.index, first.index);
        }
        // A different context is free to go elsewhere (least loaded, not the busy one).
        let other = p.pick(&c, &facts(&"Another document entirely. ".repeat(10)));
        assert_ne!(other.index, first.index);
    }

    #[test]
    fn an_overloaded_owner_loses_to_load_and_the_new_instance_learns() {
        let c = test_instances(2);
        let p = PrefixAware::new(Leg::Prefill, Arc::new(Metrics::default()));
        let text = "Long shared system prompt. ".repeat(10);
        let owner = p.pick(&c, &facts(&text));
        owner.set_engine_load(Some(BALANCE_THRESHOLD as u32 + 1));
        let moved = p.pick(&c, &facts(&text));
        assert_ne!(moved.index, owner.index);
        owner.set_engine_load(Some(0));
        assert_eq!(p.pick(&c, &facts(&text)).index, moved.index);
    }

    #[test]
    fn an_unusable_owner_is_skipped() {
        let c = test_instances(2);
        let p = PrefixAware::new(Leg::Decode, Arc::new(Metrics::default()));
        let text = "Long shared system prompt. ".repeat(10);
        let owner = p.pick(&c, &facts(&text));
        let others: Vec<_> = c
            .iter()
            .filter(|i| i.index != owner.index)
            .cloned()
            .collect();
        assert_ne!(p.pick(&others, &facts(&text)).index, owner.index);
    }

    #[test]
    fn the_table_stays_bounded_and_keeps_recent_entries() {
        let mut t = PrefixTable::new(100);
        for h in 0..1000u64 {
            t.insert(h, 1);
            assert!(t.len() <= 200);
        }
        assert_eq!(t.get(999), Some(1));
        assert_eq!(t.get(0), None);
        let p = PrefixAware::with_generation(Leg::Decode, Arc::new(Metrics::default()), 100);
        assert_eq!(p.name(), "prefix-aware");
    }
}
