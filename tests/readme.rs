//! The README's runnable examples, run as written, so the two cannot drift apart.
//!
//! README.md marks what is checked with HTML comments (invisible when rendered):
//! `<!-- readme-test: file NAME -->` before a ```toml block writes it as NAME;
//! `<!-- readme-test: run ... -->` before a console block runs each `$ pdctl ...` line and
//! wants its output exactly as shown; `tour` and `experiment` mark the two longer transcripts,
//! checked for what a reader relies on (names, ports, answers, file names), not for PIDs
//! and timings.

use crate::common;

use common::{TempDir, pdctl_bin};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;

/// The tour and the experiment use the profiles' fixed ports: one at a time.
static FIXED_PORTS: Mutex<()> = Mutex::new(());

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
}

/// A marked block: the marker's words and the block's lines (fences removed).
struct Block {
    marker: String,
    lines: Vec<String>,
}

fn marked_blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if let Some(m) = lines[i]
            .strip_prefix("<!-- readme-test: ")
            .and_then(|r| r.strip_suffix(" -->"))
        {
            let open = lines[i + 1..]
                .iter()
                .position(|l| l.starts_with("```"))
                .map(|p| i + 1 + p)
                .unwrap_or_else(|| panic!("marker `{m}` has no block after it"));
            let close = lines[open + 1..]
                .iter()
                .position(|l| l.starts_with("```"))
                .map(|p| open + 1 + p)
                .unwrap_or_else(|| panic!("block after `{m}` is not closed"));
            out.push(Block {
                marker: m.to_string(),
                lines: lines[open + 1..close]
                    .iter()
                    .map(|l| l.to_string())
                    .collect(),
            });
            i = close;
        }
        i += 1;
    }
    out
}

