//! Which splits `pdctl tune` tries and which one it calls best: the candidates a budget
//! allows, the service-level objectives (SLOs) and the goodput they define, and the
//! ranking. Pure functions, so the choice can be tested without a cluster.

use crate::bench::runner::Outcome;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How many prefill and decode instances a cluster runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Split {
    pub prefill: u32,
    pub decode: u32,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}P:{}D", self.prefill, self.decode)
    }
}

/// What the splits may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// Prefill plus decode instances.
    Instances(u32),
    /// GPUs, with the GPUs one prefill and one decode instance hold.
    Gpus {
        gpus: u32,
        per_prefill: u32,
        per_decode: u32,
    },
}

/// Every split the budget allows with at least one instance of each role, from the most
/// decode-heavy to the most prefill-heavy: P:D from 1:(n-1) to (n-1):1 for n instances;
/// for GPUs, each prefill count with as many decode instances as the GPUs left hold.
pub fn candidates(budget: Budget) -> Vec<Split> {
    match budget {
        Budget::Instances(n) => (1..n)
            .map(|p| Split {
                prefill: p,
                decode: n - p,
            })
            .collect(),
        Budget::Gpus {
            gpus,
            per_prefill,
            per_decode,
        } => {
            let (pp, pd) = (per_prefill.max(1), per_decode.max(1));
            (1..)
                .take_while(|p| p * pp + pd <= gpus)
                .map(|p| Split {
                    prefill: p,
                    decode: (gpus - p * pp) / pd,
                })
                .collect()
        }
    }
}

/// The latency objectives a request and a split are held to; unset ones hold always.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token, ms: a request meets it with its own TTFT, a split with its p90.
    pub ttft_p90_ms: Option<f64>,
    /// Inter-token latency, ms: a request meets it with its mean gap between tokens
    /// (TPOT), a split with the p90 of every gap.
    pub itl_p90_ms: Option<f64>,
}

impl Slo {
    /// Whether one completed request met the objectives (what goodput counts).
    pub fn met_by(&self, o: &Outcome) -> bool {
        if !o.ok {
            return false;
        }
        let ttft_ok = self
            .ttft_p90_ms
            .is_none_or(|t| o.ttft_ms.is_some_and(|v| v <= t));
        let tpot = if o.itl_ms.is_empty() {
            0.0
        } else {
            o.itl_ms.iter().sum::<f64>() / o.itl_ms.len() as f64
        };
        ttft_ok && self.itl_p90_ms.is_none_or(|t| tpot <= t)
    }

    /// Whether a split's p90s meet the objectives.
    pub fn met_by_split(&self, ttft_p90: f64, itl_p90: f64) -> bool {
        self.ttft_p90_ms.is_none_or(|t| ttft_p90 <= t)
            && self.itl_p90_ms.is_none_or(|t| itl_p90 <= t)
    }

    /// `TTFT p90 <= 200 ms, ITL p90 <= 30 ms`, or `none`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = self.ttft_p90_ms {
            parts.push(format!("TTFT p90 <= {t} ms"));
        }
        if let Some(t) = self.itl_p90_ms {
            parts.push(format!("ITL p90 <= {t} ms"));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

/// Requests per second that completed within the objectives.
pub fn goodput(slo: &Slo, outcomes: &[Outcome], duration_s: f64) -> f64 {
    if duration_s <= 0.0 {
        return 0.0;
    }
    outcomes.iter().filter(|o| slo.met_by(o)).count() as f64 / duration_s
}

/// What ranking needs of one measured split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    pub meets_slo: bool,
    pub goodput: f64,
    pub request_throughput: f64,
    pub failed: usize,
}

/// The index of the best split: one that meets the objectives and failed no request
/// first, then the highest goodput, then the highest throughput; None for no splits.
pub fn best(scores: &[Score]) -> Option<usize> {
    let key = |s: &Score| {
        (
            s.meets_slo && s.failed == 0,
            s.goodput,
            s.request_throughput,
        )
    };
    (0..scores.len()).max_by(|&a, &b| {
        let (x, y) = (key(&scores[a]), key(&scores[b]));
        x.0.cmp(&y.0)
            .then(x.1.total_cmp(&y.1))
            .then(x.2.total_cmp(&y.2))
            // Equal on all counts: the earlier (fewer prefill instances) wins.
            .then(b.cmp(&a))
    })
}

