//! `pdctl bench`: the serving benchmark users run today with `vllm bench serve` and
//! hand-written scripts, against any OpenAI-compatible URL (the running cluster's proxy by
//! default), with the engines' prefix-cache hit rate read before and after.

pub mod args;
pub mod dataset;
pub mod engines;
pub mod report;
pub mod runner;
pub mod stats;

use crate::vocab::Role;
use anyhow::Context;
use args::{BenchArgs, Strategy};
use report::{Report, RunInfo};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

/// Bad `pdctl bench` input (arguments, a dataset file, no cluster to measure): the
/// command line maps it to exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// Where to send requests and which engines to read cache figures from.
struct Target {
    url: String,
    prefill: Vec<String>,
    decode: Vec<String>,
    /// Sent as a bearer token with every request to `url`.
    key: Option<String>,
}

/// The benchmark's HTTP client, sending `key` as `Authorization: Bearer KEY`.
fn http_client(key: Option<&str>) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(k) = key {
        let mut value =
            reqwest::header::HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                usage("--api-key (or PDCTL_API_KEY) has characters an HTTP header cannot carry")
            })?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(1024)
        .default_headers(headers)
        .build()?)
}

/// The engine key to send to `url` when it is an engine of a cluster running under
/// `root` (its plan lists the URL); None when it is not one.
fn engine_key_for(root: &std::path::Path, url: &str) -> anyhow::Result<Option<String>> {
    let Ok(wanted) = crate::proxy::parse_endpoint(url) else {
        return Ok(None);
    };
    for found in crate::supervisor::select::scan(root) {
        if !found.running {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(found.state.plan_path()) else {
            continue;
        };
        let Ok(plan) = serde_json::from_str::<crate::plan::Plan>(&text) else {
            continue;
        };
        let is_engine = plan.services.iter().any(|s| {
            s.role.is_engine()
                && s.url
                    .as_deref()
                    .and_then(|u| crate::proxy::parse_endpoint(u).ok())
                    .is_some_and(|e| e.url == wanted.url)
        });
        if is_engine {
            let key = crate::control::auth::kept_engine_key(&found.state.dir)?;
            return Ok(key.map(|k| k.reveal().to_string()));
        }
    }
    Ok(None)
}

/// What draws the runs' latency CDFs for `--plot`, handed in by the command line: pictures
/// sit above the bench (`src/pictures`), which only measures.
pub type Draw = fn(&[&Report]) -> anyhow::Result<String>;

/// Runs a benchmark (or `--compare`s two results); `draw` makes `--plot`'s SVG.
pub async fn run(a: BenchArgs, draw: Draw) -> anyhow::Result<ExitCode> {
    if let Some(files) = &a.compare {
        return compare(files, a.plot.as_deref(), draw);
    }
    check_args(&a)?;
    let target = target(&a).await?;
    let client = http_client(target.key.as_deref())?;
    // The engines' /metrics are open (as vLLM's): no key goes to them.
    let plain = http_client(None)?;
    let model = match &a.workload.model {
        Some(m) => m.clone(),
        None => first_model(&client, &target.url).await?,
    };
    let reqs =
        dataset::build(&a, &target.prefill, &target.decode).map_err(|e| usage(e.to_string()))?;
    let mut engines = target.prefill.clone();
    engines.extend(target.decode.iter().cloned());
    let before = engines::snapshot(&plain, &engines).await;
    // On the load's own client: its kept connection, not new ones the target would count.
    let proxy_before = proxy_figures(&client, &target.url).await;

    let load = runner::Load::of(&a.workload, target.url.clone(), model.clone(), !a.no_stream);
    let total = reqs.len();
    let tty = std::io::stderr().is_terminal();
    eprintln!(
        "pdctl bench: {total} requests to {} (model {model})",
        target.url
    );
    let (outcomes, duration) = runner::run(&client, &load, &reqs, move |done| {
        progress(done, total, tty)
    })
    .await;
    if tty {
        eprintln!();
    }
    let after = engines::snapshot(&plain, &engines).await;
    let cache = engines::deltas(&engines, &before, &after);
    let proxy_after = proxy_figures(&client, &target.url).await;
    let info = RunInfo {
        label: a.label.clone().unwrap_or_else(|| default_label(&a)),
        url: target.url,
        model,
        endpoint: value_name(a.workload.endpoint),
        stream: !a.no_stream,
        dataset: value_name(a.workload.dataset),
        strategy: value_name(a.strategy),
        request_rate: a.workload.request_rate,
        max_concurrency: a.workload.max_concurrency,
    };
    let mut report = Report::from_outcomes(info, &outcomes, duration, cache);
    report.proxy = proxy_before
        .zip(proxy_after)
        .map(|(b, a)| report::ProxyWork {
            retries: a.retries - b.retries,
            migrations: a.migrations - b.migrations,
        });
    print!("{}", report.table());
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, draw(&[&report])?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(if report.completed == 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

use crate::spelling::value_name;

/// The figures of the pdctl proxy at `url` (`None`: not one, or its /metrics did not answer).
async fn proxy_figures(client: &reqwest::Client, url: &str) -> Option<crate::proxy::ProxyFigures> {
    let page = format!("{}/metrics", url.trim_end_matches('/'));
    let text = client.get(&page).send().await.ok()?.text().await.ok()?;
    crate::proxy::read_figures(&text)
}

/// Runs that share a label get their position among the files after it (`x (#1)`,
/// `x (#3)`), so every column and plot line can be told apart.
fn distinguish_labels(runs: &mut [Report]) {
    let labels: Vec<String> = runs.iter().map(|r| r.run.label.clone()).collect();
    for (i, r) in runs.iter_mut().enumerate() {
        if labels.iter().filter(|l| **l == labels[i]).count() > 1 {
            r.run.label = format!("{} (#{})", labels[i], i + 1);
        }
    }
}

fn default_label(a: &BenchArgs) -> String {
    match a.workload.dataset {
        args::DatasetKind::Prefix => format!("prefix/{}", value_name(a.strategy)),
        d => value_name(d),
    }
}

fn check_args(a: &BenchArgs) -> anyhow::Result<()> {
    a.workload.check().map_err(|e| usage(e.to_string()))?;
    if a.strategy != Strategy::None && a.workload.dataset != args::DatasetKind::Prefix {
        return Err(usage("--strategy applies to --dataset prefix only"));
    }
    if let Some(u) = &a.url {
        let parsed = reqwest::Url::parse(u).map_err(|e| {
            usage(format!(
                "--url {u}: not a URL ({e}); write e.g. http://127.0.0.1:8000"
            ))
        })?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(usage(format!("--url {u}: needs http://HOST:PORT")));
        }
    }
    Ok(())
}

/// Engine addresses as `http://HOST:PORT`, checked the way `pdctl proxy` checks its own.
fn engine_urls(flag: &str, given: &[String]) -> anyhow::Result<Vec<String>> {
    given
        .iter()
        .map(|e| {
            crate::proxy::parse_endpoint(e)
                .map(|e| e.url)
                .map_err(|err| usage(format!("{flag} {e}: {err}")))
        })
        .collect()
}

/// The URL and engines: as given, else from the running cluster.
async fn target(a: &BenchArgs) -> anyhow::Result<Target> {
    let root = crate::plan::resolve::state_root(a.state_dir.as_deref())?;
    if let Some(url) = &a.url {
        let key = match engine_key_for(&root, url)? {
            Some(k) => Some(k),
            None => a.api_key.clone(),
        };
        return Ok(Target {
            url: url.trim_end_matches('/').to_string(),
            prefill: engine_urls("--prefill", &a.prefill)?,
            decode: engine_urls("--decode", &a.decode)?,
            key,
        });
    }
    let found =
        crate::supervisor::select::running(&root, a.cluster.as_deref())?.ok_or_else(|| {
            usage(format!(
                "no pdctl cluster is running under {} (start one with `pdctl up`, or give --url)",
                root.display()
            ))
        })?;
    let r =
        crate::control::client::status(&found.state.socket_path(), Duration::from_secs(5)).await?;
    let url = r.proxy_url.clone().ok_or_else(|| {
        usage(format!(
            "cluster {} has no proxy: give --url of an engine",
            r.cluster
        ))
    })?;
    let urls = |role: Role, given: &[String]| -> Vec<String> {
        if !given.is_empty() {
            return given.to_vec();
        }
        r.services
            .iter()
            .filter(|s| s.role == role)
            .filter_map(|s| s.url.clone())
            .collect()
    };
    Ok(Target {
        url,
        prefill: engine_urls("--prefill", &urls(Role::Prefill, &a.prefill))?,
        decode: engine_urls("--decode", &urls(Role::Decode, &a.decode))?,
        key: a.api_key.clone(),
    })
}

/// The first model the server lists; a clear error when it cannot be asked (also what
/// `pdctl tune` sends when no model is given).
pub async fn first_model(client: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let models = format!("{url}/v1/models");
    let resp = client
        .get(&models)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot reach {models}: {}; is the server up (pdctl status)?",
                crate::error_text::chain(&e)
            )
        })?;
    let status = resp.status();
    let v: serde_json::Value = resp.json().await.unwrap_or_default();
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| {
            anyhow::anyhow!("{models} answered {status} without a model; give --model NAME")
        })
}

