//! Whether an instance can be reached at all, as a signal the legs on it wait on: a leg
//! on an instance found unreachable (the supervisor says its node is cut off, or, without
//! a supervisor, its health probes go unanswered) ends at once instead of waiting out the
//! first-byte or total timeout, which stay for instances that are alive and slow.

use std::future::Future;
use tokio::sync::watch;

/// An instance's reachability: `Some(why)` while it is unreachable.
#[derive(Debug)]
pub struct Reach {
    tx: watch::Sender<Option<String>>,
}

impl Default for Reach {
    fn default() -> Self {
        Reach {
            tx: watch::Sender::new(None),
        }
    }
}

impl Reach {
    /// Records the instance as unreachable (`Some(why)`) or reachable again (`None`);
    /// true when this changed which of the two it is. Legs waiting on [`Reach::lost`]
    /// end when it turns unreachable.
    pub fn set(&self, why: Option<String>) -> bool {
        self.tx.send_if_modified(|now| {
            let changed = now.is_some() != why.is_some();
            if changed {
                *now = why;
            }
            changed
        })
    }

    /// Whether the instance is taken as unreachable now.
    pub fn is_unreachable(&self) -> bool {
        self.tx.borrow().is_some()
    }

    /// Resolves with the reason once the instance is unreachable (at once if it is now);
    /// never while it is reachable.
    pub fn lost(&self) -> impl Future<Output = String> + Send + 'static {
        let mut rx = self.tx.subscribe();
        async move {
            let why = rx
                .wait_for(Option::is_some)
                .await
                .map(|why| why.clone().unwrap_or_default());
            match why {
                Ok(why) => why,
                // The instance is gone, and with it every leg on it.
                Err(_) => std::future::pending().await,
            }
        }
    }
}

/// Since when an instance's supervisor says it is draining (a `scale` down, `restart
/// --drain`, a rebalance move, `down -t`): streams still on it once `drain_grace_s` has
/// passed are handed over to other decodes instead of holding the drain up.
#[derive(Debug)]
pub struct Drained {
    tx: watch::Sender<Option<tokio::time::Instant>>,
}

impl Default for Drained {
    fn default() -> Self {
        Drained {
            tx: watch::Sender::new(None),
        }
    }
}

impl Drained {
    /// Records whether the instance is draining now (its start is kept while it lasts).
    pub fn set(&self, draining: bool) {
        self.tx
            .send_if_modified(|now| match (now.is_some(), draining) {
                (false, true) => {
                    *now = Some(tokio::time::Instant::now());
                    true
                }
                (true, false) => {
                    *now = None;
                    true
                }
                _ => false,
            });
    }

    /// Resolves once the instance has been draining for `grace` (a drain that ends before
    /// starts the wait again at the next one).
    pub fn past(&self, grace: std::time::Duration) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.tx.subscribe();
        async move {
            loop {
                let since = rx.wait_for(Option::is_some).await.ok().and_then(|v| *v);
                let Some(since) = since else {
                    // The instance is gone, and with it every leg on it.
                    return std::future::pending().await;
                };
                tokio::select! {
                    () = tokio::time::sleep_until(since + grace) => return,
                    _ = rx.wait_for(Option::is_none) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_leg_waiting_on_an_instance_learns_when_it_is_cut_off() {
        let reach = Reach::default();
        let waiting = tokio::spawn(reach.lost());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "reachable: nothing ends");
        assert!(reach.set(Some("node worker cut off".into())));
        assert!(!reach.set(Some("again".into())), "no change");
        let why = tokio::time::timeout(Duration::from_secs(2), waiting)
            .await
            .expect("the leg learns at once")
            .unwrap();
        assert_eq!(why, "node worker cut off");
        assert_eq!(reach.lost().await, "node worker cut off");
        assert!(reach.set(None) && !reach.is_unreachable());
    }

    #[tokio::test]
    async fn a_drain_is_past_its_grace_only_while_it_lasts() {
        let ms = Duration::from_millis;
        let d = Drained::default();
        let mut past = Box::pin(d.past(ms(500)));
        d.set(true);
        tokio::time::sleep(ms(300)).await;
        d.set(false);
        assert!(
            tokio::time::timeout(ms(1_000), &mut past).await.is_err(),
            "a drain that ended is not past its grace"
        );
        d.set(true);
        assert!(
            tokio::time::timeout(ms(5_000), &mut past).await.is_ok(),
            "the next drain is, after its grace"
        );
    }
}
