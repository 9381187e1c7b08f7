//! The dashboard's picture of the cluster, taken once a second: the supervisor's status
//! report (over its Unix socket), the proxy's and every engine's `/metrics`, and the new
//! lines of the proxy's access log. Counters become rates over the last few seconds,
//! histograms p50/p99 points kept for the last minutes, state changes events; the whole
//! is one JSON document the page polls ([`History::view`]).

use super::access::{Access, Hop};
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
/// A migrated stream's hops wait this long for its access line (written when it ends).
const HOPS_KEPT: Duration = Duration::from_secs(600);

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
    /// Streams continued on another decode since the last look.
    pub hops: Vec<Hop>,
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

/// What one prefill -> decode pair carried since the page's server started. A request
/// counts in the pair it started on: its prefill and its first decode, where its KV went
/// (a migrated stream ends on another decode).
#[derive(Debug, Clone, Default, Serialize)]
struct PairTotals {
    requests: u64,
    failed: u64,
    kv_handoffs: u64,
    retries: u64,
    misses: BTreeMap<String, u64>,
    /// Times the pair's streams were continued on another decode.
    migrations: u64,
    /// Those hops, `decode-1 → decode-0` (`?` for a hop whose line was not read).
    hops: BTreeMap<String, u64>,
}

/// A migrated stream's hops seen before its access line: when the first came, and each
/// hop's decodes (URLs).
#[derive(Debug)]
struct PendingHops {
    since: Instant,
    hops: Vec<(String, String)>,
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
    /// Hops of streams still going (or whose access line is still to come), by request id.
    hops: HashMap<String, PendingHops>,
    /// Each engine's KV tokens received (`kv_tokens_in`) at its last scrape.
    kv_in_seen: HashMap<String, f64>,
    /// KV tokens each engine received since the page's server first saw it.
    kv_in_moved: HashMap<String, f64>,
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
        for h in std::mem::take(&mut look.hops) {
            self.hops
                .entry(h.request_id)
                .or_insert_with(|| PendingHops {
                    since: at,
                    hops: Vec::new(),
                })
                .hops
                .push((h.from, h.to));
        }
        for a in std::mem::take(&mut look.accesses) {
            self.take_access(at, a, &names);
        }
        self.hops.retain(|_, p| at - p.since < HOPS_KEPT);
        self.count_kv_in(&look.engines);
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

    /// Takes in one request's access line with the hops its stream made: counted in the
    /// pair it started on, kept for the window's rates.
    fn take_access(&mut self, at: Instant, a: Access, names: &HashMap<String, String>) {
        let hops = match a.migrations {
            0 => Vec::new(),
            _ => self
                .hops
                .remove(&a.request_id)
                .map(|p| p.hops)
                .unwrap_or_default(),
        };
        let first_decode = hops.first().map(|h| h.0.as_str()).or(a.decode.as_deref());
        let pair = (name(names, a.prefill.as_deref()), name(names, first_decode));
        let hops: Vec<String> = hops
            .iter()
            .map(|(from, to)| format!("{} → {}", name(names, Some(from)), name(names, Some(to))))
            .collect();
        self.count_access(&a, &pair, &hops, name(names, a.decode.as_deref()));
        self.recent.push_back(Recent {
            at,
            access: a,
            pair,
        });
    }

    /// Counts one request in its pair, and keeps it when it failed (with the decode it
    /// ended on).
    fn count_access(
        &mut self,
        a: &Access,
        pair: &(String, String),
        hops: &[String],
        last_decode: String,
    ) {
        if a.failed() {
            self.errors.push_front(json!({
                "at_ms": now_ms(), "request_id": a.request_id, "status": a.status,
                "message": a.outcome, "prefill": pair.0, "decode": last_decode,
            }));
            self.errors.truncate(ERRORS);
        }
        if pair.1 == "-" {
            return;
        }
        let p = self.pairs.entry(pair.clone()).or_default();
        p.requests += 1;
        p.failed += u64::from(a.failed());
        p.retries += u64::from(a.retries);
        match a.kv_handoff.as_deref() {
            Some("ok") => p.kv_handoffs += 1,
            Some(reason) => *p.misses.entry(reason.to_string()).or_default() += 1,
            None => {}
        }
        p.migrations += u64::from(a.migrations);
        for hop in hops {
            *p.hops.entry(hop.clone()).or_default() += 1;
        }
        let unread = (a.migrations as usize).saturating_sub(hops.len());
        if unread > 0 {
            *p.hops.entry(format!("? → {last_decode}")).or_default() += unread as u64;
        }
    }

