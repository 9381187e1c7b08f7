//! A change survives the head's supervisor: journaled before each step, and finished or
//! undone when the head's supervisor starts again after a SIGKILL in the middle of it —
//! nothing left running that the plan does not list, every instance in `status`, the
//! interrupted change's fate in `status --json`, the next change accepted. And the
//! failure paths that must leave routing whole: a drained restart that cannot restart
//! puts the instance back in routing; a relative `--state-dir` works for `scale`.

use crate::common;
use crate::common::netns;
use crate::common::supervisor as suph;

use common::TempDir;
use pdctl::control::operation::Recovered;
use pdctl::control::{ServiceState, StatusReport};
use pdctl::plan::Plan;
use pdctl::supervisor::{StateDir, read_record};
use pdctl::vocab::Role;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use suph::{Cluster, text};

/// A cluster over two nodes (two network namespaces; where they cannot be made, two
/// loopback addresses): the proxy on `head`, prefill-0 on `worker`, decode instances
/// alternating head, worker, head...
struct TwoNodes {
    _pair: Option<netns::NetnsPair>,
    nh: Option<String>,
    nw: Option<String>,
    head: Cluster,
    worker: Cluster,
    dir: TempDir,
    file: PathBuf,
    head_addr: String,
    worker_addr: String,
    /// decode-N listens on `decode_port + N`.
    decode_port: u16,
    proxy_port: u16,
    /// The topology with `{DECODE}` for decode's instance count.
    template: String,
}

