//! Latency CDFs as an SVG a person would rather look at than read: one panel for time to
//! first token, one for end-to-end latency, one line per run, and under them one legend
//! line per run with its medians and throughput.

use super::{PictureError, axis, drawn, rgb, trim};
use crate::bench::report::Report;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A panel's width and height.
const W: u32 = 420;
const H: u32 = 300;
/// A legend line's height under the panels.
const ROW: u32 = 20;
/// Room left of a panel's plot for its tick labels and axis name.
const PAD_L: u32 = 58;

/// The runs' colors, in order (a seventh run takes the first again): what the SVG strokes
/// each run's lines with, so a reader (or a test) can tell them apart.
pub const RUN_COLORS: [&str; 6] = [
    "#1F77B4", "#D62728", "#2CA02C", "#FF7F0E", "#9467BD", "#8C564B",
];

/// A run's CDF lines are this wide (its legend line is wider).
pub const LINE_WIDTH: u32 = 2;

/// The SVG document for one or more runs.
pub fn svg(runs: &[&Report]) -> Result<String, PictureError> {
    let height = H + ROW * runs.len() as u32 + 10;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (2 * W, height)).into_drawing_area();
        root.fill(&WHITE).map_err(drawn)?;
        let (panels, legend) = root.split_vertically(H);
        let (left, right) = panels.split_horizontally(W);
        let ms = |v: &[f64]| v.iter().map(|s| s * 1e3).collect::<Vec<_>>();
        let ttft: Vec<Vec<f64>> = runs.iter().map(|r| ms(&r.ttfts)).collect();
        let e2e: Vec<Vec<f64>> = runs.iter().map(|r| ms(&r.e2els)).collect();
        panel(&left, "Time to first token (CDF)", &ttft)?;
        panel(&right, "End-to-end latency (CDF)", &e2e)?;
        for (i, r) in runs.iter().enumerate() {
            let y = 16 + (ROW * i as u32) as i32;
            let x = PAD_L as i32;
            let color = rgb(RUN_COLORS[i % RUN_COLORS.len()]);
            legend
                .draw(&PathElement::new(
                    [(x, y), (x + 24, y)],
                    color.stroke_width(LINE_WIDTH + 1),
                ))
                .map_err(drawn)?;
            let text = format!(
                "{}: median TTFT {:.1} ms, p99 {:.1} ms; median E2E {:.1} ms; {:.1} req/s",
                r.run.label,
                r.ttft_ms.median,
                r.ttft_ms.p99,
                r.e2el_ms.median,
                r.request_throughput
            );
            let font = ("sans-serif", 15)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center));
            legend
                .draw(&Text::new(text, (x + 32, y), font))
                .map_err(drawn)?;
        }
        root.present().map_err(drawn)?;
    }
    Ok(out)
}

/// One panel: its title, axes and grid, and one CDF line per run.
fn panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    series: &[Vec<f64>],
) -> Result<(), PictureError> {
    let max = series.iter().flatten().copied().fold(0.0, f64::max);
    let (xmax, _) = axis(max);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 17).into_font().style(FontStyle::Bold))
        .margin(8)
        .margin_right(16)
        .x_label_area_size(34)
        .y_label_area_size(PAD_L - 8)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)
        .map_err(drawn)?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .bold_line_style(RGBColor(0xee, 0xee, 0xee))
        .x_labels(6)
        .y_labels(11)
        .x_label_formatter(&|v| trim(*v))
        .y_label_formatter(&|v| trim(*v))
        .x_desc("milliseconds")
        .y_desc("fraction of requests")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(drawn)?;
    for (i, values) in series.iter().enumerate() {
        let color = rgb(RUN_COLORS[i % RUN_COLORS.len()]);
        chart
            .draw_series(LineSeries::new(
                cdf_steps(values),
                color.stroke_width(LINE_WIDTH),
            ))
            .map_err(drawn)?;
    }
    Ok(())
}

/// The empirical CDF of `values` as the corners of a step line: at each value, up from
/// the fraction below it to the fraction at or below it.
fn cdf_steps(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let mut out = Vec::with_capacity(2 * v.len());
    for (k, x) in v.iter().enumerate() {
        out.push((*x, k as f64 / n));
        out.push((*x, (k + 1) as f64 / n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pictures::read::{polylines, texts};

    #[test]
    fn a_cdf_climbs_one_step_a_value_from_zero_to_one() {
        let steps = cdf_steps(&[30.0, 10.0, 20.0, 40.0]);
        assert_eq!(steps.len(), 8);
        assert_eq!(steps[0], (10.0, 0.0));
        assert_eq!(steps[1], (10.0, 0.25));
        assert_eq!(steps[2], (20.0, 0.25));
        assert_eq!(steps[7], (40.0, 1.0));
        assert!(cdf_steps(&[]).is_empty());
    }

    fn report(label: &str, ttfts_ms: &[f64]) -> Report {
        let info = crate::bench::report::RunInfo {
            label: label.into(),
            ..Default::default()
        };
        let mut r = Report::from_outcomes(info, &[], 1.0, Vec::new());
        r.ttfts = ttfts_ms.iter().map(|v| v / 1e3).collect();
        r.e2els = ttfts_ms.iter().map(|v| 2.0 * v / 1e3).collect();
        r
    }

    #[test]
    fn each_run_is_one_line_in_each_panel_and_one_legend_line() {
        let a = report("fast <a>", &[10.0, 20.0, 30.0]);
        let b = report("slow", &[100.0, 200.0, 300.0, 400.0]);
        let svg = svg(&[&a, &b]).unwrap();
        for (color, n) in [(RUN_COLORS[0], 3), (RUN_COLORS[1], 4)] {
            let lines = polylines(&svg, color, LINE_WIDTH);
            assert_eq!(lines.len(), 2, "{color}: one line a panel");
            assert!(lines.iter().all(|l| l.len() == 2 * n), "{lines:?}");
            // The left panel's line in the left half, the right panel's in the right.
            assert!(lines[0].iter().all(|p| p.0 < f64::from(W)));
            assert!(lines[1].iter().all(|p| p.0 > f64::from(W)));
            assert_eq!(polylines(&svg, color, LINE_WIDTH + 1).len(), 1, "legend");
        }
        let texts = texts(&svg);
        for (want, panels) in [
            ("Time to first token (CDF)", 1),
            ("End-to-end latency (CDF)", 1),
            ("milliseconds", 2),
            ("fraction of requests", 2),
        ] {
            let n = texts.iter().filter(|t| *t == want).count();
            assert_eq!(n, panels, "{want}: {texts:?}");
        }
        assert!(
            texts
                .iter()
                .any(|t| t.starts_with("fast &lt;a&gt;: median TTFT")),
            "labels are escaped: {texts:?}"
        );
        assert!(texts.iter().any(|t| t.starts_with("slow: median TTFT")));
    }
}
