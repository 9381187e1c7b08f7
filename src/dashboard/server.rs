//! The dashboard's HTTP server: `/` the page, `/api/state` the document it polls,
//! `/api/logs?service=NAME` a service's last log lines; and the look once a second that
//! keeps the document fresh.

use super::Watch;
use super::access::{Line, Tail, parse_line};
use super::collect::{History, Look};
use super::pages::{read_engine, read_proxy};
use crate::control::client::{self, Endpoint, StatusConn};
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// The page: HTML, CSS and JS in one file, nothing fetched from elsewhere.
const PAGE: &str = include_str!("page.html");

/// The header of the page naming the cluster it shows.
pub const CLUSTER_HEADER: &str = "x-pdctl-cluster";

/// How often the picture is taken (the page polls as often).
const EVERY: Duration = Duration::from_secs(1);
/// One scrape or status question may take this long before the look goes without it.
const ASK_TIMEOUT: Duration = Duration::from_millis(800);
/// Log lines a click shows at most.
const MAX_LOG_LINES: usize = 400;

/// What the handlers share: the settings and the last document, ready to send.
struct Shared {
    watch: Watch,
    doc: RwLock<Arc<String>>,
    /// The supervisor's figures as Prometheus text.
    metrics: RwLock<Arc<String>>,
}

/// Serves the page on `listener` until the process ends, taking a look every second.
pub async fn serve(listener: std::net::TcpListener, watch: Watch) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let shared = Arc::new(Shared {
        watch,
        doc: RwLock::new(Arc::new("{}".into())),
        metrics: RwLock::new(Arc::new(String::new())),
    });
    tokio::spawn(look_every_second(shared.clone()));
    let app = Router::new()
        .route("/", get(page))
        .route("/api/state", get(state))
        .route("/api/logs", get(logs))
        .route("/metrics", get(metrics))
        .with_state(shared);
    axum::serve(listener, app).await
}

/// Takes the picture once a second and keeps the document of the last one.
async fn look_every_second(shared: Arc<Shared>) {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(ASK_TIMEOUT)
        .build()
        .unwrap_or_default();
    let mut history = History::default();
    let mut tail = shared.watch.proxy_log.as_deref().map(Tail::new);
    let mut conn: Option<StatusConn> = None;
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut look = Look::default();
        match ask_status(&shared.watch, &mut conn).await {
            Ok(report) => look.status = Some(report),
            Err(e) => look.status_error = Some(e),
        }
        if let Some(s) = &look.status {
            let (proxy, engines) = scrape(&http, s).await;
            look.proxy = proxy;
            look.engines = engines;
        }
        if let Some(t) = tail.as_mut() {
            for line in t.new_lines().iter().filter_map(|l| parse_line(l)) {
                match line {
                    Line::Access(a) => look.accesses.push(a),
                    Line::Hop(h) => look.hops.push(h),
                }
            }
        }
        history.add(Instant::now(), look);
        let mut doc = history.view(&shared.watch.nodes, tail.is_some());
        doc["rebalance_objectives"] = shared.watch.objectives.clone();
        let text = Arc::new(doc.to_string());
        *shared.doc.write().unwrap_or_else(|e| e.into_inner()) = text;
        let figures = Arc::new(history.supervisor_metrics());
        *shared.metrics.write().unwrap_or_else(|e| e.into_inner()) = figures;
    }
}

/// The supervisor's report over a connection kept open between looks.
async fn ask_status(
    watch: &Watch,
    conn: &mut Option<StatusConn>,
) -> Result<crate::control::StatusReport, String> {
    if conn.is_none() {
        let to = Endpoint::Unix(watch.socket.clone());
        *conn = Some(
            StatusConn::open(&to, ASK_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let answer = conn.as_mut().expect("opened above").status().await;
    if answer.is_err() {
        *conn = None;
    }
    answer.map_err(|e| e.to_string())
}

/// The proxy's page and every engine's (those with a URL), asked at once.
async fn scrape(
    http: &reqwest::Client,
    s: &crate::control::StatusReport,
) -> (
    Option<super::pages::ProxyPage>,
    std::collections::BTreeMap<String, super::pages::EnginePage>,
) {
    let get = |url: String| async move {
        let r = http
            .get(format!("{}/metrics", url.trim_end_matches('/')))
            .send()
            .await
            .ok()?;
        r.error_for_status().ok()?.text().await.ok()
    };
    let engines = s
        .services
        .iter()
        .filter(|x| x.role.is_engine())
        .filter_map(|x| {
            let url = x.url.clone()?;
            let name = x.name.clone();
            Some(async move { (name, get(url).await) })
        });
    let proxy = async {
        let text = get(s.proxy_url.clone()?).await?;
        read_proxy(&text)
    };
    let (proxy, pages) = tokio::join!(proxy, futures_util::future::join_all(engines));
    let engines = pages
        .into_iter()
        .filter_map(|(name, text)| Some((name, read_engine(&text?))))
        .collect();
    (proxy, engines)
}

/// Why a request is refused: the status and the text said.
type Refused = (StatusCode, String);

/// Whether a request may read the cluster: on loopback, when its Host is an IP address or
/// `localhost` (no page of another site that points a name of its own at 127.0.0.1);
/// bound beyond, when it carries the client key.
fn allowed(watch: &Watch, headers: &HeaderMap) -> Result<(), Refused> {
    let Some(key) = &watch.key else {
        return local_host(watch, headers);
    };
    let sent = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if crate::constant_time::equal(sent.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err((
            StatusCode::UNAUTHORIZED,
            format!(
                "missing or wrong key: the dashboard is bound beyond this machine and shows the cluster only with its client key ({}), sent as `Authorization: Bearer <key>` (the page asks for it)",
                crate::vocab::PROXY_CLIENT_KEY_VAR
            ),
        ))
    }
}

/// Refuses a Host that is neither an IP address nor `localhost`.
fn local_host(watch: &Watch, headers: &HeaderMap) -> Result<(), Refused> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let name = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let by_address = name
        .trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok();
    if by_address || name == "localhost" {
        return Ok(());
    }
    Err((
        StatusCode::FORBIDDEN,
        format!(
            "the dashboard answers at an IP address or localhost (port {}), not at `{host}`",
            watch.port
        ),
    ))
}

/// Headers every answer carries: not cached, not sniffed, nothing loaded from elsewhere.
fn guarded(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
        ),
    );
    r
}

