//! Changing a running cluster while it serves: `pdctl scale ROLE=N`, `pdctl apply` (and
//! `pdctl up` on a cluster that already runs), and the drained restarts `pdctl restart
//! --drain / --rolling` are made of. The client plans the change (`plan::diff` between the
//! plan the supervisor runs and the wanted one) and carries it out step by step over the
//! control socket: new instances start and join the proxy's routing once healthy; removed
//! ones leave routing, finish their requests in flight (up to `--timeout`) and stop,
//! highest-numbered first; changed ones are restarted that way one at a time.

use super::ExitError;
use super::cluster::ClusterArgs;
use super::common::{TopologyArgs, state_root};
use crate::control::{Request, Response, ServiceState, StatusReport, client};
use crate::plan::Plan;
use crate::plan::diff::{PlanDiff, diff};
use crate::plan::source::{ClusterSource, scalable_role};
use crate::supervisor::{StateDir, select};
use crate::vocab::Service;
use clap::Args;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Seconds a drained instance's requests in flight get by default.
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 60;

/// Arguments of `pdctl scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// How many instances each role should have: `decode=2`, `prefill=3 decode=3`.
    #[arg(required = true, value_name = "ROLE=N")]
    pub targets: Vec<String>,
    /// Print what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds a removed instance's requests in flight get before it is stopped anyway.
    #[arg(long, default_value_t = DEFAULT_DRAIN_TIMEOUT_S)]
    pub timeout: u64,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// Arguments of `pdctl apply`.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// The cluster to change (needed when several run under the state root).
    #[arg(long)]
    pub cluster: Option<String>,
    /// Print what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds a drained instance's requests in flight get before it is stopped anyway.
    #[arg(long, default_value_t = DEFAULT_DRAIN_TIMEOUT_S)]
    pub timeout: u64,
    /// When the change cannot be made live (connector, model, node layout...), take the
    /// cluster down and start it again from the file instead of refusing: requests in
    /// flight are cut.
    #[arg(long)]
    pub recreate: bool,
}

/// `pdctl scale ROLE=N...`.
pub fn scale(a: &ScaleArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let mut counts = Vec::new();
    for t in &a.targets {
        let parsed = t
            .split_once('=')
            .and_then(|(r, n)| Some((scalable_role(r.trim())?, n.trim().parse::<u32>().ok()?)));
        match parsed {
            Some(c) => counts.push(c),
            None => {
                return Err(ExitError::usage(format!(
                    "`{t}` is not ROLE=N: write for example decode=2 (roles: prefill, decode)"
                )));
            }
        }
    }
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "scale")?;
    let Some(mut source) = ClusterSource::read(&found.dir)? else {
        return Err(ExitError::usage(format!(
            "cluster {} was started from a plan file, not a topology: scale needs its topology (use `pdctl apply -f FILE`)",
            found.cluster
        )));
    };
    for (role, n) in &counts {
        source.scaled.insert(role.as_str().to_string(), *n);
    }
    let root = state_root(a.which.state_dir.as_deref());
    // A count the topology's rules refuse is the scale's fault, not the file's.
    let wanted = source.plan(&found.node, &root).map_err(|e| {
        ExitError::usage(format!(
            "`pdctl scale {}` makes a topology pdctl cannot run; nothing was changed:\n{e}",
            a.targets.join(" ")
        ))
    })?;
    let change = Change::new(&found, &wanted.plan)?;
    let code = change.carry_out(&rt, a.dry_run, Duration::from_secs(a.timeout), &wanted)?;
    if code == ExitCode::SUCCESS && !a.dry_run {
        source.write(&found.dir)?;
    }
    Ok(code)
}

/// `pdctl apply [-f FILE | -p PROFILE]`, and `pdctl up` on a cluster that runs already.
pub fn apply(a: &ApplyArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let wanted = crate::plan::resolve::resolve(&a.topology.request())?;
    if let Some(v) = &wanted.version_note {
        return Err(anyhow::Error::new(v.refusal.clone()));
    }
    let cluster = a.cluster.clone().or(Some(wanted.plan.cluster.clone()));
    let found = running(&a.topology.state_dir, cluster.as_deref(), "apply")?;
    let change = Change::new(&found, &wanted.plan)?;
    if a.recreate && !a.dry_run && !change.diff.refused.is_empty() {
        return recreate(a, &change, &found, rt);
    }
    let code = change.carry_out(&rt, a.dry_run, Duration::from_secs(a.timeout), &wanted)?;
    if code == ExitCode::SUCCESS && !a.dry_run {
        if let Some(source) = &wanted.source {
            source.write(&found.dir)?;
        }
    }
    Ok(code)
}

