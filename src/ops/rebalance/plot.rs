//! The rebalancer's history drawn as an SVG (`pdctl rebalance history --plot FILE`), so a
//! person sees at a glance what the figures did and when the split followed: three panels
//! over the same time axis — TTFT p90 with its objective, ITL p90 with its objective, and
//! the split (prefill and decode instances) — and each move as a line across them. A pure
//! function of the kept points and moves: no I/O, so it is tested on made-up histories.

use crate::bench::plot::{axis, escape, trim};
use crate::vocab::{HistoryPoint, MoveRecord};
use std::fmt::Write;

const W: f64 = 900.0;
const PAD_L: f64 = 64.0;
/// Room right of the panels for their legends.
const PAD_R: f64 = 150.0;
/// Above the first panel: the title and the first panel's name.
const TOP: f64 = 64.0;
/// A panel's plot height, and the room between panels (for the next panel's name).
const PH: f64 = 150.0;
const GAP: f64 = 40.0;
/// Below the last panel: tick labels and the axis name.
const BOTTOM: f64 = 48.0;
const FIGURE: &str = "#1f77b4";
const OBJECTIVE: &str = "#d62728";
const PREFILL: &str = "#ff7f0e";
const DECODE: &str = "#2ca02c";
/// A gap between two looks longer than this many typical gaps (and 10 s) breaks the lines:
/// nothing was looked at in between (mode off, or no supervisor).
const BREAK_FACTOR: f64 = 3.0;

/// Why there is no plot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlotError {
    #[error(
        "the history of cluster {cluster} has no looks to plot (rebalance-history.jsonl is empty or missing); the rebalancer keeps one each look while its mode is advise or act"
    )]
    Empty { cluster: String },
}

/// Where one panel sits and how values map onto it.
struct Frame {
    /// The plot area's top edge.
    top: f64,
    /// The values at the right end of the x axis and the top of the y axis.
    xmax: f64,
    ymax: f64,
}

impl Frame {
    fn pw() -> f64 {
        W - PAD_L - PAD_R
    }
    fn px(&self, t: f64) -> f64 {
        PAD_L + t / self.xmax * Frame::pw()
    }
    fn py(&self, v: f64) -> f64 {
        self.top + (1.0 - v / self.ymax) * PH
    }
}

/// Top edge of panel `k` (0, 1, 2 from the top).
fn panel_top(k: usize) -> f64 {
    TOP + k as f64 * (PH + GAP)
}

/// One line of a panel: its values at each look, how it is drawn and named.
struct Series<'a> {
    class: &'a str,
    name: &'a str,
    color: &'a str,
    values: Vec<Option<f64>>,
    /// A step line (a split, an objective) rather than straight segments between looks.
    step: bool,
    dashed: bool,
    width: f64,
}

/// The SVG of the history of `cluster`: `points` oldest first, `moves` in any order (those
/// before the first point are left out). An empty history is an error, not an empty plot.
pub fn svg(
    cluster: &str,
    points: &[HistoryPoint],
    moves: &[MoveRecord],
) -> Result<String, PlotError> {
    let Some(t0) = points.iter().map(|p| p.at_ms).min() else {
        return Err(PlotError::Empty {
            cluster: cluster.to_string(),
        });
    };
    let secs = |at_ms: u64| (at_ms as f64 - t0 as f64) / 1000.0;
    let ts: Vec<f64> = points.iter().map(|p| secs(p.at_ms)).collect();
    let moves: Vec<(f64, &MoveRecord)> = moves
        .iter()
        .filter(|m| m.at_ms >= t0)
        .map(|m| (secs(m.at_ms), m))
        .collect();
    let last = ts
        .iter()
        .chain(moves.iter().map(|(t, _)| t))
        .fold(0.0, |a: f64, b| a.max(*b));
    let (xmax, xstep) = axis(last);
    let breaks = breaks(&ts);
    let height = panel_top(3) - GAP + BOTTOM;
    let mut o = String::new();
    header(&mut o, cluster, height, points.len(), moves.len());
    let panels = panels(points);
    for (k, (title, series)) in panels.iter().enumerate() {
        let f = panel(&mut o, k, title, series, (xmax, xstep), k == 2);
        for s in series {
            for run in runs(&ts, &s.values, &breaks) {
                line(&mut o, &f, &run, s);
            }
        }
    }
    for (t, m) in &moves {
        move_marker(&mut o, *t, xmax, m);
    }
    o.push_str("</svg>\n");
    Ok(o)
}

