//! `pdctl export grafana`: the dashboard's figures for users who have Prometheus and
//! Grafana already: a Grafana dashboard (JSON, its queries in PromQL over the series the
//! proxy, the engines and the dashboard's own `/metrics` write) and a Prometheus scrape
//! configuration naming a plan's targets. Pure data made from the plan.

use crate::plan::Plan;
use crate::vocab::Role;
use serde_json::{Value, json};

/// The jobs of the scrape configuration: the proxy, the engines by role, the supervisor
/// (its figures on the dashboard's `/metrics`). The panels select on them.
pub const JOBS: [&str; 4] = [
    "pdctl-proxy",
    "pdctl-prefill",
    "pdctl-decode",
    "pdctl-supervisor",
];

/// One panel: its title, unit and queries (legend, PromQL).
struct Panel {
    title: &'static str,
    unit: &'static str,
    queries: Vec<(&'static str, String)>,
}

fn quantiles(series: &str, selector: &str) -> Vec<(&'static str, String)> {
    [("p50", 0.5), ("p99", 0.99)]
        .into_iter()
        .map(|(legend, q)| {
            (
                legend,
                format!(
                    "histogram_quantile({q}, sum by (le) (rate({series}_bucket{selector}[1m])))"
                ),
            )
        })
        .collect()
}

/// The panels, in the page's order.
fn panels() -> Vec<Panel> {
    let p = |title, unit, queries| Panel {
        title,
        unit,
        queries,
    };
    let one = |legend, q: &str| vec![(legend, q.to_string())];
    vec![
        p("Requests / s by status", "reqps", one("{{status}}", "sum by (status) (rate(pdctl_proxy_requests_total{job=\"pdctl-proxy\"}[1m]))")),
        p("Requests in flight", "short", one("in flight", "sum(pdctl_proxy_requests_in_flight{job=\"pdctl-proxy\"})")),
        p("Requests / s routed to each instance", "reqps", one("{{leg}} {{instance}}", "sum by (leg, instance) (rate(pdctl_proxy_instance_selected_total{job=\"pdctl-proxy\"}[1m]))")),
        p("TTFT (proxy, end to end)", "s", quantiles("pdctl_proxy_ttft_seconds", "{job=\"pdctl-proxy\"}")),
        p("ITL (decode engines)", "s", quantiles("vllm:inter_token_latency_seconds", "{job=\"pdctl-decode\"}")),
        p("Request latency (decode leg)", "s", quantiles("vllm:e2e_request_latency_seconds", "{job=\"pdctl-decode\"}")),
        p("Prefill leg duration", "s", quantiles("pdctl_proxy_prefill_duration_seconds", "{job=\"pdctl-proxy\"}")),
        p("KV tokens moved / s (into decodes)", "short", one("{{instance}}", "sum by (instance) (rate(vllm:prompt_tokens_by_source_total{job=\"pdctl-decode\",source=\"external_kv_transfer\"}[1m]))")),
        p("KV handoff misses / s by reason", "short", one("{{reason}}", "sum by (reason) (rate(pdctl_proxy_kv_handoff_misses_total{job=\"pdctl-proxy\"}[1m]))")),
        p("KV handoff failures / s by reason", "short", one("{{reason}}", "sum by (reason) (rate(pdctl_proxy_kv_handoff_failures_total{job=\"pdctl-proxy\"}[1m]))")),
        p("Retries and redone requests / s", "short", vec![
            ("retry {{leg}}", "sum by (leg) (rate(pdctl_proxy_retries_total{job=\"pdctl-proxy\"}[1m]))".into()),
            ("redone {{reason}}", "sum by (reason) (rate(pdctl_proxy_requests_redone_total{job=\"pdctl-proxy\"}[1m]))".into()),
        ]),
        p("Streams continued on another decode / s", "short", vec![
            ("migrated {{reason}}", "sum by (reason) (rate(pdctl_proxy_migrations_total{job=\"pdctl-proxy\"}[1m]))".into()),
            ("not continued {{reason}}", "sum by (reason) (rate(pdctl_proxy_migrations_refused_total{job=\"pdctl-proxy\"}[1m]))".into()),
        ]),
        p("Prefix-cache hit rate", "percentunit", one("{{job}}", "sum by (job) (rate(vllm:prefix_cache_hits_total[1m])) / sum by (job) (rate(vllm:prefix_cache_queries_total[1m]))")),
        p("Engine queue", "short", vec![
            ("running {{job}} {{instance}}", "sum by (job, instance) (vllm:num_requests_running)".into()),
            ("waiting {{job}} {{instance}}", "sum by (job, instance) (vllm:num_requests_waiting)".into()),
        ]),
        p("KV cache usage", "percentunit", one("{{job}} {{instance}}", "max by (job, instance) (vllm:kv_cache_usage_perc)")),
        p("Services healthy", "short", one("{{service}}", "pdctl_service_healthy{job=\"pdctl-supervisor\"}")),
        p("Restarts", "short", one("{{service}}", "pdctl_service_restarts{job=\"pdctl-supervisor\"}")),
        p("Rebalancer split", "short", one("{{role}}", "pdctl_proxy_rebalance_instances{job=\"pdctl-proxy\"}")),
    ]
}

/// The Grafana dashboard (import it: Dashboards -> New -> Import), its datasource a
/// variable so it fits any Prometheus.
pub fn dashboard(plan: &Plan) -> Value {
    let panels: Vec<Value> = panels()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let targets: Vec<Value> = p
                .queries
                .iter()
                .enumerate()
                .map(|(j, (legend, expr))| json!({
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "expr": expr, "legendFormat": legend, "refId": ((b'A' + j as u8) as char).to_string(),
                }))
                .collect();
            json!({
                "id": i + 1, "type": "timeseries", "title": p.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": (i / 3) * 8},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "targets": targets,
            })
        })
        .collect();
    json!({
        "title": format!("pdctl {}", plan.cluster),
        "uid": format!("pdctl-{}", plan.cluster),
        "tags": ["pdctl", "prefill-decode"],
        "timezone": "browser", "schemaVersion": 39, "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [{
            "name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
        }]},
        "panels": panels,
    })
}

