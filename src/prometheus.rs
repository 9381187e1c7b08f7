//! Prometheus metrics, both ways. Writing: the proxy and the simulator expose their
//! metrics through the `prometheus-client` crate (a registry per instance, its Prometheus
//! text encoder); this file adds the one metric type both need that the crate lacks,
//! [`FixedFamily`]. Reading: the parser that the proxy's scraper, `pdctl bench` and
//! `pdctl status` use on other processes' `/metrics` pages ([`samples`], [`sum`],
//! [`label_value`]).

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

/// One sample line of a page: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// The series name, with its suffix (`_total`, `_bucket`, ...).
    pub name: &'a str,
    /// Between the braces, empty when there are none.
    pub labels: &'a str,
    /// The value, finite (samples with `NaN` or `Inf` are left out).
    pub value: f64,
}

/// The sample lines of a page, comments, blank lines and unreadable values left out.
///
/// Both text formats an engine may serve are read: Prometheus text (vLLM's Python
/// server) and OpenMetrics text (`application/openmetrics-text`, as vLLM's Rust front end
/// serves it, `VLLM_USE_RUST_FRONTEND=1`): its `# EOF` and `# TYPE`/`# UNIT` lines are
/// comments here, counter samples keep their `_total` name (and `_created` ones are
/// samples of their own name, summed by nobody who asks for `_total`), an exemplar after
/// the value (`# {trace_id="..."} 1.0`) is not taken for labels, and a metric name may be
/// quoted inside the braces (`{"vllm:x",a="b"} 1`).
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let (name, labels, rest) = if let Some(inner) = line.strip_prefix('{') {
            // A quoted name first in the braces, then the labels, if any.
            let close = closing_brace(inner)?;
            let inside = &inner[..close];
            let body = inside.strip_prefix('"')?;
            let end = quoted_end(body)?;
            let labels = body[end + 1..].trim_start();
            let labels = labels.strip_prefix(',').unwrap_or(labels).trim_start();
            (&body[..end], labels, &inner[close + 1..])
        } else {
            let name_end = line.find(['{', ' ', '\t'])?;
            match line[name_end..].strip_prefix('{') {
                Some(r) => {
                    let close = closing_brace(r)?;
                    (&line[..name_end], &r[..close], &r[close + 1..])
                }
                None => (&line[..name_end], "", &line[name_end..]),
            }
        };
        let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
        value.is_finite().then_some(Sample {
            name,
            labels,
            value,
        })
    })
}

/// Where the label set that `s` starts inside of ends: the first `}` outside a quoted
/// value (values may hold `}`, and an OpenMetrics exemplar after the value has braces of
/// its own).
fn closing_brace(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// The index of the `"` that ends a quoted string whose opening quote is just before `s`.
fn quoted_end(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
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

    /// An OpenMetrics page as vLLM's Rust front end serves it (`# EOF`, `_created`
    /// samples, an exemplar, float timestamps, a quoted name) reads like Prometheus text.
    #[test]
    fn openmetrics_pages_read_like_prometheus_text() {
        let om = "# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.\n\
            # TYPE vllm:nixl_num_failed_transfers counter\n\
            vllm:nixl_num_failed_transfers_total{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:nixl_num_failed_transfers_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
            # TYPE vllm:admission_rejections counter\n\
            vllm:admission_rejections_total{model_name=\"m\",reason=\"max_num_queued_reqs\"} 5 # {trace_id=\"a}b\"} 1.0 1712345678.5\n\
            vllm:admission_rejections_total{model_name=\"m\",reason=\"max_num_queued_tokens\"} 1 1712345678.250\n\
            # TYPE vllm:num_requests_running gauge\n\
            {\"vllm:num_requests_running\",engine=\"0\"} 3\n\
            {\"vllm:num_requests_waiting\"} 4\n\
            # EOF\n";
        assert_eq!(
            sum(om, &["vllm:nixl_num_failed_transfers_total"]),
            Some(2.0)
        );
        assert_eq!(sum(om, &["vllm:admission_rejections_total"]), Some(6.0));
        let s: Vec<Sample> = samples(om).collect();
        assert_eq!(s.len(), 6);
        assert_eq!(
            label_value(s[2].labels, "reason").as_deref(),
            Some("max_num_queued_reqs")
        );
        assert_eq!(s[4].name, "vllm:num_requests_running");
        assert_eq!(s[4].labels, "engine=\"0\"");
        assert_eq!(s[5].labels, "");
        assert_eq!(
            sum(
                om,
                &["vllm:num_requests_running", "vllm:num_requests_waiting"]
            ),
            Some(7.0)
        );
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
