//! The layers of `src/`, and the test that keeps imports running downward only.
//!
//! Every top-level module of the library (a folder under `src/`, or a file there) sits
//! in one layer of [`LAYERS`]. A module may use what its own layer and the layers below
//! it define, never what a layer above defines, and no two top-level modules may import
//! each other, directly or round a longer loop. A type that two layers share goes down
//! into `src/vocab/` (or the lowest module both already use), never into the module of
//! the one that happens to use it most.
//!
//! The test reads the source, not the compiler's view: it finds every `crate::x`
//! (in `use` lines, groups such as `use crate::{a::B, c::D}`, and paths inside code) and
//! every `super::` that climbs out of a top-level module. Comments, strings and doc
//! links do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers of `src/`, lowest first. `main.rs` and `lib.rs` are the crate's root and
/// stand above every layer.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves: formats and text every layer may use",
        &["error_text", "spelling", "prometheus", "sse", "allocator"],
    ),
    ("vocabulary several layers share", &["vocab"]),
    (
        "what this machine has",
        &["tools", "vllm", "gpu", "model_files"],
    ),
    ("the user's topology", &["topology"]),
    (
        "settings of pdctl's child processes, built-in topologies",
        &["child_config", "profiles"],
    ),
    ("vLLM connector knowledge", &["connectors"]),
    ("the plan", &["plan"]),
    ("the supervisor's control protocol", &["control"]),
    (
        "the running parts",
        &["supervisor", "proxy", "sim", "bench", "export"],
    ),
    (
        "changes to a running cluster, and what measures and proves it",
        &["ops", "tune", "check"],
    ),
    ("the command line", &["cli"]),
];

/// One reference from a file to another top-level module.
#[derive(Debug, Clone)]
struct Import {
    file: PathBuf,
    line: usize,
    to: String,
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// Blanks comments, string and char literals (newlines kept, so offsets and line numbers
/// stay those of the file).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = src[i..].find('\n').map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = src[i + 2..].find("*/").map_or(b.len(), |n| i + 2 + n + 2);
                blank(&mut out, i, end);
                i = end;
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = i + 2 + hashes;
                let end = src[start..]
                    .find(&close)
                    .map_or(b.len(), |n| start + n + close.len());
                blank(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i, (j + 1).min(b.len()));
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '"'), not a lifetime ('a).
                let end = if b.get(i + 1) == Some(&b'\\') {
                    src[i + 2..].find('\'').map(|n| i + 2 + n + 1)
                } else if b.get(i + 2) == Some(&b'\'') {
                    Some(i + 3)
                } else {
                    src[i + 1..]
                        .chars()
                        .next()
                        .filter(|c| !c.is_ascii())
                        .and_then(|c| {
                            (b.get(i + 1 + c.len_utf8()) == Some(&b'\''))
                                .then_some(i + 2 + c.len_utf8())
                        })
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i, end);
                        i = end;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8")
}

fn ident_at(s: &str, at: usize) -> &str {
    let rest = &s[at..];
    let n = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    &rest[..n]
}

/// The first segment of each path in a `{...}` group starting at `open`.
fn group_heads(s: &str, open: usize) -> Vec<(usize, String)> {
    let b = s.as_bytes();
    let (mut depth, mut i, mut item_start) = (0usize, open, open + 1);
    let mut out = Vec::new();
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' | b',' if depth == 1 => {
                let item = s[item_start..i].trim_start();
                let at = i - s[item_start..i].len() + (s[item_start..i].len() - item.len());
                let head = ident_at(s, at);
                if !head.is_empty() && head != "self" {
                    out.push((at, head.to_string()));
                }
                item_start = i + 1;
                if b[i] == b'}' {
                    break;
                }
            }
            b'}' => depth -= 1,
            _ => {}
        }
        i += 1;
    }
    out
}

/// The top-level modules `src` (the text of a file of module `module`, `depth` levels
/// below the crate root) refers to, with the byte offset of each reference.
fn references(src: &str, depth: usize) -> Vec<(usize, String)> {
    let s = strip(src);
    let b = s.as_bytes();
    let mut out = Vec::new();
    // Inline modules (`mod tests { ... }`) open at a brace depth; `super::` inside one
    // climbs out of it first.
    let mut braces = 0usize;
    let mut inline: Vec<usize> = Vec::new();
    let mut i = 0;
    let boundary = |i: usize| {
        i == 0
            || !(b[i - 1].is_ascii_alphanumeric()
                || b[i - 1] == b'_'
                || b[i - 1] == b':'
                || b[i - 1] == b'$')
    };
    while i < b.len() {
        match b[i] {
            b'{' => {
                braces += 1;
                i += 1;
                continue;
            }
            b'}' => {
                if inline.last() == Some(&braces) {
                    inline.pop();
                }
                braces = braces.saturating_sub(1);
                i += 1;
                continue;
            }
            _ => {}
        }
        if boundary(i) && s[i..].starts_with("mod ") {
            let name_at = i + 4 + (s[i + 4..].len() - s[i + 4..].trim_start().len());
            let name = ident_at(&s, name_at);
            let after = s[name_at + name.len()..].trim_start();
            if after.starts_with('{') {
                inline.push(braces + 1);
            }
        }
        let (path_at, climbs) = if boundary(i) && s[i..].starts_with("crate::") {
            (i + "crate::".len(), None)
        } else if boundary(i) && s[i..].starts_with("super::") {
            let mut j = i;
            let mut k = 0;
            while s[j..].starts_with("super::") {
                j += "super::".len();
                k += 1;
            }
            (j, Some(k))
        } else {
            i += 1;
            continue;
        };
        if let Some(k) = climbs {
            // Only a climb past the file's own top-level module leaves it.
            if k < depth + inline.len() {
                i = path_at;
                continue;
            }
        }
        if b.get(path_at) == Some(&b'{') {
            out.extend(group_heads(&s, path_at));
        } else {
            let head = ident_at(&s, path_at);
            if !head.is_empty() {
                out.push((i, head.to_string()));
            }
        }
        i = path_at;
    }
    out
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src/ is readable") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module of a file under `src/` and how deep its module lies (1 for
/// `src/x.rs` and `src/x/mod.rs`); None for the crate root.
fn module_of(src: &Path, file: &Path) -> Option<(String, usize)> {
    let rel = file.strip_prefix(src).ok()?;
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        return None;
    }
    let depth = parts.len() - usize::from(parts.last().is_some_and(|p| p == "mod"));
    Some((parts[0].clone(), depth))
}

