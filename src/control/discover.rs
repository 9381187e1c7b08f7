//! Finding running clusters: every `<root>/*/control.sock` that answers `Status`.

use super::{Request, Response, SOCKET_NAME, StatusReport};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A cluster whose supervisor answered.
#[derive(Debug, Clone)]
pub struct Running {
    pub socket: PathBuf,
    pub report: StatusReport,
}

/// Why no single running cluster could be chosen.
#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(
        "no pdctl cluster is running under {root} (start one with `pdctl up`, or give --state-dir)"
    )]
    NothingRunning { root: String },
    #[error("no running cluster is named `{name}` under {root}; running: {running}")]
    NotFound {
        name: String,
        root: String,
        running: String,
    },
    #[error("several clusters run under {root}: {running}; choose one with --cluster NAME")]
    Ambiguous { root: String, running: String },
}

/// Every cluster under `root` whose supervisor answers within a second.
pub async fn running(root: &Path) -> Vec<Running> {
    let Ok(dir) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut sockets: Vec<PathBuf> = dir
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(SOCKET_NAME))
        .filter(|p| p.exists())
        .collect();
    sockets.sort();
    let mut out = Vec::new();
    for socket in sockets {
        if let Ok(Response::Status(report)) =
            super::client::send(&socket, &Request::Status, Duration::from_secs(1)).await
        {
            out.push(Running { socket, report });
        }
    }
    out
}

/// The only running cluster, or the one named `name`.
pub async fn pick(root: &Path, name: Option<&str>) -> Result<Running, DiscoverError> {
    let all = running(root).await;
    let root_s = root.display().to_string();
    let names = || {
        all.iter()
            .map(|r| r.report.cluster.clone())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match name {
        Some(n) => {
            let running = names();
            all.into_iter()
                .find(|r| r.report.cluster == n)
                .ok_or(DiscoverError::NotFound {
                    name: n.to_string(),
                    root: root_s,
                    running: if running.is_empty() {
                        "none".into()
                    } else {
                        running
                    },
                })
        }
        None if all.is_empty() => Err(DiscoverError::NothingRunning { root: root_s }),
        None if all.len() > 1 => Err(DiscoverError::Ambiguous {
            root: root_s,
            running: names(),
        }),
        None => Ok(all.into_iter().next().expect("one")),
    }
}
