//! Changing a running cluster while it serves: `pdctl restart --drain` and `--rolling`,
//! `pdctl scale` and `pdctl apply` under continuous load from `pdctl bench`, with 0 failed
//! requests; and an instance killed while it drains.

use crate::common;
use crate::common::netns;
use crate::common::supervisor as suph;

use common::TempDir;
use netns::in_netns;
use pdctl::control::ServiceState;
use serde_json::Value;
use std::process::{Child, Stdio};
use std::time::Duration;
use suph::{Cluster, sim_topology, text};

/// A cluster `name` started with `up -d` from `topology` (text, proxy port), in a temporary
/// directory that also holds its topology file; returns both with the text and the port.
fn up_sim(name: &str, (topology, port): (String, u16)) -> (Cluster, TempDir, String, u16) {
    let cluster = Cluster::new(name);
    let dir = TempDir::new(&format!("{name}-topo"));
    cluster.up_topology(dir.path(), &topology);
    (cluster, dir, topology, port)
}

/// `pdctl bench` against the proxy, 16 streams at a time, its JSON written to `json`.
fn bench(port: u16, prompts: usize, json: &std::path::Path) -> Child {
    bench_streams(port, prompts, 16, 32, json)
}

/// `pdctl bench` against the proxy: `prompts` streams, `concurrent` at a time, each
/// `output_len` tokens long.
fn bench_streams(
    port: u16,
    prompts: usize,
    concurrent: usize,
    output_len: usize,
    json: &std::path::Path,
) -> Child {
    bench_with(port, prompts, concurrent, output_len, json, &[])
}

/// `pdctl bench` against the proxy, 16 requests at a time asking for whole JSON answers.
fn bench_whole(port: u16, prompts: usize, json: &std::path::Path) -> Child {
    bench_with(port, prompts, 16, 32, json, &["--no-stream"])
}

