//! The proxy's added latency, its throughput, and its CPU cost per request and per relayed
//! stream chunk.
//!
//! Starts engines (`pdctl sim` processes; see `support/engines.rs`): a prefill with every
//! latency at zero, and decodes streaming completions. A release `pdctl proxy` (two-step
//! protocol) runs in front of them and a load generator keeps N streams in flight. Direct
//! and proxied requests are measured side by side in one run. A proxied request costs a
//! prefill leg plus the decode leg, so the "added" figures are everything the proxy adds to
//! a PD request.
//!
//! 1. Latency: decode paces its tokens 10 ms apart (the simulator's default inter-token
//!    latency); each stream alternates direct and proxied requests: time to first chunk.
//! 2. Throughput: a zero-latency decode, 64 streams in a closed loop, alternating rounds
//!    of direct-only and proxied-only traffic: completed requests per second.
//! 3. CPU cost: paced decode, 64 streams through the proxy, completions of 16 and of 64
//!    tokens: the proxy's CPU time per request at each length gives its cost per relayed
//!    chunk (the difference over the extra chunks) and per request (the rest).
//!
//! Run: `cargo bench --bench proxy_overhead`. PROXY_BENCH_SECS=N sets seconds per round
//! (default 2); PROXY_BENCH_ENGINE=inline uses a minimal in-bench server instead of sims;
//! PROXY_BENCH_LOG=warn quiets the proxy's per-request log line; PROXY_BENCH_WORKERS=N runs
//! the proxy with N runtime worker threads; PROXY_BENCH_BASELINE=/path/to/pdctl runs a
//! second proxy from that binary side by side (same engines, same streams, alternating
//! request by request) and reports it on its own rows.

#[path = "support/engines.rs"]
mod engines;
#[path = "support/proxies.rs"]
mod proxies;

use engines::{CHUNKS, PACED_ITL};
use futures_util::StreamExt;
use proxies::{CpuTime, ProxyUnderTest};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CONCURRENCY: [usize; 3] = [1, 64, 512];
const ROUNDS: usize = 2;
const THROUGHPUT_STREAMS: usize = 64;
const COST_STREAMS: usize = 64;
/// Completion lengths of the CPU cost phase: the short one is the latency phase's.
const COST_LENGTHS: [usize; 2] = [CHUNKS, 64];

/// The 1-minute load average, to put the figures in context.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// One request's timings.
#[derive(Clone, Copy)]
struct Sample {
    ttft: Duration,
    total: Duration,
    /// Body chunks the client received (one per relayed SSE event when they are paced).
    chunks: usize,
}

