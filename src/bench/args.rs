//! Arguments of `pdctl bench`.

/// Everything `pdctl bench` takes.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {}
