//! One change, planned and carried out: the wanted plan (from the topology the cluster
//! keeps, or the one the client sent), what differs from the plan that runs
//! (`plan::diff`), the checks, then the steps on each node — new capacity first, changed
//! instances one at a time, removals last, the proxy's settings in place.

use super::drain::Drainer;
use super::engine::{Inner, Progress};
use crate::control::client::ChangeEnd;
use crate::control::operation::{ChangeOptions, ChangeRequest};
use crate::control::{Request, StatusReport};
use crate::plan::Plan;
use crate::plan::diff::{PlanDiff, diff};
use crate::plan::resolve::LoadedPlan;
use crate::plan::source::{ClusterSource, scalable_role};
use crate::supervisor::StateDir;
use crate::vocab::{Role, Service};
use std::time::{Duration, Instant};

/// How a change ended.
type End = ChangeEnd;

fn refused(message: impl Into<String>) -> anyhow::Result<End> {
    Ok(ChangeEnd {
        code: 2,
        message: message.into(),
        needs_recreate: false,
    })
}

fn done(message: impl Into<String>) -> End {
    ChangeEnd {
        code: 0,
        message: message.into(),
        needs_recreate: false,
    }
}

/// Plans and carries out `change`.
pub async fn carry_out(
    inner: &Inner,
    change: ChangeRequest,
    progress: &Progress,
) -> anyhow::Result<End> {
    let running = read_plan(&inner.state_dir)?;
    match change {
        ChangeRequest::Scale { counts, how } => {
            let Some(mut source) = ClusterSource::read(&inner.state_dir)? else {
                return refused(format!(
                    "cluster {} was started from a plan file, not a topology: scale needs its topology (use `pdctl apply -f FILE`)",
                    running.cluster
                ));
            };
            let asked: Vec<String> = counts.iter().map(|(r, n)| format!("{r}={n}")).collect();
            for (role, n) in &counts {
                if scalable_role(role).is_none() {
                    return refused(format!(
                        "`{role}={n}`: only prefill and decode can be scaled"
                    ));
                }
                source.scaled.insert(role.clone(), *n);
            }
            // A count the topology's rules refuse is the scale's fault, not the file's.
            let wanted = match source.plan(&inner.nodes.here, &how.state_root) {
                Ok(w) => w,
                Err(e) => {
                    return refused(format!(
                        "`pdctl scale {}` makes a topology pdctl cannot run; nothing was changed:\n{e}",
                        asked.join(" ")
                    ));
                }
            };
            let change = Change::new(inner, running, wanted, &how, progress);
            let end = change.run().await?;
            if end.code == 0 && !how.dry_run {
                source.write(&inner.state_dir)?;
            }
            Ok(end)
        }
        ChangeRequest::Apply { source, how } => {
            let wanted = match source.plan(&inner.nodes.here, &how.state_root) {
                Ok(w) => w,
                Err(e) => return refused(format!("{e}")),
            };
            if let Some(v) = &wanted.version_note {
                return refused(v.refusal.to_string());
            }
            let change = Change::new(inner, running, wanted, &how, progress);
            let end = change.run().await?;
            if end.code == 0 && !how.dry_run {
                source.write(&inner.state_dir)?;
            }
            Ok(end)
        }
        ChangeRequest::Restart {
            targets,
            drained,
            rolling,
            how,
        } => restart(inner, &running, &targets, drained, rolling, &how, progress).await,
    }
}

/// The plan the supervisor runs now (it keeps plan.json in step with every change).
fn read_plan(state_dir: &std::path::Path) -> anyhow::Result<Plan> {
    let path = StateDir::new(state_dir).plan_path();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not a plan pdctl wrote: {e}", path.display()))
}

/// Service names for restart targets: a role stands for every instance of it.
fn expand(plan: &Plan, targets: &[String]) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for t in targets {
        let matched: Vec<String> = plan
            .services
            .iter()
            .filter(|s| s.name == *t || s.role.as_str() == t)
            .map(|s| s.name.clone())
            .collect();
        if matched.is_empty() {
            let known: Vec<&str> = plan.services.iter().map(|s| s.name.as_str()).collect();
            return Err(format!(
                "`{t}` is neither a service nor a role of cluster {}; services: {}",
                plan.cluster,
                known.join(", ")
            ));
        }
        for m in matched {
            if !names.contains(&m) {
                names.push(m);
            }
        }
    }
    Ok(names)
}

