//! Restarting and removing instances without failing requests: out of the proxy's
//! routing, requests in flight finished (watched on the proxy's `/metrics`), then
//! restarted (healthy again, back in routing) or stopped — on whichever node runs them.

use super::context::Progress;
use super::nodes::Nodes;
use crate::control::{ENDED_BEFORE_STOP, Request, ServiceState};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long a started instance may take to become healthy when its spec is not at hand
/// (its own `startup_timeout_s` is used where it is).
const DEFAULT_STARTUP_LIMIT: Duration = Duration::from_secs(900);

/// How often a wait looks again (on one connection: the supervisor's report is a copy of
/// its table; the proxy's `/metrics` is one page).
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// What a service's row says of its run, to tell whether it ended between two looks.
#[derive(Debug, Clone)]
struct RunSeen {
    pid: Option<u32>,
    restarts: u32,
    state: ServiceState,
    last_exit: Option<String>,
}

impl RunSeen {
    fn of(row: Option<crate::control::ServiceStatus>) -> Option<RunSeen> {
        row.map(|s| RunSeen {
            pid: s.pid,
            restarts: s.restarts,
            state: s.state,
            last_exit: s.last_exit,
        })
    }

    /// Whether the run seen `before` ended by now: restarted (another restart count or
    /// pid), or no longer serving (neither draining nor healthy).
    fn ended_since(&self, before: &RunSeen) -> bool {
        let other_pid = matches!((before.pid, self.pid), (Some(a), Some(b)) if a != b);
        self.restarts != before.restarts
            || other_pid
            || !matches!(self.state, ServiceState::Draining | ServiceState::Healthy)
    }
}

/// Drains, restarts and removes services of a running cluster.
pub struct Drainer<'a> {
    pub nodes: &'a Nodes,
    /// Where the proxy takes requests, if the cluster has one.
    pub proxy_url: Option<String>,
    /// The node whose supervisor the proxy follows (routing, drains).
    pub proxy_node: String,
    /// How long a drained instance's requests in flight may take; also how long a
    /// transient error (a node that does not answer) is retried.
    pub timeout: Duration,
    /// Each service's own start-up limit (`startup_timeout_s`), by name.
    pub startup: BTreeMap<String, Duration>,
    pub progress: &'a Progress,
    /// One client for the proxy's `/metrics` (its connection kept alive between looks).
    pub http: reqwest::Client,
}

