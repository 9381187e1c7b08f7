//! The one shared state of a running supervisor: a row per service, written by the
//! service tasks and read by `status`, the proxy's health feed and the progress display.
//! Locked briefly and never across an await; every change bumps a version others can
//! wait on.

use crate::control::{ServiceState, ServiceStatus, StatusReport};
use crate::plan::Plan;
use crate::supervisor::process::usage::{SAMPLE_EVERY, Sampler, Usage};
use crate::vocab::Service;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::watch;

/// The port `status` shows for a service: `http`, else `client`, else `rpc`, else any.
pub fn main_port(svc: &Service) -> Option<u16> {
    ["http", "client", "rpc"]
        .iter()
        .find_map(|k| svc.ports.get(*k).copied())
        .or_else(|| svc.ports.values().next().copied())
}

#[derive(Debug, Clone)]
struct Row {
    status: ServiceStatus,
    /// When the current process started (uptime), while one runs.
    run_started: Option<Instant>,
    /// Taken out of routing while requests in flight finish (until its run ends).
    draining: bool,
    /// Removed (`scale`, `apply`): no longer reported.
    retired: bool,
    /// The last sample of its processes' use, and the pid it was taken of.
    usage: Option<(u32, Usage)>,
    /// Another node's service: the state its own node's supervisor last reported, once
    /// it has (this node's probe may see it answer before that supervisor calls it
    /// healthy).
    reported: Option<ServiceState>,
}

impl Row {
    /// A service not started yet: `pending` here, `starting` on another node until its
    /// probe answers.
    fn new(s: &Service, node: &str) -> Row {
        let remote = s.node != node;
        Row {
            status: ServiceStatus {
                name: s.name.clone(),
                role: s.role,
                node: s.node.clone(),
                pid: None,
                state: if remote {
                    ServiceState::Starting
                } else {
                    ServiceState::Pending
                },
                gpus: s.gpus.clone(),
                port: main_port(s),
                url: s.url.clone(),
                restarts: 0,
                revision: 0,
                ports: s.ports.clone(),
                uptime_s: None,
                last_exit: None,
                last_error: None,
                remote,
                unreachable_since_ms: None,
                cpu_percent: None,
                rss_bytes: None,
                gpu_memory_bytes: None,
            },
            run_started: None,
            usage: None,
            draining: false,
            retired: false,
            reported: None,
        }
    }
}

/// Every service's state, in plan order.
#[derive(Debug)]
pub struct Table {
    cluster: String,
    node: String,
    proxy_url: Option<String>,
    rows: Mutex<Vec<Row>>,
    version: watch::Sender<u64>,
}

impl Table {
    /// All local services `pending`, remote ones `starting` until their probe answers.
    pub fn new(plan: &Plan, node: &str) -> Table {
        let rows = plan.services.iter().map(|s| Row::new(s, node)).collect();
        Table {
            cluster: plan.cluster.clone(),
            node: node.to_string(),
            proxy_url: plan.proxy_url.clone(),
            rows: Mutex::new(rows),
            version: watch::channel(0).0,
        }
    }

    /// The pids of the local services that run now (what the usage sampler reads).
    pub fn local_pids(&self) -> Vec<u32> {
        self.rows()
            .iter()
            .filter(|r| !r.retired && !r.status.remote)
            .filter_map(|r| r.status.pid)
            .collect()
    }

