//! `pdctl pull [-f FILE | -p PROFILE]`: the model fetch step alone (as `docker compose
//! pull` fetches images), and how `pdctl up` shows the same step ([`run_fetch`]), which
//! it makes before it plans (`crate::ops::up`), so the engines find the model in their
//! cache, are planned with its size, and start together with nothing of the download
//! counted in their `startup_timeout_s`.

use super::common::TopologyArgs;
use crate::model_fetch::{Progress, Source};
use crate::plan::resolve::{Machine, load_topology, model_to_fetch};
use clap::Args;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `pdctl pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
}

/// `pdctl pull`: fetches the model the topology's engines serve into their cache, with
/// progress; says so when it is there already.
pub fn pull(a: &PullArgs) -> anyhow::Result<ExitCode> {
    fetch_step(&a.topology)?;
    Ok(ExitCode::SUCCESS)
}

/// Where `up` keeps the fetch's progress for `status`: the cluster's name and state dir,
/// and whether to hand each progress to the head too (`node-up`, on its stdout).
pub struct Shown<'a> {
    pub cluster: &'a str,
    pub state_dir: &'a std::path::Path,
    pub to_head: bool,
}

/// How `node-up` hands the head its fetch's progress on its stdout: this, then the
/// [`FetchState`] as JSON, one line each; the head keeps it as [`node_fetch_file`] for its
/// `status` and prints nothing of it.
pub const TO_HEAD_PREFIX: &str = "pdctl-fetch-state ";

/// The file of the head's state dir that holds the fetch progress `node` handed it.
pub fn node_fetch_file(node: &str) -> String {
    format!("fetch-{node}.json")
}

/// The fetches of other nodes the head's `up` is relaying now (their files in the head's
/// state dir `dir`, kept by a process still alive), by node.
pub fn nodes_fetching(dir: &std::path::Path) -> Vec<FetchState> {
    let mut all: Vec<FetchState> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("fetch-") && name.ends_with(".json")
        })
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice::<FetchState>(&b).ok())
        .filter(|f| nix::sys::signal::kill(nix::unistd::Pid::from_raw(f.pid as i32), None).is_ok())
        .collect();
    all.sort_by(|a, b| a.node.cmp(&b.node));
    all
}

/// The file in the state dir that holds a running fetch's progress.
pub const FETCH_FILE: &str = "fetch.json";

/// A fetch in progress as `status` shows it (the file [`FETCH_FILE`], and the JSON of
/// `status --json` while no service has started).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FetchState {
    pub cluster: String,
    pub node: String,
    /// The `pdctl up` fetching it.
    pub pid: u32,
    pub model: String,
    pub done: u64,
    pub total: u64,
    /// `fetching model 1.20 / 3.10 GiB (38%), 45.2 MiB/s, 43 s left`.
    pub text: String,
}

/// The fetch an `up` under `root` is making now (of `cluster` when given), if any: its
/// file, written by a process still alive.
pub fn fetching(root: &std::path::Path, cluster: Option<&str>) -> Option<FetchState> {
    std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path().join(FETCH_FILE)).ok())
        .filter_map(|b| serde_json::from_slice::<FetchState>(&b).ok())
        .filter(|f| cluster.is_none_or(|c| c == f.cluster))
        .find(|f| nix::sys::signal::kill(nix::unistd::Pid::from_raw(f.pid as i32), None).is_ok())
}

/// Seconds between two progress lines.
const EVERY: Duration = crate::ops::fetch::EVERY;

/// The fetch step of `pull`: when this node's engines serve a Hugging Face model their
/// cache lacks, fetches it, printing where from and its progress (bytes done / total,
/// rate, time left) every [`EVERY`]; else says why nothing was fetched. A refusal (gated,
/// unknown model, offline, no room) is an error.
pub fn fetch_step(args: &TopologyArgs) -> anyhow::Result<()> {
    let machine = Machine::new(args.gpus.clone());
    let (t, _) = load_topology(&args.request(), &machine)?;
    let node = args.node.clone().unwrap_or_else(|| t.head.clone());
    match model_to_fetch(&t, &node) {
        Ok(source) => run_fetch(&source, &node, None),
        Err(why) => {
            println!("pdctl: {why}");
            Ok(())
        }
    }
}

/// The fetch step of a node run from a plan (`pdctl node-up`, `up --plan FILE`): the
/// plan's model ([`crate::plan::Plan::model_fetch`]) when `node` runs an engine and its
/// cache lacks it, with the token from the values kept for the engines (`hidden`).
/// Returns whether it fetched.
pub fn fetch_planned(
    plan: &crate::plan::Plan,
    node: &str,
    hidden: &crate::vocab::HiddenEnv,
    shown: Option<Shown>,
) -> anyhow::Result<bool> {
    let Some(source) = crate::ops::fetch::planned_source(plan, node, None, hidden) else {
        return Ok(false);
    };
    run_fetch(&source, node, shown)?;
    Ok(true)
}

/// Fetches `source` for `node`, printing where from and its progress (bytes done / total,
/// rate, time left) every [`EVERY`], and keeping it in the state dir for `status` when
/// `shown` says where.
pub fn run_fetch(source: &Source, node: &str, shown: Option<Shown>) -> anyhow::Result<()> {
    let file = shown.as_ref().map(|s| s.state_dir.join(FETCH_FILE));
    let mut say = |line: String| {
        let _ = writeln!(std::io::stdout(), "pdctl: {line}");
    };
    let mut keep = |p: &Progress| {
        if let (Some(s), Some(file)) = (&shown, &file) {
            let state = FetchState {
                cluster: s.cluster.to_string(),
                node: node.to_string(),
                pid: std::process::id(),
                model: source.model.clone(),
                done: p.done,
                total: p.total,
                text: format!("fetching model {}", p.text()),
            };
            let json = serde_json::to_vec(&state).expect("fetch states serialize");
            let _ = crate::supervisor::write_atomic(file, &json);
            if s.to_head {
                let _ = writeln!(
                    std::io::stdout(),
                    "{TO_HEAD_PREFIX}{}",
                    String::from_utf8_lossy(&json)
                );
            }
        }
    };
    let fetched = source.fetch_saying(node, EVERY, &mut say, &mut keep);
    if let Some(file) = &file {
        let _ = std::fs::remove_file(file);
    }
    fetched?;
    Ok(())
}
