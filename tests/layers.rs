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
        &[
            "error_text",
            "spelling",
            "prometheus",
            "sse",
            "allocator",
            "backoff",
            "constant_time",
            "stall_clock",
        ],
    ),
    ("vocabulary several layers share", &["vocab"]),
    (
        "what this machine has",
        &["tools", "vllm", "gpu", "model_files", "model_fetch"],
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
    (
        "the live page of a running cluster (reads what the running parts serve)",
        &["dashboard"],
    ),
    (
        "pictures of what the layers below measured and kept (above ops: it never draws)",
        &["pictures"],
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

/// The first position at or after `at` that is not whitespace.
fn skip_ws(s: &str, at: usize) -> usize {
    at + (s[at..].len() - s[at..].trim_start().len())
}

/// The paths written at `at` (after a `crate::`, `super::` or `self::`), a `{...}` group
/// expanded into one path per item, as segments (`*` and turbofish end a path).
fn tails(s: &str, at: usize) -> Vec<Vec<String>> {
    let b = s.as_bytes();
    let at = skip_ws(s, at);
    if b.get(at) == Some(&b'{') {
        let (mut depth, mut i, mut item_start) = (0usize, at, at + 1);
        let mut out = Vec::new();
        while i < b.len() {
            match b[i] {
                b'{' => depth += 1,
                b'}' | b',' if depth == 1 => {
                    if !s[item_start..i].trim().is_empty() {
                        out.extend(tails(s, item_start));
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
        return out;
    }
    let head = ident_at(s, at);
    if head.is_empty() {
        return vec![Vec::new()];
    }
    let next = skip_ws(s, at + head.len());
    if !s[next..].starts_with("::") {
        return vec![vec![head.to_string()]];
    }
    tails(s, next + 2)
        .into_iter()
        .map(|mut t| {
            t.insert(0, head.to_string());
            t
        })
        .collect()
}

/// Every path `src` (the text of the file of module `own`, e.g. `["proxy", "config"]`)
/// names through `crate::`, `super::` or `self::`, made absolute (segments from the crate
/// root), with the byte offset where it is written. `use` lines, groups such as
/// `use crate::{a::B, c::{D, E}}` and paths inside code all count; comments, strings and
/// doc links do not.
fn paths(src: &str, own: &[String]) -> Vec<(usize, Vec<String>)> {
    let s = strip(src);
    let b = s.as_bytes();
    let mut out = Vec::new();
    // Inline modules (`mod tests { ... }`) open at a brace depth; `super::` inside one
    // climbs out of it first, `self::` names it.
    let mut braces = 0usize;
    let mut inline: Vec<(usize, String)> = Vec::new();
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
                if inline.last().is_some_and(|(d, _)| *d == braces) {
                    inline.pop();
                }
                braces = braces.saturating_sub(1);
                i += 1;
                continue;
            }
            _ => {}
        }
        if boundary(i) && s[i..].starts_with("mod ") {
            let name_at = skip_ws(&s, i + 4);
            let name = ident_at(&s, name_at);
            let after = s[name_at + name.len()..].trim_start();
            if after.starts_with('{') {
                inline.push((braces + 1, name.to_string()));
            }
        }
        let here: Vec<String> = own
            .iter()
            .cloned()
            .chain(inline.iter().map(|(_, n)| n.clone()))
            .collect();
        let (path_at, base) = if boundary(i) && s[i..].starts_with("crate::") {
            (i + "crate::".len(), Vec::new())
        } else if boundary(i) && s[i..].starts_with("self::") {
            (i + "self::".len(), here)
        } else if boundary(i) && s[i..].starts_with("super::") {
            let mut j = i;
            let mut k = 0;
            while s[j..].starts_with("super::") {
                j += "super::".len();
                k += 1;
            }
            (j, here[..here.len().saturating_sub(k)].to_vec())
        } else {
            i += 1;
            continue;
        };
        for tail in tails(&s, path_at) {
            let mut path = base.clone();
            path.extend(tail.into_iter().filter(|seg| seg != "self"));
            out.push((i, path));
        }
        i = path_at;
    }
    out
}

/// The top-level modules `src` (the text of a file of module `own`) refers to outside its
/// own, with the byte offset of each reference.
fn references_of(src: &str, own: &[String]) -> Vec<(usize, String)> {
    let mut heads: Vec<(usize, String)> = paths(src, own)
        .into_iter()
        .filter_map(|(at, p)| Some((at, p.into_iter().next()?)))
        .filter(|(_, head)| Some(head) != own.first())
        .collect();
    // One group (`crate::vocab::{Role, Service}`) is one reference of its module.
    heads.dedup();
    heads
}

/// [`references_of`] for a file `depth` modules below the crate root (the reader's test).
fn references(src: &str, depth: usize) -> Vec<(usize, String)> {
    let own: Vec<String> = (0..depth).map(|d| format!("<own {d}>")).collect();
    references_of(src, &own)
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

/// The module path of a file under `src/` (`src/proxy/config.rs` and
/// `src/proxy/config/mod.rs`: `["proxy", "config"]`); None for the crate root.
fn module_of(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        return None;
    }
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Some(parts)
}

/// Every source file of the library: its module path, its path from the repository root,
/// and its text.
fn source_files() -> Vec<(Vec<String>, PathBuf, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|file| {
            let module = module_of(&src, &file)?;
            let text = std::fs::read_to_string(&file).expect("a source file is readable");
            let shown = file
                .strip_prefix(src.parent().unwrap())
                .unwrap()
                .to_path_buf();
            Some((module, shown, text))
        })
        .collect()
}

/// module -> the imports its files make of other top-level modules.
fn import_graph() -> BTreeMap<String, Vec<Import>> {
    let mut graph: BTreeMap<String, Vec<Import>> = BTreeMap::new();
    for (own, file, text) in source_files() {
        let imports = graph.entry(own[0].clone()).or_default();
        for (at, to) in references_of(&text, &own) {
            imports.push(Import {
                file: file.clone(),
                line: text[..at].matches('\n').count() + 1,
                to,
            });
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

/// docs/ARCHITECTURE.md is the map of `src/`: every top-level module the source has is
/// named there as `src/NAME`, so a new one cannot be added without its place on the map.
#[test]
fn every_top_level_module_is_on_the_architecture_map() {
    let map =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md"))
            .expect("docs/ARCHITECTURE.md is readable");
    let missing: Vec<String> = import_graph()
        .keys()
        .filter(|m| {
            !(map.contains(&format!("src/{m}/"))
                || map.contains(&format!("src/{m}.rs"))
                || map.contains(&format!("src/{m}`")))
        })
        .map(|m| format!("src/{m}"))
        .collect();
    assert!(
        missing.is_empty(),
        "not on the map in docs/ARCHITECTURE.md (name each as `src/NAME/` or `src/NAME.rs`): {}",
        missing.join(", ")
    );
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

/// File -> the files it imports, each with where (the first place it does). A reference
/// counts when a `crate::`, `super::` or `self::` path leads into another file's module;
/// a file's own ancestors (the `mod.rs` files that declare it, up to the crate root) do
/// not count: a child using what its folder's `mod.rs` holds is how a folder is built, and
/// the folder's tangles are between its files.
fn file_graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let files = source_files();
    let known: BTreeSet<Vec<String>> = files.iter().map(|(m, _, _)| m.clone()).collect();
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (own, file, text) in &files {
        let edges = graph.entry(own.join("/")).or_default();
        for (at, path) in paths(text, own) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|n| &path[..n])
                .find(|p| known.contains(*p))
            else {
                continue;
            };
            if own.starts_with(target) {
                continue; // itself or an ancestor
            }
            let line = text[..at].matches('\n').count() + 1;
            edges
                .entry(target.join("/"))
                .or_insert_with(|| format!("{}:{line}", file.display()));
        }
    }
    graph
}

/// The strongly connected parts of `graph` with more than one node: each a set of nodes
/// every one of which reaches every other (Tarjan's algorithm).
fn cycles<V>(graph: &BTreeMap<String, BTreeMap<String, V>>) -> Vec<BTreeSet<String>> {
    struct Walk<'a, V> {
        graph: &'a BTreeMap<String, BTreeMap<String, V>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a, V>(w: &mut Walk<'a, V>, v: &'a str) {
        let n = w.index.len();
        w.index.insert(v, n);
        w.low.insert(v, n);
        w.stack.push(v);
        for to in w.graph[v].keys().filter(|t| w.graph.contains_key(*t)) {
            if !w.index.contains_key(to.as_str()) {
                visit(w, to);
                let l = w.low[v].min(w.low[to.as_str()]);
                w.low.insert(v, l);
            } else if w.stack.contains(&to.as_str()) {
                let l = w.low[v].min(w.index[to.as_str()]);
                w.low.insert(v, l);
            }
        }
        if w.low[v] == w.index[v] {
            let mut part = BTreeSet::new();
            while let Some(top) = w.stack.pop() {
                part.insert(top.to_string());
                if top == v {
                    break;
                }
            }
            if part.len() > 1 {
                w.out.push(part);
            }
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !w.index.contains_key(v.as_str()) {
            visit(&mut w, v);
        }
    }
    w.out
}

/// No two files of `src/` import each other, directly or round a longer loop: the two
/// two-file tangles once allowed here (plan's resolve and source, the supervisor's members
/// and service task) are undone, and there is no list of allowed ones to grow back.
#[test]
fn no_import_cycle_between_files() {
    let graph = file_graph();
    let found = cycles(&graph);
    let mut wrong = Vec::new();
    for part in &found {
        let evidence: Vec<String> = part
            .iter()
            .flat_map(|from| {
                graph[from]
                    .iter()
                    .filter(|(to, _)| part.contains(*to))
                    .map(move |(to, at)| format!("    {from} -> {to} at {at}"))
            })
            .collect();
        wrong.push(format!(
            "import cycle of {} files: {}; each imports another round a loop:\n{}\n  \
             move what they share into the lowest of them (or a new small file) so imports run one way",
            part.len(),
            part.iter().cloned().collect::<Vec<_>>().join(", "),
            evidence.join("\n")
        ));
    }
    let today: Vec<String> = found
        .iter()
        .map(|p| format!("  {}", p.iter().cloned().collect::<Vec<_>>().join(", ")))
        .collect();
    assert!(
        wrong.is_empty(),
        "\n{}\n\nthe cycles between files today:\n{}\n",
        wrong.join("\n"),
        today.join("\n")
    );
}

/// The cycle finder finds a loop of three and one of two, and nothing in a chain.
#[test]
fn the_cycle_finder_finds_loops_and_only_loops() {
    let mut g: BTreeMap<String, BTreeMap<String, ()>> = BTreeMap::new();
    for (from, to) in [
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
        ("c", "d"),
        ("d", "e"),
        ("e", "d"),
        ("e", "f"),
        ("x", "a"),
    ] {
        g.entry(from.into()).or_default().insert(to.into(), ());
        g.entry(to.into()).or_default();
    }
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let mut found = cycles(&g);
    found.sort();
    assert_eq!(found, [set(&["a", "b", "c"]), set(&["d", "e"])]);
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

    // Whole paths, made absolute: `self::` is the file (or its inline module), nested groups
    // give one path each, `self` in a group is the group's head.
    let file = "use self::child::{A, b::{C, self}};\nfn g() { super::super::top::f(); }\n";
    let own = ["m".to_string(), "n".to_string(), "o".to_string()];
    let got: Vec<String> = paths(file, &own)
        .into_iter()
        .map(|(_, p)| p.join("::"))
        .collect();
    assert_eq!(
        got,
        [
            "m::n::o::child::A",
            "m::n::o::child::b::C",
            "m::n::o::child::b",
            "m::top::f"
        ]
    );
    let files = file_graph();
    assert!(
        files["bench/runner"].contains_key("bench/args")
            && files["cli/tune"].contains_key("tune/choose"),
        "{files:?}"
    );

    let graph = import_graph();
    assert!(graph.len() >= 15, "{:?}", graph.keys().collect::<Vec<_>>());
    let imports = |m: &str, to: &str| graph[m].iter().any(|i| i.to == to);
    assert!(
        imports("cli", "plan") && imports("supervisor", "vocab") && imports("plan", "topology")
    );
}

/// The layers of `src/proxy/`, lowest first, each with the files (module paths under
/// `proxy/`; a folder stands for all its files but those listed on their own) it holds.
/// A file may import from its own layer and the layers below, never from one above, so a
/// reader follows a request from `server.rs` to the engines without opening membership or
/// metrics code, and the figures read from below. The proxy's `mod.rs` is its root: it
/// wires the layers together and stands above them (like `lib.rs` above `LAYERS`). Test
/// modules (`#[cfg(test)] mod tests`) may use any layer: they check a file together with
/// what reads it.
const PROXY_LAYERS: &[(&str, &[&str])] = &[
    (
        "shared words: legs, errors, endpoints, and the recorder the figures are told through",
        &["leg", "endpoint", "errors", "recorder"],
    ),
    (
        "membership and settings: the instances and what keeps them known, the routing settings",
        &[
            "instances",
            "reach",
            "engine_run",
            "health",
            "discovery",
            "config",
            "tuning",
            "policy",
            "recompute/ledger",
            "recompute/counters",
        ],
    ),
    (
        "the request path: from the route to the engines and back",
        &[
            "server",
            "limits",
            "request",
            "designate",
            "pipeline",
            "legs",
            "protocol",
            "h1",
            "upstream",
            "usage_chunk",
            "recompute/judgment",
            "relay",
            "migration",
            "whole",
            "record",
            "drain",
            "models",
            "warmup",
        ],
    ),
    (
        "the figures: counters, scrapes of the engines, the page `/metrics` writes",
        &[
            "metrics",
            "histogram",
            "figures",
            "recompute",
            "scrape",
            "transfer_failures",
            "rebalance_seen",
        ],
    ),
];

/// The layer of a module under `proxy/` (`["recompute", "judgment"]`): that of the longest
/// entry of [`PROXY_LAYERS`] it is or lies under.
fn proxy_layer_of(module: &[String]) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    for (layer, (_, entries)) in PROXY_LAYERS.iter().enumerate() {
        for entry in *entries {
            let segs: Vec<&str> = entry.split('/').collect();
            let fits = segs.len() <= module.len() && segs.iter().zip(module).all(|(a, b)| a == b);
            if fits && best.is_none_or(|(n, _)| segs.len() > n) {
                best = Some((segs.len(), layer));
            }
        }
    }
    best.map(|(_, layer)| layer)
}

/// A file's text up to its `#[cfg(test)] mod tests`.
fn without_tests(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at])
}

