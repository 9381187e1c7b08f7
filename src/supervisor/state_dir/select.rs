//! Which cluster `down`, `status` and `logs` act on: the only one running under the state
//! root, or the one named with `--cluster`.

use crate::supervisor::SupervisorError;
use crate::supervisor::state_dir::state::{RunRecord, StateDir, read_record};
use std::path::Path;

/// A cluster directory found under the state root.
#[derive(Debug, Clone)]
pub struct Found {
    pub state: StateDir,
    /// The directory's name (`t1`, or `t1-worker` for one node of a multi-node cluster).
    pub dir_name: String,
    /// The run record, when one exists and could be read.
    pub record: Option<RunRecord>,
    /// A supervisor for it is alive.
    pub running: bool,
}

impl Found {
    /// The name to show: the cluster name from the record, else the directory's.
    pub fn label(&self) -> String {
        match &self.record {
            Some(r) if r.cluster != self.dir_name => {
                format!("{} (node {}, {})", r.cluster, r.node, self.dir_name)
            }
            _ => self.dir_name.clone(),
        }
    }

    fn matches(&self, name: &str) -> bool {
        self.dir_name == name || self.record.as_ref().is_some_and(|r| r.cluster == name)
    }
}

/// Every cluster directory under `root` (and `root` itself if it is one), sorted by name.
pub fn scan(root: &Path) -> Vec<Found> {
    let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    dirs.push(root.to_path_buf());
    let mut found: Vec<Found> = dirs
        .into_iter()
        .map(StateDir::new)
        .filter(|s| s.record_path().exists() || s.logs_dir().is_dir())
        .map(|state| {
            let record = read_record(&state).ok().flatten();
            let running = record.as_ref().is_some_and(RunRecord::supervisor_alive);
            let dir_name = state
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            Found {
                state,
                dir_name,
                record,
                running,
            }
        })
        .collect();
    found.sort_by(|a, b| a.dir_name.cmp(&b.dir_name));
    found
}

/// The running cluster to act on. `Ok(None)` when none runs (or not the named one);
/// exit 2 when several run and none was named.
pub fn running(root: &Path, cluster: Option<&str>) -> Result<Option<Found>, SupervisorError> {
    let live: Vec<Found> = scan(root).into_iter().filter(|f| f.running).collect();
    choose(live, cluster, root, "running")
}

/// A cluster that has logs (running or not), for `pdctl logs` after a `down`.
pub fn with_logs(root: &Path, cluster: Option<&str>) -> Result<Option<Found>, SupervisorError> {
    let all = scan(root);
    if let Some(live) = choose(
        all.iter().filter(|f| f.running).cloned().collect(),
        cluster,
        root,
        "running",
    )? {
        return Ok(Some(live));
    }
    let with_logs = all
        .into_iter()
        .filter(|f| f.state.logs_dir().is_dir())
        .collect();
    choose(with_logs, cluster, root, "with logs")
}

fn choose(
    candidates: Vec<Found>,
    cluster: Option<&str>,
    root: &Path,
    what: &'static str,
) -> Result<Option<Found>, SupervisorError> {
    let mut matching: Vec<Found> = match cluster {
        Some(name) => candidates.into_iter().filter(|f| f.matches(name)).collect(),
        None => candidates,
    };
    match matching.len() {
        0 => Ok(None),
        1 => Ok(matching.pop()),
        _ => Err(SupervisorError::WhichCluster {
            count: matching.len(),
            what,
            root: root.to_path_buf(),
            names: matching
                .iter()
                .map(Found::label)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Stale records under `root`: a supervisor wrote them and died without `down`.
pub fn stale(root: &Path, cluster: Option<&str>) -> Vec<Found> {
    scan(root)
        .into_iter()
        .filter(|f| f.record.is_some() && !f.running)
        .filter(|f| cluster.is_none_or(|c| f.matches(c)))
        .collect()
}
