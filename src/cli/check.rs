//! `pdctl check`: the command-line half of `crate::check` — the running cluster's pairs,
//! the transport each engine is configured with (and a warning for TCP on a machine with
//! RDMA devices), one line per pair, exit 0 when every pair moved its KV and 1 when one
//! did not (or its models could not be compared). The engines get the cluster's engine
//! key, the proxy the client key `PDCTL_API_KEY` when it is set.

use super::ExitError;
use super::common::ClusterArgs;
use super::common::running;
use crate::check::{
    Clients, Engine, PairResult, ask, pair_model, probe, proxy_model, running_mismatches,
};
use crate::connectors::transport;
use crate::control::client;
use crate::plan::pairs::engine_facts;
use crate::supervisor::StateDir;
use crate::vocab::Role;
use clap::Args;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `pdctl check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Length of each probe prompt, in words (about as many tokens).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Write every pair's result as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl check`.
pub fn check(a: CheckArgs) -> anyhow::Result<ExitCode> {
    super::runtime()?.block_on(run(a))
}

async fn run(a: CheckArgs) -> anyhow::Result<ExitCode> {
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "check")?;
    let report = client::status(&found.socket, Duration::from_secs(5)).await?;
    let plan = super::common::read_plan(&StateDir::new(&found.dir).plan_path())?;
    let proxy = report.proxy_url.clone().ok_or_else(|| {
        ExitError::usage(format!(
            "cluster {} has no proxy: check sends its probes through it",
            found.cluster
        ))
    })?;
    // The engines as they run now (after any scale), with their planned facts.
    let engines = |role: Role| -> Vec<Engine> {
        report
            .services
            .iter()
            .filter(|s| s.role == role)
            .filter_map(|s| {
                let svc = plan.service(&s.name)?;
                Some(Engine {
                    planned: engine_facts(svc, plan.settings_of(&s.name))?,
                    url: s.url.clone()?,
                })
            })
            .collect()
    };
    let (prefill, decode) = (engines(Role::Prefill), engines(Role::Decode));
    if prefill.is_empty() || decode.is_empty() {
        return Err(ExitError::usage(format!(
            "cluster {} has no prefill/decode pair to check",
            found.cluster
        )));
    }
    println!(
        "cluster {}: connector {}, proxy protocol {}",
        found.cluster, plan.connector, plan.protocol
    );
    print_transports(&plan, prefill.iter().chain(&decode));
    let engine_key = crate::control::auth::kept_engine_key(&found.dir)?;
    let client_key = std::env::var(CLIENT_KEY_ENV).ok().filter(|k| !k.is_empty());
    let clients = Clients::new(
        engine_key.as_ref().map(|k| k.reveal()),
        client_key.as_deref(),
    )?;
    let model = proxy_model(&clients.proxy, &proxy, client_key.is_some())
        .await
        .map_err(|why| ExitError::usage(format!("pdctl check: {why}")))?;
    println!("model (as the proxy lists it): {model}");
    let mut results: Vec<PairResult> = Vec::new();
    for p in &prefill {
        let pa = ask(&clients.engines, &p.url).await;
        for d in &decode {
            let da = ask(&clients.engines, &d.url).await;
            let (pa, da) = match (&pa, &da) {
                (Ok(x), Ok(y)) => (x, y),
                (Err(e), _) | (_, Err(e)) => {
                    results.push(unreachable(p, d, e));
                    continue;
                }
            };
            results.push(
                check_pair(
                    &clients,
                    &proxy,
                    &model,
                    (p, pa),
                    (d, da),
                    &plan.connector,
                    a.prompt_tokens,
                )
                .await,
            );
        }
    }
    print!("{}", table(&results));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)? + "\n")?;
        eprintln!("results written to {}", path.display());
    }
    Ok(summary(&results))
}

/// Prints the KV transport each engine is configured with (once when they agree), and a
/// warning when the KV moves over TCP on a machine with RDMA devices.
fn print_transports<'a>(plan: &crate::plan::Plan, engines: impl Iterator<Item = &'a Engine>) {
    let rdma = transport::rdma_devices();
    let mut transports: Vec<(String, transport::Transport)> = Vec::new();
    for e in engines {
        if let Some(svc) = plan.service(&e.planned.name) {
            transports.push((
                e.planned.name.clone(),
                transport::of(&plan.connector, svc, plan.settings_of(&svc.name)),
            ));
        }
    }
    let Some((_, first)) = transports.first() else {
        return;
    };
    if transports.iter().all(|(_, t)| t == first) {
        println!("KV transport: {}", first.text);
    } else {
        for (name, t) in &transports {
            println!("KV transport of {name}: {}", t.text);
        }
    }
    if transports.iter().any(|(_, t)| t.tcp) && !rdma.is_empty() {
        println!(
            "warning: the KV moves over TCP, but this machine has RDMA devices ({}): set the connector's transport to use them",
            rdma.join(", ")
        );
    }
}