/// The SVG's opening: its size, a white ground and the title.
fn header(o: &mut String, cluster: &str, height: f64, looks: usize, moves: usize) {
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle" font-weight="bold">Rebalancing of cluster {}: {} looks, {} moves</text>"#,
        W / 2.0,
        escape(cluster),
        looks,
        moves
    );
}

/// The three panels: each one's title and lines, at each look.
fn panels(points: &[HistoryPoint]) -> [(&'static str, Vec<Series<'static>>); 3] {
    let figure = |class, name, values| Series {
        class,
        name,
        color: FIGURE,
        values,
        step: false,
        dashed: false,
        width: 2.0,
    };
    let objective = |class, values| Series {
        class,
        name: "objective",
        color: OBJECTIVE,
        values,
        step: true,
        dashed: true,
        width: 1.5,
    };
    [
        (
            "TTFT p90 (ms)",
            vec![
                figure("ttft", "TTFT p90", col(points, |p| p.figures.ttft_p90_ms)),
                objective("ttft-objective", col(points, |p| p.ttft_p90_ms)),
            ],
        ),
        (
            "ITL p90 (ms)",
            vec![
                figure("itl", "ITL p90", col(points, |p| p.figures.itl_p90_ms)),
                objective("itl-objective", col(points, |p| p.itl_p90_ms)),
            ],
        ),
        (
            "Split (instances)",
            vec![
                Series {
                    class: "prefill",
                    name: "prefill",
                    color: PREFILL,
                    values: col(points, |p| Some(f64::from(p.split.prefill))),
                    step: true,
                    dashed: false,
                    width: 4.0,
                },
                Series {
                    class: "decode",
                    name: "decode",
                    color: DECODE,
                    values: col(points, |p| Some(f64::from(p.split.decode))),
                    step: true,
                    dashed: false,
                    width: 2.0,
                },
            ],
        ),
    ]
}

fn col(points: &[HistoryPoint], f: impl Fn(&HistoryPoint) -> Option<f64>) -> Vec<Option<f64>> {
    points.iter().map(f).collect()
}

/// For each look, whether the gap before it is long enough to break the lines: over
/// [`BREAK_FACTOR`] times the median gap and over 10 s.
fn breaks(ts: &[f64]) -> Vec<bool> {
    let mut gaps: Vec<f64> = ts.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_by(f64::total_cmp);
    let typical = gaps.get(gaps.len() / 2).copied().unwrap_or(0.0);
    let limit = (typical * BREAK_FACTOR).max(10.0);
    let mut out = vec![false; ts.len()];
    for i in 1..ts.len() {
        out[i] = ts[i] - ts[i - 1] > limit;
    }
    out
}

/// The runs of consecutive looks that have a value (a `None` or a break ends one), as
/// (seconds, value) pairs.
fn runs(ts: &[f64], values: &[Option<f64>], breaks: &[bool]) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut current: Vec<(f64, f64)> = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if (breaks[i] || v.is_none()) && !current.is_empty() {
            out.push(std::mem::take(&mut current));
        }
        if let Some(v) = v {
            current.push((ts[i], *v));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Panel `k`'s frame, grid, ticks, name and legend; the frame its lines are drawn in.
fn panel(
    o: &mut String,
    k: usize,
    title: &str,
    series: &[Series],
    (xmax, xstep): (f64, f64),
    x_labels: bool,
) -> Frame {
    let (ymax, ystep) = y_axis(series);
    let f = Frame {
        top: panel_top(k),
        xmax,
        ymax,
    };
    let pw = Frame::pw();
    let _ = writeln!(
        o,
        r#"<text x="{PAD_L}" y="{:.1}" font-size="13" font-weight="bold">{title}</text>"#,
        f.top - 8.0
    );
    let _ = writeln!(
        o,
        r##"<rect x="{PAD_L}" y="{:.1}" width="{pw}" height="{PH}" fill="none" stroke="#888"/>"##,
        f.top
    );
    grid(o, &f, xstep, ystep, x_labels);
    if x_labels {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">seconds since the first look</text>"#,
            PAD_L + pw / 2.0,
            f.top + PH + 34.0
        );
    }
    if let Some(s) = series
        .first()
        .filter(|s| s.values.iter().all(Option::is_none))
    {
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="#888">no {} figure in this history</text>"##,
            PAD_L + pw / 2.0,
            f.top + PH / 2.0,
            s.name
        );
    }
    legend(o, &f, series);
    f
}

