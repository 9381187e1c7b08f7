//! The dashboard's picture of the cluster, taken once a second: the supervisor's status
//! report (over its Unix socket), the proxy's and every engine's `/metrics`, and the new
//! lines of the proxy's access log. Counters become rates over the last few seconds,
//! histograms p50/p99 points kept for the last minutes, state changes events; the whole
//! is one JSON document the page polls ([`History::view`]).

use super::access::Access;
use super::pages::{Buckets, EnginePage, ProxyPage};
use crate::control::{ServiceState, StatusReport};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Rates and percentiles are over this much of the past.
pub const WINDOW: Duration = Duration::from_secs(5);
/// Latency points kept (one a second): ten minutes.
const POINTS: usize = 600;
/// Failed requests and state changes shown, newest first.
const ERRORS: usize = 20;
const EVENTS: usize = 40;

/// What one look found.
#[derive(Debug, Clone, Default)]
pub struct Look {
    pub status: Option<StatusReport>,
    /// Why the status report is missing.
    pub status_error: Option<String>,
    pub proxy: Option<ProxyPage>,
    /// Engines' pages, by service name.
    pub engines: BTreeMap<String, EnginePage>,
    /// Access lines since the last look.
    pub accesses: Vec<Access>,
}

/// The counters of one look, kept for rates.
#[derive(Debug)]
struct Tick {
    at: Instant,
    proxy: Option<ProxyPage>,
    engines: BTreeMap<String, EnginePage>,
}

/// One point of the latency charts (milliseconds; None: nothing observed in its window).
#[derive(Debug, Clone, Serialize)]
struct Point {
    t: u64,
    ttft_p50: Option<f64>,
    ttft_p99: Option<f64>,
    itl_p50: Option<f64>,
    itl_p99: Option<f64>,
    e2e_p50: Option<f64>,
    e2e_p99: Option<f64>,
}

/// What one prefill -> decode pair carried since the page's server started.
#[derive(Debug, Clone, Default, Serialize)]
struct PairTotals {
    requests: u64,
    failed: u64,
    kv_handoffs: u64,
    retries: u64,
    misses: BTreeMap<String, u64>,
}

/// A request of the window.
#[derive(Debug)]
struct Recent {
    at: Instant,
    access: Access,
    pair: (String, String),
}

/// Everything the page shows, kept between looks.
#[derive(Debug, Default)]
pub struct History {
    ticks: VecDeque<Tick>,
    points: VecDeque<Point>,
    /// The requests of the window, with their pair's service names.
    recent: VecDeque<Recent>,
    pairs: BTreeMap<(String, String), PairTotals>,
    errors: VecDeque<Value>,
    events: VecDeque<Value>,
    /// Each service's state and restarts at the last look.
    states: HashMap<String, (ServiceState, u32)>,
    last: Look,
}

