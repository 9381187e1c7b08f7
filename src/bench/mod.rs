//! `pdctl bench`.

pub mod args;

/// Runs a benchmark.
pub async fn run(_args: args::BenchArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("not built yet")
}