/// The closing line, and the exit code: 0 when every pair passed, 1 when one did not.
fn summary(results: &[PairResult]) -> ExitCode {
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !passed(r))
        .map(|r| format!("{} -> {}", r.prefill, r.decode))
        .collect();
    if failed.is_empty() {
        println!(
            "every pair moved its KV ({} of {})",
            results.len(),
            results.len()
        );
        ExitCode::SUCCESS
    } else {
        let what = if results
            .iter()
            .all(|r| r.model.is_some() && r.against_plan.is_empty())
        {
            "did NOT move their KV"
        } else {
            "did NOT pass (KV not moved, models not compared, or sizes not as planned)"
        };
        println!(
            "{} of {} pairs {what}: {}",
            failed.len(),
            results.len(),
            failed.join(", ")
        );
        ExitCode::from(1)
    }
}

/// The variable that gives `check` the key the proxy asks clients for (the proxy takes
/// it from the same variable).
const CLIENT_KEY_ENV: &str = "PDCTL_API_KEY";

/// Whether a pair passed: its KV moved, its models were compared, and both engines run
/// with the sizes the plan gave them.
fn passed(r: &PairResult) -> bool {
    r.moved && r.model.is_some() && r.against_plan.is_empty()
}

/// Checks one pair that answered: its mismatches, its models (a pair whose models cannot
/// be compared fails, saying why), and its probe.
async fn check_pair(
    clients: &Clients,
    proxy: &str,
    model: &str,
    (p, pa): (&Engine, &crate::check::Answered),
    (d, da): (&Engine, &crate::check::Answered),
    connector: &str,
    prompt_tokens: usize,
) -> PairResult {
    let mismatches = running_mismatches(p, pa, d, da, connector);
    let block = da.block_size.unwrap_or(d.planned.block_size);
    let mut r = probe(clients, proxy, model, p, d, prompt_tokens, block).await;
    r.mismatches = mismatches.iter().map(ToString::to_string).collect();
    r.sizes = vec![
        crate::check::EngineSizes::of(p, pa),
        crate::check::EngineSizes::of(d, da),
    ];
    r.against_plan = crate::check::against_plan(p, pa);
    r.against_plan.extend(crate::check::against_plan(d, da));
    match pair_model(p, pa, d, da) {
        Ok(m) => r.model = m,
        Err(why) => {
            r.problem = Some(match r.problem.take() {
                Some(other) => format!("{why}; {other}"),
                None => why.to_string(),
            });
        }
    }
    r
}

fn unreachable(p: &Engine, d: &Engine, e: &crate::check::CheckError) -> PairResult {
    PairResult {
        problem: Some(e.to_string()),
        ..PairResult::untried(p, d)
    }
}

/// One line per pair, then its mismatches and problem indented under it.
fn table(results: &[PairResult]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<28} {:<6} {:>16} {:>10} {:>12}  MODEL",
        "PAIR", "KV", "HANDED OFF", "TIME", "TOKENS/S"
    );
    for r in results {
        let _ = writeln!(
            o,
            "{:<28} {:<6} {:>16} {:>10} {:>12}  {}",
            format!("{} -> {}", r.prefill, r.decode),
            if r.moved { "moved" } else { "NOT" },
            format!("{}/{} tok", r.external_tokens, r.expected_tokens),
            format!("{:.1} ms", r.elapsed_ms),
            format!("{:.0}", r.tokens_per_s),
            r.model.as_deref().unwrap_or("?"),
        );
        if let [p, d] = r.sizes.as_slice() {
            let _ = writeln!(o, "    sizes: {p}; {d}");
        }
        for m in &r.mismatches {
            let _ = writeln!(o, "    mismatch: {m}");
        }
        for m in &r.against_plan {
            let _ = writeln!(o, "    not as planned: {m}");
        }
        if let Some(p) = &r.problem {
            let _ = writeln!(o, "    {p}");
        }
    }
    o
}
