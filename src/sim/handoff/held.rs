//! KV blocks a prefill instance keeps for a decode instance (nixl: keyed by request id,
//! pulled by the decode; mooncake: keyed by transfer id, waited for by the decode).
//! Entries leave when pulled or when they expire, and are counted in the
//! `pdctl_sim_kv_blocks_held` gauge meanwhile, so stranded KV is visible.

use crate::sim::metrics::Metrics;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The KV of one prompt as the wire carries it between sims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvBlocks {
    pub engine_id: String,
    pub block_hashes: Vec<u64>,
    pub block_ids: Vec<u64>,
    pub num_tokens: u64,
}

/// What a decode finds under a key.
#[derive(Debug, Clone, PartialEq)]
pub enum Held {
    Ready(KvBlocks),
    /// The prefill will not hand this off (it ended by a stop condition or was aborted).
    Refused(String),
}

struct Entry {
    held: Held,
    expires: Instant,
    blocks: i64,
}

/// The held entries of one prefill instance.
#[derive(Default)]
pub struct HeldKv {
    map: Mutex<HashMap<String, Entry>>,
    notify: Notify,
    next_block_id: AtomicU64,
}

impl HeldKv {
    /// Fresh block ids for `n` blocks (the `remote_block_ids` a prefill hands out).
    pub fn new_block_ids(&self, n: usize) -> Vec<u64> {
        let first = self.next_block_id.fetch_add(n as u64, Relaxed);
        (first..first + n as u64).collect()
    }

    /// Keeps `held` under `key` for at most `ttl`, and wakes decodes waiting for it.
    pub fn hold(&self, metrics: &Metrics, key: &str, held: Held, ttl: Duration) {
        let blocks = match &held {
            Held::Ready(b) => b.block_hashes.len() as i64,
            Held::Refused(_) => 0,
        };
        let old = self.lock().insert(
            key.to_string(),
            Entry {
                held,
                expires: Instant::now() + ttl,
                blocks,
            },
        );
        metrics
            .blocks_held
            .fetch_add(blocks - old.map_or(0, |e| e.blocks), Relaxed);
        self.notify.notify_waiters();
    }

    /// Removes and returns the entry under `key`, if any.
    pub fn take(&self, metrics: &Metrics, key: &str) -> Option<Held> {
        let e = self.lock().remove(key)?;
        metrics.blocks_held.fetch_sub(e.blocks, Relaxed);
        Some(e.held)
    }

    /// Like [`take`](Self::take), waiting up to `timeout` for the entry to appear.
    pub async fn wait_take(&self, metrics: &Metrics, key: &str, timeout: Duration) -> Option<Held> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(h) = self.take(metrics, key) {
                return Some(h);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.take(metrics, key);
            }
        }
    }

    /// Drops expired entries; returns their keys and block counts.
    pub fn expire(&self, metrics: &Metrics) -> Vec<(String, i64)> {
        let now = Instant::now();
        let mut gone = Vec::new();
        self.lock().retain(|k, e| {
            let keep = e.expires > now;
            if !keep {
                metrics.blocks_held.fetch_sub(e.blocks, Relaxed);
                gone.push((k.clone(), e.blocks));
            }
            keep
        });
        gone
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(n: usize) -> KvBlocks {
        KvBlocks {
            engine_id: "e".into(),
            block_hashes: (0..n as u64).collect(),
            block_ids: (0..n as u64).collect(),
            num_tokens: n as u64 * 16,
        }
    }

    #[test]
    fn held_blocks_are_counted_until_taken_or_expired() {
        let m = Metrics::new("m", 10, 16);
        let h = HeldKv::default();
        h.hold(&m, "a", Held::Ready(blocks(3)), Duration::from_secs(60));
        h.hold(&m, "b", Held::Ready(blocks(2)), Duration::ZERO);
        assert_eq!(m.blocks_held.load(Relaxed), 5);
        assert_eq!(h.expire(&m), vec![("b".to_string(), 2)]);
        assert_eq!(m.blocks_held.load(Relaxed), 3);
        assert_eq!(h.take(&m, "a"), Some(Held::Ready(blocks(3))));
        assert_eq!(h.take(&m, "a"), None);
        assert_eq!(m.blocks_held.load(Relaxed), 0);
        assert_ne!(h.new_block_ids(2), h.new_block_ids(2));
    }

    #[tokio::test]
    async fn wait_take_sees_entries_that_arrive_later_and_times_out() {
        let m = std::sync::Arc::new(Metrics::new("m", 10, 16));
        let h = std::sync::Arc::new(HeldKv::default());
        let (h2, m2) = (h.clone(), m.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            h2.hold(
                &m2,
                "x",
                Held::Refused("stop".into()),
                Duration::from_secs(5),
            );
        });
        let got = h.wait_take(&m, "x", Duration::from_secs(5)).await;
        assert_eq!(got, Some(Held::Refused("stop".into())));
        let t = Instant::now();
        assert_eq!(h.wait_take(&m, "y", Duration::from_millis(50)).await, None);
        assert!(t.elapsed() >= Duration::from_millis(50));
    }
}
