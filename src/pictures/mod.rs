//! Pictures a person looks at rather than reads, drawn with plotters (its SVG backend only:
//! no system library, no font files): the latency CDFs of `pdctl bench --plot` and
//! `pdctl tune --plot` ([`latency`]) and the rebalancer's history of
//! `pdctl rebalance history --plot` ([`rebalance`]).
//!
//! A room of its own, above what it draws from (the bench's reports, the rebalancer's kept
//! looks and moves) and below the command line that writes the files: a picture is
//! presentation, which the layers that measure or change a cluster never need
//! (`tests/layers.rs` keeps `ops` from drawing). The bench hands its reports to
//! [`latency::svg`] through the command line (`bench::Draw`) for the same reason.

pub mod latency;
pub mod rebalance;

use plotters::style::RGBColor;

/// Why a picture could not be drawn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PictureError {
    /// plotters refused a drawing step (into a string this is a bug of the drawing code,
    /// not something a user can cause).
    #[error("drawing the picture failed: {0}")]
    Draw(String),
}

/// plotters' error as ours.
fn drawn(e: impl std::fmt::Display) -> PictureError {
    PictureError::Draw(e.to_string())
}

/// `#RRGGBB` as plotters' color (the colors are kept as text so tests and readers can
/// name the lines by the stroke the SVG gives them).
fn rgb(color: &str) -> RGBColor {
    let mut bytes = [0u8; 3];
    let _ = hex::decode_to_slice(color.trim_start_matches('#'), &mut bytes);
    RGBColor(bytes[0], bytes[1], bytes[2])
}

/// A "nice" axis end and tick step covering `max`.
fn axis(max: f64) -> (f64, f64) {
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

/// A tick label: at most two decimals, no trailing zeros.
fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Reading back what a picture holds, for the tests: lines by their stroke, texts.
#[cfg(test)]
pub(crate) mod read {
    /// The value of attribute `name` in one SVG element's text.
    fn attr<'a>(element: &'a str, name: &str) -> Option<&'a str> {
        let start = element.find(&format!(" {name}=\""))? + name.len() + 3;
        let len = element[start..].find('"')?;
        Some(&element[start..start + len])
    }

    /// Every polyline stroked in `color` (`#RRGGBB`, any case) `width` wide, as its points.
    pub fn polylines(svg: &str, color: &str, width: u32) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter(|l| l.starts_with("<polyline"))
            .filter(|l| attr(l, "stroke").is_some_and(|c| c.eq_ignore_ascii_case(color)))
            .filter(|l| attr(l, "stroke-width") == Some(&width.to_string()))
            .map(|l| {
                attr(l, "points")
                    .unwrap()
                    .split_whitespace()
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    }

    /// The centres of the circles filled with `color`.
    pub fn dots(svg: &str, color: &str) -> Vec<(f64, f64)> {
        svg.lines()
            .filter(|l| l.starts_with("<circle"))
            .filter(|l| attr(l, "fill").is_some_and(|c| c.eq_ignore_ascii_case(color)))
            .map(|l| {
                let n = |a| attr(l, a).unwrap().parse().unwrap();
                (n("cx"), n("cy"))
            })
            .collect()
    }

    /// Every text element's content (plotters writes it on its own line), trimmed.
    pub fn texts(svg: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = svg;
        while let Some(open) = rest.find("<text") {
            let body = &rest[open..];
            let start = body.find('>').unwrap() + 1;
            let end = body.find("</text>").unwrap();
            out.push(body[start..end].trim().to_string());
            rest = &body[end..];
        }
        out
    }
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

    #[test]
    fn tick_labels_drop_trailing_zeros() {
        assert_eq!(trim(2.5), "2.5");
        assert_eq!(trim(10.0), "10");
        assert_eq!(trim(0.25), "0.25");
    }
}
