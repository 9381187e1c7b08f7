//! The rebalancer's history drawn as an SVG (`pdctl rebalance history --plot FILE`), so a
//! person sees at a glance what the figures did and when the split followed: three panels
//! over the same time axis — TTFT p90 with its objective, ITL p90 with its objective, and
//! the split (prefill and decode instances) — and each move as a line across them. A pure
//! function of the kept points and moves: no I/O, so it is tested on made-up histories.

use super::{PictureError, axis, drawn, rgb, trim};
use crate::vocab::{HistoryPoint, MoveOutcome, MoveRecord};
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const W: u32 = 900;
const PAD_L: u32 = 64;
/// Room right of the panels for their legends.
const PAD_R: u32 = 150;
/// Above the first panel: the title and the first panel's name.
const TOP: u32 = 64;
/// A panel's plot height, and the room between panels (for the next panel's name).
const PH: u32 = 150;
const GAP: u32 = 40;
/// Below the last panel: tick labels and the axis name.
const BOTTOM: u32 = 48;

/// The colors the SVG strokes each line with, by which a reader (or a test) tells them
/// apart: each figure, the objectives (dashed), prefill and decode instances, a move that
/// ended done and one that did not.
pub const TTFT: &str = "#1F77B4";
pub const ITL: &str = "#9467BD";
pub const OBJECTIVE: &str = "#D62728";
pub const PREFILL: &str = "#FF7F0E";
pub const DECODE: &str = "#2CA02C";
pub const MOVE: &str = "#444444";
pub const MOVE_NOT_DONE: &str = "#D62728";
/// A look that has a figure between two that have none is a dot of this radius.
const DOT: u32 = 3;
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
    #[error(transparent)]
    Draw(#[from] PictureError),
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Top edge of panel `k` (0, 1, 2 from the top).
fn panel_top(k: u32) -> u32 {
    TOP + k * (PH + GAP)
}

/// One line of a panel: its values at each look, how it is drawn and named.
struct Series<'a> {
    name: &'a str,
    color: &'a str,
    values: Vec<Option<f64>>,
    /// A step line (a split, an objective) rather than straight segments between looks.
    step: bool,
    dashed: bool,
    width: u32,
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
    let (xmax, _) = axis(last);
    let breaks = breaks(&ts);
    let height = panel_top(3) - GAP + BOTTOM;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W, height)).into_drawing_area();
        root.fill(&WHITE).map_err(drawn)?;
        let title = format!(
            "Rebalancing of cluster {cluster}: {} looks, {} moves",
            points.len(),
            moves.len()
        );
        let font = ("sans-serif", 19).into_font().style(FontStyle::Bold);
        let at = ((W / 2) as i32, 22);
        let centred = TextStyle::from(font).pos(Pos::new(HPos::Center, VPos::Center));
        root.draw(&Text::new(title, at, centred)).map_err(drawn)?;
        let mut move_xs = Vec::new();
        let areas: Vec<_> = (0..3).map(|k| panel_area(&root, k)).collect();
        for (k, (title, series)) in panels(points).iter().enumerate() {
            let mut chart = panel(&root, &areas[k], k as u32, title, series, xmax)?;
            for s in series {
                for run in runs(&ts, &s.values, &breaks) {
                    line(&mut chart, &run, s)?;
                }
            }
            if k == 0 {
                move_xs = moves
                    .iter()
                    .map(|(t, _)| chart.backend_coord(&(*t, 0.0)).0)
                    .collect();
            }
        }
        for (x, (_, m)) in move_xs.iter().zip(&moves) {
            move_marker(&root, *x, m)?;
        }
        root.present().map_err(drawn)?;
    }
    Ok(out)
}

