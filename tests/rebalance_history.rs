//! `pdctl rebalance history` on a state dir written the way the head's supervisor writes
//! it (each look appended by `ops::rebalance::history::append`, each move a JSON line of
//! `rebalance.jsonl`), with no cluster running — as after `pdctl down`, which keeps both
//! files: the table, `--last`, `--json`, `--plot`, and the errors when there is no history.

use crate::common;

use pdctl::ops::rebalance::{MOVES_FILE, history};
use pdctl::vocab::{Figures, HistoryPoint, MoveRecord, RebalanceMode, Split};
use std::io::Write;
use std::path::Path;
use std::process::Output;

/// 2026-11-27T01:02:03Z, the first look.
const T0: u64 = 1_795_741_323_000;
const LOOKS: u64 = 40;

fn split(prefill: u32, decode: u32) -> Split {
    Split { prefill, decode }
}

/// A run under `act`, one look a second: long prompts miss the 200 ms TTFT objective at
/// 2P2D, the move to 3P1D after look 10 meets it, then long outputs miss the 15 ms ITL
/// objective and the split goes back at look 30. The first look has no request yet.
fn looks() -> Vec<HistoryPoint> {
    (0..LOOKS)
        .map(|i| {
            let (at, ttft, itl, verdict) = match i {
                0 => (split(2, 2), None, None, "measuring: 0 of 3 s".to_string()),
                1..=10 => (
                    split(2, 2),
                    Some(2350.0),
                    Some(12.0),
                    "moving 2P2D -> 3P1D: TTFT p90 2350 ms over the 200 ms objective (16 requests; queue P 8.0 D 0.0; busy P 100% D 0%)".into(),
                ),
                11..=20 => (split(3, 1), Some(130.0), Some(12.0), "objectives met: TTFT p90 130 ms, ITL p90 12.0 ms (40 requests)".into()),
                21..=30 => (split(3, 1), Some(130.0), Some(24.0), "moving 3P1D -> 2P2D: ITL p90 24 ms over the 15 ms objective".into()),
                _ => (split(2, 2), Some(120.0), Some(12.0), "objectives met".into()),
            };
            HistoryPoint {
                at_ms: T0 + i * 1000,
                mode: RebalanceMode::Act,
                split: at,
                measured_s: i.min(3),
                figures: Figures {
                    requests: if ttft.is_some() { 16 } else { 0 },
                    ttft_p90_ms: ttft,
                    itl_p90_ms: itl,
                    itl_requests: if itl.is_some() { 16 } else { 0 },
                    prefill_queue: 8.0,
                    decode_queue: 0.0,
                    prefill_busy: 1.0,
                    decode_busy: 0.0,
                },
                ttft_p90_ms: Some(200.0),
                itl_p90_ms: Some(15.0),
                verdict,
            }
        })
        .collect()
}

fn moves() -> Vec<MoveRecord> {
    let record = |s: u64, from, to, reason: &str| MoveRecord {
        at_ms: T0 + s * 1000 + 400,
        from,
        to,
        reason: reason.into(),
        figures: Figures::default(),
        outcome: Some("done (0): the cluster runs 3 prefill, 1 decode".into()),
        ended_ms: Some(T0 + s * 1000 + 1900),
    };
    vec![
        record(
            10,
            split(2, 2),
            split(3, 1),
            "TTFT p90 2350 ms over the 200 ms objective",
        ),
        record(
            30,
            split(3, 1),
            split(2, 2),
            "ITL p90 24 ms over the 15 ms objective",
        ),
    ]
}

/// `root/demo` as the supervisor leaves it: logs, the history, the moves.
fn write_cluster(root: &Path) {
    let dir = root.join("demo");
    std::fs::create_dir_all(dir.join("logs")).unwrap();
    for p in looks() {
        history::append(&dir, &p).unwrap();
    }
    let mut f = std::fs::File::create(dir.join(MOVES_FILE)).unwrap();
    for m in moves() {
        writeln!(f, "{}", serde_json::to_string(&m).unwrap()).unwrap();
    }
}

