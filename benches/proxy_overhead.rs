//! The proxy's added latency and its throughput.
//!
//! Starts engines (`pdctl sim` processes; see `support/engines.rs`): a prefill with every
//! latency at zero, and decodes streaming 16-token completions. A release `pdctl proxy`
//! (two-step protocol) runs in front of them and a load generator keeps N streams in
//! flight. Direct and proxied requests are measured side by side in one run. A proxied
//! request costs a prefill leg plus the decode leg, so the "added" figures are everything
//! the proxy adds to a PD request.
//!
//! 1. Latency: decode paces its tokens 10 ms apart (the simulator's default inter-token
//!    latency); each stream alternates direct and proxied requests: time to first chunk.
//! 2. Throughput: a zero-latency decode, 64 streams in a closed loop, alternating rounds
//!    of direct-only and proxied-only traffic: completed requests per second.
//!
//! Run: `cargo bench --bench proxy_overhead`. PROXY_BENCH_SECS=N sets seconds per round
//! (default 2); PROXY_BENCH_ENGINE=inline uses a minimal in-bench server instead of sims;
//! PROXY_BENCH_LOG=warn quiets the proxy's per-request log line; PROXY_BENCH_WORKERS=N runs
//! the proxy with N runtime worker threads.

#[path = "support/engines.rs"]
mod engines;

use engines::{CHUNKS, PACED_ITL};
use futures_util::StreamExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CONCURRENCY: [usize; 3] = [1, 64, 512];
const ROUNDS: usize = 2;
const THROUGHPUT_STREAMS: usize = 64;

struct Proxy(std::process::Child);
impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The 1-minute load average, to put the figures in context.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// CPU time (user + system) the process has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    // Linux reports in USER_HZ, 100 per second on every mainstream configuration.
    Duration::from_millis(ticks * 10)
}

fn start_proxy(prefill: u16, decode: u16) -> (Proxy, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = std::env::var("PROXY_BENCH_LOG").unwrap_or_else(|_| "info".into());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdctl"));
    if let Ok(n) = std::env::var("PROXY_BENCH_WORKERS") {
        cmd.env("TOKIO_WORKER_THREADS", n);
    }
    let child = cmd
        .args(["proxy", "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prefill", &format!("127.0.0.1:{prefill}")])
        .args(["--decode", &format!("127.0.0.1:{decode}")])
        .env("RUST_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pdctl proxy (release)");
    let url = format!("http://127.0.0.1:{port}");
    let end = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < end, "the proxy did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (Proxy(child), url)
}

/// One request's timings.
#[derive(Clone, Copy)]
struct Sample {
    ttft: Duration,
    total: Duration,
}

/// Keeps `streams` requests in flight for `secs`, each stream cycling through `targets`
/// request by request (so every target is measured under the same conditions); returns
/// the timings per target.
async fn load(
    client: &reqwest::Client,
    targets: &[&str],
    streams: usize,
    secs: f64,
) -> Vec<Vec<Sample>> {
    let body = format!(
        r#"{{"model":"sim-model","prompt":"San Francisco is a","max_tokens":{CHUNKS},"stream":true}}"#
    );
    let body = Arc::new(body);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let urls: Arc<Vec<String>> = Arc::new(
        targets
            .iter()
            .map(|t| format!("{t}/v1/completions"))
            .collect(),
    );
    let mut tasks = Vec::new();
    for k in 0..streams {
        let (client, urls, body) = (client.clone(), urls.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat: Vec<Vec<Sample>> = vec![Vec::new(); urls.len()];
            let mut i = k;
            while Instant::now() < end {
                let which = i % urls.len();
                i += 1;
                let t = Instant::now();
                let resp = client
                    .post(urls[which].as_str())
                    .header("content-type", "application/json")
                    .body(body.as_str().to_owned())
                    .send()
                    .await
                    .expect("request");
                assert_eq!(resp.status(), 200);
                let mut stream = resp.bytes_stream();
                let mut ttft = None;
                let mut tail = Vec::new();
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.expect("body");
                    ttft.get_or_insert_with(|| t.elapsed());
                    tail = chunk.to_vec();
                }
                assert!(tail.ends_with(b"data: [DONE]\n\n"));
                lat[which].push(Sample {
                    ttft: ttft.expect("a first chunk"),
                    total: t.elapsed(),
                });
            }
            lat
        }));
    }
    let mut all: Vec<Vec<Sample>> = vec![Vec::new(); targets.len()];
    for t in tasks {
        for (i, v) in t.await.unwrap().into_iter().enumerate() {
            all[i].extend(v);
        }
    }
    all
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// p50 and p99 of one timing over samples, in ms.
fn p50_p99(samples: &[Sample], pick: fn(&Sample) -> Duration) -> (f64, f64) {
    let mut v: Vec<Duration> = samples.iter().map(pick).collect();
    v.sort();
    (pct(&v, 0.5), pct(&v, 0.99))
}

