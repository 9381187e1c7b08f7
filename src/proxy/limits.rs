//! Admission control in front of the engines: a token bucket (`--rate-limit` req/s) and a
//! concurrency limit (`--max-concurrent`) with a bounded wait queue (`--queue-size`).
//! What does not fit gets a 429 with `retry-after` instead of piling up without bound.

use super::errors::ProxyError;
use super::recorder::{LimitReason, Recorder};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A classic token bucket: `rate` tokens per second, holding at most `burst`.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        // One second's worth of burst, and at least one request.
        let burst = rate.max(1.0);
        Bucket {
            rate,
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Takes a token, or says how many seconds until one is available.
    fn take(&mut self, now: Instant) -> Result<(), f64> {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err((1.0 - self.tokens) / self.rate)
        }
    }
}

/// Permits of the slot semaphore while there is no concurrency limit: every request holds
/// one even then, so a limit set while it serves counts the requests already running.
const UNLIMITED: usize = 1 << 32;

/// Permits of the slot semaphore for a `--max-concurrent` (0: no limit).
fn permits(max_concurrent: usize) -> usize {
    if max_concurrent == 0 {
        UNLIMITED
    } else {
        max_concurrent
    }
}

/// The admission limits of one proxy. They can change while it serves (`pdctl apply`):
/// the concurrency slots are one semaphore whose permits are added or taken away, so the
/// requests already admitted keep counting against the new limit.
#[derive(Debug)]
pub struct Limits {
    /// Whether `bucket` holds a bucket: checked first so an unlimited proxy takes no lock.
    rate_on: AtomicBool,
    bucket: Mutex<Option<Bucket>>,
    slots: Arc<Semaphore>,
    /// 0: no concurrency limit. The semaphore holds [`permits`] of it in all, free and
    /// taken.
    max_concurrent: AtomicUsize,
    queue_size: AtomicUsize,
    waiting: AtomicUsize,
    recorder: Arc<dyn Recorder>,
}

/// A request's right to run; holding it keeps its concurrency slot taken.
#[derive(Debug)]
pub struct Admission {
    _slot: OwnedSemaphorePermit,
}

/// Decrements the wait-queue length however the wait ends (slot granted or client gone).
struct Waiting<'a>(&'a Limits);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
        self.0.recorder.queue_depth(-1);
    }
}

impl Limits {
    /// Limits from the flags; 0 turns a limit off.
    pub fn new(
        rate: f64,
        max_concurrent: usize,
        queue_size: usize,
        recorder: Arc<dyn Recorder>,
    ) -> Self {
        let l = Limits {
            rate_on: AtomicBool::new(false),
            bucket: Mutex::new(None),
            slots: Arc::new(Semaphore::new(permits(0))),
            max_concurrent: AtomicUsize::new(0),
            queue_size: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            recorder,
        };
        l.set(rate, max_concurrent, queue_size);
        l
    }

    /// Changes the limits of a running proxy. A new rate starts with a full bucket; fewer
    /// slots are taken back as requests release them (admitted requests are never cut),
    /// more are usable at once.
    pub fn set(&self, rate: f64, max_concurrent: usize, queue_size: usize) {
        {
            let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
            let same = bucket.as_ref().map(|b| b.rate) == Some(rate).filter(|r| *r > 0.0);
            if !same {
                *bucket = (rate > 0.0).then(|| Bucket::new(rate));
            }
            self.rate_on.store(bucket.is_some(), Ordering::Relaxed);
        }
        self.queue_size.store(queue_size, Ordering::Relaxed);
        let had = permits(self.max_concurrent.swap(max_concurrent, Ordering::Relaxed));
        let target = permits(max_concurrent);
        if target > had {
            self.slots.add_permits(target - had);
        } else if target < had {
            let extra = had - target;
            let later = extra - self.slots.forget_permits(extra);
            if later > 0 {
                // Taken back as requests finish; the semaphore is fair, so this waits in
                // line with requests queued before the change.
                let slots = self.slots.clone();
                tokio::spawn(async move {
                    if let Ok(p) = slots.acquire_many_owned(later as u32).await {
                        p.forget();
                    }
                });
            }
        }
    }