fn history_cmd(root: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "rebalance",
        "history",
        "--state-dir",
        root.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    common::pdctl(&args).env("COLUMNS", "120").output().unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_table_has_a_row_a_look_and_the_moves() {
    let root = common::TempDir::new("rb-history-table");
    write_cluster(root.path());
    let o = history_cmd(root.path(), &["--cluster", "demo"]);
    assert!(o.status.success(), "{}{}", out(&o), err(&o));
    let text = out(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("rebalance history of cluster demo (")
            && lines[0].contains("40 looks, 2026-11-27T01:02:03Z to 2026-11-27T01:02:42Z"),
        "{text}"
    );
    assert!(lines[1].starts_with("TIME"), "{text}");
    let rows: Vec<Vec<&str>> = lines[2..2 + LOOKS as usize]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        &rows[0][..7],
        &["01:02:03", "0", "act", "2P2D", "0", "-/200", "-/15.0"]
    );
    assert_eq!(
        &rows[5][..7],
        &[
            "01:02:08",
            "5",
            "act",
            "2P2D",
            "16",
            "2350/200",
            "12.0/15.0"
        ]
    );
    assert_eq!(rows[15][3], "3P1D");
    assert!(
        lines[1..].iter().all(|l| l.chars().count() <= 120),
        "cut to COLUMNS: {text}"
    );
    let at = text.find("moves (2):").expect("the moves follow the looks");
    let moves: Vec<&str> = text[at..].lines().skip(2).collect();
    assert_eq!(moves.len(), 2, "{text}");
    assert!(
        moves[0].starts_with("01:02:13  10  2P2D -> 3P1D  done (0)"),
        "{text}"
    );
    assert!(
        moves[1].contains("3P1D -> 2P2D")
            && moves[1].ends_with("ITL p90 24 ms over the 15 ms objective"),
        "{text}"
    );
}

#[test]
fn last_keeps_the_last_looks_and_the_moves_since() {
    let root = common::TempDir::new("rb-history-last");
    write_cluster(root.path());
    // The only cluster with a history is found without --cluster, through the variable.
    let o = common::pdctl(&["rebalance", "history", "--last", "5"])
        .env("PDCTL_STATE_DIR", root.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err(&o));
    let text = out(&o);
    assert!(
        text.lines()
            .next()
            .unwrap()
            .contains("the last 5 of 40 looks"),
        "{text}"
    );
    let rows: Vec<&str> = text.lines().skip(2).take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.len(), 5, "{text}");
    assert!(rows[0].starts_with("01:02:38  0  "), "{text}");
    assert!(
        text.contains("moves: none"),
        "both moves came before: {text}"
    );
    assert!(
        text.contains("(2 earlier move(s), before the first look shown"),
        "{text}"
    );
    let o = history_cmd(root.path(), &["--last", "12", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["points"].as_array().unwrap().len(), 12);
    assert_eq!(
        doc["moves"].as_array().unwrap().len(),
        1,
        "the move at 30.4 s only"
    );
}

