//! `pdctl restart SERVICE|ROLE...`: restarts services of the running cluster (with their
//! `restart_with` companions), as `docker compose restart` does.

use super::ExitError;
use super::cluster::RestartArgs;
use super::common::state_root;
use crate::control::{Request, Response, StatusReport, client};
use crate::supervisor::select;
use std::process::ExitCode;
use std::time::Duration;

/// Service names for the targets: a role stands for every instance of it.
fn expand(report: &StatusReport, targets: &[String]) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for t in targets {
        let matched: Vec<String> = report
            .services
            .iter()
            .filter(|s| s.name == *t || s.role.as_str() == t)
            .map(|s| s.name.clone())
            .collect();
        if matched.is_empty() {
            let known: Vec<&str> = report.services.iter().map(|s| s.name.as_str()).collect();
            return Err(ExitError::usage(format!(
                "`{t}` is neither a service nor a role of cluster {}; services: {}",
                report.cluster,
                known.join(", ")
            )));
        }
        for m in matched {
            if !names.contains(&m) {
                names.push(m);
            }
        }
    }
    Ok(names)
}

/// Asks the running supervisor to restart each target; exit 1 when one is refused.
pub fn run(a: &RestartArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let root = state_root(a.which.state_dir.as_deref());
    let Some(found) = select::running(&root, a.which.cluster.as_deref())? else {
        return Err(ExitError::nothing_running(format!(
            "no cluster is running under {}; nothing to restart",
            root.display()
        )));
    };
    let socket = found.state.socket_path();
    let ask = |req: Request| rt.block_on(client::send(&socket, &req, Duration::from_secs(10)));
    let report = match ask(Request::Status)? {
        Response::Status(r) => r,
        other => anyhow::bail!(
            "the supervisor of {} answered {other:?} to status",
            found.label()
        ),
    };
    if a.rolling {
        let roles: Vec<&String> = a
            .targets
            .iter()
            .filter(|t| {
                !report
                    .services
                    .iter()
                    .any(|s| s.role.as_str() == t.as_str())
            })
            .collect();
        if !roles.is_empty() {
            return Err(ExitError::usage(format!(
                "--rolling takes roles (prefill, decode), not {}",
                roles
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let services = expand(&report, &a.targets)?;
    if a.drain || a.rolling {
        let drain = Drainer {
            socket: &socket,
            proxy_url: report.proxy_url.clone(),
            timeout: Duration::from_secs(a.timeout),
        };
        for service in &services {
            let started = std::time::Instant::now();
            rt.block_on(drain.restart_drained(&report, service))?;
            println!(
                "pdctl: {service} restarted after draining and healthy again ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut refused = false;
    for service in services {
        match ask(Request::Restart {
            service: service.clone(),
        })? {
            Response::Done { message } => println!("pdctl: {message}"),
            Response::Error { message } => {
                eprintln!("pdctl: {service}: {message}");
                refused = true;
            }
            Response::Status(_) => anyhow::bail!("the supervisor answered a status to a restart"),
        }
    }
    Ok(if refused {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Restarts services one by one without failing requests: out of routing, requests in
/// flight finish, restart, healthy again.
struct Drainer<'a> {
    socket: &'a std::path::Path,
    proxy_url: Option<String>,
    timeout: Duration,
}

impl Drainer<'_> {
    async fn ask(&self, req: Request) -> anyhow::Result<Response> {
        Ok(client::send(self.socket, &req, Duration::from_secs(10)).await?)
    }

    async fn restart_drained(&self, report: &StatusReport, service: &str) -> anyhow::Result<()> {
        let before = report
            .services
            .iter()
            .find(|s| s.name == service)
            .map(|s| s.restarts)
            .unwrap_or(0);
        if let Response::Error { message } = self
            .ask(Request::Drain {
                service: service.to_string(),
            })
            .await?
        {
            anyhow::bail!("{service}: {message}");
        }
        let url = report
            .services
            .iter()
            .find(|s| s.name == service)
            .and_then(|s| s.url.clone());
        if let (Some(proxy), Some(url)) = (&self.proxy_url, url) {
            self.wait_idle(proxy, &url, service).await;
        }
        if let Response::Error { message } = self
            .ask(Request::Restart {
                service: service.to_string(),
            })
            .await?
        {
            anyhow::bail!("{service}: {message}");
        }
        self.wait_healthy(service, before).await
    }

    /// Waits until the proxy has no request in flight on `url` (or the timeout passes).
    async fn wait_idle(&self, proxy: &str, url: &str, service: &str) {
        let end = std::time::Instant::now() + self.timeout;
        // The proxy reads the supervisor's report twice a second: let it see the drain.
        tokio::time::sleep(Duration::from_millis(600)).await;
        loop {
            match in_flight_on(proxy, url).await {
                Some(n) if n > 0.0 && std::time::Instant::now() < end => {}
                Some(n) if n > 0.0 => {
                    eprintln!(
                        "pdctl: {service} still has {n} request(s) in flight after {:?}; restarting it anyway",
                        self.timeout
                    );
                    return;
                }
                _ => return,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `service` has restarted (restart count above `before`) and is healthy.
    async fn wait_healthy(&self, service: &str, before: u32) -> anyhow::Result<()> {
        let startup = Duration::from_secs(900);
        let end = std::time::Instant::now() + startup;
        loop {
            let report = client::status(self.socket, Duration::from_secs(10)).await?;
            if let Some(s) = report.services.iter().find(|s| s.name == service) {
                if s.restarts > before && s.state == crate::control::ServiceState::Healthy {
                    return Ok(());
                }
                if s.state == crate::control::ServiceState::Failed {
                    anyhow::bail!(
                        "{service} failed after its restart: {}",
                        s.last_exit.as_deref().unwrap_or("see `pdctl logs`")
                    );
                }
            }
            if std::time::Instant::now() >= end {
                anyhow::bail!("{service} is not healthy {startup:?} after its restart");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The proxy's count of requests in flight on the instance at `url`; None when the proxy
/// does not answer (then there is nothing to wait for).
async fn in_flight_on(proxy: &str, url: &str) -> Option<f64> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .ok()?;
    let text = client
        .get(format!("{}/metrics", proxy.trim_end_matches('/')))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let wanted = url.trim_end_matches('/');
    crate::prometheus::samples(&text)
        .filter(|s| s.name == "pdctl_proxy_instance_in_flight")
        .find(|s| s.labels.contains(&format!("instance=\"{wanted}\"")))
        .map(|s| s.value)
}
