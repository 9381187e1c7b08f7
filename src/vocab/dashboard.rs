//! The live page of a running cluster (`[dashboard]`): whether the head's supervisor
//! serves it, and where. The topology writes it, the plan carries it, the command line
//! starts the page's server beside the supervisor and prints its address. Pure data.

use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// The dashboard's default port: its own, apart from the proxy's (8000) and the engines'.
pub const DEFAULT_DASHBOARD_PORT: u16 = 8265;

/// Where the head serves the cluster's live page. On loopback by default: bound beyond
/// it, the page's data asks for the cluster's client key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Dashboard {
    /// false: no page is served.
    pub enabled: bool,
    /// The address the page's server binds (an IP address).
    pub bind: String,
    pub port: u16,
}

impl Default for Dashboard {
    fn default() -> Self {
        Dashboard {
            enabled: true,
            bind: "127.0.0.1".into(),
            port: DEFAULT_DASHBOARD_PORT,
        }
    }
}

impl Dashboard {
    /// Whether these are the defaults (left out of a plan's JSON then).
    pub fn is_default(&self) -> bool {
        *self == Dashboard::default()
    }

    /// The bind address, when it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.bind.parse().ok()
    }

    /// True when only this machine can reach the page (127.0.0.0/8, ::1).
    pub fn loopback_only(&self) -> bool {
        self.ip().is_some_and(|ip| ip.is_loopback())
    }

    /// The address a browser opens: `http://127.0.0.1:8265`. A wildcard bind is shown at
    /// loopback (where the person who started it is).
    pub fn url(&self) -> String {
        let host = match self.ip() {
            Some(ip) if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".to_string(),
            Some(ip) if ip.is_unspecified() => "[::1]".to_string(),
            Some(IpAddr::V6(ip)) => format!("[{ip}]"),
            _ => self.bind.clone(),
        };
        format!("http://{host}:{}", self.port)
    }

    /// What is wrong with the table, as (key, message): a bind that is no IP address, port 0.
    pub fn problem(&self) -> Option<(&'static str, String)> {
        if self.ip().is_none() {
            return Some((
                "bind",
                format!(
                    "`{}` is not an IP address; write one, e.g. \"127.0.0.1\" (this machine only) or \"0.0.0.0\" (every address, the page then asks for the cluster's client key)",
                    self.bind
                ),
            ));
        }
        if self.port == 0 {
            return Some(("port", "must be a port number from 1 to 65535".into()));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_loopback_on_its_own_port() {
        let d = Dashboard::default();
        assert!(d.enabled && d.loopback_only() && d.is_default());
        assert_eq!(d.url(), "http://127.0.0.1:8265");
        assert_eq!(d.problem(), None);
    }

    #[test]
    fn a_wildcard_bind_is_opened_at_loopback_and_is_not_loopback_only() {
        let d = Dashboard {
            bind: "0.0.0.0".into(),
            port: 9000,
            ..Dashboard::default()
        };
        assert!(!d.loopback_only());
        assert_eq!(d.url(), "http://127.0.0.1:9000");
        let v6 = Dashboard {
            bind: "fe80::1".into(),
            ..Dashboard::default()
        };
        assert_eq!(v6.url(), "http://[fe80::1]:8265");
    }

    #[test]
    fn a_bind_that_is_no_address_and_port_zero_are_refused() {
        let d = Dashboard {
            bind: "localhost".into(),
            ..Dashboard::default()
        };
        assert_eq!(d.problem().map(|p| p.0), Some("bind"));
        let d = Dashboard {
            port: 0,
            ..Dashboard::default()
        };
        assert_eq!(d.problem().map(|p| p.0), Some("port"));
    }
}
