//! The simulated engine (`pdctl sim`): a stand-in for `vllm serve` that speaks vLLM's
//! OpenAI-compatible HTTP surface with a deterministic tokenizer and output, a latency
//! model, a block-hash prefix cache, KV handoffs between a prefill and a decode sim, and
//! fault injection. It says it is a simulator everywhere it can.
//!
//! Layout: [`args`] (its settings: flags and `--config FILE`), [`server`] (routes), [`openai`] (request/answer
//! shapes), [`completion`] / [`stream`] / [`job`] (one request), [`engine`] (shared
//! state, scheduler, latency), [`tokenizer`], [`generate`], [`cache`], [`handoff`],
//! [`metrics`], [`faults`].

pub mod cache;
pub mod completion;
pub mod engine;
pub mod faults;
pub mod generate;
pub mod handoff;
pub mod job;
pub mod metrics;
pub mod openai;
pub mod server;
pub mod stream;
pub mod tokenizer;

use crate::child_config::sim::SimArgs;
use crate::spelling::value_name;
use crate::vocab::{SimHandoff, SimRole};
use anyhow::Context;
use axum::serve::ListenerExt;
use engine::Sim;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// A `pdctl sim` command line that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum SimConfigError {
    #[error("--{flag} must be a finite number >= 0, got {value}")]
    BadLatency { flag: &'static str, value: f64 },
    #[error("--{flag} must be at least 1")]
    Zero { flag: &'static str },
    #[error(
        "--handoff shared-dir needs --kv-dir DIR: a directory both the prefill and the decode sim can read"
    )]
    NoKvDir,
    #[error("--kv-dir {dir}: cannot create it: {source}")]
    KvDir { dir: String, source: std::io::Error },
    #[error(
        "--handoff mooncake on a prefill sim needs --bootstrap-port PORT (the proxy sends decodes there)"
    )]
    NoBootstrapPort,
    #[error("--bootstrap-port is only used with --handoff mooncake (this sim runs --handoff {0})")]
    StrayBootstrapPort(String),
    #[error(
        "--instances {0} takes neither --bootstrap-port nor --instance: run one sim per prefill with its own bootstrap port and name"
    )]
    InstancesWith(u16),
    #[error(
        "--instances {n} from --port {port} runs past port 65535: pick a lower --port or fewer --instances"
    )]
    InstancesPastPorts { n: u16, port: u16 },
}

/// Checks a command line before anything starts.
pub fn check(args: &SimArgs) -> Result<(), SimConfigError> {
    let m = &args.model_params;
    for (flag, value) in [
        ("prefill-ms-per-token", m.prefill_ms_per_token),
        ("overhead-ms", m.overhead_ms),
        ("itl-ms", m.itl_ms),
        ("batch-slowdown", m.batch_slowdown),
        ("kv-load-ms-per-token", m.kv_load_ms_per_token),
    ] {
        if !value.is_finite() || value < 0.0 {
            return Err(SimConfigError::BadLatency { flag, value });
        }
    }
    for (flag, value) in [
        ("max-model-len", m.max_model_len),
        ("block-size", m.block_size),
        ("max-num-seqs", m.max_num_seqs),
    ] {
        if value == 0 {
            return Err(SimConfigError::Zero { flag });
        }
    }
    match (args.handoff, args.bootstrap_port) {
        (SimHandoff::Mooncake, None) if args.role == SimRole::Prefill => {
            return Err(SimConfigError::NoBootstrapPort);
        }
        (h, Some(_)) if h != SimHandoff::Mooncake => {
            return Err(SimConfigError::StrayBootstrapPort(value_name(h)));
        }
        _ => {}
    }
    if args.instances == 0 {
        return Err(SimConfigError::Zero { flag: "instances" });
    }
    if args.instances > 1 {
        if args.bootstrap_port.is_some() || args.instance.is_some() {
            return Err(SimConfigError::InstancesWith(args.instances));
        }
        if args.port != 0 && args.port.checked_add(args.instances - 1).is_none() {
            return Err(SimConfigError::InstancesPastPorts {
                n: args.instances,
                port: args.port,
            });
        }
    }
    if args.handoff == SimHandoff::SharedDir {
        let dir = args.kv_dir.as_ref().ok_or(SimConfigError::NoKvDir)?;
        std::fs::create_dir_all(dir).map_err(|source| SimConfigError::KvDir {
            dir: dir.display().to_string(),
            source,
        })?;
    }
    Ok(())
}