/// Unix time now, in milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl History {
    /// Takes in a look made at `at`.
    pub fn add(&mut self, at: Instant, mut look: Look) {
        let names = look.status.as_ref().map(url_names).unwrap_or_default();
        let name = |url: &Option<String>| -> String {
            url.as_deref()
                .map(|u| u.trim_end_matches('/'))
                .map(|u| names.get(u).cloned().unwrap_or_else(|| u.to_string()))
                .unwrap_or_else(|| "-".into())
        };
        for a in std::mem::take(&mut look.accesses) {
            let pair = (name(&a.prefill), name(&a.decode));
            self.count_access(&a, pair.0.clone(), pair.1.clone());
            self.recent.push_back(Recent {
                at,
                access: a,
                pair,
            });
        }
        while self.recent.front().is_some_and(|r| at - r.at > WINDOW) {
            self.recent.pop_front();
        }
        if let Some(s) = &look.status {
            self.note_states(s);
        }
        self.ticks.push_back(Tick {
            at,
            proxy: look.proxy.clone(),
            engines: look.engines.clone(),
        });
        while self.ticks.len() > 2 && at - self.ticks[1].at >= WINDOW {
            self.ticks.pop_front();
        }
        let point = self.point();
        self.points.push_back(point);
        if self.points.len() > POINTS {
            self.points.pop_front();
        }
        self.last = look;
    }

    /// Counts one request in its pair, and keeps it when it failed.
    fn count_access(&mut self, a: &Access, prefill: String, decode: String) {
        if a.failed() {
            self.errors.push_front(json!({
                "at_ms": now_ms(), "request_id": a.request_id, "status": a.status,
                "message": a.outcome, "prefill": prefill, "decode": decode,
            }));
            self.errors.truncate(ERRORS);
        }
        if decode == "-" {
            return;
        }
        let p = self.pairs.entry((prefill, decode)).or_default();
        p.requests += 1;
        p.failed += u64::from(a.failed());
        p.retries += u64::from(a.retries);
        match a.kv_handoff.as_deref() {
            Some("ok") => p.kv_handoffs += 1,
            Some(reason) => *p.misses.entry(reason.to_string()).or_default() += 1,
            None => {}
        }
    }

    /// Notes each service whose state changed since the last look. A restart quicker than
    /// a look (its restarts count grew, its state shows none) is noted as the two changes
    /// it was: to `restarting`, then to where it is now.
    fn note_states(&mut self, s: &StatusReport) {
        for svc in &s.services {
            let now = (svc.state, svc.restarts);
            let Some((from, restarts)) = self.states.insert(svc.name.clone(), now) else {
                continue;
            };
            let unseen = svc.restarts > restarts
                && from != ServiceState::Restarting
                && svc.state != ServiceState::Restarting;
            if unseen {
                self.event(
                    &svc.name,
                    from,
                    ServiceState::Restarting,
                    svc.last_exit.as_deref(),
                );
                self.event(&svc.name, ServiceState::Restarting, svc.state, None);
            } else if from != svc.state {
                self.event(&svc.name, from, svc.state, svc.last_exit.as_deref());
            }
        }
    }

    /// Keeps one change of state, newest first.
    fn event(&mut self, service: &str, from: ServiceState, to: ServiceState, why: Option<&str>) {
        self.events.push_front(json!({
            "at_ms": now_ms(), "service": service,
            "from": from.as_str(), "to": to.as_str(), "why": why,
        }));
        self.events.truncate(EVENTS);
    }

    /// The oldest and newest ticks of the window, and the seconds between them.
    fn span(&self) -> Option<(&Tick, &Tick, f64)> {
        let (first, last) = (self.ticks.front()?, self.ticks.back()?);
        let secs = (last.at - first.at).as_secs_f64();
        (secs > 0.0).then_some((first, last, secs))
    }

    /// p50/p99 of TTFT (the proxy's histogram), ITL (the decodes'), e2e (access lines).
    fn point(&self) -> Point {
        let ms = |v: Option<f64>| v.map(|s| (s * 1e4).round() / 10.0);
        let (ttft, itl) = match self.span() {
            Some((first, last, _)) => (
                last.proxy
                    .as_ref()
                    .map(|p| p.ttft.since(&first.proxy.clone().unwrap_or_default().ttft))
                    .unwrap_or_default(),
                itl_since(first, last),
            ),
            None => Default::default(),
        };
        let mut e2e: Vec<f64> = self
            .recent
            .iter()
            .filter_map(|r| r.access.total_ms)
            .collect();
        e2e.sort_by(f64::total_cmp);
        Point {
            t: now_ms(),
            ttft_p50: ms(ttft.quantile(0.5)),
            ttft_p99: ms(ttft.quantile(0.99)),
            itl_p50: ms(itl.quantile(0.5)),
            itl_p99: ms(itl.quantile(0.99)),
            e2e_p50: rank(&e2e, 0.5),
            e2e_p99: rank(&e2e, 0.99),
        }
    }

    /// The document the page polls.
    pub fn view(&self, nodes: &BTreeMap<String, String>, proxy_log_here: bool) -> Value {
        let status = self.last.status.as_ref();
        json!({
            "at_ms": now_ms(),
            "cluster": status.map(|s| s.cluster.clone()),
            "node": status.map(|s| s.node.clone()),
            "proxy_url": status.and_then(|s| s.proxy_url.clone()),
            "status_error": self.last.status_error,
            "nodes": nodes,
            "services": self.services(),
            "totals": self.totals(),
            "pairs": self.pairs_view(),
            "pairs_source": if proxy_log_here { Value::Null } else {
                json!("the proxy runs on another node: its access log, which gives the pairs, is not here")
            },
            "points": self.points,
            "rebalance": status.and_then(|s| s.rebalance.as_ref()),
            "operation": status.and_then(|s| s.operation.as_ref())
                .map(|op| op.line(crate::control::operation::now_ms())),
            "errors": self.errors,
            "events": self.events,
        })
    }

    /// One row per service: the status report's columns, the proxy's and the engine's figures.
    fn services(&self) -> Vec<Value> {
        let Some(status) = &self.last.status else {
            return Vec::new();
        };
        let span = self.span();
        status
            .services
            .iter()
            .map(|s| {
                let url = s
                    .url
                    .as_deref()
                    .map(|u| u.trim_end_matches('/').to_string());
                let mut row = serde_json::to_value(s).unwrap_or_default();
                let routed = url.as_ref().and_then(|u| {
                    let p = self.last.proxy.as_ref()?.instances.get(u)?;
                    Some(json!({"in_flight": p.in_flight, "routed": p.routed}))
                });
                row["proxy"] = routed.unwrap_or(Value::Null);
                row["selected_per_s"] = json!(
                    span.zip(url.as_ref())
                        .and_then(|((a, b, secs), u)| selected_rate(a, b, secs, u))
                );
                row["engine"] = self.engine_row(&s.name);
                // Never the log text here: it may carry what the page must not show.
                row["last_error"] = Value::Null;
                row
            })
            .collect()
    }

    /// An engine's load, cache and KV figures (Null for other services).
    fn engine_row(&self, name: &str) -> Value {
        let Some(e) = self.last.engines.get(name) else {
            return Value::Null;
        };
        let delta = |f: fn(&EnginePage) -> f64| {
            self.span().and_then(|(a, b, secs)| {
                let (x, y) = (a.engines.get(name)?, b.engines.get(name)?);
                Some(grown(f(x), f(y)) / secs)
            })
        };
        let hits = delta(|e| e.prefix_hits);
        let queries = delta(|e| e.prefix_queries);
        json!({
            "running": e.running, "waiting": e.waiting, "kv_cache_usage": e.kv_cache_usage,
            "prefix_hit_rate": ratio(hits, queries).or(ratio(Some(e.prefix_hits), Some(e.prefix_queries))),
            "kv_tokens_in": e.kv_tokens_in,
            "kv_tokens_in_per_s": delta(|e| e.kv_tokens_in),
            "tokens_out_per_s": delta(|e| e.generation_tokens),
        })
    }

    /// The cluster's totals, with rates over the window.
    fn totals(&self) -> Value {
        let p = self.last.proxy.as_ref();
        let rate = |f: fn(&ProxyPage) -> f64| {
            self.span().and_then(|(a, b, secs)| {
                Some(grown(f(a.proxy.as_ref()?), f(b.proxy.as_ref()?)) / secs)
            })
        };
        let engines = |f: fn(&EnginePage) -> f64| self.last.engines.values().map(f).sum::<f64>();
        let engine_rate = |f: fn(&EnginePage) -> f64| {
            self.span().map(|(a, b, secs)| {
                let sum = |t: &Tick| t.engines.values().map(f).sum::<f64>();
                grown(sum(a), sum(b)) / secs
            })
        };
        let handoffs: u64 = self.pairs.values().map(|p| p.kv_handoffs).sum();
        let handoffs_recent = self
            .recent
            .iter()
            .filter(|r| r.access.kv_handoff.as_deref() == Some("ok"))
            .count();
        json!({
            "requests": p.map(|p| p.requests), "failed": p.map(|p| p.failed),
            "in_flight": p.map(|p| p.in_flight), "requests_per_s": rate(|p| p.requests),
            "retries": p.map(|p| p.retries), "redone": p.map(|p| p.redone),
            "migrations": p.and_then(|p| p.migrations.clone()),
            "kv_handoff_misses": p.map(|p| p.misses.clone()),
            "kv_handoff_failures": p.map(|p| p.handoff_failures),
            "kv_handoffs": handoffs,
            "kv_handoffs_per_s": handoffs_recent as f64 / WINDOW.as_secs_f64(),
            "kv_tokens_moved": engines(|e| e.kv_tokens_in),
            "kv_tokens_moved_per_s": engine_rate(|e| e.kv_tokens_in),
            "prefix_hit_rate": ratio(engine_rate(|e| e.prefix_hits), engine_rate(|e| e.prefix_queries))
                .or(ratio(Some(engines(|e| e.prefix_hits)), Some(engines(|e| e.prefix_queries)))),
        })
    }

    /// Each pair's totals and its rates over the window.
    fn pairs_view(&self) -> Vec<Value> {
        let secs = WINDOW.as_secs_f64();
        self.pairs
            .iter()
            .map(|(pair, t)| {
                let recent: Vec<&Access> = self
                    .recent
                    .iter()
                    .filter(|r| r.pair == *pair)
                    .map(|r| &r.access)
                    .collect();
                let ok = recent
                    .iter()
                    .filter(|a| a.kv_handoff.as_deref() == Some("ok"))
                    .count();
                let mut v = serde_json::to_value(t).unwrap_or_default();
                v["prefill"] = json!(pair.0);
                v["decode"] = json!(pair.1);
                v["requests_per_s"] = json!(recent.len() as f64 / secs);
                v["kv_handoffs_per_s"] = json!(ok as f64 / secs);
                v
            })
            .collect()
    }
}

