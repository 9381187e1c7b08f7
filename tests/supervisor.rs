//! The supervisor end to end: `pdctl up / status / logs / down` with real etcd, real
//! mooncake_master and small HTTP engines, each test in its own state root on free ports.

use crate::common;
use crate::common::supervisor as sup;

use common::{free_ports, wait_until};
use pdctl::control::ServiceState;
use pdctl::vocab::{RestartMode, Role};
use std::time::{Duration, Instant};
use sup::*;

const UP_LIMIT: Duration = Duration::from_secs(30);

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn up_status_logs_down_with_real_etcd_and_mooncake_master_leaves_nothing() {
    let c = Cluster::new("lifecycle");
    let p = free_ports(6);
    let mut plan = plan("life", &[("main", "127.0.0.1")]);
    plan.services = vec![
        etcd("main", "127.0.0.1", p[0], p[1], &c.root().join("etcd-data")),
        mooncake_master("main", "127.0.0.1", p[2], p[3]),
        local_engine(&c, "prefill-0", Role::Prefill, p[4]),
        local_engine(&c, "decode-0", Role::Decode, p[5]),
    ];
    for i in [2, 3] {
        plan.services[i].depends_on = vec!["etcd".into(), "mooncake-master".into()];
    }
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    assert!(stdout(&up).contains("4/4 healthy"), "{}", text(&up));

    let state = c.state(&plan, "main");
    let run = run_id(&state);
    let report = c.status(&[]).expect("running");
    assert_eq!(report.cluster, "life");
    assert!(all_healthy(&report), "{report:?}");
    let etcd_row = svc(&report, "etcd");
    assert_eq!((etcd_row.role, etcd_row.port), (Role::Etcd, Some(p[0])));
    assert!(etcd_row.pid.is_some() && !etcd_row.remote);
    assert_eq!(svc(&report, "decode-0").port, Some(p[5]));
    // The JSON has the cluster and, for every service, each documented key.
    let raw = c.run(&["status", "--json"]);
    assert_eq!(raw.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&raw.stdout).unwrap();
    assert_eq!(v["cluster"], "life");
    let services = v["services"].as_array().expect("services");
    assert_eq!(services.len(), 4, "{v}");
    for key in [
        "name",
        "role",
        "node",
        "pid",
        "state",
        "gpus",
        "port",
        "restarts",
        "uptime_s",
        "last_exit",
        "last_error",
    ] {
        for s in services {
            assert!(s.get(key).is_some(), "{key} missing in {s}");
        }
    }
    let table = c.run(&["status"]);
    assert_eq!(table.status.code(), Some(0));
    assert!(stdout(&table).contains("SERVICE") && stdout(&table).contains("mooncake-master"));
    // All four processes carry the run marker.
    assert!(marked(&run).len() >= 4, "{:?}", marked(&run));

    let logs = c.run(&["logs", "mooncake-master"]);
    assert!(
        stdout(&logs).contains("Master service started on port"),
        "{}",
        text(&logs)
    );
    let role_logs = c.run(&["logs", "prefill"]);
    assert!(stdout(&role_logs).contains("engine listening on 127.0.0.1"));
    let tail = c.run(&["logs", "etcd", "-n", "3"]);
    assert_eq!(stdout(&tail).lines().count(), 3, "{}", text(&tail));
    let unknown = c.run(&["logs", "nosuch"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("decode-0, etcd"));

    let t = Instant::now();
    let down = c.run(&["down"]);
    assert_eq!(down.status.code(), Some(0), "{}", text(&down));
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(marked(&run).is_empty(), "left behind: {:?}", marked(&run));
    assert!(p.iter().all(|&port| port_free("127.0.0.1", port)));
    assert!(!state.socket_path().exists() && !state.record_path().exists());
    assert!(state.log_path("etcd").exists(), "logs are kept");
    assert_eq!(c.status(&[]), None, "status exits 3 once nothing runs");
    let again = c.run(&["down"]);
    assert_eq!(again.status.code(), Some(0), "down is idempotent");
    assert!(stdout(&again).contains("nothing to stop"));
    // Logs stay readable after down: a service named alone is unprefixed, a role is
    // prefixed even with one instance.
    let by_name = stdout(&c.run(&["logs", "decode-0"]));
    assert!(by_name.contains("engine listening"), "{by_name}");
    assert!(!by_name.contains("decode-0 |"), "{by_name}");
    let by_role = stdout(&c.run(&["logs", "decode"]));
    assert!(
        !by_role.is_empty() && by_role.lines().all(|l| l.starts_with("decode-0 | ")),
        "{by_role}"
    );
}

#[test]
fn a_sim_topology_comes_up_through_the_planner_and_a_crashed_engine_comes_back() {
    let c = Cluster::new("topology");
    let topo = c.root().join("pd.toml");
    let (text_toml, proxy_port) = sim_topology("simtopo", "mooncake-store", 2, 2, "");
    std::fs::write(&topo, text_toml).unwrap();
    let up = c.run(&["up", "-d", "-f", topo.to_str().unwrap()]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    assert!(
        stdout(&up).contains("pd.toml"),
        "says which topology: {}",
        text(&up)
    );
    let r = c.status(&[]).unwrap();
    assert_eq!(r.cluster, "simtopo");
    let names: Vec<&str> = r.services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "etcd",
            "mooncake-master",
            "prefill-0",
            "prefill-1",
            "decode-0",
            "decode-1",
            "proxy"
        ]
    );
    assert!(all_healthy(&r), "{r:?}");
    assert_eq!(r.proxy_url, Some(format!("http://127.0.0.1:{proxy_port}")));

    // A request through the embedded proxy shows up in status.
    let body = r#"{"model": "sim-model", "prompt": "hello pd", "max_tokens": 4}"#;
    assert_eq!(post_json(proxy_port, "/v1/completions", body), 200);
    let table = stdout(&c.run(&["status"]));
    assert!(table.contains("1 requests (0 failed)"), "{table}");
    // The planner puts a one-node cluster in <root>/<cluster>.
    let run = run_id(&pdctl::supervisor::StateDir::new(c.root().join("simtopo")));

    // The simulator's own crash fault: exits with status 1.
    let port = svc(&r, "prefill-1").port.unwrap();
    // Engines require the cluster's engine key on everything but probes and scrapes.
    assert_eq!(post_json(port, "/sim/fault", r#"{"crash": true}"#), 401);
    let key = c.engine_key();
    assert_eq!(
        post_json_with_key(port, "/sim/fault", r#"{"crash": true}"#, Some(&key)),
        200
    );
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        svc(r, "prefill-1").restarts == 1 && all_healthy(r)
    });
    assert_eq!(
        svc(&r, "prefill-1").last_exit.as_deref(),
        Some("exit 1"),
        "{r:?}"
    );
    let logs = stdout(&c.run(&["logs", "prefill"]));
    assert!(
        logs.contains("prefill-0 | ") && logs.contains("prefill-1 | "),
        "{logs}"
    );
    assert!(logs.contains("SIMULATED engine"), "{logs}");
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
    assert!(marked(&run).is_empty(), "{:?}", marked(&run));
}

#[test]
fn a_killed_engine_is_restarted_after_its_backoff_and_its_companion_with_it() {
    let c = Cluster::new("restart");
    let p = free_ports(2);
    let mut plan = plan("rst", &[("main", "127.0.0.1")]);
    let mut prefill = local_engine(&c, "prefill-0", Role::Prefill, p[0]);
    prefill.restart_with = vec!["decode-0".into()];
    let decode = local_engine(&c, "decode-0", Role::Decode, p[1]);
    plan.services = vec![prefill, decode];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));

    let before = c.status(&[]).unwrap();
    let old_pid = svc(&before, "prefill-0").pid.unwrap();
    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(old_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let mut saw_restarting = false;
    let after = c.wait_status(UP_LIMIT, &[], |r| {
        saw_restarting |= svc(r, "prefill-0").state == ServiceState::Restarting;
        svc(r, "prefill-0").restarts == 1 && all_healthy(r)
    });
    let healthy_again = killed_at.elapsed();
    let pre = svc(&after, "prefill-0");
    assert_eq!(pre.state, ServiceState::Healthy, "{after:?}");
    assert_eq!(pre.restarts, 1);
    assert_ne!(pre.pid, Some(old_pid));
    assert_eq!(pre.last_exit.as_deref(), Some("signal 9 (SIGKILL)"));
    assert!(saw_restarting, "the restarting state was never visible");
    // backoff_initial_ms is 300: no restart before it.
    assert!(
        healthy_again >= Duration::from_millis(300),
        "{healthy_again:?}"
    );
    let dec = svc(&after, "decode-0");
    assert_eq!(dec.restarts, 1, "restart_with companion: {after:?}");
    assert!(
        dec.last_exit
            .as_deref()
            .unwrap()
            .contains("together with prefill-0")
    );
    let log = stdout(&c.run(&["logs", "prefill-0"]));
    assert!(log.contains("start #2"), "{log}");
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// The error line [`engine_that_exits_0_once`] prints before it exits.
const ENGINE_CORE_DIED: &str =
    "ERROR 11-22 05:19:57 [core.py:812] RuntimeError: shape mismatch in layer 3";

/// The LAST EXIT cell of `service`'s row in the `pdctl status` table.
fn last_exit_cell(table: &str, service: &str) -> String {
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("{service} ")))
        .unwrap_or_else(|| panic!("no row for {service}: {table}"));
    let at = table.lines().nth(1).unwrap().find("LAST EXIT").unwrap();
    row.get(at..).unwrap_or("").to_string()
}

