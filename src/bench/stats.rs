//! Summary statistics of latency samples, as `vllm bench serve` reports them.

use serde::{Deserialize, Serialize};

/// Mean, median, p90, p99 and standard deviation of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub std: f64,
    pub count: usize,
}

/// The `q` quantile (0..=1) of sorted samples, linearly interpolated.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Summarises samples (any order); all zeros when there are none.
pub fn summarize(samples: &[f64]) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len() as f64;
    let mean = s.iter().sum::<f64>() / n;
    let var = s.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    Summary {
        mean,
        median: quantile(&s, 0.5),
        p90: quantile(&s, 0.9),
        p99: quantile(&s, 0.99),
        std: var.sqrt(),
        count: s.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&s, 0.5), 50.5);
        assert!((quantile(&s, 0.99) - 99.01).abs() < 1e-9);
        assert_eq!(quantile(&[3.0], 0.9), 3.0);
    }

    #[test]
    fn summaries_describe_the_samples() {
        let x = summarize(&[4.0, 2.0, 6.0, 8.0]);
        assert_eq!(x.mean, 5.0);
        assert_eq!(x.median, 5.0);
        assert!((x.std - 5f64.sqrt()).abs() < 1e-9);
        assert_eq!(x.count, 4);
        assert_eq!(summarize(&[]), Summary::default());
    }
}
