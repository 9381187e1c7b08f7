//! Prometheus text format, both ways: the lock-free histogram and type headers the proxy
//! and the simulator expose, and the reader that the proxy's scraper, `pdctl bench` and
//! `pdctl status` use on other processes' `/metrics` pages.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// One metric family whose label sets are all known when it is made (a leg, a limit, a
/// token source, a finish reason), with one label. The code keeps each series' handle and
/// bumps it with no lookup (the crate's `Family` takes a lock and hashes the labels on
/// every access), and the series are written in the order given (a `Family` writes them
/// in hash order, which changes from run to run).
#[derive(Debug, Clone)]
pub struct FixedFamily<M, const N: usize> {
    key: &'static str,
    series: [(&'static str, M); N],
}

impl<M: Default, const N: usize> FixedFamily<M, N> {
    /// A family with one zeroed series per value of label `key`, in this order.
    pub fn new(key: &'static str, values: [&'static str; N]) -> Self {
        FixedFamily {
            key,
            series: values.map(|v| (v, M::default())),
        }
    }

    /// The series of the `i`th value given to [`FixedFamily::new`].
    pub fn get(&self, i: usize) -> &M {
        &self.series[i].1
    }
}

impl<M: EncodeMetric + TypedMetric, const N: usize> EncodeMetric for FixedFamily<M, N> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (value, metric) in &self.series {
            metric.encode(encoder.encode_family(&[(self.key, *value)])?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

/// Writes the `# HELP` and `# TYPE` lines of a metric.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A latency histogram with fixed buckets (upper bounds in seconds), lock-free.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| secs <= *b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// Appends the histogram under `name`; `labels` (e.g. `model_name="m"`, or empty) go
    /// on every series. Bounds are written as Python's client writes them (`1.0`, `0.25`).
    pub fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, "histogram", help);
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{b:?}\"}} {cumulative}"
            );
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        let labels = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(
            out,
            "{name}_count{labels} {count}\n{name}_sum{labels} {sum}"
        );
    }
}

/// One sample line of a page: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// Between the braces, empty when there are none.
    pub labels: &'a str,
    pub value: f64,
}

/// The sample lines of a page, comments, blank lines and unreadable values left out.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let name_end = line.find(['{', ' '])?;
        let (labels, rest) = match line[name_end..].strip_prefix('{') {
            // The last `}`: label values may contain one.
            Some(r) => {
                let close = r.rfind('}')?;
                (&r[..close], &r[close + 1..])
            }
            None => ("", &line[name_end..]),
        };
        let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
        value.is_finite().then_some(Sample {
            name: &line[..name_end],
            labels,
            value,
        })
    })
}

/// The sum of every sample of the named series (any labels); `None` when none is there.
pub fn sum(text: &str, names: &[&str]) -> Option<f64> {
    samples(text)
        .filter(|s| names.contains(&s.name))
        .map(|s| s.value)
        .reduce(|a, b| a + b)
}

/// The value of label `key` in a sample's label text (what [`Sample::labels`] holds), with
/// Prometheus escapes (`\\`, `\"`, `\n`) undone; `None` when the label is not there. Label
/// values are read pair by pair, so a value that merely contains `key="` is not mistaken
/// for the label.
pub fn label_value(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        if name == key {
            return Some(value);
        }
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        const B: [f64; 3] = [0.001, 0.25, 60.0];
        let h = Histogram::new(&B);
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_secs(600));
        let mut s = String::new();
        h.render(&mut s, "x", "help", "a=\"b\"");
        assert!(s.contains("# TYPE x histogram\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.001\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.25\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"60.0\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
        let mut bare = String::new();
        h.render(&mut bare, "y", "help", "");
        assert!(bare.contains("y_bucket{le=\"+Inf\"} 3\n"), "{bare}");
        assert!(bare.contains("y_count 3\n"), "{bare}");
        assert_eq!(sum(&bare, &["y_count"]), Some(3.0));
    }

    #[test]
    fn label_values_are_read_pair_by_pair_with_escapes_undone() {
        let labels = r#"model_name="a source=\"x\" b\\",engine="0",source="local_compute""#;
        assert_eq!(
            label_value(labels, "source").as_deref(),
            Some("local_compute")
        );
        assert_eq!(
            label_value(labels, "model_name").as_deref(),
            Some(r#"a source="x" b\"#)
        );
        assert_eq!(label_value(labels, "engine").as_deref(), Some("0"));
        assert_eq!(label_value(labels, "absent"), None);
        assert_eq!(label_value("", "source"), None);
        assert_eq!(label_value(r#"a="unterminated"#, "a"), None);
        assert_eq!(label_value(r#"a = "1" , b="2""#, "b").as_deref(), Some("2"));
    }

    #[test]
    fn samples_are_summed_over_label_sets_timestamps_and_braces_in_values() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"a}b\"} 2.0\n\
            vllm:num_requests_waiting{model_name=\"m\"} 4.0 1712345678\n\
            vllm:num_requests_running_other 100\n\
            plain 7\n";
        assert_eq!(
            sum(
                text,
                &["vllm:num_requests_running", "vllm:num_requests_waiting"]
            ),
            Some(9.0)
        );
        assert_eq!(sum(text, &["plain"]), Some(7.0));
        assert_eq!(sum(text, &["absent"]), None);
        let s: Vec<Sample> = samples(text).collect();
        assert_eq!(s[1].labels, "engine=\"1\",model_name=\"a}b\"");
    }
}