/// `apply --recreate` of a change that cannot be made live: down, then up -d from the file.
fn recreate(
    a: &ApplyArgs,
    change: &Change,
    found: &Found,
    rt: tokio::runtime::Runtime,
) -> anyhow::Result<ExitCode> {
    for line in change.diff.lines() {
        println!("  {line}");
    }
    println!(
        "pdctl: --recreate: taking cluster {} down and starting it again from the topology (requests in flight are cut)",
        found.cluster
    );
    let down = super::cluster::DownArgs {
        timeout: 30,
        which: ClusterArgs {
            cluster: Some(found.cluster.clone()),
            state_dir: a.topology.state_dir.clone(),
        },
    };
    let code = super::down::run(&down, rt)?;
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    super::cluster::up(super::cluster::UpArgs {
        topology: a.topology.clone(),
        detach: true,
        plan: None,
        log_max_bytes: crate::supervisor::DEFAULT_MAX_BYTES,
        log_keep: crate::supervisor::DEFAULT_KEEP,
    })
}

/// The running cluster a command acts on.
pub(super) struct Found {
    pub cluster: String,
    pub node: String,
    pub dir: std::path::PathBuf,
    pub socket: std::path::PathBuf,
}

/// The cluster running under the state root (`which` names it when several run); exit 3
/// with `nothing to VERB` when none does.
pub(super) fn running(
    state_dir: &Option<std::path::PathBuf>,
    cluster: Option<&str>,
    verb: &str,
) -> anyhow::Result<Found> {
    let root = state_root(state_dir.as_deref());
    let Some(found) = select::running(&root, cluster)? else {
        return Err(ExitError::nothing_running(format!(
            "no cluster{} is running under {}; nothing to {verb} (`pdctl up` starts one)",
            cluster.map(|c| format!(" {c}")).unwrap_or_default(),
            root.display()
        )));
    };
    let record = found
        .record
        .clone()
        .expect("running clusters have a record");
    Ok(Found {
        cluster: record.cluster.clone(),
        node: record.node.clone(),
        dir: found.state.dir.clone(),
        socket: found.state.socket_path(),
    })
}

/// What turning the running cluster into the wanted plan takes.
struct Change {
    socket: std::path::PathBuf,
    /// The node the supervisor runs (the one whose services change).
    node: String,
    running: Plan,
    wanted: Plan,
    diff: PlanDiff,
}

impl Change {
    fn new(found: &Found, wanted: &Plan) -> anyhow::Result<Change> {
        let running = super::cluster::read_plan(&StateDir::new(&found.dir).plan_path())?;
        let diff = diff(&running, wanted);
        Ok(Change {
            socket: found.socket.clone(),
            node: found.node.clone(),
            running,
            wanted: wanted.clone(),
            diff,
        })
    }

    /// Whether service `name` runs on this supervisor's node.
    fn is_local(&self, name: &str) -> bool {
        self.service(name).node == self.node
    }

    fn service(&self, name: &str) -> &Service {
        self.wanted
            .service(name)
            .expect("the diff names services of the wanted plan")
    }

