//! Helpers for the supervisor's integration tests: hand-built plans with real etcd,
//! real mooncake_master and small HTTP engines; a cluster guard that kills everything
//! a test started even when it fails; status and process checks.
#![allow(dead_code)]

use crate::common::{TempDir, pdctl};
use pdctl::control::{ServiceState, StatusReport};
use pdctl::plan::Plan;
use pdctl::supervisor::marked_processes;
use pdctl::supervisor::{StateDir, read_record};
use pdctl::vocab::{Probe, RestartMode, RestartPolicy, Role, Service, Shutdown};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// A tiny HTTP engine: answers every GET with 200, prints a line when listening, and
/// with a second argument exits with status 1 after that many seconds. With CHATTY=1 it
/// prints a numbered line every 5 ms (for log rotation). With FORK=1 it leaves a
/// `sleep` child behind (a grandchild of the supervisor, like vLLM's engine core); with
/// FORK=noenv that child has an empty environment (no run marker) and its pid is printed. With
/// SICK_AFTER=S it answers 503 after S seconds while staying alive (a hung engine). With
/// EXIT0_ONCE=PATH, on its first run only (while PATH does not exist), it answers one GET,
/// then prints a vLLM-style error line and a harmless line after it and exits with
/// status 0, as a vLLM API server whose engine core died does.
pub const ENGINE_PY: &str = r#"
import http.server, os, sys, threading, time, subprocess
STARTED = time.time()
host, port = sys.argv[1], int(sys.argv[2])
exit_after = float(sys.argv[3]) if len(sys.argv) > 3 else 0
EXIT0_ONCE = os.environ.get("EXIT0_ONCE")
def die_cleanly():
    print("ERROR 11-22 05:19:57 [core.py:812] RuntimeError: shape mismatch in layer 3", file=sys.stderr, flush=True)
    print("INFO:     Shutting down", flush=True)
    os._exit(0)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global EXIT0_ONCE
        if EXIT0_ONCE and not os.path.exists(EXIT0_ONCE):
            open(EXIT0_ONCE, "w").close()
            EXIT0_ONCE = None
            threading.Timer(0.3, die_cleanly).start()
        sick = os.environ.get("SICK_AFTER")
        if sick and time.time() - STARTED > float(sick):
            self.send_response(503)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
if os.environ.get("FORK") == "noenv":
    # Like vLLM's engine core, whose process title overwrites its environment: a child
    # that does not carry the run marker.
    child = subprocess.Popen(["sleep", "1001"], env={})
    print(f"unmarked child {child.pid}", flush=True)
elif os.environ.get("FORK"):
    subprocess.Popen(["sleep", "1000"])
if exit_after:
    threading.Timer(exit_after, lambda: os._exit(1)).start()
if os.environ.get("CHATTY"):
    def chat():
        i = 0
        while True:
            print(f"chat {i:08d}", flush=True)
            i += 1
            time.sleep(0.005)
    threading.Thread(target=chat, daemon=True).start()
srv = http.server.HTTPServer((host, port), H)
print(f"engine listening on {host}:{port}", flush=True)
srv.serve_forever()
"#;

/// A temporary state root plus the engine script; on drop, stops every cluster under
/// the root by force (supervisor and all marked processes), so a failed test leaves
/// nothing running.
pub struct Cluster {
    pub root: TempDir,
    pub engine: PathBuf,
}

impl Cluster {
    pub fn new(tag: &str) -> Cluster {
        let root = TempDir::new(tag);
        let engine = root.path().join("engine.py");
        std::fs::write(&engine, ENGINE_PY).unwrap();
        Cluster { root, engine }
    }

    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// The state dir `up --plan P --state-dir ROOT` uses for `plan` on `node`.
    pub fn state(&self, plan: &Plan, node: &str) -> StateDir {
        let dir = if plan.nodes.len() > 1 {
            format!("{}-{node}", plan.cluster)
        } else {
            plan.cluster.clone()
        };
        StateDir::new(self.root().join(dir))
    }

    /// Writes `plan` as JSON under the root; returns its path.
    pub fn write_plan(&self, plan: &Plan) -> PathBuf {
        let p = self.root().join(format!("plan-{}.json", plan.cluster));
        std::fs::write(&p, serde_json::to_vec_pretty(plan).unwrap()).unwrap();
        p
    }

