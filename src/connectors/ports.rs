//! Port bookkeeping per host, so a plan never gives one port to two listeners.

use std::collections::BTreeMap;

/// Ports taken on each host address, with who took them.
#[derive(Debug, Clone, Default)]
pub struct PortBook {
    used: BTreeMap<String, BTreeMap<u16, String>>,
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

    /// Takes `width` consecutive free ports on `host`, the first at or above `base`, and
    /// returns the first (per-node ranges such as side-channel or bootstrap ports).
    /// `None` when the range would run past 65535.
    pub fn take(&mut self, host: &str, base: u16, width: u16, owner: &str) -> Option<u16> {
        let width = width.max(1);
        let ports = self.used.entry(host.to_string()).or_default();
        let mut start = u32::from(base);
        while start + u32::from(width) - 1 <= 65535 {
            let clash =
                (start..start + u32::from(width)).find(|p| ports.contains_key(&(*p as u16)));
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
}
