//! Stopping: a service's whole process group (so engine subprocesses go too) with its
//! shutdown signal, SIGKILL after the timeout; and the order a cluster is taken down in
//! (dependants before what they depend on, independent services at the same time).

use crate::plan::Plan;
use crate::supervisor::process::procfs;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::process::ExitStatus;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// How long to wait for a group to vanish after SIGKILL before giving up on it.
const AFTER_KILL: Duration = Duration::from_secs(2);

/// A signal named as in a plan (`SIGTERM`, `TERM`, `sigint`), or `None` if unknown.
pub fn parse_signal(name: &str) -> Option<Signal> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    Signal::from_str(&full).ok()
}

/// Asks the process group led by `child` to stop: `signal` to the group, SIGKILL to the
/// group once `timeout` passes, then makes sure no member is left. Returns the leader's
/// exit status when it could be read.
pub async fn stop_run(
    child: &mut tokio::process::Child,
    pgid: i32,
    signal: Signal,
    timeout: Duration,
) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    let _ = killpg(Pid::from_raw(pgid), signal);
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => Some(status),
        _ => {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            child.wait().await.ok()
        }
    };
    clear_group(
        pgid,
        signal,
        deadline.saturating_duration_since(Instant::now()),
    )
    .await;
    status
}

/// Removes what is left of group `pgid` after its leader exited (children it forked that
/// did not exit with it): `signal`, then SIGKILL after `grace`. Returns once no live
/// member remains, or after giving up (logged).
pub async fn clear_group(pgid: i32, signal: Signal, grace: Duration) {
    if procfs::live_group_members(pgid).is_empty() {
        return;
    }
    let _ = killpg(Pid::from_raw(pgid), signal);
    if wait_group_empty(pgid, grace).await {
        return;
    }
    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    if !wait_group_empty(pgid, AFTER_KILL).await {
        tracing::warn!(
            "process group {pgid} still has members after SIGKILL: {:?}",
            procfs::live_group_members(pgid)
        );
    }
}

async fn wait_group_empty(pgid: i32, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    loop {
        if procfs::live_group_members(pgid).is_empty() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Plan indices of this node's services grouped into stop waves: wave 0 holds services
/// nothing local depends on; each later wave only services whose dependants stopped in
/// earlier waves.
pub fn stop_waves(plan: &Plan, node: &str) -> Vec<Vec<usize>> {
    let n = plan.services.len();
    let local: Vec<bool> = plan.services.iter().map(|s| s.node == node).collect();
    let mut level = vec![0usize; n];
    // Dependants come after their dependencies in a plan, so walking backwards sees
    // every dependant's level before the service it depends on.
    for i in (0..n).rev() {
        let name = &plan.services[i].name;
        level[i] = (i + 1..n)
            .filter(|&j| local[j] && plan.services[j].depends_on.contains(name))
            .map(|j| level[j] + 1)
            .max()
            .unwrap_or(0);
    }
    let top = level.iter().copied().max().unwrap_or(0);
    (0..=top)
        .map(|l| (0..n).filter(|&i| local[i] && level[i] == l).collect())
        .filter(|w: &Vec<usize>| !w.is_empty())
        .collect()
}

/// `exit 1`, `signal 9 (SIGKILL)`: how a process ended, for `last_exit`.
pub fn describe_exit(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        format!("exit {code}")
    } else if let Some(sig) = status.signal() {
        match Signal::try_from(sig) {
            Ok(s) => format!("signal {sig} ({})", s.as_str()),
            Err(_) => format!("signal {sig}"),
        }
    } else {
        "ended".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::testing;
    use crate::vocab::Service;

    #[test]
    fn signal_names_parse_in_the_usual_spellings() {
        assert_eq!(parse_signal("SIGTERM"), Some(Signal::SIGTERM));
        assert_eq!(parse_signal("int"), Some(Signal::SIGINT));
        assert_eq!(parse_signal("SIGNOPE"), None);
    }

    fn svc(name: &str, node: &str, deps: &[&str]) -> Service {
        Service {
            depends_on: deps.iter().map(|d| d.to_string()).collect(),
            startup_timeout_s: 1,
            ..testing::service(name, node)
        }
    }

    #[test]
    fn waves_stop_dependants_first_and_skip_remote_services() {
        let services = vec![
            svc("etcd", "a", &[]),
            svc("master", "a", &["etcd"]),
            svc("p0", "a", &["etcd", "master"]),
            svc("d0", "b", &["etcd", "master"]),
            svc("proxy", "a", &["p0", "d0"]),
        ];
        let plan = Plan {
            connector: "mooncake-store".into(),
            ..testing::plan("a", services)
        };
        assert_eq!(
            stop_waves(&plan, "a"),
            vec![vec![4], vec![2], vec![1], vec![0]]
        );
        // On node b only d0 runs; its dependencies are remote.
        assert_eq!(stop_waves(&plan, "b"), vec![vec![3]]);
    }

    #[tokio::test]
    async fn stopping_a_group_also_stops_its_grandchildren() {
        let mut cmd = tokio::process::Command::new("/bin/sh");
        // The shell ignores TERM and leaves a background sleep behind.
        cmd.args(["-c", "trap '' TERM; sleep 30 & wait"])
            .process_group(0);
        let mut child = cmd.spawn().unwrap();
        let pgid = child.id().unwrap() as i32;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(procfs::live_group_members(pgid).len() >= 2);
        let t = Instant::now();
        let status = stop_run(
            &mut child,
            pgid,
            Signal::SIGTERM,
            Duration::from_millis(300),
        )
        .await;
        assert!(procfs::live_group_members(pgid).is_empty());
        assert!(t.elapsed() < Duration::from_secs(3));
        assert_eq!(describe_exit(&status.unwrap()), "signal 9 (SIGKILL)");
    }
}
