//! Helpers shared by the integration tests: free ports, the pdctl binary, child processes
//! that are killed when a test ends (even when it fails).
#![allow(dead_code)]

pub mod gate;
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

/// Where the tests' own server ports are handed out from: below the kernel's ephemeral
/// range (`net.ipv4.ip_local_port_range`, 32768 and up by default), from which every
/// outgoing connection takes its local port. A port picked in that range and bound only
/// later (a cluster's instance that a scale adds a minute in) can meanwhile be taken by a
/// client socket of a test running beside it: seen as "the new instances cannot start
/// here" once tests ran six at a time. Each port is handed out once per test binary.
const OWN_PORTS_FROM: u16 = 10_000;

/// The first port of the kernel's ephemeral range (where the pool of own ports ends).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .filter(|low| *low > OWN_PORTS_FROM + 2_000)
        .unwrap_or(32_768)
}

/// Ports left unhanded after each run ([`own_port_run`]).
const SPARE_AFTER_RUN: u16 = 8;

/// `n` consecutive ports below the ephemeral range that no one holds now and that no other
/// test of this binary was given; where a run starts is spread by the process id, so two
/// test binaries running at once rarely meet.
pub fn own_port_run(n: u16) -> u16 {
    use std::sync::Mutex;
    static NEXT: Mutex<Option<u16>> = Mutex::new(None);
    let low = ephemeral_low();
    let span = low - OWN_PORTS_FROM;
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    let mut at =
        next.unwrap_or_else(|| OWN_PORTS_FROM + (std::process::id() as u16 % span) / 64 * 64);
    for _ in 0..span {
        if at.checked_add(n).is_none_or(|end| end > low) {
            at = OWN_PORTS_FROM;
        }
        let free = (at..at + n).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok());
        if free {
            // The ports right after a run stay unhanded: a cluster's `scale` adds its
            // instances there (base port + index), after the run was handed out.
            *next = Some(at + n + SPARE_AFTER_RUN);
            return at;
        }
        at += 1;
    }
    panic!("no run of {n} free ports between {OWN_PORTS_FROM} and {low}");
}

/// A TCP port free on 127.0.0.1 right now, handed to no other test ([`own_port_run`]).
pub fn free_port() -> u16 {
    own_port_run(1)
}

/// `n` distinct free ports.
pub fn free_ports(n: usize) -> Vec<u16> {
    (0..n).map(|_| free_port()).collect()
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

/// Polls `check` every 20 ms until it returns true or `timeout` passes, not counting the
/// time this process was frozen meanwhile ([`waited_out`]): a 2-core machine running two
/// vLLM engines froze whole for up to 100 s (the kernel logged a workqueue lockup), and
/// what the test waits on got no time either.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let over = waited_out(timeout);
    while !over() {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// Whether `timeout` has passed since this call, not counting the time this process was
/// frozen meanwhile (pdctl's own stall clock, which the supervisor and `up -d` use).
pub fn waited_out(timeout: Duration) -> impl Fn() -> bool {
    let clock = pdctl::stall_clock::clock();
    let began = Instant::now();
    move || began.elapsed() >= timeout + clock.stalled_since(began)
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

/// Polls an async condition every 20 ms until true or `timeout`, not counting the time this
/// process was frozen meanwhile.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let over = waited_out(timeout);
    loop {
        if check().await {
            return true;
        }
        if over() {
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
