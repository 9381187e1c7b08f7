//! `pdctl rebalance history`: what the rebalancer saw at each look and the moves it made,
//! read straight from the cluster's state dir (`rebalance-history.jsonl`, `rebalance.jsonl`)
//! — so it works while the cluster runs and after `pdctl down`, which keeps both files —
//! as a table a person reads, one JSON object for scripts, or an SVG plot.

use super::ExitError;
use super::common::{ClusterArgs, state_root};
use crate::ops::rebalance::{MOVES_FILE, history, read_moves};
use crate::pictures::rebalance as plot;
use crate::supervisor::{StateDir, format_utc, read_record, select};
use crate::vocab::{HistoryPoint, MoveRecord};
use clap::Args;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The options of `pdctl rebalance history` (refused with a mode).
#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// history: only the last N looks (and the moves since the first of them).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub last: Option<u64>,
    /// history: one JSON object, {"points": [...], "moves": [...]}, instead of the table.
    #[arg(long)]
    pub json: bool,
    /// history: also draw the figures over time and the moves as an SVG into FILE.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

impl HistoryArgs {
    /// The first history option given, to refuse it beside a mode.
    pub fn given(&self) -> Option<&'static str> {
        if self.last.is_some() {
            Some("--last")
        } else if self.json {
            Some("--json")
        } else if self.plot.is_some() {
            Some("--plot")
        } else {
            None
        }
    }
}

/// What to do about a missing history, said once for every way it can be missing.
const WHAT_TO_DO: &str = "the rebalancer keeps one (a line each look, every 1-5 s), on the head node, while the topology has a `[rebalance]` table and its mode is advise or act: add the table (docs/rebalance.md) and start the cluster with it, or name another cluster with --cluster or another state root with --state-dir / PDCTL_STATE_DIR";

/// Why there is no history to show.
#[derive(Debug, thiserror::Error)]
pub enum NoHistory {
    #[error("cluster {cluster} has no rebalancer history: {} holds no {} or {}; {}", dir.display(), history::HISTORY_FILE, MOVES_FILE, WHAT_TO_DO)]
    Empty { cluster: String, dir: PathBuf },
    #[error("no cluster {cluster} under {} (clusters with a rebalancer history there: {known}); {}", root.display(), WHAT_TO_DO)]
    NoSuchCluster {
        cluster: String,
        root: PathBuf,
        known: String,
    },
    #[error("no cluster under {} has a rebalancer history ({}); {}", root.display(), history::HISTORY_FILE, WHAT_TO_DO)]
    Nowhere { root: PathBuf },
    #[error("{count} clusters under {} have a rebalancer history: {names}; name one with --cluster NAME", root.display())]
    Which {
        count: usize,
        root: PathBuf,
        names: String,
    },
}

/// A cluster directory and the cluster's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub name: String,
    pub dir: PathBuf,
}

fn has_history(dir: &Path) -> bool {
    let kept = dir.join(history::HISTORY_FILE);
    [
        kept.with_file_name(format!("{}.1", history::HISTORY_FILE)),
        kept,
        dir.join(MOVES_FILE),
    ]
    .iter()
    .any(|p| p.is_file())
}

/// The cluster a directory holds: its run record's name while it runs, the kept
/// topology's after `down`, else the directory's own name (`demo`, or `demo-head` for the
/// head of a cluster over several nodes).
fn cluster_name(dir: &Path) -> String {
    if let Ok(Some(r)) = read_record(&StateDir::new(dir)) {
        return r.cluster;
    }
    crate::plan::source::ClusterSource::read(dir)
        .ok()
        .flatten()
        .and_then(|s| s.topology().ok())
        .map(|t| t.spec.cluster)
        .unwrap_or_else(|| dir_name(dir))
}

