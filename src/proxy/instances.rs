//! The engine endpoints the proxy routes to, with the live facts routing needs about
//! each: usable or not, requests in flight, engine-reported load, and error counts.

pub use super::endpoint::{Endpoint, EndpointError, parse_endpoint};
use super::engine_run::routing_changed;
pub use super::leg::{FailureKind, Leg};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Marker for "the engine's load has not been scraped (yet)".
const LOAD_UNKNOWN: u32 = u32::MAX;

/// One engine endpoint (a vLLM or sim HTTP server) and its live state.
#[derive(Debug)]
pub struct Instance {
    pub leg: Leg,
    /// Position in its leg's list (stable: policies and the prefix table use it).
    pub index: usize,
    /// Normalized base URL, `http://host:port`, no trailing slash.
    pub url: String,
    /// `host:port` as written in the URL, what `user` designation matches.
    pub host_port: String,
    pub host: String,
    pub port: u16,
    /// Mooncake bootstrap port of a prefill instance (protocol `mooncake`).
    pub bootstrap_port: Option<u16>,
    /// The DNS name (`--prefill-dns NAME:PORT`) this instance's address came from; such an
    /// instance leaves when the name stops listing its address.
    pub dns_name: Option<String>,
    in_flight: AtomicUsize,
    usable: AtomicBool,
    engine_load: AtomicU32,
    selected: AtomicU64,
    failures: [AtomicU64; 4],
    consecutive_failures: AtomicU32,
    consecutive_successes: AtomicU32,
    supervised: AtomicBool,
    /// A leg on it was answered 2xx since the last probe round (health.rs).
    answered: AtomicBool,
    /// The supervisor says it is starting or restarting: worth waiting for.
    coming_back: AtomicBool,
    /// Why it was last taken out of rotation, for the error when no instance is left.
    out_reason: std::sync::Mutex<String>,
    /// KV handoffs due to it as a decode, and what its counters showed (recompute.rs).
    pub ledger: super::recompute::ledger::HandoffLedger,
    /// Whether it can be reached at all: the legs on it end when it cannot (reach.rs).
    pub reach: super::reach::Reach,
    /// Whether (since when) its supervisor says it drains: streams past the grace move.
    pub drained: super::reach::Drained,
    /// Which run of its engine this is: pairs warmed with another run are warmed again.
    pub run: super::engine_run::EngineRun,
}

impl Instance {
    /// A new instance, usable until health checks say otherwise.
    pub fn new(leg: Leg, index: usize, endpoint: Endpoint, bootstrap_port: Option<u16>) -> Self {
        Instance {
            leg,
            index,
            url: endpoint.url,
            host_port: format!("{}:{}", endpoint.host, endpoint.port),
            host: endpoint.host,
            port: endpoint.port,
            bootstrap_port,
            dns_name: None,
            in_flight: AtomicUsize::new(0),
            usable: AtomicBool::new(true),
            engine_load: AtomicU32::new(LOAD_UNKNOWN),
            selected: AtomicU64::new(0),
            failures: Default::default(),
            consecutive_failures: AtomicU32::new(0),
            consecutive_successes: AtomicU32::new(0),
            supervised: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            coming_back: AtomicBool::new(false),
            out_reason: std::sync::Mutex::new(String::new()),
            ledger: Default::default(),
            reach: Default::default(),
            drained: Default::default(),
            run: Default::default(),
        }
    }

    /// Records why the instance was taken out of rotation.
    pub fn set_out_reason(&self, why: &str) {
        *self.out_reason.lock().unwrap_or_else(|p| p.into_inner()) = why.to_string();
    }

    /// Why the instance was last taken out of rotation ("not usable" if never said).
    pub fn out_reason(&self) -> String {
        let why = self.out_reason.lock().unwrap_or_else(|p| p.into_inner());
        if why.is_empty() {
            "not usable".to_string()
        } else {
            why.clone()
        }
    }

    /// Whether a supervisor's status report currently decides this instance's health
    /// (then own probes leave it alone).
    pub fn is_supervised(&self) -> bool {
        self.supervised.load(Ordering::Relaxed)
    }

    /// Records whether the supervisor's report covers this instance.
    pub fn set_supervised(&self, supervised: bool) {
        self.supervised.store(supervised, Ordering::Relaxed);
    }

