//! `pdctl restart SERVICE|ROLE...`: restarts services of the running cluster (with their
//! `restart_with` companions), as `docker compose restart` does.

use super::ExitError;
use super::cluster::RestartArgs;
use super::live::Drainer;
use crate::control::{Request, Response, StatusReport, client};
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
    let found = super::live::running(&a.which.state_dir, a.which.cluster.as_deref(), "restart")?;
    let socket = found.socket.clone();
    let ask = |req: Request| rt.block_on(client::send(&socket, &req, Duration::from_secs(10)));
    let report = match ask(Request::Status)? {
        Response::Status(r) => r,
        other => anyhow::bail!(
            "the supervisor of {} answered {other:?} to status",
            found.cluster
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
            Response::Status(_) | Response::Spec { .. } => {
                anyhow::bail!("the supervisor answered something else than asked")
            }
        }
    }
    Ok(if refused {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
