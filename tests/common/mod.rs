//! Helpers shared by the integration tests: free ports, the pdctl binary, child processes
//! that are killed when a test ends (even when it fails).
#![allow(dead_code)]

pub mod hub;
pub mod netns;
pub mod proxy;
pub mod sim;
pub mod supervisor;
pub mod svg;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The pdctl binary cargo built for these tests.
pub fn pdctl_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pdctl"))
}

/// A `Command` for pdctl with the given arguments, blind to what this machine has
/// installed: no vLLM lookup on PATH or in pdctl's venvs, no NVML (`PDCTL_IGNORE_INSTALLED`),
/// and a state root of the test run's own instead of the developer's ~/.local/state. A
/// test that wants detection builds a fake interpreter and names it in engine.python; one
/// that wants GPUs passes `--gpus`; one that wants the real machine removes the variable.
pub fn pdctl(args: &[&str]) -> Command {
    let mut c = Command::new(pdctl_bin());
    c.args(args)
        .env(pdctl::vllm::IGNORE_INSTALLED_ENV, "1")
        .env("XDG_STATE_HOME", test_state_home());
    c
}

/// The arguments of `pdctl bench` against `url`: `prompts` requests of `input_len`
/// tokens in and `output_len` out, `concurrency` at a time, its JSON report in `json`.
pub fn bench_args(
    url: &str,
    prompts: usize,
    concurrency: usize,
    (input_len, output_len): (usize, usize),
    json: &std::path::Path,
) -> Vec<String> {
    let mut args: Vec<String> = ["bench", "--url", url].map(String::from).to_vec();
    for (flag, n) in [
        ("--num-prompts", prompts),
        ("--max-concurrency", concurrency),
        ("--input-len", input_len),
        ("--output-len", output_len),
    ] {
        args.extend([flag.to_string(), n.to_string()]);
    }
    args.extend(["--json".to_string(), json.display().to_string()]);
    args
}

/// The state root pdctl falls back to in tests (one per test binary run).
pub fn test_state_home() -> PathBuf {
    std::env::temp_dir().join(format!("pdctl-test-xdg-{}", std::process::id()))
}

/// A TCP port free on 127.0.0.1 right now (the OS picks it; reuse soon after is unlikely).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

/// `n` distinct free ports.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// A child process killed (SIGKILL) when dropped, so a failing test leaves nothing behind.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `check` every 20 ms until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// A fresh temporary directory removed when dropped.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory named after the test (`pdctl-test-TAG-XXXXXX`), removed on drop.
    pub fn new(tag: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pdctl-test-{tag}-"))
            .tempdir()
            .expect("a temporary directory");
        TempDir(dir)
    }
    pub fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// `text` without ANSI escape sequences (ESC [ ... letter).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for n in chars.by_ref() {
                if n.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Polls an async condition every 20 ms until true or `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client for the tests' own requests, with a generous overall timeout (no test may hang).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The body of a GET of `url`, as text; panics naming the URL when the request fails.
pub async fn get_text(url: &str) -> String {
    let resp = http()
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    resp.text().await.unwrap()
}

/// The body of a GET of `url`, as JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    let text = get_text(url).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {url}: {e}: {text}"))
}

/// The text of the first choice of a whole chat answer.
pub fn chat_text(answer: &serde_json::Value) -> &str {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no chat text in {answer}"))
}

/// The JSON array of strings `items` as `&str`s, in order.
pub fn strs(items: &serde_json::Value) -> Vec<&str> {
    let items = items.as_array().expect("a JSON array");
    items.iter().map(|i| i.as_str().unwrap()).collect()
}

/// The string `field` of every element of the JSON array `items`, in order.
pub fn field_strs<'a>(items: &'a serde_json::Value, field: &str) -> Vec<&'a str> {
    let items = items.as_array().expect("a JSON array");
    items.iter().map(|i| i[field].as_str().unwrap()).collect()
}

/// Runs `cmd` to its end and returns its stdout; it must succeed (a failure shows both
/// its streams).
pub fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().expect("the command starts");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