    /// Prints the change, refuses it or carries it out; exit 1 when a step failed.
    fn carry_out(
        &self,
        rt: &tokio::runtime::Runtime,
        dry_run: bool,
        timeout: Duration,
        wanted: &crate::plan::resolve::LoadedPlan,
    ) -> anyhow::Result<ExitCode> {
        let d = &self.diff;
        if d.is_empty() {
            println!(
                "pdctl: cluster {} already runs what the topology describes; nothing to change",
                self.running.cluster
            );
            return Ok(ExitCode::SUCCESS);
        }
        for line in d.lines() {
            println!("  {line}");
        }
        if !d.refused.is_empty() {
            return Err(ExitError::usage(format!(
                "cluster {} cannot be changed that way while it runs (the lines marked !); nothing was changed. `pdctl apply --recreate` takes it down and up again to make such a change",
                self.running.cluster
            )));
        }
        if dry_run {
            println!("pdctl: dry run: nothing was changed");
            return Ok(ExitCode::SUCCESS);
        }
        let problems = crate::supervisor::preflight_added(
            &self.wanted,
            &d.added,
            &self.node,
            &wanted.missing,
            &wanted.machine,
        );
        if !problems.is_empty() {
            return Err(ExitError::usage(format!(
                "the new instances cannot start here; nothing was changed:\n{}",
                crate::supervisor::bullet_list(&problems)
            )));
        }
        let started = Instant::now();
        let result = rt.block_on(self.steps(timeout));
        match result {
            Ok(()) => {
                println!(
                    "pdctl: cluster {} changed in {:.1} s",
                    self.running.cluster,
                    started.elapsed().as_secs_f64()
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => {
                eprintln!(
                    "pdctl: the change stopped: {e:#}\npdctl: `pdctl status` shows what runs now"
                );
                Ok(ExitCode::from(1))
            }
        }
    }

    async fn steps(&self, timeout: Duration) -> anyhow::Result<()> {
        let d = &self.diff;
        let report = client::status(&self.socket, Duration::from_secs(10)).await?;
        let drainer = Drainer {
            socket: &self.socket,
            proxy_url: report.proxy_url.clone(),
            timeout,
        };
        // New capacity first, then changed instances one at a time, then removals. Steps
        // on another node's services only change what this supervisor follows there: that
        // node's supervisor starts, restarts and stops them when the command runs there.
        let proxy_here = self
            .wanted
            .services
            .iter()
            .any(|s| s.role == crate::vocab::Role::Proxy && s.node == self.node);
        for name in &d.added {
            let message = drainer
                .expect_done(Request::Add {
                    service: Box::new(self.service(name).clone()),
                })
                .await?;
            println!("pdctl: {name}: {message}");
        }
        for name in d.added.iter().filter(|n| self.is_local(n)) {
            let t = Instant::now();
            drainer.wait_healthy(name, None).await?;
            if proxy_here {
                drainer.wait_routed(self.service(name), true).await;
            }
            println!(
                "pdctl: {name}: healthy{} ({:.1} s)",
                if proxy_here {
                    ", in routing"
                } else {
                    "; the proxy routes to it once the same command has run on its node"
                },
                t.elapsed().as_secs_f64()
            );
        }
        for (name, _) in &d.rolled {
            let t = Instant::now();
            drainer
                .expect_done(Request::Replace {
                    service: Box::new(self.service(name).clone()),
                })
                .await?;
            if !self.is_local(name) {
                println!(
                    "pdctl: {name}: runs on node {}; it restarts with its new settings when the same command runs there",
                    self.service(name).node
                );
                continue;
            }
            let report = client::status(&self.socket, Duration::from_secs(10)).await?;
            drainer.restart_drained(&report, name).await?;
            println!(
                "pdctl: {name}: restarted with its new settings after draining ({:.1} s)",
                t.elapsed().as_secs_f64()
            );
        }
        for name in &d.removed {
            let t = Instant::now();
            let report = client::status(&self.socket, Duration::from_secs(10)).await?;
            drainer.remove_drained(&report, name).await?;
            let svc = self.running.service(name);
            if let Some(svc) = svc.filter(|_| proxy_here) {
                drainer.wait_routed(svc, false).await;
            }
            if svc.is_some_and(|s| s.node != self.node) {
                println!(
                    "pdctl: {name}: out of routing, drained and no longer followed here ({:.1} s); the same command on node {} stops it",
                    t.elapsed().as_secs_f64(),
                    svc.map_or("?", |s| s.node.as_str())
                );
                continue;
            }
            println!(
                "pdctl: {name}: drained, stopped and removed ({:.1} s)",
                t.elapsed().as_secs_f64()
            );
        }
        if let Some(proxy) = self
            .wanted
            .services
            .iter()
            .find(|s| s.role == crate::vocab::Role::Proxy)
            && self.running.service(&proxy.name) != Some(proxy)
        {
            // Its membership follows the supervisor already; a new spec (revision) is
            // what its live settings follow, and what it starts with next time.
            drainer
                .expect_done(Request::Replace {
                    service: Box::new(proxy.clone()),
                })
                .await?;
            if !d.proxy_live.is_empty() && !proxy_here {
                println!(
                    "pdctl: {}: runs on node {}; its new settings take effect when the same command runs there",
                    proxy.name, proxy.node
                );
            }
            if !d.proxy_live.is_empty() && proxy_here {
                let t = Instant::now();
                let report = client::status(&self.socket, Duration::from_secs(10)).await?;
                let revision = report
                    .services
                    .iter()
                    .find(|s| s.name == proxy.name)
                    .map_or(0, |s| s.revision);
                if drainer.wait_settings(revision).await {
                    println!(
                        "pdctl: {}: {} in effect, without a restart ({:.1} s)",
                        proxy.name,
                        d.proxy_live.join(", "),
                        t.elapsed().as_secs_f64()
                    );
                } else {
                    println!(
                        "pdctl: {}: did not confirm its new settings within 10 s; its log says why (`pdctl logs {}`)",
                        proxy.name, proxy.name
                    );
                }
            }
            if !d.proxy_restart.is_empty() {
                println!(
                    "pdctl: {}: {} take effect at its next start (`pdctl restart {}`, which cuts its streams); its routing already follows the change",
                    proxy.name,
                    d.proxy_restart.join(", "),
                    proxy.name
                );
            }
        }
        Ok(())
    }
}

/// Restarts and removes services without failing requests: out of routing, requests in
/// flight finish, then restart (healthy again) or stop.
pub(super) struct Drainer<'a> {
    pub socket: &'a Path,
    pub proxy_url: Option<String>,
    pub timeout: Duration,
}

impl Drainer<'_> {
    async fn ask(&self, req: Request) -> anyhow::Result<Response> {
        // A removal answers once the service stopped: allow its stop timeout and more.
        let wait = self.timeout + Duration::from_secs(60);
        Ok(client::send(self.socket, &req, wait).await?)
    }

