//! Engines found by DNS name (`--prefill-dns NAME:PORT`, `--decode-dns NAME:PORT`): every
//! address the name resolves to is one instance. On Kubernetes a headless Service resolves
//! to one address per ready pod, so looking the name up again every health interval makes
//! the proxy follow pods that come, go or move, with nothing but DNS.
//!
//! A name that does not resolve yet is not an error: the proxy starts, answers 503 for the
//! leg until an address appears, and keeps looking. Addresses that vanish from the answer
//! leave routing at once; when the name stops resolving at all, its instances stay (health
//! probes take dead ones out of rotation) until [`FORGET_AFTER`] lookups in a row failed.
//!
//! Tests (and anyone who must pin a name) can point `PDCTL_PROXY_HOSTS_FILE` at a file in
//! /etc/hosts format: a name listed there resolves to the addresses there, read afresh at
//! every lookup, before the system resolver is asked.

use super::Proxy;
use super::config::ConfigError;
use super::instances::{EndpointError, Instance, Leg, parse_endpoint};
use crate::child_config::proxy::ProxyArgs;
use crate::vocab::ProxyProtocol;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Names an /etc/hosts-format file consulted before the system resolver.
pub const HOSTS_FILE_ENV: &str = "PDCTL_PROXY_HOSTS_FILE";

/// Failed lookups in a row after which a name's instances are dropped.
pub const FORGET_AFTER: u32 = 3;

/// One `--prefill-dns` / `--decode-dns` value.
#[derive(Debug)]
pub struct DnsSource {
    pub leg: Leg,
    /// The name as given (`prefill.ns.svc.cluster.local`).
    pub name: String,
    /// The port every address serves on.
    pub port: u16,
    /// The Mooncake bootstrap port of every instance found (protocol `mooncake`).
    pub bootstrap_port: Option<u16>,
    /// Lookups that failed in a row (said once when it starts, once when it ends).
    failures: AtomicU32,
}

impl DnsSource {
    /// Parses `NAME:PORT` (an `http://` prefix is allowed) for the flag named `flag`.
    pub fn parse(
        leg: Leg,
        flag: &'static str,
        raw: &str,
        bootstrap_port: Option<u16>,
    ) -> Result<DnsSource, ConfigError> {
        let e = parse_endpoint(raw).map_err(|source| ConfigError::Endpoint { flag, source })?;
        if e.host.parse::<IpAddr>().is_ok() || e.host.starts_with('[') {
            return Err(ConfigError::Endpoint {
                flag,
                source: EndpointError::Malformed(format!(
                    "{raw} (an address, not a name: give it with --{})",
                    leg.as_str()
                )),
            });
        }
        Ok(DnsSource {
            leg,
            name: e.host,
            port: e.port,
            bootstrap_port,
            failures: AtomicU32::new(0),
        })
    }

    /// `NAME:PORT`, as logs and errors say it.
    pub fn spelled(&self) -> String {
        format!("{}:{}", self.name, self.port)
    }
}

/// The DNS names to follow (`--prefill-dns`, `--decode-dns`), each checked.
pub fn dns_sources(args: &ProxyArgs) -> Result<Vec<DnsSource>, ConfigError> {
    let boot = (args.protocol == ProxyProtocol::Mooncake)
        .then(|| args.bootstrap_ports.get(args.prefill.len()).copied())
        .flatten();
    let mut out = Vec::new();
    for raw in &args.prefill_dns {
        out.push(DnsSource::parse(Leg::Prefill, "prefill-dns", raw, boot)?);
    }
    for raw in &args.decode_dns {
        out.push(DnsSource::parse(Leg::Decode, "decode-dns", raw, None)?);
    }
    for (i, s) in out.iter().enumerate() {
        if out[..i]
            .iter()
            .any(|o| o.name.eq_ignore_ascii_case(&s.name) && o.port == s.port)
        {
            return Err(ConfigError::Duplicate {
                flag: if s.leg == Leg::Prefill {
                    "prefill-dns"
                } else {
                    "decode-dns"
                },
                url: s.spelled(),
            });
        }
    }
    Ok(out)
}

/// The addresses `name` has in the file `PDCTL_PROXY_HOSTS_FILE` names, if it lists it.
fn from_hosts_file(name: &str) -> Option<Vec<IpAddr>> {
    let path = std::env::var_os(HOSTS_FILE_ENV)?;
    let text = std::fs::read_to_string(path).ok()?;
    let found: Vec<IpAddr> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let ip: IpAddr = words.next()?.parse().ok()?;
            words.any(|w| w.eq_ignore_ascii_case(name)).then_some(ip)
        })
        .collect();
    (!found.is_empty()).then_some(found)
}

/// Why a name gave no addresses this time (the proxy logs it and looks again).
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("the name has no address")]
    NoAddress,
    #[error("{0}")]
    Failed(#[from] std::io::Error),
    #[error("the lookup took longer than 5 s")]
    TimedOut,
}

/// Every address `name` resolves to now, sorted and without repeats.
pub async fn resolve(name: &str, port: u16) -> Result<BTreeSet<IpAddr>, LookupError> {
    if let Some(ips) = from_hosts_file(name) {
        return Ok(ips.into_iter().collect());
    }
    let lookup = tokio::net::lookup_host((name, port));
    match tokio::time::timeout(std::time::Duration::from_secs(5), lookup).await {
        Ok(Ok(addrs)) => {
            let ips: BTreeSet<IpAddr> = addrs.map(|a| a.ip()).collect();
            if ips.is_empty() {
                Err(LookupError::NoAddress)
            } else {
                Ok(ips)
            }
        }
        Ok(Err(e)) => Err(LookupError::Failed(e)),
        Err(_) => Err(LookupError::TimedOut),
    }
}