#[test]
fn json_gives_the_files_records_under_points_and_moves() {
    let root = common::TempDir::new("rb-history-json");
    write_cluster(root.path());
    let o = history_cmd(root.path(), &["--json"]);
    assert!(o.status.success(), "{}", err(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let first = &doc["points"][1];
    assert_eq!(first["at_ms"], T0 + 1000);
    assert_eq!(first["mode"], "act");
    assert_eq!(first["split"]["prefill"], 2);
    assert_eq!(first["figures"]["ttft_p90_ms"], 2350.0);
    assert_eq!(first["ttft_p90_ms"], 200.0);
    assert_eq!(doc["moves"][0]["to"]["prefill"], 3);
    assert_eq!(
        doc["moves"][0]["outcome"],
        "done (0): the cluster runs 3 prefill, 1 decode"
    );
    let points: Vec<HistoryPoint> = serde_json::from_value(doc["points"].clone()).unwrap();
    let moves: Vec<MoveRecord> = serde_json::from_value(doc["moves"].clone()).unwrap();
    assert_eq!(points, looks());
    assert_eq!(moves, self::moves());
}

#[test]
fn plot_writes_an_svg_of_the_figures_and_moves_and_says_where() {
    let root = common::TempDir::new("rb-history-plot");
    write_cluster(root.path());
    let file = root.path().join("history.svg");
    let o = history_cmd(root.path(), &["--plot", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(out(&o).contains("moves (2):"), "the table is printed too");
    assert!(
        err(&o).contains(&format!(
            "wrote the plot of 40 looks and 2 moves to {}",
            file.display()
        )),
        "{}",
        err(&o)
    );
    let svg = std::fs::read_to_string(&file).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let texts = common::svg::texts(&svg);
    let has = |t: &str| texts.iter().any(|x| x == t);
    assert!(
        has("Rebalancing of cluster demo: 40 looks, 2 moves"),
        "{texts:?}"
    );
    for panel in ["TTFT p90 (ms)", "ITL p90 (ms)", "Split (instances)"] {
        assert!(has(panel), "{panel}");
    }
    // Each move a line across the three panels (both ended done), labelled with its splits.
    let moves = common::svg::polylines(&svg, pdctl::pictures::rebalance::MOVE, 1);
    assert_eq!(moves.len(), 2, "{moves:?}");
    assert!(moves.iter().all(|m| m.len() == 2 && m[0].0 == m[1].0));
    assert!(
        has("2P2D -&gt; 3P1D") && has("3P1D -&gt; 2P2D"),
        "{texts:?}"
    );
    // The first look has no TTFT: the line starts at the second, 39 vertices (its legend's
    // stroke is the only other line of its color).
    let ttft = common::svg::polylines(&svg, pdctl::pictures::rebalance::TTFT, 2);
    let mut vertices: Vec<usize> = ttft.iter().map(Vec::len).collect();
    vertices.sort();
    assert_eq!(vertices, [2, 39], "{ttft:?}");
}

#[test]
fn no_history_fails_saying_where_it_looked_and_what_to_do() {
    let root = common::TempDir::new("rb-history-none");
    // A cluster that ran without [rebalance]: logs only.
    std::fs::create_dir_all(root.path().join("plain/logs")).unwrap();
    let o = history_cmd(root.path(), &[]);
    assert_eq!(o.status.code(), Some(3), "{}", err(&o));
    let e = err(&o);
    assert!(
        e.contains(&format!(
            "no cluster under {} has a rebalancer history",
            root.path().display()
        )),
        "{e}"
    );
    assert!(e.contains("[rebalance]") && e.contains("--cluster"), "{e}");
    let o = history_cmd(root.path(), &["--cluster", "plain"]);
    assert_eq!(o.status.code(), Some(3));
    let e = err(&o);
    assert!(
        e.contains(&format!(
            "cluster plain has no rebalancer history: {} holds no rebalance-history.jsonl",
            root.path().join("plain").display()
        )),
        "{e}"
    );
    write_cluster(root.path());
    let o = history_cmd(root.path(), &["--cluster", "nope", "--plot", "x.svg"]);
    assert_eq!(o.status.code(), Some(3));
    let e = err(&o);
    assert!(
        e.contains("no cluster nope under") && e.contains("there: demo)"),
        "{e}"
    );
    assert!(out(&o).is_empty(), "nothing printed: {}", out(&o));
}

#[test]
fn the_modes_are_unchanged_and_refuse_the_history_options() {
    let root = common::TempDir::new("rb-history-modes");
    let o = common::pdctl(&["rebalance", "act", "--json"])
        .env("PDCTL_STATE_DIR", root.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    assert!(
        err(&o).contains("--json goes with `pdctl rebalance history`"),
        "{}",
        err(&o)
    );
    let o = common::pdctl(&["rebalance", "advise"])
        .env("PDCTL_STATE_DIR", root.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "nothing runs: {}", err(&o));
    assert!(err(&o).contains("nothing to rebalance"), "{}", err(&o));
}
