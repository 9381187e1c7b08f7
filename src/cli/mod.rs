//! Command-line entry: parses arguments, runs one command, maps its outcome to an exit code
//! the way docker compose users expect (0 ok, 1 failure, 2 bad input, 3 nothing running).
//!
//! Besides the commands, what a person sees of a cluster lives here, on the client side:
//! `view` (the status table, composing the supervisor's status report with the proxy's
//! figures), `logs_cmd` (`pdctl logs`) and `detach` (the client half of `up -d`).

mod check;
pub mod cluster;
pub mod common;
mod dashboard;
mod detach;
mod down;
pub mod exit;
pub mod export;
mod info;
mod live;
mod log_buffer;
mod logs_cmd;
mod pull;
mod rebalance;
mod rebalance_history;
mod remote_up;
mod restart;
mod rotate_head;
mod secret;
mod tune;
mod view;

use crate::child_config::Configured;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

pub use exit::ExitError;

/// pdctl: prefill/decode disaggregated LLM serving from one TOML topology.
#[derive(Debug, Parser)]
#[command(name = "pdctl", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Every verb pdctl knows.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print what `up` would run: commands, env, GPUs, ports, probes, generated files.
    Plan(info::PlanArgs),
    /// Start the cluster and keep it up (foreground, or -d to detach).
    Up(cluster::UpArgs),
    /// Fetch the model the engines serve into their Hugging Face cache, with progress (what
    /// `up` does first when it is missing).
    Pull(pull::PullArgs),
    /// Stop every service of the running cluster and remove its runtime state.
    Down(down::DownArgs),
    /// Show the state of every service (table, or --json).
    Status(cluster::StatusArgs),
    /// Restart services (`decode-1`) or roles (`prefill`) of the running cluster.
    Restart(restart::RestartArgs),
    /// Set how many instances a role has, while serving: `scale decode=2`.
    Scale(live::ScaleArgs),
    /// Switch the rebalancer (`[rebalance]`) while serving: `off`, `advise` or `act`; or
    /// `history`: the figures of each look and the moves, as a table, JSON or a plot.
    Rebalance(rebalance::RebalanceArgs),
    /// Change the running cluster to what a topology says, while serving (`--dry-run` shows
    /// the change only).
    Apply(live::ApplyArgs),
    /// After the head found its change journal unreadable (moved aside to
    /// `journal.json.bad-<time>`, `status` says so): say you have seen it, so changes run
    /// again.
    AckJournal(cluster::AckJournalArgs),
    /// Print the cluster's secret (or with --engine-key the key its engines require).
    Secret(secret::SecretArgs),
    /// On the head: print the token a node started by hand joins with
    /// (`PDCTL_JOIN_TOKEN=... pdctl up --node NODE`): it pins the cluster's CA.
    JoinToken(secret::JoinTokenArgs),
    /// Find the prefill:decode split for a workload and its objectives by measuring each
    /// split on the running cluster (moved there live).
    Tune(tune::TuneCommand),
    /// Prove the KV path: one probe per prefill -> decode pair, the decode's own counters
    /// say whether the KV moved (exit 1 when a pair did not), plus transport and pair checks.
    Check(check::CheckArgs),
    /// Print the address of the running cluster's live page and open it in a browser
    /// where one is at hand (`[dashboard]`; `pdctl up` prints it too).
    Dashboard(dashboard::DashboardArgs),
    /// Show the logs of a role (`prefill`) or one service (`prefill-2`).
    Logs(cluster::LogsArgs),
    /// List the GPUs this machine has (NVML), or say why none can be read.
    Gpus(info::GpusArgs),
    /// List the built-in topologies with one line each.
    Profiles(info::ProfilesArgs),
    /// Write the plan as manifests for another system (`export k8s`: Kubernetes).
    Export(export::ExportArgs),
    /// Run the PD proxy alone, in front of instances started by other means (flags, or
    /// `--config FILE` with flags given beside it overriding the file).
    Proxy(Configured<crate::child_config::proxy::ProxyArgs>),
    /// Run a simulated engine (speaks vLLM's HTTP API; says it is a simulator); flags, or
    /// `--config FILE` with flags given beside it overriding the file.
    Sim(Configured<crate::child_config::sim::SimArgs>),
    /// Benchmark an OpenAI-compatible endpoint (the running cluster's proxy by default).
    Bench(crate::bench::args::BenchArgs),
    /// Internal: the supervisor process that `up -d` leaves running.
    #[command(hide = true)]
    Supervise(cluster::SuperviseArgs),
    /// Internal: what `pdctl up` on the head runs on a node over SSH (the plan and the
    /// node's credentials come on stdin).
    #[command(hide = true)]
    NodeUp,
}