fn dir_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The cluster directory under `root` whose history to show: the one `cluster` names
/// (by its directory or cluster name), else the only one with a history (the running one
/// when several have one and one runs).
pub fn locate(root: &Path, cluster: Option<&str>) -> Result<Located, NoHistory> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    dirs.retain(|d| d.is_dir());
    dirs.sort();
    dirs.push(root.to_path_buf());
    let with: Vec<Located> = dirs
        .into_iter()
        .filter(|d| has_history(d))
        .map(|dir| Located {
            name: cluster_name(&dir),
            dir,
        })
        .collect();
    let names = |l: &[Located]| l.iter().map(|l| l.name.clone()).collect::<Vec<_>>();
    let Some(c) = cluster else {
        return match with.len() {
            0 => Err(NoHistory::Nowhere {
                root: root.to_path_buf(),
            }),
            1 => Ok(with[0].clone()),
            count => only_running(root, &with).ok_or_else(|| NoHistory::Which {
                count,
                root: root.to_path_buf(),
                names: names(&with).join(", "),
            }),
        };
    };
    let matching: Vec<&Located> = with
        .iter()
        .filter(|l| l.name == c || dir_name(&l.dir) == c)
        .collect();
    match matching[..] {
        [one] => Ok(one.clone()),
        [] if root.join(c).is_dir() => Err(NoHistory::Empty {
            cluster: c.to_string(),
            dir: root.join(c),
        }),
        [] => Err(NoHistory::NoSuchCluster {
            cluster: c.to_string(),
            root: root.to_path_buf(),
            known: Some(names(&with).join(", "))
                .filter(|k| !k.is_empty())
                .unwrap_or_else(|| "none".into()),
        }),
        _ => Err(NoHistory::Which {
            count: matching.len(),
            root: root.to_path_buf(),
            names: matching
                .iter()
                .map(|l| dir_name(&l.dir))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Of several clusters with a history, the one whose supervisor runs, when exactly one does.
fn only_running(root: &Path, with: &[Located]) -> Option<Located> {
    let running: Vec<PathBuf> = select::scan(root)
        .into_iter()
        .filter(|f| f.running)
        .map(|f| f.state.dir)
        .collect();
    let mut live = with.iter().filter(|l| running.contains(&l.dir));
    match (live.next(), live.next()) {
        (Some(one), None) => Some(one.clone()),
        _ => None,
    }
}

/// `pdctl rebalance history`: the table (or JSON) on stdout, the plot into its file.
pub fn history(which: &ClusterArgs, a: &HistoryArgs) -> anyhow::Result<ExitCode> {
    let root = state_root(which.state_dir.as_deref())?;
    let found = locate(&root, which.cluster.as_deref())
        .map_err(|e| ExitError::nothing_running(e.to_string()))?;
    let mut points = history::read(&found.dir);
    let mut moves = read_moves(&found.dir.join(MOVES_FILE));
    if points.is_empty() && moves.is_empty() {
        return Err(ExitError::nothing_running(
            NoHistory::Empty {
                cluster: found.name,
                dir: found.dir,
            }
            .to_string(),
        ));
    }
    let total = points.len();
    let all_moves = moves.len();
    if let Some(n) = a.last {
        points.drain(..total.saturating_sub(n as usize));
        if let Some(first) = points.first() {
            moves.retain(|m| m.at_ms >= first.at_ms);
        }
    }
    if a.json {
        let doc = serde_json::json!({ "points": points, "moves": moves });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!(
            "{}",
            heading(&found, &points, total)
                + &points_table(&points, width())
                + &moves_table(&moves, points.first(), width())
        );
        if moves.len() < all_moves {
            println!(
                "({} earlier move(s), before the first look shown: without --last to see them)",
                all_moves - moves.len()
            );
        }
    }
    if let Some(file) = &a.plot {
        let svg = plot::svg(&found.name, &points, &moves)?;
        std::fs::write(file, svg)
            .map_err(|e| anyhow::anyhow!("cannot write the plot to {}: {e}", file.display()))?;
        eprintln!(
            "pdctl: wrote the plot of {} looks and {} moves to {}",
            points.len(),
            moves.len(),
            file.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The terminal's width as the shell says (`COLUMNS`), else 160.
fn width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(160usize)
        .max(60)
}

fn clock(at_ms: u64) -> String {
    format_utc((at_ms / 1000) as i64)
}

fn heading(found: &Located, points: &[HistoryPoint], total: usize) -> String {
    let mut out = format!(
        "rebalance history of cluster {} ({})",
        found.name,
        found.dir.display()
    );
    match (points.first(), points.last()) {
        (Some(a), Some(b)) => {
            let shown = if points.len() < total {
                format!("the last {} of {total} looks", points.len())
            } else {
                format!("{total} looks")
            };
            let _ = writeln!(
                out,
                ": {shown}, {} to {}; TTFT and ITL p90 over the window in ms, / the objective",
                clock(a.at_ms),
                clock(b.at_ms)
            );
        }
        _ => out.push_str(": no looks kept\n"),
    }
    out
}

/// `v` ms as the table shows it: whole above 100, one decimal below; `-` when unknown.
fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
    }
}

/// A figure and its objective, `2350/200`; the figure alone without an objective.
fn against(figure: Option<f64>, objective: Option<f64>) -> String {
    match objective {
        Some(o) => format!("{}/{}", ms(figure), ms(Some(o))),
        None => ms(figure),
    }
}

/// One row a look: time (UTC and seconds since the first shown), mode, split, figures
/// against their objectives, queues and busy shares, the verdict cut to `width`.
pub fn points_table(points: &[HistoryPoint], width: usize) -> String {
    let Some(first) = points.first() else {
        return String::new();
    };
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            let f = &p.figures;
            vec![
                clock(p.at_ms)[11..19].to_string(),
                since(first.at_ms, p.at_ms),
                p.mode.as_str().to_string(),
                p.split.to_string(),
                f.requests.to_string(),
                against(f.ttft_p90_ms, p.ttft_p90_ms),
                against(f.itl_p90_ms, p.itl_p90_ms),
                format!("{:.1}/{:.1}", f.prefill_queue, f.decode_queue),
                format!(
                    "{:.0}/{:.0}%",
                    f.prefill_busy * 100.0,
                    f.decode_busy * 100.0
                ),
                p.verdict.clone(),
            ]
        })
        .collect();
    let head = [
        "TIME",
        "+S",
        "MODE",
        "SPLIT",
        "REQS",
        "TTFT P90/OBJ",
        "ITL P90/OBJ",
        "QUEUE P/D",
        "BUSY P/D",
        "VERDICT",
    ];
    columns(&head, &rows, width)
}

/// The moves, each with when (UTC and seconds since `first`), from -> to, how it ended
/// and why; `moves: none` when there were none.
pub fn moves_table(moves: &[MoveRecord], first: Option<&HistoryPoint>, width: usize) -> String {
    if moves.is_empty() {
        return "\nmoves: none\n".into();
    }
    let t0 = first.map_or(moves[0].at_ms, |p| p.at_ms);
    let rows: Vec<Vec<String>> = moves
        .iter()
        .map(|m| {
            vec![
                clock(m.at_ms)[11..19].to_string(),
                since(t0, m.at_ms),
                format!("{} -> {}", m.from, m.to),
                cut(m.outcome.as_deref().unwrap_or("-"), 48),
                m.reason.clone(),
            ]
        })
        .collect();
    let head = ["TIME", "+S", "MOVE", "OUTCOME", "REASON"];
    format!(
        "\nmoves ({}):\n{}",
        moves.len(),
        columns(&head, &rows, width)
    )
}

fn since(t0: u64, at: u64) -> String {
    format!("{:.0}", (at as f64 - t0 as f64) / 1000.0)
}

/// `text` at most `n` characters long, `...` marking a cut.
fn cut(text: &str, n: usize) -> String {
    if text.chars().count() <= n {
        return text.to_string();
    }
    let kept: String = text.chars().take(n.saturating_sub(3)).collect();
    format!("{kept}...")
}

/// Columns two spaces apart, each as wide as its widest cell; the last one cut so a line
/// fits in `width` (never below 20 characters).
fn columns(head: &[&str], rows: &[Vec<String>], width: usize) -> String {
    let n = head.len();
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let before: usize = widths[..n - 1].iter().map(|w| w + 2).sum();
    let last = width.saturating_sub(before).max(20);
    let line = |cells: Vec<String>| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == n {
                l.push_str(&cut(c, last));
            } else {
                let _ = write!(l, "{c:<w$}  ", w = widths[i]);
            }
        }
        l.trim_end().to_string() + "\n"
    };
    let mut out = line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Figures, RebalanceMode, Split};

    /// 2026-11-27T01:02:03Z
    const T0: u64 = 1_795_741_323_000;

    fn point(s: u64, verdict: &str) -> HistoryPoint {
        HistoryPoint {
            at_ms: T0 + s * 1000,
            mode: RebalanceMode::Advise,
            split: Split {
                prefill: 2,
                decode: 2,
            },
            measured_s: 4,
            figures: Figures {
                requests: 16,
                ttft_p90_ms: Some(2350.0),
                itl_p90_ms: Some(23.5),
                itl_requests: 16,
                prefill_queue: 7.2,
                decode_queue: 0.8,
                prefill_busy: 1.0,
                decode_busy: 0.4,
            },
            ttft_p90_ms: Some(200.0),
            itl_p90_ms: None,
            verdict: verdict.into(),
        }
    }

    #[test]
    fn a_look_is_one_row_with_figures_against_objectives() {
        let long = format!("would move 2P2D -> 3P1D: {}", "x".repeat(200));
        let points = vec![point(0, "measuring: 2 of 4 s"), point(5, &long)];
        let t = points_table(&points, 120);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("TIME      +S  MODE    SPLIT"), "{t}");
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            &cells[..9],
            &[
                "01:02:08", "5", "advise", "2P2D", "16", "2350/200", "23.5", "7.2/0.8", "100/40%"
            ],
            "{t}"
        );
        assert!(lines.iter().all(|l| l.chars().count() <= 120), "{t}");
        assert!(
            lines[2].ends_with("xxx..."),
            "the verdict is cut to fit: {t}"
        );
        assert!(lines[1].ends_with("measuring: 2 of 4 s"), "{t}");
    }

    #[test]
    fn unknown_figures_show_as_a_dash() {
        let mut p = point(0, "objectives met");
        p.figures.ttft_p90_ms = None;
        p.figures.itl_p90_ms = None;
        p.itl_p90_ms = Some(15.0);
        let t = points_table(&[p], 160);
        let cells: Vec<&str> = t.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(&cells[5..7], &["-/200", "-/15.0"], "{t}");
    }

    #[test]
    fn moves_list_when_from_to_how_it_ended_and_why() {
        let m = MoveRecord {
            at_ms: T0 + 12_000,
            from: Split {
                prefill: 2,
                decode: 2,
            },
            to: Split {
                prefill: 3,
                decode: 1,
            },
            reason: "TTFT p90 2350 ms over the 200 ms objective".into(),
            figures: Figures::default(),
            outcome: Some(
                "done (0): scaled prefill to 3, decode to 1 in 1.1 s after a drain".into(),
            ),
            ended_ms: Some(T0 + 13_100),
        };
        let t = moves_table(&[m], Some(&point(0, "")), 160);
        assert!(t.contains("moves (1):"), "{t}");
        let row = t.lines().last().unwrap();
        assert!(
            row.starts_with(
                "01:02:15  12  2P2D -> 3P1D  done (0): scaled prefill to 3, decode to 1 in...  "
            ),
            "{row}"
        );
        assert!(
            row.ends_with("TTFT p90 2350 ms over the 200 ms objective"),
            "{row}"
        );
        assert_eq!(moves_table(&[], None, 160), "\nmoves: none\n");
    }

    #[test]
    fn the_cluster_is_found_by_name_and_a_missing_one_says_where_it_looked() {
        let root = tempfile::tempdir().unwrap();
        let demo = root.path().join("demo");
        std::fs::create_dir_all(demo.join("logs")).unwrap();
        std::fs::create_dir_all(root.path().join("quiet/logs")).unwrap();
        std::fs::write(demo.join(history::HISTORY_FILE), "").unwrap();
        let found = locate(root.path(), None).unwrap();
        assert_eq!(found.name, "demo");
        assert_eq!(found.dir, demo);
        assert_eq!(locate(root.path(), Some("demo")).unwrap(), found);
        let quiet = locate(root.path(), Some("quiet")).unwrap_err().to_string();
        assert!(
            quiet.contains("cluster quiet has no rebalancer history"),
            "{quiet}"
        );
        assert!(
            quiet.contains(&root.path().join("quiet").display().to_string()),
            "{quiet}"
        );
        assert!(quiet.contains("[rebalance]"), "{quiet}");
        let none = locate(root.path(), Some("nope")).unwrap_err().to_string();
        assert!(none.contains("no cluster nope under"), "{none}");
        assert!(
            none.contains("(clusters with a rebalancer history there: demo)"),
            "{none}"
        );
        std::fs::create_dir_all(root.path().join("other")).unwrap();
        std::fs::write(root.path().join("other").join(MOVES_FILE), "").unwrap();
        let which = locate(root.path(), None).unwrap_err().to_string();
        assert!(which.contains("2 clusters under"), "{which}");
        assert!(which.contains("--cluster"), "{which}");
        let empty = tempfile::tempdir().unwrap();
        let nowhere = locate(empty.path(), None).unwrap_err().to_string();
        assert!(nowhere.contains("no cluster under"), "{nowhere}");
    }
}
