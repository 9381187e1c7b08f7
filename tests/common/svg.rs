//! Reading back what pdctl's SVG pictures hold (drawn by plotters, one element a line, text
//! on its own line): the lines by their stroke, the texts. For tests that check what a
//! picture shows, not its bytes.

/// The value of attribute `name` in one element's text.
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
                .expect("a polyline has points")
                .split_whitespace()
                .map(|xy| {
                    let (x, y) = xy.split_once(',').expect("x,y");
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect()
        })
        .collect()
}

/// Every text element's content, trimmed (as escaped in the SVG: `&gt;` for `>`).
pub fn texts(svg: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find("<text") {
        let body = &rest[open..];
        let start = body.find('>').expect("a text element closes its tag") + 1;
        let end = body.find("</text>").expect("a text element ends");
        out.push(body[start..end].trim().to_string());
        rest = &body[end..];
    }
    out
}