/// A test engine that, on its first run only, prints an error line and exits with
/// status 0 by itself shortly after it was found healthy.
fn engine_that_exits_0_once(c: &Cluster, port: u16) -> pdctl::vocab::Service {
    let mut s = local_engine(c, "decode-0", Role::Decode, port);
    let marker = c.root().join("decode-0-exited-once");
    s.env
        .insert("EXIT0_ONCE".into(), marker.display().to_string());
    s
}

/// A server that exits with status 0 without being asked to has failed (a vLLM API
/// server whose engine core died does exactly that): `on-failure` restarts it.
#[test]
fn an_engine_that_exits_0_on_its_own_is_restarted() {
    let c = Cluster::new("exit0");
    let p = free_ports(1);
    let mut plan = plan("exz", &[("main", "127.0.0.1")]);
    plan.services = vec![engine_that_exits_0_once(&c, p[0])];
    assert_eq!(plan.services[0].restart.mode, RestartMode::OnFailure);
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        let d = svc(r, "decode-0");
        d.restarts == 1 && d.state == ServiceState::Healthy
    });
    let d = svc(&r, "decode-0");
    assert_eq!(
        (d.state, d.restarts),
        (ServiceState::Healthy, 1),
        "an exit 0 was not restarted: {r:?}"
    );
    assert!(d.pid.is_some());
    assert_eq!(d.last_exit.as_deref(), Some("exit 0"), "{r:?}");
    // The error line is the last one that looked like an error, not the last line.
    assert_eq!(d.last_error.as_deref(), Some(ENGINE_CORE_DIED), "{r:?}");
    let table = stdout(&c.run(&["status"]));
    assert_eq!(
        last_exit_cell(&table, "decode-0"),
        "exit 0: RuntimeError: shape mismatch in layer 3",
        "{table}"
    );
    let log = stdout(&c.run(&["logs", "decode-0"]));
    assert!(
        log.contains("run #1 ended: exit 0") && log.contains("start #2"),
        "{log}"
    );
    let sup_log = stdout(&c.run(&["logs", "supervisor"]));
    assert!(
        sup_log.contains(
            "decode-0: exit 0 (last error: RuntimeError: shape mismatch in layer 3); restarting in"
        ),
        "{sup_log}"
    );
    assert_eq!(c.run(&["status"]).status.code(), Some(0));
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// With restart mode `never` the same exit 0 is not restarted: the service is `failed`
/// and `status` says so.
#[test]
fn with_restart_never_an_engine_that_exits_0_stays_down_failed() {
    let c = Cluster::new("exit0never");
    let p = free_ports(1);
    let mut plan = plan("exn", &[("main", "127.0.0.1")]);
    let mut dying = engine_that_exits_0_once(&c, p[0]);
    dying.restart.mode = RestartMode::Never;
    plan.services = vec![dying];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        svc(r, "decode-0").state == ServiceState::Failed
    });
    let d = svc(&r, "decode-0");
    assert_eq!(d.state, ServiceState::Failed, "{r:?}");
    assert_eq!(
        d.last_exit.as_deref(),
        Some("exit 0; restart policy is `never`"),
        "{r:?}"
    );
    assert_eq!(d.last_error.as_deref(), Some(ENGINE_CORE_DIED), "{r:?}");
    // Longer than the 300 ms backoff: no restart came.
    std::thread::sleep(Duration::from_millis(1500));
    let r = c.status(&[]).unwrap();
    let d = svc(&r, "decode-0");
    assert_eq!(
        (d.state, d.restarts, d.pid),
        (ServiceState::Failed, 0, None)
    );
    let st = c.run(&["status"]);
    assert_eq!(st.status.code(), Some(1), "{}", text(&st));
    assert_eq!(
        last_exit_cell(&stdout(&st), "decode-0"),
        "exit 0; restart policy is `never`: RuntimeError: shape mismatch in layer 3",
        "{}",
        text(&st)
    );
    assert!(stdout(&st).contains("failed"), "{}", text(&st));
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// The simulated engine exiting 0 by itself (the sim's `exit` fault, as a vLLM server
/// whose engine core died) is restarted like any other failure, through the planner's
/// default restart policy, and the cluster serves again.
#[test]
fn a_sim_engine_that_exits_0_is_restarted_and_serves_again() {
    let c = Cluster::new("simexit0");
    let topo = c.root().join("pd.toml");
    let (text_toml, proxy_port) = sim_topology("simexit", "mooncake-store", 1, 1, "");
    std::fs::write(&topo, text_toml).unwrap();
    let up = c.run(&["up", "-d", "-f", topo.to_str().unwrap()]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let r = c.status(&[]).unwrap();
    let port = svc(&r, "decode-0").port.unwrap();
    let key = c.engine_key();
    assert_eq!(
        post_json_with_key(port, "/sim/fault", r#"{"exit": 0}"#, Some(&key)),
        200
    );
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        svc(r, "decode-0").restarts == 1 && all_healthy(r)
    });
    let d = svc(&r, "decode-0");
    assert_eq!((d.state, d.restarts), (ServiceState::Healthy, 1), "{r:?}");
    assert_eq!(d.last_exit.as_deref(), Some("exit 0"), "{r:?}");
    let error = d.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("ERROR") && error.contains("RuntimeError: the simulated engine core died"),
        "{r:?}"
    );
    let table = stdout(&c.run(&["status"]));
    assert!(
        last_exit_cell(&table, "decode-0")
            .starts_with("exit 0: fault injection: exit requested: RuntimeError"),
        "{table}"
    );
    // The proxy learns of the healthy instance from its next poll of the supervisor.
    let body = r#"{"model": "sim-model", "prompt": "hello again", "max_tokens": 4}"#;
    assert!(
        wait_until(Duration::from_secs(5), || {
            post_json(proxy_port, "/v1/completions", body) == 200
        }),
        "the proxy never served again after the restart"
    );
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// Two services restarted together (`restart_with` both ways) that both keep crashing:
/// restarting one along with the other must not wipe its crash count, or neither would
/// ever reach the crash-loop limit.
#[test]
fn coupled_services_that_keep_crashing_both_end_failed() {
    let c = Cluster::new("coupledloop");
    let p = free_ports(2);
    let mut plan = plan("cpl", &[("main", "127.0.0.1")]);
    let mut services = Vec::new();
    for (i, (name, role, other)) in [
        ("prefill-0", Role::Prefill, "decode-0"),
        ("decode-0", Role::Decode, "prefill-0"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = engine(&c, name, role, "main", "127.0.0.1", p[i], Some(0.6));
        s.restart.max_restarts = 2;
        s.restart.backoff_initial_ms = 50;
        s.restart_with = vec![other.into()];
        services.push(s);
    }
    plan.services = services;
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        r.services.iter().all(|s| s.state == ServiceState::Failed)
    });
    assert!(
        r.services.iter().all(|s| s.state == ServiceState::Failed),
        "a coupled crash loop was never stopped: {r:?}"
    );
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

