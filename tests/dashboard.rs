//! The dashboard as a person sees it: a sim 1P2D under load, its page opened in Debian's
//! headless Chromium, read from the DOM the page's own script drew (every instance with its
//! state, the request and KV handoff counts rising, a pair's KV tokens moved rising, a decode
//! killed shown restarting, then healthy, and its streams' hops shown in their pair); and `pdctl export grafana`'s queries checked against what the running
//! cluster's `/metrics` pages export.

use crate::common;
use crate::common::supervisor::{self as suph, Cluster, sim_topology, text};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Debian's Chromium; the test fails saying how to get it when it is missing.
fn chromium() -> PathBuf {
    ["chromium", "chromium-browser"]
        .iter()
        .find_map(|p| pdctl::tools::find_program(p))
        .unwrap_or_else(|| {
            panic!(
                "chromium is not installed, and this test opens the dashboard in it: `./install.sh --with-test-deps` (or `apt-get install -y chromium`) installs Debian's"
            )
        })
}

/// The page's DOM once its script ran for 2.5 s of virtual time (its first polls).
fn dump_dom(url: &str) -> String {
    let out = headless(url, &["--dump-dom"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Headless Chromium on `url` for 2.5 s of virtual time, doing `what` (`--dump-dom`,
/// `--screenshot=FILE`).
fn headless(url: &str, what: &[&str]) -> std::process::Output {
    let profile = common::TempDir::new("chromium-profile");
    let mut cmd = std::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=2500",
    ])
    .args(what)
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg(url);
    let out = suph::run_bounded(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "chromium failed: {}", text(&out));
    out
}

/// With `PDCTL_DASHBOARD_SCREENSHOT=FILE`, the page under load, a decode just killed and
/// back, as a PNG (the picture in the README and docs/observability.md).
fn screenshot(url: &str) {
    let Some(file) = std::env::var_os("PDCTL_DASHBOARD_SCREENSHOT") else {
        return;
    };
    let shot = format!("--screenshot={}", std::path::Path::new(&file).display());
    headless(
        url,
        &[&shot, "--window-size=1400,1450", "--hide-scrollbars"],
    );
}

/// The value of `attr="..."` in the element text starting at `at` (a `>` inside a quoted
/// value does not end the tag: the serializer may leave it unescaped).
fn attr<'a>(dom: &'a str, at: usize, attr: &str) -> Option<&'a str> {
    let mut quoted = false;
    let tag_len = dom[at..].find(|c| {
        quoted ^= c == '"';
        c == '>' && !quoted
    })?;
    let tag = &dom[at..at + tag_len];
    let key = format!("{attr}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// Every element carrying `marker` (an attribute name), as the value of `marker` and of
/// `other`, in page order.
fn elements<'a>(dom: &'a str, marker: &str, other: &str) -> Vec<(&'a str, &'a str)> {
    let key = format!(" {marker}=\"");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = dom[from..].find(&key) {
        let at = dom[..from + i].rfind('<').unwrap_or(0);
        if let (Some(a), Some(b)) = (attr(dom, at, marker), attr(dom, at, other)) {
            out.push((a, b));
        }
        from += i + key.len();
    }
    out
}

/// The number a tile of the page shows (its `data-value`).
fn tile(dom: &str, id: &str) -> f64 {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("the page has no `{id}` tile:\n{dom}"));
    let at = dom[..at].rfind('<').unwrap();
    attr(dom, at, "data-value")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the `{id}` tile shows no number"))
}

/// A pair row's figure (`data-FIGURE`) as the page shows it; `pair` is `prefill>decode`.
fn pair_figure<'a>(dom: &'a str, pair: &str, figure: &str) -> Option<&'a str> {
    elements(dom, "data-pair", figure)
        .into_iter()
        .find(|(p, _)| p.replace("&gt;", ">") == pair)
        .map(|(_, v)| v)
}

/// A pair's KV tokens moved, as a number (it fails saying what the page showed).
fn pair_kv_tokens(dom: &str, pair: &str) -> f64 {
    pair_figure(dom, pair, "data-kv-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "the page shows no KV tokens moved for {pair}: {:?}",
                elements(dom, "data-pair", "data-kv-tokens")
            )
        })
}

