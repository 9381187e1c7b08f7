//! The proxies under test: a release `pdctl proxy` of this build, and optionally one of a
//! baseline binary (`PROXY_BENCH_BASELINE=/path/to/pdctl`) run side by side with it against
//! the same engines, so a change is judged against its predecessor in one run. Also reads a
//! process's CPU time from /proc.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `pdctl proxy` (killed on drop).
pub struct ProxyUnderTest {
    /// Its name in the tables ("this build", "baseline").
    pub label: &'static str,
    /// Base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    child: Child,
}

impl Drop for ProxyUnderTest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ProxyUnderTest {
    /// CPU time the proxy process has used so far.
    pub fn cpu(&self) -> CpuTime {
        CpuTime::of(self.child.id())
    }
}

/// The binaries to run proxies from: this build, then the baseline if one is given.
pub fn binaries() -> Vec<(&'static str, String)> {
    let mut v = vec![("this build", env!("CARGO_BIN_EXE_pdctl").to_string())];
    if let Ok(b) = std::env::var("PROXY_BENCH_BASELINE") {
        v.push(("baseline", b));
    }
    v
}

/// Starts `bin proxy` (two-step) in front of one prefill and one decode port.
pub fn start(label: &'static str, bin: &str, prefill: u16, decode: u16) -> ProxyUnderTest {
    let port = super::engines::free_port();
    let log = std::env::var("PROXY_BENCH_LOG").unwrap_or_else(|_| "info".into());
    let mut cmd = Command::new(bin);
    if let Ok(n) = std::env::var("PROXY_BENCH_WORKERS") {
        cmd.env("TOKIO_WORKER_THREADS", n);
    }
    let child = cmd
        .args(["proxy", "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prefill", &format!("127.0.0.1:{prefill}")])
        .args(["--decode", &format!("127.0.0.1:{decode}")])
        .env("RUST_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin} proxy: {e}"));
    let proxy = ProxyUnderTest {
        label,
        url: format!("http://127.0.0.1:{port}"),
        child,
    };
    super::engines::wait_listening(port, &format!("the proxy ({bin})"));
    proxy
}

/// CPU time of a process: the total with nanosecond resolution (the sum over its threads
/// of /proc/PID/task/TID/schedstat; the proxy's runtime threads live as long as it does),
/// and the user / system split in clock ticks (/proc/PID/stat, 10 ms resolution).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuTime {
    pub total: Duration,
    pub user_ticks: u64,
    pub system_ticks: u64,
}

impl CpuTime {
    /// Reads the CPU time `pid` has used so far (zero if it cannot be read).
    pub fn of(pid: u32) -> CpuTime {
        let mut total_ns = 0u64;
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
                total_ns += stat
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name (which is in parentheses): utime and stime are 14 and 15.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let tick = |i: usize| fields.get(i).and_then(|v| v.parse().ok()).unwrap_or(0);
        CpuTime {
            total: Duration::from_nanos(total_ns),
            user_ticks: tick(11),
            system_ticks: tick(12),
        }
    }

    /// The CPU time used between `earlier` and `self`.
    pub fn since(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            total: self.total.saturating_sub(earlier.total),
            user_ticks: self.user_ticks.saturating_sub(earlier.user_ticks),
            system_ticks: self.system_ticks.saturating_sub(earlier.system_ticks),
        }
    }

    /// Adds two spans of CPU time.
    pub fn plus(self, other: CpuTime) -> CpuTime {
        CpuTime {
            total: self.total + other.total,
            user_ticks: self.user_ticks + other.user_ticks,
            system_ticks: self.system_ticks + other.system_ticks,
        }
    }

    /// The share of it spent in the kernel, in percent.
    pub fn system_percent(self) -> f64 {
        let all = (self.user_ticks + self.system_ticks).max(1);
        self.system_ticks as f64 * 100.0 / all as f64
    }
}