/// A panel's y axis end and step: whole instances with a step of room above the largest
/// count for the split, a tenth of room above the largest figure for the others.
fn y_axis(series: &[Series]) -> (f64, f64) {
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().flatten().copied())
        .fold(0.0, f64::max);
    if series.iter().all(|s| s.step && !s.dashed) {
        let (m, s) = axis(max + 1.0);
        let s = s.max(1.0);
        ((m / s).ceil() * s, s)
    } else {
        axis(max * 1.1)
    }
}

/// A panel's grid lines and tick labels (the time labels only under the bottom panel).
fn grid(o: &mut String, f: &Frame, xstep: f64, ystep: f64, x_labels: bool) {
    let (xmax, ymax, pw) = (f.xmax, f.ymax, Frame::pw());
    let mut t = 0.0;
    while t <= xmax + xstep / 2.0 {
        let x = f.px(t);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/>"##,
            f.top,
            f.top + PH
        );
        if x_labels {
            let _ = writeln!(
                o,
                r#"<text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
                f.top + PH + 15.0,
                trim(t)
            );
        }
        t += xstep;
    }
    let mut v = 0.0;
    while v <= ymax + ystep / 2.0 {
        let y = f.py(v);
        let _ = writeln!(
            o,
            r##"<line x1="{PAD_L}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/>"##,
            PAD_L + pw
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"#,
            PAD_L - 5.0,
            y + 4.0,
            trim(v)
        );
        v += ystep;
    }
}

/// The names of a panel's lines, right of it.
fn legend(o: &mut String, f: &Frame, series: &[Series]) {
    for (i, s) in series.iter().enumerate() {
        let x = W - PAD_R + 14.0;
        let y = f.top + 14.0 + 20.0 * i as f64;
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            o,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="{}"{dash}/>"#,
            x + 24.0,
            s.color,
            s.width
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" font-size="12">{}</text>"#,
            x + 30.0,
            y + 4.0,
            s.name
        );
    }
}

/// One run of values: a polyline, or a dot when it is a single look.
fn line(o: &mut String, f: &Frame, run: &[(f64, f64)], s: &Series) {
    if let [(t, v)] = run {
        let _ = writeln!(
            o,
            r#"<circle class="{}" cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
            s.class,
            f.px(*t),
            f.py(*v),
            s.color
        );
        return;
    }
    let mut pts = String::new();
    for (i, (t, v)) in run.iter().enumerate() {
        if s.step && i > 0 {
            let _ = write!(pts, "{:.1},{:.1} ", f.px(*t), f.py(run[i - 1].1));
        }
        let _ = write!(pts, "{:.1},{:.1} ", f.px(*t), f.py(*v));
    }
    let dash = if s.dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let _ = writeln!(
        o,
        r#"<polyline class="{}" points="{}" fill="none" stroke="{}" stroke-width="{}"{dash}/>"#,
        s.class,
        pts.trim_end(),
        s.color,
        s.width
    );
}