/// module -> the imports its files make of other top-level modules.
fn import_graph() -> BTreeMap<String, Vec<Import>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, Vec<Import>> = BTreeMap::new();
    for file in files {
        let Some((module, depth)) = module_of(&src, &file) else {
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("a source file is readable");
        let imports = graph.entry(module.clone()).or_default();
        for (at, to) in references(&text, depth) {
            if to != module {
                imports.push(Import {
                    file: file
                        .strip_prefix(src.parent().unwrap())
                        .unwrap()
                        .to_path_buf(),
                    line: text[..at].matches('\n').count() + 1,
                    to,
                });
            }
        }
    }
    graph
}

fn place(import: &Import) -> String {
    format!("{}:{}", import.file.display(), import.line)
}

#[test]
fn every_module_sits_in_a_layer_and_imports_only_downward() {
    let graph = import_graph();
    let mut wrong = Vec::new();
    for (module, imports) in &graph {
        let Some(own) = layer_of(module) else {
            wrong.push(format!(
                "src/{module} is in no layer: add it to LAYERS in tests/layers.rs, above what it imports and below what imports it"
            ));
            continue;
        };
        for i in imports {
            let Some(theirs) = layer_of(&i.to) else {
                continue; // reported as a module of its own
            };
            if theirs > own {
                wrong.push(format!(
                    "{}: `{module}` ({}) imports `{}` ({}), a layer above it: move what both need down (src/vocab/ for shared types)",
                    place(i),
                    LAYERS[own].0,
                    i.to,
                    LAYERS[theirs].0
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "\n{}\n", wrong.join("\n"));
}

#[test]
fn no_import_cycle_spans_two_top_level_modules() {
    let graph = import_graph();
    let edges: BTreeMap<&str, BTreeSet<&str>> = graph
        .iter()
        .map(|(m, is)| {
            let to = is
                .iter()
                .map(|i| i.to.as_str())
                .filter(|t| graph.contains_key(*t))
                .collect();
            (m.as_str(), to)
        })
        .collect();
    // A cycle through `from` exists when `from` is reachable from one of its imports.
    for from in edges.keys() {
        let mut path_to: BTreeMap<&str, &str> = BTreeMap::new();
        let mut todo: Vec<&str> = edges[from].iter().copied().collect();
        for t in &todo {
            path_to.insert(t, from);
        }
        while let Some(m) = todo.pop() {
            if m == *from {
                let mut cycle = vec![*from];
                let mut at = path_to[from];
                while at != *from {
                    cycle.push(at);
                    at = path_to[at];
                }
                cycle.push(from);
                cycle.reverse();
                let evidence: Vec<String> = cycle
                    .windows(2)
                    .map(|w| {
                        let i = graph[w[0]].iter().find(|i| i.to == w[1]).unwrap();
                        format!("  {} -> {} at {}", w[0], w[1], place(i))
                    })
                    .collect();
                panic!(
                    "import cycle {}:\n{}",
                    cycle.join(" -> "),
                    evidence.join("\n")
                );
            }
            for next in edges.get(m).into_iter().flatten() {
                if !path_to.contains_key(next) {
                    path_to.insert(next, m);
                    todo.push(next);
                }
            }
        }
    }
}

/// The reader finds what it must, so the two tests above cannot pass by reading nothing.
#[test]
fn the_reader_sees_uses_groups_inline_paths_and_climbs() {
    let src = r#"
use crate::plan::Plan;
use crate::{topology::Topology, vocab::{Role, Service}};
// use crate::commented::Out;
/// [`crate::doc_link::Out`]
fn f() -> String { let _ = crate::gpu::detect(); "crate::in_a_string::Out".into() }
use super::sibling::X;
mod tests {
    use super::*;
}
"#;
    let heads: Vec<String> = references(src, 2).into_iter().map(|(_, m)| m).collect();
    assert_eq!(heads, ["plan", "topology", "vocab", "gpu"]);
    // From a file right under src/, `super::` is the crate root: its next segment is a
    // top-level module. Inside its inline `mod tests`, `super::` is the file itself.
    let heads: Vec<String> = references(src, 1).into_iter().map(|(_, m)| m).collect();
    assert_eq!(heads, ["plan", "topology", "vocab", "gpu", "sibling"]);

    let graph = import_graph();
    assert!(graph.len() >= 15, "{:?}", graph.keys().collect::<Vec<_>>());
    let imports = |m: &str, to: &str| graph[m].iter().any(|i| i.to == to);
    assert!(
        imports("cli", "plan") && imports("supervisor", "vocab") && imports("plan", "topology")
    );
}