/// One streamed completion: a shared context (the decodes' prefix cache has its KV) and a
/// question of its own, whole KV blocks only prefill has: its decode receives them.
async fn complete(client: &reqwest::Client, proxy: u16, i: u32, max_tokens: u32) {
    let url = format!("http://127.0.0.1:{proxy}/v1/completions");
    let context: String = (0..120).map(|i| format!(" word{i}")).collect();
    let own: String = (0..40).map(|j| format!(" q{i}w{j}")).collect();
    let body = serde_json::json!({
        "model": "sim-model",
        "prompt": format!("shared context{context} question{own}"),
        "max_tokens": max_tokens, "stream": true,
    });
    if let Ok(r) = client.post(&url).json(&body).send().await {
        let _ = r.bytes().await;
    }
}

/// Streams completions until `stop`; worker `w`'s prompts are its own.
async fn load(proxy: u16, w: u32, stop: Arc<AtomicBool>) {
    let client = common::http();
    let mut i = 0u32;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        complete(&client, proxy, w * 1_000_000 + i, 16).await;
    }
}

/// The page's rows of services: (name, state).
fn services(dom: &str) -> Vec<(&str, &str)> {
    elements(dom, "data-service", "data-state")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_page_shows_a_1p2d_at_work_and_a_killed_decode_coming_back() {
    let dash = suph::free_port_run(1);
    let extra = format!("[engine.sim]\nitl_ms = 15.0\n[dashboard]\nport = {dash}\n");
    let (topology, proxy) = sim_topology("dash-1p2d", "example", 1, 2, &extra);
    let c = Cluster::new("dash");
    let dir = common::TempDir::new("dash-topology");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let up = tokio::task::block_in_place(|| c.run(&["up", "-d", "-f", file.to_str().unwrap()]));
    assert!(up.status.success(), "{}", text(&up));
    let url = format!("http://127.0.0.1:{dash}");
    let printed = String::from_utf8_lossy(&up.stdout);
    assert!(
        printed.contains(&format!("dashboard at {url}")),
        "up did not print the dashboard's address:\n{printed}"
    );
    let shown = tokio::task::block_in_place(|| c.run(&["dashboard", "--no-open"]));
    assert!(shown.status.success(), "{}", text(&shown));
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert_eq!(shown.trim(), url, "pdctl dashboard prints its address");

    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(load(proxy, w, stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let first = tokio::task::block_in_place(|| dump_dom(&url));
    let rows = services(&first);
    for name in ["prefill-0", "decode-0", "decode-1", "proxy"] {
        assert!(
            rows.iter().any(|(n, s)| *n == name && *s == "healthy"),
            "the page does not list {name} as healthy: {rows:?}"
        );
    }
    let (requests, handoffs) = (tile(&first, "t-requests"), tile(&first, "t-handoffs"));
    // None yet if no request of the pair has ended: nothing moved shown.
    let pair_tokens = pair_figure(&first, "prefill-0>decode-0", "data-kv-tokens")
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = tokio::task::block_in_place(|| dump_dom(&url));
    let (requests2, handoffs2) = (tile(&second, "t-requests"), tile(&second, "t-handoffs"));
    let pair_tokens2 = pair_kv_tokens(&second, "prefill-0>decode-0");
    assert!(
        pair_tokens2 > pair_tokens,
        "prefill-0 -> decode-0's KV tokens moved did not rise between two reads: {pair_tokens} then {pair_tokens2}"
    );
    assert!(
        requests2 > requests,
        "requests did not rise between two reads: {requests} then {requests2}"
    );
    assert!(
        handoffs2 > handoffs,
        "KV handoffs did not rise between two reads: {handoffs} then {handoffs2}"
    );
    assert!(
        tile(&second, "t-rate") > 0.0,
        "the page shows no request rate under load"
    );
    assert!(
        second.contains("prefill-0 → decode-0") && second.contains("prefill-0 → decode-1"),
        "the page shows no pair flow"
    );

    // Long streams on both decodes, so that decode-1 is killed in the middle of some.
    let long: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(async move { complete(&common::http(), proxy, 9_000_000 + i, 200).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    kill_decode_and_watch(&c, &url).await;
    for s in long {
        let _ = s.await;
    }
    hops_shown_in_their_pair(&url).await;
    tokio::task::block_in_place(|| screenshot(&url));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    grafana_queries_name_exported_metrics(&c, dash).await;
}

/// SIGKILLs decode-1 and reads the page until its changes of state show it restarting and
/// then healthy, and its row says healthy again.
async fn kill_decode_and_watch(c: &Cluster, url: &str) {
    let report = tokio::task::block_in_place(|| c.status(&[])).expect("the cluster runs");
    let pid = suph::svc(&report, "decode-1").pid.expect("decode-1 runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let end = Instant::now() + Duration::from_secs(40);
    let mut dom = String::new();
    while Instant::now() < end {
        dom = tokio::task::block_in_place(|| dump_dom(url));
        let events: Vec<(&str, &str)> = elements(&dom, "data-event-service", "data-to")
            .into_iter()
            .filter(|(s, _)| *s == "decode-1")
            .collect();
        // Newest first: a `healthy` before (newer than) a `restarting`.
        let restarting = events.iter().position(|e| e.1 == "restarting");
        let healthy_after =
            restarting.is_some_and(|r| events[..r].iter().any(|e| e.1 == "healthy"));
        let row_healthy = services(&dom).contains(&("decode-1", "healthy"));
        if healthy_after && row_healthy {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!(
        "within 40 s the page did not show decode-1 restarting and then healthy; its changes of state: {:?}, services: {:?}",
        elements(&dom, "data-event-service", "data-to"),
        services(&dom)
    );
}

/// Reads the page until the pair prefill-0 -> decode-1 shows streams continued from
/// decode-1 on decode-0 (logged when each ends).
async fn hops_shown_in_their_pair(url: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    let mut dom = String::new();
    while Instant::now() < end {
        dom = tokio::task::block_in_place(|| dump_dom(url));
        let migrations: f64 = pair_figure(&dom, "prefill-0>decode-1", "data-migrations")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0.0);
        let hops = pair_figure(&dom, "prefill-0>decode-1", "data-hops").unwrap_or("");
        if migrations >= 1.0 && hops.contains("decode-1 → decode-0") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!(
        "within 20 s of decode-1's kill the page shows no stream of prefill-0 -> decode-1 continued on decode-0; the pairs' migrations: {:?}, hops: {:?}, the proxy's migrations tile: {:?}",
        elements(&dom, "data-pair", "data-migrations"),
        elements(&dom, "data-pair", "data-hops"),
        dom.find("id=\"t-migrations\"")
            .map(|_| tile(&dom, "t-migrations"))
    );
}

/// Every query of `pdctl export grafana`'s dashboard reads metrics that the running
/// cluster's pages (proxy, engines, the dashboard's own) export.
async fn grafana_queries_name_exported_metrics(c: &Cluster, dash: u16) {
    let out_dir = common::TempDir::new("grafana");
    let out = tokio::task::block_in_place(|| {
        c.run(&["export", "grafana", "-o", out_dir.path().to_str().unwrap()])
    });
    assert!(out.status.success(), "{}", text(&out));
    let json =
        std::fs::read_to_string(out_dir.path().join("pdctl-grafana-dashboard.json")).unwrap();
    let board: serde_json::Value = serde_json::from_str(&json).unwrap();
    let scrape = std::fs::read_to_string(out_dir.path().join("prometheus-scrape.yml")).unwrap();
    let report = tokio::task::block_in_place(|| c.status(&[])).unwrap();
    let mut pages = vec![common::get_text(&format!("http://127.0.0.1:{dash}/metrics")).await];
    for s in report.services.iter().filter(|s| s.url.is_some()) {
        let u = s.url.as_deref().unwrap().trim_end_matches('/');
        assert!(
            scrape.contains(u.trim_start_matches("http://")),
            "the scrape config lacks {}: {scrape}",
            s.name
        );
        pages.push(common::get_text(&format!("{u}/metrics")).await);
    }
    let exported: std::collections::BTreeSet<String> = pages
        .iter()
        .flat_map(|p| p.lines())
        .filter_map(|l| match l.strip_prefix("# TYPE ") {
            Some(t) => t.split_whitespace().next().map(str::to_string),
            None => pdctl::prometheus::samples(l)
                .next()
                .map(|s| s.name.to_string()),
        })
        .collect();
    let queries = pdctl::dashboard::grafana::queries(&board);
    assert!(queries.len() >= 15, "{queries:?}");
    for q in &queries {
        for name in pdctl::dashboard::grafana::metric_names(q) {
            let family = ["_total", "_bucket"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(
                exported.contains(&name) || exported.contains(family),
                "the Grafana query `{q}` reads `{name}`, which no /metrics page of the running cluster exports"
            );
        }
    }
}