#[test]
fn an_engine_that_keeps_crashing_ends_failed_and_status_says_so() {
    let c = Cluster::new("crashloop");
    let p = free_ports(2);
    let mut plan = plan("loop", &[("main", "127.0.0.1")]);
    // Healthy at first, then exits with status 1 after 0.6 s, every time.
    let mut flaky = engine(
        &c,
        "decode-0",
        Role::Decode,
        "main",
        "127.0.0.1",
        p[0],
        Some(0.6),
    );
    flaky.restart.max_restarts = 2;
    flaky.restart.backoff_initial_ms = 50;
    let steady = local_engine(&c, "prefill-0", Role::Prefill, p[1]);
    plan.services = vec![steady, flaky];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        svc(r, "decode-0").state == ServiceState::Failed
    });
    let d = svc(&r, "decode-0");
    assert_eq!(d.state, ServiceState::Failed, "{r:?}");
    assert_eq!(d.restarts, 2);
    let why = d.last_exit.as_deref().unwrap();
    assert!(
        why.contains("exit 1") && why.contains("crash loop"),
        "{why}"
    );
    assert_eq!(d.pid, None);
    assert_eq!(svc(&r, "prefill-0").state, ServiceState::Healthy);
    let st = c.run(&["status"]);
    assert_eq!(st.status.code(), Some(1), "not all healthy: exit 1");
    assert!(stdout(&st).contains("failed"));

    // A restart asked for over the control socket (what the proxy or a person uses).
    let socket = c.state(&plan, "main").socket_path();
    let ask = |service: &str| {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let req = pdctl::control::Request::Restart {
            service: service.into(),
        };
        rt.block_on(pdctl::control::client::send(
            &socket,
            &req,
            Duration::from_secs(5),
        ))
        .unwrap()
    };
    let old_pid = svc(&r, "prefill-0").pid;
    match ask("prefill-0") {
        pdctl::control::Response::Done { message } => assert!(message.contains("prefill-0")),
        other => panic!("{other:?}"),
    }
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        let p = svc(r, "prefill-0");
        p.restarts == 1 && p.state == ServiceState::Healthy
    });
    assert_ne!(svc(&r, "prefill-0").pid, old_pid, "{r:?}");
    assert_eq!(
        svc(&r, "prefill-0").last_exit.as_deref(),
        Some("restart requested")
    );
    match ask("nosuch") {
        pdctl::control::Response::Error { message } => {
            assert!(message.contains("prefill-0, decode-0"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

#[test]
fn an_engine_that_stops_answering_is_restarted_by_its_liveness_probe() {
    let c = Cluster::new("liveness");
    let p = free_ports(1);
    let mut plan = plan("live", &[("main", "127.0.0.1")]);
    let mut sick = local_engine(&c, "decode-0", Role::Decode, p[0]);
    sick.env.insert("SICK_AFTER".into(), "1.5".into());
    plan.services = vec![sick];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let first_pid = svc(&c.status(&[]).unwrap(), "decode-0").pid;
    let mut saw_unhealthy = false;
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        saw_unhealthy |= svc(r, "decode-0").state == ServiceState::Unhealthy;
        svc(r, "decode-0").restarts >= 1
    });
    let d = svc(&r, "decode-0");
    assert!(d.restarts >= 1, "{r:?}");
    let why = d.last_exit.as_deref().unwrap();
    assert!(
        why.contains("liveness failed 2 times") && why.contains("503"),
        "{why}"
    );
    assert!(
        saw_unhealthy,
        "unhealthy was never shown before the restart"
    );
    assert_ne!(d.pid, first_pid);
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// A probe that timed out while the supervisor itself was frozen (the whole machine was:
/// here the supervisor and its engine are both SIGSTOPped for 4 s, as a machine that
/// freezes whole does to every process) says nothing of the engine and is not counted:
/// with one failed probe enough to call it unhealthy, the engine stays healthy, and the
/// log says why. On two vLLM engines on one busy 2-core machine such freezes took a
/// serving decode out of rotation.
/// Whether a connection to 127.0.0.1:`port` holds bytes its listener has not read (a
/// probe's request to a stopped engine), from /proc/net/tcp.
fn unread_request_on(port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    tcp.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let local_port = f
            .get(1)
            .and_then(|a| a.split(':').nth(1))
            .and_then(|p| u16::from_str_radix(p, 16).ok());
        let unread = f
            .get(4)
            .and_then(|q| q.split(':').nth(1))
            .and_then(|r| u64::from_str_radix(r, 16).ok());
        local_port == Some(port) && f.get(3) == Some(&"01") && unread.is_some_and(|n| n > 0)
    })
}

#[test]
fn a_probe_that_timed_out_while_the_supervisor_was_frozen_is_not_counted() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let c = Cluster::new("frozen");
    let p = free_ports(1);
    let mut plan = plan("frz", &[("main", "127.0.0.1")]);
    plan.health.probe_timeout_s = 1;
    plan.health.failed_probes = 1;
    plan.services = vec![local_engine(&c, "decode-0", Role::Decode, p[0])];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let state = c.state(&plan, "main");
    let record = pdctl::supervisor::read_record(&state).unwrap().unwrap();
    let supervisor = Pid::from_raw(record.supervisor_pid);
    let engine = Pid::from_raw(svc(&c.status(&[]).unwrap(), "decode-0").pid.unwrap() as i32);
    // The engine stops first; the moment a probe waits on it (its request unread in the
    // engine's socket), the supervisor freezes too, with most of the probe's 1 s ahead.
    std::thread::sleep(Duration::from_millis(1_500));
    kill(engine, Signal::SIGSTOP).unwrap();
    let waiting = wait_until(Duration::from_secs(5), || unread_request_on(p[0]));
    kill(supervisor, Signal::SIGSTOP).unwrap();
    assert!(waiting, "no probe reached the stopped engine");
    std::thread::sleep(Duration::from_secs(3));
    kill(supervisor, Signal::SIGCONT).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kill(engine, Signal::SIGCONT).unwrap();
    let mut states = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        if let Some(r) = c.status(&[]) {
            states.push(svc(&r, "decode-0").state);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(state.dir.join("logs/supervisor.log")).unwrap_or_default();
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
    assert!(
        log.contains("while this machine stalled") && log.contains("not counted"),
        "the uncounted probe is logged:\n{log}"
    );
    assert!(!states.is_empty());
    assert!(
        states.iter().all(|s| *s == ServiceState::Healthy),
        "{states:?}\n{log}"
    );
}

#[test]
fn a_sigkilled_supervisor_leaves_no_orphans_and_the_next_up_cleans_its_state() {
    let c = Cluster::new("sigkill");
    let p = free_ports(2);
    let mut plan = plan("orph", &[("main", "127.0.0.1")]);
    let mut forking = local_engine(&c, "prefill-0", Role::Prefill, p[0]);
    forking.env.insert("FORK".into(), "1".into());
    plan.services = vec![forking, local_engine(&c, "decode-0", Role::Decode, p[1])];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let state = c.state(&plan, "main");
    let record = pdctl::supervisor::read_record(&state).unwrap().unwrap();
    // Two engines and the engine's own child (a grandchild of the supervisor).
    assert!(wait_until(Duration::from_secs(5), || marked(
        &record.run_id
    )
    .len()
        >= 3));

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(record.supervisor_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let gone = wait_until(Duration::from_secs(2), || marked(&record.run_id).is_empty());
    assert!(gone, "orphans after 2 s: {:?}", marked(&record.run_id));
    assert_eq!(c.status(&[]), None, "a dead supervisor is not running");
    assert!(
        state.record_path().exists(),
        "stale record left for the next up"
    );

    let again = c.up_detached(&plan, &[]);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again));
    assert!(
        stdout(&again).contains(&format!(
            "cleaned up after a supervisor (pid {})",
            record.supervisor_pid
        )),
        "{}",
        text(&again)
    );
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// A grandchild without the run marker in its environment (vLLM's engine core overwrites
/// it with its process title) is still found and killed after the supervisor's SIGKILL,
/// as a member of the detached supervisor's session.
#[test]
fn a_sigkilled_supervisor_leaves_no_unmarked_grandchild() {
    let c = Cluster::new("sigkill-noenv");
    let p = free_ports(1);
    let mut plan = plan("orph2", &[("main", "127.0.0.1")]);
    let mut forking = local_engine(&c, "decode-0", Role::Decode, p[0]);
    forking.env.insert("FORK".into(), "noenv".into());
    plan.services = vec![forking];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let state = c.state(&plan, "main");
    let record = pdctl::supervisor::read_record(&state).unwrap().unwrap();
    let mut child = None;
    assert!(wait_until(Duration::from_secs(5), || {
        let log = std::fs::read_to_string(state.log_path("decode-0")).unwrap_or_default();
        child = log.lines().find_map(|l| {
            l.strip_prefix("unmarked child ")?
                .trim()
                .parse::<i32>()
                .ok()
        });
        child.is_some()
    }));
    let child = child.unwrap();
    let alive = |pid: i32| pdctl::supervisor::process(pid).is_some_and(|p| !p.is_zombie());
    assert!(alive(child));
    assert!(
        !marked(&record.run_id).contains(&child),
        "the child carries the marker"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(record.supervisor_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let gone = wait_until(Duration::from_secs(3), || !alive(child));
    if !gone {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(
        gone,
        "the unmarked grandchild {child} outlived the SIGKILLed supervisor"
    );
    let _ = c.run(&["down"]);
}

#[test]
fn preflight_reports_a_busy_port_and_a_missing_program_together_and_spawns_nothing() {
    let c = Cluster::new("preflight");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();
    let p = free_ports(1);
    let mut plan = plan("pre", &[("main", "127.0.0.1")]);
    let mut missing = local_engine(&c, "decode-0", Role::Decode, p[0]);
    missing.argv[0] = "vllm-not-installed-here".into();
    plan.services = vec![
        local_engine(&c, "prefill-0", Role::Prefill, busy_port),
        missing,
    ];
    let out = c.up_detached(&plan, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("2 problem(s), nothing was started"), "{err}");
    assert!(err.contains(&format!(
        "port {busy_port} (http) on 127.0.0.1 is already in use"
    )));
    assert!(err.contains("program `vllm-not-installed-here` not found"));
    let state = c.state(&plan, "main");
    assert!(!state.record_path().exists(), "no supervisor was started");
    assert!(
        !state.log_path("prefill-0").exists(),
        "no service was started"
    );
    assert_eq!(c.status(&[]), None);

    let garbled = c.root().join("garbled.json");
    std::fs::write(&garbled, "{\"cluster\": 1").unwrap();
    let bad = c.run(&["up", "-d", "--plan", garbled.to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("garbled.json is not a valid plan"));

    // A topology mistake is reported with file, line and key, before any state exists.
    let topo = c.root().join("typo.toml");
    std::fs::write(&topo, "cluster = \"typo\"\n[model]\nname = \"m\"\n[engine]\nkind = \"sim\"\n[prefill]\ninstnces = 2\n").unwrap();
    let typo = c.run(&["up", "-d", "-f", topo.to_str().unwrap()]);
    assert_eq!(typo.status.code(), Some(2), "{}", text(&typo));
    let err = String::from_utf8_lossy(&typo.stderr);
    assert!(
        err.contains("typo.toml:7:1: prefill.instnces: unknown key"),
        "{err}"
    );
    assert!(
        !c.root().join("typo").exists(),
        "nothing was created for it"
    );
}

#[test]
fn a_start_failure_is_reported_fast_with_the_last_log_lines() {
    let c = Cluster::new("startfail");
    let p = free_ports(2);
    let mut plan = plan("sfail", &[("main", "127.0.0.1")]);
    let mut broken = local_engine(&c, "decode-0", Role::Decode, p[0]);
    broken.argv = [
        "sh",
        "-c",
        "echo loading weights; echo 'CUDA out of memory' >&2; exit 3",
    ]
    .map(String::from)
    .to_vec();
    let mut proxy = local_engine(&c, "proxy", Role::Proxy, p[1]);
    proxy.depends_on = vec!["decode-0".into()];
    plan.services = vec![broken, proxy];
    let t = Instant::now();
    let out = c.up_detached(&plan, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("decode-0 failed: exit 3 while starting"),
        "{err}"
    );
    assert!(err.contains("CUDA out of memory"), "{err}");
    // The supervisor stays for inspection; the dependant never started.
    let r = c.status(&[]).expect("supervisor still up");
    assert_eq!(svc(&r, "decode-0").state, ServiceState::Failed);
    assert_eq!(svc(&r, "proxy").state, ServiceState::Failed);
    assert!(
        svc(&r, "proxy")
            .last_exit
            .as_deref()
            .unwrap()
            .contains("dependency decode-0")
    );
    assert_eq!(c.run(&["down"]).status.code(), Some(0));

    // In the foreground the same failure takes everything down and exits 1.
    let path = c.write_plan(&plan);
    let fg = c.run(&["up", "--plan", path.to_str().unwrap()]);
    assert_eq!(fg.status.code(), Some(1), "{}", text(&fg));
    let out = stdout(&fg);
    assert!(
        out.contains("decode-0 failed: exit 3 while starting"),
        "{out}"
    );
    assert!(out.contains("CUDA out of memory"), "{out}");
    assert!(
        out.contains("stopping the cluster because it could not start"),
        "{out}"
    );
    assert_eq!(c.status(&[]), None);
}

#[test]
fn foreground_up_streams_prefixed_logs_and_sigint_takes_the_cluster_down() {
    use std::io::{BufRead, BufReader};
    let c = Cluster::new("foreground");
    let p = free_ports(1);
    let mut plan = plan("fg", &[("main", "127.0.0.1")]);
    let mut chatty = local_engine(&c, "prefill-0", Role::Prefill, p[0]);
    chatty.env.insert("CHATTY".into(), "1".into());
    plan.services = vec![chatty];
    let path = c.write_plan(&plan);
    let mut cmd = common::pdctl(&["up", "--plan", path.to_str().unwrap()]);
    cmd.arg("--state-dir").arg(c.root());
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut guard = common::ChildGuard(cmd.spawn().unwrap());
    let reader = BufReader::new(guard.0.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in reader.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + UP_LIMIT;
    while !seen
        .iter()
        .any(|l: &String| l.starts_with("prefill-0 | chat "))
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("no prefixed log line; output so far:\n{}", seen.join("\n")),
        }
    }
    let all = seen.join("\n");
    assert!(all.contains("all local services healthy"), "{all}");
    assert!(
        all.contains("SERVICE"),
        "status table before the logs: {all}"
    );
    let run = run_id(&c.state(&plan, "main"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard.pid() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = wait_exit(&mut guard.0, Duration::from_secs(10)).expect("up exits after SIGINT");
    assert_eq!(status.code(), Some(0));
    // The reader ends at EOF, once every writer of the pipe (the supervisor) is gone.
    let rest: Vec<String> =
        std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(5)).ok()).collect();
    assert!(
        rest.iter().any(|l| l.contains("stopped 1 service(s)")),
        "{rest:?}"
    );
    assert!(marked(&run).is_empty());
    assert_eq!(c.status(&[]), None);
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn two_nodes_on_loopback_addresses_start_in_either_order_and_see_each_other() {
    // Two "machines": each node's supervisor has its own state root.
    let c = Cluster::new("twonode-head");
    let w = Cluster::new("twonode-worker");
    let p = free_ports(4);
    let (head, worker) = (("head", "127.0.0.2"), ("worker", "127.0.0.3"));
    let mut plan = plan("duo", &[head, worker]);
    let mut decode = engine(&c, "decode-0", Role::Decode, worker.0, worker.1, p[3], None);
    decode.depends_on = vec!["etcd".into()];
    let mut prefill = engine(&c, "prefill-0", Role::Prefill, head.0, head.1, p[2], None);
    prefill.depends_on = vec!["etcd".into()];
    plan.services = vec![
        etcd(head.0, head.1, p[0], p[1], &c.root().join("etcd-data")),
        prefill,
        decode,
    ];
    let nowhere = c.up_detached(&plan, &["--node", "nowhere"]);
    assert_eq!(nowhere.status.code(), Some(2), "{}", text(&nowhere));
    assert!(String::from_utf8_lossy(&nowhere.stderr).contains("(nodes: head, worker)"));

    // The worker first: its decode waits for etcd on the head.
    let worker_plan = plan.clone();
    let worker_up = std::thread::scope(|scope| {
        let waiting = scope.spawn(|| w.up_detached(&worker_plan, &["--node", "worker"]));
        let mut seen = None;
        wait_until(UP_LIMIT, || {
            seen = w.status(&[]);
            seen.is_some()
        });
        let r = seen.expect("the worker's supervisor runs");
        assert_eq!(svc(&r, "decode-0").state, ServiceState::Pending, "{r:?}");
        assert!(svc(&r, "etcd").remote);

        let head_up = c.up_detached(&plan, &["--node", "head"]);
        assert_eq!(head_up.status.code(), Some(0), "{}", text(&head_up));
        waiting.join().unwrap()
    });
    assert_eq!(worker_up.status.code(), Some(0), "{}", text(&worker_up));
    let on_worker = w.status(&[]).unwrap();
    assert!(!svc(&on_worker, "decode-0").remote && svc(&on_worker, "etcd").remote);

    let r = c.wait_status(UP_LIMIT, &[], all_healthy);
    assert!(all_healthy(&r), "head sees every instance healthy: {r:?}");
    let remote = svc(&r, "decode-0");
    assert!(remote.remote && remote.node == "worker");
    assert_eq!(remote.pid, None, "remote: not the head's process");
    // The head probed it while the worker had not started it yet (refused): that is no
    // exit of the run that serves, so LAST EXIT says nothing.
    assert_eq!(remote.last_exit, None, "{remote:?}");
    assert_eq!(c.run(&["status"]).status.code(), Some(0));

    // The worker goes away: the head shows its instance unhealthy, status exits 1.
    assert_eq!(w.run(&["down"]).status.code(), Some(0));
    let r = c.wait_status(UP_LIMIT, &[], |r| {
        svc(r, "decode-0").state == ServiceState::Unhealthy
    });
    assert_eq!(svc(&r, "decode-0").state, ServiceState::Unhealthy);
    assert_eq!(c.run(&["status"]).status.code(), Some(1));
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
    assert!(
        p.iter()
            .all(|&port| port_free("127.0.0.2", port) && port_free("127.0.0.3", port))
    );
}

#[test]
fn a_second_up_is_refused_and_several_clusters_need_a_name() {
    let c = Cluster::new("twice");
    let p = free_ports(2);
    let mut once = plan("once", &[("main", "127.0.0.1")]);
    once.services = vec![local_engine(&c, "prefill-0", Role::Prefill, p[0])];
    assert_eq!(c.up_detached(&once, &[]).status.code(), Some(0));
    let again = c.up_detached(&once, &[]);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again));
    assert!(String::from_utf8_lossy(&again.stderr).contains("is already running"));
    assert_eq!(
        svc(&c.status(&[]).unwrap(), "prefill-0").state,
        ServiceState::Healthy
    );

    let mut other = plan("other", &[("main", "127.0.0.1")]);
    other.services = vec![local_engine(&c, "decode-0", Role::Decode, p[1])];
    assert_eq!(c.up_detached(&other, &[]).status.code(), Some(0));
    for cmd in [&["status"][..], &["down"], &["logs", "prefill"]] {
        let out = c.run(cmd);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("once, other") && err.contains("--cluster"),
            "{err}"
        );
    }
    assert_eq!(c.status(&["--cluster", "other"]).unwrap().cluster, "other");
    assert_eq!(c.run(&["down", "--cluster", "once"]).status.code(), Some(0));
    // One left: no name needed any more.
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
    assert_eq!(c.status(&[]), None);
}

#[test]
fn logs_rotate_by_size_and_follow_continues_across_rotations() {
    use std::io::{BufRead, BufReader};
    let c = Cluster::new("rotate");
    let p = free_ports(1);
    let mut plan = plan("rot", &[("main", "127.0.0.1")]);
    let mut chatty = local_engine(&c, "prefill-0", Role::Prefill, p[0]);
    chatty.env.insert("CHATTY".into(), "1".into());
    plan.services = vec![chatty];
    let up = c.up_detached(&plan, &["--log-max-bytes", "2000", "--log-keep", "2"]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let state = c.state(&plan, "main");
    let mut cmd = common::pdctl(&["logs", "prefill-0", "-f", "-n", "1"]);
    cmd.arg("--state-dir").arg(c.root());
    cmd.stdout(std::process::Stdio::piped());
    let mut follower = common::ChildGuard(cmd.spawn().unwrap());
    let lines = BufReader::new(follower.0.stdout.take().unwrap()).lines();
    // 600 lines of 14 bytes is 8400 bytes: four rotations while following.
    let numbers: Vec<u64> = lines
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("chat ").and_then(|n| n.parse().ok()))
        .take(600)
        .collect();
    drop(follower);
    assert_eq!(numbers.len(), 600);
    assert!(
        numbers.windows(2).all(|w| w[1] == w[0] + 1),
        "lines were lost or repeated across rotation"
    );
    let rotated = |i: u32| pdctl::supervisor::rotated_path(&state.log_path("prefill-0"), i);
    assert!(rotated(1).exists() && rotated(2).exists());
    assert!(!rotated(3).exists(), "only --log-keep 2 copies are kept");
    assert!(
        std::fs::metadata(state.log_path("prefill-0"))
            .unwrap()
            .len()
            < 4000 + 200
    );
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}

/// Issue 23: a service's typed settings go to whoever follows them (the running proxy
/// does) as a typed message: at once, and again when a `Replace` brings new ones, which
/// plan.json keeps. Nothing is read back from a file.
#[test]
fn typed_settings_are_sent_to_their_follower_at_once_and_again_when_replaced() {
    use pdctl::child_config::ChildSettings;
    use pdctl::child_config::proxy::ProxyArgs;
    use pdctl::control::{Request, Response};
    let c = Cluster::new("settings");
    let p = free_ports(1);
    let mut plan = plan("settings", &[("main", "127.0.0.1")]);
    let engine = local_engine(&c, "prefill-0", Role::Prefill, p[0]);
    let first = ProxyArgs {
        retries: 1,
        ..ProxyArgs::default()
    };
    plan.settings.insert(
        "prefill-0".into(),
        ChildSettings::Proxy(Box::new(first.clone())),
    );
    plan.services = vec![engine.clone()];
    let up = c.up_detached(&plan, &[]);
    assert_eq!(up.status.code(), Some(0), "{}", text(&up));
    let state = c.state(&plan, "main");
    let socket = state.socket_path();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let follower = {
        let socket = socket.clone();
        rt.spawn(async move {
            pdctl::control::client::watch_settings(&socket, "prefill-0", |rev, s| {
                let _ = tx.send((rev, s));
            })
            .await
        })
    };
    let next = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<(u64, Option<ChildSettings>)>| {
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), rx.recv()).await })
            .expect("no settings within 10 s")
            .expect("the follower ended")
    };
    let (rev, got) = next(&mut rx);
    assert_eq!(rev, 0);
    assert_eq!(got.as_ref().and_then(|s| s.proxy()), Some(&first));

    let second = ProxyArgs {
        retries: 7,
        ..first.clone()
    };
    let req = Request::Replace {
        service: Box::new(engine),
        settings: Some(Box::new(ChildSettings::Proxy(Box::new(second.clone())))),
    };
    let answer = rt
        .block_on(pdctl::control::client::send(
            &socket,
            &req,
            Duration::from_secs(5),
        ))
        .unwrap();
    assert!(matches!(answer, Response::Done { .. }), "{answer:?}");
    let (rev, got) = next(&mut rx);
    assert_eq!(rev, 1);
    assert_eq!(got.as_ref().and_then(|s| s.proxy()), Some(&second));
    assert_eq!(svc(&c.status(&[]).unwrap(), "prefill-0").revision, 1);
    let kept: pdctl::plan::Plan =
        serde_json::from_str(&std::fs::read_to_string(state.plan_path()).unwrap()).unwrap();
    assert_eq!(
        kept.settings_of("prefill-0").and_then(|s| s.proxy()),
        Some(&second),
        "plan.json keeps the new settings"
    );
    follower.abort();

    // A service the cluster does not have is refused by name.
    let e = rt
        .block_on(pdctl::control::client::watch_settings(
            &socket,
            "nosuch",
            |_, _| {},
        ))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no service `nosuch`"), "{e}");
    assert_eq!(c.run(&["down"]).status.code(), Some(0));
}
