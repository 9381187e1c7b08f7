//! The cluster's live page (`[dashboard]`, `pdctl dashboard`): one self-contained HTML
//! page embedded in the binary, and the JSON it polls, served by a small HTTP server the
//! head's supervisor process runs beside the cluster.
//!
//! It watches from outside the request path: once a second it asks the supervisor for its
//! status over the control socket (as `pdctl status` does), scrapes the proxy's and the
//! engines' `/metrics` (as Prometheus would) and reads the new lines of the proxy's access
//! log (which the proxy writes anyway). Nothing in the proxy waits on it or knows of it.
//! Read-only: it offers no action. Bound beyond loopback, its data needs the cluster's
//! client key; it never shows a secret (the keys are blanked out of the log lines it
//! serves, the last-error text is left out).

mod access;
mod collect;
pub mod grafana;
mod pages;
mod server;

pub use server::{CLUSTER_HEADER, serve};

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where the dashboard's server reads the cluster from, and what it guards.
#[derive(Clone)]
pub struct Watch {
    /// The supervisor's control socket.
    pub socket: PathBuf,
    /// The proxy's log file on this node (None: the proxy runs elsewhere, or there is none).
    pub proxy_log: Option<PathBuf>,
    /// Node name -> address, as the plan writes them.
    pub nodes: BTreeMap<String, String>,
    /// The key the data asks for (`Authorization: Bearer KEY`); None: loopback, no key asked.
    pub key: Option<String>,
    /// Texts never shown (the cluster's keys), blanked out of served log lines.
    pub hidden: Vec<String>,
    /// The cluster's name, in a header of the page (`x-pdctl-cluster`), so `pdctl status`
    /// tells its own dashboard from another cluster's on the same port.
    pub cluster: String,
    /// The port it listens on (in its messages).
    pub port: u16,
    /// The rebalancer's objectives (`[rebalance]`'s `ttft_p90_ms`, `itl_p90_ms`), shown
    /// beside what it measures; Null without the table.
    pub objectives: serde_json::Value,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("socket", &self.socket)
            .field("proxy_log", &self.proxy_log)
            .field("key", &self.key.as_ref().map(|_| ".."))
            .finish_non_exhaustive()
    }
}

/// Why the page cannot be served as configured: bound beyond loopback without a client key
/// to ask for, it would show the cluster to anyone who can reach the port.
pub fn refusal(dashboard: &crate::vocab::Dashboard, has_key: bool) -> Option<String> {
    (!dashboard.loopback_only() && !has_key).then(|| {
        format!(
            "the dashboard binds {} (beyond this machine) but the cluster has no client key to ask for: set {} before `pdctl up`, or bind it to 127.0.0.1",
            dashboard.bind,
            crate::vocab::PROXY_CLIENT_KEY_VAR
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Dashboard;

    #[test]
    fn beyond_loopback_the_page_needs_a_key_to_ask_for() {
        let open = Dashboard {
            bind: "0.0.0.0".into(),
            ..Dashboard::default()
        };
        let why = refusal(&open, false).expect("refused without a key");
        assert!(
            why.contains("PDCTL_API_KEY") && why.contains("127.0.0.1"),
            "{why}"
        );
        assert_eq!(refusal(&open, true), None);
        assert_eq!(refusal(&Dashboard::default(), false), None);
    }
}
