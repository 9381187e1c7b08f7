//! How connections to another machine find that the peer went silent: TCP keepalive and
//! a user timeout (TCP_USER_TIMEOUT). The topology's `[network]` table writes them, the
//! plan carries them, the proxy sets them on its legs' connections and the supervisors on
//! their probes of other nodes' services. Pure data: the sockets are set where they open.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Keepalive and user timeout of connections to other machines. The defaults find a dead
/// peer in about 10 s: an idle connection is probed after 4 s, then every 2 s, and given
/// up after 3 unanswered probes; data unacknowledged for 10 s ends the connection too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpLiveness {
    /// Seconds a connection may stay silent before the first keepalive probe.
    pub tcp_keepalive_idle_s: u32,
    /// Seconds between keepalive probes.
    pub tcp_keepalive_interval_s: u32,
    /// Unanswered keepalive probes that end the connection.
    pub tcp_keepalive_count: u32,
    /// Seconds sent data may stay unacknowledged before the connection ends.
    pub tcp_user_timeout_s: u32,
    /// Authenticated connections one node may hold open to another's control channel at
    /// once (it needs one kept for its polls and a few short ones): a node whose key
    /// leaked, or that misbehaves, cannot hold more (each may hold a 1 MiB request).
    pub control_connections_per_node: u32,
    /// Authenticated connections a node's control channel holds open in all.
    pub control_connections: u32,
}

impl Default for TcpLiveness {
    fn default() -> Self {
        TcpLiveness {
            tcp_keepalive_idle_s: 4,
            tcp_keepalive_interval_s: 2,
            tcp_keepalive_count: 3,
            tcp_user_timeout_s: 10,
            control_connections_per_node: 16,
            control_connections: 256,
        }
    }
}

impl TcpLiveness {
    /// The settings by name (as the topology and the proxy's flags spell them), for checks.
    pub fn named(&self) -> [(&'static str, u32); 4] {
        [
            ("tcp_keepalive_idle_s", self.tcp_keepalive_idle_s),
            ("tcp_keepalive_interval_s", self.tcp_keepalive_interval_s),
            ("tcp_keepalive_count", self.tcp_keepalive_count),
            ("tcp_user_timeout_s", self.tcp_user_timeout_s),
        ]
    }

    /// The first setting that is 0, which cannot work (no keepalive probe, a timeout that
    /// fires at once): the one rule for them, which the topology (`network.NAME`) and the
    /// proxy's flags (`--tcp-...`) both apply.
    /// The control channel's caps are held to the same rule (0 would refuse every node).
    pub fn first_zero(&self) -> Option<&'static str> {
        first_zero(&self.named()).or_else(|| {
            first_zero(&[
                (
                    "control_connections_per_node",
                    self.control_connections_per_node,
                ),
                ("control_connections", self.control_connections),
            ])
        })
    }

    /// Whether these are the defaults (left out of a plan's JSON then).
    pub fn is_default(&self) -> bool {
        *self == TcpLiveness::default()
    }

    /// Silence before the first keepalive probe.
    pub fn keepalive_idle(&self) -> Duration {
        Duration::from_secs(self.tcp_keepalive_idle_s.into())
    }

    /// Time between keepalive probes.
    pub fn keepalive_interval(&self) -> Duration {
        Duration::from_secs(self.tcp_keepalive_interval_s.into())
    }

    /// How long sent data may go unacknowledged.
    pub fn user_timeout(&self) -> Duration {
        Duration::from_secs(self.tcp_user_timeout_s.into())
    }

    /// How long a connection to a peer that went silent lasts at most: keepalive's idle
    /// time and probes, or the user timeout, whichever ends it first.
    pub fn dead_peer_found_within(&self) -> Duration {
        let keepalive =
            self.keepalive_idle() + self.keepalive_interval() * self.tcp_keepalive_count;
        keepalive.min(self.user_timeout().max(self.keepalive_idle()))
    }
}

/// The name of the first setting in `named` that is 0: the one rule of settings for which 0
/// cannot work (here and in `[health]`).
pub fn first_zero(named: &[(&'static str, u32)]) -> Option<&'static str> {
    named.iter().find(|(_, v)| *v == 0).map(|(name, _)| *name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_find_a_dead_peer_in_about_ten_seconds() {
        let d = TcpLiveness::default();
        assert_eq!(d.dead_peer_found_within(), Duration::from_secs(10));
        let t: TcpLiveness = toml::from_str("tcp_user_timeout_s = 30").unwrap();
        assert_eq!(t.tcp_keepalive_idle_s, 4);
        assert_eq!(t.dead_peer_found_within(), Duration::from_secs(10));
        assert!(toml::from_str::<TcpLiveness>("keepalive = 1").is_err());
    }
}