    /// Runs a pdctl command with `--state-dir ROOT` appended, to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        run_bounded(self.command(args), Duration::from_secs(60))
    }

    /// `pdctl up -d -f FILE` of a topology written into `dir`; panics when it fails.
    pub fn up_topology(&self, dir: &Path, topology: &str) {
        let file = dir.join("topology.toml");
        std::fs::write(&file, topology).unwrap();
        let out = self.run(&["up", "-d", "-f", file.to_str().unwrap()]);
        assert!(out.status.success(), "up -d failed:\n{}", text(&out));
    }

    /// A pdctl command with `--state-dir ROOT` appended, not started.
    pub fn command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = pdctl(args);
        cmd.arg("--state-dir").arg(self.root());
        cmd.env_remove("PDCTL_STATE_DIR");
        cmd
    }

    /// `pdctl up -d --plan PLAN [extra]`.
    pub fn up_detached(&self, plan: &Plan, extra: &[&str]) -> Output {
        let p = self.write_plan(plan);
        let mut args = vec!["up", "-d", "--plan", p.to_str().unwrap()];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    /// The join token of a node started by hand as `pdctl join-token` prints it, once the
    /// head's `up` (started elsewhere) has made the cluster's secret and CA; waits up to
    /// `limit`.
    pub fn wait_join_token(&self, limit: Duration) -> String {
        let mut secret = None;
        let made = crate::common::wait_until(limit, || {
            let out = self.run(&["join-token"]);
            secret = out
                .status
                .success()
                .then(|| String::from_utf8(out.stdout).unwrap().trim().to_string());
            secret.is_some()
        });
        assert!(made, "the head made no join token within {limit:?}");
        secret.unwrap()
    }

    /// The running cluster's engine key, as `pdctl secret --engine-key` prints it.
    pub fn engine_key(&self) -> String {
        let out = self.run(&["secret", "--engine-key"]);
        assert!(out.status.success(), "secret --engine-key: {}", text(&out));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// `pdctl status --json` parsed, or None when nothing runs (exit 3).
    pub fn status(&self, extra: &[&str]) -> Option<StatusReport> {
        let mut args = vec!["status", "--json"];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        if out.status.code() == Some(3) {
            return None;
        }
        Some(
            serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("status --json is not a report ({e}): {}", text(&out))),
        )
    }

    /// Polls status until `check` holds or `limit` passes; returns the last report.
    pub fn wait_status(
        &self,
        limit: Duration,
        extra: &[&str],
        mut check: impl FnMut(&StatusReport) -> bool,
    ) -> StatusReport {
        let end = Instant::now() + limit;
        loop {
            let r = self.status(extra).expect("the cluster runs");
            if check(&r) || Instant::now() > end {
                return r;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let Ok(dirs) = std::fs::read_dir(self.root()) else {
            return;
        };
        for d in dirs.filter_map(|e| e.ok()) {
            let state = StateDir::new(d.path());
            if let Ok(Some(rec)) = read_record(&state) {
                kill_run(rec.supervisor_pid, &rec.run_id);
            }
        }
    }
}

/// SIGKILL to a supervisor and to every process carrying its run id.
pub fn kill_run(supervisor_pid: i32, run_id: &str) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let _ = kill(Pid::from_raw(supervisor_pid), Signal::SIGKILL);
    for p in marked_processes(run_id) {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}

/// Runs `cmd` with output captured, killing it if it runs past `limit`.
pub fn run_bounded(mut cmd: std::process::Command, limit: Duration) -> Output {
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn pdctl");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("pdctl output"),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("{cmd:?} ran longer than {limit:?}");
        }
    }
}

