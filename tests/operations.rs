//! Changing a running cluster while it serves: `pdctl restart --drain` and `--rolling`,
//! `pdctl scale` and `pdctl apply` under continuous load from `pdctl bench`, with 0 failed
//! requests; and an instance killed while it drains.

mod common;
#[path = "common/supervisor.rs"]
mod suph;

use common::TempDir;
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
    let (url, prompts, concurrent, output_len) = (
        format!("http://127.0.0.1:{port}"),
        prompts.to_string(),
        concurrent.to_string(),
        output_len.to_string(),
    );
    let mut args = vec![
        "bench",
        "--url",
        &url,
        "--num-prompts",
        &prompts,
        "--max-concurrency",
        &concurrent,
        "--input-len",
        "32",
        "--output-len",
        &output_len,
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    common::pdctl(&args)
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
/// end with the proxy's error naming the decode leg, nothing hangs, `scale` says what
/// happened and finishes, and `status` shows the one decode instance left.
#[test]
fn an_instance_killed_while_draining_fails_only_its_requests_and_scale_finishes() {
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
    assert!(failed >= 1, "the killed instance carried streams: {v}");
    let (whole_completed, whole_failed) = finished(whole, &whole_json);
    let w: Value = serde_json::from_str(&std::fs::read_to_string(&whole_json).unwrap()).unwrap();
    assert_eq!(whole_completed + whole_failed, 8);
    assert!(
        whole_failed >= 1,
        "the killed instance carried whole answers: {w}"
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

/// Two nodes on loopback addresses (prefill and the proxy on `head`, decode on `worker`),
/// each with its own supervisor: `scale decode=2` on the head follows the new instance
/// there (routing waits for it), the same command on the worker starts it, and the proxy
/// routes to it once healthy; `scale decode=1` on the head drains it out of routing, on the
/// worker stops it. Requests keep being answered throughout.
#[test]
fn scaling_a_role_on_another_node_takes_the_command_on_each_node() {
    let run = suph::free_port_run(12);
    let topology = format!(
        "cluster = \"o-2node\"\nhead = \"head\"\n\
         [nodes]\nhead = \"127.0.0.1\"\nworker = \"127.0.0.3\"\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n[engine.sim]\nitl_ms = 4.0\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
         [decode]\ninstances = 1\nnode = \"worker\"\nbase_port = {}\n\
         [proxy]\nport = {run}\n",
        run + 2,
        run + 6,
    );
    let (head, worker) = (Cluster::new("o2head"), Cluster::new("o2work"));
    let dir = TempDir::new("o2node-topo");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let f = file.to_str().unwrap();
    for (c, node) in [(&worker, "worker"), (&head, "head")] {
        let out = c.run(&["up", "-d", "-f", f, "--node", node]);
        assert!(out.status.success(), "{node}: {}", text(&out));
    }
    let both = |r: &pdctl::control::StatusReport| suph::all_healthy(r);
    assert!(both(&head.wait_status(Duration::from_secs(30), &[], both)));
    let json = dir.path().join("bench.json");
    let load = bench_streams(run, 600, 8, 32, &json);

    // Up: the head follows decode-1 (nothing starts there), the worker starts it.
    let out = head.run(&["scale", "decode=2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("decode-1: following decode-1 on node worker"),
        "{}",
        text(&out)
    );
    assert_eq!(routed_decode(run).len(), 1, "not routed before it runs");
    let out = worker.run(&["scale", "decode=2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("decode-1: starting"), "{}", text(&out));
    let r = head.wait_status(Duration::from_secs(20), &[], |r| {
        r.services
            .iter()
            .any(|s| s.name == "decode-1" && s.state == ServiceState::Healthy)
    });
    assert!(suph::svc(&r, "decode-1").remote, "{r:?}");
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while routed_decode(run).len() < 2 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(routed_decode(run).len(), 2, "{}", proxy_metrics(run));

    // Down: out of routing and drained from the head, then stopped on the worker.
    let out = head.run(&["scale", "decode=1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("decode-1: out of routing, drained and no longer followed here"),
        "{}",
        text(&out)
    );
    assert_eq!(routed_decode(run).len(), 1, "{}", proxy_metrics(run));
    assert_eq!(decode_names(&head), ["decode-0"]);
    let out = worker.run(&["scale", "decode=1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(decode_names(&worker), ["decode-0"]);
    assert!(suph::port_free("127.0.0.3", run + 7), "decode-1 stopped");

    let (completed, failed) = finished(load, &json);
    assert_eq!((completed, failed), (600, 0));
    down(&head);
    down(&worker);
}
