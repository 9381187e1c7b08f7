//! The supervisors a change talks to: this node's over its Unix socket, the others' over
//! the TCP control channel (mutually authenticated TLS, requests as `PeerRequest`). A step names the node whose
//! supervisor must take it; the rest is the same request either way.

use crate::control::client::{self, Endpoint};
use crate::control::{Request, Response, StatusReport};
use std::collections::BTreeMap;
use std::time::Duration;

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
    /// an error naming the node.
    pub async fn ask(&self, node: &str, req: Request, wait: Duration) -> anyhow::Result<String> {
        let to = self.endpoint(node)?;
        let answer = client::send_to(to, &req, wait)
            .await
            .map_err(|e| anyhow::anyhow!("node {node}: {e}"))?;
        match answer {
            Response::Done { message } => Ok(message),
            Response::Error { message } => anyhow::bail!("node {node}: {message}"),
            other => anyhow::bail!("node {node}: the supervisor answered {other:?}"),
        }
    }

    /// `node`'s own status report (its services as it runs them).
    pub async fn status(&self, node: &str) -> anyhow::Result<StatusReport> {
        let to = self.endpoint(node)?;
        client::status_at(to, Duration::from_secs(10))
            .await
            .map_err(|e| anyhow::anyhow!("node {node}: {e}"))
    }
}