/// stdout and stderr of a finished command, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A plan with no services yet; add them with the builders below.
pub fn plan(cluster: &str, nodes: &[(&str, &str)]) -> Plan {
    Plan {
        cluster: cluster.into(),
        state_dir: PathBuf::from("/nonexistent/overridden-by-state-dir"),
        head_node: nodes[0].0.into(),
        nodes: nodes
            .iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect(),
        proxy_url: None,
        engine: "test".into(),
        vllm_version: None,
        vllm_version_source: None,
        connector: "mooncake-store".into(),
        protocol: "two-step".into(),
        services: vec![],
        warnings: vec![],
        control_port: None,
        tcp: Default::default(),
        health: Default::default(),
        settings: Default::default(),
        rebalance: None,
        model_fetch: None,
        // The supervisor's own tests need no page (and its scrapes of the engines would
        // meet the probes these tests watch); tests/dashboard.rs brings one up.
        dashboard: pdctl::vocab::Dashboard {
            enabled: false,
            ..Default::default()
        },
    }
}

/// A restart policy with short delays, so tests see restarts quickly.
pub fn quick_restarts(max_restarts: u32) -> RestartPolicy {
    RestartPolicy {
        mode: RestartMode::OnFailure,
        backoff_initial_ms: 300,
        backoff_max_ms: 1_000,
        max_restarts,
        window_s: 60,
        liveness_failures: 2,
    }
}

fn base(name: &str, role: Role, node: &str, host: &str, argv: Vec<String>) -> Service {
    Service {
        host: host.into(),
        startup_timeout_s: 20,
        restart: quick_restarts(5),
        shutdown: Shutdown {
            signal: "SIGTERM".into(),
            timeout_s: 5,
        },
        ..Service::new(name, role, node, argv)
    }
}

/// Real etcd (Debian etcd-server) on `host`, data under `data_dir`.
pub fn etcd(node: &str, host: &str, client: u16, peer: u16, data_dir: &Path) -> Service {
    let url = |p: u16, h: &str| format!("http://{h}:{p}");
    let argv = [
        "etcd",
        "--name",
        "pdctl-test",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--listen-client-urls",
        &url(client, host),
        "--advertise-client-urls",
        &url(client, host),
        "--listen-peer-urls",
        &url(peer, "127.0.0.1"),
        "--initial-advertise-peer-urls",
        &url(peer, "127.0.0.1"),
        "--initial-cluster",
        &format!("pdctl-test={}", url(peer, "127.0.0.1")),
    ]
    .map(String::from)
    .to_vec();
    let mut s = base("etcd", Role::Etcd, node, host, argv);
    s.ports = BTreeMap::from([("client".into(), client), ("peer".into(), peer)]);
    s.probe = Probe::Http {
        url: format!("{}/health", url(client, host)),
        status: 200,
        body_contains: Some("\"health\":\"true\"".into()),
    };
    s
}

/// Real mooncake_master (PyPI mooncake-transfer-engine) after etcd.
pub fn mooncake_master(node: &str, host: &str, rpc: u16, metrics: u16) -> Service {
    let argv = [
        "mooncake_master".to_string(),
        "--rpc_port".into(),
        rpc.to_string(),
        "--metrics_port".into(),
        metrics.to_string(),
    ]
    .to_vec();
    let mut s = base("mooncake-master", Role::MooncakeMaster, node, host, argv);
    s.ports = BTreeMap::from([("rpc".into(), rpc), ("metrics".into(), metrics)]);
    s.probe = Probe::Http {
        url: format!("http://127.0.0.1:{metrics}/health"),
        status: 200,
        body_contains: None,
    };
    s.depends_on = vec!["etcd".into()];
    s
}

/// One of the test engines, probed over HTTP.
pub fn engine(
    c: &Cluster,
    name: &str,
    role: Role,
    node: &str,
    host: &str,
    port: u16,
    exit_after_s: Option<f64>,
) -> Service {
    let mut argv = vec![
        "python3".to_string(),
        c.engine.display().to_string(),
        host.to_string(),
        port.to_string(),
    ];
    if let Some(s) = exit_after_s {
        argv.push(s.to_string());
    }
    let mut s = base(name, role, node, host, argv);
    s.ports = BTreeMap::from([("http".into(), port)]);
    s.url = Some(format!("http://{host}:{port}"));
    s.probe = Probe::Http {
        url: format!("http://{host}:{port}/health"),
        status: 200,
        body_contains: None,
    };
    s
}

/// A test engine on node "main" at 127.0.0.1 that runs until stopped: most tests need no
/// more.
pub fn local_engine(c: &Cluster, name: &str, role: Role, port: u16) -> Service {
    engine(c, name, role, "main", "127.0.0.1", port, None)
}