/// pdctl on PATH first, blind to this machine's vLLM and GPUs, with its own state root.
fn shell(dir: &Path, state: &Path, script: &str) -> Output {
    let bin_dir = pdctl_bin().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .args(["-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .env(pdctl::vllm::IGNORE_INSTALLED_ENV, "1")
        .env("PDCTL_STATE_DIR", state)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every `run` block's commands print exactly the lines the README shows after them, on
/// the files the `file` blocks before them wrote.
#[test]
fn the_readme_error_examples_print_what_it_shows() {
    let dir = TempDir::new("readme-errors");
    let state = TempDir::new("readme-errors-state");
    let blocks = marked_blocks(&readme());
    let mut runs = 0;
    for b in &blocks {
        if let Some(name) = b.marker.strip_prefix("file ") {
            std::fs::write(dir.path().join(name), b.lines.join("\n") + "\n").unwrap();
            continue;
        }
        let Some(how) = b.marker.strip_prefix("run") else {
            continue;
        };
        // The one edit the README describes in words rather than showing.
        let edit = how.trim() == "after misspelling prefill.instances in demo.toml";
        assert!(edit || how.is_empty(), "unknown marker `{}`", b.marker);
        let demo = dir.path().join("demo.toml");
        let original = std::fs::read_to_string(&demo).unwrap();
        if edit {
            let at = original
                .find("[prefill]\ninstances")
                .expect("demo.toml has [prefill]");
            let mut bad = original.clone();
            bad.replace_range(at..at + "[prefill]\ninstances".len(), "[prefill]\ninstnces");
            std::fs::write(&demo, bad).unwrap();
        }
        let (command, shown) = b.lines.split_first().unwrap();
        let command = command
            .strip_prefix("$ ")
            .expect("a run block starts with `$ `");
        let out = shell(dir.path(), state.path(), command);
        std::fs::write(&demo, &original).unwrap();
        let got = text(&out);
        assert_eq!(
            got.lines().collect::<Vec<_>>(),
            shown.iter().map(String::as_str).collect::<Vec<_>>(),
            "README's `{command}` prints something else"
        );
        assert_eq!(out.status.code(), Some(2), "`{command}`: {got}");
        runs += 1;
    }
    assert_eq!(runs, 3, "the README's error examples were not all found");
}

/// The tour: `up -p sim-4p4d -d` prints the table it shows, the curl gets the answer it
/// shows (the simulator is deterministic per prompt), `logs decode` is prefixed per
/// instance, and `down` stops the 11 services.
#[test]
fn the_readme_tour_runs_as_shown() {
    let _ports = FIXED_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    let blocks = marked_blocks(&readme());
    let tour = &blocks.iter().find(|b| b.marker == "tour").unwrap().lines;
    let dir = TempDir::new("readme-tour");
    let state = TempDir::new("readme-tour-state");
    let commands: Vec<&String> = tour.iter().filter(|l| l.starts_with("$ ")).collect();
    assert_eq!(
        commands[0], "$ pdctl up -p sim-4p4d -d",
        "the tour starts elsewhere"
    );

    let up = shell(dir.path(), state.path(), "pdctl up -p sim-4p4d -d");
    let down_guard = Down(dir.path().to_path_buf(), state.path().to_path_buf());
    let got = text(&up);
    assert_eq!(up.status.code(), Some(0), "{got}");
    // The lines the README shows in full appear in the output as they are.
    for line in tour.iter().take_while(|l| !l.starts_with("$ curl")) {
        if line.starts_with("$ ") || line == "..." || line.is_empty() {
            continue;
        }
        let columns = |l: &str| -> Vec<String> {
            // PID, uptime, CPU and memory vary; every other column must be as shown.
            let mut c: Vec<String> = l.split_whitespace().map(str::to_string).collect();
            if c.len() == 13 && c[3].chars().all(|ch| ch.is_ascii_digit()) {
                c[3] = "PID".into();
                c[8] = "UPTIME".into();
                c[9] = "CPU".into();
                c[10] = "MEM".into();
            }
            if l.starts_with("cluster sim-4p4d is up") {
                c.truncate(6);
            }
            c
        };
        assert!(
            got.lines().any(|g| columns(g) == columns(line)),
            "README shows `{line}`, up printed:\n{got}"
        );
    }

    // The curl line: the README's request body, its answer's text and usage.
    let body_line = tour.iter().find(|l| l.contains("-d '")).unwrap();
    let body: Value = serde_json::from_str(
        body_line
            .split("-d '")
            .nth(1)
            .unwrap()
            .trim_end_matches('\''),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answer: Value = rt.block_on(async {
        reqwest::Client::new()
            .post("http://127.0.0.1:8000/v1/completions")
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    let shown_text = tour
        .iter()
        .find_map(|l| l.split("\"text\":\"").nth(1))
        .and_then(|r| r.split('"').next())
        .unwrap();
    assert_eq!(answer["choices"][0]["text"], shown_text, "{answer}");
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["usage"]["prompt_tokens"], 4);
    assert_eq!(answer["usage"]["completion_tokens"], 12);

    let logs = shell(dir.path(), state.path(), "pdctl logs decode -n 1");
    let logs = text(&logs);
    let prefixes: Vec<&str> = logs.lines().map(|l| &l[..11.min(l.len())]).collect();
    assert_eq!(
        prefixes,
        ["decode-0 | ", "decode-1 | ", "decode-2 | ", "decode-3 | "],
        "{logs}"
    );

    drop(down_guard);
    let down = shell(dir.path(), state.path(), "pdctl status");
    assert_eq!(down.status.code(), Some(3), "the cluster outlived down");
}

/// Runs `pdctl down` when dropped, and checks what it printed against the tour.
struct Down(std::path::PathBuf, std::path::PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        let out = shell(&self.0, &self.1, "pdctl down");
        if !std::thread::panicking() {
            assert!(
                text(&out).starts_with("pdctl: stopped 11 service(s) of cluster sim-4p4d in "),
                "{}",
                text(&out)
            );
        }
    }
}

/// The prefix-caching experiment's commands, as written but with fewer prompts: every
/// command succeeds and `--compare` reads the files the loop wrote, labelled as shown.
#[test]
fn the_readme_prefix_caching_experiment_runs() {
    let _ports = FIXED_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    let blocks = marked_blocks(&readme());
    let lines = &blocks
        .iter()
        .find(|b| b.marker == "experiment")
        .unwrap()
        .lines;
    let dir = TempDir::new("readme-experiment");
    let state = TempDir::new("readme-experiment-state");
    std::fs::create_dir(dir.path().join("examples")).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/prefix-caching.toml"),
        dir.path().join("examples/prefix-caching.toml"),
    )
    .unwrap();
    // The commands: `$ ` lines with the lines that continue them.
    let mut script = String::from("set -e\n");
    let mut in_command = false;
    for l in lines {
        if let Some(c) = l.strip_prefix("$ ") {
            script.push_str(c);
            script.push('\n');
            in_command = c.ends_with('\\') || c.ends_with("; do");
        } else if in_command {
            script.push_str(l);
            script.push('\n');
            in_command = l.ends_with('\\') || l.trim_end().ends_with("; do");
        }
    }
    assert!(script.contains("--num-prompts 90"), "{script}");
    let script = script.replace("--num-prompts 90", "--num-prompts 6");
    let out = shell(dir.path(), state.path(), &script);
    let down = shell(dir.path(), state.path(), "pdctl down");
    let got = text(&out);
    assert_eq!(out.status.code(), Some(0), "{script}\n{got}");
    assert_eq!(down.status.code(), Some(0), "{}", text(&down));
    // The header row of --compare, as the README shows it.
    let header = lines
        .iter()
        .find(|l| l.trim_start().starts_with("designate"))
        .unwrap();
    let labels: Vec<&str> = header.split_whitespace().collect();
    assert!(
        got.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == labels),
        "no `{header}` in:\n{got}"
    );
    assert!(dir.path().join("strategies.svg").exists());
}
