//! Silent recomputes under steady streamed load, through `pdctl up` of simulated engines.
//! The decode sim of one cluster reads another KV directory than its prefill writes, so
//! every handoff is silently lost: nothing fails, the answers are right, decode's usage
//! honestly shows no cached token. Streaming clients that never ask for usage keep both
//! clusters busy for the whole run (legs always in flight), and the proxy must count every
//! one of those requests while the load runs (`pdctl status` shows it), give each client
//! exactly the stream it asked for (no usage chunk it did not ask for; its usage when it
//! did), and count nothing on the healthy cluster.

use crate::common;
use crate::common::supervisor as suph;

use common::TempDir;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};
use suph::{Cluster, sim_topology, text};

/// Streaming clients, each sending its next request as soon as the last one ended.
const CLIENTS: usize = 12;
/// Tokens each answer streams (10 ms apart in the sim's default model).
const ANSWER_TOKENS: u32 = 60;
const COUNTED: &str = "pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"}";

/// What the clients did so far.
#[derive(Default)]
struct Load {
    started: AtomicU64,
    completed: AtomicU64,
    /// Streams that were not what the client asked for, with why.
    wrong: std::sync::Mutex<Vec<String>>,
}

/// A prompt of about 100 words, different for every (client, request).
fn prompt(tag: &str, client: usize, k: u64) -> String {
    let mut p = format!("{tag} client {client} request {k}");
    for i in 0..100 {
        p.push_str([" river", " stone", " cloud", " lamp", " field"][(i + client) % 5]);
    }
    p
}

fn body(prompt: &str, usage: bool) -> Value {
    let mut b = json!({"model": "sim-model", "prompt": prompt, "max_tokens": ANSWER_TOKENS,
        "temperature": 0, "stream": true});
    if usage {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// The events of an SSE body, `[DONE]` as a string.
fn events(raw: &str) -> Vec<Value> {
    raw.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d)))
        .collect()
}

/// Why a stream a client that did not ask for usage got is wrong, if it is.
fn wrong_stream(raw: &str) -> Option<String> {
    let ev = events(raw);
    if ev.last() != Some(&json!("[DONE]")) {
        return Some(format!("no [DONE] at the end: {raw}"));
    }
    let bad = ev[..ev.len() - 1]
        .iter()
        .find(|e| !e["usage"].is_null() || e["choices"].as_array().is_none_or(|c| c.is_empty()));
    bad.map(|e| format!("an event the client did not ask for: {e}"))
}

/// One client: streams without usage until `until`.
async fn client(url: String, tag: &'static str, i: usize, until: Instant, load: Arc<Load>) {
    let http = reqwest::Client::new();
    let mut k = 0;
    while Instant::now() < until {
        k += 1;
        load.started.fetch_add(1, SeqCst);
        let r = http
            .post(&url)
            .json(&body(&prompt(tag, i, k), false))
            .send()
            .await;
        let raw = match r {
            Ok(r) if r.status() == 200 => r.text().await.unwrap_or_default(),
            Ok(r) => format!("HTTP {}", r.status()),
            Err(e) => format!("{e}"),
        };
        match wrong_stream(&raw) {
            None => {
                load.completed.fetch_add(1, SeqCst);
            }
            Some(why) => load.wrong.lock().unwrap().push(why),
        }
    }
}

/// Starts `CLIENTS` clients on `rt` against the proxy on `port` for `secs` seconds.
fn start_load(
    rt: &tokio::runtime::Runtime,
    port: u16,
    tag: &'static str,
    secs: u64,
) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
    let load = Arc::new(Load::default());
    let until = Instant::now() + Duration::from_secs(secs);
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    let tasks = (0..CLIENTS)
        .map(|i| rt.spawn(client(url.clone(), tag, i, until, load.clone())))
        .collect();
    (load, tasks)
}

