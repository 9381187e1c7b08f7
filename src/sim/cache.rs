//! The prefix cache: prompts are cut into fixed-size blocks of token ids, each block is
//! named by a hash chained to the block before it (so a block's hash stands for the
//! whole prefix up to it, as in vLLM), and blocks are kept in an LRU of fixed capacity.
//! A request reuses the longest run of leading blocks already cached. Only full blocks
//! are cached; the partial tail of a prompt is always computed.

use super::tokenizer::fnv1a;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The hash chained into a prompt's first block: fixed, so every process agrees.
const ROOT_HASH: u64 = 0x7064_6374_6c2d_7369; // "pdctl-si"

/// The chained hashes of the full blocks of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return out;
    }
    let mut parent = ROOT_HASH;
    let mut buf = Vec::with_capacity(8 + block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        buf.extend_from_slice(&parent.to_le_bytes());
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        parent = fnv1a(&buf);
        out.push(parent);
    }
    out
}

/// The keys are already hashes: use them as they are.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const NIL: usize = usize::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: usize,
    next: usize,
}

/// An LRU set of block hashes with a fixed capacity (0 turns caching off).
pub struct PrefixCache {
    capacity: usize,
    index: HashMap<u64, usize, BuildHasherDefault<IdentityHasher>>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Most recently used.
    head: usize,
    /// Least recently used: evicted first.
    tail: usize,
    evictions: u64,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> PrefixCache {
        PrefixCache {
            capacity,
            index: HashMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            evictions: 0,
        }
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether a block is cached (does not count as a use).
    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// How many leading blocks of `hashes` are cached; those count as used now.
    pub fn lookup(&mut self, hashes: &[u64]) -> usize {
        let mut n = 0;
        for h in hashes {
            match self.index.get(h) {
                Some(&slot) => {
                    self.move_to_front(slot);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Caches all `hashes` (or marks them used), evicting the least recently used.
    pub fn insert(&mut self, hashes: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for &h in hashes {
            if let Some(&slot) = self.index.get(&h) {
                self.move_to_front(slot);
                continue;
            }
            if self.index.len() >= self.capacity {
                self.evict_one();
            }
            let node = Node {
                hash: h,
                prev: NIL,
                next: NIL,
            };
            let slot = match self.free.pop() {
                Some(s) => {
                    self.nodes[s] = node;
                    s
                }
                None => {
                    self.nodes.push(node);
                    self.nodes.len() - 1
                }
            };
            self.index.insert(h, slot);
            self.push_front(slot);
        }
    }

    fn evict_one(&mut self) {
        let slot = self.tail;
        if slot == NIL {
            return;
        }
        self.unlink(slot);
        self.index.remove(&self.nodes[slot].hash);
        self.free.push(slot);
        self.evictions += 1;
    }

    fn move_to_front(&mut self, slot: usize) {
        if self.head != slot {
            self.unlink(slot);
            self.push_front(slot);
        }
    }

    fn unlink(&mut self, slot: usize) {
        let Node { prev, next, .. } = self.nodes[slot];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next].prev = prev;
        }
    }

    fn push_front(&mut self, slot: usize) {
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_cover_full_blocks_and_chain() {
        let t: Vec<u32> = (0..40).collect();
        let h = block_hashes(&t, 16);
        assert_eq!(h.len(), 2, "the 8-token tail is not a block");
        // Same second block after a different first block: a different hash.
        let mut u = t.clone();
        u[0] = 999;
        let g = block_hashes(&u, 16);
        assert_ne!(h[0], g[0]);
        assert_ne!(h[1], g[1]);
        assert_eq!(block_hashes(&t, 16), h, "stable");
        assert!(block_hashes(&t, 0).is_empty());
    }

    #[test]
    fn lookup_finds_the_longest_cached_prefix() {
        let mut c = PrefixCache::new(100);
        let a = block_hashes(&(0..64).collect::<Vec<u32>>(), 16);
        assert_eq!(c.lookup(&a), 0);
        c.insert(&a[..2]);
        assert_eq!(c.lookup(&a), 2);
        c.insert(&a);
        assert_eq!(c.lookup(&a), 4);
        // A prompt sharing the first block only.
        let mut other: Vec<u32> = (0..64).collect();
        other[20] = 5;
        assert_eq!(c.lookup(&block_hashes(&other, 16)), 1);
    }

    #[test]
    fn capacity_evicts_least_recently_used() {
        let mut c = PrefixCache::new(3);
        c.insert(&[1, 2, 3]);
        assert_eq!(c.lookup(&[1]), 1); // 1 is now most recent: 2 is the oldest
        c.insert(&[4]);
        assert_eq!(c.len(), 3);
        assert!(c.contains(1) && c.contains(3) && c.contains(4));
        assert!(!c.contains(2));
        assert_eq!(c.evictions(), 1);
        c.insert(&[5, 6, 7, 8]);
        assert_eq!(c.len(), 3);
        assert!(c.contains(6) && c.contains(7) && c.contains(8));
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = PrefixCache::new(0);
        c.insert(&[1, 2]);
        assert!(c.is_empty());
        assert_eq!(c.lookup(&[1, 2]), 0);
    }
}
