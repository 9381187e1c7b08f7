//! Operations: every change to a running cluster — `scale`, `apply` (and `up` on a
//! running cluster), `restart` (plain, `--drain`, `--rolling`) and a cluster-wide `down` —
//! planned and carried out inside the head node's supervisor, so a change outlives the
//! client that asked for it and one command on the head changes every node.
//!
//! The flow: the client (`crate::cli`) sends one [`ChangeRequest`] over the control
//! socket and prints the progress lines that come back; the supervisor hands it to the
//! [`Engine`] (through [`crate::supervisor::Operations`]), which plans the wanted cluster
//! (`plan::diff` against the plan that runs), checks it, and carries it out step by step:
//! on this node through its own supervisor, on the others through theirs over the TCP
//! control channel ([`nodes`]), waiting on the proxy's `/metrics` for routing and drains
//! ([`drain`]). One change at a time; `status` shows the one running and the last one.
//!
//! [`ChangeRequest`]: crate::control::operation::ChangeRequest

mod change;
mod context;
mod drain;
mod engine;
pub mod fetch;
mod journal;
mod nodes;
pub mod rebalance;
mod recover;
pub mod up;

pub use engine::Engine;
pub use journal::{ACK_COMMAND, acknowledge as acknowledge_journal};

use crate::control::client::{self, ChangeEnd, ControlError};
use crate::control::operation::ChangeRequest;
use std::path::Path;

/// Seconds a drained instance's requests in flight get by default.
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 60;

/// Asks the supervisor on `socket` for `change`, handing each progress line to `print`
/// (`true`: an error line) as it comes; returns how it ended (exit code 0 done, 1 a step
/// failed, 2 refused, and the last words).
pub async fn request(
    socket: &Path,
    change: ChangeRequest,
    print: impl FnMut(&str, bool),
) -> Result<ChangeEnd, ControlError> {
    client::change(socket, change, print).await
}