#[test]
fn proxy_files_import_only_their_own_layer_or_below() {
    let files = source_files();
    let known: BTreeSet<Vec<String>> = files.iter().map(|(m, _, _)| m.clone()).collect();
    let mut wrong = Vec::new();
    let mut across = 0;
    for (own, file, text) in files
        .iter()
        .filter(|(m, _, _)| m.len() > 1 && m[0] == "proxy")
    {
        let Some(mine) = proxy_layer_of(&own[1..]) else {
            wrong.push(format!(
                "{} is in no layer of proxy/: add it to PROXY_LAYERS in tests/layers.rs (and to proxy/mod.rs's `# Layout`)",
                file.display()
            ));
            continue;
        };
        let checked = without_tests(text);
        for (at, path) in paths(checked, own)
            .into_iter()
            .filter(|(_, p)| p[0] == "proxy")
        {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|n| &path[..n])
                .find(|p| known.contains(*p))
            else {
                continue;
            };
            if own.starts_with(target) {
                continue; // itself, or the folder it is in
            }
            let Some(theirs) = proxy_layer_of(&target[1..]) else {
                continue; // reported as a file of its own
            };
            if theirs != mine {
                across += 1;
            }
            if theirs > mine {
                wrong.push(format!(
                    "{}:{}: `{}` ({}) imports `{}` ({}), a layer above it: move what both need down, or reach the figures through recorder.rs",
                    file.display(),
                    checked[..at].matches('\n').count() + 1,
                    own[1..].join("/"),
                    PROXY_LAYERS[mine].0,
                    target[1..].join("/"),
                    PROXY_LAYERS[theirs].0
                ));
            }
        }
    }
    for entry in PROXY_LAYERS.iter().flat_map(|(_, es)| es.iter()) {
        let mut module = vec!["proxy".to_string()];
        module.extend(entry.split('/').map(String::from));
        if !known.contains(&module) {
            wrong.push(format!(
                "PROXY_LAYERS names proxy/{entry}, which is no module: take it out"
            ));
        }
    }
    // The reader sees the imports between layers (legs -> errors, metrics -> instances, ...).
    assert!(
        across > 40,
        "only {across} imports across proxy/'s layers found"
    );
    assert!(wrong.is_empty(), "\n{}\n", wrong.join("\n"));
}

#[test]
fn no_import_cycle_inside_proxy() {
    let graph = file_graph();
    let inside: Vec<String> = cycles(&graph)
        .into_iter()
        .filter(|part| part.iter().any(|f| f.starts_with("proxy/")))
        .map(|part| part.into_iter().collect::<Vec<_>>().join(", "))
        .collect();
    assert!(
        inside.is_empty(),
        "files of proxy/ importing one another round a loop:\n  {}",
        inside.join("\n  ")
    );
}

/// A file's layer is that of the longest entry it lies under, so a folder's files may sit
/// in different layers.
#[test]
fn proxy_layers_place_a_file_by_its_longest_entry() {
    let m = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
    assert_eq!(proxy_layer_of(&m("recompute/ledger")), Some(1));
    assert_eq!(proxy_layer_of(&m("recompute/judgment")), Some(2));
    assert_eq!(proxy_layer_of(&m("recompute/windows")), Some(3));
    assert_eq!(proxy_layer_of(&m("protocol/nixl")), Some(2));
    assert_eq!(proxy_layer_of(&m("nowhere")), None);
}
