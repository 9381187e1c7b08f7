//! The head's rebalancer as the proxy last saw it in its supervisor's report (the proxy
//! asks for one every few seconds to follow health): the split, the mode and the moves
//! counted, written on `/metrics` as `pdctl_proxy_rebalance_*` so a dashboard can put
//! the split and its moves beside the latencies that caused them. No supervisor, or no
//! `[rebalance]` table: the families are there, without series.

use crate::vocab::{MoveCounts, MoveOutcome, RebalanceMode, RebalanceReport, Split};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

/// What the last report said of the rebalancer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seen {
    mode: RebalanceMode,
    split: Split,
    counted: MoveCounts,
}

/// The last report's rebalancer, shared by the families that write it.
#[derive(Debug, Clone, Default)]
pub struct RebalanceSeen(Arc<Mutex<Option<Seen>>>);

impl RebalanceSeen {
    /// Keeps what `report` says (None: the cluster has no rebalancer).
    pub fn set(&self, report: Option<&RebalanceReport>) {
        let seen = report.map(|r| Seen {
            mode: r.mode,
            split: r.split,
            counted: r.moves_counted,
        });
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = seen;
    }

    fn get(&self) -> Option<Seen> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The families, as (name, help, family) for the registry.
    pub fn families(&self) -> [(&'static str, &'static str, Family); 5] {
        let f = |kind, write| Family {
            seen: self.clone(),
            kind,
            write,
        };
        [
            (
                "rebalance_instances",
                "Instances per role in the split the head's rebalancer last read (its [rebalance] table)",
                f(MetricType::Gauge, instances),
            ),
            (
                "rebalance_mode",
                "The head's rebalancer mode: 1 for the one it is in (off, advise, act)",
                f(MetricType::Gauge, mode),
            ),
            (
                "rebalance_moves",
                "Moves the head's rebalancer set out to make since its supervisor started, by the role each was to gain, whatever its outcome (pdctl_proxy_rebalance_moves_by_outcome_total says how they ended)",
                f(MetricType::Counter, moves),
            ),
            (
                "rebalance_moves_failed",
                "Of those moves, the ones that moved nothing: their change was refused (as stale too) or failed",
                f(MetricType::Counter, failed),
            ),
            (
                "rebalance_moves_by_outcome",
                "Moves of the head's rebalancer since its supervisor started, by how their change ended: done (the split moved), failed (refused or failed), refused_as_stale (another change had moved the split since the figures were judged), not_started (the change was refused before it began)",
                f(MetricType::Counter, by_outcome),
            ),
        ]
    }
}

/// How a family writes its series from what was seen.
type Write = fn(&Seen, MetricEncoder) -> fmt::Result;

/// One `pdctl_proxy_rebalance_*` family.
#[derive(Debug)]
pub struct Family {
    seen: RebalanceSeen,
    kind: MetricType,
    write: Write,
}

impl EncodeMetric for Family {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        match self.seen.get() {
            Some(seen) => (self.write)(&seen, encoder),
            None => Ok(()),
        }
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

fn instances(s: &Seen, mut e: MetricEncoder) -> fmt::Result {
    for (role, n) in [("prefill", s.split.prefill), ("decode", s.split.decode)] {
        ConstGauge::new(i64::from(n)).encode(e.encode_family(&[("role", role)])?)?;
    }
    Ok(())
}

fn mode(s: &Seen, mut e: MetricEncoder) -> fmt::Result {
    for m in [
        RebalanceMode::Off,
        RebalanceMode::Advise,
        RebalanceMode::Act,
    ] {
        let on = i64::from(m == s.mode);
        ConstGauge::new(on).encode(e.encode_family(&[("mode", m.as_str())])?)?;
    }
    Ok(())
}

fn moves(s: &Seen, mut e: MetricEncoder) -> fmt::Result {
    let c = s.counted;
    for (toward, n) in [("prefill", c.toward_prefill), ("decode", c.toward_decode)] {
        ConstCounter::new(n).encode(e.encode_family(&[("toward", toward)])?)?;
    }
    Ok(())
}

fn failed(s: &Seen, e: MetricEncoder) -> fmt::Result {
    ConstCounter::new(s.counted.failed).encode(e)
}

fn by_outcome(s: &Seen, mut e: MetricEncoder) -> fmt::Result {
    for (label, outcome) in [
        ("done", MoveOutcome::Done),
        ("failed", MoveOutcome::Failed),
        ("refused_as_stale", MoveOutcome::Stale),
        ("not_started", MoveOutcome::NotStarted),
    ] {
        let n = s.counted.ended(outcome);
        ConstCounter::new(n).encode(e.encode_family(&[("outcome", label)])?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Figures, Toward};
    use prometheus_client::registry::Registry;

    fn page(seen: &RebalanceSeen) -> String {
        let mut r = Registry::with_prefix("pdctl_proxy");
        for (name, help, family) in seen.families() {
            r.register(name, help, family);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    #[test]
    fn the_split_mode_and_moves_of_the_last_report_are_written() {
        let seen = RebalanceSeen::default();
        assert!(
            !page(&seen).lines().any(|l| !l.starts_with('#')),
            "no rebalancer, no series"
        );
        let mut counted = MoveCounts::default();
        counted.count(Toward::Prefill, MoveOutcome::Done);
        counted.count(Toward::Prefill, MoveOutcome::Failed);
        counted.count(Toward::Decode, MoveOutcome::Done);
        counted.count(Toward::Decode, MoveOutcome::Stale);
        counted.count(Toward::Decode, MoveOutcome::NotStarted);
        seen.set(Some(&RebalanceReport {
            mode: RebalanceMode::Act,
            split: Split {
                prefill: 3,
                decode: 1,
            },
            window_s: 30,
            measured_s: 30,
            figures: Figures::default(),
            verdict: String::new(),
            moves_total: 5,
            moves: vec![],
            moves_counted: counted,
        }));
        let text = page(&seen);
        for line in [
            "pdctl_proxy_rebalance_instances{role=\"prefill\"} 3",
            "pdctl_proxy_rebalance_instances{role=\"decode\"} 1",
            "pdctl_proxy_rebalance_mode{mode=\"act\"} 1",
            "pdctl_proxy_rebalance_mode{mode=\"advise\"} 0",
            "pdctl_proxy_rebalance_moves_total{toward=\"prefill\"} 2",
            "pdctl_proxy_rebalance_moves_total{toward=\"decode\"} 3",
            "pdctl_proxy_rebalance_moves_failed_total 3",
            "pdctl_proxy_rebalance_moves_by_outcome_total{outcome=\"done\"} 2",
            "pdctl_proxy_rebalance_moves_by_outcome_total{outcome=\"failed\"} 1",
            "pdctl_proxy_rebalance_moves_by_outcome_total{outcome=\"refused_as_stale\"} 1",
            "pdctl_proxy_rebalance_moves_by_outcome_total{outcome=\"not_started\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
        seen.set(None);
        assert!(!page(&seen).lines().any(|l| !l.starts_with('#')));
    }
}