    /// Whether the supervisor reports it on its way (back) up, so a request may wait for it.
    pub fn is_coming_back(&self) -> bool {
        self.coming_back.load(Ordering::Relaxed)
    }

    /// Records whether it is on its way (back) up.
    pub fn set_coming_back(&self, yes: bool) {
        self.coming_back.store(yes, Ordering::Relaxed);
    }

    /// Whether routing may send requests here now.
    pub fn is_usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    /// Sets usability directly (supervisor feed, first probe, passive marking).
    /// Returns true when this changed the state.
    pub fn set_usable(&self, usable: bool) -> bool {
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.consecutive_successes.store(0, Ordering::Relaxed);
        let changed = self.usable.swap(usable, Ordering::Relaxed) != usable;
        if changed {
            routing_changed();
        }
        changed
    }

    /// Records one health probe result; the instance goes down after `down_after`
    /// failures in a row and up after `up_after` successes in a row.
    /// Returns true when this changed the state.
    pub fn record_probe(&self, ok: bool, down_after: u32, up_after: u32) -> bool {
        if ok {
            self.consecutive_failures.store(0, Ordering::Relaxed);
            let n = self.consecutive_successes.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.is_usable() && n >= up_after {
                self.usable.store(true, Ordering::Relaxed);
                routing_changed();
                return true;
            }
        } else {
            self.consecutive_successes.store(0, Ordering::Relaxed);
            let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if self.is_usable() && n >= down_after {
                self.usable.store(false, Ordering::Relaxed);
                routing_changed();
                return true;
            }
        }
        false
    }

    /// Notes that a leg on it was answered 2xx: as good as a health probe that passed, so
    /// an instance that serves requests is not probed as well (at 64P64D the probes were
    /// a sixth of the proxy's CPU per request). Read first: a request that finds it set
    /// writes nothing.
    pub fn note_answered(&self) {
        if !self.answered.load(Ordering::Relaxed) {
            self.answered.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a leg on it was answered 2xx since the last call (health.rs, once a round).
    pub fn take_answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed) && self.answered.swap(false, Ordering::Relaxed)
    }

    /// Requests this proxy has on this instance right now (until their responses end).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Running + waiting requests the engine last reported, if scraped.
    pub fn engine_load(&self) -> Option<u32> {
        match self.engine_load.load(Ordering::Relaxed) {
            LOAD_UNKNOWN => None,
            n => Some(n),
        }
    }

    /// Stores the engine-reported load (None = unknown, e.g. scrape failed).
    pub fn set_engine_load(&self, load: Option<u32>) {
        let v = load.map_or(LOAD_UNKNOWN, |n| n.min(LOAD_UNKNOWN - 1));
        self.engine_load.store(v, Ordering::Relaxed);
    }

    /// The load least-loaded routing compares: own in-flight count, or the engine's
    /// own count when it is higher (other clients, or requests not yet visible here).
    pub fn load(&self) -> usize {
        let own = self.in_flight();
        self.engine_load().map_or(own, |e| own.max(e as usize))
    }

    /// Times routing chose this instance.
    pub fn selected(&self) -> u64 {
        self.selected.load(Ordering::Relaxed)
    }

    /// Failures of one kind seen on this instance.
    pub fn failures(&self, kind: FailureKind) -> u64 {
        self.failures[kind as usize].load(Ordering::Relaxed)
    }