/// A family of the supervisor's figures: name, type, help, the value of a service.
type Family = (
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::control::ServiceStatus) -> Option<f64>,
);

impl History {
    /// The supervisor's figures as Prometheus text (the `pdctl-supervisor` job of
    /// `pdctl export grafana`): each service's health, restarts, CPU and memory.
    pub fn supervisor_metrics(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let Some(status) = &self.last.status else {
            return out;
        };
        let families: [Family; 4] = [
            (
                "pdctl_service_healthy",
                "gauge",
                "1 when the supervisor finds the service healthy, else 0",
                |s| Some(f64::from(u8::from(s.state == ServiceState::Healthy))),
            ),
            (
                "pdctl_service_restarts",
                "gauge",
                "Times the supervisor restarted the service since it started",
                |s| Some(f64::from(s.restarts)),
            ),
            (
                "pdctl_service_cpu_percent",
                "gauge",
                "CPU of the service and its children, percent of one core",
                |s| s.cpu_percent.map(f64::from),
            ),
            (
                "pdctl_service_memory_bytes",
                "gauge",
                "Resident memory of the service and its children",
                |s| s.rss_bytes.map(|b| b as f64),
            ),
        ];
        for (name, kind, help, value) in families {
            let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} {kind}");
            for svc in &status.services {
                if let Some(v) = value(svc) {
                    let _ = writeln!(
                        out,
                        "{name}{{service=\"{}\",role=\"{}\",node=\"{}\",state=\"{}\"}} {v}",
                        svc.name, svc.role, svc.node, svc.state
                    );
                }
            }
        }
        out
    }
}