fn progress(done: usize, total: usize, tty: bool) {
    if tty {
        let width = 40;
        let filled = done * width / total.max(1);
        eprint!(
            "\r[{}{}] {done}/{total}",
            "#".repeat(filled),
            " ".repeat(width - filled)
        );
    } else if done == total || done % (total / 10).max(1) == 0 {
        eprintln!("{done}/{total} requests done");
    }
}

fn compare(
    files: &[std::path::PathBuf],
    plot: Option<&std::path::Path>,
    draw: Draw,
) -> anyhow::Result<ExitCode> {
    let load = |p: &std::path::Path| -> anyhow::Result<Report> {
        let text = std::fs::read_to_string(p)
            .map_err(|e| usage(format!("cannot read {}: {e}", p.display())))?;
        serde_json::from_str(&text).map_err(|e| {
            usage(format!(
                "{} is not a pdctl bench --json result: {e}",
                p.display()
            ))
        })
    };
    let mut runs = files
        .iter()
        .map(|f| load(f))
        .collect::<anyhow::Result<Vec<Report>>>()?;
    distinguish_labels(&mut runs);
    let refs: Vec<&Report> = runs.iter().collect();
    print!("{}", report::compare(&refs));
    if let Some(path) = plot {
        std::fs::write(path, draw(&refs)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(label: &str) -> Report {
        let info = RunInfo {
            label: label.into(),
            ..RunInfo::default()
        };
        Report::from_outcomes(info, &[], 1.0, Vec::new())
    }

    #[test]
    fn the_report_says_what_the_proxy_did_when_the_target_is_one() {
        let mut r = run("x");
        assert!(!r.table().contains("Proxy"));
        assert!(serde_json::to_value(&r).unwrap().get("proxy").is_none());
        r.proxy = Some(report::ProxyWork {
            retries: 2.0,
            migrations: 5.0,
        });
        let table = r.table();
        assert!(table.contains("Streams continued elsewhere:"), "{table}");
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("Streams continued") && l.ends_with(" 5"))
        );
        assert_eq!(
            serde_json::to_value(&r).unwrap()["proxy"]["migrations"],
            5.0
        );
    }

    #[test]
    fn runs_sharing_a_label_all_get_their_position() {
        let mut runs = vec![run("x"), run("y"), run("x"), run("x")];
        distinguish_labels(&mut runs);
        let labels: Vec<&str> = runs.iter().map(|r| r.run.label.as_str()).collect();
        assert_eq!(labels, ["x (#1)", "y", "x (#3)", "x (#4)"]);
    }
}
