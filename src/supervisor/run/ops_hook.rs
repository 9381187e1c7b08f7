//! The door through which the supervisor hands changes to the whole cluster to the
//! operations layer above it (`crate::ops`), which the caller of [`super::runner::run`]
//! plugs in. The supervisor only relays: it knows nothing of what a change does.

use crate::control::Response;
use crate::control::operation::{ChangeRequest, OperationReport};
use std::future::Future;
use std::pin::Pin;
use tokio::sync::mpsc;

/// Changes to the whole cluster, carried out inside the supervisor process so that they
/// outlive the client that asked for them.
pub trait Operations: Send + Sync {
    /// Starts `change` unless one runs already (then Err names it). Its progress goes to
    /// `out` as `Progress` lines, ending with one `Finished`; sending stops mattering once
    /// the client has gone.
    /// (Err stays text: it is the refusal the client is sent as it is, `Response::Error`;
    /// no caller decides anything by its kind.)
    fn begin(
        &self,
        change: ChangeRequest,
        out: mpsc::UnboundedSender<Response>,
    ) -> Result<(), String>;

    /// At the supervisor's start, before it serves requests: takes up the change its
    /// last run left cut short (finished or undone) and reconciles the other nodes with
    /// the plan, in a task of its own; changes are refused until that is done.
    fn recover(&self);

    /// The change running now, or the last one.
    fn report(&self) -> Option<OperationReport>;

    /// Before this node takes the cluster down: takes the other nodes down; one line per
    /// node saying how that went.
    fn down_others(&self, timeout_s: u64)
    -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>>;

    /// The rebalancer's state (`[rebalance]`), when the cluster has one.
    fn rebalance(&self) -> Option<crate::vocab::RebalanceReport> {
        None
    }

    /// `pdctl rebalance MODE`: what the rebalancer does from now on; Ok says what
    /// changed, Err why nothing did.
    /// (Both stay text: each is the line the client prints; no caller looks inside.)
    fn set_rebalance(&self, mode: crate::vocab::RebalanceMode) -> Result<String, String> {
        Err(format!(
            "this cluster has no rebalancer: add a [rebalance] table to its topology and `pdctl apply` it, or restart it, to use mode {}",
            mode.as_str()
        ))
    }
}
