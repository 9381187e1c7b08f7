//! One change, planned and carried out: the wanted plan (from the topology the cluster
//! keeps, or the one the client sent), what differs from the plan that runs
//! (`plan::diff`), the checks, then the steps on each node — the leaving instances whose
//! GPUs new ones take first (`plan::order`), new capacity next, changed instances one at a
//! time, the other removals last, the proxy's settings in place. The wanted plan keeps each
//! instance that stays on the GPUs and ports it runs on (`plan::held`).

use super::context::{Inner, Progress};
use super::drain::Drainer;
use super::journal::{Journal, JournalError, JournalKind};
use crate::control::client::ChangeEnd;
use crate::control::operation::now_ms;
use crate::control::operation::{ChangeOptions, ChangeRequest};
use crate::control::{Request, StatusReport};
use crate::plan::diff::{PlanDiff, diff};
use crate::plan::order::{FreeFirst, Frees, free_first};
use crate::plan::resolve::LoadedPlan;
use crate::plan::source::{ClusterSource, scalable_role};
use crate::plan::{Holdings, Plan};
use crate::supervisor::StateDir;
use crate::vocab::{Role, Service};
use std::sync::Mutex;
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
    // The instances the change keeps stay on the GPUs and ports they run on (plan::held).
    let held = Holdings::of(&running);
    let what = change.describe();
    match change {
        ChangeRequest::Scale {
            counts,
            expect,
            how,
        } => {
            if let Some(refusal) = stale(&running, expect) {
                return refused(refusal);
            }
            let scale = Scale {
                counts: &counts,
                how: &how,
                what: &what,
            };
            scale.carry_out(inner, running, &held, progress).await
        }
        ChangeRequest::Apply { source, how } => {
            let wanted = match source.plan(&inner.nodes.here, &how.state_root, &held) {
                Ok(w) => w,
                Err(e) => return refused(format!("{e}")),
            };
            if let Some(v) = &wanted.version_note {
                return refused(v.refusal.to_string());
            }
            let sources = (ClusterSource::read(&inner.state_dir)?, Some(*source));
            let change = Change::new(inner, running, wanted, sources, &how, progress);
            change.run(&what).await
        }
        ChangeRequest::Restart {
            targets,
            drained,
            rolling,
            how,
        } => {
            let services = match restart_targets(&running, &targets, rolling) {
                Ok(s) => s,
                Err(e) => return refused(e),
            };
            journaled_restart(
                inner,
                &running,
                what,
                services,
                drained || rolling,
                &how,
                progress,
            )
            .await
        }
    }
}

/// A `pdctl scale` (or a rebalancer's move) not refused as stale.
struct Scale<'a> {
    counts: &'a [(String, u32)],
    how: &'a ChangeOptions,
    what: &'a str,
}

impl Scale<'_> {
    /// The topology the cluster runs with the new counts, planned and carried out; refused
    /// when the cluster was started from a plan file, a role cannot be scaled, or the
    /// topology's rules refuse a count.
    async fn carry_out(
        &self,
        inner: &Inner,
        running: Plan,
        held: &Holdings,
        progress: &Progress,
    ) -> anyhow::Result<End> {
        let from_source = ClusterSource::read(&inner.state_dir)?;
        let Some(mut source) = from_source.clone() else {
            return refused(format!(
                "cluster {} was started from a plan file, not a topology: scale needs its topology (use `pdctl apply -f FILE`)",
                running.cluster
            ));
        };
        let asked: Vec<String> = self
            .counts
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        for (role, n) in self.counts {
            if scalable_role(role).is_none() {
                return refused(format!(
                    "`{role}={n}`: only prefill and decode can be scaled"
                ));
            }
            source.scaled.insert(role.clone(), *n);
        }
        // A count the topology's rules refuse is the scale's fault, not the file's.
        let wanted = match source.plan(&inner.nodes.here, &self.how.state_root, held) {
            Ok(w) => w,
            Err(e) => {
                return refused(format!(
                    "`pdctl scale {}` makes a topology pdctl cannot run; nothing was changed:\n{e}",
                    asked.join(" ")
                ));
            }
        };
        let sources = (from_source, Some(source));
        let change = Change::new(inner, running, wanted, sources, self.how, progress);
        change.run(self.what).await
    }
}