/// Every PromQL query of a dashboard made by [`dashboard`].
pub fn queries(dashboard: &Value) -> Vec<String> {
    dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect()
}

/// `host:port` of a URL such as `http://127.0.0.1:8100`.
fn host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |x| x.1);
    rest.split('/').next().unwrap_or(rest)
}

/// The scrape configuration (YAML) for the plan's targets. The proxy's job keeps its
/// own `instance` label (the engine each series is about): `honor_labels`. `bearer`:
/// the dashboard's `/metrics` asks for the client key (bound beyond loopback).
pub fn scrape_config(plan: &Plan, bearer_file: Option<&str>) -> String {
    let mut jobs: Vec<(String, Vec<String>, bool, Option<&str>)> = Vec::new();
    let urls = |role: Role| -> Vec<String> {
        plan.by_role(role)
            .filter_map(|s| s.url.as_deref().map(|u| host_port(u).to_string()))
            .collect()
    };
    jobs.push((JOBS[0].into(), urls(Role::Proxy), true, None));
    jobs.push((JOBS[1].into(), urls(Role::Prefill), false, None));
    jobs.push((JOBS[2].into(), urls(Role::Decode), false, None));
    if plan.dashboard.enabled {
        jobs.push((
            JOBS[3].into(),
            vec![host_port(&plan.dashboard.url()).to_string()],
            false,
            bearer_file,
        ));
    }
    let mut out = format!(
        "# Prometheus scrape configuration for pdctl cluster {} (pdctl export grafana).\n# Merge these jobs into the scrape_configs of your prometheus.yml.\nscrape_configs:\n",
        plan.cluster
    );
    for (job, targets, honor, bearer) in jobs.into_iter().filter(|j| !j.1.is_empty()) {
        out.push_str(&format!(
            "  - job_name: {job}\n    scrape_interval: 5s\n    metrics_path: /metrics\n"
        ));
        if honor {
            out.push_str("    honor_labels: true\n");
        }
        if let Some(file) = bearer {
            out.push_str(&format!(
                "    authorization:\n      credentials_file: {file}\n"
            ));
        }
        out.push_str("    static_configs:\n      - targets:\n");
        for t in targets {
            out.push_str(&format!("          - \"{t}\"\n"));
        }
    }
    out
}

