//! Readiness and liveness checks (HTTP, TCP, a log line), and the polling schedule used
//! while a service starts: 50 ms at first so a simulated cluster is ready in well under a
//! second, growing to 1 s so a vLLM that loads for minutes is not hammered.

use crate::vocab::{HealthSettings, Probe, Service, TcpLiveness};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
/// Time between liveness probes of a healthy service.
pub const LIVENESS_INTERVAL: Duration = Duration::from_secs(1);

/// Why a probe did not pass; its text is the short reason progress and status show.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("log has no line containing {contains:?} yet")]
    NoLogLine { contains: String },
    #[error("GET {url} timed out")]
    HttpTimeout { url: String },
    #[error("GET {url}: connection refused")]
    HttpRefused { url: String },
    #[error("GET {url}: {source}")]
    Http { url: String, source: reqwest::Error },
    #[error("GET {url} answered {got}, expected {want}")]
    HttpStatus { url: String, got: u16, want: u16 },
    #[error("GET {url}: reading the body: {source}")]
    HttpBody { url: String, source: reqwest::Error },
    #[error("GET {url} body lacks {text:?}")]
    BodyLacks { url: String, text: String },
    #[error("TCP {host}:{port}: {source}")]
    Tcp {
        host: String,
        port: u16,
        source: std::io::Error,
    },
    #[error("TCP {host}:{port}: timed out")]
    TcpTimeout { host: String, port: u16 },
    /// Timed out while this process was frozen for `stalled` (the whole machine was): no
    /// evidence either way, not counted ([`crate::stall_clock`]).
    #[error("{timed_out} while this machine stalled {:.1} s: not counted", stalled.as_secs_f64())]
    Stalled {
        timed_out: Box<ProbeError>,
        stalled: Duration,
    },
}

impl ProbeError {
    /// Whether this failure is evidence that the service cannot serve (its port refuses
    /// connections or resets them: the process is gone or not listening; or it says so
    /// itself with a 5xx, as vLLM's /health does once its engine is dead), rather than
    /// slowness (no answer in time), which only `health.failed_probes` failures in a row
    /// make count.
    pub fn cannot_serve(&self) -> bool {
        if self.inconclusive() {
            return false;
        }
        match self {
            ProbeError::HttpRefused { .. } => true,
            ProbeError::HttpStatus { got, .. } => *got >= 500,
            ProbeError::Tcp { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
            ),
            ProbeError::Http { source, .. } => reset_in(source),
            _ => false,
        }
    }
}

impl ProbeError {
    /// Whether this probe says nothing of the service (it timed out while this process
    /// was frozen): it neither counts as a failure nor ends a run of failures.
    pub fn inconclusive(&self) -> bool {
        matches!(self, ProbeError::Stalled { .. })
    }

    /// Whether this is a probe that got no answer in time.
    fn timed_out(&self) -> bool {
        matches!(
            self,
            ProbeError::HttpTimeout { .. } | ProbeError::TcpTimeout { .. }
        )
    }
}

/// A probe that timed out across a freeze of this process of at least this long is not
/// counted: the service did not get its time either.
const STALL_EXCUSES: Duration = Duration::from_secs(1);

/// Whether an io error of kind ConnectionReset / ConnectionRefused is in `e`'s chain.
fn reset_in(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused
            )
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Runs probes; holds the HTTP client (no proxy: probes go straight to the services).
#[derive(Debug, Clone)]
pub struct Prober {
    http: reqwest::Client,
    /// Per-attempt limit of an HTTP or TCP probe (`health.probe_timeout_s`).
    timeout: Duration,
}

impl Default for Prober {
    fn default() -> Self {
        Prober::new(TcpLiveness::default(), HealthSettings::default())
    }
}

impl Prober {
    /// A prober whose connections carry `tcp`'s keepalive and user timeout, so a pooled
    /// connection to a node that went silent is given up in seconds, not reused, and whose
    /// probes wait `health`'s probe timeout for a busy server's answer.
    pub fn new(tcp: TcpLiveness, health: HealthSettings) -> Prober {
        let timeout = health.probe_timeout();
        // Ticking from now on, so a freeze during the first probes is seen.
        crate::stall_clock::clock();
        let http = reqwest::Client::builder()
            .no_proxy()
            // A fresh connection for every probe. vLLM closes a connection idle for 5 s
            // (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`): a kept one, taken again after a freeze of
            // a few seconds, met that close as the probe went out and read as a reset,
            // which takes a service out of rotation at once (seen on two busy machines:
            // decode out for 1.5 s though it never stopped serving). On a fresh connection
            // a reset is evidence.
            .pool_max_idle_per_host(0)
            .timeout(timeout)
            .connect_timeout(timeout)
            .tcp_keepalive(tcp.keepalive_idle())
            .tcp_keepalive_interval(tcp.keepalive_interval())
            .tcp_keepalive_retries(tcp.tcp_keepalive_count)
            .tcp_user_timeout(tcp.user_timeout())
            .build()
            .expect("a plain HTTP client builds");
        Prober { http, timeout }
    }

