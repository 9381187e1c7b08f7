//! What a person sees of a running cluster: the status table (`pdctl status`, and after
//! `up`) composed from the supervisor's status report and the proxy's request figures
//! scraped from its `/metrics` when it runs. It lives on the client side because the
//! supervisor knows nothing of the proxy.

use crate::control::{ServiceStatus, StatusReport};
use crate::supervisor::exit_summary;
use std::fmt::Write;
use std::future::Future;
use std::pin::Pin;

/// Characters of the LAST EXIT column at most; `status --json` has the whole text.
pub const LAST_EXIT_WIDTH: usize = 80;

/// `text` cut to `max` characters, the cut marked with `...`.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let kept: String = text.chars().take(max.saturating_sub(3)).collect();
    format!("{}...", kept.trim_end())
}

/// `42s`, `3m04s`, `2h01m`, `5d03h`.
pub fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `512K`, `340M`, `1.2G`, `14G` (powers of 1024, as `ps` and `top` count).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["K", "M", "G", "T"];
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v < 9.95 && unit > 0 {
        format!("{v:.1}{}", UNITS[unit])
    } else {
        format!("{v:.0}{}", UNITS[unit])
    }
}

fn cells(s: &ServiceStatus) -> [String; 13] {
    let dash = || "-".to_string();
    let mut node = s.node.clone();
    if s.remote {
        node.push_str(" (remote)");
    }
    [
        s.name.clone(),
        s.role.to_string(),
        node,
        s.pid.map(|p| p.to_string()).unwrap_or_else(dash),
        s.state.to_string(),
        if s.gpus.is_empty() {
            dash()
        } else {
            s.gpus
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
        s.port.map(|p| p.to_string()).unwrap_or_else(dash),
        s.restarts.to_string(),
        s.uptime_s.map(human_duration).unwrap_or_else(dash),
        s.cpu_percent
            .map(|c| format!("{c:.0}%"))
            .unwrap_or_else(dash),
        s.rss_bytes.map(human_bytes).unwrap_or_else(dash),
        s.gpu_memory_bytes.map(human_bytes).unwrap_or_else(dash),
        exit_summary(s)
            .map(|t| shorten(&t, LAST_EXIT_WIDTH))
            .unwrap_or_else(dash),
    ]
}

/// The table `pdctl status` prints: a heading line, then one row per service.
pub fn status_table(report: &StatusReport) -> String {
    const HEAD: [&str; 13] = [
        "SERVICE",
        "ROLE",
        "NODE",
        "PID",
        "STATE",
        "GPUS",
        "PORT",
        "RESTARTS",
        "UPTIME",
        "CPU",
        "MEM",
        "GPU-MEM",
        "LAST EXIT",
    ];
    let healthy = report
        .services
        .iter()
        .filter(|s| s.state == crate::control::ServiceState::Healthy)
        .count();
    let mut out = format!(
        "cluster {} (node {}): {}/{} healthy",
        report.cluster,
        report.node,
        healthy,
        report.services.len()
    );
    if let Some(url) = &report.proxy_url {
        let _ = write!(out, ", requests to {url}");
    }
    out.push('\n');
    let mut table = comfy_table::Table::new();
    // No borders and two spaces between columns, the way `docker ps` looks and the way
    // scripts and tests read it; never wrapped to the terminal's width.
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(HEAD);
    for s in &report.services {
        table.add_row(cells(s));
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    out.push_str(&table.trim_fmt());
    out.push('\n');
    if let Some(op) = &report.operation {
        let _ = writeln!(out, "{}", op.line(crate::control::operation::now_ms()));
    }
    if let Some(r) = &report.rebalance {
        let _ = writeln!(
            out,
            "rebalance ({}, {} over {}/{} s, {} moves): {}",
            r.mode.as_str(),
            r.split,
            r.measured_s,
            r.window_s,
            r.moves_total,
            r.verdict
        );
    }
    out
}

/// The text `pdctl up` shows once every local service is healthy: the status table and,
/// when the proxy answers, its figures. Handed to the supervisor as its
/// [`crate::supervisor::RunOptions::healthy_text`].
pub fn healthy_text(report: StatusReport) -> Pin<Box<dyn Future<Output = String> + Send>> {
    Box::pin(async move {
        let table = status_table(&report);
        let mut text = super::dashboard::after_table(&table, super::dashboard::foreground_line());
        if let Some(url) = &report.proxy_url {
            if let Some(figures) = scrape_proxy(url).await {
                text.push_str(&figures);
                text.push('\n');
            }
        }
        text
    })
}

/// `proxy http://..: 1200 requests (3 failed), 2 in flight, 5 retries, 2 KV handoff
/// misses (900 prompt tokens recomputed)` from the running proxy (the misses include those
/// found in decode's own vLLM counters), or `None` when it does not answer within half a
/// second.
pub async fn scrape_proxy(proxy_url: &str) -> Option<String> {
    let text = metrics_page(proxy_url, std::time::Duration::from_millis(500)).await?;
    let f = crate::proxy::read_figures(&text)?;
    let mut out = format_figures(proxy_url, &f);
    for line in pairs_out_of_routing(proxy_url).await {
        out.push('\n');
        out.push_str(&line);
    }
    Some(out)
}

/// A line for each prefill/decode pair the proxy keeps out of routing while its KV path
/// is not warmed (`/health?ready`'s `pairs`), with the reason.
async fn pairs_out_of_routing(proxy_url: &str) -> Vec<String> {
    let Ok(client) = reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_millis(500))
        .build()
    else {
        return Vec::new();
    };
    let url = format!("{}/health?ready", proxy_url.trim_end_matches('/'));
    let Ok(resp) = client.get(&url).send().await else {
        return Vec::new();
    };
    let Ok(v) = resp.json::<serde_json::Value>().await else {
        return Vec::new();
    };
    pair_lines(&v)
}

/// The lines of [`pairs_out_of_routing`] from a `/health?ready` answer.
fn pair_lines(v: &serde_json::Value) -> Vec<String> {
    v["pairs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["state"] != "ready")
        .map(|p| {
            format!(
                "  pair {} -> {} out of routing: {}",
                p["prefill"].as_str().unwrap_or("?"),
                p["decode"].as_str().unwrap_or("?"),
                p["reason"]
                    .as_str()
                    .unwrap_or("warming up its KV path (one small request through both legs)")
            )
        })
        .collect()
}

/// The proxy's `/metrics` page, or `None` when it does not answer within `timeout`.
pub(super) async fn metrics_page(proxy_url: &str, timeout: std::time::Duration) -> Option<String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .build()
        .ok()?;
    let url = format!("{}/metrics", proxy_url.trim_end_matches('/'));
    client.get(&url).send().await.ok()?.text().await.ok()
}

/// The status line of a proxy's figures.
fn format_figures(proxy_url: &str, f: &crate::proxy::ProxyFigures) -> String {
    let recomputed = if f.recomputed_tokens > 0.0 {
        format!(" ({:.0} prompt tokens recomputed)", f.recomputed_tokens)
    } else {
        String::new()
    };
    let estimated = if f.kv_handoff_misses_estimated > 0.0 {
        format!(
            ", about {:.0} more estimated from decode counters",
            f.kv_handoff_misses_estimated
        )
    } else {
        String::new()
    };
    let continued = if f.migrations > 0.0 {
        format!(", {:.0} streams continued on another decode", f.migrations)
    } else {
        String::new()
    };
    let failures = if f.kv_handoff_failures > 0.0 {
        format!(", {:.0} KV handoff failures", f.kv_handoff_failures)
    } else {
        String::new()
    };
    format!(
        "proxy {proxy_url}: {:.0} requests ({:.0} failed), {:.0} in flight, {:.0} retries{continued}, {:.0} KV handoff misses{recomputed}{estimated}{failures}",
        f.requests, f.failed, f.in_flight, f.retries, f.kv_handoff_misses
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ServiceState;
    use crate::vocab::Role;

    #[test]
    fn the_proxy_line_shows_misses_and_recomputed_tokens_when_there_are_some() {
        let mut f = crate::proxy::ProxyFigures {
            requests: 1200.0,
            failed: 3.0,
            in_flight: 2.0,
            retries: 5.0,
            migrations: 0.0,
            kv_handoff_misses: 0.0,
            kv_handoff_failures: 0.0,
            recomputed_tokens: 0.0,
            kv_handoff_misses_estimated: 0.0,
        };
        assert_eq!(
            format_figures("http://p:8000", &f),
            "proxy http://p:8000: 1200 requests (3 failed), 2 in flight, 5 retries, 0 KV handoff misses"
        );
        f.migrations = 7.0;
        assert!(
            format_figures("http://p:8000", &f)
                .contains("5 retries, 7 streams continued on another decode, 0 KV")
        );
        f.migrations = 0.0;
        f.kv_handoff_misses = 2.0;
        f.recomputed_tokens = 900.0;
        assert!(
            format_figures("http://p:8000", &f)
                .ends_with("2 KV handoff misses (900 prompt tokens recomputed)")
        );
        f.kv_handoff_failures = 3.0;
        assert!(
            format_figures("http://p:8000", &f)
                .ends_with("(900 prompt tokens recomputed), 3 KV handoff failures")
        );
        f.kv_handoff_misses_estimated = 4.0;
        assert!(format_figures("http://p:8000", &f).ends_with(
            "(900 prompt tokens recomputed), about 4 more estimated from decode counters, 3 KV handoff failures"
        ));
    }

    #[test]
    fn pairs_not_ready_are_listed_with_their_reason() {
        let v = serde_json::json!({"pairs": [
            {"prefill": "http://p:1", "decode": "http://d:2", "state": "ready", "took_ms": 40},
            {"prefill": "http://p:1", "decode": "http://d:3", "state": "failed",
             "reason": "warm-up failed: decode http://d:3 could not take the KV: answered 500; next try in 4 s"},
            {"prefill": "http://p:1", "decode": "http://d:4", "state": "warming"},
        ]});
        let lines = pair_lines(&v);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].contains("http://p:1 -> http://d:3 out of routing: warm-up failed"),
            "{lines:?}"
        );
        assert!(lines[1].contains("warming up its KV path"), "{lines:?}");
    }

    #[test]
    fn durations_read_like_docker() {
        assert_eq!(human_duration(0.4), "0s");
        assert_eq!(human_duration(184.0), "3m04s");
        assert_eq!(human_duration(7260.0), "2h01m");
        assert_eq!(human_duration(97_200.0 + 86_400.0), "2d03h");
    }

    #[test]
    fn table_has_every_column_and_marks_remote_rows() {
        let report = StatusReport {
            cluster: "t1".into(),
            node: "head".into(),
            proxy_url: Some("http://127.0.0.1:8000".into()),
            services: vec![ServiceStatus {
                name: "decode-1".into(),
                role: Role::Decode,
                node: "worker".into(),
                pid: None,
                state: ServiceState::Healthy,
                gpus: vec![2, 3],
                port: Some(8201),
                url: None,
                restarts: 2,
                revision: 0,
                ports: Default::default(),
                uptime_s: Some(65.0),
                last_exit: Some("signal 9 (SIGKILL)".into()),
                last_error: None,
                remote: true,
                unreachable_since_ms: None,
                cpu_percent: None,
                rss_bytes: None,
                gpu_memory_bytes: None,
            }],
            operation: None,
            rebalance: None,
            certificates: None,
        };
        let t = status_table(&report);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("1/1 healthy") && lines[0].contains(":8000"));
        assert!(lines[1].starts_with("SERVICE") && lines[1].ends_with("LAST EXIT"));
        for cell in [
            "decode-1",
            "worker (remote)",
            "2,3",
            "8201",
            "1m05s",
            "SIGKILL",
        ] {
            assert!(lines[2].contains(cell), "{cell} missing in {t}");
        }
        // A service on this node shows what its processes use; no GPU figure is a dash.
        let mut local = report.services[0].clone();
        local.remote = false;
        local.cpu_percent = Some(187.4);
        local.rss_bytes = Some(3 * 1024 * 1024 * 1024 + 300 * 1024 * 1024);
        let t = status_table(&StatusReport {
            services: vec![local.clone()],
            ..report.clone()
        });
        let heading: Vec<&str> = t.lines().nth(1).unwrap().split_whitespace().collect();
        let row: Vec<&str> = t.lines().nth(2).unwrap().split_whitespace().collect();
        let at = |name: &str| row[heading.iter().position(|h| *h == name).unwrap()];
        assert_eq!(
            (at("CPU"), at("MEM"), at("GPU-MEM")),
            ("187%", "3.3G", "-"),
            "{t}"
        );
        local.gpu_memory_bytes = Some(70 * 1024 * 1024 * 1024);
        let t = status_table(&StatusReport {
            services: vec![local],
            ..report
        });
        assert!(t.lines().nth(2).unwrap().contains(" 70G "), "{t}");
    }

    #[test]
    fn bytes_read_like_top() {
        assert_eq!(human_bytes(0), "0K");
        assert_eq!(human_bytes(512 * 1024), "512K");
        assert_eq!(human_bytes(5 * 1024 * 1024 + 300 * 1024), "5.3M");
        assert_eq!(human_bytes(340 * 1024 * 1024), "340M");
        assert_eq!(human_bytes(14 * 1024 * 1024 * 1024), "14G");
    }

    #[test]
    fn last_exit_shows_the_error_message_short() {
        let mut s = ServiceStatus {
            name: "decode-0".into(),
            role: Role::Decode,
            node: "n".into(),
            pid: None,
            state: ServiceState::Restarting,
            gpus: vec![],
            port: None,
            url: None,
            restarts: 1,
            revision: 0,
            ports: Default::default(),
            uptime_s: None,
            last_exit: Some("exit 0".into()),
            last_error: Some(
                "ERROR 11-22 05:19:57 [core.py:812] RuntimeError: shape mismatch".into(),
            ),
            remote: false,
            unreachable_since_ms: None,
            cpu_percent: None,
            rss_bytes: None,
            gpu_memory_bytes: None,
        };
        assert_eq!(
            exit_summary(&s).as_deref(),
            Some("exit 0: RuntimeError: shape mismatch")
        );
        let long = format!("RuntimeError: {}", "x".repeat(200));
        s.last_error = Some(long.clone());
        let report = StatusReport {
            cluster: "c".into(),
            node: "n".into(),
            proxy_url: None,
            services: vec![s.clone()],
            operation: None,
            rebalance: None,
            certificates: None,
        };
        let row = status_table(&report).lines().nth(2).unwrap().to_string();
        let cell = row.split("  ").last().unwrap().trim();
        assert!(cell.starts_with("exit 0: RuntimeError: xxx"), "{row}");
        assert!(
            cell.ends_with("...") && cell.chars().count() == LAST_EXIT_WIDTH,
            "{row}"
        );
        // The JSON keeps the whole line.
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["last_error"], long.as_str());
        assert_eq!(json["last_exit"], "exit 0");
        s.last_exit = None;
        assert_eq!(exit_summary(&s), None);
    }
}
