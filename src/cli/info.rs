//! `pdctl plan`, `pdctl gpus`, `pdctl profiles`: commands that only look.

use super::common::TopologyArgs;
use clap::Args;
use std::process::ExitCode;

/// Arguments of `pdctl plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Print the plan as JSON (a stable document for scripts and tests).
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `pdctl gpus`.
#[derive(Debug, Args)]
pub struct GpusArgs {
    /// Print the inventory as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `pdctl profiles`.
#[derive(Debug, Args)]
pub struct ProfilesArgs {}

/// Prints what `up` would run.
pub fn plan(a: PlanArgs) -> anyhow::Result<ExitCode> {
    let loaded = crate::plan::resolve::resolve(&a.topology.request())?;
    if let Some(v) = &loaded.version_note {
        eprintln!("pdctl: warning: {}", v.note);
    }
    let missing: Vec<String> = loaded.missing.iter().map(|m| m.to_string()).collect();
    if a.json {
        let mut doc = serde_json::to_value(&loaded.plan)?;
        doc["source"] = loaded.source_note.clone().into();
        doc["missing"] = missing.into();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!(
            "{}",
            crate::plan::render::render(&loaded.plan, &loaded.source_note, &missing)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Lists this machine's GPUs, or says in one line why none can be read (exit 1).
pub fn gpus(a: GpusArgs) -> anyhow::Result<ExitCode> {
    match crate::gpu::detect() {
        Ok(list) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({ "gpus": list }))?
                );
            } else if list.is_empty() {
                println!("NVML answered but lists no GPU");
            } else {
                println!(
                    "{:<5} {:<28} {:>18} {:<36} PROCESSES",
                    "GPU", "NAME", "MEMORY USED/TOTAL", "UUID"
                );
                for g in &list {
                    let mem = match (g.memory_used_mib, g.memory_total_mib) {
                        (Some(u), Some(t)) => format!("{u}/{t} MiB"),
                        _ => "?".into(),
                    };
                    let procs: Vec<String> = g.processes.iter().map(u32::to_string).collect();
                    println!(
                        "{:<5} {:<28} {:>18} {:<36} {}",
                        g.index,
                        g.name.as_deref().unwrap_or("?"),
                        mem,
                        g.uuid.as_deref().unwrap_or("?"),
                        if procs.is_empty() {
                            "-".into()
                        } else {
                            procs.join(",")
                        }
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({ "gpus": [], "error": e.reason })
                    )?
                );
            } else {
                eprintln!("{e}");
            }
            Ok(ExitCode::from(1))
        }
    }
}

/// Lists the built-in profiles with one line each.
pub fn profiles(_a: ProfilesArgs) -> anyhow::Result<ExitCode> {
    let width = crate::profiles::ALL
        .iter()
        .map(|p| p.name.len())
        .max()
        .unwrap_or(0);
    for p in crate::profiles::ALL {
        println!("{:<width$}  {}", p.name, p.description());
    }
    Ok(ExitCode::SUCCESS)
}