    /// `Ok` when the probe passes, else a short reason for progress and status displays.
    /// `log_seen` says whether the log line of a `LogLine` probe appeared in this run.
    pub async fn check(&self, probe: &Probe, log_seen: &AtomicBool) -> Result<(), ProbeError> {
        let began = std::time::Instant::now();
        match self.check_once(probe, log_seen).await {
            Err(e) if e.timed_out() => {
                let stalled = crate::stall_clock::clock().stalled_since(began);
                Err(if stalled >= STALL_EXCUSES {
                    ProbeError::Stalled {
                        timed_out: Box::new(e),
                        stalled,
                    }
                } else {
                    e
                })
            }
            other => other,
        }
    }

    async fn check_once(&self, probe: &Probe, log_seen: &AtomicBool) -> Result<(), ProbeError> {
        match probe {
            Probe::Http {
                url,
                status,
                body_contains,
            } => {
                self.http_check(url, *status, body_contains.as_deref())
                    .await
            }
            Probe::Tcp { host, port } => tcp_check(host, *port, self.timeout).await,
            Probe::LogLine { contains } => {
                if log_seen.load(Ordering::Relaxed) {
                    Ok(())
                } else {
                    Err(ProbeError::NoLogLine {
                        contains: contains.clone(),
                    })
                }
            }
        }
    }

    async fn http_check(
        &self,
        url: &str,
        want: u16,
        body_contains: Option<&str>,
    ) -> Result<(), ProbeError> {
        let resp = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| describe_http_error(url, e))?;
        let got = resp.status().as_u16();
        if got != want {
            return Err(ProbeError::HttpStatus {
                url: url.to_string(),
                got,
                want,
            });
        }
        if let Some(text) = body_contains {
            let body = resp.text().await.map_err(|source| ProbeError::HttpBody {
                url: url.to_string(),
                source,
            })?;
            if !body.contains(text) {
                return Err(ProbeError::BodyLacks {
                    url: url.to_string(),
                    text: text.to_string(),
                });
            }
        }
        Ok(())
    }
}

fn describe_http_error(url: &str, source: reqwest::Error) -> ProbeError {
    let url = url.to_string();
    if source.is_timeout() {
        ProbeError::HttpTimeout { url }
    } else if source.is_connect() {
        ProbeError::HttpRefused { url }
    } else {
        ProbeError::Http { url, source }
    }
}

async fn tcp_check(host: &str, port: u16, limit: Duration) -> Result<(), ProbeError> {
    match tokio::time::timeout(limit, tokio::net::TcpStream::connect((host, port))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(source)) => Err(ProbeError::Tcp {
            host: host.to_string(),
            port,
            source,
        }),
        Err(_) => Err(ProbeError::TcpTimeout {
            host: host.to_string(),
            port,
        }),
    }
}

/// How a service on another node is checked: its own probe when that works from here,
/// a TCP connect to its main port when its probe is a log line (unreadable from here).
/// Whether `host` is a loopback address other than `node_address`: a service bound there
/// on another node answers only on that node (pdctl binds what no other node reaches to
/// loopback), so its state comes from its own node's supervisor, never from a probe here.
pub fn only_on_its_node(host: &str, node_address: Option<&str>) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    loopback && node_address != Some(host)
}

pub fn remote_probe(svc: &Service) -> Option<Probe> {
    match &svc.probe {
        Probe::LogLine { .. } => {
            crate::supervisor::run::table::main_port(svc).map(|port| Probe::Tcp {
                host: svc.host.clone(),
                port,
            })
        }
        other => Some(other.clone()),
    }
}

