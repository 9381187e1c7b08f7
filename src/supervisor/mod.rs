//! The supervisor: runs a plan's services, probes them, restarts them, stops them.
//!
//! It executes a [`crate::plan::Plan`] and knows nothing of vLLM nor of the proxy; the
//! commands that drive it (`pdctl up / down / status / logs / restart`, the hidden
//! `supervise`) and what a person sees of a cluster (the status table with the proxy's
//! figures, `pdctl logs`, the client half of `up -d`) live in `crate::cli`. Folders by concern:
//! - `run/`: the running side: the supervisor process, one task per service (dependency
//!   waiting and run watching as its children), the restart policy, stopping, remote
//!   nodes, the control socket, the shared status table and the foreground output;
//! - `process/`: spawning processes so that none outlives the supervisor, the watchdog,
//!   reading `/proc`;
//! - `state_dir/`: the state directory, its lock and run record, log files, cleaning up
//!   after a killed supervisor, finding running clusters;
//! - `preflight`: every problem found before anything is spawned;
//! - `testing` (tests only): the plans and services its unit tests build on.
//!
//! The folders are private; what other stages use is re-exported below, so this file is
//! the supervisor's whole public face.

mod preflight;
mod process;
mod run;
mod state_dir;
#[cfg(test)]
mod testing;

pub use preflight::bullet_list;
pub use preflight::check as preflight_check;
pub use preflight::check_added as preflight_added;
pub use process::procfs::{ProcInfo, marked_processes, process};
pub use process::watchdog::watch as run_watchdog;
pub use run::console::colour_wanted;
pub use run::control_server::Origin;
pub use run::ops_hook::Operations;
pub use run::progress::{
    Renderer, StartupEnd, exit_summary, failure_text, rows as progress_rows, startup_verdict,
};
pub use run::runner::{RunOptions, run};
pub use run::service::FAILURE_LINES;
pub use state_dir::logfile::{
    DEFAULT_KEEP, DEFAULT_MAX_BYTES, NOTE_PREFIX, format_utc, log_message, rotated_path, strip_ansi,
};
pub use state_dir::select;
pub use state_dir::stale::clean_if_stale;
pub use state_dir::state::{
    ClusterLock, RunRecord, SUPERVISOR_LOG_NAME, StateDir, make_private, private_umask,
    read_record, sync_dir, write_atomic,
};

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
    #[error(
        "node `{node}` is one of several: its supervisor needs the cluster's certificates to talk to the others. On the head `pdctl up` starts the nodes with `ssh` in [nodes]; for another, run `pdctl join-token` on the head and give it here as {} (or `--join-token-file FILE`)",
        crate::control::auth::JOIN_TOKEN_ENV
    )]
    NoSecret { node: String },
    #[error("the state directory {} is not safe to use: {why}; give pdctl a directory of your own (--state-dir DIR, or fix its owner and mode: chmod 700)", path.display())]
    UnsafeStateDir { path: PathBuf, why: String },
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
                | SupervisorError::UnsafeStateDir { .. }
                | SupervisorError::WhichCluster { .. }
        )
    }
}