    /// Counts one failure of a leg on this instance.
    pub fn record_failure(&self, kind: FailureKind) {
        self.failures[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Marks this instance as chosen for a request and counts it in flight until the
    /// returned guard is dropped (which is when the response stream ends).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.selected.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

/// Holds one request in an instance's in-flight count; dropping it ends the count.
#[derive(Debug)]
pub struct InFlight(Arc<Instance>);

impl InFlight {
    /// The instance this guard counts on.
    pub fn instance(&self) -> &Arc<Instance> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The prefill and decode instances, in the order they were given.
#[derive(Debug)]
pub struct Pools {
    pub prefill: Vec<Arc<Instance>>,
    pub decode: Vec<Arc<Instance>>,
}

impl Pools {
    /// The instances of one leg.
    pub fn of(&self, leg: Leg) -> &[Arc<Instance>] {
        match leg {
            Leg::Prefill => &self.prefill,
            Leg::Decode => &self.decode,
        }
    }

    /// Every instance, prefill first.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Instance>> {
        self.prefill.iter().chain(self.decode.iter())
    }

    /// The instance of `leg` whose `host:port` is `host_port` (host compared without case).
    pub fn find(&self, leg: Leg, host_port: &str) -> Option<&Arc<Instance>> {
        let wanted = host_port.trim().to_ascii_lowercase();
        self.of(leg)
            .iter()
            .find(|i| i.host_port.to_ascii_lowercase() == wanted)
    }
}

/// The instances routing sees now. Instances listed with `--prefill` / `--decode` stay for
/// the proxy's life; those found through DNS names (`--prefill-dns`) come and go as the
/// names' addresses do, so a request takes one [`LivePools::snapshot`] and works on it.
#[derive(Debug)]
pub struct LivePools {
    current: std::sync::RwLock<Arc<Pools>>,
    /// The next index to give a new instance of each leg: indexes are never reused, so the
    /// prefix table and the tried-list never mistake a new pod for one that left.
    next_index: [AtomicUsize; 2],
}

impl LivePools {
    /// Starts from a fixed set of instances (their indexes are taken as given).
    pub fn new(pools: Pools) -> LivePools {
        let next = |v: &[Arc<Instance>]| {
            AtomicUsize::new(v.iter().map(|i| i.index + 1).max().unwrap_or(0))
        };
        LivePools {
            next_index: [next(&pools.prefill), next(&pools.decode)],
            current: std::sync::RwLock::new(Arc::new(pools)),
        }
    }

    /// The instances as they are now; later changes do not touch a snapshot already taken.
    pub fn snapshot(&self) -> Arc<Pools> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A fresh index for a new instance of `leg`.
    pub fn next_index(&self, leg: Leg) -> usize {
        self.next_index[leg as usize].fetch_add(1, Ordering::Relaxed)
    }

    /// Replaces the instances of `leg` by `f`'s answer to the current ones.
    pub fn update(&self, leg: Leg, f: impl FnOnce(&[Arc<Instance>]) -> Vec<Arc<Instance>>) {
        let mut guard = self.current.write().unwrap_or_else(|p| p.into_inner());
        let mut next = Pools {
            prefill: guard.prefill.clone(),
            decode: guard.decode.clone(),
        };
        match leg {
            Leg::Prefill => next.prefill = f(&guard.prefill),
            Leg::Decode => next.decode = f(&guard.decode),
        }
        *guard = Arc::new(next);
        drop(guard);
        routing_changed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_needs_n_failures_to_go_down_and_m_successes_to_come_back() {
        let i = Instance::new(Leg::Decode, 0, parse_endpoint("h:1").unwrap(), None);
        assert!(!i.record_probe(false, 3, 2));
        assert!(!i.record_probe(false, 3, 2));
        assert!(i.is_usable());
        assert!(i.record_probe(false, 3, 2));
        assert!(!i.is_usable());
        assert!(!i.record_probe(true, 3, 2));
        assert!(!i.is_usable());
        assert!(i.record_probe(true, 3, 2));
        assert!(i.is_usable());
    }

    #[test]
    fn in_flight_lasts_as_long_as_the_guard() {
        let i = Arc::new(Instance::new(
            Leg::Decode,
            0,
            parse_endpoint("h:1").unwrap(),
            None,
        ));
        let g = i.begin();
        let g2 = i.begin();
        assert_eq!(i.in_flight(), 2);
        drop(g);
        assert_eq!(i.in_flight(), 1);
        drop(g2);
        assert_eq!((i.in_flight(), i.selected()), (0, 2));
    }

    #[test]
    fn load_takes_the_higher_of_own_and_engine_counts() {
        let i = Arc::new(Instance::new(
            Leg::Decode,
            0,
            parse_endpoint("h:1").unwrap(),
            None,
        ));
        let _g = i.begin();
        assert_eq!(i.load(), 1);
        i.set_engine_load(Some(7));
        assert_eq!(i.load(), 7);
        i.set_engine_load(Some(0));
        assert_eq!(i.load(), 1);
    }
}