    /// Adds what each engine's KV-tokens-received counter grew by since its last scrape
    /// (all of it after a restart; nothing at its first scrape: the page counts from now).
    fn count_kv_in(&mut self, engines: &BTreeMap<String, EnginePage>) {
        for (name, e) in engines {
            if let Some(before) = self.kv_in_seen.insert(name.clone(), e.kv_tokens_in) {
                *self.kv_in_moved.entry(name.clone()).or_default() += grown(before, e.kv_tokens_in);
            }
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

    /// How fast a figure of the engine `name` grew over the window, per second.
    fn engine_rate(&self, name: &str, f: fn(&EnginePage) -> f64) -> Option<f64> {
        self.span().and_then(|(a, b, secs)| {
            let (x, y) = (a.engines.get(name)?, b.engines.get(name)?);
            Some(grown(f(x), f(y)) / secs)
        })
    }

    /// An engine's load, cache and KV figures (Null for other services).
    fn engine_row(&self, name: &str) -> Value {
        let Some(e) = self.last.engines.get(name) else {
            return Value::Null;
        };
        let delta = |f: fn(&EnginePage) -> f64| self.engine_rate(name, f);
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
            // Since the page's server started, across engine restarts: the pairs' sum.
            "kv_tokens_moved": self.kv_in_moved.values().sum::<f64>().round(),
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
                let (share, split) = self.kv_share(pair);
                let moved = self.kv_in_moved.get(&pair.1).map(|m| m * share);
                let rate = self.engine_rate(&pair.1, |e| e.kv_tokens_in);
                v["kv_tokens_moved"] = json!(moved.map(f64::round));
                v["kv_tokens_moved_per_s"] = json!(rate.map(|r| r * share));
                v["kv_tokens_split"] = json!(split);
                v
            })
            .collect()
    }

    /// The pair's part of its decode's KV tokens received: its share of the KV handoffs
    /// that decode took (1 when they all came from this prefill), and whether several
    /// prefills shared it (then the part is an estimate: it assumes like prompts).
    fn kv_share(&self, pair: &(String, String)) -> (f64, bool) {
        let (from_all, prefills) = self
            .pairs
            .iter()
            .filter(|(k, t)| k.1 == pair.1 && t.kv_handoffs > 0)
            .fold((0u64, 0u32), |(n, c), (_, t)| (n + t.kv_handoffs, c + 1));
        let mine = self.pairs.get(pair).map_or(0, |t| t.kv_handoffs);
        if from_all == 0 {
            return (0.0, false);
        }
        (mine as f64 / from_all as f64, prefills > 1)
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

/// The service name of an instance's URL (the URL itself when no service has it; `-` for
/// none).
fn name(names: &HashMap<String, String>, url: Option<&str>) -> String {
    url.map(|u| u.trim_end_matches('/'))
        .map(|u| names.get(u).cloned().unwrap_or_else(|| u.to_string()))
        .unwrap_or_else(|| "-".into())
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
            migrations: 0,
            kv_handoff: handoff.map(str::to_string),
        }
    }

    /// A service of the status report, `healthy` unless said.
    fn service(
        name: &str,
        url: Option<&str>,
        state: ServiceState,
    ) -> crate::control::ServiceStatus {
        let role = if name.starts_with("prefill") {
            crate::vocab::Role::Prefill
        } else {
            crate::vocab::Role::Decode
        };
        crate::control::ServiceStatus {
            name: name.into(),
            role,
            node: "n".into(),
            pid: None,
            state,
            gpus: vec![],
            port: None,
            url: url.map(str::to_string),
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
        }
    }

    fn report(services: Vec<crate::control::ServiceStatus>) -> StatusReport {
        StatusReport {
            cluster: "c".into(),
            node: "n".into(),
            proxy_url: None,
            services,
            operation: None,
            rebalance: None,
            certificates: None,
        }
    }

    /// A 2P2D's report: prefill-N at http://pN:1, decode-N at http://dN:2.
    fn two_by_two() -> StatusReport {
        let healthy = ServiceState::Healthy;
        report(vec![
            service("prefill-0", Some("http://p0:1"), healthy),
            service("prefill-1", Some("http://p1:1"), healthy),
            service("decode-0", Some("http://d0:2/"), healthy),
            service("decode-1", Some("http://d1:2"), healthy),
        ])
    }

    /// A request from prefill `p` to decode `d` (service numbers) that went well.
    fn served(id: &str, p: u8, d: u8) -> Access {
        Access {
            prefill: Some(format!("http://p{p}:1")),
            decode: Some(format!("http://d{d}:2")),
            ..access(id, 200, Some("ok"))
        }
    }