/// Reads a duration as people write one: `200ms`, `0.2s`, `1.5 s`, or a bare number of
/// milliseconds; gives milliseconds.
pub fn parse_ms(text: &str) -> Result<f64, NotADuration> {
    let t = text.trim();
    let (number, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (t, 1.0)
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * scale),
        _ => Err(NotADuration(text.to_string())),
    }
}

/// Text [`parse_ms`] cannot read as a positive duration (the flag parser shows it with the
/// forms it takes).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{0}` is not a duration: write e.g. 200ms, 0.2s or 200 (milliseconds)")]
pub struct NotADuration(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn split(prefill: u32, decode: u32) -> Split {
        Split { prefill, decode }
    }

    #[test]
    fn an_instance_budget_gives_every_split_with_both_roles() {
        assert_eq!(
            candidates(Budget::Instances(4)),
            [split(1, 3), split(2, 2), split(3, 1)]
        );
        assert!(candidates(Budget::Instances(1)).is_empty());
    }

    #[test]
    fn a_gpu_budget_fills_the_gpus_left_with_decode() {
        // 8 GPUs, prefill TP1, decode TP2.
        let got = candidates(Budget::Gpus {
            gpus: 8,
            per_prefill: 1,
            per_decode: 2,
        });
        assert_eq!(
            got,
            [
                split(1, 3),
                split(2, 3),
                split(3, 2),
                split(4, 2),
                split(5, 1),
                split(6, 1)
            ]
        );
    }

    fn outcome(ttft: f64, gaps: &[f64]) -> Outcome {
        Outcome {
            ok: true,
            ttft_ms: Some(ttft),
            itl_ms: gaps.to_vec(),
            ..Outcome::default()
        }
    }

    #[test]
    fn goodput_counts_requests_within_both_objectives() {
        let slo = Slo {
            ttft_p90_ms: Some(200.0),
            itl_p90_ms: Some(30.0),
        };
        let outs = [
            outcome(100.0, &[20.0, 25.0]),
            outcome(250.0, &[20.0]),       // TTFT too long
            outcome(100.0, &[20.0, 50.0]), // mean gap 35 ms
            Outcome::default(),            // failed
        ];
        assert_eq!(goodput(&slo, &outs, 2.0), 0.5);
        assert_eq!(goodput(&Slo::default(), &outs, 1.0), 3.0);
        assert!(slo.met_by_split(199.0, 30.0) && !slo.met_by_split(201.0, 10.0));
        assert_eq!(slo.describe(), "TTFT p90 <= 200 ms, ITL p90 <= 30 ms");
    }

    fn score(meets_slo: bool, goodput: f64, failed: usize) -> Score {
        Score {
            meets_slo,
            goodput,
            request_throughput: goodput,
            failed,
        }
    }

    #[test]
    fn the_best_split_meets_the_objectives_before_it_is_fast() {
        let scores = [
            score(false, 30.0, 0),
            score(true, 12.0, 0),
            score(true, 10.0, 0),
        ];
        assert_eq!(best(&scores), Some(1));
        // A split that failed requests does not win over one that failed none.
        assert_eq!(best(&[score(true, 30.0, 2), score(true, 5.0, 0)]), Some(1));
        // Nothing meets them: the highest goodput.
        assert_eq!(best(&[score(false, 3.0, 0), score(false, 4.0, 0)]), Some(1));
        assert_eq!(best(&[]), None);
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_ms("200ms"), Ok(200.0));
        assert_eq!(parse_ms("0.2s"), Ok(200.0));
        assert_eq!(parse_ms("1.5 s"), Ok(1500.0));
        assert_eq!(parse_ms("30"), Ok(30.0));
        assert!(parse_ms("fast").unwrap_err().to_string().contains("200ms"));
        assert!(parse_ms("-1ms").is_err());
    }
}
