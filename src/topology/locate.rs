//! Finding keys in the topology text, so every error can say file:line:col.
//!
//! serde sees values, not positions; this re-reads the document as toml's spanned tree and
//! answers two questions: where is `prefill.nodes[1]`, and which key is at byte N.

use super::TopologyError;
use std::ops::Range;
use toml::de::{DeTable, DeValue};

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// The source text of a topology and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Locator {
    /// What errors call the file (a path, or `<profile sim-1p1d>`).
    pub file: String,
    text: String,
}

impl Locator {
    pub fn new(file: impl Into<String>, text: impl Into<String>) -> Locator {
        Locator {
            file: file.into(),
            text: text.into(),
        }
    }

    /// The text as it was read.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Length of the text, in bytes.
    pub fn text_len(&self) -> usize {
        self.text.len()
    }

    /// True when the file writes exactly this key (not just an ancestor of it).
    pub fn writes(&self, path: &str) -> bool {
        self.span_of_exact(path).is_some()
    }

    /// A best guess at the key written on the line holding `offset`, for syntax errors
    /// (`[proxy` -> `proxy`, `port = ` -> `port`).
    pub fn key_on_line_of(&self, offset: usize) -> String {
        let offset = offset.min(self.text.len());
        let start = self.text[..offset].rfind('\n').map(|i| i + 1).unwrap_or(0);
        let end = self.text[start..]
            .find('\n')
            .map(|i| start + i)
            .unwrap_or(self.text.len());
        let line = &self.text[start..end];
        let key = line.split('=').next().unwrap_or("");
        key.trim()
            .trim_matches(|c| c == '[' || c == ']')
            .trim()
            .to_string()
    }

    /// 1-based line and column of a byte offset.
    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
        let col = self.text[line_start..offset].chars().count() + 1;
        (line, col)
    }

    /// Where `path` (e.g. `prefill.nodes[1]`) is written: the key for table entries, the
    /// value for array elements. Falls back to the nearest written ancestor.
    pub fn span_of(&self, path: &str) -> Option<Range<usize>> {
        self.find(path).map(|(span, _)| span)
    }

    /// Where `path` is written, only if the whole path is.
    fn span_of_exact(&self, path: &str) -> Option<Range<usize>> {
        self.find(path)
            .filter(|(_, exact)| *exact)
            .map(|(span, _)| span)
    }

    /// The span of the deepest written prefix of `path`, and whether it is all of it.
    fn find(&self, path: &str) -> Option<(Range<usize>, bool)> {
        let segs = parse_path(path);
        let total = segs.len();
        let mut depth = 0;
        let root = DeTable::parse(&self.text).ok()?;
        let mut best = None;
        let mut table: Option<&DeTable> = Some(root.get_ref());
        let mut array: Option<&toml::de::DeArray> = None;
        for seg in segs {
            let found = match (&seg, table, array) {
                (Seg::Key(k), Some(t), _) => t
                    .iter()
                    .find(|(key, _)| key.get_ref() == k)
                    .map(|(key, val)| (key.span(), val)),
                (Seg::Index(i), _, Some(a)) => a.get(*i).map(|v| (v.span(), v)),
                _ => None,
            };
            let Some((span, val)) = found else { break };
            best = Some(span);
            depth += 1;
            table = None;
            array = None;
            match val.get_ref() {
                DeValue::Table(t) => table = Some(t),
                DeValue::Array(a) => array = Some(a),
                _ => {}
            }
        }
        best.map(|b| (b, depth == total))
    }

    /// The deepest key path whose key or value covers byte `offset`.
    pub fn path_at(&self, offset: usize) -> Option<String> {
        let root = DeTable::parse(&self.text).ok()?;
        let mut path = String::new();
        let mut found = false;
        walk_table(root.get_ref(), offset, &mut path, &mut found);
        found.then_some(path)
    }

    /// Node names in the order the file writes them (the first is the default head).
    pub fn table_key_order(&self, table: &str) -> Vec<String> {
        let Ok(root) = DeTable::parse(&self.text) else {
            return Vec::new();
        };
        let Some((_, val)) = root.get_ref().iter().find(|(k, _)| k.get_ref() == table) else {
            return Vec::new();
        };
        let DeValue::Table(t) = val.get_ref() else {
            return Vec::new();
        };
        let mut keys: Vec<(usize, String)> = t
            .iter()
            .map(|(k, _)| (k.span().start, k.get_ref().to_string()))
            .collect();
        keys.sort();
        keys.into_iter().map(|(_, k)| k).collect()
    }

    /// A located error for `key` (dotted path), pointing at where that key is written.
    pub fn error(
        &self,
        key: &str,
        message: impl Into<String>,
        hint: Option<String>,
    ) -> TopologyError {
        // A key not written anywhere is reported at the top of the file.
        let offset = self.span_of(key).map_or(0, |s| s.start);
        self.error_at(offset, key, message, hint)
    }

    /// A located error at a byte offset (syntax errors, serde errors with a span).
    pub fn error_at(
        &self,
        offset: usize,
        key: &str,
        message: impl Into<String>,
        hint: Option<String>,
    ) -> TopologyError {
        let (line, col) = self.line_col(offset);
        TopologyError {
            file: self.file.clone(),
            line,
            col,
            key: key.to_string(),
            message: message.into(),
            hint,
        }
    }
}