    /// Decodes' pages whose KV-tokens-received counters say `kv`.
    fn decodes(kv: [f64; 2]) -> BTreeMap<String, EnginePage> {
        (0..2)
            .map(|i| {
                let page = EnginePage {
                    kv_tokens_in: kv[i],
                    ..EnginePage::default()
                };
                (format!("decode-{i}"), page)
            })
            .collect()
    }

    /// The pair `prefill -> decode` of a view.
    fn pair<'a>(v: &'a Value, prefill: &str, decode: &str) -> &'a Value {
        v["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["prefill"] == prefill && p["decode"] == decode)
            .unwrap_or_else(|| panic!("no pair {prefill} -> {decode}: {}", v["pairs"]))
    }

    #[test]
    fn each_pair_shows_the_kv_tokens_its_decode_received_from_its_prefill() {
        let mut h = History::default();
        let t0 = Instant::now();
        let look = |engines, accesses| Look {
            status: Some(two_by_two()),
            engines,
            accesses,
            ..Look::default()
        };
        // Before: what the counters held when the page's server started is not counted.
        h.add(t0, look(decodes([1000.0, 500.0]), vec![]));
        let accesses = vec![
            served("a", 0, 0),
            access("miss", 200, Some("decode_cached_tokens_low")),
            served("b", 0, 1),
            served("c", 1, 1),
            served("d", 1, 1),
        ];
        h.add(
            t0 + Duration::from_secs(1),
            look(decodes([1640.0, 800.0]), accesses),
        );
        let v = h.view(&BTreeMap::new(), true);
        let only = pair(&v, "prefill-0", "decode-0");
        assert_eq!(only["kv_tokens_moved"], 640.0);
        assert_eq!(only["kv_tokens_moved_per_s"], 640.0);
        assert_eq!(only["kv_tokens_split"], false);
        // decode-1's 300 tokens came from two prefills: split by their handoffs, 1 to 2.
        let (a, b) = (
            pair(&v, "prefill-0", "decode-1"),
            pair(&v, "prefill-1", "decode-1"),
        );
        assert_eq!(
            (&a["kv_tokens_moved"], &b["kv_tokens_moved"]),
            (&json!(100.0), &json!(200.0))
        );
        assert_eq!(
            (&a["kv_tokens_split"], &b["kv_tokens_split"]),
            (&json!(true), &json!(true))
        );
        // decode-0 restarted (its counter began again): what it received since counts.
        h.add(
            t0 + Duration::from_secs(2),
            look(decodes([64.0, 800.0]), vec![]),
        );
        let v = h.view(&BTreeMap::new(), true);
        assert_eq!(pair(&v, "prefill-0", "decode-0")["kv_tokens_moved"], 704.0);
        assert_eq!(
            v["totals"]["kv_tokens_moved"], 1004.0,
            "the cluster's total is its pairs' sum, and does not drop with a restart"
        );
    }

    #[test]
    fn a_migrated_stream_counts_in_the_pair_it_started_on_with_its_hops() {
        let mut h = History::default();
        let t0 = Instant::now();
        let hop = |id: &str, from: u8, to: u8| Hop {
            request_id: id.into(),
            from: format!("http://d{from}:2"),
            to: format!("http://d{to}:2"),
        };
        // Its hop is logged while it streams; its access line at its end, with its last decode.
        h.add(
            t0,
            Look {
                status: Some(two_by_two()),
                hops: vec![hop("m", 1, 0)],
                ..Look::default()
            },
        );
        let moved = Access {
            migrations: 1,
            retries: 2,
            ..served("m", 0, 0)
        };
        // One whose hop line was not read (the page's server started after it).
        let unread = Access {
            migrations: 1,
            ..served("u", 1, 0)
        };
        h.add(
            t0 + Duration::from_secs(1),
            Look {
                status: Some(two_by_two()),
                accesses: vec![moved, unread],
                ..Look::default()
            },
        );
        let v = h.view(&BTreeMap::new(), true);
        let started = pair(&v, "prefill-0", "decode-1");
        assert_eq!(
            (&started["requests"], &started["kv_handoffs"]),
            (&json!(1), &json!(1))
        );
        assert_eq!(
            (&started["migrations"], &started["retries"]),
            (&json!(1), &json!(2))
        );
        assert_eq!(started["hops"], json!({"decode-1 → decode-0": 1}));
        assert_eq!(
            pair(&v, "prefill-1", "decode-0")["hops"],
            json!({"? → decode-0": 1})
        );
        assert!(
            v["pairs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|p| p["prefill"] != "prefill-0" || p["decode"] != "decode-0"),
            "the stream is counted where it started, not where it ended: {}",
            v["pairs"]
        );
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
        let report = |state| report(vec![service("decode-1", None, state)]);
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
