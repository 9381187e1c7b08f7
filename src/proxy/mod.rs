//! The PD proxy (`pdctl proxy`): the one address clients send OpenAI requests to. It splits
//! each request into a prefill leg and a decode leg for the protocol of the cluster's KV
//! connector, picks instances with a routing policy, and relays decode's answer. It knows
//! endpoints and a protocol, nothing of processes: health comes from its own probes or from
//! the supervisor's control socket.
//!
//! # Layout
//!
//! The files sit in four layers; each imports only from its own layer and those below
//! (tests/layers.rs, `PROXY_LAYERS`, keeps it so, and finds no import cycle in the folder).
//! This file is the root that wires them together ([`Proxy`]); a file's unit tests may use
//! any layer (they check it together with what reads it).
//!
//! 1. Shared words: `leg` (prefill or decode, why a leg failed), `endpoint`, `errors`
//!    (what a client or a leg is told), `recorder` (the events the lower layers count;
//!    the figures implement it, so nothing below the figures imports them).
//! 2. Membership and settings: `instances` (the engines and their live facts), `reach`,
//!    `engine_run` (which run of its engine an instance is), `health` (probes, the
//!    supervisor's word), `discovery` (instances found by DNS
//!    name); `config`, `tuning` (settings taken while serving, from the supervisor's spec
//!    of the proxy), `policy` (instance choice); `recompute/ledger` and
//!    `recompute/counters` (the record of KV handoffs each decode instance carries).
//! 3. The request path: `server` (routes) -> `limits` (admission) -> `designate`,
//!    `request` -> `pipeline` (flows, retries) -> `legs` (one attempt of one leg), using
//!    `protocol` (bodies per connector), `h1` (the legs' HTTP/1.1 client), `upstream`
//!    (the HTTP client of probes and scrapes), `usage_chunk` (the usage chunk each
//!    streamed decode leg asks for and the client gets only if it asked),
//!    `recompute/judgment` (a decode leg judged by its own usage); `relay` (streams),
//!    `migration` (a stream whose decode broke off, continued on another decode),
//!    `whole` (a whole answer put together from the stream its decode leg was read as),
//!    `record` (the request's log line), `drain` (shutdown), `models`, `warmup` (one
//!    request through each new prefill/decode pair whose connector handshakes lazily).
//! 4. The figures, reading from below: `metrics` (the counters and `/metrics`, a
//!    [`recorder::Recorder`]), `histogram`, `figures` (what `pdctl status` reads back),
//!    `recompute` (KV handoff misses decode hides: the window check on its counters),
//!    `scrape` (engines' `/metrics`), `transfer_failures`, `rebalance_seen` (the head's
//!    rebalancer as the supervisor's report shows it).
//!
//! The modules are private; what the other stages use is re-exported here: the command's
//! arguments, the endpoint parser, the figures `pdctl status` reads from `/metrics`.

mod config;
mod designate;
mod discovery;
mod drain;
mod endpoint;
mod engine_run;
mod errors;
mod figures;
mod h1;
mod health;
mod histogram;
mod instances;
mod leg;
mod legs;
mod limits;
mod metrics;
mod migration;
mod models;
mod pipeline;
mod policy;
mod protocol;
mod reach;
mod rebalance_seen;
mod recompute;
mod record;
mod recorder;
mod relay;
mod request;
mod scrape;
mod server;
mod transfer_failures;
mod tuning;
mod upstream;
mod usage_chunk;
mod warmup;
mod whole;

use crate::child_config::proxy::ProxyArgs;
use anyhow::Context;
use arc_swap::ArcSwap;
pub use config::ConfigError;
pub use endpoint::parse_endpoint;
pub use figures::{
    InstanceFigures, ProxyFigures, instance as instance_figures, read as read_figures,
    settings_revision,
};
pub use instances::Leg;
use instances::LivePools;
use limits::Limits;
use metrics::Metrics;
use policy::Policy;
use protocol::Protocol;
use recorder::Recorder;
use std::sync::Arc;
use std::time::Duration;
use upstream::Upstream;

/// Everything a request needs, shared by all requests.
#[derive(Debug)]
pub struct Proxy {
    /// Timeouts and switches; swapped whole when they change while it runs (`tuning`).
    settings: ArcSwap<config::Settings>,
    /// The instances routing sees now (fixed ones, and those DNS names list).
    pub pools: LivePools,
    /// The names whose addresses are instances (`--prefill-dns`, `--decode-dns`).
    pub dns: Vec<discovery::DnsSource>,
    /// The routing policy of each leg; swapped when `pdctl apply` names another.
    policies: ArcSwap<tuning::Policies>,
    pub protocol: Box<dyn Protocol>,
    /// The decodes' kv_load_failure_policy: under "fail" a decode's generation error on a
    /// request with a KV handoff is a failed KV load (legs.rs).
    pub kv_load_failure_policy: crate::topology::KvLoadFailurePolicy,
    /// What the plan says of the decodes' KV, for judging their answers (recompute/).
    pub handoff: recompute::HandoffSettings,
    pub upstream: Upstream,
    pub limits: Limits,
    /// The counters `/metrics` writes, and what renders them: the figures' own (scrape,
    /// transfer failures); the request path counts through `recorder` and serves the
    /// page through [`Proxy::metrics_page`].
    pub metrics: Arc<Metrics>,
    /// The same counters as the request path, limits and policies see them: events to
    /// count, not how they are kept (recorder.rs).
    pub recorder: Arc<dyn Recorder>,
    /// Shutdown: refusing new requests, cutting streams at the end of the grace.
    pub drain: drain::Drain,
    /// Which prefill/decode pairs have their KV path warmed (protocols whose connector
    /// makes its handshake lazily route only those).
    pub warmup: warmup::Warmup,
}