/// (sum, count) of the proxy's prefill-leg duration histogram.
async fn prefill_histogram(client: &reqwest::Client, proxy: &str) -> (f64, f64) {
    let text = client
        .get(format!("{proxy}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        value("pdctl_proxy_prefill_duration_seconds_sum"),
        value("pdctl_proxy_prefill_duration_seconds_count"),
    )
}

/// What alternating direct / proxied rounds at one concurrency measured.
struct Rounds {
    direct: Vec<Sample>,
    proxied: Vec<Sample>,
    /// The proxy process's CPU time per proxied request, in microseconds.
    proxy_cpu_us: f64,
    /// Mean duration of the prefill leg as the proxy measured it, in ms.
    prefill_leg_ms: f64,
}

/// Direct and proxied requests at one concurrency. `interleaved`: every stream alternates
/// direct and proxied requests (latency: both see the same machine at the same moment);
/// otherwise alternating rounds of only direct, then only proxied (throughput).
async fn side_by_side(
    client: &reqwest::Client,
    direct: &str,
    proxy: &(Proxy, String),
    streams: usize,
    secs: f64,
    interleaved: bool,
) -> Rounds {
    let proxied = proxy.1.as_str();
    let pid = proxy.0.0.id();
    // Warm the connection pools of both paths.
    load(client, &[direct, proxied], streams, 0.3).await;
    let (mut d, mut p) = (Vec::new(), Vec::new());
    let (sum0, n0) = prefill_histogram(client, proxied).await;
    let before = cpu_time(pid);
    let mut proxy_cpu = Duration::ZERO;
    if interleaved {
        let mut r = load(client, &[direct, proxied], streams, secs * ROUNDS as f64).await;
        p = r.pop().unwrap();
        d = r.pop().unwrap();
        proxy_cpu = cpu_time(pid) - before;
    } else {
        for _ in 0..ROUNDS {
            d.extend(load(client, &[direct], streams, secs).await.remove(0));
            let before = cpu_time(pid);
            p.extend(load(client, &[proxied], streams, secs).await.remove(0));
            proxy_cpu += cpu_time(pid) - before;
        }
    }
    let (sum1, n1) = prefill_histogram(client, proxied).await;
    Rounds {
        prefill_leg_ms: (sum1 - sum0) * 1e3 / (n1 - n0).max(1.0),
        proxy_cpu_us: proxy_cpu.as_secs_f64() * 1e6 / p.len().max(1) as f64,
        direct: d,
        proxied: p,
    }
}

fn main() {
    let secs: f64 = std::env::var("PROXY_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let kind = engines::Kind::from_env();
    let engines_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let prefill_engine = engines::start(kind, &engines_rt, "prefill", false);
    let paced_engine = engines::start(kind, &engines_rt, "decode", true);
    let instant_engine = engines::start(kind, &engines_rt, "decode", false);
    let (prefill, paced_decode, instant_decode) =
        (prefill_engine.port, paced_engine.port, instant_engine.port);
    let paced_proxy = start_proxy(prefill, paced_decode);
    let instant_proxy = start_proxy(prefill, instant_decode);
    println!(
        "Engines: {}; load average at start: {}",
        kind.describe(),
        load_average()
    );
    println!();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .no_proxy()
        .build()
        .unwrap();
    println!(
        "Latency: decode streams {CHUNKS} tokens, one every {PACED_ITL:?}; each stream alternates direct and proxied requests for {} s",
        secs * ROUNDS as f64
    );
    println!();
    println!(
        "| streams | TTFT direct p50 | TTFT proxied p50 | **added p50** | TTFT direct p99 | TTFT proxied p99 | **added p99** | of which prefill leg (mean) | proxy CPU per request |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let direct = format!("http://127.0.0.1:{paced_decode}");
    for streams in CONCURRENCY {
        let r = client_rt.block_on(side_by_side(
            &client,
            &direct,
            &paced_proxy,
            streams,
            secs,
            true,
        ));
        let (d50, d99) = p50_p99(&r.direct, |s| s.ttft);
        let (p50, p99) = p50_p99(&r.proxied, |s| s.ttft);
        println!(
            "| {streams} | {d50:.3} ms | {p50:.3} ms | **{:.3} ms** | {d99:.3} ms | {p99:.3} ms | **{:.3} ms** | {:.3} ms | {:.0} µs |",
            p50 - d50,
            p99 - d99,
            r.prefill_leg_ms,
            r.proxy_cpu_us,
        );
    }
    println!();
    println!(
        "Throughput: zero-latency decode, {THROUGHPUT_STREAMS} streams in a closed loop, {ROUNDS} alternating rounds of {secs} s per path"
    );
    println!();
    println!("| path | requests/s | end-to-end p50 | end-to-end p99 | proxy CPU per request |");
    println!("|---|---:|---:|---:|---:|");
    let direct = format!("http://127.0.0.1:{instant_decode}");
    let r = client_rt.block_on(side_by_side(
        &client,
        &direct,
        &instant_proxy,
        THROUGHPUT_STREAMS,
        secs,
        false,
    ));
    let total = secs * ROUNDS as f64;
    let rows = [
        ("direct to decode", &r.direct, "-".to_string()),
        (
            "through the proxy (prefill + decode legs)",
            &r.proxied,
            format!("{:.0} µs", r.proxy_cpu_us),
        ),
    ];
    for (name, samples, cpu) in rows {
        let (e50, e99) = p50_p99(samples, |s| s.total);
        println!(
            "| {name} | {:.0} | {e50:.3} ms | {e99:.3} ms | {cpu} |",
            samples.len() as f64 / total
        );
    }
}