impl Drainer<'_> {
    /// How long the answer to `req` may take: a `Remove` answers once its service has
    /// stopped; the rest at once.
    fn patience(&self, req: &Request) -> Duration {
        match req {
            Request::Remove { .. } | Request::Down { .. } => self.timeout + Duration::from_secs(60),
            _ => Duration::from_secs(10),
        }
    }

    /// Sends `req` to `node`'s supervisor (again, with backoff, while it cannot be
    /// reached, within the change's timeout); its `Done` message.
    pub async fn ask(&self, node: &str, req: Request) -> anyhow::Result<String> {
        let wait = self.patience(&req);
        self.nodes
            .ask_retrying(node, &req, wait, self.timeout)
            .await
    }

    /// `service`'s start-up limit.
    fn startup_limit(&self, service: &str) -> Duration {
        self.startup
            .get(service)
            .copied()
            .unwrap_or(DEFAULT_STARTUP_LIMIT)
    }

    /// Out of routing, requests in flight finish, restarted by `owner`'s supervisor,
    /// healthy again there, back in routing. Whatever fails after the drain, the instance
    /// is put back in routing (it rejoins once it answers) before the error is returned.
    pub async fn restart_drained(&self, service: &str, owner: &str) -> anyhow::Result<()> {
        let before = self.row(owner, service).await?.map_or(0, |s| s.restarts);
        // One the proxy does not route to (starting, failed) has nothing to drain.
        let routed = self
            .row(&self.proxy_node, service)
            .await?
            .is_some_and(|s| s.state == ServiceState::Healthy);
        let restarted = async {
            if routed {
                self.drain(service, owner).await?;
            }
            self.ask(
                owner,
                Request::Restart {
                    service: service.to_string(),
                },
            )
            .await
            .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
            self.wait_healthy(owner, service, Some(before)).await
        };
        if let Err(e) = restarted.await {
            return Err(self.resume_after(service, e).await);
        }
        if owner != self.proxy_node {
            // Drained in the proxy's supervisor, restarted by its own: back in routing.
            self.resume(service).await?;
            self.wait_healthy(&self.proxy_node, service, None).await?;
        }
        Ok(())
    }

    /// Back in routing in the proxy's supervisor (once it answers its probe).
    async fn resume(&self, service: &str) -> anyhow::Result<String> {
        self.ask(
            &self.proxy_node,
            Request::Resume {
                service: service.to_string(),
            },
        )
        .await
    }

    /// After a step on drained `service` failed with `e`: put it back in routing, and
    /// the error saying so (or that even that failed).
    async fn resume_after(&self, service: &str, e: anyhow::Error) -> anyhow::Error {
        match self.resume(service).await {
            Ok(_) => {
                self.progress.warn(&format!(
                    "{service}: {e:#}; put back in routing (it rejoins once it answers)"
                ));
                e
            }
            Err(r) => anyhow::anyhow!(
                "{e:#}; and it could not be put back in routing: {r:#} (`pdctl restart {service}` once its node answers)"
            ),
        }
    }

    /// Out of routing, requests in flight finish, stopped by `owner`'s supervisor and
    /// forgotten by every node's. A node that no longer knows it has nothing to do.
    pub async fn remove_drained(&self, service: &str, owner: &str) -> anyhow::Result<()> {
        let healthy = self
            .row(&self.proxy_node, service)
            .await?
            .is_some_and(|s| s.state == ServiceState::Healthy);
        if healthy {
            if let Err(e) = self.drain(service, owner).await {
                return Err(self.resume_after(service, e).await);
            }
        }
        let mut nodes: Vec<String> = vec![owner.to_string()];
        nodes.extend(
            std::iter::once(&self.nodes.here)
                .chain(self.nodes.others())
                .filter(|n| n.as_str() != owner)
                .cloned(),
        );
        for node in &nodes {
            let said = self.forget(node, service).await?;
            // Its process died after the drain's last look and before the stop: the
            // requests it carried got the proxy's error, which the drain must not hide.
            if healthy
                && node == owner
                && said
                    .as_deref()
                    .is_some_and(|m| m.contains(ENDED_BEFORE_STOP))
            {
                self.progress.warn(&format!(
                    "{service} ended while draining ({}): its requests in flight got the proxy's error",
                    said.as_deref().and_then(|m| m.split(ENDED_BEFORE_STOP).nth(1)).unwrap_or("?")
                ));
            }
        }
        Ok(())
    }

    /// `node`'s supervisor stops `service` (if it runs it) and forgets it; nothing to do
    /// where it is not known.
    /// Returns what that supervisor answered (None where it did not know the service).
    pub async fn forget(&self, node: &str, service: &str) -> anyhow::Result<Option<String>> {
        if self.row(node, service).await?.is_none() {
            return Ok(None);
        }
        let remove = Request::Remove {
            service: service.to_string(),
            timeout_s: self.timeout.as_secs(),
        };
        self.ask(node, remove)
            .await
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{service}: {e}"))
    }

    /// The row of `service` in `node`'s own report.
    pub async fn row(
        &self,
        node: &str,
        service: &str,
    ) -> anyhow::Result<Option<crate::control::ServiceStatus>> {
        let report = self.nodes.status(node, self.timeout).await?;
        Ok(report.services.into_iter().find(|s| s.name == service))
    }

    /// The row of `service` in `node`'s report, asked once (for what is only said, never
    /// decided on).
    async fn row_once(&self, node: &str, service: &str) -> Option<crate::control::ServiceStatus> {
        let report = self.nodes.status(node, Duration::ZERO).await.ok()?;
        report.services.into_iter().find(|s| s.name == service)
    }

    /// Takes `service` out of routing and waits until the proxy has no request on it;
    /// fails (and leaves the caller to put it back) when that cannot be known.
    async fn drain(&self, service: &str, owner: &str) -> anyhow::Result<()> {
        // Its run as it was before the drain: a death any time after this is told. (Taken
        // after the drain began, it missed a death in between when the supervisor had
        // already restarted the service: seen under load.)
        let before = RunSeen::of(self.row(owner, service).await.ok().flatten());
        self.ask(
            &self.proxy_node,
            Request::Drain {
                service: service.to_string(),
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        let url = self
            .row(&self.proxy_node, service)
            .await?
            .and_then(|s| s.url);
        if let (Some(proxy), Some(url)) = (&self.proxy_url, url) {
            self.wait_idle(proxy, &url, service, owner, before).await?;
        }
        Ok(())
    }

    /// Waits until the proxy no longer routes to `url` (it follows its supervisor's
    /// report), then until it has no request in flight there (or the timeout passes),
    /// saying so when the service's run ended meanwhile (it died while draining). While
    /// the proxy's count cannot be read it waits and says so; if it still cannot be read
    /// at the timeout, the drain fails rather than cut requests it cannot see.
    async fn wait_idle(
        &self,
        proxy: &str,
        url: &str,
        service: &str,
        owner: &str,
        before: Option<RunSeen>,
    ) -> anyhow::Result<()> {
        let end = Instant::now() + self.timeout;
        let mut unread: Option<String> = None;
        loop {
            let look = match self.proxy_page(proxy).await {
                Ok(page) => Ok(crate::proxy::instance_figures(&page, url)),
                Err(e) => Err(e),
            };
            match look {
                // Not listed: nothing routed there, nothing to wait for.
                Ok(None) => break,
                Ok(Some(f)) if !f.routed && f.in_flight <= 0.0 => break,
                Ok(Some(f)) if Instant::now() >= end => {
                    if f.in_flight > 0.0 {
                        self.progress.warn(&format!(
                            "{service} still has {} request(s) in flight after {:?}; going on anyway",
                            f.in_flight, self.timeout
                        ));
                    }
                    break;
                }
                Ok(Some(_)) => {
                    if unread.take().is_some() {
                        self.progress
                            .line(&format!("{service}: the proxy answers again"));
                    }
                }
                Err(e) if Instant::now() >= end => anyhow::bail!(
                    "{service}: the proxy's count of its requests in flight could not be read for {:?} ({e}); not going on, so as not to cut them",
                    self.timeout
                ),
                Err(e) => {
                    if unread.is_none() {
                        self.progress.warn(&format!(
                            "{service}: cannot read the proxy's count of its requests in flight ({e}); waiting"
                        ));
                    }
                    unread = Some(e);
                }
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        let now = RunSeen::of(self.row_once(owner, service).await);
        if let (Some(before), Some(now)) = (before, now)
            && now.ended_since(&before)
        {
            self.progress.warn(&format!(
                "{service} ended while draining ({}): its requests in flight got the proxy's error",
                now.last_exit.as_deref().unwrap_or(now.state.as_str())
            ));
        }
        Ok(())
    }

    /// Waits (a few seconds at most) until the proxy routes to the instance at `url`
    /// (`routed`) or no longer knows it: it follows its supervisor's report twice a second.
    pub async fn wait_routed(&self, name: &str, url: Option<&str>, routed: bool) {
        let (Some(proxy), Some(url)) = (&self.proxy_url, url) else {
            return;
        };
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let Ok(page) = self.proxy_page(proxy).await else {
                return;
            };
            let seen = crate::proxy::instance_figures(&page, url);
            match seen {
                Some(f) if routed && f.routed => return,
                None if !routed => return,
                _ => {}
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        self.progress.warn(&format!(
            "{name}: the proxy has not {} it after 10 s",
            if routed { "routed to" } else { "forgotten" }
        ));
    }

    /// Waits (10 s at most) until the proxy says the settings of its spec's `revision` are
    /// in effect; true when it did (or there is no proxy to ask).
    pub async fn wait_settings(&self, revision: u64) -> bool {
        let Some(proxy) = &self.proxy_url else {
            return true;
        };
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let seen = self
                .proxy_page(proxy)
                .await
                .ok()
                .and_then(|p| crate::proxy::settings_revision(&p));
            if seen.is_some_and(|r| r >= revision) {
                return true;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        false
    }

    /// Waits until `service` is healthy in `node`'s report (with `restarted_after`:
    /// restarted since its count was that), within the service's own start-up limit;
    /// fails when it fails. Follows the report on one connection, made again only if it
    /// breaks.
    pub async fn wait_healthy(
        &self,
        node: &str,
        service: &str,
        restarted_after: Option<u32>,
    ) -> anyhow::Result<()> {
        let limit = self.startup_limit(service);
        let end = Instant::now() + limit;
        let mut conn = None;
        loop {
            let report = match conn.as_mut() {
                None => None,
                Some(c) => crate::control::client::StatusConn::status(c).await.ok(),
            };
            let report = match report {
                Some(r) => r,
                None => {
                    // (Re)connect, retrying a node that does not answer until the limit.
                    let left = end.saturating_duration_since(Instant::now());
                    let mut c = self.status_conn(node, left).await?;
                    let r = c.status().await;
                    conn = Some(c);
                    r.map_err(|e| anyhow::anyhow!("node {node}: {e}"))?
                }
            };
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
                anyhow::bail!(
                    "{service} is not healthy {limit:?} after it was started (its startup_timeout_s)"
                );
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }

    /// A status connection to `node`, tried again with backoff for up to `within`.
    async fn status_conn(
        &self,
        node: &str,
        within: Duration,
    ) -> anyhow::Result<crate::control::client::StatusConn> {
        let end = Instant::now() + within;
        let mut failures = 0;
        loop {
            failures += 1;
            let delay = super::nodes::ASK_AGAIN.after(failures);
            match self.nodes.status_conn(node).await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() + delay < end => {
                    tracing::warn!("{e:#}; trying again in {delay:?}");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The proxy's `/metrics` page, or why it could not be read.
    /// (Err stays text: the change's progress says it; every error is waited out alike.)
    async fn proxy_page(&self, proxy: &str) -> Result<String, String> {
        metrics_page(&self.http, proxy).await
    }
}

/// The `/metrics` page of the HTTP service at `base` (the proxy, an engine), or why it
/// could not be read, naming the URL. (Err stays text: said in a change's progress or
/// logged; no caller decides by its kind.)
pub(super) async fn metrics_page(http: &reqwest::Client, base: &str) -> Result<String, String> {
    let url = format!("{}/metrics", base.trim_end_matches('/'));
    let answer = http
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !answer.status().is_success() {
        return Err(format!("{url}: {}", answer.status()));
    }
    answer.text().await.map_err(|e| format!("{url}: {e}"))
}

/// The HTTP client a drainer reads the proxy's `/metrics` with.
pub fn metrics_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("a plain HTTP client builds")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(pid: u32, restarts: u32, state: ServiceState) -> RunSeen {
        RunSeen {
            pid: Some(pid),
            restarts,
            state,
            last_exit: None,
        }
    }

    #[test]
    fn a_run_that_died_and_came_back_during_the_drain_is_told() {
        let before = seen(10, 0, ServiceState::Healthy);
        assert!(!seen(10, 0, ServiceState::Draining).ended_since(&before));
        assert!(
            seen(11, 1, ServiceState::Healthy).ended_since(&before),
            "restarted and healthy again: still a death"
        );
        assert!(seen(11, 0, ServiceState::Draining).ended_since(&before));
        assert!(seen(10, 0, ServiceState::Restarting).ended_since(&before));
    }
}
