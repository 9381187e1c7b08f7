//! The request figures `pdctl status` shows for a running proxy, read back from its
//! `/metrics` page: here, beside the metric names the proxy writes (metrics.rs), so the two
//! change together.

/// The proxy's request figures `status` shows, summed from its `/metrics` page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProxyFigures {
    pub requests: f64,
    /// Requests answered with a 4xx or 5xx status.
    pub failed: f64,
    pub in_flight: f64,
    pub retries: f64,
    /// Streams whose decode broke off mid-answer, continued on another decode.
    pub migrations: f64,
    /// Decode had to recompute because the KV handoff did not happen: those the proxy
    /// caused or saw coming, and those found in decode's own vLLM counters and usage.
    pub kv_handoff_misses: f64,
    /// KV handoffs decode could not load: the larger of the requests failed for it and
    /// the failed transfers decodes reported.
    pub kv_handoff_failures: f64,
    /// Prompt tokens decodes computed themselves in those misses (found ones only).
    pub recomputed_tokens: f64,
    /// Requests estimated from decodes' counters to have recomputed (legs no answer
    /// judged): an estimate, not in `kv_handoff_misses`.
    pub kv_handoff_misses_estimated: f64,
}

/// Reads the proxy's counters from a Prometheus text page; `None` when it has none of
/// `pdctl_proxy_requests_total` (not the pdctl proxy, or an older one).
pub fn read(metrics_text: &str) -> Option<ProxyFigures> {
    let mut f = ProxyFigures::default();
    let mut found = false;
    let mut failures = [0.0f64; 2];
    for crate::prometheus::Sample {
        name,
        labels,
        value,
    } in crate::prometheus::samples(metrics_text)
    {
        match name {
            "pdctl_proxy_requests_total" => {
                found = true;
                f.requests += value;
                if labels.contains("status=\"4") || labels.contains("status=\"5") {
                    f.failed += value;
                }
            }
            "pdctl_proxy_requests_in_flight" => f.in_flight += value,
            "pdctl_proxy_retries_total" => f.retries += value,
            "pdctl_proxy_migrations_total" => f.migrations += value,
            "pdctl_proxy_kv_handoff_misses_total" => f.kv_handoff_misses += value,
            // A request failed for its KV load is most often also a failed transfer its
            // decode reports: the larger of the two views, not their sum.
            "pdctl_proxy_kv_handoff_failures_total" => {
                let slot = usize::from(labels.contains(super::metrics::ENGINE_FAILED_TRANSFERS));
                failures[slot] += value;
                f.kv_handoff_failures = failures[0].max(failures[1]);
            }
            "pdctl_proxy_kv_handoff_recomputed_tokens_total" => f.recomputed_tokens += value,
            "pdctl_proxy_kv_handoff_misses_estimated_total" => {
                f.kv_handoff_misses_estimated += value
            }
            _ => {}
        }
    }
    found.then_some(f)
}

/// What the proxy's page says of the instance at `url`: requests in flight on it and
/// whether routing may use it; None when the page does not list that instance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InstanceFigures {
    pub in_flight: f64,
    pub routed: bool,
}

/// The proxy's figures for the instance at `url` (`pdctl_proxy_instance_in_flight` and
/// `pdctl_proxy_instance_healthy`, matched by their `instance` label).
pub fn instance(metrics_text: &str, url: &str) -> Option<InstanceFigures> {
    let wanted = url.trim_end_matches('/');
    let mut f: Option<InstanceFigures> = None;
    for s in crate::prometheus::samples(metrics_text) {
        let field = match s.name {
            "pdctl_proxy_instance_in_flight" => 0,
            "pdctl_proxy_instance_healthy" => 1,
            _ => continue,
        };
        if crate::prometheus::label_value(s.labels, "instance").as_deref() != Some(wanted) {
            continue;
        }
        let e = f.get_or_insert(InstanceFigures {
            in_flight: 0.0,
            routed: false,
        });
        if field == 0 {
            e.in_flight += s.value;
        } else {
            e.routed = s.value == 1.0;
        }
    }
    f
}

/// The revision of the spec whose settings the proxy runs with
/// (`pdctl_proxy_settings_revision`).
pub fn settings_revision(metrics_text: &str) -> Option<u64> {
    crate::prometheus::samples(metrics_text)
        .find(|s| s.name == "pdctl_proxy_settings_revision" && s.labels.is_empty())
        .map(|s| s.value as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_counters_are_summed_over_labels() {
        let text = "# HELP pdctl_proxy_requests_total x\n\
                    # TYPE pdctl_proxy_requests_total counter\n\
                    pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"200\"} 10\n\
                    pdctl_proxy_requests_total{route=\"/v1/chat/completions\",status=\"502\"} 2\n\
                    pdctl_proxy_requests_total{route=\"/v1/completions\",status=\"429\"} 1\n\
                    pdctl_proxy_requests_in_flight 3\n\
                    pdctl_proxy_retries_total{leg=\"prefill\"} 1\n\
                    pdctl_proxy_retries_total{leg=\"decode\"} 2\n\
                    pdctl_proxy_migrations_total{reason=\"connection\"} 1\n\
                    pdctl_proxy_migrations_total{reason=\"drained\"} 1\n\
                    pdctl_proxy_kv_handoff_misses_total{reason=\"no_kv_transfer_params\"} 4\n\
                    pdctl_proxy_kv_handoff_misses_total{reason=\"decode_cached_tokens_low\"} 2\n\
                    pdctl_proxy_kv_handoff_misses_estimated_total 5\n\
                    pdctl_proxy_kv_handoff_failures_total{reason=\"decode_failed_the_request\"} 1\n\
                    pdctl_proxy_kv_handoff_recomputed_tokens_total 900\n";
        let f = read(text).unwrap();
        assert_eq!(
            f,
            ProxyFigures {
                requests: 13.0,
                failed: 3.0,
                in_flight: 3.0,
                retries: 3.0,
                migrations: 2.0,
                kv_handoff_misses: 6.0,
                kv_handoff_failures: 1.0,
                recomputed_tokens: 900.0,
                kv_handoff_misses_estimated: 5.0
            }
        );
        assert_eq!(read("vllm:num_requests_running 3\n"), None);
    }
}
