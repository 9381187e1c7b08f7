//! The simulated engine's shared state and scheduler: admission up to `max_num_seqs`
//! running sequences (the rest wait), the prefix cache, and the latency model.
//!
//! Time model: a request's first token comes `overhead + uncached_prompt_tokens *
//! prefill_ms_per_token + handed_off_tokens * kv_load_ms_per_token` after it is
//! admitted, plus its wait for a turn to compute: at most `max_concurrent_prefills`
//! prompts compute at once (in arrival order), so an instance's prefill time grows with
//! the prompt tokens queued on it. Each later token comes one step after the previous,
//! where a step is `itl_ms * (1 + batch_slowdown * (running - 1))`, so a decode step grows
//! with its batch. All zero means no timer at all.

use super::cache::PrefixCache;
use super::faults::Faults;
use super::handoff::held::HeldKv;
use super::metrics::Metrics;
use crate::child_config::sim::SimArgs;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Everything the request handlers share.
pub struct Sim {
    pub args: SimArgs,
    /// Changes on every start, so a decode can tell a restarted prefill from the old one.
    pub engine_id: String,
    /// Host that decodes use to reach this instance for KV pulls.
    pub kv_host: String,
    started: Instant,
    started_unix: u64,
    pub metrics: Metrics,
    pub faults: Faults,
    cache: Mutex<PrefixCache>,
    slots: Arc<Semaphore>,
    /// Turns to compute a prompt (`max_concurrent_prefills`; None: no limit).
    prefill_turns: Option<Semaphore>,
    next_id: AtomicU64,
    id_tag: u32,
    /// KV kept for decodes (nixl and mooncake prefill side).
    pub held: HeldKv,
    /// Client for KV pulls from prefill instances.
    pub http: reqwest::Client,
}

impl Sim {
    /// State for a sim started with `args` (already checked).
    pub fn new(args: SimArgs) -> Sim {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let tag = super::tokenizer::fnv1a(
            format!("{}-{}-{}", std::process::id(), now.as_nanos(), args.port).as_bytes(),
        ) as u32;
        let instance = args
            .instance
            .clone()
            .unwrap_or_else(|| format!("{}-{}", crate::spelling::value_name(args.role), args.port));
        let kv_host = args
            .kv_host
            .clone()
            .unwrap_or_else(|| match args.host.as_str() {
                "0.0.0.0" | "::" | "[::]" => "127.0.0.1".to_string(),
                h => h.to_string(),
            });
        let m = &args.model_params;
        Sim {
            engine_id: format!("pdctl-sim-{instance}-{tag:08x}"),
            kv_host,
            started: Instant::now(),
            started_unix: now.as_secs(),
            metrics: Metrics::new(&args.model, m.cache_blocks, m.block_size),
            faults: {
                let f = Faults::new(args.fault_exit_after);
                if args.fault_first_handshake_fails {
                    let first = super::faults::FaultRequest {
                        fail_handoff_next: Some(1),
                        ..Default::default()
                    };
                    f.apply(&first, 0);
                }
                f
            },
            cache: Mutex::new(PrefixCache::new(m.cache_blocks as usize)),
            slots: Arc::new(Semaphore::new(m.max_num_seqs as usize)),
            prefill_turns: (m.max_concurrent_prefills > 0)
                .then(|| Semaphore::new(m.max_concurrent_prefills as usize)),
            next_id: AtomicU64::new(1),
            id_tag: tag,
            held: HeldKv::default(),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            args,
        }
    }

    /// Milliseconds since the process started.
    pub fn uptime_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Unix time of the start, for `/v1/models`.
    pub fn started_unix(&self) -> u64 {
        self.started_unix
    }

    /// False while the simulated model is still "loading" (`--startup-ms`).
    pub fn loaded(&self) -> bool {
        self.uptime_ms() >= self.args.model_params.startup_ms
    }

    /// A request id: the client's X-Request-Id when given (so both legs of a PD request
    /// share it), else a fresh one unique to this instance.
    pub fn request_id(&self, prefix: &str, client_id: Option<&str>) -> String {
        match client_id {
            Some(id) if !id.is_empty() => format!("{prefix}-{id}"),
            _ => format!(
                "{prefix}-{:08x}{:08x}",
                self.id_tag,
                self.next_id.fetch_add(1, Relaxed)
            ),
        }
    }

