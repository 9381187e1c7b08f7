//! The supervisor: runs a plan's services, probes them, restarts them, stops them.
//!
//! It executes a [`crate::plan::Plan`] and knows nothing of vLLM. Layout:
//! - the commands that drive it (`pdctl up / down / status / logs / restart`, the hidden
//!   `supervise`) live in `crate::cli::cluster`, so this module depends on no CLI code but
//!   [`select`]'s usage errors;
//! - [`state`], [`stale`], [`procfs`], [`select`]: the state dir, its lock and run record,
//!   cleaning up after a killed supervisor, finding running clusters;
//! - [`preflight`]: every problem found before anything is spawned;
//! - [`spawner`], [`watchdog`]: starting processes so that none outlives the supervisor;
//! - [`service`], [`run_watch`], [`deps`], [`remote`], [`pump`], [`policy`], [`probe`],
//!   [`table`]: one task per service (waiting for dependencies, watching each run, moving
//!   its output), probes of other nodes' services, the restart policy, readiness/liveness
//!   probes, and the shared state `status` reads;
//! - [`runner`], [`stop`], [`control_server`]: the supervisor process itself;
//! - [`logfile`], [`console`], [`progress`], [`view`], [`logs_cmd`], [`detach`]: what users see.

pub mod console;
pub mod control_server;
pub mod deps;
pub mod detach;
pub mod logfile;
pub mod logs_cmd;
pub mod policy;
pub mod preflight;
pub mod probe;
pub mod procfs;
pub mod progress;
pub mod pump;
pub mod remote;
pub mod run_watch;
pub mod runner;
pub mod select;
pub mod service;
pub mod spawner;
pub mod stale;
pub mod state;
pub mod stop;
pub mod table;
pub mod view;
pub mod watchdog;

use std::path::{Path, PathBuf};

/// Everything that can go wrong inside the supervisor, each saying what and where.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("could not {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cluster in {} is already running{}; see `pdctl status`, or stop it with `pdctl down` first",
        dir.display(),
        pid.map(|p| format!(" (supervisor pid {p})")).unwrap_or_default()
    )]
    AlreadyRunning { dir: PathBuf, pid: Option<i32> },
    #[error("the run record {} is unreadable ({reason}); remove it if no supervisor runs", path.display())]
    BadRecord { path: PathBuf, reason: String },
    #[error("pre-flight found {} problem(s), nothing was started:\n{}", .0.len(), preflight::bullet_list(.0))]
    Preflight(Vec<String>),
    #[error("node `{node}` is not in the topology (nodes: {known}); pass --node with one of them")]
    UnknownNode { node: String, known: String },
    #[error("{count} clusters {what} under {}: {names}; name one with --cluster NAME", root.display())]
    WhichCluster {
        count: usize,
        what: &'static str,
        root: PathBuf,
        names: String,
    },
}

impl SupervisorError {
    /// An I/O error with the action and the path it concerned.
    pub fn io(what: &'static str, path: &Path, source: std::io::Error) -> SupervisorError {
        SupervisorError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }

    /// True for errors the user fixes by changing input (exit code 2).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            SupervisorError::AlreadyRunning { .. }
                | SupervisorError::Preflight(_)
                | SupervisorError::UnknownNode { .. }
                | SupervisorError::WhichCluster { .. }
        )
    }
}