async fn bind(host: &str, port: u16, what: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| format!("cannot listen on {host}:{port} for the {what} (is the port in use? pick another with --port / --bootstrap-port)"))
}

/// Runs the simulator (`--instances` of it) until SIGINT or SIGTERM.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    check(&args)?;
    if args.instances == 1 {
        return serve(args).await;
    }
    let mut all = tokio::task::JoinSet::new();
    for i in 0..args.instances {
        let port = if args.port == 0 { 0 } else { args.port + i };
        all.spawn(serve(SimArgs {
            port,
            instances: 1,
            ..args.clone()
        }));
    }
    // One that stops (a port taken, a signal) stops the process.
    match all.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(anyhow::anyhow!("a simulated instance failed: {e}")),
        None => Ok(()),
    }
}

/// Serves one simulated instance until SIGINT or SIGTERM.
async fn serve(args: SimArgs) -> anyhow::Result<()> {
    let listener = bind(&args.host, args.port, "OpenAI API").await?;
    let port = listener.local_addr()?.port();
    let bootstrap = match args.bootstrap_port {
        Some(p) => Some(bind(&args.host, p, "mooncake bootstrap server").await?),
        None => None,
    };
    let sim = Arc::new(Sim::new(SimArgs { port, ..args }));
    let a = &sim.args;
    tracing::info!(
        "pdctl-sim {}: a SIMULATED engine, not vLLM (no model weights, no GPU). model {}, role {}, handoff {}, engine id {}",
        env!("CARGO_PKG_VERSION"),
        a.model,
        value_name(a.role),
        value_name(a.handoff),
        sim.engine_id
    );
    let startup = a.model_params.startup_ms;
    let url = format!("http://{}:{port}", a.host);
    if startup > 0 {
        tracing::info!("loading the simulated model: /health answers 503 for {startup} ms");
        let s = sim.clone();
        let u = url.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(startup)).await;
            tracing::info!("ready: serving {} on {u}", s.args.model);
        });
    } else {
        tracing::info!("ready: serving {} on {url}", a.model);
    }
    if let Some(l) = bootstrap {
        tracing::info!("mooncake bootstrap server on {}", l.local_addr()?);
        let router = handoff::mooncake::bootstrap_router(sim.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l.tap_io(|t| drop(t.set_nodelay(true))), router).await {
                tracing::error!("bootstrap server stopped: {e}");
            }
        });
    }
    if matches!(
        a.handoff,
        SimHandoff::Nixl | SimHandoff::Mooncake | SimHandoff::NixlPush
    ) {
        tokio::spawn(handoff::expire_loop(sim.clone()));
    }
    if a.log_stats_interval_ms > 0 {
        tokio::spawn(stats_loop(sim.clone()));
    }
    let app = server::router(sim.clone());
    let accepted = sim.clone();
    let listener = listener.tap_io(move |t| {
        drop(t.set_nodelay(true));
        accepted
            .metrics
            .connections_accepted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    let serve = axum::serve(listener, app).with_graceful_shutdown(shutdown_signal());
    serve.await.context("the HTTP server failed")?;
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM; requests still running get two seconds.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
    tracing::info!("shutting down: no new requests; in-flight requests get 2 s");
    tokio::spawn(async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        tracing::info!("stopped (in-flight requests cut off)");
        std::process::exit(0);
    });
}

/// Logs throughput, load and the prefix cache hit rate now and then, as vLLM does.
async fn stats_loop(sim: Arc<Sim>) {
    let period = Duration::from_millis(sim.args.log_stats_interval_ms);
    let m = &sim.metrics;
    let (mut last_prompt, mut last_gen) = (0, 0);
    loop {
        tokio::time::sleep(period).await;
        let (p, g) = (
            m.prompt_tokens.load(Relaxed),
            m.generation_tokens.load(Relaxed),
        );
        let running = m.running.load(Relaxed);
        let waiting = m.waiting.load(Relaxed);
        if p == last_prompt && g == last_gen && running == 0 && waiting == 0 {
            continue;
        }
        let secs = period.as_secs_f64();
        tracing::info!(
            "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {:.1}%, Prefix cache hit rate: {:.2}%",
            (p - last_prompt) as f64 / secs,
            (g - last_gen) as f64 / secs,
            m.kv_usage() * 100.0,
            m.hit_rate_percent()
        );
        (last_prompt, last_gen) = (p, g);
    }
}