    /// Takes a usage sample (by pid) into the rows of the processes it was taken of.
    /// Watchers are not woken: a figure changing is not a change of state.
    pub fn set_usage(&self, by_pid: &HashMap<u32, Usage>) {
        for r in self.rows().iter_mut() {
            r.usage = r
                .status
                .pid
                .and_then(|pid| by_pid.get(&pid).map(|u| (pid, *u)));
        }
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, Vec<Row>> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A snapshot as `pdctl status --json` prints it.
    pub fn report(&self) -> StatusReport {
        let now = Instant::now();
        let services = self
            .rows()
            .iter()
            .filter(|r| !r.retired)
            .map(|r| {
                let mut s = r.status.clone();
                if r.draining && s.state == ServiceState::Healthy {
                    s.state = ServiceState::Draining;
                }
                s.uptime_s = r
                    .run_started
                    .map(|t| (now - t).as_secs_f64())
                    .map(|u| (u * 10.0).round() / 10.0);
                // A sample of an earlier run's process says nothing of this one.
                if let Some((_, u)) = r.usage.filter(|(pid, _)| s.pid == Some(*pid)) {
                    s.cpu_percent = u.cpu_percent.map(|c| (c * 10.0).round() / 10.0);
                    s.rss_bytes = Some(u.rss_bytes);
                    s.gpu_memory_bytes = u.gpu_memory_bytes;
                }
                s
            })
            .collect();
        StatusReport {
            cluster: self.cluster.clone(),
            node: self.node.clone(),
            proxy_url: self.proxy_url.clone(),
            services,
            operation: None,
            rebalance: None,
            certificates: None,
        }
    }

    /// A row for slot `idx` (a new one, or a retired one taken over): `service` as not
    /// started yet.
    pub fn put(&self, idx: usize, service: &Service) {
        {
            let mut rows = self.rows();
            let row = Row::new(service, &self.node);
            if idx < rows.len() {
                rows[idx] = row;
            } else {
                rows.push(row);
            }
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// How slot `idx` is described changed (`Replace`): its GPUs, ports and URL, and one
    /// more revision.
    pub fn describe(&self, idx: usize, service: &Service) -> u64 {
        let mut revision = 0;
        self.update(idx, |s| {
            s.gpus = service.gpus.clone();
            s.port = main_port(service);
            s.ports = service.ports.clone();
            s.url = service.url.clone();
            s.revision += 1;
            revision = s.revision;
        });
        revision
    }

    /// Slot `idx` was removed: no longer reported.
    pub fn retire(&self, idx: usize) {
        self.rows()[idx].retired = true;
        self.version.send_modify(|v| *v += 1);
    }

    /// How many times service `idx`'s spec was replaced (its `revision`).
    pub fn revision(&self, idx: usize) -> u64 {
        self.rows()[idx].status.revision
    }

    /// Current state of service `idx`.
    pub fn state(&self, idx: usize) -> ServiceState {
        self.rows()[idx].status.state
    }

    /// Takes what node `node`'s supervisor reports of its own services (`(name, state)`)
    /// into the rows of this node that follow them. Wakes watchers when a state changed.
    pub fn set_reported(&self, node: &str, states: &[(String, ServiceState)]) {
        let changed = {
            let mut rows = self.rows();
            let mut changed = false;
            for r in rows
                .iter_mut()
                .filter(|r| r.status.remote && r.status.node == node)
            {
                let now = states
                    .iter()
                    .find(|(name, _)| *name == r.status.name)
                    .map(|(_, s)| *s);
                if now.is_some() && r.reported != now {
                    r.reported = now;
                    changed = true;
                }
            }
            changed
        };
        if changed {
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// Whether service `idx` is ready for the services that depend on it: healthy, and,
    /// on another node, not called anything else by that node's supervisor. Both views
    /// must agree, or a dependent (the proxy) would start while the status it routes by
    /// still says `starting`.
    pub fn ready_for_dependents(&self, idx: usize) -> bool {
        let rows = self.rows();
        let r = &rows[idx];
        r.status.state == ServiceState::Healthy
            && (!r.status.remote || r.reported.is_none_or(|s| s == ServiceState::Healthy))
    }

    /// What service `idx`'s own node's supervisor last reported of it (another node's
    /// service; none yet, or this node's own).
    pub fn reported(&self, idx: usize) -> Option<ServiceState> {
        self.rows()[idx].reported
    }

    /// How service `idx`'s last run ended, as its row says.
    pub fn last_exit(&self, idx: usize) -> Option<String> {
        self.rows()[idx].status.last_exit.clone()
    }

    /// Changes service `idx`'s row and wakes everyone waiting on the table.
    pub fn update(&self, idx: usize, change: impl FnOnce(&mut ServiceStatus)) {
        {
            let mut rows = self.rows();
            change(&mut rows[idx].status);
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// Sets only the state.
    pub fn set_state(&self, idx: usize, state: ServiceState) {
        self.update(idx, |s| s.state = state);
    }

    /// Takes service `idx` out of routing (reported `draining` while healthy) until its
    /// current run ends; false when it has no healthy run to drain.
    pub fn drain(&self, idx: usize) -> bool {
        let ok = {
            let mut rows = self.rows();
            let healthy = rows[idx].status.state == ServiceState::Healthy;
            if healthy {
                rows[idx].draining = true;
            }
            healthy
        };
        self.version.send_modify(|v| *v += 1);
        ok
    }

    /// Service `idx`, drained here, back in routing: one of another node (restarted
    /// there) is `starting` until its probe answers again; a local one (whose restart
    /// did not happen) goes on as its own watching says.
    pub fn resume(&self, idx: usize) {
        {
            let mut rows = self.rows();
            if rows[idx].draining {
                rows[idx].draining = false;
                if rows[idx].status.remote {
                    rows[idx].status.state = ServiceState::Starting;
                }
            }
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// A process for service `idx` just started: state `starting`, pid, uptime from now.
    pub fn run_started(&self, idx: usize, pid: Option<u32>, state: ServiceState) {
        {
            let mut rows = self.rows();
            rows[idx].run_started = Some(Instant::now());
            rows[idx].status.pid = pid;
            rows[idx].status.state = state;
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// The process of service `idx` is gone; `why` goes into `last_exit` and, with it,
    /// `error` (the run's last error line) into `last_error`. Without a `why` both keep
    /// what they said.
    pub fn run_ended(
        &self,
        idx: usize,
        state: ServiceState,
        why: Option<String>,
        error: Option<String>,
    ) {
        {
            let mut rows = self.rows();
            rows[idx].run_started = None;
            rows[idx].draining = false;
            rows[idx].status.pid = None;
            rows[idx].status.state = state;
            if why.is_some() {
                rows[idx].status.last_exit = why;
                rows[idx].status.last_error = error;
            }
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// A receiver that wakes on every change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

/// Samples the local services' processes every [`SAMPLE_EVERY`] into `table`, for as long
/// as the supervisor runs (the reading of `/proc` and NVML on a blocking thread).
pub async fn sample_usage(table: std::sync::Arc<Table>) {
    let mut sampler = match Sampler::new() {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("no CPU and memory figures in status: {e}");
            None
        }
    };
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(mut s) = sampler.take() else {
            return;
        };
        let pids = table.local_pids();
        let Ok((s, usage)) = tokio::task::spawn_blocking(move || {
            let usage = s.sample(&pids);
            (s, usage)
        })
        .await
        else {
            return;
        };
        table.set_usage(&usage);
        sampler = Some(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::testing;

    fn service(name: &str, node: &str) -> Service {
        let mut s = testing::tcp_service(name, node, 8100);
        s.ports.insert("metrics".to_string(), 9);
        s
    }

    #[test]
    fn remote_rows_are_marked_and_main_port_prefers_http() {
        let plan = testing::plan("a", vec![service("p0", "a"), service("p1", "b")]);
        let t = Table::new(&plan, "a");
        let r = t.report();
        assert_eq!(r.services[0].port, Some(8100));
        assert!(!r.services[0].remote && r.services[1].remote);
        assert_eq!(r.services[0].state, ServiceState::Pending);
        let rx = t.subscribe();
        t.run_started(0, Some(42), ServiceState::Starting);
        assert!(rx.has_changed().unwrap());
        let r = t.report();
        assert_eq!(r.services[0].pid, Some(42));
        assert!(r.services[0].uptime_s.is_some());
        t.run_ended(
            0,
            ServiceState::Failed,
            Some("exit 1".into()),
            Some("RuntimeError: x".into()),
        );
        let r = t.report();
        assert_eq!(r.services[0].last_exit.as_deref(), Some("exit 1"));
        assert_eq!(r.services[0].last_error.as_deref(), Some("RuntimeError: x"));
        // A later end without an error line does not keep the old one.
        t.run_ended(0, ServiceState::Stopped, Some("stopped".into()), None);
        assert_eq!(t.report().services[0].last_error, None);
        assert_eq!((r.services[0].pid, r.services[0].uptime_s), (None, None));
    }

    #[test]
    fn a_remote_service_is_ready_for_dependents_only_when_its_own_node_agrees() {
        let plan = testing::plan("a", vec![service("p0", "a"), service("d0", "b")]);
        let t = Table::new(&plan, "a");
        t.set_state(0, ServiceState::Healthy);
        assert!(t.ready_for_dependents(0), "a local healthy service");
        // This node's probe got an answer before node b's supervisor reported anything.
        t.run_started(1, None, ServiceState::Healthy);
        assert!(
            t.ready_for_dependents(1),
            "nothing reported yet: the probe's word"
        );
        let rx = t.subscribe();
        t.set_reported("b", &[("d0".into(), ServiceState::Starting)]);
        assert!(
            rx.has_changed().unwrap(),
            "a report that changes wakes waiters"
        );
        assert!(
            !t.ready_for_dependents(1),
            "its node still says starting: the proxy would route by that"
        );
        // Another node's report, or one without the service, changes nothing here.
        t.set_reported("c", &[("d0".into(), ServiceState::Healthy)]);
        t.set_reported("b", &[]);
        assert!(!t.ready_for_dependents(1));
        t.set_reported("b", &[("d0".into(), ServiceState::Healthy)]);
        assert!(t.ready_for_dependents(1));
        t.set_state(1, ServiceState::Unhealthy);
        assert!(
            !t.ready_for_dependents(1),
            "this node's probe failing counts too"
        );
    }
}
