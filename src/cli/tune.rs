//! `pdctl tune`: the command-line half of `crate::tune` — which cluster, its starting
//! split, moving between splits (every change goes through [`set_split`]), Ctrl-C, and
//! writing the result.

use super::ExitError;
use super::common::{ClusterArgs, Found, running};
use crate::control::client;
use crate::control::operation::{ChangeOptions, ChangeRequest};
use crate::supervisor::StateDir;
use crate::tune::args::TuneArgs;
use crate::tune::choose::{self, Budget, Split};
use crate::tune::report::{TuneResult, WorkloadInfo};
use crate::tune::{Measured, Workload};
use crate::vocab::Role;
use anyhow::Context;
use clap::Args;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `pdctl tune`.
#[derive(Debug, Args)]
pub struct TuneCommand {
    #[command(flatten)]
    pub tune: TuneArgs,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl tune`.
pub fn tune(a: TuneCommand) -> anyhow::Result<ExitCode> {
    super::runtime()?.block_on(run(a))
}

/// Changes the running cluster to `to` prefill and decode instances, live: one `scale`
/// carried out by the head's supervisor (`crate::ops`): new instances join routing once
/// healthy, removed ones drain first. Every split change of `pdctl tune` goes through
/// here. A change still running (one a Ctrl-C left behind goes on in the supervisor) is
/// waited for first, since the supervisor takes one change at a time.
pub async fn set_split(cluster: &ClusterArgs, to: Split, drain_timeout: u64) -> anyhow::Result<()> {
    let found = running(&cluster.state_dir, cluster.cluster.as_deref(), "tune")?;
    let end = std::time::Instant::now() + Duration::from_secs(drain_timeout + 900);
    loop {
        let report = client::status(&found.socket, Duration::from_secs(5)).await?;
        if !report.operation.as_ref().is_some_and(|o| o.running()) {
            break;
        }
        if std::time::Instant::now() > end {
            anyhow::bail!("another change to the cluster is still running; see `pdctl status`");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let change = ChangeRequest::Scale {
        counts: vec![
            ("prefill".to_string(), to.prefill),
            ("decode".to_string(), to.decode),
        ],
        expect: None,
        how: ChangeOptions {
            dry_run: false,
            drain_timeout_s: drain_timeout,
            state_root: super::common::state_root(cluster.state_dir.as_deref())?,
        },
    };
    let done = crate::ops::request(&found.socket, change, |line, error| {
        if error {
            eprintln!("pdctl: {line}");
        }
    })
    .await
    .context("the split change stopped")?;
    if done.code != 0 {
        anyhow::bail!(
            "`pdctl scale prefill={} decode={}` failed: {}",
            to.prefill,
            to.decode,
            done.message
        );
    }
    Ok(())
}

async fn run(a: TuneCommand) -> anyhow::Result<ExitCode> {
    let t = &a.tune;
    check_args(t)?;
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "tune")?;
    let report = client::status(&found.socket, Duration::from_secs(5)).await?;
    let proxy = report.proxy_url.clone().ok_or_else(|| {
        ExitError::usage(format!(
            "cluster {} has no proxy: tune measures through it",
            found.cluster
        ))
    })?;
    let count = |role: Role| report.services.iter().filter(|s| s.role == role).count() as u32;
    let start = Split {
        prefill: count(Role::Prefill),
        decode: count(Role::Decode),
    };
    let (splits, budget_text) = splits_to_measure(t, &found, start)?;
    let workload = workload_of(t, &proxy).await?;
    eprintln!(
        "pdctl tune: cluster {} runs {start}; measuring {} splits of {budget_text} ({} requests each, objectives: {}); Ctrl-C returns it to {start}",
        found.cluster,
        splits.len(),
        workload.requests.len(),
        workload.slo.describe()
    );
    let which = a.which.clone();
    let drain = t.drain_timeout;
    let swept = tokio::select! {
        r = crate::tune::sweep(&splits, &workload, |s| {
            let which = which.clone();
            async move { set_split(&which, s, drain).await }
        }) => r,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("pdctl tune: interrupted; returning cluster {} to {start}", found.cluster);
            set_split(&which, start, drain).await?;
            eprintln!("pdctl tune: cluster {} runs {start} again", found.cluster);
            return Ok(ExitCode::from(130));
        }
    };
    let measured: Vec<Measured> = match swept {
        Ok(m) => m,
        Err(e) => {
            eprintln!(
                "pdctl tune: {e:#}; returning cluster {} to {start}",
                found.cluster
            );
            set_split(&which, start, drain).await?;
            return Err(e);
        }
    };
    let scores: Vec<choose::Score> = measured.iter().map(Measured::score).collect();
    let best_at = choose::best(&scores).expect("at least one split was measured");
    let best = measured[best_at].split();
    let left_on = if t.apply { best } else { start };
    eprintln!("pdctl tune: leaving cluster {} on {left_on}", found.cluster);
    set_split(&which, left_on, drain).await?;
    let result = TuneResult {
        cluster: found.cluster.clone(),
        budget: budget_text,
        slo: workload.slo,
        workload: workload_info(t, &workload),
        start,
        best_meets_slo: measured[best_at].meets_slo,
        splits: measured,
        best,
        left_on,
    };
    write_result(t, &result)?;
    Ok(if result.splits.iter().all(|m| m.completed == 0) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The splits the budget allows (the cluster's GPUs per instance counted for
/// `--gpu-budget`), and the budget as the table says it.
fn splits_to_measure(
    t: &TuneArgs,
    found: &Found,
    start: Split,
) -> anyhow::Result<(Vec<Split>, String)> {
    let plan = super::common::read_plan(&StateDir::new(&found.dir).plan_path())?;
    let gpus_of = |role: Role| plan.by_role(role).next().map_or(0, |s| s.gpus.len() as u32);
    let gpus_per = (gpus_of(Role::Prefill), gpus_of(Role::Decode));
    if t.gpu_budget.is_some() && gpus_per == (0, 0) {
        return Err(ExitError::usage(format!(
            "--gpu-budget: the engines of cluster {} hold no GPU; give --budget N (instances) instead",
            found.cluster
        )));
    }
    let budget = t.budget(start.prefill + start.decode, gpus_per);
    let splits = choose::candidates(budget);
    let budget_text = match budget {
        Budget::Instances(n) => format!("{n} instance{}", if n == 1 { "" } else { "s" }),
        Budget::Gpus { gpus, .. } => format!("{gpus} GPUs"),
    };
    if splits.is_empty() {
        return Err(ExitError::usage(format!(
            "a budget of {budget_text} leaves no split with at least one prefill and one decode instance; give a larger --budget"
        )));
    }
    Ok((splits, budget_text))
}

/// The requests every split is measured with, sent to the proxy at `proxy` (the model:
/// `--model`, else the first one the proxy lists).
async fn workload_of(t: &TuneArgs, proxy: &str) -> anyhow::Result<Workload> {
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()?;
    let model = match &t.workload.model {
        Some(m) => m.clone(),
        None => crate::bench::first_model(&http, proxy).await?,
    };
    let bench = t.bench_args();
    let requests = crate::bench::dataset::build(&bench, &[], &[])
        .map_err(|e| ExitError::usage(e.to_string()))?;
    Ok(Workload {
        load: crate::bench::runner::Load::of(&t.workload, proxy.to_string(), model, true),
        requests,
        slo: t.slo(),
        dataset: crate::spelling::value_name(t.workload.dataset),
    })
}

/// The workload as the result records it.
fn workload_info(t: &TuneArgs, workload: &Workload) -> WorkloadInfo {
    WorkloadInfo {
        dataset: workload.dataset.clone(),
        num_prompts: t.workload.num_prompts,
        input_len: t.workload.input_len,
        output_len: t.workload.output_len,
        request_rate: t.workload.request_rate,
        max_concurrency: t.workload.max_concurrency,
    }
}

/// Prints the table, and writes `--json` and `--plot` when asked.
fn write_result(t: &TuneArgs, result: &TuneResult) -> anyhow::Result<()> {
    print!("{}", result.table());
    if let Some(path) = &t.json {
        std::fs::write(path, serde_json::to_string_pretty(result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    if let Some(path) = &t.plot {
        let runs: Vec<&crate::bench::report::Report> =
            result.splits.iter().map(|m| &m.bench).collect();
        std::fs::write(path, crate::pictures::latency::svg(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// The workload flags the bench would refuse, refused before anything moves.
fn check_args(t: &TuneArgs) -> anyhow::Result<()> {
    t.workload
        .check()
        .map_err(|e| ExitError::usage(e.to_string()))?;
    if t.budget == Some(0) || t.gpu_budget == Some(0) {
        return Err(ExitError::usage(
            "a budget of 0 leaves nothing to split; give at least 2",
        ));
    }
    Ok(())
}