    /// Sends `req`; an error answer becomes an error.
    async fn expect_done(&self, req: Request) -> anyhow::Result<String> {
        match self.ask(req).await? {
            Response::Done { message } => Ok(message),
            Response::Error { message } => anyhow::bail!("{message}"),
            Response::Status(_) | Response::Spec { .. } => {
                anyhow::bail!("the supervisor answered something else than asked")
            }
        }
    }

    /// Out of routing, requests in flight finish, restart, healthy again.
    pub async fn restart_drained(
        &self,
        report: &StatusReport,
        service: &str,
    ) -> anyhow::Result<()> {
        let before = report
            .services
            .iter()
            .find(|s| s.name == service)
            .map(|s| s.restarts)
            .unwrap_or(0);
        self.drain(report, service).await?;
        self.expect_done(Request::Restart {
            service: service.to_string(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        self.wait_healthy(service, Some(before)).await
    }

    /// Out of routing, requests in flight finish, stopped and forgotten.
    pub async fn remove_drained(&self, report: &StatusReport, service: &str) -> anyhow::Result<()> {
        let healthy = report
            .services
            .iter()
            .any(|s| s.name == service && s.state == ServiceState::Healthy);
        if healthy {
            self.drain(report, service).await?;
        }
        self.expect_done(Request::Remove {
            service: service.to_string(),
            timeout_s: self.timeout.as_secs(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        Ok(())
    }

    /// Takes `service` out of routing and waits until the proxy has no request on it.
    async fn drain(&self, report: &StatusReport, service: &str) -> anyhow::Result<()> {
        self.expect_done(Request::Drain {
            service: service.to_string(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        let url = report
            .services
            .iter()
            .find(|s| s.name == service)
            .and_then(|s| s.url.clone());
        if let (Some(proxy), Some(url)) = (&self.proxy_url, url) {
            self.wait_idle(proxy, &url, service).await;
        }
        Ok(())
    }

    /// Waits until the proxy has no request in flight on `url` (or the timeout passes),
    /// saying so when the service's run ended meanwhile (it died while draining).
    async fn wait_idle(&self, proxy: &str, url: &str, service: &str) {
        let end = Instant::now() + self.timeout;
        let run_of = |r: &StatusReport| {
            r.services
                .iter()
                .find(|s| s.name == service)
                .map(|s| (s.restarts, s.state, s.last_exit.clone()))
        };
        let first = client::status(self.socket, Duration::from_secs(5))
            .await
            .ok()
            .and_then(|r| run_of(&r));
        // The proxy reads the supervisor's report twice a second: let it see the drain.
        tokio::time::sleep(Duration::from_millis(600)).await;
        loop {
            match in_flight_on(proxy, url).await {
                Some(n) if n > 0.0 && Instant::now() < end => {}
                Some(n) if n > 0.0 => {
                    eprintln!(
                        "pdctl: {service} still has {n} request(s) in flight after {:?}; going on anyway",
                        self.timeout
                    );
                    break;
                }
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Requests may have ended because the process did: the supervisor sees the exit
        // within moments of the proxy seeing the streams break.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = client::status(self.socket, Duration::from_secs(5))
            .await
            .ok()
            .and_then(|r| run_of(&r));
        if let (Some((restarts, _, _)), Some((now_restarts, state, last_exit))) = (first, now)
            && (now_restarts != restarts || state != ServiceState::Draining)
        {
            eprintln!(
                "pdctl: {service} ended while draining ({}): its requests in flight got the proxy's error",
                last_exit.as_deref().unwrap_or(state.as_str())
            );
        }
    }

    /// Waits (a few seconds at most) until the proxy routes to `service` (`routed`) or
    /// no longer knows it: it follows the supervisor's report twice a second.
    async fn wait_routed(&self, service: &Service, routed: bool) {
        let (Some(proxy), Some(url)) = (&self.proxy_url, &service.url) else {
            return;
        };
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let seen = proxy_metric(proxy, "pdctl_proxy_instance_healthy", url).await;
            match seen {
                Err(()) => return,
                Ok(v) if routed == (v == Some(1.0)) && (routed || v.is_none()) => return,
                Ok(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "pdctl: {}: the proxy has not {} it after 10 s",
            service.name,
            if routed { "routed to" } else { "forgotten" }
        );
    }

    /// Waits (10 s at most) until the proxy says the settings of its spec's `revision` are
    /// in effect; true when it did (or there is no proxy to ask).
    async fn wait_settings(&self, revision: u64) -> bool {
        let Some(proxy) = &self.proxy_url else {
            return true;
        };
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let seen = proxy_gauge(proxy, "pdctl_proxy_settings_revision").await;
            if seen.is_some_and(|r| r >= revision as f64) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Waits until `service` is healthy (with `restarted_after`: restarted since its count
    /// was that); fails when it fails.
    pub async fn wait_healthy(
        &self,
        service: &str,
        restarted_after: Option<u32>,
    ) -> anyhow::Result<()> {
        let startup = Duration::from_secs(900);
        let end = Instant::now() + startup;
        loop {
            let report = client::status(self.socket, Duration::from_secs(10)).await?;
            if let Some(s) = report.services.iter().find(|s| s.name == service) {
                let restarted = restarted_after.is_none_or(|b| s.restarts > b);
                if restarted && s.state == ServiceState::Healthy {
                    return Ok(());
                }
                if s.state == ServiceState::Failed {
                    anyhow::bail!(
                        "{service} failed: {}",
                        s.last_exit.as_deref().unwrap_or("see `pdctl logs`")
                    );
                }
            }
            if Instant::now() >= end {
                anyhow::bail!("{service} is not healthy {startup:?} after it was started");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The value of the proxy's metric `name` without labels; None when the proxy does not
/// answer or has no such metric.
async fn proxy_gauge(proxy: &str, name: &str) -> Option<f64> {
    let text = proxy_page(proxy).await.ok()?;
    crate::prometheus::samples(&text)
        .find(|s| s.name == name && s.labels.is_empty())
        .map(|s| s.value)
}

/// The proxy's `/metrics` page; Err when it does not answer.
async fn proxy_page(proxy: &str) -> Result<String, ()> {
    super::view::metrics_page(proxy, Duration::from_secs(2))
        .await
        .ok_or(())
}

/// The proxy's count of requests in flight on the instance at `url`; None when the proxy
/// does not answer (then there is nothing to wait for).
async fn in_flight_on(proxy: &str, url: &str) -> Option<f64> {
    proxy_metric(proxy, "pdctl_proxy_instance_in_flight", url)
        .await
        .ok()
        .flatten()
}

/// The value of the proxy's per-instance metric `name` for the instance at `url`: Err when
/// the proxy does not answer, Ok(None) when it does not list that instance.
async fn proxy_metric(proxy: &str, name: &str, url: &str) -> Result<Option<f64>, ()> {
    let text = proxy_page(proxy).await?;
    let wanted = url.trim_end_matches('/');
    Ok(crate::prometheus::samples(&text)
        .filter(|s| s.name == name)
        .find(|s| crate::prometheus::label_value(s.labels, "instance").as_deref() == Some(wanted))
        .map(|s| s.value))
}