    /// How many leading blocks of `hashes` the prefix cache holds (marks them used).
    pub fn cache_lookup(&self, hashes: &[u64]) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .lookup(hashes)
    }

    /// Puts blocks into the prefix cache.
    pub fn cache_insert(&self, hashes: &[u64]) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(hashes);
    }

    /// Time to compute `uncached` prompt tokens and load `loaded` handed-off ones, when
    /// no other prompt waits for its turn.
    pub fn prefill_time(&self, uncached: u64, loaded: u64) -> Duration {
        self.fixed_prefill_time(loaded) + self.compute_time(uncached)
    }

    /// The part of the time to first token that runs alongside other requests: the
    /// per-request overhead and loading handed-off KV.
    fn fixed_prefill_time(&self, loaded: u64) -> Duration {
        let m = &self.args.model_params;
        ms(m.overhead_ms + loaded as f64 * m.kv_load_ms_per_token)
    }

    /// Computing `uncached` prompt tokens, once it is this prompt's turn.
    fn compute_time(&self, uncached: u64) -> Duration {
        ms(uncached as f64 * self.args.model_params.prefill_ms_per_token)
    }

    /// Waits a prompt's time to first token: the fixed part, then its turn to compute
    /// (behind the prompts queued before it when `max_concurrent_prefills` compute
    /// already), then the computing.
    pub async fn prefill(&self, uncached: u64, loaded: u64) {
        pause(self.fixed_prefill_time(loaded)).await;
        let compute = self.compute_time(uncached);
        if compute.is_zero() {
            return;
        }
        let _turn = match &self.prefill_turns {
            Some(turns) => Some(turns.acquire().await.expect("never closed")),
            None => None,
        };
        pause(compute).await;
    }

    /// One decode step with the current number of running sequences.
    pub fn step_time(&self) -> Duration {
        let m = &self.args.model_params;
        if m.itl_ms == 0.0 {
            return Duration::ZERO;
        }
        let others = (self.metrics.running.load(Relaxed) - 1).max(0) as f64;
        ms(m.itl_ms * (1.0 + m.batch_slowdown * others))
    }

    /// Waits for room for `seqs` sequences (counted as waiting meanwhile), then counts
    /// them as running until the returned guard is dropped.
    pub async fn admit(self: &Arc<Self>, seqs: u32) -> RunGuard {
        let want = seqs.min(self.args.model_params.max_num_seqs).max(1);
        let permit = match self.slots.clone().try_acquire_many_owned(want) {
            Ok(p) => p,
            Err(_) => {
                let _waiting = Counted::new(&self.metrics.waiting, 1);
                self.slots
                    .clone()
                    .acquire_many_owned(want)
                    .await
                    .expect("the slot semaphore is never closed")
            }
        };
        self.metrics.running.fetch_add(i64::from(seqs), Relaxed);
        RunGuard {
            sim: self.clone(),
            seqs: i64::from(seqs),
            blocks: 0,
            _permit: permit,
            finished: false,
        }
    }
}

/// Milliseconds (fractional) as a Duration; negative or NaN gives zero.
pub fn ms(v: f64) -> Duration {
    if v > 0.0 {
        Duration::from_secs_f64(v / 1000.0)
    } else {
        Duration::ZERO
    }
}

/// Sleeps unless `d` is zero (the zero-latency setting never touches a timer).
pub async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Adds to a gauge for as long as it lives.
struct Counted<'a> {
    gauge: &'a std::sync::atomic::AtomicI64,
    n: i64,
}

impl<'a> Counted<'a> {
    fn new(gauge: &'a std::sync::atomic::AtomicI64, n: i64) -> Self {
        gauge.fetch_add(n, Relaxed);
        Counted { gauge, n }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.gauge.fetch_sub(self.n, Relaxed);
    }
}

/// Running sequences of one request. Dropped before [`RunGuard::finish`] means the
/// client went away: the request counts as aborted.
pub struct RunGuard {
    sim: Arc<Sim>,
    seqs: i64,
    blocks: i64,
    _permit: OwnedSemaphorePermit,
    finished: bool,
}

impl RunGuard {
    /// Counts `n` more KV blocks in use by this request.
    pub fn add_blocks(&mut self, n: i64) {
        self.blocks += n;
        self.sim.metrics.blocks_in_use.fetch_add(n, Relaxed);
    }