async fn page(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    // The page holds no data: bound beyond loopback it is served to all (it asks for the
    // key the data needs), on loopback to a local Host only.
    if s.watch.key.is_none()
        && let Err(r) = local_host(&s.watch, &headers)
    {
        return guarded(r.into_response());
    }
    let mut r = ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response();
    if let Ok(name) = HeaderValue::from_str(&s.watch.cluster) {
        r.headers_mut().insert(CLUSTER_HEADER, name);
    }
    guarded(r)
}

async fn state(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = allowed(&s.watch, &headers) {
        return guarded(r.into_response());
    }
    let doc = s.doc.read().unwrap_or_else(|e| e.into_inner()).clone();
    guarded(
        (
            [(header::CONTENT_TYPE, "application/json")],
            doc.to_string(),
        )
            .into_response(),
    )
}

async fn metrics(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = allowed(&s.watch, &headers) {
        return guarded(r.into_response());
    }
    let text = s.metrics.read().unwrap_or_else(|e| e.into_inner()).clone();
    let kind = "text/plain; version=0.0.4; charset=utf-8";
    guarded(([(header::CONTENT_TYPE, kind)], text.to_string()).into_response())
}

/// `?service=NAME&lines=N`.
#[derive(serde::Deserialize)]
struct LogsQuery {
    service: String,
    lines: Option<usize>,
}

async fn logs(State(s): State<Arc<Shared>>, headers: HeaderMap, q: Query<LogsQuery>) -> Response {
    if let Err(r) = allowed(&s.watch, &headers) {
        return guarded(r.into_response());
    }
    let n = q.lines.unwrap_or(100).clamp(1, MAX_LOG_LINES);
    let to = Endpoint::Unix(s.watch.socket.clone());
    let answer = client::logs_at(&to, &q.service, n, Duration::from_secs(5)).await;
    let r = match answer {
        Ok(lines) => {
            let lines: Vec<String> = lines.iter().map(|l| hide(l, &s.watch.hidden)).collect();
            axum::Json(serde_json::json!({"service": q.service, "lines": lines})).into_response()
        }
        Err(e) => (
            StatusCode::NOT_FOUND,
            format!("no log of `{}`: {e}", q.service),
        )
            .into_response(),
    };
    guarded(r)
}

/// `line` with every hidden text blanked out.
fn hide(line: &str, hidden: &[String]) -> String {
    let plain = crate::supervisor::strip_ansi(line);
    hidden
        .iter()
        .filter(|h| h.len() >= 8)
        .fold(plain, |acc, h| acc.replace(h.as_str(), "[hidden]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(key: Option<&str>) -> Watch {
        Watch {
            socket: "/nonexistent".into(),
            proxy_log: None,
            nodes: Default::default(),
            key: key.map(str::to_string),
            hidden: vec![],
            cluster: "c".into(),
            port: 8265,
            objectives: serde_json::Value::Null,
        }
    }

    fn headers(host: &str, auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_str(host).unwrap());
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn the_data_needs_the_key_when_one_is_asked_and_a_rebinding_host_is_refused() {
        let open = watch(None);
        assert!(allowed(&open, &headers("127.0.0.1:8265", None)).is_ok());
        assert!(allowed(&open, &headers("localhost:8265", None)).is_ok());
        assert!(allowed(&open, &headers("[::1]:8265", None)).is_ok());
        let r = allowed(&open, &headers("evil.example:8265", None)).unwrap_err();
        assert_eq!(r.0, StatusCode::FORBIDDEN);
        let keyed = watch(Some("k-123456789"));
        let r = allowed(&keyed, &headers("10.0.0.5:8265", None)).unwrap_err();
        assert_eq!(r.0, StatusCode::UNAUTHORIZED);
        assert!(allowed(&keyed, &headers("10.0.0.5:8265", Some("Bearer wrong"))).is_err());
        assert!(
            allowed(
                &keyed,
                &headers("10.0.0.5:8265", Some("Bearer k-123456789"))
            )
            .is_ok()
        );
    }

    #[test]
    fn log_lines_never_show_a_key() {
        let hidden = vec!["sekrit-engine-key".to_string()];
        assert_eq!(
            hide("argv --api-key sekrit-engine-key now", &hidden),
            "argv --api-key [hidden] now"
        );
    }

    #[test]
    fn the_page_is_self_contained() {
        assert!(PAGE.starts_with("<!DOCTYPE html>"));
        for far in [
            "src=\"http",
            "href=\"http",
            "url(http",
            "@import",
            "<script src",
            "<link ",
        ] {
            assert!(!PAGE.contains(far), "the page loads `{far}` from elsewhere");
        }
    }
}