/// A move: a line across the three panels at its time, labelled with its splits (and how
/// it ended, when it did not end done).
fn move_marker(o: &mut String, t: f64, xmax: f64, m: &MoveRecord) {
    let f = Frame {
        top: panel_top(0),
        xmax,
        ymax: 1.0,
    };
    let x = f.px(t);
    let outcome = m.outcome.as_deref().unwrap_or("done");
    let ended = if outcome.starts_with("done") {
        String::new()
    } else {
        format!(" ({})", outcome.split([' ', ':']).next().unwrap_or(outcome))
    };
    let color = if ended.is_empty() { "#444" } else { OBJECTIVE };
    let _ = writeln!(
        o,
        r#"<line class="move" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{color}" stroke-width="1.5"/>"#,
        f.top,
        panel_top(2) + PH
    );
    let label = escape(&format!("{} -> {}{ended}", m.from, m.to));
    let (lx, ly) = (x + 4.0, f.top + 6.0);
    let _ = writeln!(
        o,
        r#"<text class="move-label" x="{lx:.1}" y="{ly:.1}" font-size="11" fill="{color}" transform="rotate(90 {lx:.1} {ly:.1})">{label}</text>"#
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Figures, RebalanceMode, Split};

    fn split(prefill: u32, decode: u32) -> Split {
        Split { prefill, decode }
    }

    /// A look `s` seconds in, with these figures, under objectives 200 / 25 ms.
    fn point(s: u64, ttft: Option<f64>, itl: Option<f64>, at: Split) -> HistoryPoint {
        HistoryPoint {
            at_ms: 1_700_000_000_000 + s * 1000,
            mode: RebalanceMode::Act,
            split: at,
            measured_s: 3,
            figures: Figures {
                requests: 10,
                ttft_p90_ms: ttft,
                itl_p90_ms: itl,
                ..Figures::default()
            },
            ttft_p90_ms: Some(200.0),
            itl_p90_ms: Some(25.0),
            verdict: "objectives met".into(),
        }
    }

    fn a_move(s: u64, from: Split, to: Split, outcome: &str) -> MoveRecord {
        MoveRecord {
            at_ms: 1_700_000_000_000 + s * 1000,
            from,
            to,
            reason: "TTFT p90 over".into(),
            figures: Figures::default(),
            outcome: Some(outcome.into()),
            ended_ms: Some(1_700_000_000_000 + s * 1000 + 1500),
        }
    }

    /// The point lists of the polylines of `class`.
    fn polylines(svg: &str, class: &str) -> Vec<Vec<(f64, f64)>> {
        let start = format!(r#"<polyline class="{class}" points=""#);
        svg.lines()
            .filter_map(|l| l.strip_prefix(&start))
            .map(|rest| {
                rest.split('"')
                    .next()
                    .unwrap()
                    .split(' ')
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    }

    fn history() -> (Vec<HistoryPoint>, Vec<MoveRecord>) {
        let points = vec![
            point(0, Some(100.0), Some(20.0), split(2, 2)),
            point(1, Some(200.0), Some(20.0), split(2, 2)),
            point(2, Some(400.0), Some(20.0), split(2, 2)),
            point(3, Some(150.0), Some(20.0), split(3, 1)),
            point(4, Some(120.0), Some(20.0), split(3, 1)),
        ];
        let moves = vec![a_move(2, split(2, 2), split(3, 1), "done (0): scaled")];
        (points, moves)
    }

    #[test]
    fn each_figure_is_one_line_and_each_split_a_step_line() {
        let (points, moves) = history();
        let svg = svg("demo", &points, &moves).unwrap();
        assert!(svg.contains("Rebalancing of cluster demo"), "{svg}");
        let ttft = polylines(&svg, "ttft");
        assert_eq!(ttft.len(), 1);
        assert_eq!(ttft[0].len(), 5, "one vertex a look");
        assert!(
            ttft[0].windows(2).all(|w| w[0].0 < w[1].0),
            "time goes right"
        );
        // A step line has a riser before each look after the first: 2n - 1 vertices.
        let prefill = polylines(&svg, "prefill");
        assert_eq!(prefill.len(), 1);
        assert_eq!(prefill[0].len(), 9);
        let ys: Vec<f64> = prefill[0].iter().map(|p| p.1).collect();
        assert!(
            ys[8] < ys[0],
            "3 prefill instances at the end sit above the 2 at the start"
        );
        assert_eq!(polylines(&svg, "decode")[0].len(), 9);
    }

    #[test]
    fn the_objective_is_a_dashed_level_line_at_its_value() {
        let (points, moves) = history();
        let svg = svg("demo", &points, &moves).unwrap();
        let objective = polylines(&svg, "ttft-objective");
        assert_eq!(objective.len(), 1);
        let y = objective[0][0].1;
        assert!(
            objective[0].iter().all(|p| p.1 == y),
            "level: {objective:?}"
        );
        // The look whose TTFT equals the objective (200 ms) sits on it; 400 ms above it.
        let ttft = &polylines(&svg, "ttft")[0];
        assert_eq!(ttft[1].1, y);
        assert!(ttft[2].1 < y);
        assert!(ttft[0].1 > y);
        let line = svg.lines().find(|l| l.contains("ttft-objective")).unwrap();
        assert!(line.contains("stroke-dasharray"), "{line}");
        assert_eq!(polylines(&svg, "itl-objective")[0].len(), 9);
    }

    #[test]
    fn a_move_is_a_labelled_line_at_its_time() {
        let (points, mut moves) = history();
        moves.push(a_move(4, split(3, 1), split(2, 2), "failed (1): refused"));
        let svg = svg("demo", &points, &moves).unwrap();
        let markers: Vec<&str> = svg
            .lines()
            .filter(|l| l.contains(r#"class="move""#))
            .collect();
        assert_eq!(markers.len(), 2);
        assert!(svg.contains(">2P2D -&gt; 3P1D</text>"), "{svg}");
        assert!(svg.contains(">3P1D -&gt; 2P2D (failed)</text>"), "{svg}");
        // At the third look's x (2 s in): the x of the TTFT line's third vertex.
        let x = polylines(&svg, "ttft")[0][2].0;
        assert!(
            markers[0].contains(&format!(r#"x1="{x:.1}""#)),
            "{}",
            markers[0]
        );
    }

    #[test]
    fn a_look_without_a_figure_leaves_a_gap_not_a_zero() {
        let (mut points, moves) = history();
        points[2].figures.ttft_p90_ms = None;
        points[4].figures.itl_p90_ms = None;
        let svg = svg("demo", &points, &moves).unwrap();
        let ttft = polylines(&svg, "ttft");
        assert_eq!(ttft.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2]);
        assert_eq!(polylines(&svg, "itl")[0].len(), 4);
        // The split goes on: it is known at every look.
        assert_eq!(polylines(&svg, "prefill")[0].len(), 9);
        // A lone look between two gaps is a dot.
        points[1].figures.ttft_p90_ms = None;
        points[3].figures.ttft_p90_ms = None;
        let svg = super::svg("demo", &points, &moves).unwrap();
        assert_eq!(polylines(&svg, "ttft").len(), 0);
        assert_eq!(svg.matches(r#"<circle class="ttft""#).count(), 2);
    }

    #[test]
    fn a_long_pause_between_looks_breaks_the_lines() {
        let mut points: Vec<HistoryPoint> = (0..4)
            .map(|s| point(s, Some(100.0), None, split(2, 2)))
            .collect();
        points.extend((600..604).map(|s| point(s, Some(100.0), None, split(2, 2))));
        let svg = svg("demo", &points, &[]).unwrap();
        assert_eq!(polylines(&svg, "ttft").len(), 2);
        assert_eq!(polylines(&svg, "prefill").len(), 2);
        assert!(
            svg.contains("no ITL p90 figure in this history"),
            "ITL never measured"
        );
    }

    #[test]
    fn an_empty_history_is_an_error_not_an_empty_plot() {
        let err = svg("demo", &[], &[]).unwrap_err();
        assert_eq!(
            err,
            PlotError::Empty {
                cluster: "demo".into()
            }
        );
        assert!(
            err.to_string().contains("cluster demo has no looks"),
            "{err}"
        );
    }
}
