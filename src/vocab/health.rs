//! When a service counts as unable to serve, and when a node counts as cut off: the
//! topology's `[health]` table, carried by the plan to every supervisor. A busy engine
//! answers `/health` slowly (vLLM's CPU build under load: seconds, see docs/supervisor.md);
//! that is no evidence it cannot serve, and a node whose supervisor answers slowly is not
//! cut off. Pure data: the probes and the cut-off are decided where they run.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The probe timeout, the failed probes in a row that take a service out of rotation
/// (a refused connection does at once), and how long a node's control channel and its
/// services' ports must all go unanswered before it is cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSettings {
    /// Seconds one liveness probe (`GET /health`, a TCP connect) may take.
    pub probe_timeout_s: u32,
    /// Liveness probes failed in a row (no answer in time, an error status) after which a
    /// healthy service is `unhealthy` and leaves rotation. A refused or reset connection
    /// takes it out at the first probe: that is evidence, not slowness.
    pub failed_probes: u32,
    /// Seconds a node's supervisor must go unanswered AND no port of that node (its
    /// control channel, its services) take a TCP connection before the node is cut off
    /// and the legs in flight on it end.
    pub cut_off_after_s: u32,
}

impl Default for HealthSettings {
    fn default() -> Self {
        HealthSettings {
            probe_timeout_s: 10,
            failed_probes: HealthSettings::default_failed_probes(),
            cut_off_after_s: 6,
        }
    }
}

impl HealthSettings {
    /// The default `failed_probes` (a const, for the standalone proxy's own probes).
    pub const fn default_failed_probes() -> u32 {
        3
    }

    /// The settings by name, as the topology spells them (`health.NAME`).
    pub fn named(&self) -> [(&'static str, u32); 3] {
        [
            ("probe_timeout_s", self.probe_timeout_s),
            ("failed_probes", self.failed_probes),
            ("cut_off_after_s", self.cut_off_after_s),
        ]
    }

    /// The first setting that is 0, which cannot work (a probe that times out at once,
    /// a service out of rotation before any probe failed, a node cut off at once).
    pub fn first_zero(&self) -> Option<&'static str> {
        super::tcp::first_zero(&self.named())
    }

    /// Whether these are the defaults (left out of a plan's JSON then).
    pub fn is_default(&self) -> bool {
        *self == HealthSettings::default()
    }

    /// How long one probe may take.
    pub fn probe_timeout(&self) -> Duration {
        Duration::from_secs(self.probe_timeout_s.max(1).into())
    }

    /// How long a node's channel and ports must be silent before it is cut off.
    pub fn cut_off_after(&self) -> Duration {
        Duration::from_secs(self.cut_off_after_s.max(1).into())
    }
}