impl Proxy {
    /// Builds a proxy from checked arguments (nothing is started).
    pub fn new(a: &ProxyArgs) -> anyhow::Result<Proxy> {
        let settings = config::settings(a)?;
        let pools = LivePools::new(config::pools(a)?);
        let dns = discovery::dns_sources(a)?;
        let metrics = Arc::new(Metrics::default());
        let recorder: Arc<dyn Recorder> = metrics.clone();
        let upstream = Upstream::new(
            settings.connect_timeout,
            a.tcp(),
            a.engine_api_key.as_deref(),
        )?;
        let bootstrap_timeout = settings.connect_timeout + Duration::from_secs(2);
        let protocol = protocol::build(a.protocol, bootstrap_timeout);
        Ok(Proxy {
            warmup: warmup::Warmup::new(
                a.protocol.lazy_handshake() && !a.no_warmup,
                Duration::from_secs(a.warmed_within_s),
            ),
            policies: ArcSwap::from_pointee(tuning::Policies::new(a, &recorder)),
            protocol,
            kv_load_failure_policy: a.kv_load_failure_policy,
            handoff: recompute::HandoffSettings {
                leaves_tokens: a.handoff_leaves_tokens,
                details: a.decode_prompt_tokens_details,
            },
            limits: Limits::new(
                a.rate_limit,
                a.max_concurrent,
                a.queue_size,
                recorder.clone(),
            ),
            upstream,
            pools,
            dns,
            settings: ArcSwap::from_pointee(settings),
            metrics,
            recorder,
            drain: drain::Drain::default(),
        })
    }

    /// The `/metrics` page now: the counters and the per-instance series of the instances
    /// routing sees (the figures render it; the route only serves it).
    pub fn metrics_page(&self) -> String {
        self.metrics.render(&self.pools.snapshot())
    }

    /// The routing policy of a leg now.
    pub fn policy(&self, leg: Leg) -> Arc<dyn Policy> {
        self.policies.load().of(leg).clone()
    }

    /// The policies of both legs now.
    fn policies(&self) -> arc_swap::Guard<Arc<tuning::Policies>> {
        self.policies.load()
    }

    fn set_policies(&self, p: tuning::Policies) {
        self.policies.store(Arc::new(p));
    }

    fn set_settings(&self, s: config::Settings) {
        self.settings.store(Arc::new(s));
    }

    /// The timeouts and switches in effect now (a guard: read it, do not hold it across
    /// an await).
    pub fn settings(&self) -> arc_swap::Guard<Arc<config::Settings>> {
        self.settings.load()
    }
}

/// Runs the proxy until SIGINT or SIGTERM.
pub async fn run(a: ProxyArgs) -> anyhow::Result<()> {
    let proxy = Arc::new(Proxy::new(&a)?);
    let addr = format!("{}:{}", a.host, a.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| config::ConfigError::Listen {
            addr: addr.clone(),
            port: a.port,
            source,
        })?;
    discovery::refresh_all(&proxy).await;
    health::start(proxy.clone(), a.supervisor_socket.clone(), a.clone()).await;
    discovery::start(proxy.clone());
    warmup::start(proxy.clone());
    scrape::start(
        proxy.clone(),
        proxy.settings().health_interval,
        proxy.settings().scrape_metrics,
    );
    tracing::info!(
        "pdctl proxy listening on http://{addr}: protocol {}, prefill policy {}, decode policy {}, {} prefill, {} decode",
        proxy.protocol.name(),
        proxy.policy(Leg::Prefill).name(),
        proxy.policy(Leg::Decode).name(),
        proxy.pools.snapshot().prefill.len(),
        proxy.pools.snapshot().decode.len(),
    );
    for src in &proxy.dns {
        tracing::info!(
            "{} instances: every address of {} (looked up every {:?})",
            src.leg,
            src.spelled(),
            proxy.settings().health_interval
        );
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // Routes made into services once, here: served as a plain Router, axum rebuilds the
    // route table (a map and a boxed service per route) for every connection, 3.8 KiB each
    // that 1000 streams kept (docs/proxy.md, "Memory"); this way a connection clones an Arc.
    let app = server::router(proxy.clone()).with_state(());
    let limits = server::ClientLimits {
        header_read_timeout: Duration::from_secs(a.header_read_timeout_s),
        max_connections: a.max_client_connections,
    };
    let server = tokio::spawn(server::serve(listener, app, limits, async {
        let _ = stop_rx.await;
    }));
    shutdown_signal().await?;
    // Until the drain ends, connections are still taken: new requests get a 503 saying why.
    proxy.drain.run(drain::grace_from_env()).await;
    let _ = stop_tx.send(());
    match tokio::time::timeout(Duration::from_secs(1), server).await {
        Ok(joined) => joined.context("the proxy server task failed")?,
        Err(_) => tracing::warn!("connections still open after the drain; exiting"),
    }
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    Ok(())
}