/// The three panels: each one's title and lines, at each look.
fn panels(points: &[HistoryPoint]) -> [(&'static str, Vec<Series<'static>>); 3] {
    let figure = |name, color, values| Series {
        name,
        color,
        values,
        step: false,
        dashed: false,
        width: 2,
    };
    let objective = |values| Series {
        name: "objective",
        color: OBJECTIVE,
        values,
        step: true,
        dashed: true,
        width: 2,
    };
    [
        (
            "TTFT p90 (ms)",
            vec![
                figure("TTFT p90", TTFT, col(points, |p| p.figures.ttft_p90_ms)),
                objective(col(points, |p| p.ttft_p90_ms)),
            ],
        ),
        (
            "ITL p90 (ms)",
            vec![
                figure("ITL p90", ITL, col(points, |p| p.figures.itl_p90_ms)),
                objective(col(points, |p| p.itl_p90_ms)),
            ],
        ),
        (
            "Split (instances)",
            vec![
                Series {
                    name: "prefill",
                    color: PREFILL,
                    values: col(points, |p| Some(f64::from(p.split.prefill))),
                    step: true,
                    dashed: false,
                    width: 4,
                },
                Series {
                    name: "decode",
                    color: DECODE,
                    values: col(points, |p| Some(f64::from(p.split.decode))),
                    step: true,
                    dashed: false,
                    width: 2,
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

/// The part of the picture panel `k` takes: its plot, the tick labels left of it (and
/// under it for the last one), and the room right of it for its legend.
fn panel_area<'b>(
    root: &DrawingArea<SVGBackend<'b>, Shift>,
    k: u32,
) -> DrawingArea<SVGBackend<'b>, Shift> {
    let bottom = if k == 2 { BOTTOM } else { 0 };
    root.clone().shrink((0, panel_top(k)), (W, PH + bottom))
}

/// Panel `k`'s name, frame, grid, ticks and legend; the chart its lines are drawn in.
fn panel<'a, 'b>(
    root: &DrawingArea<SVGBackend<'b>, Shift>,
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    k: u32,
    title: &str,
    series: &[Series],
    xmax: f64,
) -> Result<Chart<'a, 'b>, PictureError> {
    let (ymax, ystep) = y_axis(series);
    let top = panel_top(k);
    let last = k == 2;
    let bottom = if last { BOTTOM } else { 0 };
    let mut chart = ChartBuilder::on(area)
        .set_label_area_size(LabelAreaPosition::Left, PAD_L)
        .set_label_area_size(LabelAreaPosition::Bottom, bottom)
        .margin_right(PAD_R)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(drawn)?;
    let name = TextStyle::from(("sans-serif", 16).into_font().style(FontStyle::Bold))
        .pos(Pos::new(HPos::Left, VPos::Bottom));
    root.draw(&Text::new(
        title.to_string(),
        (PAD_L as i32, top as i32 - 6),
        name,
    ))
    .map_err(drawn)?;
    let tick = |v: &f64| trim(*v);
    let mut mesh = chart.configure_mesh();
    mesh.max_light_lines(0)
        .bold_line_style(RGBColor(0xee, 0xee, 0xee))
        .x_labels(8)
        .y_labels((ymax / ystep).round() as usize + 1)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(("sans-serif", 13));
    if last {
        mesh.x_desc("seconds since the first look");
    }
    mesh.draw().map_err(drawn)?;
    if let Some(s) = series
        .first()
        .filter(|s| s.values.iter().all(Option::is_none))
    {
        let grey = ("sans-serif", 15)
            .into_font()
            .color(&RGBColor(0x88, 0x88, 0x88))
            .pos(Pos::new(HPos::Center, VPos::Center));
        let what = format!("no {} figure in this history", s.name);
        chart
            .plotting_area()
            .draw(&Text::new(what, (xmax / 2.0, ymax / 2.0), grey))
            .map_err(drawn)?;
    }
    legend(root, top, series)?;
    Ok(chart)
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

/// The names of a panel's lines, right of it, each beside a stroke drawn as its line is.
fn legend(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    top: u32,
    series: &[Series],
) -> Result<(), PictureError> {
    for (i, s) in series.iter().enumerate() {
        let x = (W - PAD_R + 14) as i32;
        let y = (top + 14 + 20 * i as u32) as i32;
        let style = rgb(s.color).stroke_width(s.width);
        let dashes: &[(i32, i32)] = if s.dashed {
            &[(0, 6), (10, 16), (20, 24)]
        } else {
            &[(0, 24)]
        };
        for (from, to) in dashes {
            root.draw(&PathElement::new([(x + from, y), (x + to, y)], style))
                .map_err(drawn)?;
        }
        let font =
            TextStyle::from(("sans-serif", 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        root.draw(&Text::new(s.name.to_string(), (x + 30, y), font))
            .map_err(drawn)?;
    }
    Ok(())
}

/// One run of values: a line (stepped and dashed as its series is), or a dot when it is a
/// single look.
fn line(chart: &mut Chart, run: &[(f64, f64)], s: &Series) -> Result<(), PictureError> {
    let color = rgb(s.color);
    if let [only] = run {
        chart
            .draw_series([Circle::new(*only, DOT, color.filled())])
            .map_err(drawn)?;
        return Ok(());
    }
    let mut pts = Vec::with_capacity(2 * run.len());
    for (i, (t, v)) in run.iter().enumerate() {
        if s.step && i > 0 {
            pts.push((*t, run[i - 1].1));
        }
        pts.push((*t, *v));
    }
    let style = color.stroke_width(s.width);
    if s.dashed {
        chart
            .draw_series(DashedLineSeries::new(pts, 6u32, 4u32, style))
            .map_err(drawn)?;
    } else {
        chart
            .draw_series(LineSeries::new(pts, style))
            .map_err(drawn)?;
    }
    Ok(())
}

/// A move: a line across the three panels at its x, labelled with its splits (and how it
/// ended, when it did not end done).
fn move_marker(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    x: i32,
    m: &MoveRecord,
) -> Result<(), PictureError> {
    let outcome = MoveOutcome::of(m.outcome.as_deref().unwrap_or("done"));
    let ended = if outcome == MoveOutcome::Done {
        String::new()
    } else {
        format!(" ({})", outcome.as_str())
    };
    let color = rgb(if ended.is_empty() {
        MOVE
    } else {
        MOVE_NOT_DONE
    });
    let (top, bottom) = (panel_top(0) as i32, (panel_top(2) + PH) as i32);
    root.draw(&PathElement::new(
        [(x, top), (x, bottom)],
        color.stroke_width(1),
    ))
    .map_err(drawn)?;
    let label = format!("{} -> {}{ended}", m.from, m.to);
    let font = ("sans-serif", 14)
        .into_font()
        .color(&color)
        .transform(FontTransform::Rotate90);
    // Turned a quarter, the text's first line hangs left of its anchor: anchored a line
    // right of the marker, it reads beside it.
    root.draw(&Text::new(label, (x + 18, top + 6), font))
        .map_err(drawn)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pictures::read::{dots, polylines, texts};
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

    /// The lines drawn in `color`, `width` wide, inside panel `k`'s plot (not its legend).
    fn lines_in(svg: &str, color: &str, width: u32, k: u32) -> Vec<Vec<(f64, f64)>> {
        let (top, bottom) = (f64::from(panel_top(k)), f64::from(panel_top(k) + PH));
        let right = f64::from(W - PAD_R);
        polylines(svg, color, width)
            .into_iter()
            .filter(|l| {
                l.iter()
                    .all(|&(x, y)| x <= right && y >= top && y <= bottom)
            })
            .collect()
    }

    /// The vertical lines across all three panels drawn in `color`: the moves.
    fn markers(svg: &str, color: &str) -> Vec<f64> {
        let (top, bottom) = (f64::from(panel_top(0)), f64::from(panel_top(2) + PH));
        polylines(svg, color, 1)
            .into_iter()
            .filter(|l| l.len() == 2 && l[0].0 == l[1].0 && l[0].1 == top && l[1].1 == bottom)
            .map(|l| l[0].0)
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
        let texts = texts(&svg);
        assert!(
            texts.contains(&"Rebalancing of cluster demo: 5 looks, 1 moves".to_string()),
            "{texts:?}"
        );
        for panel in ["TTFT p90 (ms)", "ITL p90 (ms)", "Split (instances)"] {
            assert!(texts.iter().any(|t| t == panel), "{panel}: {texts:?}");
        }
        for name in ["TTFT p90", "ITL p90", "objective", "prefill", "decode"] {
            assert!(texts.iter().any(|t| t == name), "legend {name}: {texts:?}");
        }
        let ttft = lines_in(&svg, TTFT, 2, 0);
        assert_eq!(ttft.len(), 1);
        assert_eq!(ttft[0].len(), 5, "one vertex a look");
        assert!(
            ttft[0].windows(2).all(|w| w[0].0 < w[1].0),
            "time goes right"
        );
        assert_eq!(
            lines_in(&svg, ITL, 2, 1).len(),
            1,
            "ITL in the second panel"
        );
        // A step line has a riser before each look after the first: 2n - 1 vertices.
        let prefill = lines_in(&svg, PREFILL, 4, 2);
        assert_eq!(prefill.len(), 1);
        assert_eq!(prefill[0].len(), 9);
        let ys: Vec<f64> = prefill[0].iter().map(|p| p.1).collect();
        assert!(
            ys[8] < ys[0],
            "3 prefill instances at the end sit above the 2 at the start"
        );
        assert_eq!(lines_in(&svg, DECODE, 2, 2)[0].len(), 9);
    }

    #[test]
    fn the_objective_is_a_dashed_level_line_at_its_value() {
        let (points, moves) = history();
        let svg = svg("demo", &points, &moves).unwrap();
        // Dashed: many short pieces, all at one height (a level objective).
        let objective = lines_in(&svg, OBJECTIVE, 2, 0);
        assert!(objective.len() > 10, "{objective:?}");
        let y = objective[0][0].1;
        assert!(
            objective.iter().flatten().all(|p| p.1 == y),
            "level: {objective:?}"
        );
        let x_end = objective.iter().flatten().map(|p| p.0).fold(0.0, f64::max);
        // The look whose TTFT equals the objective (200 ms) sits on it; 400 ms above it.
        let ttft = &lines_in(&svg, TTFT, 2, 0)[0];
        assert_eq!(ttft[1].1, y);
        assert!(ttft[2].1 < y);
        assert!(ttft[0].1 > y);
        assert!(
            x_end >= ttft[4].0 - 10.0,
            "the objective runs to the last look"
        );
        assert!(
            !lines_in(&svg, OBJECTIVE, 2, 1).is_empty(),
            "ITL's objective"
        );
    }

    #[test]
    fn a_move_is_a_labelled_line_at_its_time() {
        let (points, mut moves) = history();
        moves.push(a_move(4, split(3, 1), split(2, 2), "failed (1): refused"));
        let mut never = moves.clone();
        let svg = svg("demo", &points, &moves).unwrap();
        let done = markers(&svg, MOVE);
        let failed = markers(&svg, MOVE_NOT_DONE);
        assert_eq!((done.len(), failed.len()), (1, 1), "{svg}");
        let texts = texts(&svg);
        assert!(texts.contains(&"2P2D -&gt; 3P1D".to_string()), "{texts:?}");
        assert!(
            texts.contains(&"3P1D -&gt; 2P2D (failed)".to_string()),
            "{texts:?}"
        );
        // A move whose change never started says so (before: "(not)").
        never.last_mut().unwrap().outcome = Some("not started: another change runs".into());
        let never = self::texts(&self::svg("demo", &points, &never).unwrap());
        assert!(
            never.contains(&"3P1D -&gt; 2P2D (not started)".to_string()),
            "{never:?}"
        );
        // At the third look's x (2 s in), the fifth's (4 s in): the TTFT line's vertices.
        let ttft = &lines_in(&svg, TTFT, 2, 0)[0];
        assert_eq!(done[0], ttft[2].0);
        assert_eq!(failed[0], ttft[4].0);
    }

    #[test]
    fn a_look_without_a_figure_leaves_a_gap_not_a_zero() {
        let (mut points, moves) = history();
        points[2].figures.ttft_p90_ms = None;
        points[4].figures.itl_p90_ms = None;
        let svg = svg("demo", &points, &moves).unwrap();
        let ttft = lines_in(&svg, TTFT, 2, 0);
        assert_eq!(ttft.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2]);
        assert_eq!(lines_in(&svg, ITL, 2, 1)[0].len(), 4);
        // The split goes on: it is known at every look.
        assert_eq!(lines_in(&svg, PREFILL, 4, 2)[0].len(), 9);
        // A lone look between two gaps is a dot.
        points[1].figures.ttft_p90_ms = None;
        points[3].figures.ttft_p90_ms = None;
        let svg = super::svg("demo", &points, &moves).unwrap();
        assert_eq!(lines_in(&svg, TTFT, 2, 0).len(), 0);
        assert_eq!(dots(&svg, TTFT).len(), 2);
    }

    #[test]
    fn a_long_pause_between_looks_breaks_the_lines() {
        let mut points: Vec<HistoryPoint> = (0..4)
            .map(|s| point(s, Some(100.0), None, split(2, 2)))
            .collect();
        points.extend((600..604).map(|s| point(s, Some(100.0), None, split(2, 2))));
        let svg = svg("demo", &points, &[]).unwrap();
        assert_eq!(lines_in(&svg, TTFT, 2, 0).len(), 2);
        assert_eq!(lines_in(&svg, PREFILL, 4, 2).len(), 2);
        assert!(
            texts(&svg).contains(&"no ITL p90 figure in this history".to_string()),
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
