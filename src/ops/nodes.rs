//! The supervisors a change talks to: this node's over its Unix socket, the others' over
//! the TCP control channel (mutually authenticated TLS, requests as `PeerRequest`). A step names the node whose
//! supervisor must take it; the rest is the same request either way.

use crate::backoff::Backoff;
use crate::control::client::{self, ControlError, Endpoint};
use crate::control::{Request, Response, StatusReport};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Every node's supervisor, as seen from the head.
#[derive(Debug, Clone)]
pub struct Nodes {
    /// The node this runs on (the head).
    pub here: String,
    local: Endpoint,
    others: BTreeMap<String, Endpoint>,
}

impl Nodes {
    pub fn new(here: String, local: Endpoint, others: BTreeMap<String, Endpoint>) -> Nodes {
        Nodes {
            here,
            local,
            others,
        }
    }

    /// The other nodes' names.
    pub fn others(&self) -> impl Iterator<Item = &String> {
        self.others.keys()
    }

    /// Whether `node` has never joined the cluster: its channel is mutually authenticated
    /// and the head's book holds no certificate of it. Nothing of the cluster can run
    /// there, and no supervisor there could answer: a change has nothing to ask it.
    pub fn never_joined(&self, node: &str) -> bool {
        match self.others.get(node) {
            Some(Endpoint::Tcp { tls, .. }) => {
                tls.accepted().is_some_and(|a| !a.contains_key(node))
            }
            _ => false,
        }
    }

    fn endpoint(&self, node: &str) -> anyhow::Result<&Endpoint> {
        if node == self.here {
            return Ok(&self.local);
        }
        self.others.get(node).ok_or_else(|| {
            anyhow::anyhow!(
                "node {node} has no control channel here (nodes: {})",
                std::iter::once(&self.here)
                    .chain(self.others.keys())
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// Sends `req` to `node`'s supervisor, waiting up to `wait`; its `Done` message, or
    /// an error naming the node. One try.
    pub async fn ask(&self, node: &str, req: Request, wait: Duration) -> anyhow::Result<String> {
        self.ask_retrying(node, &req, wait, Duration::ZERO).await
    }

    /// Sends `req` to `node`'s supervisor, waiting up to `wait`: its answer as it is (for
    /// the requests answered with more than `Done` or `Error`). One try.
    pub async fn answer(
        &self,
        node: &str,
        req: &Request,
        wait: Duration,
    ) -> anyhow::Result<Response> {
        let to = self.endpoint(node)?;
        retrying(node, Duration::ZERO, || client::send_to(to, req, wait)).await
    }

    /// [`Nodes::ask`], tried again with backoff while the supervisor cannot be reached or
    /// does not answer (a transient error), until `within` has passed; an answer, even
    /// an error, ends it.
    pub async fn ask_retrying(
        &self,
        node: &str,
        req: &Request,
        wait: Duration,
        within: Duration,
    ) -> anyhow::Result<String> {
        let to = self.endpoint(node)?;
        let answer = retrying(node, within, || client::send_to(to, req, wait)).await?;
        match answer {
            Response::Done { message } => Ok(message),
            Response::Error { message } => anyhow::bail!("node {node}: {message}"),
            other => anyhow::bail!("node {node}: the supervisor answered {other:?}"),
        }
    }

    /// `node`'s own status report (its services as it runs them), asked again with
    /// backoff for up to `within` while its supervisor does not answer.
    pub async fn status(&self, node: &str, within: Duration) -> anyhow::Result<StatusReport> {
        let to = self.endpoint(node)?;
        retrying(node, within, || {
            client::status_at(to, Duration::from_secs(10))
        })
        .await
    }

    /// A connection to `node`'s supervisor kept open for repeated status requests (one
    /// handshake, however often it is asked).
    pub async fn status_conn(&self, node: &str) -> anyhow::Result<client::StatusConn> {
        let to = self.endpoint(node)?;
        client::StatusConn::open(to, Duration::from_secs(10))
            .await
            .map_err(|e| anyhow::anyhow!("node {node}: {e}"))
    }
}

/// True for a failure that asking again may cure: nobody listening (yet), no answer in
/// time, the connection cut. A refusal or an answer this pdctl cannot read is final.
pub fn transient(e: &ControlError) -> bool {
    matches!(
        e,
        ControlError::Connect { .. }
            | ControlError::NoAnswer { .. }
            | ControlError::Timeout { .. }
            | ControlError::Io { .. }
    )
}

/// The wait before asking a node's supervisor again: 200 ms, doubling, at most 2 s.
pub const ASK_AGAIN: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));

/// `attempt` until it succeeds, fails for good, or `within` has passed (backoff from
/// 200 ms doubling to 2 s between tries); the error names `node`.
async fn retrying<T, F, Fut>(node: &str, within: Duration, mut attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ControlError>>,
{
    let end = Instant::now() + within;
    let mut tries = 0u32;
    loop {
        tries += 1;
        let delay = ASK_AGAIN.after(tries);
        match attempt().await {
            Ok(t) => return Ok(t),
            Err(e) if transient(&e) && Instant::now() + delay < end => {
                tracing::warn!("node {node}: {e}; asking again in {delay:?}");
                tokio::time::sleep(delay).await;
            }
            Err(e) if tries > 1 => anyhow::bail!("node {node}: {e} (tried {tries} times)"),
            Err(e) => anyhow::bail!("node {node}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn no_answer() -> ControlError {
        ControlError::NoAnswer {
            path: "worker:7070".into(),
        }
    }

    #[tokio::test]
    async fn a_transient_error_is_asked_again_until_it_answers() {
        let tries = AtomicU32::new(0);
        let got = retrying("worker", Duration::from_secs(5), || async {
            match tries.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(no_answer()),
                _ => Ok("answered"),
            }
        })
        .await
        .unwrap();
        assert_eq!((got, tries.load(Ordering::SeqCst)), ("answered", 3));
    }

    #[tokio::test]
    async fn a_refusal_is_final_and_the_window_bounds_the_tries() {
        let tries = AtomicU32::new(0);
        let err = retrying("worker", Duration::from_secs(5), || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(ControlError::Refused {
                path: "worker:7070".into(),
                message: "no service `decode-9`".into(),
            })
        })
        .await
        .unwrap_err();
        assert_eq!(tries.load(Ordering::SeqCst), 1);
        assert!(err.to_string().starts_with("node worker: "), "{err}");
        let t = Instant::now();
        let tries = AtomicU32::new(0);
        let err = retrying("worker", Duration::from_millis(700), || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(no_answer())
        })
        .await
        .unwrap_err();
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
        // 200 ms, then 400 ms: a third wait would pass the window.
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        assert!(err.to_string().contains("tried 3 times"), "{err}");
    }
}