fn walk_table(t: &DeTable, offset: usize, path: &mut String, found: &mut bool) {
    for (k, v) in t.iter() {
        let (ks, vs) = (k.span(), v.span());
        if ks.contains(&offset)
            || vs.contains(&offset)
            || (vs.start <= offset && offset <= vs.end && !vs.is_empty())
        {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(k.get_ref());
            *found = true;
            if !ks.contains(&offset) {
                walk_value(v.get_ref(), offset, path, found);
            }
            return;
        }
    }
    // Tables declared by headers ([a.b]) have value spans that may not cover their
    // entries; descend into any sub-table that holds the offset somewhere.
    for (k, v) in t.iter() {
        if let DeValue::Table(sub) = v.get_ref()
            && table_covers(sub, offset)
        {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(k.get_ref());
            *found = true;
            walk_table(sub, offset, path, found);
            return;
        }
    }
}

fn table_covers(t: &DeTable, offset: usize) -> bool {
    t.iter().any(|(k, v)| {
        k.span().contains(&offset)
            || v.span().contains(&offset)
            || matches!(v.get_ref(), DeValue::Table(sub) if table_covers(sub, offset))
    })
}

fn walk_value(v: &DeValue, offset: usize, path: &mut String, found: &mut bool) {
    match v {
        DeValue::Table(t) => walk_table(t, offset, path, found),
        DeValue::Array(a) => {
            for (i, item) in a.iter().enumerate() {
                if item.span().contains(&offset) {
                    path.push_str(&format!("[{i}]"));
                    walk_value(item.get_ref(), offset, path, found);
                    return;
                }
            }
        }
        _ => {}
    }
}

fn parse_path(path: &str) -> Vec<Seg> {
    let mut segs = Vec::new();
    for part in path.split('.') {
        let mut rest = part;
        if let Some(i) = rest.find('[') {
            if i > 0 {
                segs.push(Seg::Key(rest[..i].to_string()));
            }
            rest = &rest[i..];
            while let Some(r) = rest.strip_prefix('[') {
                let end = r.find(']').unwrap_or(r.len());
                if let Ok(n) = r[..end].parse() {
                    segs.push(Seg::Index(n));
                }
                rest = r.get(end + 1..).unwrap_or("");
            }
        } else if !rest.is_empty() {
            segs.push(Seg::Key(rest.to_string()));
        }
    }
    segs
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "cluster = \"a\"\n\n[prefill]\ninstances = 2\nnodes = [\"n1\", \"n2\"]\n\n[engine.sim]\nitl_ms = 3.0\n";

    #[test]
    fn finds_keys_and_array_elements() {
        let l = Locator::new("t.toml", DOC);
        let at = |p| l.line_col(l.span_of(p).unwrap().start);
        assert_eq!(at("cluster"), (1, 1));
        assert_eq!(at("prefill"), (3, 2));
        assert_eq!(at("prefill.instances"), (4, 1));
        assert_eq!(at("prefill.nodes[1]"), (5, 16));
        assert_eq!(at("engine.sim.itl_ms"), (8, 1));
        // Unwritten keys fall back to the nearest written ancestor.
        assert_eq!(at("prefill.base_port"), (3, 2));
        assert!(l.span_of("decode").is_none());
    }

    #[test]
    fn names_the_key_at_an_offset() {
        let l = Locator::new("t.toml", DOC);
        let off = DOC.find("\"n2\"").unwrap();
        assert_eq!(l.path_at(off).as_deref(), Some("prefill.nodes[1]"));
        let off = DOC.find("itl_ms").unwrap();
        assert_eq!(l.path_at(off).as_deref(), Some("engine.sim.itl_ms"));
        let off = DOC.find("instances").unwrap();
        assert_eq!(l.path_at(off).as_deref(), Some("prefill.instances"));
    }

    #[test]
    fn keeps_the_file_order_of_a_table() {
        let l = Locator::new("t.toml", "[nodes]\nzeta = \"1\"\nalpha = \"2\"\n");
        assert_eq!(l.table_key_order("nodes"), vec!["zeta", "alpha"]);
    }
}
