//! The proxy's latency histograms: the shared lock-free histogram with the proxy's buckets.

use crate::prometheus;

/// Upper bounds (seconds) of the latency histograms: from sub-millisecond proxy work to
/// minute-long prefills of huge prompts.
const BUCKETS_S: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A latency histogram with the proxy's buckets (a `Default`, so the metrics derive it).
#[derive(Debug)]
pub struct Histogram(prometheus::Histogram);

impl Default for Histogram {
    fn default() -> Self {
        Histogram(prometheus::Histogram::new(&BUCKETS_S))
    }
}

impl std::ops::Deref for Histogram {
    type Target = prometheus::Histogram;
    fn deref(&self) -> &prometheus::Histogram {
        &self.0
    }
}
