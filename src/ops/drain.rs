//! Restarting and removing instances without failing requests: out of the proxy's
//! routing, requests in flight finished (watched on the proxy's `/metrics`), then
//! restarted (healthy again, back in routing) or stopped — on whichever node runs them.

use super::engine::Progress;
use super::nodes::Nodes;
use crate::control::{Request, ServiceState, StatusReport};
use std::time::{Duration, Instant};

/// How long a started instance may take to become healthy (vLLM loading a large model).
const STARTUP_LIMIT: Duration = Duration::from_secs(900);

/// Drains, restarts and removes services of a running cluster.
pub struct Drainer<'a> {
    pub nodes: &'a Nodes,
    /// Where the proxy takes requests, if the cluster has one.
    pub proxy_url: Option<String>,
    /// The node whose supervisor the proxy follows (routing, drains).
    pub proxy_node: String,
    /// How long a drained instance's requests in flight may take.
    pub timeout: Duration,
    pub progress: &'a Progress,
}

impl Drainer<'_> {
    /// The wait for a request that answers once a service has stopped.
    fn patience(&self) -> Duration {
        self.timeout + Duration::from_secs(60)
    }

    /// Sends `req` to `node`'s supervisor; its `Done` message.
    pub async fn ask(&self, node: &str, req: Request) -> anyhow::Result<String> {
        self.nodes.ask(node, req, self.patience()).await
    }

    /// Out of routing, requests in flight finish, restarted by `owner`'s supervisor,
    /// healthy again there, back in routing.
    pub async fn restart_drained(&self, service: &str, owner: &str) -> anyhow::Result<()> {
        let before = self.row(owner, service).await?.map_or(0, |s| s.restarts);
        self.drain(service, owner).await?;
        self.ask(
            owner,
            Request::Restart {
                service: service.to_string(),
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        self.wait_healthy(owner, service, Some(before)).await?;
        if owner != self.proxy_node {
            // Drained in the proxy's supervisor, restarted by its own: back in routing.
            self.ask(
                &self.proxy_node,
                Request::Resume {
                    service: service.to_string(),
                },
            )
            .await?;
            self.wait_healthy(&self.proxy_node, service, None).await?;
        }
        Ok(())
    }

    /// Out of routing, requests in flight finish, stopped by `owner`'s supervisor and
    /// forgotten by every node's.
    pub async fn remove_drained(&self, service: &str, owner: &str) -> anyhow::Result<()> {
        let healthy = self
            .row(&self.proxy_node, service)
            .await?
            .is_some_and(|s| s.state == ServiceState::Healthy);
        if healthy {
            self.drain(service, owner).await?;
        }
        let remove = || Request::Remove {
            service: service.to_string(),
            timeout_s: self.timeout.as_secs(),
        };
        self.ask(owner, remove())
            .await
            .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        let mut others: Vec<&String> = self.nodes.others().collect();
        others.push(&self.nodes.here);
        for node in others.into_iter().filter(|n| n.as_str() != owner) {
            self.ask(node, remove())
                .await
                .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
        }
        Ok(())
    }

    /// The row of `service` in `node`'s own report.
    async fn row(
        &self,
        node: &str,
        service: &str,
    ) -> anyhow::Result<Option<crate::control::ServiceStatus>> {
        let report = self.nodes.status(node).await?;
        Ok(report.services.into_iter().find(|s| s.name == service))
    }

    /// Takes `service` out of routing and waits until the proxy has no request on it.
    async fn drain(&self, service: &str, owner: &str) -> anyhow::Result<()> {
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
            self.wait_idle(proxy, &url, service, owner).await;
        }
        Ok(())
    }

    /// Waits until the proxy has no request in flight on `url` (or the timeout passes),
    /// saying so when the service's run ended meanwhile (it died while draining).
    async fn wait_idle(&self, proxy: &str, url: &str, service: &str, owner: &str) {
        let end = Instant::now() + self.timeout;
        let run_of = |r: Option<crate::control::ServiceStatus>| {
            r.map(|s| (s.restarts, s.state, s.last_exit))
        };
        let first = run_of(self.row(owner, service).await.ok().flatten());
        // The proxy reads its supervisor's report twice a second: let it see the drain.
        tokio::time::sleep(Duration::from_millis(600)).await;
        loop {
            match in_flight_on(proxy, url).await {
                Some(n) if n > 0.0 && Instant::now() < end => {}
                Some(n) if n > 0.0 => {
                    self.progress.warn(&format!(
                        "{service} still has {n} request(s) in flight after {:?}; going on anyway",
                        self.timeout
                    ));
                    break;
                }
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Requests may have ended because the process did: its supervisor sees the exit
        // within moments of the proxy seeing the streams break.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = run_of(self.row(owner, service).await.ok().flatten());
        if let (Some((restarts, _, _)), Some((now_restarts, state, last_exit))) = (first, now)
            && (now_restarts != restarts
                || !matches!(state, ServiceState::Draining | ServiceState::Healthy))
        {
            self.progress.warn(&format!(
                "{service} ended while draining ({}): its requests in flight got the proxy's error",
                last_exit.as_deref().unwrap_or(state.as_str())
            ));
        }
    }

    /// Waits (a few seconds at most) until the proxy routes to the instance at `url`
    /// (`routed`) or no longer knows it: it follows its supervisor's report twice a second.
    pub async fn wait_routed(&self, name: &str, url: Option<&str>, routed: bool) {
        let (Some(proxy), Some(url)) = (&self.proxy_url, url) else {
            return;
        };
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let Some(page) = proxy_page(proxy).await else {
                return;
            };
            let seen = crate::proxy::instance_figures(&page, url);
            match seen {
                Some(f) if routed && f.routed => return,
                None if !routed => return,
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            let seen = proxy_page(proxy)
                .await
                .and_then(|p| crate::proxy::settings_revision(&p));
            if seen.is_some_and(|r| r >= revision) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Waits until `service` is healthy in `node`'s report (with `restarted_after`:
    /// restarted since its count was that); fails when it fails.
    pub async fn wait_healthy(
        &self,
        node: &str,
        service: &str,
        restarted_after: Option<u32>,
    ) -> anyhow::Result<()> {
        let end = Instant::now() + STARTUP_LIMIT;
        loop {
            let report: StatusReport = self.nodes.status(node).await?;
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
                anyhow::bail!("{service} is not healthy {STARTUP_LIMIT:?} after it was started");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The proxy's `/metrics` page; None when it does not answer.
async fn proxy_page(proxy: &str) -> Option<String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .ok()?;
    let url = format!("{}/metrics", proxy.trim_end_matches('/'));
    client.get(&url).send().await.ok()?.text().await.ok()
}

/// The proxy's count of requests in flight on the instance at `url`; None when the proxy
/// does not answer or does not list it (then there is nothing to wait for).
async fn in_flight_on(proxy: &str, url: &str) -> Option<f64> {
    let page = proxy_page(proxy).await?;
    crate::proxy::instance_figures(&page, url).map(|f| f.in_flight)
}