impl TwoNodes {
    /// Starts it with `decode` instances; each engine takes `startup_ms` to be ready and
    /// `itl_ms` per token; `decode_extra` goes into `[decode]`.
    fn up(tag: &str, decode: u32, startup_ms: u32, itl_ms: f64, decode_extra: &str) -> TwoNodes {
        let netns::TwoHosts {
            pair,
            ns_a: nh,
            ns_b: nw,
            addr_a: head_addr,
            addr_b: worker_addr,
        } = netns::TwoHosts::make(tag);
        let run = suph::free_port_run(16);
        let template = format!(
            "cluster = \"j-2node\"\nhead = \"head\"\n\
             [nodes]\nhead = \"{head_addr}\"\nworker = \"{worker_addr}\"\n\
             [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
             [engine.sim]\nitl_ms = {itl_ms:.1}\nstartup_ms = {startup_ms}\n\
             [connector]\nkind = \"nixl\"\n\
             [prefill]\ninstances = 1\nnode = \"worker\"\nbase_port = {}\n\
             [decode]\ninstances = {{DECODE}}\nnodes = [\"head\", \"worker\"]\nbase_port = {}\n{decode_extra}\
             [control]\nport = {}\n\
             [proxy]\nport = {run}\n",
            run + 2,
            run + 6,
            run + 14,
        );
        let (head, worker) = (
            Cluster::new(&format!("{tag}h")),
            Cluster::new(&format!("{tag}w")),
        );
        let dir = TempDir::new(&format!("{tag}-topo"));
        let file = dir.path().join("topology.toml");
        let c = TwoNodes {
            _pair: pair,
            nh,
            nw,
            head,
            worker,
            dir,
            file,
            head_addr,
            worker_addr,
            decode_port: run + 6,
            proxy_port: run,
            template,
        };
        std::fs::write(&c.file, c.topology(decode)).unwrap();
        let f = c.file.to_str().unwrap();
        let up_head = c
            .on_head(&["up", "-d", "-f", f, "--node", "head"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let token = c.head.wait_join_token(Duration::from_secs(30));
        let mut up_worker = c.on_worker(&["up", "-d", "-f", f, "--node", "worker"]);
        up_worker.env(pdctl::control::auth::JOIN_TOKEN_ENV, &token);
        let out = suph::run_bounded(up_worker, Duration::from_secs(60));
        assert!(out.status.success(), "worker: {}", text(&out));
        let up = up_head.wait_with_output().unwrap();
        assert!(up.status.success(), "head: {}", text(&up));
        let r = c.head.wait_status(Duration::from_secs(30), &[], |r| {
            suph::all_healthy(r) && r.services.iter().all(|s| s.pid.is_some())
        });
        assert!(suph::all_healthy(&r), "{r:?}");
        c
    }

    fn topology(&self, decode: u32) -> String {
        self.template.replace("{DECODE}", &decode.to_string())
    }

    fn on_head(&self, args: &[&str]) -> Command {
        netns::NetnsPair::wrap(self.nh.as_deref(), self.head.command(args))
    }

    fn on_worker(&self, args: &[&str]) -> Command {
        netns::NetnsPair::wrap(self.nw.as_deref(), self.worker.command(args))
    }

    /// A pdctl command on the head, to completion.
    fn head_run(&self, args: &[&str]) -> Output {
        suph::run_bounded(self.on_head(args), Duration::from_secs(120))
    }

    fn head_state(&self) -> StateDir {
        StateDir::new(self.head.root().join("j-2node-head"))
    }

    fn worker_state(&self) -> StateDir {
        StateDir::new(self.worker.root().join("j-2node-worker"))
    }

    /// The plan the head runs now (plan.json in its state dir).
    fn head_plan(&self) -> Plan {
        let text = std::fs::read_to_string(self.head_state().plan_path()).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// `pdctl bench` against the proxy from the head's side: `prompts` requests of
    /// `output_len` tokens, 8 at a time, its JSON in `json`.
    fn bench(&self, prompts: usize, output_len: usize, json: &Path) -> Child {
        let url = format!("http://{}:{}", self.head_addr, self.proxy_port);
        let mut bench = match self.nh.as_deref() {
            Some(ns) => netns::NetnsPair::exec(ns, &common::pdctl_bin()),
            None => common::pdctl(&[]),
        };
        bench.args(common::bench_args(&url, prompts, 8, (32, output_len), json));
        bench
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// SIGKILL to the head's supervisor once `ready` holds for the head's report and the
    /// worker's (polled); then waits until the head's services are gone with it.
    fn kill_head_when(
        &self,
        what: &str,
        mut ready: impl FnMut(&StatusReport, &StatusReport) -> bool,
    ) {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (h, w) = (self.head.status(&[]), self.worker.status(&[]));
            if let (Some(h), Some(w)) = (&h, &w)
                && ready(h, w)
            {
                break;
            }
            assert!(
                Instant::now() < end,
                "never saw {what}: head {h:?}\nworker {w:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Its watchdog stops the head's services.
        suph::kill_supervisor_and_wait(&self.head_state());
    }

    /// `pdctl up` on the head again, from `file`; then waits (60 s at most) until the
    /// head's start-up recovery has ended. Returns the head's report then and how long it
    /// took from the `up`.
    fn up_head_again(&self, file: &Path) -> (StatusReport, Duration) {
        let t = Instant::now();
        let out = self.head_run(&["up", "-d", "-f", file.to_str().unwrap(), "--node", "head"]);
        assert!(out.status.success(), "up on the head again: {}", text(&out));
        let r = self.head.wait_status(Duration::from_secs(60), &[], |r| {
            r.operation.as_ref().is_some_and(|o| o.outcome.is_some()) && suph::all_healthy(r)
        });
        (r, t.elapsed())
    }

    /// Asserts what a person checks after the head came back: no process runs on the
    /// worker that the plan does not list, `status` on the head shows every instance of
    /// the plan healthy, and the interrupted change `what` was `recovered`.
    fn assert_whole(&self, r: &StatusReport, took: Duration, what: &str, recovered: Recovered) {
        let plan = self.head_plan();
        let op = r.operation.as_ref().expect("status shows the recovery");
        let interrupted = op
            .interrupted
            .as_ref()
            .expect("status names the interrupted change");
        assert_eq!(interrupted.what, what, "{op:?}");
        assert_eq!(interrupted.recovered, Some(recovered), "{op:?}");
        let outcome = op.outcome.as_ref().expect("the recovery ended");
        assert_eq!(outcome.code, 0, "{op:?}");
        assert!(
            took < Duration::from_secs(60),
            "the head took {took:?} to come back whole"
        );
        let mut shown: Vec<&str> = r.services.iter().map(|s| s.name.as_str()).collect();
        let mut planned: Vec<&str> = plan.services.iter().map(|s| s.name.as_str()).collect();
        shown.sort();
        planned.sort();
        assert_eq!(
            shown, planned,
            "status shows every instance of the plan: {r:?}"
        );
        assert!(suph::all_healthy(r), "{r:?}");
        // The worker runs what the plan places there, and no other process of its run.
        let w = self.worker.status(&[]).expect("the worker runs");
        let mut on_worker: Vec<&str> = w
            .services
            .iter()
            .filter(|s| !s.remote)
            .map(|s| s.name.as_str())
            .collect();
        let mut planned_there: Vec<&str> = plan
            .services
            .iter()
            .filter(|s| s.node == "worker")
            .map(|s| s.name.as_str())
            .collect();
        on_worker.sort();
        planned_there.sort();
        assert_eq!(on_worker, planned_there, "the worker runs {w:?}");
        let pids: Vec<i32> = w
            .services
            .iter()
            .filter(|s| !s.remote)
            .filter_map(|s| s.pid.map(|p| p as i32))
            .collect();
        let run_id = suph::run_id(&self.worker_state());
        let stray: Vec<i32> = suph::marked(&run_id)
            .into_iter()
            .filter(|p| !pids.contains(p))
            .collect();
        assert!(
            stray.is_empty(),
            "processes of the worker's run not in the plan: {stray:?} ({w:?})"
        );
    }

    /// `scale decode=N` on the head, which must succeed, and N decode instances routed.
    fn scale_ok(&self, n: u32) {
        let target = format!("decode={n}");
        let out = self.head_run(&["scale", &target]);
        assert!(
            out.status.success(),
            "{target} after the head came back: {}",
            text(&out)
        );
        let r = self.head.status(&[]).unwrap();
        let decode = r.services.iter().filter(|s| s.role == Role::Decode).count();
        assert_eq!(decode, n as usize, "{r:?}");
    }

    /// A bench of `prompts` requests through the proxy: none fails.
    fn serves(&self, prompts: usize) {
        let json = self.dir.path().join("bench-after.json");
        let (completed, failed) = finished(self.bench(prompts, 32, &json), &json);
        assert_eq!((completed, failed), (prompts as u64, 0));
    }

    /// `pdctl down` on the head takes both nodes down.
    fn down(&self) {
        let out = self.head_run(&["down"]);
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            self.worker.status(&[]).is_none(),
            "down on the head took the worker down"
        );
    }
}

/// The bench's (completed, failed), once it has exited successfully.
fn finished(child: Child, json: &Path) -> (u64, u64) {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (
        v["completed"].as_u64().unwrap(),
        v["failed"].as_u64().unwrap(),
    )
}

/// True when `name` runs on the worker (its own row there).
fn runs_on_worker(w: &StatusReport, name: &str) -> bool {
    w.services.iter().any(|s| s.name == name && !s.remote)
}

/// The head's supervisor SIGKILLed in the middle of `scale decode=2` (decode-1 started on
/// the worker, the head waiting for it) under load, then in the middle of a rolling
/// restart of decode, then of an `apply`: each time `pdctl up` on the head brings back,
/// within 60 s, a cluster that runs exactly its plan, shows every instance, says what it
/// made of the change, serves, and takes the next `scale`.
#[test]
fn the_head_killed_in_the_middle_of_a_change_comes_back_whole() {
    let c = TwoNodes::up("pdj36k", 1, 2500, 4.0, "");
    let file = c.file.clone();

    // 1. scale decode=2, killed once the worker runs decode-1 (not healthy yet).
    let load_json = c.dir.path().join("bench-load.json");
    let load = c.bench(400, 32, &load_json);
    let mut scale = c.on_head(&["scale", "decode=2"]);
    let scale = scale
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    c.kill_head_when("decode-1 started on the worker", |_, w| {
        runs_on_worker(w, "decode-1")
    });
    drop(scale);
    let started = suph::svc(&c.worker.status(&[]).unwrap(), "decode-1").pid;
    let _ = load.wait_with_output();
    let (r, took) = c.up_head_again(&file);
    eprintln!(
        "scale: the head came back whole in {:.1} s",
        took.as_secs_f64()
    );
    c.assert_whole(&r, took, "scale decode=2", Recovered::Finished);
    assert_eq!(
        suph::svc(&c.worker.status(&[]).unwrap(), "decode-1").pid,
        started,
        "decode-1 adopted as it ran, not started again"
    );
    let source = std::fs::read_to_string(c.head_state().dir.join("topology.json")).unwrap();
    let source: Value = serde_json::from_str(&source).unwrap();
    assert_eq!(
        source["scaled"]["decode"], 2,
        "topology.json says what runs: {source}"
    );
    c.serves(40);

    // 2. restart --rolling decode, killed while it restarts decode-1 on the worker.
    let mut roll = c.on_head(&["restart", "--rolling", "decode"]);
    let roll = roll
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    c.kill_head_when("the rolling restart at decode-1", |h, _| {
        h.operation
            .as_ref()
            .is_some_and(|o| o.outcome.is_none() && o.step.starts_with("decode-1"))
    });
    drop(roll);
    let before = suph::svc(&c.worker.status(&[]).unwrap(), "decode-1").restarts;
    let (r, took) = c.up_head_again(&file);
    eprintln!(
        "restart --rolling: the head came back whole in {:.1} s",
        took.as_secs_f64()
    );
    c.assert_whole(&r, took, "restart --rolling decode", Recovered::Finished);
    let after = suph::svc(&c.worker.status(&[]).unwrap(), "decode-1").restarts;
    assert!(
        after > before || before > 0,
        "decode-1 was restarted ({before} -> {after})"
    );
    c.serves(40);

    // 3. apply of a topology with 3 decode instances, killed once decode-2 (on the head)
    // is being waited for; `up` again with the first file: the apply is finished.
    let applied = c.dir.path().join("three.toml");
    std::fs::write(&applied, c.topology(3)).unwrap();
    let mut apply = c.on_head(&["apply", "-f", applied.to_str().unwrap(), "--node", "head"]);
    let apply = apply
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    c.kill_head_when("the apply waiting for decode-2", |h, _| {
        h.operation
            .as_ref()
            .is_some_and(|o| o.outcome.is_none() && o.step.starts_with("decode-2: waiting"))
    });
    drop(apply);
    let (r, took) = c.up_head_again(&file);
    eprintln!(
        "apply: the head came back whole in {:.1} s",
        took.as_secs_f64()
    );
    c.assert_whole(
        &r,
        took,
        &format!("apply {}", applied.display()),
        Recovered::Finished,
    );
    assert_eq!(
        r.services.iter().filter(|s| s.role == Role::Decode).count(),
        3,
        "{r:?}"
    );
    c.scale_ok(4);
    c.serves(40);

    // 4. scale decode=6, killed once the worker runs decode-5; `up` again with a topology
    // that is neither plan (the first file, 1 decode instance): the scale is set aside and
    // the instances the worker runs beyond that plan are stopped as orphans.
    let mut scale = c.on_head(&["scale", "decode=6"]);
    let scale = scale
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    c.kill_head_when("decode-5 started on the worker", |_, w| {
        runs_on_worker(w, "decode-5")
    });
    drop(scale);
    let (r, took) = c.up_head_again(&file);
    eprintln!(
        "scale set aside: the head came back whole in {:.1} s",
        took.as_secs_f64()
    );
    c.assert_whole(&r, took, "scale decode=6", Recovered::SetAside);
    let message = &r
        .operation
        .as_ref()
        .unwrap()
        .outcome
        .as_ref()
        .unwrap()
        .message;
    assert!(
        message.contains("decode-5: ran on node worker but not in the plan"),
        "{message}"
    );
    assert_eq!(decode_count(&r), 1, "{r:?}");
    c.scale_ok(2);
    c.serves(40);
    c.down();
}

/// How many decode instances a report shows.
fn decode_count(r: &StatusReport) -> usize {
    r.services.iter().filter(|s| s.role == Role::Decode).count()
}

/// A drained restart of decode-1 on the worker whose restart cannot happen (the worker's
/// supervisor stops answering once the drain has begun): it fails, saying so, and
/// decode-1 is back in routing, never left `draining`; the next restart succeeds once the
/// worker answers again.
#[test]
fn a_restart_that_fails_after_its_drain_puts_the_instance_back_in_routing() {
    let c = TwoNodes::up("pdj36d", 2, 0, 40.0, "");
    let worker_pid = read_record(&c.worker_state())
        .unwrap()
        .unwrap()
        .supervisor_pid;
    // Streams of 200 tokens at 40 ms: the drain waits for them (about 8 s).
    let load_json = c.dir.path().join("bench-long.json");
    let load = c.bench(8, 200, &load_json);
    std::thread::sleep(Duration::from_millis(1000));
    let restart = c
        .on_head(&["restart", "--drain", "decode-1", "--timeout", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let r = c.head.wait_status(Duration::from_secs(20), &[], |r| {
        suph::svc(r, "decode-1").state == ServiceState::Draining
    });
    assert_eq!(
        suph::svc(&r, "decode-1").state,
        ServiceState::Draining,
        "{r:?}"
    );
    let stop = |sig| nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker_pid), sig).unwrap();
    stop(nix::sys::signal::Signal::SIGSTOP);
    let out = restart.wait_with_output().unwrap();
    stop(nix::sys::signal::Signal::SIGCONT);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("put back in routing"), "{}", text(&out));
    let r = c.head.status(&[]).unwrap();
    assert_ne!(
        suph::svc(&r, "decode-1").state,
        ServiceState::Draining,
        "{r:?}"
    );
    let r = c
        .head
        .wait_status(Duration::from_secs(15), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "decode-1 back in routing: {r:?}");
    // The proxy reads its supervisor's report twice a second.
    let mut page = String::new();
    let routed = common::wait_until(Duration::from_secs(10), || {
        page = proxy_metrics(&c);
        let decode = page.lines().filter(|l| {
            l.starts_with("pdctl_proxy_instance_healthy{leg=\"decode\"") && l.ends_with(" 1")
        });
        decode.count() == 2
    });
    assert!(routed, "decode-1 back in the proxy's routing: {page}");
    let (completed, failed) = finished(load, &load_json);
    assert_eq!((completed, failed), (8, 0), "the drain cut no stream");
    let out = c.head_run(&["restart", "--drain", "decode-1"]);
    assert!(out.status.success(), "{}", text(&out));
    c.down();
}

/// The proxy's `/metrics`, asked from the head's side.
fn proxy_metrics(c: &TwoNodes) -> String {
    let (host, port) = (c.head_addr.clone(), c.proxy_port);
    netns::in_netns(c.nh.as_deref(), move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect((host.as_str(), port)).expect("the proxy");
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
}

/// `up` and `scale` with a relative `--state-dir` (and a relative `PDCTL_STATE_DIR`),
/// run from the directory it is relative to: the new instance starts, nothing else
/// changes.
#[test]
fn scale_works_with_a_relative_state_dir() {
    let work = TempDir::new("j36rel");
    let (topology, port) = suph::sim_topology("j-rel", "nixl", 1, 1, "");
    std::fs::write(work.path().join("t.toml"), &topology).unwrap();
    let run = |args: &[&str], env_dir: bool| {
        let mut cmd = common::pdctl(args);
        cmd.current_dir(work.path());
        if env_dir {
            cmd.env("PDCTL_STATE_DIR", "rel-state");
        } else {
            cmd.arg("--state-dir").arg("rel-state");
            cmd.env_remove("PDCTL_STATE_DIR");
        }
        suph::run_bounded(cmd, Duration::from_secs(60))
    };
    let out = run(&["up", "-d", "-f", "t.toml"], false);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["scale", "decode=2"], true);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        !said.contains("proxy: new settings"),
        "no spurious proxy change: {said}"
    );
    let out = run(&["status", "--json"], false);
    assert!(out.status.success(), "{}", text(&out));
    let r: StatusReport = serde_json::from_slice(&out.stdout).unwrap();
    let decode: Vec<&str> = r
        .services
        .iter()
        .filter(|s| s.role == Role::Decode && s.state == ServiceState::Healthy)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(decode, ["decode-0", "decode-1"], "{r:?}");
    let plan: Value = serde_json::from_str(
        &std::fs::read_to_string(work.path().join("rel-state/j-rel/plan.json")).unwrap(),
    )
    .unwrap();
    assert!(
        Path::new(plan["state_dir"].as_str().unwrap()).is_absolute(),
        "the plan names its state dir absolutely: {}",
        plan["state_dir"]
    );
    assert_eq!(
        suph::post_json(
            port,
            "/v1/completions",
            r#"{"model":"sim-model","prompt":"hi","max_tokens":4}"#
        ),
        200
    );
    let out = run(&["down"], true);
    assert!(out.status.success(), "{}", text(&out));
}

/// `scale decode=2` whose new instance cannot start on the worker (its port is taken
/// there, which the head's pre-flight cannot see): the scale fails and is undone — decode-1
/// runs nowhere, neither node's plan lists it, topology.json keeps the old count — and the
/// cluster serves as before.
#[test]
fn a_scale_whose_new_instance_fails_is_undone() {
    let c = TwoNodes::up("pdj36u", 1, 0, 4.0, "restart = \"never\"\n");
    let (addr, port) = (c.worker_addr.clone(), c.decode_port + 1);
    let _taken = netns::in_netns(c.nw.as_deref(), move || {
        std::net::TcpListener::bind((addr.as_str(), port)).expect("decode-1's port")
    });
    let out = c.head_run(&["scale", "decode=2"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("decode-1 failed"), "{said}");
    assert!(said.contains("it was undone"), "{said}");
    let r = c.head.status(&[]).unwrap();
    assert!(r.services.iter().all(|s| s.name != "decode-1"), "{r:?}");
    let w = c.worker.status(&[]).unwrap();
    assert!(w.services.iter().all(|s| s.name != "decode-1"), "{w:?}");
    assert!(c.head_plan().service("decode-1").is_none());
    let source = std::fs::read_to_string(c.head_state().dir.join("topology.json")).unwrap();
    let source: Value = serde_json::from_str(&source).unwrap();
    assert!(source["scaled"].get("decode").is_none(), "{source}");
    assert!(
        !c.head_state().journal_path().exists(),
        "no journal is left once the change is undone"
    );
    let op = r.operation.expect("status shows the last change");
    assert_eq!(op.outcome.map(|o| o.code), Some(1));
    c.serves(20);
    c.down();
}

/// A drained restart while the proxy cannot be asked for its count of requests in flight
/// (SIGSTOPped once the drain began, streams running): the drain waits and says so, and
/// at `--timeout` the restart fails rather than cut requests it cannot see — decode-1 is
/// not restarted and goes back in routing; its streams all finish.
#[test]
fn a_drain_that_cannot_read_the_in_flight_count_waits_and_does_not_cut() {
    let cluster = Cluster::new("j36blind");
    let dir = TempDir::new("j36blind-topo");
    let (topology, port) =
        suph::sim_topology("j-blind", "nixl", 1, 2, "[engine.sim]\nitl_ms = 40.0\n");
    cluster.up_topology(dir.path(), &topology);
    let json = dir.path().join("bench.json");
    let url = format!("http://127.0.0.1:{port}");
    // Streams of 150 tokens at 40 ms (about 6 s each), 8 at a time.
    let load = common::pdctl(&[
        "bench",
        "--url",
        &url,
        "--num-prompts",
        "8",
        "--max-concurrency",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "150",
        "--json",
        json.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let r = cluster.status(&[]).unwrap();
    let proxy = suph::svc(&r, "proxy").pid.expect("the proxy runs") as i32;
    let restarts = suph::svc(&r, "decode-1").restarts;
    let restart = cluster
        .command(&["restart", "--drain", "decode-1", "--timeout", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let r = cluster.wait_status(Duration::from_secs(10), &[], |r| {
        suph::svc(r, "decode-1").state == ServiceState::Draining
    });
    assert_eq!(suph::svc(&r, "decode-1").state, ServiceState::Draining);
    let signal = |sig| nix::sys::signal::kill(nix::unistd::Pid::from_raw(proxy), sig).unwrap();
    signal(nix::sys::signal::Signal::SIGSTOP);
    let out = restart.wait_with_output().unwrap();
    signal(nix::sys::signal::Signal::SIGCONT);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("cannot read the proxy's count"), "{said}");
    assert!(said.contains("waiting"), "{said}");
    assert!(
        said.contains("not going on, so as not to cut them"),
        "{said}"
    );
    assert!(said.contains("put back in routing"), "{said}");
    let r = cluster.wait_status(Duration::from_secs(10), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    assert_eq!(
        suph::svc(&r, "decode-1").restarts,
        restarts,
        "not restarted"
    );
    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (8, 0), "no stream was cut");
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}