/// The prefill and decode instances `plan` runs.
pub fn split_of(plan: &Plan) -> crate::vocab::Split {
    crate::vocab::Split {
        prefill: plan.by_role(Role::Prefill).count() as u32,
        decode: plan.by_role(Role::Decode).count() as u32,
    }
}

/// The first words of the refusal of a change decided on a split that no longer runs.
pub const REFUSED_AS_STALE: &str = "refused as stale";

/// Why a scale decided on the split `expect` must not run on `running` (None: it may).
/// A rebalancer's move is judged on figures read over seconds; a `pdctl scale` that
/// ended meanwhile must not be undone by counts judged on the split before it.
fn stale(running: &Plan, expect: Option<crate::vocab::Split>) -> Option<String> {
    let expect = expect?;
    let now = split_of(running);
    (now != expect).then(|| {
        format!(
            "{REFUSED_AS_STALE}: the move was judged on {expect}, but {now} runs now (changed meanwhile); nothing was changed"
        )
    })
}

/// `pdctl restart` of `services`, journaled from its first step to its end.
async fn journaled_restart(
    inner: &Inner,
    running: &Plan,
    what: String,
    services: Vec<String>,
    drained: bool,
    how: &ChangeOptions,
    progress: &Progress,
) -> anyhow::Result<End> {
    let mut journal = Journal {
        what,
        started_ms: now_ms(),
        kind: JournalKind::Restart {
            services: services.clone(),
            drained,
        },
        how: how.clone(),
        step: "planned".into(),
        told: Vec::new(),
        done: Vec::new(),
        undoing: false,
    };
    journal.write(&inner.state_dir)?;
    let end = restart(
        inner,
        running,
        &services,
        drained,
        how,
        progress,
        &mut journal,
    )
    .await;
    Journal::clear(&inner.state_dir)?;
    end
}

/// Writes the cluster's topology.json (synced), or removes it when the cluster has none
/// (it was started from a plan file).
pub fn write_source(dir: &std::path::Path, source: Option<&ClusterSource>) -> anyhow::Result<()> {
    let path = dir.join(crate::plan::source::SOURCE_FILE);
    match source {
        Some(s) => {
            let json = serde_json::to_vec_pretty(s).expect("sources serialize");
            crate::supervisor::write_atomic(&path, &json)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
        }
        None => match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => anyhow::bail!("cannot remove {}: {e}", path.display()),
        },
    }
}

/// The plan the supervisor runs now (it keeps plan.json in step with every change).
pub fn read_plan(state_dir: &std::path::Path) -> anyhow::Result<Plan> {
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

/// The services `pdctl restart` names: each target a service or (every instance of) a
/// role; `--rolling` takes roles only. Err: the refusal.
fn restart_targets(
    running: &Plan,
    targets: &[String],
    rolling: bool,
) -> Result<Vec<String>, String> {
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
            return Err(format!(
                "--rolling takes roles (prefill, decode), not {}",
                not_roles.join(", ")
            ));
        }
    }
    expand(running, targets)
}