/// `pdctl restart`: each target restarted by the supervisor of its node; drained ones
/// (`--drain`, `--rolling`) one at a time without failing a request.
async fn restart(
    inner: &Inner,
    running: &Plan,
    targets: &[String],
    drained: bool,
    rolling: bool,
    how: &ChangeOptions,
    progress: &Progress,
) -> anyhow::Result<End> {
    if rolling {
        let not_roles: Vec<&str> = targets
            .iter()
            .filter(|t| {
                !running
                    .services
                    .iter()
                    .any(|s| s.role.as_str() == t.as_str())
            })
            .map(String::as_str)
            .collect();
        if !not_roles.is_empty() {
            return refused(format!(
                "--rolling takes roles (prefill, decode), not {}",
                not_roles.join(", ")
            ));
        }
    }
    let services = match expand(running, targets) {
        Ok(s) => s,
        Err(e) => return refused(e),
    };
    let drainer = drainer(inner, running, how, progress);
    let mut failed = Vec::new();
    for name in &services {
        let owner = running
            .service(name)
            .map_or(inner.nodes.here.clone(), |s| s.node.clone());
        let t = Instant::now();
        progress.step(&format!("{name}: restarting"));
        if drained || rolling {
            drainer.restart_drained(name, &owner).await?;
            progress.line(&format!(
                "{name} restarted after draining and healthy again ({:.1} s)",
                t.elapsed().as_secs_f64()
            ));
            continue;
        }
        let req = Request::Restart {
            service: name.clone(),
        };
        match drainer.ask(&owner, req).await {
            Ok(message) => progress.line(&message),
            Err(e) => {
                progress.warn(&format!("{name}: {e:#}"));
                failed.push(name.clone());
            }
        }
    }
    Ok(if failed.is_empty() {
        done(format!("restarted {}", services.join(", ")))
    } else {
        ChangeEnd {
            code: 1,
            message: format!("not restarted: {}", failed.join(", ")),
            needs_recreate: false,
        }
    })
}

/// The drainer of `running`'s cluster: its proxy, and the node whose supervisor it follows.
fn drainer<'a>(
    inner: &'a Inner,
    running: &Plan,
    how: &ChangeOptions,
    progress: &'a Progress,
) -> Drainer<'a> {
    let proxy = running.services.iter().find(|s| s.role == Role::Proxy);
    Drainer {
        nodes: &inner.nodes,
        proxy_url: running.proxy_url.clone(),
        proxy_node: proxy.map_or(inner.nodes.here.clone(), |p| p.node.clone()),
        timeout: Duration::from_secs(how.drain_timeout_s),
        progress,
    }
}

/// What turning the running cluster into the wanted plan takes.
struct Change<'a> {
    inner: &'a Inner,
    running: Plan,
    wanted: Plan,
    diff: PlanDiff,
    /// What pre-flight found wrong with the instances to add on this node.
    problems: Vec<String>,
    how: &'a ChangeOptions,
    progress: &'a Progress,
}

