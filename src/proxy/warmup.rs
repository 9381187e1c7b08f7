//! Ready means the KV path works. vLLM's NixlConnector (pull and push) makes its handshake
//! with a prefill lazily, over its ZMQ side channel, on the first request a decode takes
//! from that prefill; a handshake that times out fails that request (under
//! `kv_load_failure_policy = "fail"`). So for protocols whose handshake is lazy
//! ([`crate::vocab::ProxyProtocol::lazy_handshake`]) each prefill/decode pair gets one small
//! warm-up request (a prompt of a few hundred tokens, one output token) through both legs
//! before routing sends it a client's request: at start, for every pair an instance
//! joining later makes (`pdctl scale`, a rebalance move), and again when one of its
//! engines runs anew (a restart: [`super::engine_run`]). An instance that was only out
//! of rotation for a while (busy, a freeze) keeps its warmed pairs: the handshake lives
//! as long as the two processes. A pair whose warm-up fails stays out of routing with the
//! reason (`/health?ready`, `pdctl status`) and is tried again with a growing backoff.
//! The warm-up goes straight to the engines: it never reaches a client and no counter of
//! the proxy's traffic sees it; `pdctl_proxy_warmups_total{instance=DECODE}` counts them,
//! so that the rebalancer can take them out of the decode engines' own counters.

use super::Proxy;
use super::engine_run::{routing_changed, routing_epoch};
use super::instances::{Instance, Leg, LivePools, Pools};
use super::protocol::{Body, PrefillAnswer};
use super::recompute::judgment::{Expect, leg_sent};
use super::recorder::Recorder;
use super::upstream::MAX_ANSWER_BYTES;
use crate::backoff::Backoff;
use arc_swap::{ArcSwap, Guard};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// How often the pairs are looked over.
const TICK: Duration = Duration::from_millis(200);
/// How long one warm-up (both legs) may take: a first NIXL handshake on a busy CPU engine
/// takes seconds, vLLM gives up on it after its own timeout.
const WARM_TIMEOUT: Duration = Duration::from_secs(60);
/// Backoff after a failed warm-up: 1 s, doubling, at most 30 s.
const BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
/// `/health?warmed` waits for a pair of the first round through this many warm-ups: one
/// that failed is tried again (a NIXL handshake that timed out on a busy machine works the
/// next time), a pair whose KV path fails every time does not hold `up` further.
const SETTLE_ATTEMPTS: u32 = 3;
/// Words of the warm-up prompt (the one setting of its size): more than one KV block on
/// every engine (vLLM's CPU build uses blocks of 128 tokens), so decode really loads KV
/// from the prefill. Whether a shorter prompt (one token) makes the connector's handshake
/// as well is to be measured on vLLM; this is the number to change then.
pub const PROMPT_WORDS: usize = 300;
/// Warm-ups on their way at once: 16P16D makes 256 pairs at start, and each warm-up is a
/// prefill and a decode on engines that also start; the rest wait their turn.
pub const WARM_AT_ONCE: usize = 8;

/// Where one pair stands.
#[derive(Debug, Clone)]
pub enum PairState {
    /// A warm-up is on its way (attempt number).
    Warming { attempt: u32 },
    /// Its KV path works; the warm-up took this long.
    Ready { took: Duration },
    /// The last warm-up failed; the next is due at `next_try`.
    Failed {
        why: String,
        attempt: u32,
        next_try: Instant,
    },
}

/// One pair as `/health?ready` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PairView {
    pub prefill: String,
    pub decode: String,
    /// `warming`, `ready` or `failed`.
    pub state: &'static str,
    /// Why the last warm-up failed (and when the next one goes), for `failed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How long the warm-up that made it ready took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub took_ms: Option<u64>,
}

/// A pair's state, with the engine runs ([`super::engine_run::EngineRun::generation`] of
/// the prefill and of the decode) it holds for.
#[derive(Debug, Clone)]
struct Pair {
    state: PairState,
    runs: Runs,
}

/// The engine runs of a pair's prefill and decode.
type Runs = (u64, u64);

/// `(prefill URL, decode URL)`.
type Key = (String, String);

fn runs_of(prefill: &Instance, decode: &Instance) -> Runs {
    (prefill.run.generation(), decode.run.generation())
}