/// `pdctl restart`: each of `services` restarted by the supervisor of its node; drained
/// ones (`--drain`, `--rolling`) one at a time without failing a request. Each step is
/// journaled before it is taken; the ones in `journal.done` are skipped (a restart taken
/// up again after the head's supervisor stopped).
pub async fn restart(
    inner: &Inner,
    running: &Plan,
    services: &[String],
    drained: bool,
    how: &ChangeOptions,
    progress: &Progress,
    journal: &mut Journal,
) -> anyhow::Result<End> {
    let dir = &inner.state_dir;
    let drainer = drainer(inner, running, running, how, progress);
    let mut failed = Vec::new();
    let todo: Vec<&String> = services
        .iter()
        .filter(|n| !journal.done.contains(n))
        .collect();
    for name in todo {
        let owner = running
            .service(name)
            .map_or(inner.nodes.here.clone(), |s| s.node.clone());
        let t = Instant::now();
        progress.step(&format!("{name}: restarting"));
        journal.step(dir, &format!("{name}: restart on node {owner}"))?;
        if drained {
            if let Err(e) = drainer.restart_drained(name, &owner).await {
                progress.warn(&format!("{name}: {e:#}"));
                failed.push(name.clone());
                break;
            }
            progress.line(&format!(
                "{name} restarted after draining and healthy again ({:.1} s)",
                t.elapsed().as_secs_f64()
            ));
        } else {
            let req = Request::Restart {
                service: name.clone(),
            };
            match drainer.ask(&owner, req).await {
                Ok(message) => progress.line(&message),
                Err(e) => {
                    progress.warn(&format!("{name}: {e:#}"));
                    failed.push(name.clone());
                    continue;
                }
            }
        }
        journal.finished(dir, name)?;
    }
    let left: Vec<&String> = services
        .iter()
        .filter(|n| !journal.done.contains(n) && !failed.contains(n))
        .collect();
    Ok(if failed.is_empty() {
        done(format!("restarted {}", services.join(", ")))
    } else {
        ChangeEnd {
            code: 1,
            message: format!(
                "not restarted: {}{}; every instance is in routing or on its way back",
                failed.join(", "),
                if left.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (and, a drained restart stopping at the first failure, not tried: {})",
                        left.iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ),
            needs_recreate: false,
        }
    })
}

/// The drainer of a change from `running` to `wanted`: its proxy (as it runs), the node
/// whose supervisor it follows, each service's start-up limit.
fn drainer<'a>(
    inner: &'a Inner,
    running: &Plan,
    wanted: &Plan,
    how: &ChangeOptions,
    progress: &'a Progress,
) -> Drainer<'a> {
    let proxy = running.services.iter().find(|s| s.role == Role::Proxy);
    let startup = running
        .services
        .iter()
        .chain(&wanted.services)
        .map(|s| {
            // Its supervisor fails it at its own limit; the stop before a restart comes on top.
            let limit = Duration::from_secs(s.startup_timeout_s.saturating_add(60));
            (s.name.clone(), limit)
        })
        .collect();
    Drainer {
        nodes: &inner.nodes,
        proxy_url: running.proxy_url.clone(),
        proxy_node: proxy.map_or(inner.nodes.here.clone(), |p| p.node.clone()),
        timeout: Duration::from_secs(how.drain_timeout_s),
        startup,
        progress,
        http: super::drain::metrics_client(),
    }
}

/// How long a node's fetch of the model is waited for: it is judged by its progress there
/// (no byte for a while is a stall, tried again, then an error), not by a time limit.
const FETCH_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// A change that ended with `code` before its first step: nothing was changed.
fn failed_before(why: String, code: u8) -> End {
    ChangeEnd {
        code,
        message: format!("{why}\nnothing was changed"),
        needs_recreate: false,
    }
}

/// What turning the running cluster into the wanted plan takes.
pub struct Change<'a> {
    inner: &'a Inner,
    running: Plan,
    wanted: Plan,
    /// topology.json before and after.
    sources: (Option<ClusterSource>, Option<ClusterSource>),
    diff: PlanDiff,
    /// The removals that go before the new capacity: their GPUs are what it starts on.
    free_first: Vec<FreeFirst>,
    /// What pre-flight found wrong with the instances to add on this node.
    problems: Vec<String>,
    how: &'a ChangeOptions,
    progress: &'a Progress,
    /// The journal, written before each step.
    journal: Mutex<Option<Journal>>,
}

impl<'a> Change<'a> {
    /// The change from `running` to `wanted`, checked as `up` checks a cluster (the
    /// machine's GPUs are asked here, before anything waits).
    fn new(
        inner: &'a Inner,
        running: Plan,
        wanted: LoadedPlan,
        sources: (Option<ClusterSource>, Option<ClusterSource>),
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
        let mut c = Change::between(inner, running, wanted.plan, sources, how, progress);
        c.problems = problems;
        c
    }

