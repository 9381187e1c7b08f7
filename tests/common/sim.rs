//! Helpers for the simulator's tests: a `pdctl sim` process on a free port with its log
//! captured, JSON/SSE requests, and metric lookups.
#![allow(dead_code)]

use crate::common::strip_ansi;
use crate::common::{ChildGuard, TempDir, free_port, pdctl_bin};
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A running `pdctl sim`, killed when dropped.
pub struct SimProc {
    pub child: ChildGuard,
    pub port: u16,
    pub base: String,
    log: PathBuf,
    _dir: TempDir,
}

impl SimProc {
    /// Starts `pdctl sim --port P <args>` and waits until it answers /version.
    pub async fn start(args: &[&str]) -> SimProc {
        Self::start_on(free_port(), args).await
    }

    /// Starts a sim with these latencies in ms (per prompt token, per request, per output
    /// token) and the flags in `more`.
    pub async fn timed(
        prefill_per_token: &str,
        overhead: &str,
        itl: &str,
        more: &[&str],
    ) -> SimProc {
        let mut args = vec![
            "--prefill-ms-per-token",
            prefill_per_token,
            "--overhead-ms",
            overhead,
            "--itl-ms",
            itl,
        ];
        args.extend_from_slice(more);
        Self::start(&args).await
    }

    /// Same, on a given port.
    pub async fn start_on(port: u16, args: &[&str]) -> SimProc {
        let mut argv = vec!["--port".to_string(), port.to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        Self::start_argv(port, &argv).await
    }

    /// Starts `pdctl sim <argv>` where `argv` names its own `--port port` (a command line
    /// the planner wrote) and waits until it answers /version.
    pub async fn start_argv(port: u16, argv: &[String]) -> SimProc {
        let dir = TempDir::new("sim");
        let log = dir.path().join("sim.log");
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(pdctl_bin());
        cmd.arg("sim").args(argv);
        cmd.env("RUST_LOG", "info").env("NO_COLOR", "1");
        // A key in the caller's environment would guard every /v1 route.
        cmd.env_remove("VLLM_API_KEY");
        cmd.stdout(Stdio::null()).stderr(file);
        let child = ChildGuard(cmd.spawn().expect("spawn pdctl sim"));
        let mut sim = SimProc {
            child,
            port,
            base: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = client().get(sim.url("/version")).send().await {
                if r.status().is_success() {
                    return sim;
                }
            }
            if let Ok(Some(status)) = sim.child.0.try_wait() {
                panic!("pdctl sim exited early ({status}):\n{}", sim.log());
            }
            assert!(
                Instant::now() < end,
                "pdctl sim did not start:\n{}",
                sim.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Everything the sim logged so far (ANSI colours stripped).
    pub fn log(&self) -> String {
        let raw = std::fs::read_to_string(&self.log).unwrap_or_default();
        strip_ansi(&raw)
    }

    /// Waits up to `timeout` for `needle` to appear in the log.
    pub async fn wait_log(&self, needle: &str, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if self.log().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.log().contains(needle)
    }

    /// POSTs JSON and returns status and parsed body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string()).await
    }

    /// POSTs raw bytes as JSON.
    pub async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let r = client()
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// GETs a path and returns status and text.
    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = client().get(self.url(path)).send().await.expect("request");
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// The sum of every sample of metric `name` (any labels).
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        metric_in(&text, name).unwrap_or_else(|| panic!("metric {name} not exposed:\n{text}"))
    }

    /// Waits up to 10 s for metric `name` to read `want`; fails showing the sim's log.
    pub async fn wait_metric(&self, name: &str, want: f64) {
        let wait = Duration::from_secs(10);
        let seen = crate::common::eventually(wait, || async { self.metric(name).await == want });
        assert!(seen.await, "{name} is not {want}; log:\n{}", self.log());
    }

    /// The sim's `vllm:prompt_tokens_by_source_total` for one `source` label value
    /// (`local_compute`, `local_cache_hit`, `external_kv_transfer`).
    pub async fn prompt_tokens(&self, source: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        prompt_tokens_in(&text, source)
            .unwrap_or_else(|| panic!("no prompt tokens with source={source}:\n{text}"))
    }

    /// Waits up to `timeout` for the process to exit; its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.0.try_wait() {
                return Some(s.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// A client with a generous overall timeout (no test may hang).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The sum of the samples of `name` in a Prometheus text exposition.
pub fn metric_in(text: &str, name: &str) -> Option<f64> {
    pdctl::prometheus::sum(text, &[name])
}

/// The summed `vllm:prompt_tokens_by_source_total` samples labelled `source` on a page.
pub fn prompt_tokens_in(text: &str, source: &str) -> Option<f64> {
    pdctl::prometheus::samples(text)
        .filter(|s| s.name == "vllm:prompt_tokens_by_source_total")
        .filter(|s| pdctl::prometheus::label_value(s.labels, "source").as_deref() == Some(source))
        .map(|s| s.value)
        .reduce(|a, b| a + b)
}

/// The `data:` payloads of an SSE body, in order (`[DONE]` kept as a string).
pub fn sse_events(body: &str) -> Vec<Value> {
    pdctl::sse::data_of(body.as_bytes())
        .into_iter()
        .map(|d| serde_json::from_str(&d).unwrap_or(Value::String(d)))
        .collect()
}

/// A prompt of exactly `n` tokens under the sim's tokenizer (`n` distinct words).
pub fn prompt_of(n: usize, tag: &str) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}
