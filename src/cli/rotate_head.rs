//! `pdctl join-token --rotate-head`: the head's certificate rotated, so a leaked head key
//! stops working on every node (docs/security.md, "The head's certificate").

use crate::control::tls::{ClusterCa, NodeCreds, stage_head_rotation};
use std::path::Path;
use std::process::ExitCode;

/// Stages a rotation of the head's certificate kept in `dir` (the head's `tls/`): the
/// running supervisor announces it to the nodes at once, and the head's next `up` puts
/// it to use.
pub fn rotate(dir: &Path, ca: &ClusterCa, head: &str) -> anyhow::Result<ExitCode> {
    let current = NodeCreds::read(dir)?
        .filter(|c| c.node == head)
        .ok_or_else(|| {
            super::ExitError::usage(format!(
                "the head's certificate is not in {}: run `pdctl up` on the head first",
                dir.display()
            ))
        })?;
    let staged = stage_head_rotation(ca, &current)?;
    println!(
        "pdctl: the head's next certificate is staged (serial {}), signed by the one of now; every node running takes it at its next poll (within seconds). Put it to use with `pdctl down` and `pdctl up` on the head: from then on the nodes refuse the old certificate and its key. A node that was not running meanwhile joins again (`pdctl join-token --node NODE`).",
        staged.serial
    );
    Ok(ExitCode::SUCCESS)
}