    /// Admits a request now, after waiting in the queue, or refuses it with a 429.
    pub async fn admit(&self) -> Result<Admission, ProxyError> {
        if self.rate_on.load(Ordering::Relaxed) {
            let taken = match self
                .bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
            {
                Some(bucket) => bucket.take(Instant::now()),
                None => Ok(()),
            };
            if let Err(wait_s) = taken {
                self.recorder.rate_limited(LimitReason::Rate);
                return Err(ProxyError::RateLimited {
                    message: format!("rate limit reached (--rate-limit): retry in {wait_s:.2} s"),
                    retry_after_s: wait_s.ceil().max(1.0) as u64,
                });
            }
        }
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Ok(Admission { _slot: p });
        }
        // All slots taken: wait in the queue if it has room.
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        self.recorder.queue_depth(1);
        let waiting = Waiting(self);
        let queue_size = self.queue_size.load(Ordering::Relaxed);
        if before >= queue_size {
            drop(waiting);
            self.recorder.rate_limited(LimitReason::Concurrency);
            return Err(ProxyError::RateLimited {
                message: format!(
                    "too many requests: all {} slots (--max-concurrent) are busy and the wait queue of {queue_size} (--queue-size) is full",
                    self.max_concurrent.load(Ordering::Relaxed)
                ),
                retry_after_s: 1,
            });
        }
        self.recorder.queued();
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        drop(waiting);
        Ok(Admission { _slot: permit })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::metrics::Metrics;
    use std::time::Duration;

    #[test]
    fn the_bucket_allows_a_burst_then_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(2.0);
        b.last = t0;
        assert!(b.take(t0).is_ok());
        assert!(b.take(t0).is_ok());
        let wait = b.take(t0).unwrap_err();
        assert!((wait - 0.5).abs() < 1e-9, "{wait}");
        assert!(b.take(t0 + Duration::from_millis(500)).is_ok());
        assert!(b.take(t0 + Duration::from_millis(500)).is_err());
    }

    #[tokio::test]
    async fn a_full_queue_is_refused_and_a_freed_slot_admits_the_waiter() {
        let m = Arc::new(Metrics::default());
        let l = Arc::new(Limits::new(0.0, 1, 1, m.clone()));
        let first = l.admit().await.unwrap();
        let l2 = l.clone();
        let waiter = tokio::spawn(async move { l2.admit().await.map(|_| ()) });
        // Let the waiter enter the queue.
        while l.waiting.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        let refused = l.admit().await.unwrap_err();
        assert_eq!(refused.status(), 429);
        drop(first);
        waiter.await.unwrap().unwrap();
        assert_eq!(l.waiting.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn fewer_slots_count_the_requests_already_admitted_and_more_admit_at_once() {
        let m = Arc::new(Metrics::default());
        let l = Arc::new(Limits::new(0.0, 3, 0, m));
        let a = l.admit().await.unwrap();
        let b = l.admit().await.unwrap();
        // Down to 1 while 2 run: nothing more until both are done.
        l.set(0.0, 1, 0);
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        drop(a);
        tokio::task::yield_now().await;
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        drop(b);
        // The take-back task gets the freed permit first, then one slot is left.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let c = l.admit().await.unwrap();
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        // Up to 3: two more at once; then off: no limit at all.
        l.set(0.0, 3, 0);
        let (_d, _e) = (l.admit().await.unwrap(), l.admit().await.unwrap());
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        l.set(0.0, 0, 0);
        let more: Vec<_> = futures_util::future::join_all((0..10).map(|_| l.admit())).await;
        assert!(more.iter().all(Result::is_ok));
        // A limit set while 13 run counts them: none more until 11 have ended.
        l.set(0.0, 2, 0);
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        drop(more);
        drop(c);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            l.admit().await.unwrap_err().status(),
            429,
            "_d and _e still run"
        );
        drop((_d, _e));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let (_f, _g) = (l.admit().await.unwrap(), l.admit().await.unwrap());
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
        l.set(0.0, 0, 0);
        drop((_f, _g));
        // A rate limit switched on refuses once its burst is spent.
        l.set(1.0, 0, 0);
        assert!(l.admit().await.is_ok());
        assert_eq!(l.admit().await.unwrap_err().status(), 429);
    }
}