/// Keeps `streams` requests of `tokens` tokens in flight for `secs`, each stream cycling
/// through `targets` request by request (so every target is measured under the same
/// conditions); returns the timings per target.
async fn load(
    client: &reqwest::Client,
    targets: &[&str],
    streams: usize,
    secs: f64,
    tokens: usize,
) -> Vec<Vec<Sample>> {
    let body = format!(
        r#"{{"model":"sim-model","prompt":"San Francisco is a","max_tokens":{tokens},"stream":true}}"#
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
                let mut chunks = 0;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.expect("body");
                    ttft.get_or_insert_with(|| t.elapsed());
                    chunks += 1;
                    tail = chunk.to_vec();
                }
                assert!(tail.ends_with(b"data: [DONE]\n\n"));
                lat[which].push(Sample {
                    ttft: ttft.expect("a first chunk"),
                    total: t.elapsed(),
                    chunks,
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

/// Mean of one timing over samples, in ms.
fn mean_ms(samples: &[Sample], pick: fn(&Sample) -> Duration) -> f64 {
    samples.iter().map(|s| pick(s).as_secs_f64()).sum::<f64>() * 1e3 / samples.len().max(1) as f64
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

/// The proxy's own stage histograms (sum in seconds, count), read from its /metrics.
#[derive(Clone, Copy, Default)]
struct Stages {
    /// Prefill leg: sent until its answer was complete.
    prefill: (f64, f64),
    /// Decode leg: sent until its first byte.
    decode_first_byte: (f64, f64),
    /// Client request received until its first byte went out.
    ttft: (f64, f64),
}

impl Stages {
    async fn read(client: &reqwest::Client, proxy: &str) -> Stages {
        let text = client
            .get(format!("{proxy}/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        let value = |name: &str| pdctl::prometheus::sum(&text, &[name]).unwrap_or(0.0);
        let histogram = |name: &str| {
            (
                value(&format!("pdctl_proxy_{name}_sum")),
                value(&format!("pdctl_proxy_{name}_count")),
            )
        };
        Stages {
            prefill: histogram("prefill_duration_seconds"),
            decode_first_byte: histogram("decode_ttft_seconds"),
            ttft: histogram("ttft_seconds"),
        }
    }

    /// Mean duration of each stage between `earlier` and `self`, in ms.
    fn means_since(self, earlier: Stages) -> StageMeans {
        let mean =
            |(s1, n1): (f64, f64), (s0, n0): (f64, f64)| (s1 - s0) * 1e3 / (n1 - n0).max(1.0);
        StageMeans {
            prefill: mean(self.prefill, earlier.prefill),
            decode_first_byte: mean(self.decode_first_byte, earlier.decode_first_byte),
            ttft: mean(self.ttft, earlier.ttft),
        }
    }
}

/// Mean stage durations as the proxy measured them, in ms.
#[derive(Clone, Copy, Default)]
struct StageMeans {
    prefill: f64,
    decode_first_byte: f64,
    ttft: f64,
}

/// What one proxy served during a measurement.
struct Served {
    samples: Vec<Sample>,
    cpu: CpuTime,
    /// Mean stage durations as the proxy measured them.
    stages: StageMeans,
}

impl Served {
    /// The proxy's CPU time per request it served, in microseconds.
    fn cpu_per_request_us(&self) -> f64 {
        self.cpu.total.as_secs_f64() * 1e6 / self.samples.len().max(1) as f64
    }

    /// Mean body chunks per request.
    fn chunks_per_request(&self) -> f64 {
        self.samples.iter().map(|s| s.chunks).sum::<usize>() as f64
            / self.samples.len().max(1) as f64
    }
}

/// Every stream cycles through direct (when given) and every proxy, request by request,
/// for `secs`: all targets see the same machine at the same moment. Returns the direct
/// samples and what each proxy served.
async fn interleaved(
    client: &reqwest::Client,
    direct: Option<&str>,
    proxies: &[ProxyUnderTest],
    streams: usize,
    secs: f64,
    tokens: usize,
) -> (Vec<Sample>, Vec<Served>) {
    let mut targets: Vec<&str> = direct.into_iter().collect();
    targets.extend(proxies.iter().map(|p| p.url.as_str()));
    // Warm the connection pools of every path.
    load(client, &targets, streams, 0.3, tokens).await;
    let mut before = Vec::new();
    for p in proxies {
        before.push((Stages::read(client, &p.url).await, p.cpu()));
    }
    let mut results = load(client, &targets, streams, secs, tokens).await;
    let cpu_after: Vec<CpuTime> = proxies.iter().map(ProxyUnderTest::cpu).collect();
    let direct_samples = if direct.is_some() {
        results.remove(0)
    } else {
        Vec::new()
    };
    let mut served = Vec::new();
    for ((p, samples), ((stages0, cpu0), cpu1)) in proxies
        .iter()
        .zip(results)
        .zip(before.into_iter().zip(cpu_after))
    {
        let stages = Stages::read(client, &p.url).await.means_since(stages0);
        served.push(Served {
            samples,
            cpu: cpu1.since(cpu0),
            stages,
        });
    }
    (direct_samples, served)
}

/// Alternating rounds of direct-only, then each proxy alone (throughput: each path gets
/// the whole machine in its rounds).
async fn in_rounds(
    client: &reqwest::Client,
    direct: &str,
    proxies: &[ProxyUnderTest],
    streams: usize,
    secs: f64,
) -> (Vec<Sample>, Vec<Served>) {
    let mut targets = vec![direct];
    targets.extend(proxies.iter().map(|p| p.url.as_str()));
    load(client, &targets, streams, 0.3, CHUNKS).await;
    let mut direct_samples = Vec::new();
    let mut served: Vec<Served> = proxies
        .iter()
        .map(|_| Served {
            samples: Vec::new(),
            cpu: CpuTime::default(),
            stages: StageMeans::default(),
        })
        .collect();
    for _ in 0..ROUNDS {
        direct_samples.extend(
            load(client, &[direct], streams, secs, CHUNKS)
                .await
                .remove(0),
        );
        for (p, s) in proxies.iter().zip(served.iter_mut()) {
            let before = p.cpu();
            let r = load(client, &[p.url.as_str()], streams, secs, CHUNKS).await;
            s.cpu = s.cpu.plus(p.cpu().since(before));
            s.samples.extend(r.into_iter().next().unwrap());
        }
    }
    (direct_samples, served)
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
    let binaries = proxies::binaries();
    let paced_proxies: Vec<ProxyUnderTest> = binaries
        .iter()
        .map(|(label, bin)| proxies::start(label, bin, prefill, paced_decode))
        .collect();
    let instant_proxies: Vec<ProxyUnderTest> = binaries
        .iter()
        .map(|(label, bin)| proxies::start(label, bin, prefill, instant_decode))
        .collect();
    println!(
        "Engines: {}; proxies: {}; load average at start: {}",
        kind.describe(),
        binaries
            .iter()
            .map(|(l, b)| format!("{l} ({b})"))
            .collect::<Vec<_>>()
            .join(", "),
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
        "| streams | proxy | TTFT direct p50 | TTFT proxied p50 | **added p50** | TTFT direct p99 | TTFT proxied p99 | **added p99** | of which prefill leg (mean) | proxy CPU per request |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let direct = format!("http://127.0.0.1:{paced_decode}");
    let mut breakdown = Vec::new();
    for streams in CONCURRENCY {
        let (d, served) = client_rt.block_on(interleaved(
            &client,
            Some(&direct),
            &paced_proxies,
            streams,
            secs * ROUNDS as f64,
            CHUNKS,
        ));
        let (d50, d99) = p50_p99(&d, |s| s.ttft);
        for (p, s) in paced_proxies.iter().zip(&served) {
            let (p50, p99) = p50_p99(&s.samples, |s| s.ttft);
            println!(
                "| {streams} | {} | {d50:.3} ms | {p50:.3} ms | **{:.3} ms** | {d99:.3} ms | {p99:.3} ms | **{:.3} ms** | {:.3} ms | {:.0} µs |",
                p.label,
                p50 - d50,
                p99 - d99,
                s.stages.prefill,
                s.cpu_per_request_us(),
            );
            let direct_mean = mean_ms(&d, |s| s.ttft);
            let added = mean_ms(&s.samples, |s| s.ttft) - direct_mean;
            let st = s.stages;
            let inside = st.ttft - st.prefill - st.decode_first_byte;
            breakdown.push(format!(
                "| {streams} | {} | {added:.3} ms | {:.3} ms | {:.3} ms | {inside:.3} ms | {:.3} ms |",
                p.label,
                st.prefill,
                st.decode_first_byte - direct_mean,
                added - st.ttft + direct_mean,
            ));
        }
    }
    println!();
    println!(
        "Where the added TTFT goes (means over the same requests): the proxy's own histograms split it into the prefill leg, decode's first byte as the proxy waited for it minus the direct TTFT, the proxy's time outside both legs (its TTFT minus them), and the rest, outside the proxy (the client <-> proxy hops)"
    );
    println!();
    println!(
        "| streams | proxy | added (mean) | prefill leg | decode first byte minus direct | in the proxy, outside the legs | client <-> proxy hops |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for row in breakdown {
        println!("{row}");
    }
    println!();

    println!(
        "Throughput: zero-latency decode, {THROUGHPUT_STREAMS} streams in a closed loop, {ROUNDS} alternating rounds of {secs} s per path"
    );
    println!();
    println!("| path | requests/s | end-to-end p50 | end-to-end p99 | proxy CPU per request |");
    println!("|---|---:|---:|---:|---:|");
    let direct = format!("http://127.0.0.1:{instant_decode}");
    let (d, served) = client_rt.block_on(in_rounds(
        &client,
        &direct,
        &instant_proxies,
        THROUGHPUT_STREAMS,
        secs,
    ));
    let total = secs * ROUNDS as f64;
    let mut rows = vec![("direct to decode".to_string(), &d, "-".to_string())];
    for (p, s) in instant_proxies.iter().zip(&served) {
        rows.push((
            format!("through the proxy, {} (prefill + decode legs)", p.label),
            &s.samples,
            format!("{:.0} µs", s.cpu_per_request_us()),
        ));
    }
    for (name, samples, cpu) in rows {
        let (e50, e99) = p50_p99(samples, |s| s.total);
        println!(
            "| {name} | {:.0} | {e50:.3} ms | {e99:.3} ms | {cpu} |",
            samples.len() as f64 / total
        );
    }
    println!();

    let [short, long] = COST_LENGTHS;
    println!(
        "CPU cost: decode paces tokens {PACED_ITL:?} apart, {COST_STREAMS} streams through the proxy for {} s per length; per chunk = the difference between {long}- and {short}-token completions over the extra chunks",
        secs * ROUNDS as f64
    );
    println!();
    println!(
        "| proxy | CPU per request ({short} tokens) | CPU per request ({long} tokens) | chunks per request | **CPU per chunk** | **CPU per request without chunks** | kernel share |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let runs: Vec<Vec<Served>> = COST_LENGTHS
        .iter()
        .map(|&tokens| {
            client_rt
                .block_on(interleaved(
                    &client,
                    None,
                    &paced_proxies,
                    COST_STREAMS,
                    secs * ROUNDS as f64,
                    tokens,
                ))
                .1
        })
        .collect();
    for (i, p) in paced_proxies.iter().enumerate() {
        let (a, b) = (&runs[0][i], &runs[1][i]);
        let extra_chunks = b.chunks_per_request() - a.chunks_per_request();
        assert!(
            extra_chunks > 1.0,
            "the longer completions brought no more chunks ({:.1} vs {:.1}): the engine ignores max_tokens",
            b.chunks_per_request(),
            a.chunks_per_request()
        );
        let per_chunk = (b.cpu_per_request_us() - a.cpu_per_request_us()) / extra_chunks;
        let fixed = a.cpu_per_request_us() - per_chunk * a.chunks_per_request();
        println!(
            "| {} | {:.0} µs | {:.0} µs | {:.1} / {:.1} | **{per_chunk:.1} µs** | **{fixed:.0} µs** | {:.0} % |",
            p.label,
            a.cpu_per_request_us(),
            b.cpu_per_request_us(),
            a.chunks_per_request(),
            b.chunks_per_request(),
            a.cpu.plus(b.cpu).system_percent(),
        );
    }
    println!();
    println!("Load average at the end: {}", load_average());
}
