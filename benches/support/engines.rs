//! The engines the proxy benchmark talks to: `pdctl sim` processes (the default), or a
//! minimal axum server inside the bench (`PROXY_BENCH_ENGINE=inline`), which costs less CPU
//! per request and so leaves more of a small machine to the proxy.

use axum::Router;
use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Tokens (stream chunks) of every benchmark completion.
pub const CHUNKS: usize = 16;
/// Time between the chunks of a paced decode stream (the simulator's default ITL).
pub const PACED_ITL: Duration = Duration::from_millis(10);

/// A running engine: its port, and its process when it is one (killed on drop).
pub struct Engine {
    pub port: u16,
    child: Option<Child>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Which engines to run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Sim,
    Inline,
}

impl Kind {
    /// From PROXY_BENCH_ENGINE (`sim`, the default, or `inline`).
    pub fn from_env() -> Kind {
        match std::env::var("PROXY_BENCH_ENGINE").as_deref() {
            Ok("inline") => Kind::Inline,
            _ => Kind::Sim,
        }
    }

    /// What the table header says.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Sim => "`pdctl sim` processes",
            Kind::Inline => "a minimal axum server inside the bench",
        }
    }
}

/// Starts an engine: a prefill, a decode pacing its tokens PACED_ITL apart, or a decode
/// with every latency at zero.
pub fn start(kind: Kind, rt: &tokio::runtime::Runtime, role: &str, paced: bool) -> Engine {
    match kind {
        Kind::Inline => Engine {
            port: start_inline(rt, paced),
            child: None,
        },
        Kind::Sim => start_sim(role, paced),
    }
}

/// A port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_sim(role: &str, paced: bool) -> Engine {
    let port = free_port();
    let itl = if paced {
        PACED_ITL.as_millis().to_string()
    } else {
        "0".into()
    };
    let child = Command::new(env!("CARGO_BIN_EXE_pdctl"))
        .args([
            "sim",
            "--port",
            &port.to_string(),
            "--role",
            role,
            "--handoff",
            "none",
        ])
        .args([
            "--itl-ms",
            &itl,
            "--overhead-ms",
            "0",
            "--prefill-ms-per-token",
            "0",
        ])
        .args(["--batch-slowdown", "0", "--log-stats-interval-ms", "0"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pdctl sim (release)");
    let engine = Engine {
        port,
        child: Some(child),
    };
    wait_listening(port, "pdctl sim");
    engine
}

/// Waits (at most 20 s) until something listens on loopback `port`.
pub fn wait_listening(port: u16, what: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < end, "{what} did not start on port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const STREAM_BODY: &str = concat!(
    "data: {\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" b\",\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" c\",\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" d\",\"finish_reason\":\"length\"}]}\n\n",
    "data: [DONE]\n\n",
);
const FULL_BODY: &str = "{\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,\"total_tokens\":9}}";

async fn completions(body: axum::body::Bytes) -> Response {
    // The prefill leg asks for stream=false; everything else streams.
    let stream = !body.windows(14).any(|w| w == b"\"stream\":false");
    let (ct, text) = if stream {
        ("text/event-stream", STREAM_BODY)
    } else {
        ("application/json", FULL_BODY)
    };
    Response::builder()
        .header(header::CONTENT_TYPE, ct)
        .body(Body::from(text))
        .unwrap()
}

/// The `max_tokens` of a benchmark request body (written by the bench without spaces).
fn max_tokens(body: &[u8]) -> usize {
    const KEY: &[u8] = b"\"max_tokens\":";
    body.windows(KEY.len())
        .position(|w| w == KEY)
        .map(|at| {
            body[at + KEY.len()..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .fold(0, |n, d| n * 10 + usize::from(d - b'0'))
        })
        .unwrap_or(CHUNKS)
}

/// A decode stream paced like a real engine: a chunk at once, then one every PACED_ITL,
/// `max_tokens` chunks in all, then `data: [DONE]`.
async fn paced(body: axum::body::Bytes) -> Response {
    if body.windows(14).any(|w| w == b"\"stream\":false") {
        return completions(body).await;
    }
    let tokens = max_tokens(&body);
    let chunk = "data: {\"id\":\"b\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":null}]}\n\n";
    let stream = futures_util::stream::unfold(0usize, move |i| async move {
        if i > tokens {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(PACED_ITL).await;
        }
        let bytes = if i == tokens {
            "data: [DONE]\n\n"
        } else {
            chunk
        };
        Some((Ok::<_, std::convert::Infallible>(bytes), i + 1))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn engine(paced_decode: bool) -> Router {
    let r = if paced_decode {
        Router::new().route("/v1/completions", post(paced))
    } else {
        Router::new().route("/v1/completions", post(completions))
    };
    r.route("/health", get(|| async { "ok" }))
}

/// Starts an engine; returns its port.
fn start_inline(rt: &tokio::runtime::Runtime, paced_decode: bool) -> u16 {
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let l = l.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(l, engine(paced_decode)).await.unwrap() });
        port
    })
}