/// The wait before the next readiness probe, `elapsed` after the process started:
/// 50 ms for the first quarter second, then a fifth of the time waited so far (noticing
/// readiness at most 20 % late), at most 1 s.
pub fn startup_delay(elapsed: Duration) -> Duration {
    (elapsed / 5).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Whether a healthy service whose liveness probes failed `failures` times in a row, the
/// last with `why`, is to be called unhealthy (out of rotation) now: at once when the
/// failure shows it cannot serve (a refused or reset connection), else after
/// `failed_probes` failures in a row, so one slow answer of a busy engine is not enough.
pub fn unhealthy_now(failures: u32, why: &ProbeError, failed_probes: u32) -> bool {
    why.cannot_serve() || failures >= failed_probes.max(1)
}

/// Output from a starting service often means its state changed ("ready to serve"), so
/// it triggers an early probe — but not more often than this.
pub const OUTPUT_PROBE_GAP: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_services_of_other_nodes_are_not_probed_from_here() {
        assert!(only_on_its_node("127.0.0.1", Some("10.0.0.2")));
        assert!(only_on_its_node("localhost", Some("10.0.0.2")));
        assert!(only_on_its_node("::1", Some("10.0.0.2")));
        assert!(!only_on_its_node("10.0.0.2", Some("10.0.0.2")));
        // Test nodes on loopback addresses: a service at the node's own address is probed.
        assert!(!only_on_its_node("127.0.0.3", Some("127.0.0.3")));
        assert!(only_on_its_node("127.0.0.1", Some("127.0.0.3")));
    }

    #[test]
    fn a_slow_probe_needs_n_in_a_row_and_a_refused_one_counts_at_once() {
        let url = "http://h:1/health".to_string();
        let slow = ProbeError::HttpTimeout { url: url.clone() };
        assert!(!slow.cannot_serve());
        assert!(!unhealthy_now(1, &slow, 3));
        assert!(!unhealthy_now(2, &slow, 3));
        assert!(unhealthy_now(3, &slow, 3));
        // A 5xx is the service's own word that it cannot serve (vLLM's /health once its
        // engine is dead); a 4xx is not.
        let dead = ProbeError::HttpStatus {
            url: url.clone(),
            got: 503,
            want: 200,
        };
        assert!(unhealthy_now(1, &dead, 3));
        let odd = ProbeError::HttpStatus {
            url: url.clone(),
            got: 404,
            want: 200,
        };
        assert!(!unhealthy_now(1, &odd, 3));
        let refused = ProbeError::HttpRefused { url };
        assert!(unhealthy_now(1, &refused, 3));
        let tcp = ProbeError::Tcp {
            host: "h".into(),
            port: 1,
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        assert!(unhealthy_now(1, &tcp, 3));
        let tcp_slow = ProbeError::TcpTimeout {
            host: "h".into(),
            port: 1,
        };
        assert!(!unhealthy_now(1, &tcp_slow, 3));
    }

    #[test]
    fn startup_polling_starts_fast_grows_with_the_wait_and_caps_at_a_second() {
        let ms = |m| Duration::from_millis(m);
        assert_eq!(startup_delay(ms(0)), ms(50));
        assert_eq!(startup_delay(ms(200)), ms(50));
        assert_eq!(startup_delay(ms(2_000)), ms(400));
        assert_eq!(startup_delay(ms(600_000)), ms(1_000));
    }

    /// A server that answers the first request on a connection and keeps it open, and
    /// resets the connection if a second request comes on it (as vLLM's server does when
    /// the request meets its close of an idle connection).
    async fn resets_a_kept_connection() -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    if s.read(&mut buf).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    let _ = s.write_all(ok.as_bytes()).await;
                    if s.read(&mut buf).await.unwrap_or(0) > 0 {
                        let _ = s.set_zero_linger();
                    }
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn each_probe_has_a_fresh_connection_so_a_closed_kept_one_is_no_reset() {
        let port = resets_a_kept_connection().await;
        let p = Prober::default();
        let seen = AtomicBool::new(false);
        let probe = Probe::Http {
            url: format!("http://127.0.0.1:{port}/health"),
            status: 200,
            body_contains: None,
        };
        for n in 1..=3 {
            let r = p.check(&probe, &seen).await;
            assert!(r.is_ok(), "probe {n}: {}", r.unwrap_err());
        }
    }

    #[tokio::test]
    async fn tcp_and_http_probes_pass_and_fail_for_the_right_reasons() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let body = "{\"health\":\"true\"}";
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        let p = Prober::default();
        let seen = AtomicBool::new(false);
        let url = format!("http://127.0.0.1:{port}/health");
        let http = |status, body: Option<&str>| Probe::Http {
            url: url.clone(),
            status,
            body_contains: body.map(String::from),
        };
        assert_eq!(
            p.check(&http(200, Some("true")), &seen)
                .await
                .map_err(|e| e.to_string()),
            Ok(())
        );
        let wrong = p
            .check(&http(204, None), &seen)
            .await
            .unwrap_err()
            .to_string();
        assert!(wrong.contains("answered 200, expected 204"), "{wrong}");
        let lacks = p
            .check(&http(200, Some("false")), &seen)
            .await
            .unwrap_err()
            .to_string();
        assert!(lacks.contains("lacks"), "{lacks}");
        let tcp = Probe::Tcp {
            host: "127.0.0.1".into(),
            port,
        };
        assert_eq!(
            p.check(&tcp, &seen).await.map_err(|e| e.to_string()),
            Ok(())
        );
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_port = closed.local_addr().unwrap().port();
        drop(closed);
        let dead = Probe::Tcp {
            host: "127.0.0.1".into(),
            port: dead_port,
        };
        assert!(p.check(&dead, &seen).await.is_err());
        let line = Probe::LogLine {
            contains: "ready".into(),
        };
        assert!(p.check(&line, &seen).await.is_err());
        seen.store(true, Ordering::Relaxed);
        assert_eq!(
            p.check(&line, &seen).await.map_err(|e| e.to_string()),
            Ok(())
        );
    }
}