/// What routing chooses from, prepared when it changes (an engine's new run, an instance
/// in or out of rotation, joining or leaving, a pair warmed or forgotten: what moves
/// [`routing_epoch`]) instead of looking every pair over per request. Lists are in the
/// pools' order.
#[derive(Debug, Default)]
pub struct ReadyIndex {
    /// The [`routing_epoch`] it was built at (None: never built).
    epoch: Option<u64>,
    /// The usable instances of each leg (by `Leg as usize`).
    usable: [Vec<Arc<Instance>>; 2],
    /// The usable instances of each leg in a warmed pair with a usable one of the other.
    paired: [Vec<Arc<Instance>>; 2],
    /// By an instance's (`Leg as usize`, index): the usable instances of the other leg
    /// whose pair with it is warmed with the engine runs they have.
    partners: HashMap<(usize, usize), Vec<Arc<Instance>>>,
}

impl ReadyIndex {
    /// The usable instances of `leg`.
    pub fn usable(&self, leg: Leg) -> &[Arc<Instance>] {
        &self.usable[leg as usize]
    }

    /// The usable instances of `leg` that make a warmed pair with a usable instance of
    /// the other leg (all usable ones where pairs need no warm-up).
    pub fn paired(&self, leg: Leg) -> &[Arc<Instance>] {
        &self.paired[leg as usize]
    }

    /// The usable instances of the other leg warmed with `inst` (usable or not itself).
    pub fn partners_of(&self, inst: &Instance) -> &[Arc<Instance>] {
        self.partners
            .get(&(inst.leg as usize, inst.index))
            .map_or(&[], Vec::as_slice)
    }
}

/// The warm-up state of every prefill/decode pair (by the instances' URLs).
#[derive(Debug)]
pub struct Warmup {
    needed: bool,
    pairs: Mutex<HashMap<Key, Pair>>,
    /// What routing chooses from, rebuilt when [`routing_epoch`] moved.
    index: ArcSwap<ReadyIndex>,
    /// Bounds the warm-ups on their way at once ([`WARM_AT_ONCE`]).
    at_once: Semaphore,
    /// Every pair usable when the proxy started is warmed, or `settle_within` has passed.
    settled: AtomicBool,
    /// How long `/health?warmed` waits for that (`--warmed-within-s`).
    settle_within: Duration,
    /// Tells warm-up request ids apart.
    next_id: AtomicU64,
    /// When the warm-ups started (the proxy's start), for the first round's progress.
    began: std::sync::OnceLock<Instant>,
}

impl Default for Warmup {
    fn default() -> Self {
        Warmup {
            needed: false,
            pairs: Mutex::default(),
            index: ArcSwap::default(),
            at_once: Semaphore::new(WARM_AT_ONCE),
            settled: AtomicBool::default(),
            settle_within: Duration::ZERO,
            next_id: AtomicU64::default(),
            began: std::sync::OnceLock::new(),
        }
    }
}

impl Warmup {
    /// The state for a protocol whose handshake is lazy (`needed`), or a no-op one;
    /// `/health?warmed` waits up to `settle_within` for the first pairs.
    pub fn new(needed: bool, settle_within: Duration) -> Warmup {
        Warmup {
            needed,
            settled: AtomicBool::new(!needed),
            settle_within,
            ..Warmup::default()
        }
    }

