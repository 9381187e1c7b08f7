//! Latency CDFs as an SVG a person would rather look at than read: one panel for time to
//! first token, one for end-to-end latency, one line per run.

use super::report::Report;
use std::fmt::Write;

const W: f64 = 420.0;
const H: f64 = 300.0;
const PAD_L: f64 = 58.0;
const PAD_B: f64 = 42.0;
const PAD_T: f64 = 30.0;
const PAD_R: f64 = 16.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// A "nice" axis end and tick step covering `max` (also the rebalance history plot's).
pub(crate) fn axis(max: f64) -> (f64, f64) {
    let max = if max > 0.0 { max } else { 1.0 };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// Where a panel sits and how values map onto it.
struct Frame {
    /// The panel's left edge.
    x0: f64,
    /// The value at the right end of the x axis.
    xmax: f64,
    /// The plot area's width and height.
    pw: f64,
    ph: f64,
}

impl Frame {
    fn px(&self, v: f64) -> f64 {
        self.x0 + PAD_L + v / self.xmax * self.pw
    }
    fn py(&self, p: f64) -> f64 {
        PAD_T + (1.0 - p) * self.ph
    }
}

/// One panel at `x0`: its axes and one CDF line per series.
fn panel(o: &mut String, x0: f64, title: &str, series: &[(&str, Vec<f64>)]) {
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0, f64::max);
    let (xmax, step) = axis(max);
    let f = Frame {
        x0,
        xmax,
        pw: W - PAD_L - PAD_R,
        ph: H - PAD_T - PAD_B,
    };
    axes(o, &f, step, title);
    for (i, (_, values)) in series.iter().enumerate() {
        cdf_line(o, &f, values, COLORS[i % COLORS.len()]);
    }
}

/// The panel's title, frame, grid lines, tick labels and axis names.
fn axes(o: &mut String, f: &Frame, step: f64, title: &str) {
    let (x0, pw, ph) = (f.x0, f.pw, f.ph);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="18" font-size="14" text-anchor="middle" font-weight="bold">{title}</text>"#,
        x0 + W / 2.0
    );
    let _ = writeln!(
        o,
        r##"<rect x="{}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>"##,
        x0 + PAD_L
    );
    let mut t = 0.0;
    while t <= f.xmax + step / 2.0 {
        let x = f.px(t);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{PAD_T}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/>"##,
            PAD_T + ph
        );
        let _ = writeln!(
            o,
            r#"<text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            PAD_T + ph + 15.0,
            trim(t)
        );
        t += step;
    }
    for p in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
        let y = f.py(p);
        let _ = writeln!(
            o,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/>"##,
            x0 + PAD_L,
            x0 + PAD_L + pw
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"#,
            x0 + PAD_L - 5.0,
            y + 4.0,
            trim(p)
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">milliseconds</text>"#,
        x0 + PAD_L + pw / 2.0,
        H - 8.0
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">fraction of requests</text>"#,
        x0 + 14.0,
        PAD_T + ph / 2.0,
        x0 + 14.0,
        PAD_T + ph / 2.0
    );
}

/// The empirical CDF of `values` as a step line.
fn cdf_line(o: &mut String, f: &Frame, values: &[f64], color: &str) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let mut pts = String::new();
    let mut prev = 0.0;
    for (k, x) in v.iter().enumerate() {
        let _ = write!(
            pts,
            "{:.1},{:.1} {:.1},{:.1} ",
            f.px(*x),
            f.py(prev),
            f.px(*x),
            f.py((k + 1) as f64 / n)
        );
        prev = (k + 1) as f64 / n;
    }
    let _ = writeln!(
        o,
        r#"<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>"#
    );
}

/// A tick label: at most two decimals, no trailing zeros.
pub(crate) fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Text made safe inside an SVG element.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG document for one or more runs.
pub fn svg(runs: &[&Report]) -> String {
    let legend_h = 20.0 * runs.len() as f64 + 10.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif">"#,
        2.0 * W,
        H + legend_h
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let ms = |v: &[f64]| v.iter().map(|s| s * 1e3).collect::<Vec<_>>();
    let ttft: Vec<(&str, Vec<f64>)> = runs
        .iter()
        .map(|r| (r.run.label.as_str(), ms(&r.ttfts)))
        .collect();
    let e2e: Vec<(&str, Vec<f64>)> = runs
        .iter()
        .map(|r| (r.run.label.as_str(), ms(&r.e2els)))
        .collect();
    panel(&mut o, 0.0, "Time to first token (CDF)", &ttft);
    panel(&mut o, W, "End-to-end latency (CDF)", &e2e);
    for (i, r) in runs.iter().enumerate() {
        let y = H + 16.0 + 20.0 * i as f64;
        let c = COLORS[i % COLORS.len()];
        let _ = writeln!(
            o,
            r#"<line x1="{PAD_L}" y1="{y}" x2="{}" y2="{y}" stroke="{c}" stroke-width="3"/>"#,
            PAD_L + 24.0
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" font-size="12">{}: median TTFT {:.1} ms, p99 {:.1} ms; median E2E {:.1} ms; {:.1} req/s</text>"#,
            PAD_L + 32.0,
            y + 4.0,
            escape(&r.run.label),
            r.ttft_ms.median,
            r.ttft_ms.p99,
            r.e2el_ms.median,
            r.request_throughput
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_round_numbers() {
        assert_eq!(axis(87.0), (100.0, 20.0));
        assert_eq!(axis(0.9), (1.0, 0.2));
        assert_eq!(axis(0.0), (1.0, 0.2));
    }
}