    /// The change from `running` to `wanted` as a journal names it: already checked when
    /// it was first asked for (finishing or undoing it after the head's supervisor
    /// stopped).
    pub fn between(
        inner: &'a Inner,
        running: Plan,
        wanted: Plan,
        sources: (Option<ClusterSource>, Option<ClusterSource>),
        how: &'a ChangeOptions,
        progress: &'a Progress,
    ) -> Change<'a> {
        let mut running = running;
        // The table the rebalancer judges by is the kept topology's (an `apply` that only
        // changes it leaves plan.json as it was).
        if let Some(Ok(kept)) = sources.0.as_ref().map(|s| s.rebalance()) {
            running.rebalance = kept;
        }
        let diff = diff(&running, &wanted);
        Change {
            inner,
            free_first: free_first(&running, &wanted, &diff),
            diff,
            running,
            wanted,
            sources,
            problems: Vec::new(),
            how,
            progress,
            journal: Mutex::new(None),
        }
    }

    /// The same change the other way round: what undoing it takes.
    fn reversed(&self) -> Change<'a> {
        Change::between(
            self.inner,
            self.wanted.clone(),
            self.running.clone(),
            (self.sources.1.clone(), self.sources.0.clone()),
            self.how,
            self.progress,
        )
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

    /// Says the change, refuses it or carries it out (journaled; undone if a step fails).
    async fn run(&self, what: &str) -> anyhow::Result<End> {
        let d = &self.diff;
        let cluster = &self.running.cluster;
        if d.is_empty() {
            return self.only_rebalance();
        }
        for line in d.lines() {
            self.progress.line(&format!("  {line}"));
        }
        for first in &self.free_first {
            self.progress.line(&format!("  first: {}", first.line()));
        }
        let new_warnings = self
            .wanted
            .warnings
            .iter()
            .filter(|w| !self.running.warnings.contains(w));
        for w in new_warnings {
            self.progress.warn(w);
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
        if let Some(end) = self.fetch_first().await {
            return Ok(end);
        }
        let started = Instant::now();
        self.begin_journal(what)?;
        match self.make().await {
            Ok(()) => Ok(done(format!(
                "cluster {cluster} changed in {:.1} s",
                started.elapsed().as_secs_f64()
            ))),
            Err(e) => Ok(self.undo_after(e).await),
        }
    }

    /// The model fetched on each node that gets new engines, where its cache lacks it,
    /// before any of them starts: here with its progress lines, on another node by its
    /// own supervisor (asked over the control channel; its lines go to that node's log).
    /// The end of the change when that fails (nothing was changed yet).
    async fn fetch_first(&self) -> Option<End> {
        let p = self.progress;
        let planned = self.wanted.model_fetch.as_ref()?;
        let here = &self.inner.nodes.here;
        let added: Vec<&Service> = self
            .diff
            .added
            .iter()
            .map(|n| self.service(n))
            .filter(|s| s.role.is_engine())
            .collect();
        let mut elsewhere: std::collections::BTreeMap<&str, Vec<Role>> = Default::default();
        for s in added.iter().filter(|s| &s.node != here) {
            elsewhere.entry(s.node.as_str()).or_default().push(s.role);
        }
        for (node, roles) in elsewhere {
            p.step(&format!("fetching the model on node {node}"));
            p.line(&format!(
                "node {node}: fetching {} there if its cache lacks it (its progress goes to that node's supervisor log)",
                planned.model
            ));
            let req = Request::FetchModel {
                source: Box::new(planned.clone()),
                roles,
            };
            match self.inner.nodes.answer(node, &req, FETCH_WAIT).await {
                Ok(crate::control::Response::Done { message }) => {
                    p.line(&format!("node {node}: {message}"))
                }
                Ok(crate::control::Response::Finished { code, message, .. }) => {
                    return Some(failed_before(format!("node {node}: {message}"), code));
                }
                Ok(other) => {
                    return Some(failed_before(
                        format!("node {node}: asked to fetch the model, it answered {other:?}"),
                        1,
                    ));
                }
                Err(e) => return Some(failed_before(format!("{e:#}"), 1)),
            }
        }
        let names: Vec<String> = added.iter().map(|s| s.name.clone()).collect();
        let hidden = match crate::control::hidden_env::kept(&self.inner.state_dir) {
            Ok(h) => h,
            Err(e) => return Some(failed_before(format!("{e}"), 1)),
        };
        let source = super::fetch::planned_source(&self.wanted, here, Some(&names), &hidden)?;
        p.step("fetching the model before the new engines start");
        match super::fetch::fetch_here(source, here, p).await {
            Ok(_) => None,
            Err(e) => Some(failed_before(
                format!("{e}"),
                if e.is_usage() { 2 } else { 1 },
            )),
        }
    }

    /// Nothing to change in what runs: a changed `[rebalance]` table is still kept (the
    /// topology `scale` and the rebalancer read), which the rebalancer takes at its next
    /// look.
    fn only_rebalance(&self) -> anyhow::Result<End> {
        let cluster = &self.running.cluster;
        if self.diff.rebalance.is_none() || self.sources.1.is_none() {
            return Ok(done(format!(
                "cluster {cluster} already runs what the topology describes; nothing to change"
            )));
        }
        for line in self.diff.lines() {
            self.progress.line(&format!("  {line}"));
        }
        if self.how.dry_run {
            return Ok(done("dry run: nothing was changed"));
        }
        write_source(&self.inner.state_dir, self.sources.1.as_ref())?;
        Ok(done(format!(
            "cluster {cluster}: the [rebalance] table is kept; the rebalancer takes it at its next look"
        )))
    }

    /// The journal of this change, on disk before its first step.
    fn begin_journal(&self, what: &str) -> anyhow::Result<()> {
        let journal = Journal {
            what: what.to_string(),
            started_ms: now_ms(),
            kind: JournalKind::Plans {
                from: Box::new(self.running.clone()),
                wanted: Box::new(self.wanted.clone()),
                from_source: self.sources.0.clone().map(Box::new),
                wanted_source: self.sources.1.clone().map(Box::new),
            },
            how: self.how.clone(),
            step: "planned".into(),
            told: Vec::new(),
            done: Vec::new(),
            undoing: false,
        };
        journal.write(&self.inner.state_dir)?;
        self.set_journal(journal);
        Ok(())
    }

    /// Follows (and keeps writing) `journal` from now on.
    pub fn set_journal(&self, journal: Journal) {
        *self.journal.lock().unwrap_or_else(|e| e.into_inner()) = Some(journal);
    }

    /// Updates the journal and writes it (synced) before the step it now names.
    fn journal(
        &self,
        f: impl FnOnce(&mut Journal, &std::path::Path) -> Result<(), JournalError>,
    ) -> anyhow::Result<()> {
        let mut j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
        match j.as_mut() {
            Some(j) => Ok(f(j, &self.inner.state_dir)?),
            None => Ok(()),
        }
    }

    /// Carries the change out, then keeps its topology and forgets its journal.
    pub async fn make(&self) -> anyhow::Result<()> {
        self.steps().await?;
        write_source(&self.inner.state_dir, self.sources.1.as_ref())?;
        Journal::clear(&self.inner.state_dir)?;
        Ok(())
    }

    /// A step failed with `e`: the change is undone (journaled as such) so the cluster
    /// runs what it ran before; the end saying both.
    pub async fn undo_after(&self, e: anyhow::Error) -> End {
        self.progress.warn(&format!(
            "the change stopped: {e:#}; undoing it (back to the plan that ran before)"
        ));
        let back = self.reversed();
        let journal = self
            .journal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(mut j) = journal {
            j.undoing = true;
            back.set_journal(j);
        }
        let message = match back.make().await {
            Ok(()) => format!(
                "the change stopped: {e:#}\nit was undone: cluster {} runs what it ran before",
                self.running.cluster
            ),
            Err(u) => {
                // Nothing better is known than what runs: the next change starts from it.
                let _ = Journal::clear(&self.inner.state_dir);
                format!(
                    "the change stopped: {e:#}\nundoing it failed too: {u:#}\n`pdctl status` shows what runs now"
                )
            }
        };
        ChangeEnd {
            code: 1,
            message,
            needs_recreate: false,
        }
    }

    /// Every node's supervisor, this one first.
    fn all_nodes(&self) -> Vec<String> {
        std::iter::once(self.inner.nodes.here.clone())
            .chain(self.inner.nodes.others().cloned())
            .collect()
    }

    /// Sends `req` (made anew per node) to every node's supervisor, `first` first; each
    /// node that answered is journaled.
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
            self.journal(|j, dir| j.told(dir, node))?;
            if i == 0 {
                message = m;
            }
        }
        Ok(message)
    }

    /// The step `step` is next: `status` and the journal say so.
    fn next(&self, step: &str, shown: &str) -> anyhow::Result<()> {
        self.progress.step(shown);
        self.journal(|j, dir| j.step(dir, step))
    }

    /// New capacity first: every node learns of it, its own node starts it; then each is
    /// waited for until healthy and routed.
    async fn add_steps(&self, drainer: &Drainer<'_>) -> anyhow::Result<()> {
        let p = self.progress;
        for name in &self.diff.added {
            let svc = self.service(name);
            self.next(
                &format!("{name}: add on node {}", svc.node),
                &format!("{name}: starting on node {}", svc.node),
            )?;
            let message = self
                .everywhere(drainer, &svc.node, || Request::Add {
                    service: Box::new(svc.clone()),
                    settings: self.settings(name),
                })
                .await?;
            p.line(&message);
        }
        for name in &self.diff.added {
            let svc = self.service(name);
            let t = Instant::now();
            self.next(
                &format!("{name}: wait until healthy"),
                &format!("{name}: waiting until healthy"),
            )?;
            drainer.wait_healthy(&svc.node, name, None).await?;
            drainer
                .wait_healthy(&drainer.proxy_node, name, None)
                .await?;
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
        Ok(())
    }

    /// The change's steps: the leaving instances whose GPUs new ones take first, then new
    /// capacity, changed instances one at a time, the other removals last, the proxy's
    /// settings in place (plan::order says why that order).
    async fn steps(&self) -> anyhow::Result<()> {
        let d = &self.diff;
        let p = self.progress;
        let drainer = drainer(self.inner, &self.running, &self.wanted, self.how, p);
        for first in &self.free_first {
            let name = &first.instance;
            match first.frees {
                Frees::Leaves => self.remove_step(&drainer, name, Some(first)).await?,
                Frees::Shrinks { .. } => self.roll_step(&drainer, name, Some(first)).await?,
            }
        }
        self.add_steps(&drainer).await?;
        let went_first = |name: &String| self.free_first.iter().any(|f| &f.instance == name);
        for (name, _) in d.rolled.iter().filter(|(n, _)| !went_first(n)) {
            self.roll_step(&drainer, name, None).await?;
        }
        for name in d.removed.iter().filter(|n| !went_first(n)) {
            self.remove_step(&drainer, name, None).await?;
        }
        self.proxy_settings(&drainer).await
    }

    /// Restarts the changed instance `name` with its new settings, after the proxy drained
    /// it: every node keeps the new spec, its own node restarts it. `first` when it goes
    /// before the new capacity that shares its GPUs.
    async fn roll_step(
        &self,
        drainer: &Drainer<'_>,
        name: &str,
        first: Option<&FreeFirst>,
    ) -> anyhow::Result<()> {
        let svc = self.service(name);
        let t = Instant::now();
        let before = first.map_or(String::new(), |f| {
            format!(", before {} starts", starters(f))
        });
        self.next(
            &format!("{name}: new settings, restart on node {}{before}", svc.node),
            &format!("{name}: restarting with its new settings{before}"),
        )?;
        self.everywhere(drainer, &svc.node, || Request::Replace {
            service: Box::new(svc.clone()),
            settings: self.settings(name),
        })
        .await?;
        drainer.restart_drained(name, &svc.node).await?;
        self.progress.line(&format!(
            "{name}: restarted with its new settings after draining ({:.1} s){}",
            t.elapsed().as_secs_f64(),
            first.map_or(String::new(), |f| format!(
                "; its GPUs have room for {} now",
                starters(f)
            ))
        ));
        Ok(())
    }

    /// Drains, stops and removes the leaving instance `name` on its node; `first` when it
    /// goes before the new capacity that takes its GPUs.
    async fn remove_step(
        &self,
        drainer: &Drainer<'_>,
        name: &str,
        first: Option<&FreeFirst>,
    ) -> anyhow::Result<()> {
        let p = self.progress;
        let t = Instant::now();
        let old = self.running.service(name);
        let owner = old.map_or(self.inner.nodes.here.clone(), |s| s.node.clone());
        let starters = first.map(starters);
        let before = starters.as_ref().map_or(String::new(), |s| {
            format!(", before {s} starts on its GPUs")
        });
        self.next(
            &format!("{name}: drain, stop and remove on node {owner}{before}"),
            &format!("{name}: draining, then stopping on node {owner}{before}"),
        )?;
        self.wait_dependants_started(drainer, name).await;
        drainer.remove_drained(name, &owner).await?;
        drainer
            .wait_routed(name, old.and_then(|s| s.url.as_deref()), false)
            .await;
        p.line(&format!(
            "{name}: drained, stopped and removed{} ({:.1} s){}",
            if owner == self.inner.nodes.here {
                String::new()
            } else {
                format!(" on node {owner}")
            },
            t.elapsed().as_secs_f64(),
            starters.map_or(String::new(), |s| format!(
                "; its GPUs are free for {s}, one instance fewer serves until it is healthy"
            ))
        ));
        Ok(())
    }

    /// Waits, each within its start-up limit, until no service that depends on `name`
    /// still waits for its dependencies to start: removing `name` under it would fail it.
    /// That happens when the head's supervisor takes a change up at its start, while the
    /// cluster it started is still coming up (the proxy waits for every engine), and the
    /// change's first step is a removal (one that frees a GPU, plan::order).
    async fn wait_dependants_started(&self, drainer: &Drainer<'_>, name: &str) {
        let dependants = self
            .running
            .services
            .iter()
            .filter(|s| s.depends_on.iter().any(|d| d == name));
        for dependant in dependants {
            let end = Instant::now() + Duration::from_secs(dependant.startup_timeout_s + 60);
            loop {
                // A node that does not answer is the removal's own error to report.
                let Ok(report) = self
                    .inner
                    .nodes
                    .status(&dependant.node, drainer.timeout)
                    .await
                else {
                    break;
                };
                let pending = report.services.iter().any(|s| {
                    s.name == dependant.name && s.state == crate::control::ServiceState::Pending
                });
                if !pending || Instant::now() >= end {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
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
        self.next(
            &format!("{}: new settings", proxy.name),
            &format!("{}: new settings", proxy.name),
        )?;
        self.everywhere(drainer, &proxy.node, || Request::Replace {
            service: Box::new(proxy.clone()),
            settings: self.settings(&proxy.name),
        })
        .await?;
        if !d.proxy_live.is_empty() {
            let t = Instant::now();
            let report: StatusReport = self
                .inner
                .nodes
                .status(&proxy.node, drainer.timeout)
                .await?;
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

/// The instances that start on the GPUs `f` frees, for progress lines.
fn starters(f: &FreeFirst) -> String {
    let names: Vec<&str> = f.taken_by.iter().map(|(s, _)| s.as_str()).collect();
    names.join(", ")
}

#[cfg(test)]
mod stale_tests {
    use super::*;
    use crate::vocab::{Service, Split};

    #[test]
    fn a_scale_judged_on_another_split_is_refused_as_stale() {
        let svc = |name: &str, role| Service::new(name, role, "n", ["true"]);
        let running = Plan::for_tests(
            "n",
            vec![
                svc("prefill-0", Role::Prefill),
                svc("prefill-1", Role::Prefill),
                svc("decode-0", Role::Decode),
                svc("decode-1", Role::Decode),
                svc("decode-2", Role::Decode),
            ],
        );
        let s = |prefill, decode| Some(Split { prefill, decode });
        assert_eq!(stale(&running, None), None, "pdctl scale: whatever runs");
        assert_eq!(stale(&running, s(2, 3)), None);
        let e = stale(&running, s(2, 2)).unwrap();
        assert!(
            e.starts_with("refused as stale: the move was judged on 2P2D, but 2P3D runs now"),
            "{e}"
        );
    }
}