fn bench_with(
    port: u16,
    prompts: usize,
    concurrent: usize,
    output_len: usize,
    json: &std::path::Path,
    extra: &[&str],
) -> Child {
    let url = format!("http://127.0.0.1:{port}");
    common::pdctl(&[])
        .args(common::bench_args(
            &url,
            prompts,
            concurrent,
            (32, output_len),
            json,
        ))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `pdctl down`, which must succeed.
fn down(cluster: &Cluster) {
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The bench's result: (completed, failed).
fn finished(child: Child, json: &std::path::Path) -> (u64, u64) {
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

/// A rolling restart of 4 decode instances while 16 streams run: every instance restarted
/// once and healthy, and the bench has 0 failed requests.
#[test]
fn a_rolling_restart_of_decode_under_load_fails_no_request() {
    let (cluster, dir, _, port) = up_sim(
        "oroll",
        sim_topology("o-roll", "nixl", 1, 4, "[engine.sim]\nitl_ms = 4.0\n"),
    );
    let json = dir.path().join("bench.json");
    let load = bench(port, 1200, &json);
    let whole_json = dir.path().join("bench-whole.json");
    let whole = bench_whole(port, 1200, &whole_json);
    std::thread::sleep(Duration::from_millis(800));
    let out = cluster.run(&["restart", "--rolling", "decode"]);
    assert!(out.status.success(), "{}", text(&out));
    for i in 0..4 {
        assert!(
            text(&out).contains(&format!("decode-{i} restarted after draining")),
            "{}",
            text(&out)
        );
    }
    let (completed, failed) = finished(load, &json);
    let report = cluster.status(&[]).unwrap();
    for i in 0..4 {
        let d = suph::svc(&report, &format!("decode-{i}"));
        assert_eq!(
            (d.restarts, d.state),
            (1, ServiceState::Healthy),
            "{report:?}"
        );
    }
    assert_eq!((completed, failed), (1200, 0));
    assert_eq!(finished(whole, &whole_json), (1200, 0), "whole answers");
    down(&cluster);
}

/// The only decode instance restarted with --drain while streams run: new requests wait
/// in the proxy while it restarts instead of failing; status shows `draining` meanwhile.
#[test]
fn draining_the_only_decode_instance_fails_no_request() {
    let (cluster, dir, _, port) = up_sim(
        "odrain",
        sim_topology("o-drain", "example", 1, 1, "[engine.sim]\nitl_ms = 4.0\n"),
    );
    let json = dir.path().join("bench.json");
    let load = bench(port, 400, &json);
    std::thread::sleep(Duration::from_millis(500));
    let restart = cluster
        .command(&["restart", "--drain", "decode-0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen_draining = false;
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while !seen_draining && std::time::Instant::now() < end {
        seen_draining = cluster
            .status(&[])
            .is_some_and(|r| suph::svc(&r, "decode-0").state == ServiceState::Draining);
    }
    let out = restart.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(seen_draining, "status never showed decode-0 draining");
    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (400, 0));
    let d = suph::svc(&cluster.status(&[]).unwrap(), "decode-0").clone();
    assert_eq!((d.restarts, d.state), (1, ServiceState::Healthy));
    // --rolling is for roles.
    let out = cluster.run(&["restart", "--rolling", "decode-0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--rolling takes roles"),
        "{}",
        text(&out)
    );
    down(&cluster);
}

/// The proxy's `/metrics` text.
fn proxy_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the proxy");
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The decode instances the proxy routes to (healthy in its metrics).
fn routed_decode(port: u16) -> Vec<String> {
    proxy_metrics(port)
        .lines()
        .filter(|l| {
            l.starts_with("pdctl_proxy_instance_healthy{leg=\"decode\"") && l.ends_with(" 1")
        })
        .map(|l| {
            l.split("instance=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

fn decode_names(cluster: &Cluster) -> Vec<String> {
    cluster
        .status(&[])
        .unwrap()
        .services
        .into_iter()
        .filter(|s| s.role == pdctl::vocab::Role::Decode)
        .map(|s| s.name)
        .collect()
}

/// The sum of the proxy's samples named `name`.
fn proxy_sum(port: u16, name: &str) -> f64 {
    pdctl::prometheus::sum(&proxy_metrics(port), &[name]).unwrap_or(0.0)
}

/// `scale decode=2`, back to 4, an `apply` that changes the proxy's policy and limits
/// (taken in place) and one that changes a decode argument, all while 16 streams and 16
/// requests for whole answers run: 0 failed requests, after each step `status` and the
/// proxy's routing agree on the decode instances, and the proxy never restarts.
#[test]
fn scale_and_apply_under_load_fail_no_request() {
    let extra = "[engine.sim]\nitl_ms = 4.0\n";
    let (cluster, dir, t, port) = up_sim("oscale", sim_topology("o-scale", "nixl", 1, 4, extra));
    let file = dir.path().join("topology.toml");
    // What cannot change live is refused, and nothing changes.
    let other = t.replace("kind = \"nixl\"", "kind = \"example\"");
    let other_file = dir.path().join("other.toml");
    std::fs::write(&other_file, &other).unwrap();
    let out = cluster.run(&["apply", "-f", other_file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("! the connector would change from nixl to example")
            && text(&out).contains("nothing was changed"),
        "{}",
        text(&out)
    );
    let out = cluster.run(&["scale", "decode=two"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    let json = dir.path().join("bench.json");
    let load = bench(port, 1500, &json);
    let whole_json = dir.path().join("bench-whole.json");
    let whole = bench_whole(port, 1500, &whole_json);
    let proxy_pid = suph::svc(&cluster.status(&[]).unwrap(), "proxy").pid;
    std::thread::sleep(Duration::from_millis(800));
    let out = cluster.run(&["scale", "decode=2", "--dry-run"]);
    assert!(
        out.status.success() && text(&out).contains("- decode-3: leave routing"),
        "{}",
        text(&out)
    );
    assert_eq!(decode_names(&cluster).len(), 4, "a dry run changes nothing");

    let out = cluster.run(&["scale", "decode=2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(decode_names(&cluster), ["decode-0", "decode-1"]);
    assert_eq!(routed_decode(port).len(), 2, "{}", proxy_metrics(port));

    let out = cluster.run(&["scale", "decode=4"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        decode_names(&cluster),
        ["decode-0", "decode-1", "decode-2", "decode-3"]
    );
    assert_eq!(routed_decode(port).len(), 4, "{}", proxy_metrics(port));

    // The proxy's policy and limits change in place: same process, counters kept, and
    // the new concurrency limit holds (32 clients, 24 slots: some wait in its queue).
    let answered = proxy_sum(port, "pdctl_proxy_requests_total");
    let t = format!("{t}policy = \"least-loaded\"\nmax_concurrent = 24\nqueue_size = 512\n");
    std::fs::write(&file, &t).unwrap();
    let out = cluster.run(&["apply", "-f", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("(in place, no restart)")
            && text(&out).contains("--max-concurrent 0 -> 24")
            && text(&out).contains("in effect, without a restart"),
        "{}",
        text(&out)
    );
    let proxy = suph::svc(&cluster.status(&[]).unwrap(), "proxy").clone();
    assert_eq!((proxy.pid, proxy.restarts), (proxy_pid, 0));
    // Each scale replaced its spec too (instance lists): the settings of the last one hold.
    assert!(proxy.revision >= 1);
    assert_eq!(
        proxy_sum(port, "pdctl_proxy_settings_revision"),
        proxy.revision as f64
    );
    assert!(proxy_sum(port, "pdctl_proxy_requests_total") >= answered);
    let end = std::time::Instant::now() + Duration::from_secs(5);
    // Without a limit nothing ever waits in the queue.
    while proxy_sum(port, "pdctl_proxy_queued_total") == 0.0 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        proxy_sum(port, "pdctl_proxy_queued_total") > 0.0,
        "{}",
        proxy_metrics(port)
    );

    // A decode argument changes: every decode instance is rolled, one at a time.
    let changed = t.replacen("[decode]\n", "[decode]\nargs = [\"--itl-ms\", \"3\"]\n", 1);
    std::fs::write(&file, &changed).unwrap();
    let out = cluster.run(&["apply", "-f", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    for i in 0..4 {
        assert!(
            text(&out).contains(&format!(
                "~ decode-{i}: restart with arguments without `--itl-ms 4`, with `--itl-ms 3`"
            )),
            "{}",
            text(&out)
        );
    }
    let out = cluster.run(&["apply", "-f", file.to_str().unwrap()]);
    assert!(text(&out).contains("nothing to change"), "{}", text(&out));

    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (1500, 0), "streamed");
    assert_eq!(finished(whole, &whole_json), (1500, 0), "whole answers");
    let report = cluster.status(&[]).unwrap();
    assert!(suph::all_healthy(&report), "{report:?}");
    assert_eq!(
        suph::svc(&report, "proxy").pid,
        proxy_pid,
        "the proxy never restarted"
    );
    // --recreate makes the change that cannot be made live: down, then up from the file.
    let out = cluster.run(&["apply", "-f", other_file.to_str().unwrap(), "--recreate"]);
    assert!(out.status.success(), "{}", text(&out));
    let report = cluster.status(&[]).unwrap();
    assert!(suph::all_healthy(&report), "{report:?}");
    assert!(
        report.services.iter().all(|s| s.restarts == 0) && decode_names(&cluster).len() == 4,
        "a new cluster: {report:?}"
    );
    let out = cluster.run(&["apply", "-f", other_file.to_str().unwrap(), "--dry-run"]);
    assert!(text(&out).contains("nothing to change"), "{}", text(&out));
    down(&cluster);
}

/// A decode instance killed with SIGKILL while `scale` drains it: the streams it carried
/// go on on the decode left, the whole answers it carried (nothing sent yet) are redone
/// there, nothing hangs, `scale` says what happened and finishes, and `status` shows the
/// one decode instance left.
#[test]
fn an_instance_killed_while_draining_loses_none_of_its_requests_and_scale_finishes() {
    let (cluster, dir, _, port) = up_sim(
        "okill",
        sim_topology("o-kill", "nixl", 1, 2, "[engine.sim]\nitl_ms = 40.0\n"),
    );
    let json = dir.path().join("bench.json");
    // Streams of 200 tokens at 40 ms: each lasts about 8 s; as many whole answers.
    let load = bench_streams(port, 8, 8, 200, &json);
    let whole_json = dir.path().join("bench-whole.json");
    let whole = bench_with(port, 8, 8, 200, &whole_json, &["--no-stream"]);
    std::thread::sleep(Duration::from_millis(1500));
    let scale = cluster
        .command(&["scale", "decode=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pid = None;
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while pid.is_none() && std::time::Instant::now() < end {
        pid = cluster.status(&[]).and_then(|r| {
            let d = suph::svc(&r, "decode-1");
            (d.state == ServiceState::Draining)
                .then_some(d.pid)
                .flatten()
        });
    }
    let pid = pid.expect("status never showed decode-1 draining");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let out = scale.wait_with_output().unwrap();
    let (completed, failed) = finished(load, &json);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("decode-1 ended while draining"),
        "{}\nbench: {v}",
        text(&out)
    );
    assert_eq!(completed + failed, 8);
    assert_eq!(
        failed, 0,
        "the killed instance's streams went on elsewhere: {v}"
    );
    let (whole_completed, whole_failed) = finished(whole, &whole_json);
    let w: Value = serde_json::from_str(&std::fs::read_to_string(&whole_json).unwrap()).unwrap();
    assert_eq!(whole_completed + whole_failed, 8);
    // A whole answer sends its client nothing before decode has finished: those the killed
    // instance carried are redone once on the decode left, so none fails.
    assert_eq!(
        whole_failed, 0,
        "whole answers are redone on the decode left: {w}"
    );
    for errors in [
        v["errors"].as_object().unwrap(),
        w["errors"].as_object().unwrap(),
    ] {
        assert!(
            errors.keys().all(|e| e.contains("decode")),
            "every failure names the decode leg: {errors:?}"
        );
    }
    assert_eq!(decode_names(&cluster), ["decode-0"]);
    assert_eq!(
        routed_decode(port),
        [format!("http://127.0.0.1:{}", port + 3)]
    );
    down(&cluster);
}

/// `scale decode=4` whose client is SIGKILLed right after it started: the head's
/// supervisor carries the change out all the same (4 decode instances healthy and routed,
/// the change's outcome in `status`), and the load running meanwhile has 0 failed requests.
#[test]
fn a_scale_whose_client_is_killed_still_completes_under_load() {
    let (cluster, dir, _, port) = up_sim(
        "okilled",
        sim_topology("o-killed", "nixl", 1, 2, "[engine.sim]\nitl_ms = 4.0\n"),
    );
    let json = dir.path().join("bench.json");
    let load = bench_streams(port, 600, 8, 32, &json);
    let whole_json = dir.path().join("bench-whole.json");
    let whole = bench_whole(port, 600, &whole_json);
    std::thread::sleep(Duration::from_millis(500));
    let mut scale = cluster
        .command(&["scale", "decode=4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The change has begun once the supervisor streams its first line.
    let mut first = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(scale.stdout.as_mut().unwrap())
        .read_line(&mut first)
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(scale.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let killed = scale.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed),
        Some(9),
        "{first}"
    );
    let r = cluster.wait_status(Duration::from_secs(60), &[], |r| {
        r.operation.as_ref().is_some_and(|o| o.outcome.is_some())
    });
    let op = r.operation.clone().expect("status shows the change");
    assert_eq!(op.what, "scale decode=4");
    let outcome = op.outcome.expect("the change finished");
    assert_eq!(outcome.code, 0, "{outcome:?}");
    let r = cluster.wait_status(Duration::from_secs(20), &[], suph::all_healthy);
    assert_eq!(decode_names(&cluster).len(), 4, "{r:?}");
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while routed_decode(port).len() < 4 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(routed_decode(port).len(), 4, "{}", proxy_metrics(port));
    assert_eq!(finished(load, &json), (600, 0));
    assert_eq!(finished(whole, &whole_json), (600, 0));
    down(&cluster);
}

/// A second change while one runs is refused with exit 2 naming the running one; the
/// first finishes.
#[test]
fn a_second_change_while_one_runs_is_refused() {
    let (cluster, dir, _, port) = up_sim(
        "osecond",
        sim_topology("o-second", "nixl", 1, 2, "[engine.sim]\nitl_ms = 20.0\n"),
    );
    let json = dir.path().join("bench.json");
    // Streams of 100 tokens at 20 ms: a drain waits about 2 s for them.
    let load = bench_streams(port, 40, 8, 100, &json);
    std::thread::sleep(Duration::from_millis(500));
    let rolling = cluster
        .command(&["restart", "--rolling", "decode"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let r = cluster.wait_status(Duration::from_secs(10), &[], |r| {
        r.operation.as_ref().is_some_and(|o| o.running())
    });
    assert!(r.operation.as_ref().is_some_and(|o| o.running()), "{r:?}");
    let human = cluster.run(&["status"]);
    assert!(
        text(&human).contains("change in progress: restart --rolling decode"),
        "{}",
        text(&human)
    );
    let second = cluster.run(&["scale", "decode=3"]);
    assert_eq!(second.status.code(), Some(2), "{}", text(&second));
    assert!(
        text(&second).contains("another change is running: restart --rolling decode"),
        "{}",
        text(&second)
    );
    let out = rolling.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("decode-1 restarted after draining"),
        "{}",
        text(&out)
    );
    let r = cluster.status(&[]).unwrap();
    let outcome = r.operation.unwrap().outcome.unwrap();
    assert_eq!(outcome.code, 0);
    assert_eq!(
        decode_names(&cluster).len(),
        2,
        "the refused scale changed nothing"
    );
    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (40, 0));
    down(&cluster);
}

/// The proxy's `/metrics` at `host:port`, asked from inside `ns`.
fn proxy_metrics_at(ns: Option<&str>, host: &str, port: u16) -> String {
    let host = host.to_string();
    in_netns(ns, move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect((host.as_str(), port)).expect("the proxy");
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
}

/// `cluster`'s pdctl command, run inside `ns` when there is one.
fn node_command(ns: Option<&str>, cluster: &Cluster, args: &[&str]) -> std::process::Command {
    netns::NetnsPair::wrap(ns, cluster.command(args))
}

/// A cluster over two nodes, each with its own supervisor and network stack (two network
/// namespaces joined by a veth pair; where they cannot be made, two loopback addresses):
/// prefill and the proxy on `head`, decode instances spread over `head` and `worker`.
/// Each `scale` runs once, on the head, and changes both nodes while load runs (0 failed
/// requests); the head's status shows the worker's services with the pids its supervisor
/// reports; a join with a wrong secret is refused and logged; `down` on the
/// head takes the worker down too.
#[test]
fn one_scale_on_the_head_changes_every_node() {
    let netns::TwoHosts {
        pair: _pair,
        ns_a: ns_head,
        ns_b: ns_worker,
        addr_a: head_addr,
        addr_b: worker_addr,
    } = netns::TwoHosts::make("pdo");
    let run = suph::free_port_run(12);
    let topology = format!(
        "cluster = \"o-2node\"\nhead = \"head\"\n\
         [nodes]\nhead = \"{head_addr}\"\nworker = \"{worker_addr}\"\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n[engine.sim]\nitl_ms = 4.0\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
         [decode]\ninstances = 1\nnodes = [\"worker\", \"head\"]\nbase_port = {}\n\
         [control]\nport = {}\n\
         [proxy]\nport = {run}\n",
        run + 2,
        run + 6,
        run + 11,
    );
    let (head, worker) = (Cluster::new("o2head"), Cluster::new("o2work"));
    let dir = TempDir::new("o2node-topo");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let f = file.to_str().unwrap();
    let (nh, nw) = (ns_head.as_deref(), ns_worker.as_deref());
    // The head makes the cluster's secret and CA at its first `up`; `pdctl join-token`
    // prints the worker's token. The head's proxy waits for decode-0 on the worker meanwhile.
    let up_head = node_command(nh, &head, &["up", "-d", "-f", f, "--node", "head"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let secret = head.wait_join_token(Duration::from_secs(30));
    let mut up_worker = node_command(nw, &worker, &["up", "-d", "-f", f, "--node", "worker"]);
    up_worker.env(pdctl::control::auth::JOIN_TOKEN_ENV, &secret);
    let out = suph::run_bounded(up_worker, Duration::from_secs(60));
    assert!(out.status.success(), "worker: {}", text(&out));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    // The head asks the worker's supervisor once a second.
    let r = head.wait_status(Duration::from_secs(30), &[], |r| {
        suph::all_healthy(r) && suph::svc(r, "decode-0").pid.is_some()
    });
    assert!(suph::all_healthy(&r), "{r:?}");
    let decode0 = suph::svc(&r, "decode-0");
    assert!(
        decode0.remote && decode0.pid.is_some(),
        "the worker's pid: {r:?}"
    );
    // The worker was started with its join token in the environment: no service has it.
    let environ = std::fs::read(format!("/proc/{}/environ", decode0.pid.unwrap())).unwrap();
    assert!(
        !String::from_utf8_lossy(&environ).contains(pdctl::control::auth::JOIN_TOKEN_ENV),
        "decode-0 inherited the join token"
    );

    // A port check (connect, close unheard: what a head does to tell a busy node from a
    // cut one) is not a refusal, and does not take the refusal line's place below.
    let control = format!("{head_addr}:{}", run + 11);
    let checked = control.clone();
    in_netns(nw, move || {
        drop(std::net::TcpStream::connect(&checked).expect("the head's control port"));
    });
    // A join with the head's CA pinned but a wrong secret is refused (and logged).
    let token = pdctl::control::tls::JoinToken::parse(&secret).expect("a join token");
    let wrong = pdctl::control::tls::JoinToken {
        ca_hash: token.ca_hash.clone(),
        id: token.id.clone(),
        secret: pdctl::control::tls::TokenSecret::random(),
    };
    let refused = in_netns(nw, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(pdctl::control::client::join(
            &control,
            "head",
            "worker",
            &wrong,
            Duration::from_secs(5),
        ))
        .map(|_| ())
    });
    let err = refused
        .expect_err("a wrong secret must be refused")
        .to_string();
    assert!(err.contains("wrong join token"), "{err}");
    // The head answers the joiner first and logs the refusal after: wait for the line.
    let head_log = head.root().join("o-2node-head/logs/supervisor.log");
    let refusal = |l: &str| l.contains("control channel: refused a connection from");
    let logged = common::wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&head_log).is_ok_and(|l| {
            l.lines()
                .any(|line| refusal(line) && line.contains("wrong join token"))
        })
    });
    let log = std::fs::read_to_string(&head_log).unwrap_or_default();
    assert!(logged, "the refusal is not in the head's log: {log}");
    let others: Vec<&str> = log
        .lines()
        .filter(|line| refusal(line) && !line.contains("wrong join token"))
        .collect();
    assert!(others.is_empty(), "refused besides the join: {others:?}");

    let json = dir.path().join("bench.json");
    let url = format!("http://{head_addr}:{run}");
    let bench_args = [
        "bench",
        "--url",
        &url,
        "--num-prompts",
        "1000",
        "--max-concurrency",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "32",
        "--json",
        json.to_str().unwrap(),
    ];
    let mut bench = match nh {
        Some(ns) => netns::NetnsPair::exec(ns, &common::pdctl_bin()),
        None => common::pdctl(&[]),
    };
    bench.args(bench_args);
    let load = bench
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));

    let routed = |n: usize| {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let page = proxy_metrics_at(nh, &head_addr, run);
            let count = page
                .lines()
                .filter(|l| {
                    l.starts_with("pdctl_proxy_instance_healthy{leg=\"decode\"")
                        && l.ends_with(" 1")
                })
                .count();
            if count == n || std::time::Instant::now() > end {
                return count;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    for (n, on_worker, on_head) in [(2, 1, 1), (4, 2, 2)] {
        let target = format!("decode={n}");
        let out = head.run(&["scale", &target]);
        assert!(out.status.success(), "{target}: {}", text(&out));
        assert_eq!(routed(n), n, "{target}");
        let w = worker.status(&[]).unwrap();
        let local_decode: Vec<&pdctl::control::ServiceStatus> = w
            .services
            .iter()
            .filter(|s| s.role == pdctl::vocab::Role::Decode && !s.remote)
            .collect();
        assert_eq!(local_decode.len(), on_worker, "{target}: worker runs {w:?}");
        // Give the head a poll of the worker's supervisor to see the new pids.
        let r = head.wait_status(Duration::from_secs(5), &[], |r| {
            r.services
                .iter()
                .filter(|s| s.remote)
                .all(|s| s.pid.is_some())
        });
        for d in &local_decode {
            assert_eq!(
                suph::svc(&r, &d.name).pid,
                d.pid,
                "{target}: head shows the worker's pid"
            );
        }
        let on_head_now = r
            .services
            .iter()
            .filter(|s| s.role == pdctl::vocab::Role::Decode && !s.remote)
            .count();
        assert_eq!(on_head_now, on_head, "{target}: {r:?}");
    }
    let out = head.run(&["scale", "decode=1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(routed(1), 1);
    assert_eq!(decode_names(&worker), ["decode-0"]);

    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (1000, 0));
    let out = head.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("node worker: stopped"),
        "{}",
        text(&out)
    );
    assert!(
        worker.status(&[]).is_none(),
        "down on the head took the worker down"
    );
}

/// A stand-in for vLLM on a GPU, for the tests of a change's order on GPUs: started as
/// `python -m vllm.entrypoints.openai.api_server ... --host H --port P ...`, it holds each
/// GPU of its CUDA_VISIBLE_DEVICES (an exclusive lock on `$FAKE_GPU_DIR/gpuN`, released
/// when it exits, however it exits) and fails as vLLM does on a GPU whose memory is taken
/// when another instance holds one; then serves /health until stopped. Each start and
/// refusal is appended to `$FAKE_GPU_DIR/log`; it answers `$FAKE_START_S` after it holds
/// its GPUs (vLLM loading its weights).
const FAKE_GPU_ENGINE: &str = r#"
import fcntl, http.server, os, sys, time
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
host, port = flag("--host"), int(flag("--port"))
gpu_dir = os.environ["FAKE_GPU_DIR"]
def log(line):
    with open(os.path.join(gpu_dir, "log"), "a") as f:
        f.write(line + "\n")
held = []
for g in os.environ["CUDA_VISIBLE_DEVICES"].split(","):
    f = open(os.path.join(gpu_dir, f"gpu{g}"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        log(f"refused port {port} gpu {g} held by {f.read()}")
        print(f"torch.OutOfMemoryError: CUDA out of memory on GPU {g}: held by {f.read()}", file=sys.stderr, flush=True)
        sys.exit(1)
    f.seek(0)
    f.truncate()
    f.write(f"port {port}")
    f.flush()
    held.append(f)
log(f"started port {port} gpus {os.environ['CUDA_VISIBLE_DEVICES']}")
time.sleep(float(os.environ.get("FAKE_START_S", "0")))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, port), H).serve_forever()
"#;

/// A NIXL vLLM topology of cluster `name` with `p` prefill and `d` decode instances, one
/// GPU each, whose `engine.python` runs [`FAKE_GPU_ENGINE`] (made in `dir`, answering
/// `start_s` after it starts), on free ports.
fn fake_gpu_topology(
    dir: &std::path::Path,
    name: &str,
    (p, d): (u32, u32),
    start_s: f64,
) -> String {
    use std::os::unix::fs::PermissionsExt;
    let engine = dir.join("fake_vllm.py");
    std::fs::write(&engine, FAKE_GPU_ENGINE).unwrap();
    // `python -c ...` (the version pdctl reads, the modules pre-flight looks for) answers
    // vLLM 0.26.0 and "found"; `python -m vllm...` runs the stand-in.
    let python = dir.join("python3");
    std::fs::write(
        &python,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -m ]; then shift 2; exec python3 {} \"$@\"; fi\nprintf 0.26.0\n",
            engine.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    let gpus = dir.join("gpus");
    std::fs::create_dir_all(&gpus).unwrap();
    let run = suph::free_port_run(14);
    format!(
        "cluster = \"{name}\"\n\
         [model]\nname = \"{}\"\n\
         [engine]\nvllm_version = \"0.26.0\"\npython = \"{}\"\nenv = {{ FAKE_GPU_DIR = \"{}\", FAKE_START_S = \"{start_s}\" }}\n\
         [connector]\nkind = \"nixl\"\nside_channel_port = {}\n\
         [prefill]\ninstances = {p}\nbase_port = {}\n\
         [decode]\ninstances = {d}\nbase_port = {}\n\
         [proxy]\nport = {run}\n",
        model.display(),
        python.display(),
        gpus.display(),
        run + 9,
        run + 1,
        run + 5,
    )
}

/// Each engine's GPUs as `status` shows them, `name=list`, by name.
fn engine_gpus(cluster: &Cluster) -> Vec<String> {
    let mut out: Vec<String> = cluster
        .status(&[])
        .unwrap()
        .services
        .iter()
        .filter(|s| s.role.is_engine())
        .map(|s| {
            let gpus: Vec<String> = s.gpus.iter().map(u32::to_string).collect();
            format!("{}={}", s.name, gpus.join(","))
        })
        .collect();
    out.sort();
    out
}

/// On a 4-GPU machine (declared; engines that hold their GPUs as vLLM does), moving an
/// instance from decode to prefill and back: the instances kept stay on their GPUs, the
/// leaving instance is drained and stopped before the new one starts on its GPU, and no
/// engine ever finds its GPU taken. Planned afresh (before the change kept GPUs),
/// prefill-2 was started on GPU 2 while decode-0 ran there, and failed.
#[test]
fn a_scale_on_gpus_frees_the_leaving_instances_gpu_before_the_new_one_starts() {
    let cluster = Cluster::new("ogpus");
    let dir = TempDir::new("ogpus-topo");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, fake_gpu_topology(dir.path(), "o-gpus", (2, 2), 0.0)).unwrap();
    let out = cluster.run(&[
        "up",
        "-d",
        "-f",
        file.to_str().unwrap(),
        "--gpus",
        "0,1,2,3",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let before = ["decode-0=2", "decode-1=3", "prefill-0=0", "prefill-1=1"];
    assert_eq!(engine_gpus(&cluster), before);

    let out = cluster.run(&["scale", "prefill=3", "decode=1", "--dry-run"]);
    assert!(
        out.status.success()
            && text(&out).contains("first: decode-1 is drained, stopped and removed before prefill-2 starts: prefill-2 takes its GPU 3"),
        "{}",
        text(&out)
    );
    // `apply --dry-run` of the same split written in a file says the same.
    let other = dir.path().join("3p1d.toml");
    let text_3p1d = std::fs::read_to_string(&file)
        .unwrap()
        .replace("[prefill]\ninstances = 2", "[prefill]\ninstances = 3")
        .replace("[decode]\ninstances = 2", "[decode]\ninstances = 1");
    std::fs::write(&other, text_3p1d).unwrap();
    let out = cluster.run(&[
        "apply",
        "-f",
        other.to_str().unwrap(),
        "--gpus",
        "0,1,2,3",
        "--dry-run",
    ]);
    assert!(
        out.status.success()
            && text(&out).contains(
                "first: decode-1 is drained, stopped and removed before prefill-2 starts"
            ),
        "{}",
        text(&out)
    );
    assert_eq!(engine_gpus(&cluster), before, "a dry run changes nothing");

    let out = cluster.run(&["scale", "prefill=3", "decode=1"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let gone = said
        .find("decode-1: drained, stopped and removed")
        .expect(&said);
    let healthy = said.find("prefill-2: healthy").expect(&said);
    assert!(
        gone < healthy,
        "decode-1 goes before prefill-2 starts:\n{said}"
    );
    assert!(
        !said.contains("decode-0: restarted"),
        "decode-0 stays as it is:\n{said}"
    );
    assert_eq!(
        engine_gpus(&cluster),
        ["decode-0=2", "prefill-0=0", "prefill-1=1", "prefill-2=3"]
    );

    // And back: prefill-2 leaves GPU 3 to decode-1.
    let out = cluster.run(&["scale", "prefill=2", "decode=2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out)
            .contains("first: prefill-2 is drained, stopped and removed before decode-1 starts"),
        "{}",
        text(&out)
    );
    assert_eq!(engine_gpus(&cluster), before);
    let log = std::fs::read_to_string(dir.path().join("gpus/log")).unwrap();
    assert!(
        !log.contains("refused"),
        "an engine found its GPU taken:\n{log}"
    );
    assert_eq!(
        log.lines().filter(|l| l.starts_with("started")).count(),
        6,
        "{log}"
    );
    down(&cluster);
}

/// The head's supervisor SIGKILLed in the middle of a change on GPUs, its second (so the
/// plan it started from has GPUs a fresh plan would not give): `up` again starts each
/// instance on the GPUs it ran on, finishes the change in the same order (the leaving
/// instance first), and no engine ever finds its GPU taken.
#[test]
fn a_change_on_gpus_cut_short_is_finished_on_the_gpus_it_planned() {
    let cluster = Cluster::new("ogpuj");
    let dir = TempDir::new("ogpuj-topo");
    let file = dir.path().join("topology.toml");
    let topology = fake_gpu_topology(dir.path(), "o-gpuj", (2, 2), 1.5);
    std::fs::write(&file, topology).unwrap();
    let up = || {
        cluster.run(&[
            "up",
            "-d",
            "-f",
            file.to_str().unwrap(),
            "--gpus",
            "0,1,2,3",
        ])
    };
    let out = up();
    assert!(out.status.success(), "{}", text(&out));
    let before = engine_gpus(&cluster);
    let out = cluster.run(&["scale", "prefill=3", "decode=1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        engine_gpus(&cluster),
        ["decode-0=2", "prefill-0=0", "prefill-1=1", "prefill-2=3"]
    );

    // Back to 2P2D: prefill-2 is removed first, then decode-1 starts on its GPU 3; the
    // supervisor dies while decode-1 starts.
    let mut back = cluster.command(&["scale", "prefill=2", "decode=2"]);
    let mut back = back
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let seen = cluster.wait_status(Duration::from_secs(30), &[], |r| {
        r.operation
            .as_ref()
            .is_some_and(|o| o.outcome.is_none() && o.step.contains("decode-1: waiting"))
    });
    assert!(
        seen.operation
            .as_ref()
            .is_some_and(|o| o.step.contains("decode-1")),
        "{seen:?}"
    );
    let state = pdctl::supervisor::StateDir::new(cluster.root().join("o-gpuj"));
    suph::kill_supervisor_and_wait(&state);
    // Its client has nothing more to say: the change is taken up by the next supervisor.
    let _ = back.kill();
    let _ = back.wait();

    let out = up();
    assert!(out.status.success(), "up again: {}", text(&out));
    let r = cluster.wait_status(Duration::from_secs(60), &[], |r| {
        r.operation.as_ref().is_some_and(|o| o.outcome.is_some()) && suph::all_healthy(r)
    });
    let op = r.operation.as_ref().expect("status shows the recovery");
    let interrupted = op.interrupted.as_ref().expect("status names the change");
    assert_eq!(
        interrupted.recovered,
        Some(pdctl::control::operation::Recovered::Finished),
        "{op:?}"
    );
    assert!(suph::all_healthy(&r), "{r:?}");
    assert_eq!(engine_gpus(&cluster), before);
    let log = std::fs::read_to_string(dir.path().join("gpus/log")).unwrap();
    assert!(
        !log.contains("refused"),
        "an engine found its GPU taken:\n{log}"
    );
    down(&cluster);
}