impl<'a> Change<'a> {
    /// The change from `running` to `wanted`, checked as `up` checks a cluster (the
    /// machine's GPUs are asked here, before anything waits).
    fn new(
        inner: &'a Inner,
        running: Plan,
        wanted: LoadedPlan,
        how: &'a ChangeOptions,
        progress: &'a Progress,
    ) -> Change<'a> {
        let diff = diff(&running, &wanted.plan);
        let problems = if diff.refused.is_empty() && !how.dry_run {
            crate::supervisor::preflight_added(
                &wanted.plan,
                &diff.added,
                &inner.nodes.here,
                &wanted.missing,
                &wanted.machine,
            )
        } else {
            Vec::new()
        };
        Change {
            inner,
            running,
            wanted: wanted.plan,
            diff,
            problems,
            how,
            progress,
        }
    }

    fn service(&self, name: &str) -> &Service {
        self.wanted
            .service(name)
            .expect("the diff names services of the wanted plan")
    }

    /// The wanted plan's typed settings of service `name`, as a control message carries
    /// them.
    fn settings(&self, name: &str) -> Option<Box<crate::child_config::ChildSettings>> {
        self.wanted.settings_of(name).cloned().map(Box::new)
    }

    /// Says the change, refuses it or carries it out.
    async fn run(&self) -> anyhow::Result<End> {
        let d = &self.diff;
        let cluster = &self.running.cluster;
        if d.is_empty() {
            return Ok(done(format!(
                "cluster {cluster} already runs what the topology describes; nothing to change"
            )));
        }
        for line in d.lines() {
            self.progress.line(&format!("  {line}"));
        }
        if !d.refused.is_empty() {
            return Ok(ChangeEnd {
                code: 2,
                message: format!(
                    "cluster {cluster} cannot be changed that way while it runs (the lines marked !); nothing was changed. `pdctl apply --recreate` takes it down and up again to make such a change"
                ),
                needs_recreate: true,
            });
        }
        if self.how.dry_run {
            return Ok(done("dry run: nothing was changed"));
        }
        if !self.problems.is_empty() {
            return refused(format!(
                "the new instances cannot start here; nothing was changed:\n{}",
                crate::supervisor::bullet_list(&self.problems)
            ));
        }
        let started = Instant::now();
        self.steps().await?;
        Ok(done(format!(
            "cluster {cluster} changed in {:.1} s",
            started.elapsed().as_secs_f64()
        )))
    }

    /// Every node's supervisor, this one first.
    fn all_nodes(&self) -> Vec<String> {
        std::iter::once(self.inner.nodes.here.clone())
            .chain(self.inner.nodes.others().cloned())
            .collect()
    }

    /// Sends `req` (made anew per node) to every node's supervisor, `first` first.
    async fn everywhere(
        &self,
        drainer: &Drainer<'_>,
        first: &str,
        req: impl Fn() -> Request,
    ) -> anyhow::Result<String> {
        let mut nodes = self.all_nodes();
        nodes.retain(|n| n != first);
        nodes.insert(0, first.to_string());
        let mut message = String::new();
        for (i, node) in nodes.iter().enumerate() {
            let m = drainer.ask(node, req()).await?;
            if i == 0 {
                message = m;
            }
        }
        Ok(message)
    }

    async fn steps(&self) -> anyhow::Result<()> {
        let d = &self.diff;
        let p = self.progress;
        let drainer = drainer(self.inner, &self.running, self.how, p);
        let proxy_node = drainer.proxy_node.clone();
        // New capacity first: every node learns of it, its own node starts it.
        for name in &d.added {
            let svc = self.service(name);
            p.step(&format!("{name}: starting on node {}", svc.node));
            let message = self
                .everywhere(&drainer, &svc.node, || Request::Add {
                    service: Box::new(svc.clone()),
                    settings: self.settings(name),
                })
                .await?;
            p.line(&message);
        }
        for name in &d.added {
            let svc = self.service(name);
            let t = Instant::now();
            p.step(&format!("{name}: waiting until healthy"));
            drainer.wait_healthy(&svc.node, name, None).await?;
            drainer.wait_healthy(&proxy_node, name, None).await?;
            drainer.wait_routed(name, svc.url.as_deref(), true).await;
            p.line(&format!(
                "{name}: healthy{} ({:.1} s)",
                if svc.node == self.inner.nodes.here {
                    ", in routing".to_string()
                } else {
                    format!(" on node {}, in routing", svc.node)
                },
                t.elapsed().as_secs_f64()
            ));
        }
        // Changed instances one at a time: every node keeps the new spec, its own node
        // restarts it after the proxy drained it.
        for (name, _) in &d.rolled {
            let svc = self.service(name);
            let t = Instant::now();
            p.step(&format!("{name}: restarting with its new settings"));
            self.everywhere(&drainer, &svc.node, || Request::Replace {
                service: Box::new(svc.clone()),
                settings: self.settings(name),
            })
            .await?;
            drainer.restart_drained(name, &svc.node).await?;
            p.line(&format!(
                "{name}: restarted with its new settings after draining ({:.1} s)",
                t.elapsed().as_secs_f64()
            ));
        }
        for name in &d.removed {
            let t = Instant::now();
            let old = self.running.service(name);
            let owner = old.map_or(self.inner.nodes.here.clone(), |s| s.node.clone());
            p.step(&format!("{name}: draining, then stopping on node {owner}"));
            drainer.remove_drained(name, &owner).await?;
            drainer
                .wait_routed(name, old.and_then(|s| s.url.as_deref()), false)
                .await;
            p.line(&format!(
                "{name}: drained, stopped and removed{} ({:.1} s)",
                if owner == self.inner.nodes.here {
                    String::new()
                } else {
                    format!(" on node {owner}")
                },
                t.elapsed().as_secs_f64()
            ));
        }
        self.proxy_settings(&drainer).await
    }

    /// The proxy's new spec: its membership follows the supervisor already; its live
    /// settings follow the spec's revision, the rest its next start.
    async fn proxy_settings(&self, drainer: &Drainer<'_>) -> anyhow::Result<()> {
        let d = &self.diff;
        let p = self.progress;
        let Some(proxy) = self.wanted.services.iter().find(|s| s.role == Role::Proxy) else {
            return Ok(());
        };
        if self.running.service(&proxy.name) == Some(proxy)
            && self.running.settings_of(&proxy.name) == self.wanted.settings_of(&proxy.name)
        {
            return Ok(());
        }
        p.step(&format!("{}: new settings", proxy.name));
        self.everywhere(drainer, &proxy.node, || Request::Replace {
            service: Box::new(proxy.clone()),
            settings: self.settings(&proxy.name),
        })
        .await?;
        if !d.proxy_live.is_empty() {
            let t = Instant::now();
            let report: StatusReport = self.inner.nodes.status(&proxy.node).await?;
            let revision = report
                .services
                .iter()
                .find(|s| s.name == proxy.name)
                .map_or(0, |s| s.revision);
            if drainer.wait_settings(revision).await {
                p.line(&format!(
                    "{}: {} in effect, without a restart ({:.1} s)",
                    proxy.name,
                    d.proxy_live.join(", "),
                    t.elapsed().as_secs_f64()
                ));
            } else {
                p.warn(&format!(
                    "{}: did not confirm its new settings within 10 s; its log says why (`pdctl logs {}`)",
                    proxy.name, proxy.name
                ));
            }
        }
        if !d.proxy_restart.is_empty() {
            p.line(&format!(
                "{}: {} take effect at its next start (`pdctl restart {}`, which cuts its streams); its routing already follows the change",
                proxy.name,
                d.proxy_restart.join(", "),
                proxy.name
            ));
        }
        Ok(())
    }
}