/// Looks `src` up once and brings its instances in line with the answer: new addresses
/// become instances (probed once before routing uses them), vanished ones leave.
pub async fn refresh(p: &Arc<Proxy>, src: &DnsSource) {
    let ips = match resolve(&src.name, src.port).await {
        Ok(ips) => {
            if src.failures.swap(0, Ordering::Relaxed) >= 1 {
                tracing::info!("{} name {} resolves again", src.leg, src.spelled());
            }
            ips
        }
        Err(e) => {
            let n = src.failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n == 1 {
                tracing::warn!(
                    "{} name {} does not resolve ({e}); looking again every health interval",
                    src.leg,
                    src.spelled()
                );
            }
            if n == FORGET_AFTER {
                apply(p, src, &BTreeSet::new()).await;
            }
            return;
        }
    };
    apply(p, src, &ips).await;
}

/// Makes the instances found by `src` exactly those at `ips`.
async fn apply(p: &Arc<Proxy>, src: &DnsSource, ips: &BTreeSet<IpAddr>) {
    let urls: BTreeSet<String> = ips
        .iter()
        .map(|ip| format!("http://{}", SocketAddr::new(*ip, src.port)))
        .collect();
    let mut added: Vec<Arc<Instance>> = Vec::new();
    let mut removed: Vec<String> = Vec::new();
    p.pools.update(src.leg, |now| {
        let mine = |i: &Arc<Instance>| i.dns_name.as_deref() == Some(src.name.as_str());
        let mut next: Vec<Arc<Instance>> = Vec::new();
        for i in now {
            if mine(i) && !urls.contains(&i.url) {
                removed.push(i.url.clone());
            } else {
                next.push(i.clone());
            }
        }
        for url in &urls {
            // An address also listed by hand (or by another name) is one instance.
            if next.iter().any(|i| &i.url == url) {
                continue;
            }
            let Ok(endpoint) = parse_endpoint(url) else {
                continue;
            };
            let mut inst = Instance::new(
                src.leg,
                p.pools.next_index(src.leg),
                endpoint,
                src.bootstrap_port,
            );
            inst.dns_name = Some(src.name.clone());
            inst.set_usable(false);
            inst.set_out_reason("just found by DNS, not probed yet");
            let inst = Arc::new(inst);
            added.push(inst.clone());
            next.push(inst);
        }
        next
    });
    for url in &removed {
        tracing::info!(
            "{} instance {url} left: {} no longer lists it",
            src.leg,
            src.spelled()
        );
    }
    for inst in &added {
        tracing::info!(
            "{} instance {} found through {}",
            src.leg,
            inst.url,
            src.spelled()
        );
    }
    if !added.is_empty() {
        super::health::first_look(p, &added).await;
    }
}

/// One lookup of every name (done before the proxy serves, so instances that resolve at
/// start are there for the first request).
pub async fn refresh_all(p: &Arc<Proxy>) {
    let sources = &p.dns;
    futures_util::future::join_all(sources.iter().map(|s| refresh(p, s))).await;
}

/// Looks every name up again every health interval, forever.
pub fn start(p: Arc<Proxy>) {
    if p.dns.is_empty() {
        return;
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(p.settings().health_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            refresh_all(&p).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::pools;
    use crate::proxy::config::tests::args;

    #[test]
    fn names_may_stand_for_the_instances_and_mooncake_needs_their_bootstrap_port() {
        let a = args(&[
            "--prefill-dns",
            "pd-prefill:8100",
            "--decode-dns",
            "pd-decode:8200",
        ]);
        assert!(pools(&a).unwrap().prefill.is_empty());
        let names: Vec<String> = dns_sources(&a)
            .unwrap()
            .iter()
            .map(|s| s.spelled())
            .collect();
        assert_eq!(names, ["pd-prefill:8100", "pd-decode:8200"]);
        let a = args(&[
            "--prefill-dns",
            "pd-prefill:8100",
            "--decode",
            "h:3",
            "--protocol",
            "mooncake",
        ]);
        let e = pools(&a).unwrap_err().to_string();
        assert!(
            e.contains("plus one for the instances --prefill-dns finds"),
            "{e}"
        );
        let a = args(&[
            "--prefill-dns",
            "pd-prefill:8100",
            "--decode",
            "h:3",
            "--protocol",
            "mooncake",
            "--bootstrap-port",
            "8998",
        ]);
        assert_eq!(dns_sources(&a).unwrap()[0].bootstrap_port, Some(8998));
    }

    #[test]
    fn a_dns_source_is_a_name_and_a_port() {
        let s = DnsSource::parse(Leg::Prefill, "prefill-dns", "pd-prefill:8100", None).unwrap();
        assert_eq!((s.name.as_str(), s.port), ("pd-prefill", 8100));
        let e = DnsSource::parse(Leg::Prefill, "prefill-dns", "10.0.0.1:8100", None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--prefill-dns") && e.contains("--prefill"),
            "{e}"
        );
        let e = DnsSource::parse(Leg::Decode, "decode-dns", "pd-decode", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no port"), "{e}");
    }
}