/// Parses the command line and runs it; never panics on user error.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let log_buffer = init_tracing(&cli.command);
    let code = match run(cli.command) {
        Ok(code) => code,
        Err(err) => exit::report(err),
    };
    if let Some(buffer) = log_buffer {
        buffer.flush();
    }
    code
}

/// Sets up logging to stderr; for the proxy, with its access lines gathered (returned, to
/// be written out at the end).
fn init_tracing(cmd: &Command) -> Option<log_buffer::LogBuffer> {
    // Long-running servers log at info; one-shot commands stay quiet unless RUST_LOG says.
    let default = match cmd {
        Command::Proxy(_) | Command::Sim(_) | Command::Supervise(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only on a terminal: services' stderr goes to log files under `up`.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_env_filter(filter);
    if matches!(cmd, Command::Proxy(_)) {
        let buffer = log_buffer::LogBuffer::start();
        let _ = builder.with_writer(buffer.clone()).try_init();
        Some(buffer)
    } else {
        let _ = builder.with_writer(std::io::stderr).try_init();
        None
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Threads a long-running server process (proxy, sim) runs blocking work on at most. Each
/// such thread costs memory for as long as it lives (its stack and its own allocator heap),
/// and tokio's default allows 512: under 1000 concurrent streams the decode sim runs one
/// blocking KV load of the shared-directory handoff per request, which could start as many
/// threads as loads overlap (docs/proxy.md, "Memory"). The work they do (small file reads
/// and writes, DNS lookups) queues for a free one instead.
const SERVER_BLOCKING_THREADS: usize = 4;

/// The runtime of a server process (proxy, sim): the default worker threads, few blocking
/// threads.
fn server_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(SERVER_BLOCKING_THREADS)
        .on_thread_park(crate::allocator::on_thread_park)
        .build()?)
}

/// Runs one command to completion.
pub fn run(cmd: Command) -> anyhow::Result<ExitCode> {
    match cmd {
        Command::Plan(a) => info::plan(a),
        Command::Gpus(a) => info::gpus(a),
        Command::Profiles(a) => info::profiles(a),
        Command::Up(a) => cluster::up(a),
        Command::Pull(a) => pull::pull(&a),
        Command::Down(a) => cluster::down(a),
        Command::Status(a) => cluster::status(a),
        Command::Logs(a) => cluster::logs(a),
        Command::Dashboard(a) => dashboard::run(a),
        Command::Restart(a) => cluster::restart(a),
        Command::Scale(a) => live::scale(&a, runtime()?),
        Command::Rebalance(a) => rebalance::rebalance(&a, runtime()?),
        Command::Apply(a) => cluster::apply(a),
        Command::Tune(a) => tune::tune(a),
        Command::Check(a) => check::check(a),
        Command::Supervise(a) => cluster::supervise(a),
        Command::Secret(a) => secret::show(a),
        Command::JoinToken(a) => secret::join_token(a),
        Command::AckJournal(a) => cluster::ack_journal(a),
        Command::NodeUp => cluster::node_up(),
        Command::Export(a) => export::export(a),
        Command::Proxy(a) => {
            let a = a.resolve(|p| std::fs::read_to_string(p))?;
            server_runtime()?
                .block_on(crate::proxy::run(a))
                .map(|_| ExitCode::SUCCESS)
        }
        Command::Sim(a) => {
            let a = a.resolve(|p| std::fs::read_to_string(p))?;
            server_runtime()?
                .block_on(crate::sim::run(a))
                .map(|_| ExitCode::SUCCESS)
        }
        Command::Bench(a) => runtime()?.block_on(crate::bench::run(a, |runs| {
            Ok(crate::pictures::latency::svg(runs)?)
        })),
    }
}