/// The metric names a PromQL query reads: what is left once quoted strings, label
/// matchers (`{...}`), ranges (`[...]`) and grouping (`by (...)`) are taken out, less the
/// functions (a word before `(`) and the aggregation keywords.
pub fn metric_names(expr: &str) -> Vec<String> {
    let mut plain = String::new();
    let mut skip_until: Option<char> = None;
    for c in expr.chars() {
        match skip_until {
            Some(end) if c == end => skip_until = None,
            Some(_) => {}
            None => match c {
                '"' => skip_until = Some('"'),
                '{' => skip_until = Some('}'),
                '[' => skip_until = Some(']'),
                _ => plain.push(c),
            },
        }
    }
    // `by (a, b)` / `without (a)`: the labels in the parentheses are no metrics.
    for kw in [" by (", " without ("] {
        while let Some(at) = plain.find(kw) {
            let close = plain[at..].find(')').map_or(plain.len(), |n| at + n + 1);
            plain.replace_range(at..close, " ");
        }
    }
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    let mut rest = plain.as_str();
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let tail = &rest[start..];
        let len = tail.find(|c: char| !is_word(c)).unwrap_or(tail.len());
        let word = &tail[..len];
        let before_paren = tail[len..].trim_start().starts_with('(');
        let keyword = matches!(
            word,
            "by" | "without" | "and" | "or" | "unless" | "on" | "ignoring"
        );
        if !before_paren && !keyword {
            names.push(word.to_string());
        }
        rest = &tail[len..];
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_what_a_query_reads() {
        assert_eq!(
            metric_names(
                "histogram_quantile(0.5, sum by (le) (rate(pdctl_proxy_ttft_seconds_bucket{job=\"pdctl-proxy\"}[1m])))"
            ),
            ["pdctl_proxy_ttft_seconds_bucket"]
        );
        assert_eq!(
            metric_names(
                "sum by (job) (rate(vllm:prefix_cache_hits_total[1m])) / sum by (job) (rate(vllm:prefix_cache_queries_total[1m]))"
            ),
            [
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total"
            ]
        );
        assert_eq!(
            metric_names("pdctl_service_healthy{job=\"x\"}"),
            ["pdctl_service_healthy"]
        );
    }

    #[test]
    fn every_panel_has_a_query_naming_a_metric_and_a_unique_ref() {
        let mut plan = Plan::for_tests("n", vec![]);
        plan.cluster = "demo".into();
        let d = dashboard(&plan);
        assert_eq!(d["uid"], "pdctl-demo");
        for p in d["panels"].as_array().unwrap() {
            let t = p["targets"].as_array().unwrap();
            assert!(!t.is_empty(), "{p}");
            for q in t {
                assert!(!metric_names(q["expr"].as_str().unwrap()).is_empty(), "{q}");
            }
        }
    }

    #[test]
    fn the_scrape_config_names_each_target_by_job() {
        let text = "scrape_configs";
        let plan = Plan::for_tests("n", vec![]);
        let y = scrape_config(&plan, Some("/etc/prometheus/pdctl.key"));
        assert!(y.contains(text));
        assert!(y.contains("job_name: pdctl-supervisor"), "{y}");
        assert!(y.contains("\"127.0.0.1:8265\""), "{y}");
        assert!(
            y.contains("credentials_file: /etc/prometheus/pdctl.key"),
            "{y}"
        );
        assert!(
            !y.contains("pdctl-proxy"),
            "a plan without a proxy has no proxy job: {y}"
        );
    }
}
