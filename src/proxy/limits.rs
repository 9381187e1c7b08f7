//! Admission control in front of the engines: a token bucket (`--rate-limit` req/s) and a
//! concurrency limit (`--max-concurrent`) with a bounded wait queue (`--queue-size`).
//! What does not fit gets a 429 with `retry-after` instead of piling up without bound.

use super::errors::ProxyError;
use super::metrics::{LimitReason, Metrics};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// The admission limits of one proxy.
#[derive(Debug)]
pub struct Limits {
    bucket: Option<Mutex<Bucket>>,
    slots: Option<Arc<Semaphore>>,
    max_concurrent: usize,
    queue_size: usize,
    waiting: AtomicUsize,
    metrics: Arc<Metrics>,
}

/// A request's right to run; holding it keeps its concurrency slot taken.
#[derive(Debug)]
pub struct Admission {
    _slot: Option<OwnedSemaphorePermit>,
}

/// Decrements the wait-queue length however the wait ends (slot granted or client gone).
struct Waiting<'a>(&'a Limits);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.queue_depth(-1);
    }
}

impl Limits {
    /// Limits from the flags; 0 turns a limit off.
    pub fn new(rate: f64, max_concurrent: usize, queue_size: usize, metrics: Arc<Metrics>) -> Self {
        Limits {
            bucket: (rate > 0.0).then(|| Mutex::new(Bucket::new(rate))),
            slots: (max_concurrent > 0).then(|| Arc::new(Semaphore::new(max_concurrent))),
            max_concurrent,
            queue_size,
            waiting: AtomicUsize::new(0),
            metrics,
        }
    }

    /// Admits a request now, after waiting in the queue, or refuses it with a 429.
    pub async fn admit(&self) -> Result<Admission, ProxyError> {
        if let Some(bucket) = &self.bucket {
            let taken = bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(Instant::now());
            if let Err(wait_s) = taken {
                self.metrics.rate_limited(LimitReason::Rate);
                return Err(ProxyError::RateLimited {
                    message: format!("rate limit reached (--rate-limit): retry in {wait_s:.2} s"),
                    retry_after_s: wait_s.ceil().max(1.0) as u64,
                });
            }
        }
        let Some(slots) = &self.slots else {
            return Ok(Admission { _slot: None });
        };
        if let Ok(p) = slots.clone().try_acquire_owned() {
            return Ok(Admission { _slot: Some(p) });
        }
        // All slots taken: wait in the queue if it has room.
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        self.metrics.queue_depth(1);
        let waiting = Waiting(self);
        if before >= self.queue_size {
            drop(waiting);
            self.metrics.rate_limited(LimitReason::Concurrency);
            return Err(ProxyError::RateLimited {
                message: format!(
                    "too many requests: all {} slots (--max-concurrent) are busy and the wait queue of {} (--queue-size) is full",
                    self.max_concurrent, self.queue_size
                ),
                retry_after_s: 1,
            });
        }
        self.metrics.queued();
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        drop(waiting);
        Ok(Admission {
            _slot: Some(permit),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