    /// Marks the request as completed (not aborted).
    pub fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        let m = &self.sim.metrics;
        m.running.fetch_sub(self.seqs, Relaxed);
        m.blocks_in_use.fetch_sub(self.blocks, Relaxed);
        if !self.finished {
            m.aborted.fetch_add(1, Relaxed);
            tracing::info!("request aborted: the client went away");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{SimHandoff, SimModel, SimRole};

    fn sim(model: SimModel) -> Arc<Sim> {
        Arc::new(Sim::new(SimArgs {
            host: "127.0.0.1".into(),
            port: 1,
            role: SimRole::Both,
            model: "m".into(),
            instance: None,
            handoff: SimHandoff::None,
            kv_dir: None,
            bootstrap_port: None,
            kv_load_failure_policy: crate::topology::KvLoadFailurePolicy::Recompute,
            model_params: model,
            fault_exit_after: None,
            fault_first_handshake_fails: false,
            kv_host: None,
            log_stats_interval_ms: 0,
            api_key: None,
            instances: 1,
        }))
    }

    #[test]
    fn latency_model_math() {
        let s = sim(SimModel {
            overhead_ms: 2.0,
            prefill_ms_per_token: 0.5,
            kv_load_ms_per_token: 0.01,
            itl_ms: 10.0,
            batch_slowdown: 0.1,
            ..SimModel::default()
        });
        assert_eq!(s.prefill_time(100, 0), Duration::from_millis(52));
        assert_eq!(s.prefill_time(0, 1000), Duration::from_millis(12));
        assert_eq!(s.step_time(), Duration::from_millis(10));
        s.metrics.running.store(5, Relaxed);
        assert_eq!(s.step_time(), Duration::from_millis(14));
        let z = sim(SimModel::zero_latency());
        z.metrics.running.store(50, Relaxed);
        assert_eq!(z.prefill_time(10_000, 10_000), Duration::ZERO);
        assert_eq!(z.step_time(), Duration::ZERO);
    }

    #[tokio::test]
    async fn admission_waits_beyond_max_num_seqs_and_guard_counts_aborts() {
        let s = sim(SimModel {
            max_num_seqs: 2,
            ..SimModel::zero_latency()
        });
        let mut a = s.admit(2).await;
        assert_eq!(s.metrics.running.load(Relaxed), 2);
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.admit(1).await.finish() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(s.metrics.waiting.load(Relaxed), 1);
        a.finish();
        drop(a);
        waiter.await.unwrap();
        assert_eq!(s.metrics.waiting.load(Relaxed), 0);
        assert_eq!(s.metrics.running.load(Relaxed), 0);
        assert_eq!(s.metrics.aborted.load(Relaxed), 0);
        let mut g = s.admit(1).await;
        g.add_blocks(3);
        assert_eq!(s.metrics.blocks_in_use.load(Relaxed), 3);
        drop(g);
        assert_eq!(s.metrics.aborted.load(Relaxed), 1);
        assert_eq!(s.metrics.blocks_in_use.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn prompts_on_one_instance_compute_one_at_a_time() {
        let model = SimModel {
            overhead_ms: 0.0,
            prefill_ms_per_token: 1.0,
            ..SimModel::default()
        };
        // Three 40-token prompts at once: the last gets its first token after all three
        // computed in turn (120 ms); load can only make it later.
        let serial = sim(model.clone());
        let t = std::time::Instant::now();
        let all = (0..3).map(|_| {
            let s = serial.clone();
            tokio::spawn(async move { s.prefill(40, 0).await })
        });
        for h in all.collect::<Vec<_>>() {
            h.await.unwrap();
        }
        assert!(
            t.elapsed() >= Duration::from_millis(120),
            "{:?}",
            t.elapsed()
        );
        // 0 sets no limit: every prompt computes alongside the others, as before.
        let parallel = sim(SimModel {
            max_concurrent_prefills: 0,
            ..model
        });
        assert!(parallel.prefill_turns.is_none());
    }

    #[test]
    fn request_ids_use_the_client_id_or_are_unique() {
        let s = sim(SimModel::default());
        assert_eq!(s.request_id("cmpl", Some("abc")), "cmpl-abc");
        assert_ne!(s.request_id("cmpl", None), s.request_id("cmpl", None));
    }
}
