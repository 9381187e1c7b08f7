//! The rebalancer's figures over time: one [`HistoryPoint`] a look, appended to
//! `rebalance-history.jsonl` in the cluster's state dir, so that `pdctl rebalance history`
//! can list and plot how the figures and the split went, during a run or after it. The
//! file is bounded: past [`ROTATE_AT`] bytes it becomes `rebalance-history.jsonl.1` (the
//! one before is dropped), so at most twice that is kept.

use crate::vocab::HistoryPoint;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file each look's point is appended to, one JSON object a line.
pub const HISTORY_FILE: &str = "rebalance-history.jsonl";

/// Size past which the file is set aside (about a day of looks 5 s apart).
pub const ROTATE_AT: u64 = 8 << 20;

fn older(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Appends `point` to the history in `state_dir`, setting a full file aside first.
pub fn append(state_dir: &Path, point: &HistoryPoint) -> std::io::Result<()> {
    append_bounded(&state_dir.join(HISTORY_FILE), point, ROTATE_AT)
}

fn append_bounded(path: &Path, point: &HistoryPoint, limit: u64) -> std::io::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() >= limit) {
        std::fs::rename(path, older(path))?;
    }
    append_line(path, point)
}

/// Appends `value` to `path` as one line of JSON (the history's and the moves' files).
pub fn append_line(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let line = serde_json::to_string(value).map_err(std::io::Error::other)?;
    writeln!(f, "{line}")
}

/// The points kept in `state_dir`, oldest first (the set-aside file's, then the current
/// file's; lines that do not read are skipped).
pub fn read(state_dir: &Path) -> Vec<HistoryPoint> {
    let path = state_dir.join(HISTORY_FILE);
    [older(&path), path]
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect::<Vec<HistoryPoint>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Figures, RebalanceMode, Split};

    fn point(at_ms: u64) -> HistoryPoint {
        HistoryPoint {
            at_ms,
            mode: RebalanceMode::Act,
            split: Split {
                prefill: 2,
                decode: 2,
            },
            measured_s: 3,
            figures: Figures::default(),
            ttft_p90_ms: Some(200.0),
            itl_p90_ms: None,
            verdict: "objectives met".into(),
        }
    }

    #[test]
    fn a_full_file_is_set_aside_and_both_are_read_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(HISTORY_FILE);
        let limit = serde_json::to_string(&point(0)).unwrap().len() as u64 * 2;
        for at in 0..5 {
            append_bounded(&path, &point(at), limit).unwrap();
        }
        // Two lines a file: 0,1 set aside then dropped, 2,3 set aside, 4 current.
        let read_back: Vec<u64> = read(dir.path()).iter().map(|p| p.at_ms).collect();
        assert_eq!(read_back, vec![2, 3, 4]);
        std::fs::write(&path, "not json\n").unwrap();
        assert_eq!(read(dir.path()).len(), 2, "a bad line is skipped");
    }
}