/// A proxy metric (0 when the page does not have it).
fn metric(rt: &tokio::runtime::Runtime, port: u16, series: &str) -> f64 {
    let page = rt.block_on(common::get_text(&format!(
        "http://127.0.0.1:{port}/metrics"
    )));
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The KV handoff misses `pdctl status` shows on its proxy line.
fn status_misses(cluster: &Cluster) -> f64 {
    let out = cluster.run(&["status"]);
    let all = text(&out);
    let line = all
        .lines()
        .find(|l| l.contains("KV handoff misses"))
        .unwrap_or_else(|| panic!("no proxy line in pdctl status:\n{all}"));
    let before = &line[..line.find(" KV handoff misses").unwrap()];
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A sim 1P1D with the ExampleConnector's shared directory; `decode_args` go into its
/// `[decode]` table. Returns the topology and the proxy's port.
fn topology(cluster: &str, decode_args: &str) -> (String, u16) {
    sim_topology(cluster, "example", 1, 1, decode_args)
}

#[test]
fn every_silently_lost_handoff_under_steady_streamed_load_is_counted_while_it_runs() {
    let cluster = Cluster::new("rl-lost");
    let dir = TempDir::new("rl-lost-topo");
    let elsewhere = TempDir::new("rl-lost-kv");
    let args = format!("args = [\"--kv-dir\", \"{}\"]", elsewhere.path().display());
    let (topo, port) = topology("rl-lost", &args);
    cluster.up_topology(dir.path(), &topo);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let started = Instant::now();
    let (load, tasks) = start_load(&rt, port, "lost", 30);
    // While the load runs: every request completed so far is already counted.
    let mut checks = Vec::new();
    for at in [8, 16, 24] {
        std::thread::sleep(Duration::from_secs(at).saturating_sub(started.elapsed()));
        let completed = load.completed.load(SeqCst) as f64;
        let shown = status_misses(&cluster);
        let counted = metric(&rt, port, COUNTED);
        let sent = load.started.load(SeqCst) as f64;
        assert!(
            shown >= completed && counted <= sent,
            "at {at} s: {completed} requests completed, {sent} sent, pdctl status shows {shown} misses"
        );
        checks.push((at, completed, shown));
    }
    for t in tasks {
        rt.block_on(t).unwrap();
    }
    let wrong = load.wrong.lock().unwrap().clone();
    assert!(wrong.is_empty(), "streams not as asked: {wrong:?}");
    let completed = load.completed.load(SeqCst) as f64;
    assert!(
        completed >= 100.0,
        "too little load to prove anything: {completed}"
    );
    assert_eq!(metric(&rt, port, COUNTED), completed, "{checks:?}");
    assert_eq!(status_misses(&cluster), completed);
    // Counted once, by the answers: nothing estimated or left unchecked beside them.
    assert_eq!(
        metric(&rt, port, "pdctl_proxy_kv_handoff_misses_estimated_total"),
        0.0
    );
    assert!(
        !rt.block_on(common::get_text(&format!(
            "http://127.0.0.1:{port}/metrics"
        )))
        .contains("pdctl_proxy_kv_handoffs_unchecked_total{"),
    );
    println!("counted while the load ran (s, completed, status): {checks:?}; {completed} in all");

    // The stream a client gets is decode's own, usage chunk and all only when asked.
    let key = cluster.engine_key();
    let decode_port = decode_port(&topo);
    let p = prompt("lost", 99, 1);
    let proxied = rt.block_on(post(port, &body(&p, false), None));
    let direct = rt.block_on(post(decode_port, &body(&p, false), Some(&key)));
    assert_eq!(
        normalized(&proxied),
        normalized(&direct),
        "{proxied}\n{direct}"
    );
    let asked = rt.block_on(post(port, &body(&prompt("lost", 99, 2), true), None));
    let ev = events(&asked);
    let usage = &ev[ev.len() - 2];
    assert_eq!(usage["choices"], json!([]), "{asked}");
    assert_eq!(
        usage["usage"]["completion_tokens"], ANSWER_TOKENS,
        "{asked}"
    );
    assert!(
        usage["usage"]["prompt_tokens"].as_u64().unwrap() > 100,
        "{asked}"
    );
    assert_eq!(metric(&rt, port, COUNTED), completed + 2.0);
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_healthy_cluster_under_the_same_load_counts_no_miss() {
    let cluster = Cluster::new("rl-ok");
    let dir = TempDir::new("rl-ok-topo");
    let (topo, port) = topology("rl-ok", "");
    cluster.up_topology(dir.path(), &topo);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (load, tasks) = start_load(&rt, port, "ok", 12);
    for t in tasks {
        rt.block_on(t).unwrap();
    }
    let wrong = load.wrong.lock().unwrap().clone();
    assert!(wrong.is_empty(), "streams not as asked: {wrong:?}");
    assert!(load.completed.load(SeqCst) >= 30);
    // A few scrapes later (the window check runs each second): still nothing.
    std::thread::sleep(Duration::from_secs(3));
    let page = rt.block_on(common::get_text(&format!(
        "http://127.0.0.1:{port}/metrics"
    )));
    assert!(
        !page.contains("pdctl_proxy_kv_handoff_misses_total{"),
        "{page}"
    );
    assert!(
        page.contains("pdctl_proxy_kv_handoff_misses_estimated_total 0\n"),
        "{page}"
    );
    assert_eq!(status_misses(&cluster), 0.0);
    let out = cluster.run(&["down"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The decode sim's port: the `[decode]` table's base_port.
fn decode_port(topology: &str) -> u16 {
    let t: toml::Table = toml::from_str(topology).unwrap();
    t["decode"]["base_port"].as_integer().unwrap() as u16
}

/// POSTs a streamed completion to 127.0.0.1:`port` (with `key` as bearer); the raw body.
async fn post(port: u16, body: &Value, key: Option<&str>) -> String {
    let mut r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v1/completions"))
        .json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// A stream's events with what differs between two answers to one request (its id and
/// creation time) blanked.
fn normalized(raw: &str) -> Vec<Value> {
    events(raw)
        .into_iter()
        .map(|mut e| {
            if let Some(o) = e.as_object_mut() {
                o.insert("id".into(), json!("-"));
                o.insert("created".into(), json!(0));
            }
            e
        })
        .collect()
}
