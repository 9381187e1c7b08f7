//! Stopping without hiding it from clients. On SIGTERM the proxy stops taking requests
//! (503 JSON with `retry-after`), lets those in flight finish, and when time runs out ends
//! each stream it must cut with an SSE error event and `data: [DONE]`, so a client can tell
//! an answer cut by a shutdown from a network fault. How long it has is what the
//! supervisor says (the time until it would SIGKILL), so `pdctl down -t N` is honoured whole.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

pub use crate::control::STOP_DEADLINE_ENV;

/// How long in-flight requests get when nobody says (a proxy run by hand, Ctrl-C).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// The shutdown state every request looks at.
#[derive(Debug)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: Arc<AtomicUsize>,
    cut: watch::Sender<bool>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            draining: AtomicBool::new(false),
            in_flight: Arc::new(AtomicUsize::new(0)),
            cut: watch::channel(false).0,
        }
    }
}

/// Counts one request as in flight until dropped (with its response stream, if any).
#[derive(Debug)]
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Resolves when the proxy cuts what is still in flight.
pub type CutSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

impl Drain {
    /// Whether new requests are refused.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Counts a request in flight.
    pub fn enter(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.in_flight.clone())
    }

    /// Requests (and streams) not finished yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A future that resolves when [`Drain::cut_now`] is called.
    pub fn cut_signal(&self) -> CutSignal {
        let mut rx = self.cut.subscribe();
        Box::pin(async move {
            let _ = rx.wait_for(|cut| *cut).await;
        })
    }

    /// Stops taking requests, waits for those in flight up to `grace` less a margin to
    /// end the rest with an error event, and cuts what is left.
    pub async fn run(&self, grace: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        let margin = (grace / 4).min(Duration::from_secs(1));
        let cut_at = tokio::time::Instant::now() + grace.saturating_sub(margin);
        tracing::info!(
            "stopping: new requests get 503; {} in flight get {:?} to finish",
            self.in_flight(),
            grace.saturating_sub(margin)
        );
        if !self.wait_empty(cut_at).await {
            tracing::warn!(
                "{} request(s) still in flight at the end of the shutdown grace: ending each with an error event",
                self.in_flight()
            );
            self.cut.send_replace(true);
            self.wait_empty(tokio::time::Instant::now() + margin).await;
        }
    }

    async fn wait_empty(&self, until: tokio::time::Instant) -> bool {
        loop {
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The time left before the supervisor's SIGKILL, read from [`STOP_DEADLINE_ENV`]'s file;
/// [`DEFAULT_GRACE`] when there is none.
pub fn grace_from_env() -> Duration {
    std::env::var_os(STOP_DEADLINE_ENV)
        .and_then(|p| grace_from_file(Path::new(&p)))
        .unwrap_or(DEFAULT_GRACE)
}

fn grace_from_file(path: &Path) -> Option<Duration> {
    let text = std::fs::read_to_string(path).ok()?;
    let deadline_ms: u64 = text.trim().parse().ok()?;
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_millis() as u64;
    Some(Duration::from_millis(deadline_ms.saturating_sub(now_ms)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_is_the_time_left_until_the_written_deadline() {
        let dir = std::env::temp_dir().join(format!("pdctl-drain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("stop-by");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        std::fs::write(&f, (now + 30_000).to_string()).unwrap();
        let g = grace_from_file(&f).unwrap();
        assert!(
            g > Duration::from_secs(29) && g <= Duration::from_secs(30),
            "{g:?}"
        );
        std::fs::write(&f, (now - 5).to_string()).unwrap();
        assert_eq!(grace_from_file(&f), Some(Duration::ZERO));
        std::fs::write(&f, "soon").unwrap();
        assert_eq!(grace_from_file(&f), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn requests_finishing_in_time_are_not_cut() {
        let d = Arc::new(Drain::default());
        let guard = d.enter();
        let cut = d.cut_signal();
        let runner = tokio::spawn({
            let d = d.clone();
            async move { d.run(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(d.is_draining());
        drop(guard);
        runner.await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), cut)
                .await
                .is_err(),
            "cut although nothing was left"
        );
    }

    #[tokio::test]
    async fn what_is_left_at_the_end_of_the_grace_is_cut() {
        let d = Arc::new(Drain::default());
        let guard = d.enter();
        let cut = d.cut_signal();
        let started = std::time::Instant::now();
        let runner = tokio::spawn({
            let d = d.clone();
            async move { d.run(Duration::from_millis(400)).await }
        });
        cut.await;
        drop(guard);
        runner.await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
