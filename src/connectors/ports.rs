//! Port bookkeeping per host, so a plan never gives one port to two listeners.

use std::collections::BTreeMap;

/// Ports taken on each host address, with who took them.
#[derive(Debug, Clone, Default)]
pub struct PortBook {
    used: BTreeMap<String, BTreeMap<u16, String>>,
    /// Ports the running cluster's listeners hold, by host and owner (`prefill-0
    /// (side-channel)`), when a change plans it again: each owner gets its own back, and
    /// nobody else is given one (a listener leaving the plan may still hold it while the
    /// new ones start).
    kept: BTreeMap<String, BTreeMap<u16, String>>,
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

    /// Keeps `port` on `host` for `owner`, as the running cluster has it (see `kept`).
    pub fn keep(&mut self, host: &str, port: u16, owner: &str) {
        self.kept
            .entry(host.to_string())
            .or_default()
            .insert(port, owner.to_string());
    }

    /// Takes `width` consecutive free ports on `host`, the first at or above `base`, and
    /// returns the first (per-node ranges such as side-channel or bootstrap ports): the
    /// range `owner` kept, when it still fits; never a port kept for another owner.
    /// `None` when the range would run past 65535.
    pub fn take(&mut self, host: &str, base: u16, width: u16, owner: &str) -> Option<u16> {
        let width = width.max(1);
        let no_kept = BTreeMap::new();
        let kept = self.kept.get(host).unwrap_or(&no_kept);
        let ports = self.used.entry(host.to_string()).or_default();
        let blocked = |p: u32| {
            let p = p as u16;
            ports.contains_key(&p) || kept.get(&p).is_some_and(|o| o != owner)
        };
        let own = kept
            .iter()
            .filter(|(p, o)| *o == owner && **p >= base)
            .map(|(p, _)| u32::from(*p))
            .next();
        let fits = |start: u32| {
            start + u32::from(width) - 1 <= 65535
                && !(start..start + u32::from(width)).any(&blocked)
        };
        let mut start = match own {
            Some(p) if fits(p) => p,
            _ => u32::from(base),
        };
        while start + u32::from(width) - 1 <= 65535 {
            let clash = (start..start + u32::from(width)).find(|p| blocked(*p));
            match clash {
                None => {
                    for p in start..start + u32::from(width) {
                        ports.insert(p as u16, owner.to_string());
                    }
                    return Some(start as u16);
                }
                Some(p) => start = p + 1,
            }
        }
        None
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
    fn a_kept_port_goes_back_to_its_owner_and_to_nobody_else() {
        // 1P2D ran: prefill-0 5600, decode-0 5601, decode-1 5602. Planned again as 2P1D
        // (placement order: prefill-0, prefill-1, decode-0).
        let mut b = PortBook::default();
        for (port, owner) in [(5600, "prefill-0"), (5601, "decode-0"), (5602, "decode-1")] {
            b.keep("h", port, &format!("{owner} (side-channel)"));
        }
        assert_eq!(b.take("h", 5600, 1, "prefill-0 (side-channel)"), Some(5600));
        // Not decode-0's, nor decode-1's (it may run while prefill-1 starts).
        assert_eq!(b.take("h", 5600, 1, "prefill-1 (side-channel)"), Some(5603));
        assert_eq!(b.take("h", 5600, 1, "decode-0 (side-channel)"), Some(5601));
        // Another host knows nothing of them.
        assert_eq!(b.take("g", 5600, 1, "decode-0 (side-channel)"), Some(5600));
        // A kept port below a new base is not kept; a kept range too narrow now moves.
        let mut b = PortBook::default();
        b.keep("h", 5557, "prefill-0 (side-channel)");
        assert_eq!(b.take("h", 5600, 1, "prefill-0 (side-channel)"), Some(5600));
        let mut b = PortBook::default();
        b.keep("h", 5600, "prefill-0 (side-channel)");
        b.keep("h", 5601, "decode-0 (side-channel)");
        assert_eq!(b.take("h", 5600, 2, "prefill-0 (side-channel)"), Some(5602));
    }
}