/// Service URL (no trailing `/`) -> service name.
fn url_names(s: &StatusReport) -> HashMap<String, String> {
    s.services
        .iter()
        .filter_map(|x| {
            Some((
                x.url.as_deref()?.trim_end_matches('/').to_string(),
                x.name.clone(),
            ))
        })
        .collect()
}

/// How much a counter grew (all of it when it went down: the process restarted).
fn grown(before: f64, after: f64) -> f64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

/// a / b when b is above 0.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    let (a, b) = (a?, b?);
    (b > 0.0).then_some(a / b)
}

/// The `q` quantile of sorted values (nearest rank).
fn rank(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    Some(sorted[i])
}

/// The decodes' inter-token latencies observed between two ticks.
fn itl_since(first: &Tick, last: &Tick) -> Buckets {
    let mut sum = Buckets::default();
    for (name, now) in &last.engines {
        let then = first
            .engines
            .get(name)
            .map(|e| e.itl.clone())
            .unwrap_or_default();
        sum.merge(&now.itl.since(&then));
    }
    sum
}

/// How often routing chose the instance at `url` per second between two ticks.
fn selected_rate(a: &Tick, b: &Tick, secs: f64, url: &str) -> Option<f64> {
    let x = a.proxy.as_ref()?.instances.get(url)?.selected;
    let y = b.proxy.as_ref()?.instances.get(url)?.selected;
    Some(grown(x, y) / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(id: &str, status: u16, handoff: Option<&str>) -> Access {
        Access {
            request_id: id.into(),
            outcome: if status < 400 {
                "ok".into()
            } else {
                "no decode is healthy".into()
            },
            prefill: Some("http://p:1".into()),
            decode: Some("http://d:2/".into()),
            status,
            ttft_ms: Some(10.0),
            total_ms: Some(100.0),
            retries: 0,
            kv_handoff: handoff.map(str::to_string),
        }
    }

    #[test]
    fn accesses_count_in_their_pair_and_failures_are_kept_with_their_id() {
        let mut h = History::default();
        let t0 = Instant::now();
        let look = Look {
            accesses: vec![
                access("a", 200, Some("ok")),
                access("b", 200, Some("decode_cached_tokens_low")),
                access("c", 503, None),
            ],
            ..Look::default()
        };
        h.add(t0, look);
        let v = h.view(&BTreeMap::new(), true);
        let pair = &v["pairs"][0];
        assert_eq!(
            (pair["prefill"].as_str(), pair["decode"].as_str()),
            (Some("http://p:1"), Some("http://d:2"))
        );
        assert_eq!(pair["requests"], 3);
        assert_eq!(pair["kv_handoffs"], 1);
        assert_eq!(pair["misses"]["decode_cached_tokens_low"], 1);
        assert_eq!(v["errors"][0]["request_id"], "c");
        assert_eq!(v["errors"][0]["status"], 503);
        assert_eq!(v["points"][0]["e2e_p50"], 100.0);
    }

    #[test]
    fn rates_come_from_counters_over_the_window_and_a_restart_is_not_negative() {
        let mut h = History::default();
        let t0 = Instant::now();
        let page = |n: f64| ProxyPage {
            requests: n,
            ..ProxyPage::default()
        };
        h.add(
            t0,
            Look {
                proxy: Some(page(10.0)),
                ..Look::default()
            },
        );
        h.add(
            t0 + Duration::from_secs(2),
            Look {
                proxy: Some(page(30.0)),
                ..Look::default()
            },
        );
        assert_eq!(
            h.view(&BTreeMap::new(), true)["totals"]["requests_per_s"],
            10.0
        );
        h.add(
            t0 + Duration::from_secs(4),
            Look {
                proxy: Some(page(4.0)),
                ..Look::default()
            },
        );
        let r = h.view(&BTreeMap::new(), true)["totals"]["requests_per_s"]
            .as_f64()
            .unwrap();
        assert!(r >= 0.0, "{r}");
    }

    #[test]
    fn a_state_change_is_an_event() {
        let mut h = History::default();
        let report = |state| StatusReport {
            cluster: "c".into(),
            node: "n".into(),
            proxy_url: None,
            services: vec![crate::control::ServiceStatus {
                name: "decode-1".into(),
                role: crate::vocab::Role::Decode,
                node: "n".into(),
                pid: None,
                state,
                gpus: vec![],
                port: None,
                url: None,
                restarts: 0,
                revision: 0,
                ports: Default::default(),
                uptime_s: None,
                last_exit: Some("signal 9 (SIGKILL)".into()),
                last_error: Some("secret-ish text".into()),
                remote: false,
                unreachable_since_ms: None,
                cpu_percent: None,
                rss_bytes: None,
                gpu_memory_bytes: None,
            }],
            operation: None,
            rebalance: None,
            certificates: None,
        };
        let t0 = Instant::now();
        h.add(
            t0,
            Look {
                status: Some(report(ServiceState::Healthy)),
                ..Look::default()
            },
        );
        h.add(
            t0,
            Look {
                status: Some(report(ServiceState::Restarting)),
                ..Look::default()
            },
        );
        let v = h.view(&BTreeMap::new(), true);
        assert_eq!(v["events"][0]["service"], "decode-1");
        assert_eq!(
            (
                v["events"][0]["from"].as_str(),
                v["events"][0]["to"].as_str()
            ),
            (Some("healthy"), Some("restarting"))
        );
        assert_eq!(v["services"][0]["state"], "restarting");
        assert_eq!(v["services"][0]["last_error"], Value::Null);
    }
}