/// Live (non-zombie) processes carrying `run_id`.
pub fn marked(run_id: &str) -> Vec<i32> {
    marked_processes(run_id)
}

/// SIGKILLs the supervisor of the cluster in `state` and waits (10 s at most) until its
/// watchdog has stopped every process it started; panics when some outlive it.
pub fn kill_supervisor_and_wait(state: &StateDir) {
    let record = read_record(state)
        .unwrap()
        .expect("the cluster runs: it has a run record");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(record.supervisor_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let gone = crate::common::wait_until(Duration::from_secs(10), || {
        marked(&record.run_id).is_empty()
    });
    assert!(
        gone,
        "processes outlived their supervisor: {:?}",
        marked(&record.run_id)
    );
    // The kernel drops a dead process's cluster lock when its last file closes, which can
    // come after its services are gone on a loaded machine (seen once with eight tests at
    // a time: the next `up` said "already running"); a lock still held is a failure.
    let released = crate::common::wait_until(Duration::from_secs(10), || state.lock().is_ok());
    assert!(
        released,
        "the killed supervisor's cluster lock is still held after 10 s"
    );
}

/// The run id of the cluster in `state`, while it has a record.
pub fn run_id(state: &StateDir) -> String {
    read_record(state)
        .unwrap()
        .expect("a running cluster has a run record")
        .run_id
}

/// The service named `name` in a report.
pub fn svc<'a>(r: &'a StatusReport, name: &str) -> &'a pdctl::control::ServiceStatus {
    r.services
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name} in {r:?}"))
}

/// True when every service in the report is healthy.
pub fn all_healthy(r: &StatusReport) -> bool {
    r.services.iter().all(|s| s.state == ServiceState::Healthy)
}

/// The first of `n` consecutive ports free on 127.0.0.1 right now.
pub fn free_port_run(n: u16) -> u16 {
    crate::common::own_port_run(n)
}

/// A sim topology (the planner's format): etcd, mooncake_master, `p` prefill + `d` decode
/// `pdctl sim` engines over `connector`, and the proxy, every port from one run of free
/// ports so no two can collide; `extra` (more tables or keys) goes before `[proxy]`, which
/// comes last. Returns it and the proxy port.
pub fn sim_topology(cluster: &str, connector: &str, p: u16, d: u16, extra: &str) -> (String, u16) {
    // Each cluster's dashboard on a port of its own (the default, 8265, is one for all
    // the clusters that tests run side by side), unless the test places it itself; taken
    // before the run, whose end is where a scale adds instances.
    let dashboard = if extra.contains("[dashboard]") {
        String::new()
    } else {
        format!("[dashboard]\nport = {}\n", crate::common::free_port())
    };
    let run = free_port_run(5 + 2 * p + d);
    let (bootstrap, prefill, decode) = (run + 5, run + 5 + p, run + 5 + 2 * p);
    let proxy = run + 4;
    let text = format!(
        "cluster = \"{cluster}\"\n\
         [model]\nname = \"sim-model\"\n\
         [engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"{connector}\"\nbootstrap_port = {bootstrap}\n\
         [etcd]\nclient_port = {}\npeer_port = {}\n\
         [mooncake_master]\nrpc_port = {}\nmetrics_port = {}\n\
         [prefill]\ninstances = {p}\nbase_port = {prefill}\n\
         [decode]\ninstances = {d}\nbase_port = {decode}\n\
         {extra}\n\
         {dashboard}\
         [proxy]\nport = {proxy}\n",
        run,
        run + 1,
        run + 2,
        run + 3,
    );
    (text, proxy)
}

/// `POST path` with a JSON body to 127.0.0.1:port; returns the status code.
pub fn post_json(port: u16, path: &str, body: &str) -> u16 {
    post_json_with_key(port, path, body, None)
}

/// [`post_json`] with `Authorization: Bearer KEY` when a key is given (an engine of a
/// cluster pdctl started requires its engine key).
pub fn post_json_with_key(port: u16, path: &str, body: &str, key: Option<&str>) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         {auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// True when nothing listens on host:port any more.
pub fn port_free(host: &str, port: u16) -> bool {
    std::net::TcpListener::bind((host, port)).is_ok()
}
