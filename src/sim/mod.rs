//! The simulated engine (`pdctl sim`).

pub mod args;

/// Runs the simulator until it is stopped.
pub async fn run(_args: args::SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
