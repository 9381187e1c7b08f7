//! The proxy's latency histograms: lock-free (a handful of relaxed atomic adds per
//! observation, no lock on the request path), exposed through `prometheus-client` as a
//! custom metric type because the crate's own histogram takes a lock on every observation.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (seconds) of the latency histograms: from sub-millisecond proxy work to
/// minute-long prefills of huge prompts.
const BUCKETS_S: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A latency histogram with fixed buckets, lock-free; a cheap handle (clones share the
/// counts), so the metrics keep one and the registry another.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<Counts>);

/// What a [`Histogram`]'s handles share.
#[derive(Debug)]
struct Counts {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); those above the last bound are only in `count`.
    buckets: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    /// A histogram with the proxy's buckets (so the metrics can build one per stage).
    fn default() -> Self {
        Histogram::new(&BUCKETS_S)
    }
}

impl Histogram {
    /// An empty histogram with these upper bounds (seconds, ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram(Arc::new(Counts {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }))
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let c = &self.0;
        let secs = d.as_secs_f64();
        if let Some(i) = c.bounds.iter().position(|b| secs <= *b) {
            c.buckets[i].fetch_add(1, Relaxed);
        }
        c.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
        c.count.fetch_add(1, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0.count.load(Relaxed)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    /// Hands the crate the per-bucket counts; it writes them cumulative, adds `+Inf`, the
    /// sum (seconds) and the count.
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let c = &self.0;
        let buckets: Vec<(f64, u64)> = c
            .bounds
            .iter()
            .zip(&c.buckets)
            .map(|(b, n)| (*b, n.load(Relaxed)))
            .collect();
        let sum = c.sum_micros.load(Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, self.count(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::prometheus_text::encode;
    use prometheus_client::registry::Registry;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        const B: [f64; 3] = [0.001, 0.25, 60.0];
        let h = Histogram::new(&B);
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_secs(600));
        let mut r = Registry::with_labels([("a".into(), "b".into())].into_iter());
        r.register("x", "help", h.clone());
        let mut s = String::new();
        encode(&mut s, &r).unwrap();
        assert!(s.contains("# TYPE x histogram\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.001\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.25\"} 2\n"), "{s}");
        // The crate writes bounds as Go's client does (`60`), not as Python's (`60.0`).
        assert!(s.contains("x_bucket{a=\"b\",le=\"60\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
        let mut bare_registry = Registry::default();
        bare_registry.register("y", "help", h);
        let mut bare = String::new();
        encode(&mut bare, &bare_registry).unwrap();
        assert!(bare.contains("y_bucket{le=\"+Inf\"} 3\n"), "{bare}");
        assert!(bare.contains("y_count 3\n"), "{bare}");
        assert_eq!(crate::prometheus::sum(&bare, &["y_count"]), Some(3.0));
    }
}
