//! The PD proxy (`pdctl proxy`).

pub mod args;

/// Runs the proxy until it is stopped.
pub async fn run(_args: args::ProxyArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