    /// Whether pairs are warmed before routing uses them.
    pub fn needed(&self) -> bool {
        self.needed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Pair>> {
        self.pairs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether routing may send a handoff from `prefill` to `decode`: their pair was warmed
    /// with the engine runs they have now.
    pub fn pair_ready(&self, prefill: &Instance, decode: &Instance) -> bool {
        !self.needed
            || self
                .lock()
                .get(&(prefill.url.clone(), decode.url.clone()))
                .is_some_and(|pair| {
                    matches!(pair.state, PairState::Ready { .. })
                        && pair.runs == runs_of(prefill, decode)
                })
    }

    /// What routing chooses from now: the index built at the current [`routing_epoch`],
    /// built first when that moved (once per change, not per request).
    pub fn ready(&self, pools: &LivePools) -> Guard<Arc<ReadyIndex>> {
        let epoch = routing_epoch();
        let index = self.index.load();
        if index.epoch == Some(epoch) {
            return index;
        }
        drop(index);
        self.index
            .store(Arc::new(self.build(&pools.snapshot(), epoch)));
        self.index.load()
    }

    /// The index of `pools` as they and the pairs are now, marked with `epoch` (read
    /// before: a change while it is built moves the epoch, and the next read builds anew).
    fn build(&self, pools: &Pools, epoch: u64) -> ReadyIndex {
        let usable_of = |leg| -> Vec<Arc<Instance>> {
            let all = pools.of(leg).iter();
            all.filter(|i| i.is_usable()).cloned().collect()
        };
        let usable = [usable_of(Leg::Prefill), usable_of(Leg::Decode)];
        if !self.needed {
            let paired = usable.clone();
            let partners = HashMap::new();
            let epoch = Some(epoch);
            return ReadyIndex {
                epoch,
                usable,
                paired,
                partners,
            };
        }
        let by_url = |leg| -> HashMap<&str, &Arc<Instance>> {
            pools.of(leg).iter().map(|i| (i.url.as_str(), i)).collect()
        };
        let (prefills, decodes) = (by_url(Leg::Prefill), by_url(Leg::Decode));
        let mut partners: HashMap<(usize, usize), Vec<Arc<Instance>>> = HashMap::new();
        for ((pu, du), pair) in self.lock().iter() {
            let (Some(p), Some(d)) = (prefills.get(pu.as_str()), decodes.get(du.as_str())) else {
                continue;
            };
            if !matches!(pair.state, PairState::Ready { .. }) || pair.runs != runs_of(p, d) {
                continue;
            }
            for (a, b) in [(p, d), (d, p)] {
                if b.is_usable() {
                    let key = (a.leg as usize, a.index);
                    partners.entry(key).or_default().push(Arc::clone(b));
                }
            }
        }
        for list in partners.values_mut() {
            list.sort_by_key(|i| i.index);
        }
        let paired = usable.clone().map(|leg| {
            let warmed = |i: &Arc<Instance>| partners.contains_key(&(i.leg as usize, i.index));
            leg.into_iter().filter(warmed).collect()
        });
        let epoch = Some(epoch);
        ReadyIndex {
            epoch,
            usable,
            paired,
            partners,
        }
    }

    /// Marks the pair of `prefill` and `decode` warmed with their engines' runs now, as a
    /// warm-up that went through would (for the tests of what routing does with it).
    #[cfg(test)]
    pub(crate) fn mark_ready(&self, prefill: &Instance, decode: &Instance) {
        let key = (prefill.url.clone(), decode.url.clone());
        let state = PairState::Ready {
            took: Duration::ZERO,
        };
        let runs = runs_of(prefill, decode);
        self.lock().insert(key, Pair { state, runs });
        routing_changed();
    }

    /// Whether a warm-up is on its way or due again (a request may wait for it).
    pub fn pending(&self) -> bool {
        self.needed
            && self
                .lock()
                .values()
                .any(|pair| !matches!(pair.state, PairState::Ready { .. }))
    }

    /// How far the first round is, for the log line `pdctl up` shows as the proxy's
    /// progress while it waits for `/health?warmed`: None once it settled.
    fn progress(&self, pairs: &HashMap<Key, Pair>) -> Option<String> {
        if self.settled() {
            return None;
        }
        let ready = pairs
            .values()
            .filter(|pair| matches!(pair.state, PairState::Ready { .. }))
            .count();
        let secs = self.began.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
        Some(format!(
            "{ready} of {} pair(s) warmed, {secs:.1} s since the start, at most {WARM_AT_ONCE} at once",
            pairs.len()
        ))
    }

    /// Whether the pairs usable at start are all warmed (or the wait for them is over).
    pub fn settled(&self) -> bool {
        self.settled.load(Ordering::Relaxed)
    }

    /// Every pair known, for `/health?ready` and `pdctl status`.
    pub fn views(&self) -> Vec<PairView> {
        let mut out: Vec<PairView> = self
            .lock()
            .iter()
            .map(|((p, d), pair)| {
                let (state, reason, took_ms) = match &pair.state {
                    PairState::Warming { attempt } => (
                        "warming",
                        Some(format!("warming up its KV path (attempt {attempt})")),
                        None,
                    ),
                    PairState::Ready { took } => ("ready", None, Some(took.as_millis() as u64)),
                    PairState::Failed { why, next_try, .. } => (
                        "failed",
                        Some(format!(
                            "warm-up failed: {why}; next try in {:.0} s",
                            next_try
                                .saturating_duration_since(Instant::now())
                                .as_secs_f64()
                        )),
                        None,
                    ),
                };
                PairView {
                    prefill: p.clone(),
                    decode: d.clone(),
                    state,
                    reason,
                    took_ms,
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.prefill, &a.decode).cmp(&(&b.prefill, &b.decode)));
        out
    }

    /// Why no instance of `leg` is routable although some are usable: their pairs.
    pub fn why_not(&self, leg: Leg) -> String {
        let views = self.views();
        let mut parts: Vec<String> = views
            .iter()
            .filter(|v| v.state != "ready")
            .map(|v| {
                format!(
                    "pair {} -> {} {}",
                    v.prefill,
                    v.decode,
                    v.reason.as_deref().unwrap_or("is warming up its KV path")
                )
            })
            .collect();
        if parts.is_empty() {
            parts.push(format!("no {leg} instance makes a warmed pair yet"));
        }
        parts.join("; ")
    }
}

/// Starts warming pairs (nothing when the protocol's handshake is not lazy).
pub fn start(p: Arc<Proxy>) {
    if !p.warmup.needed() {
        return;
    }
    tokio::spawn(async move {
        let began = *p.warmup.began.get_or_init(Instant::now);
        let mut round: Vec<Key> = Vec::new();
        // The epoch of the last look and when a failed pair is due next: pairs are looked
        // over again only when either says so (an idle proxy of 64P64D does not go over
        // 4,096 pairs five times a second).
        let mut looked: Option<(u64, Option<Instant>)> = None;
        loop {
            let epoch = routing_epoch();
            let again = looked.is_none_or(|(seen, next)| {
                seen != epoch || next.is_some_and(|t| t <= Instant::now())
            });
            let started = if again {
                let (started, next) = tick(&p);
                looked = Some((epoch, next));
                started
            } else {
                Vec::new()
            };
            // The first round is the first tick that could pair anything: at the proxy's
            // start an engine the supervisor has not reported usable yet (a remote one its
            // node still calls starting) leaves no pair, and an empty round is not a warm-up
            // done (it made `/health?warmed` say yes at once, `up` end, and the first
            // request wait for a warm-up on its own; seen with vLLM on two machines).
            if round.is_empty() {
                round = started;
            }
            if !p.warmup.settled() && settle(&p.warmup, &round, began.elapsed()) {
                let said = p.warmup.progress(&p.warmup.lock());
                p.warmup.settled.store(true, Ordering::Relaxed);
                tracing::info!(
                    "the first round of KV path warm-ups is over: {}",
                    said.unwrap_or_default()
                );
            }
            tokio::time::sleep(TICK).await;
        }
    });
}

/// Whether `/health?warmed` may say yes, `elapsed` after the proxy's start: every pair of
/// the first `round` is warmed (or forgotten: an instance left) or has failed
/// [`SETTLE_ATTEMPTS`] warm-ups, or the wait is over. A first failed warm-up does not end
/// the wait: it is tried again, and on a busy machine a NIXL handshake that timed out once
/// works the next time (`up` ending before that made the first request wait for the
/// warm-up and fail).
fn settle(w: &Warmup, round: &[Key], elapsed: Duration) -> bool {
    let pairs = w.lock();
    let (mut waiting, mut given_up) = (Vec::new(), Vec::new());
    for k in round {
        match pairs.get(k).map(|pair| &pair.state) {
            None | Some(PairState::Ready { .. }) => {}
            Some(PairState::Warming { attempt }) => waiting.push(format!(
                "{} -> {} (warm-up attempt {attempt} on its way)",
                k.0, k.1
            )),
            Some(PairState::Failed { why, attempt, .. }) => {
                let said = format!("{} -> {} (attempt {attempt} failed: {why})", k.0, k.1);
                if *attempt < SETTLE_ATTEMPTS {
                    waiting.push(said);
                } else {
                    given_up.push(said);
                }
            }
        }
    }
    if !round.is_empty() && waiting.is_empty() {
        if !given_up.is_empty() {
            tracing::warn!(
                "the KV path of pair(s) {} failed {SETTLE_ATTEMPTS} warm-ups: ready all the same; warm-ups go on, and requests wait for a warmed pair",
                given_up.join("; ")
            );
        }
        return true;
    }
    if elapsed < w.settle_within {
        return false;
    }
    waiting.extend(given_up);
    tracing::warn!(
        "after {} s the KV path of {} is not warmed: ready all the same; warm-ups go on, and requests wait for a warmed pair",
        w.settle_within.as_secs(),
        if waiting.is_empty() {
            "no pair (no prefill and decode usable together yet)".to_string()
        } else {
            format!("pair(s) {}", waiting.join("; "))
        }
    );
    true
}

/// A pair due for a warm-up: its prefill, its decode, the attempt and the runs it is for.
type Due = (Arc<Instance>, Arc<Instance>, u32, Runs);

/// Forgets pairs an instance of which left routing or runs anew (a restarted engine has
/// no handshake; one that was only out of rotation, busy, keeps it), and starts the
/// warm-ups that are due for pairs of usable instances. Returns the pairs it started and
/// when the next failed one is due again (the loop looks again then, or on a change).
fn tick(p: &Arc<Proxy>) -> (Vec<Key>, Option<Instant>) {
    let pools = p.pools.snapshot();
    let (due, next) = {
        let mut pairs = p.warmup.lock();
        if forget_stale(&mut pairs, &pools) {
            routing_changed();
        }
        let due = due_pairs(&mut pairs, &pools);
        (due, next_due(&pairs))
    };
    let started = due
        .iter()
        .map(|(pf, d, _, _)| (pf.url.clone(), d.url.clone()))
        .collect();
    for pair in due {
        tokio::spawn(warm_pair(p.clone(), pair));
    }
    (started, next)
}

/// Drops the pairs of which an instance left or runs anew; true when one was dropped.
fn forget_stale(pairs: &mut HashMap<Key, Pair>, pools: &Pools) -> bool {
    let by_url = |leg| -> HashMap<&str, &Arc<Instance>> {
        pools.of(leg).iter().map(|i| (i.url.as_str(), i)).collect()
    };
    let (prefills, decodes) = (by_url(Leg::Prefill), by_url(Leg::Decode));
    let before = pairs.len();
    pairs.retain(|(pu, du), pair| {
        let (Some(pf), Some(d)) = (prefills.get(pu.as_str()), decodes.get(du.as_str())) else {
            return false;
        };
        let same = pair.runs == runs_of(pf, d);
        if !same && matches!(pair.state, PairState::Ready { .. }) {
            tracing::info!(
                "pair {pu} -> {du} leaves routing until warmed again: an engine of it runs anew (restarted), and its KV handshake went with the old run"
            );
        }
        same
    });
    pairs.len() != before
}

/// Marks warming, and returns, the pairs of usable instances that have no state yet or
/// whose failed warm-up is due again.
fn due_pairs(pairs: &mut HashMap<Key, Pair>, pools: &Pools) -> Vec<Due> {
    let usable = |leg| pools.of(leg).iter().filter(|i| i.is_usable());
    let now = Instant::now();
    let mut due = Vec::new();
    for pf in usable(Leg::Prefill) {
        for d in usable(Leg::Decode) {
            let key = (pf.url.clone(), d.url.clone());
            let attempt = match pairs.get(&key).map(|pair| &pair.state) {
                None => 1,
                Some(PairState::Failed {
                    attempt, next_try, ..
                }) if *next_try <= now => attempt + 1,
                Some(_) => continue,
            };
            let runs = runs_of(pf, d);
            let state = PairState::Warming { attempt };
            pairs.insert(key, Pair { state, runs });
            due.push((pf.clone(), d.clone(), attempt, runs));
        }
    }
    due
}

/// When the first failed pair is due for its next warm-up.
fn next_due(pairs: &HashMap<Key, Pair>) -> Option<Instant> {
    pairs
        .values()
        .filter_map(|pair| match pair.state {
            PairState::Failed { next_try, .. } => Some(next_try),
            _ => None,
        })
        .min()
}

/// Warms one pair once its turn comes ([`WARM_AT_ONCE`] at once) and records the result.
async fn warm_pair(p: Arc<Proxy>, (pf, d, attempt, runs): Due) {
    let Ok(_turn) = p.warmup.at_once.acquire().await else {
        return;
    };
    tracing::info!(
        "warming up the KV path of pair {} -> {} (attempt {attempt}): one small request through both legs before routing uses it",
        pf.url,
        d.url
    );
    let t0 = Instant::now();
    let result = tokio::time::timeout(WARM_TIMEOUT, warm(&p, &pf, &d))
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", WARM_TIMEOUT.as_secs())));
    record(&p.warmup, &pf, &d, attempt, runs, result, t0.elapsed());
}

/// Stores a warm-up's result as its pair's state (unless the pair was forgotten or
/// warmed anew meanwhile) and tells routing.
fn record(
    w: &Warmup,
    pf: &Instance,
    d: &Instance,
    attempt: u32,
    runs: Runs,
    result: Result<(), String>,
    took: Duration,
) {
    let key = (pf.url.clone(), d.url.clone());
    let mut pairs = w.lock();
    // Forgotten meanwhile (an instance left or ran anew): nothing to record.
    if !pairs
        .get(&key)
        .is_some_and(|pair| matches!(pair.state, PairState::Warming { .. }) && pair.runs == runs)
    {
        return;
    }
    let state = match result {
        Ok(()) => {
            pairs.insert(
                key.clone(),
                Pair {
                    state: PairState::Ready { took },
                    runs,
                },
            );
            let progress = w.progress(&pairs).map(|s| format!(" ({s})"));
            tracing::info!(
                "KV path of pair {} -> {} warmed in {:.1} s: the pair enters routing{}",
                pf.url,
                d.url,
                took.as_secs_f64(),
                progress.unwrap_or_default()
            );
            PairState::Ready { took }
        }
        Err(why) => {
            let wait = backoff(attempt);
            tracing::warn!(
                "warm-up of pair {} -> {} failed after {:.1} s ({why}): the pair stays out of routing; next try in {:.0} s",
                pf.url,
                d.url,
                took.as_secs_f64(),
                wait.as_secs_f64()
            );
            let next_try = Instant::now() + wait;
            PairState::Failed {
                why,
                attempt,
                next_try,
            }
        }
    };
    pairs.insert(key, Pair { state, runs });
    drop(pairs);
    routing_changed();
}

/// The wait after the `attempt`-th failed warm-up.
fn backoff(attempt: u32) -> Duration {
    BACKOFF.after(attempt)
}

/// One warm-up of the pair: the protocol's prefill leg, then its decode leg with what the
/// prefill handed over, as a client's request would go, but sent straight to the engines.
async fn warm(p: &Proxy, prefill: &Arc<Instance>, decode: &Arc<Instance>) -> Result<(), String> {
    let model = served_model(p, prefill).await?;
    let n = p.warmup.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("pdctl-warmup-{}-{n}", std::process::id());
    let original = warm_body(&model);
    let handshake = p
        .protocol
        .prepare(prefill, &p.upstream)
        .await
        .map_err(|f| format!("prefill {}: {f}", prefill.url))?;
    let pbody = p.protocol.prefill_body(&original, &id, &handshake);
    let answer: PrefillAnswer = {
        let bytes = post(p, &prefill.url, &pbody, &id)
            .await
            .map_err(|e| format!("prefill {}: {e}", prefill.url))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| format!("prefill {} answered non-JSON: {e}", prefill.url))?
    };
    p.protocol.learned(prefill, &answer);
    let dbody = p
        .protocol
        .decode_body(&original, &id, prefill, &handshake, Some(&answer));
    if let Some(miss) = dbody.handoff_miss {
        return Err(format!(
            "prefill {} handed no KV over ({miss})",
            prefill.url
        ));
    }
    // The decode's counters show this handoff: its leg is accounted for like a client's
    // (left to the window check of those counters, so no recompute is suspected), but
    // nothing is counted in the proxy's figures.
    let expect = Expect::handoff(&original, dbody.body.as_ref());
    let silent: Arc<dyn Recorder> = Arc::new(super::recorder::Silent);
    let account = leg_sent(&silent, decode, expect, false, p.handoff, &id);
    let dbody = dbody.body.unwrap_or(original);
    p.metrics.warmup_sent(&decode.url);
    let sent = post(p, &decode.url, &dbody, &id).await;
    drop(account);
    sent.map_err(|e| format!("decode {} could not take the KV: {e}", decode.url))?;
    Ok(())
}

/// The warm-up request: a few hundred tokens of prompt, one token out, greedy.
fn warm_body(model: &str) -> Body {
    let prompt = format!(
        "pdctl warm-up of the KV path.{}",
        " ready".repeat(PROMPT_WORDS)
    );
    let v = json!({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    match v {
        Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// The model the prefill serves (the first its `/v1/models` lists).
async fn served_model(p: &Proxy, prefill: &Instance) -> Result<String, String> {
    let url = format!("{}/v1/models", prefill.url);
    let (status, body) = p
        .upstream
        .get(&url, Duration::from_secs(10))
        .await
        .map_err(|f| format!("GET {url}: {f}"))?;
    if status != 200 {
        return Err(format!("GET {url} answered {status}"));
    }
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| format!("GET {url} answered non-JSON: {e}"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("GET {url} lists no model"))
}

/// POSTs `body` to `base`'s completions route; the whole answer when it is 2xx.
async fn post(p: &Proxy, base: &str, body: &Body, id: &str) -> Result<bytes::Bytes, String> {
    let bytes = serde_json::to_vec(body).expect("JSON values serialize");
    let resp = p
        .upstream
        .legs()
        .post_json(base, "/v1/completions", &bytes, id)
        .await
        .map_err(|f| f.to_string())?;
    let status = resp.status;
    let answer = resp
        .body
        .read_all(MAX_ANSWER_BYTES)
        .await
        .map_err(|f| f.to_string())?;
    if !(200..300).contains(&status) {
        return Err(format!(
            "answered {status}: {}",
            crate::error_text::answer_message(&answer)
        ));
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::instances::parse_endpoint;

    fn inst(leg: Leg, addr: &str) -> Arc<Instance> {
        Arc::new(Instance::new(leg, 0, parse_endpoint(addr).unwrap(), None))
    }

    fn inst_at(leg: Leg, index: usize, addr: &str) -> Arc<Instance> {
        Arc::new(Instance::new(
            leg,
            index,
            parse_endpoint(addr).unwrap(),
            None,
        ))
    }

    fn pools_of(prefill: &[&Arc<Instance>], decode: &[&Arc<Instance>]) -> LivePools {
        let own = |v: &[&Arc<Instance>]| v.iter().map(|i| Arc::clone(i)).collect();
        LivePools::new(Pools {
            prefill: own(prefill),
            decode: own(decode),
        })
    }

    fn urls(list: &[Arc<Instance>]) -> Vec<&str> {
        list.iter().map(|i| i.url.as_str()).collect()
    }

    #[test]
    fn the_ready_index_follows_warm_ups_usability_and_new_runs() {
        let w = Warmup::new(true, Duration::from_secs(180));
        let (p0, p1) = (
            inst_at(Leg::Prefill, 0, "p:1"),
            inst_at(Leg::Prefill, 1, "p:2"),
        );
        let (d0, d1) = (
            inst_at(Leg::Decode, 0, "d:1"),
            inst_at(Leg::Decode, 1, "d:2"),
        );
        let pools = pools_of(&[&p0, &p1], &[&d0, &d1]);
        assert_eq!(urls(w.ready(&pools).usable(Leg::Decode)).len(), 2);
        assert!(
            w.ready(&pools).paired(Leg::Prefill).is_empty(),
            "none warmed"
        );
        w.mark_ready(&p0, &d0);
        let index = w.ready(&pools);
        assert_eq!(urls(index.paired(Leg::Prefill)), ["http://p:1"]);
        assert_eq!(urls(index.paired(Leg::Decode)), ["http://d:1"]);
        assert_eq!(urls(index.partners_of(&p0)), ["http://d:1"]);
        assert!(index.partners_of(&p1).is_empty());
        drop(index);
        w.mark_ready(&p0, &d1);
        w.mark_ready(&p1, &d0);
        let index = w.ready(&pools);
        assert_eq!(urls(index.partners_of(&p0)), ["http://d:1", "http://d:2"]);
        assert_eq!(
            urls(index.paired(Leg::Prefill)),
            ["http://p:1", "http://p:2"]
        );
        drop(index);
        // A drained (out of rotation) decode drops out, and so does a prefill whose only
        // warmed partner it was.
        d0.set_usable(false);
        let index = w.ready(&pools);
        assert_eq!(urls(index.usable(Leg::Decode)), ["http://d:2"]);
        assert_eq!(urls(index.paired(Leg::Prefill)), ["http://p:1"]);
        assert!(index.partners_of(&p1).is_empty());
        assert_eq!(urls(index.partners_of(&p0)), ["http://d:2"]);
        drop(index);
        d0.set_usable(true);
        assert_eq!(urls(w.ready(&pools).partners_of(&p1)), ["http://d:1"]);
        // A restarted prefill has no handshake left: its pairs are not ready.
        p0.run.ended();
        let index = w.ready(&pools);
        assert_eq!(urls(index.paired(Leg::Prefill)), ["http://p:2"]);
        assert_eq!(urls(index.paired(Leg::Decode)), ["http://d:1"]);
        assert!(index.partners_of(&d1).is_empty());
        drop(index);
        // A pair whose warm-up failed is out too.
        put(
            &w,
            &(p1.url.clone(), d0.url.clone()),
            PairState::Failed {
                why: "handshake timed out".into(),
                attempt: 1,
                next_try: Instant::now(),
            },
        );
        assert!(w.ready(&pools).paired(Leg::Decode).is_empty());
        // Without warm-ups every usable instance is paired.
        let none = Warmup::new(false, Duration::ZERO);
        assert_eq!(urls(none.ready(&pools).paired(Leg::Decode)).len(), 2);
    }

    #[test]
    fn a_pair_of_an_instance_that_left_is_forgotten() {
        let (p0, d0) = (
            inst_at(Leg::Prefill, 0, "p:1"),
            inst_at(Leg::Decode, 0, "d:1"),
        );
        let d1 = inst_at(Leg::Decode, 1, "d:2");
        let pools = pools_of(&[&p0], &[&d0, &d1]);
        let w = Warmup::new(true, Duration::from_secs(180));
        w.mark_ready(&p0, &d0);
        w.mark_ready(&p0, &d1);
        pools.update(Leg::Decode, |now| now[1..].to_vec());
        assert!(forget_stale(&mut w.lock(), &pools.snapshot()));
        assert_eq!(urls(w.ready(&pools).partners_of(&p0)), ["http://d:2"]);
        assert!(
            !forget_stale(&mut w.lock(), &pools.snapshot()),
            "nothing more"
        );
        // Due: the usable pairs with no state, once each.
        let due = due_pairs(&mut w.lock(), &pools.snapshot());
        assert!(due.is_empty(), "both pairs are known");
        let pools = pools_of(&[&p0], &[&d0, &d1]);
        let due = due_pairs(&mut w.lock(), &pools.snapshot());
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].1.url, "http://d:1");
    }

    /// Sets a pair's state as warmed with the engines' first runs.
    fn put(w: &Warmup, key: &Key, state: PairState) {
        w.lock().insert(
            key.clone(),
            Pair {
                state,
                runs: (0, 0),
            },
        );
        routing_changed();
    }

    #[test]
    fn warmed_waits_through_a_failed_first_warm_up_until_the_pair_is_ready_or_time_is_up() {
        let w = Warmup::new(true, Duration::from_secs(180));
        let key = ("http://p:1".to_string(), "http://d:2".to_string());
        let round = vec![key.clone()];
        let early = Duration::from_secs(40);
        assert!(!settle(&w, &[], early), "no pair yet is no warm-up done");
        put(&w, &key, PairState::Warming { attempt: 1 });
        assert!(!settle(&w, &round, early));
        put(
            &w,
            &key,
            PairState::Failed {
                why: "answered 500: handshake timed out".into(),
                attempt: 1,
                next_try: Instant::now(),
            },
        );
        assert!(
            !settle(&w, &round, early),
            "a failed first warm-up is tried again before ready"
        );
        assert!(
            settle(&w, &round, Duration::from_secs(180)),
            "past the wait: ready all the same"
        );
        put(
            &w,
            &key,
            PairState::Failed {
                why: "answered 400: no such model".into(),
                attempt: SETTLE_ATTEMPTS,
                next_try: Instant::now(),
            },
        );
        assert!(
            settle(&w, &round, early),
            "a pair that failed every warm-up holds `up` no further"
        );
        put(
            &w,
            &key,
            PairState::Ready {
                took: Duration::from_secs(3),
            },
        );
        assert!(settle(&w, &round, early));
        w.lock().clear();
        assert!(settle(&w, &round, early), "a pair forgotten waits no more");
    }

    #[test]
    fn only_a_ready_pair_is_routable_and_a_failed_one_says_why() {
        let w = Warmup::new(true, Duration::from_secs(180));
        let p = inst(Leg::Prefill, "10.0.0.1:1");
        let d = inst(Leg::Decode, "10.0.0.2:2");
        let pools = pools_of(&[&p], &[&d]);
        assert!(!w.pair_ready(&p, &d), "unknown: not ready");
        assert!(w.ready(&pools).paired(Leg::Decode).is_empty());
        put(
            &w,
            &(p.url.clone(), d.url.clone()),
            PairState::Failed {
                why: "handshake timed out".into(),
                attempt: 1,
                next_try: Instant::now() + Duration::from_secs(2),
            },
        );
        assert!(w.pending());
        let why = w.why_not(Leg::Decode);
        assert!(
            why.contains("handshake timed out") && why.contains(&d.url),
            "{why}"
        );
        put(
            &w,
            &(p.url.clone(), d.url.clone()),
            PairState::Ready {
                took: Duration::from_millis(40),
            },
        );
        assert!(w.pair_ready(&p, &d));
        assert_eq!(urls(w.ready(&pools).paired(Leg::Decode)), [d.url.as_str()]);
        assert_eq!(urls(w.ready(&pools).paired(Leg::Prefill)), [p.url.as_str()]);
        assert!(!w.pending());
        assert_eq!(w.views()[0].state, "ready");
        d.set_usable(false);
        d.set_usable(true);
        assert!(
            w.pair_ready(&p, &d),
            "out of rotation for a while (busy): the same process keeps its handshake"
        );
        assert!(!d.run.follow_report(Some(41), 0));
        assert!(d.run.follow_report(Some(42), 1));
        assert!(
            !w.pair_ready(&p, &d),
            "a restarted decode has no handshake with the prefill"
        );
        // A protocol without a lazy handshake routes every pair at once.
        assert!(Warmup::new(false, Duration::ZERO).pair_ready(&p, &d));
        assert!(Warmup::new(false, Duration::ZERO).settled());
    }

    #[test]
    fn backoff_doubles_from_a_second_to_half_a_minute() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(4), Duration::from_secs(8));
        assert_eq!(backoff(9), Duration::from_secs(30));
    }
}
