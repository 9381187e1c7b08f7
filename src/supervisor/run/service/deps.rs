//! Waiting until a service's dependencies are healthy: local ones run by this supervisor,
//! remote ones (on other nodes) known from their probes.

use crate::control::ServiceState;
use crate::supervisor::run::service::{Cmd, ServiceCtx};
use crate::supervisor::run::table::Table;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// How waiting for dependencies ended.
#[derive(Debug)]
pub enum DepsOutcome {
    Ready,
    /// A dependency failed, stopped, is unknown, or (remote) never became ready.
    Failed(String),
    /// `down` arrived while waiting.
    Stop(oneshot::Sender<()>),
}

/// What this node and the remote service's own node say of service `idx`: the two views a
/// remote dependency must agree on ([`Table::ready_for_dependents`]), so a timeout names
/// the one that held it back.
///
fn remote_views(table: &Table, idx: usize, node: &str) -> String {
    format!(
        "this node sees it {}, node {node} {}",
        table.state(idx),
        match table.reported(idx) {
            Some(s) => format!("reports it {s}"),
            None => "has reported nothing of it (its supervisor not reached)".to_string(),
        }
    )
}

/// Waits until every dependency of service `idx` is healthy. A remote dependency gets the
/// longer of its own and the waiting service's start-up timeout (it may be another node's
/// vLLM loading for minutes); local ones fail by their own start-up timeouts.
pub async fn wait_for_dependencies(
    ctx: &ServiceCtx,
    idx: usize,
    rx: &mut mpsc::UnboundedReceiver<Cmd>,
) -> DepsOutcome {
    let members = ctx.members();
    let svc = &members.plan.services[idx];
    let mut deps = Vec::with_capacity(svc.depends_on.len());
    for name in &svc.depends_on {
        match members.index_of(name) {
            Some(i) => deps.push(i),
            None => {
                return DepsOutcome::Failed(format!(
                    "depends on `{name}`, which is not in the plan"
                ));
            }
        }
    }
    let limit = Duration::from_secs(svc.startup_timeout_s);
    let started = Instant::now();
    let mut changes = ctx.table.subscribe();
    loop {
        let mut all_ready = true;
        for &d in &deps {
            let dep = &members.plan.services[d];
            let remote = dep.node != ctx.node;
            match ctx.table.state(d) {
                ServiceState::Healthy if ctx.table.ready_for_dependents(d) => {}
                state @ (ServiceState::Failed | ServiceState::Stopped) if !remote => {
                    return DepsOutcome::Failed(format!("dependency {} is {state}", dep.name));
                }
                // A remote engine may load for as long as its own start-up allows.
                _ if remote
                    && started.elapsed()
                        >= limit.max(Duration::from_secs(dep.startup_timeout_s)) =>
                {
                    return DepsOutcome::Failed(format!(
                        "dependency {} on node {} ({}) was not ready within {} s: {}",
                        dep.name,
                        dep.node,
                        dep.host,
                        limit
                            .max(Duration::from_secs(dep.startup_timeout_s))
                            .as_secs(),
                        remote_views(&ctx.table, d, &dep.node)
                    ));
                }
                _ => all_ready = false,
            }
        }
        if all_ready {
            return DepsOutcome::Ready;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            cmd = rx.recv() => match cmd {
                Some(Cmd::Stop { done, .. }) => return DepsOutcome::Stop(done),
                // Not started yet: a restart changes nothing.
                Some(Cmd::Restart { .. }) => {}
                None => return DepsOutcome::Stop(oneshot::channel().0),
            },
            // Wake up now and then to check the remote deadline.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::testing;

    #[test]
    fn a_remote_dependency_that_times_out_is_named_with_both_views() {
        let plan = testing::plan(
            "a",
            vec![
                testing::tcp_service("proxy", "a", 8000),
                testing::tcp_service("decode-0", "b", 8100),
            ],
        );
        let t = Table::new(&plan, "a");
        t.run_started(1, None, ServiceState::Healthy);
        assert_eq!(
            remote_views(&t, 1, "b"),
            "this node sees it healthy, node b has reported nothing of it (its supervisor not reached)"
        );
        t.set_reported("b", &[("decode-0".into(), ServiceState::Starting)]);
        assert_eq!(
            remote_views(&t, 1, "b"),
            "this node sees it healthy, node b reports it starting"
        );
    }
}
