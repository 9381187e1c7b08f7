//! Services placed on other nodes: never spawned here, only probed, so `status` on the
//! head shows them, local services that depend on them wait for them and the proxy routes
//! to them. `pdctl scale` and `apply` add and remove such rows too (their own node's
//! supervisor starts and stops the processes).

use crate::control::ServiceState;
use crate::supervisor::run::probe::{
    LIVENESS_INTERVAL, only_on_its_node, remote_probe, startup_delay, unhealthy_now,
};
use crate::supervisor::run::service::ServiceCtx;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio::sync::watch;

/// Probes remote service `idx` until `shutdown` turns true: fast while it has not
/// answered yet, every second after; `healthy` on success, `unhealthy` once it cannot
/// serve (refused) or `health.failed_probes` probes in a row failed (a busy engine's slow
/// answer alone keeps it healthy).
pub async fn run_remote(ctx: Arc<ServiceCtx>, idx: usize, mut shutdown: watch::Receiver<bool>) {
    let svc = ctx.service(idx);
    let node_address = ctx.members().plan.nodes.get(&svc.node).cloned();
    if only_on_its_node(&svc.host, node_address.as_deref()) {
        ctx.table.update(idx, |s| {
            s.last_exit = Some(format!(
                "listens on {} of node {}: its state comes from that node's supervisor",
                svc.host, svc.node
            ));
        });
        return;
    }
    let Some(probe) = remote_probe(&svc) else {
        ctx.table.update(idx, |s| {
            s.last_exit = Some("cannot be probed from this node (no port or URL)".into());
        });
        return;
    };
    let never = AtomicBool::new(false);
    let started = std::time::Instant::now();
    let failed_probes = ctx.members().plan.health.failed_probes;
    let mut seen_healthy = false;
    let mut failures = 0u32;
    loop {
        let delay = if seen_healthy {
            LIVENESS_INTERVAL
        } else {
            startup_delay(started.elapsed())
        };
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        // Stopped, or removed from the cluster (`scale`, `apply`): not probed any more.
        if *shutdown.borrow() || ctx.members().index_of(&svc.name) != Some(idx) {
            return;
        }
        let result = ctx.prober.check(&probe, &never).await;
        let state = ctx.table.state(idx);
        if result.is_ok() {
            failures = 0;
        }
        match result {
            Ok(()) if !seen_healthy || state != ServiceState::Healthy => {
                if seen_healthy {
                    ctx.table.set_state(idx, ServiceState::Healthy);
                } else {
                    // What the probes said while it started (connection refused before
                    // its node had started it) is no exit of this run: LAST EXIT would
                    // read as a failure of a healthy service.
                    ctx.table.update(idx, |s| s.last_exit = None);
                    ctx.table.run_started(idx, None, ServiceState::Healthy);
                }
                seen_healthy = true;
            }
            Ok(()) => {}
            Err(why) if seen_healthy && why.inconclusive() => {
                tracing::warn!("probe of {} on node {}: {why}", svc.name, svc.node);
            }
            Err(why) => {
                failures += 1;
                let next = match (seen_healthy, state) {
                    (false, _) => ServiceState::Starting,
                    // Busy, not gone: still healthy, and nothing to say in LAST EXIT.
                    (true, ServiceState::Healthy)
                        if !unhealthy_now(failures, &why, failed_probes) =>
                    {
                        continue;
                    }
                    (true, _) => ServiceState::Unhealthy,
                };
                ctx.table.update(idx, |s| {
                    s.state = next;
                    s.last_exit = Some(why.to_string());
                });
            }
        }
    }
}
