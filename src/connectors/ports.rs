//! Port bookkeeping per host, so a plan never gives one port to two listeners.

use std::collections::BTreeMap;

/// Ports taken on each host address, with who took them.
#[derive(Debug, Clone, Default)]
pub struct PortBook {
    used: BTreeMap<String, BTreeMap<u16, String>>,
    /// Ports instances of a running cluster listen on, by host, with the instance's name:
    /// [`PortBook::take`] gives an instance back its own and no one else any of them (a
    /// change plans its wanted cluster with them, so a kept instance keeps its ports and a
    /// new one never starts on a port a running one holds).
    held: BTreeMap<String, BTreeMap<u16, String>>,
}

/// A port asked for twice on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clash {
    pub port: u16,
    /// Who had it first, e.g. `prefill-0 (http)`.
    pub holder: String,
}

impl PortBook {
    /// Records a port fixed by the topology; a clash names who holds it already.
    pub fn claim(&mut self, host: &str, port: u16, owner: &str) -> Result<(), Clash> {
        // A port the topology fixes is that one, whoever ran on it before.
        if let Some(held) = self.held.get_mut(host) {
            held.remove(&port);
        }
        let ports = self.used.entry(host.to_string()).or_default();
        if let Some(holder) = ports.get(&port) {
            return Err(Clash {
                port,
                holder: holder.clone(),
            });
        }
        ports.insert(port, owner.to_string());
        Ok(())
    }

    /// Says that instance `service` of the running cluster listens on `port` of `host`.
    pub fn hold(&mut self, host: &str, port: u16, service: &str) {
        let taken = self.used.get(host).is_some_and(|u| u.contains_key(&port));
        if !taken {
            let held = self.held.entry(host.to_string()).or_default();
            held.insert(port, service.to_string());
        }
    }

    /// Takes `width` consecutive free ports on `host`, the first at or above `base`, and
    /// returns the first (per-node ranges such as side-channel or bootstrap ports).
    /// `owner` is `NAME (what)`: the range instance NAME holds in the running cluster, when
    /// it holds one that fits, else the first range no one holds or took. `None` when the
    /// range would run past 65535.
    pub fn take(&mut self, host: &str, base: u16, width: u16, owner: &str) -> Option<u16> {
        let width = width.max(1);
        let service = owner.split(" (").next().unwrap_or(owner);
        let empty = BTreeMap::new();
        let held = self.held.get(host).unwrap_or(&empty);
        let range = |start: u32| start..start + u32::from(width);
        let own = held
            .iter()
            .filter(|(p, s)| **p >= base && s.as_str() == service)
            .map(|(p, _)| u32::from(*p))
            .find(|start| {
                range(*start)
                    .all(|p| p <= 65535 && held.get(&(p as u16)).is_some_and(|s| s == service))
            });
        let ports = self.used.entry(host.to_string()).or_default();
        let busy = |p: u32| {
            ports.contains_key(&(p as u16)) || held.get(&(p as u16)).is_some_and(|s| s != service)
        };
        let mut start = own.unwrap_or(u32::from(base));
        let found = loop {
            if start + u32::from(width) - 1 > 65535 {
                break None;
            }
            match range(start).find(|p| busy(*p)) {
                None => break Some(start),
                Some(p) => start = p + 1,
            }
        };
        let first = found?;
        for p in range(first) {
            ports.insert(p as u16, owner.to_string());
        }
        if let Some(held) = self.held.get_mut(host) {
            held.retain(|p, _| !range(first).contains(&u32::from(*p)));
        }
        Some(first as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_clash_only_on_the_same_host() {
        let mut b = PortBook::default();
        b.claim("10.0.0.1", 8100, "prefill-0 (http)").unwrap();
        b.claim("10.0.0.2", 8100, "prefill-1 (http)").unwrap();
        let c = b.claim("10.0.0.1", 8100, "proxy (http)").unwrap_err();
        assert_eq!(c.holder, "prefill-0 (http)");
    }

    #[test]
    fn takes_the_next_free_range() {
        let mut b = PortBook::default();
        b.claim("h", 5601, "x").unwrap();
        assert_eq!(b.take("h", 5600, 1, "a"), Some(5600));
        // 5601 is held, so a width-2 range starts after it.
        assert_eq!(b.take("h", 5600, 2, "b"), Some(5602));
        assert_eq!(b.take("h", 5600, 1, "c"), Some(5604));
        assert_eq!(b.take("h", 65535, 2, "d"), None);
    }

    #[test]
    fn an_instance_gets_back_the_range_it_holds_and_no_one_takes_a_held_port() {
        let mut b = PortBook::default();
        // Running: prefill-0 5600, decode-0 5602-5603 (two ranks), decode-1 5601.
        b.hold("h", 5600, "prefill-0");
        b.hold("h", 5601, "decode-1");
        b.hold("h", 5602, "decode-0");
        b.hold("h", 5603, "decode-0");
        assert_eq!(b.take("h", 5600, 1, "prefill-0 (side-channel)"), Some(5600));
        // A new instance planned before decode-0 does not take its ports, nor decode-1's.
        assert_eq!(b.take("h", 5600, 1, "prefill-1 (side-channel)"), Some(5604));
        assert_eq!(b.take("h", 5600, 2, "decode-0 (side-channel)"), Some(5602));
        // A range it holds that no longer fits (now three ranks) is not kept.
        let mut c = PortBook::default();
        c.hold("h", 5600, "decode-0");
        c.hold("h", 5601, "decode-0");
        c.hold("h", 5602, "decode-1");
        assert_eq!(c.take("h", 5600, 3, "decode-0 (side-channel)"), Some(5603));
        // A port the topology fixes wins over a held one.
        let mut d = PortBook::default();
        d.hold("h", 8000, "decode-3");
        d.claim("h", 8000, "proxy (http)").unwrap();
        assert_eq!(d.take("h", 8000, 1, "decode-3 (side-channel)"), Some(8001));
    }
}
