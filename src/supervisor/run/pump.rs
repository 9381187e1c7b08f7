//! Moving a service's output from its pipe to its log file, its recent-lines memory, the
//! foreground terminal, and the log-line readiness probe.

use crate::supervisor::run::console::Console;
use crate::supervisor::state_dir::logfile::{LineSplitter, ServiceLog};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::io::AsyncReadExt;

/// Where one run's output goes besides the file.
#[derive(Debug, Clone)]
pub struct PumpTargets {
    pub log: Arc<ServiceLog>,
    pub console: Console,
    /// Index of the service (colour and name on the console).
    pub idx: usize,
    /// Its name, printed before each line on the console.
    pub name: String,
    /// Text of a `LogLine` probe, and the flag set when a line contains it.
    pub watch_for: Option<(String, Arc<AtomicBool>)>,
    /// Woken on every chunk of output (a readiness probe may be due).
    pub activity: Arc<tokio::sync::Notify>,
}

/// Reads `output` until every writer closed it (the service and all its children).
pub async fn pump(mut output: tokio::net::unix::pipe::Receiver, to: PumpTargets) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut split = LineSplitter::default();
    loop {
        match output.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                to.log.append(&buf[..n]);
                for line in split.feed(&buf[..n]) {
                    handle_line(&to, &line);
                }
                // After the lines: a log-line probe woken by this sees its flag set.
                to.activity.notify_one();
            }
        }
    }
    if let Some(rest) = split.rest() {
        handle_line(&to, &rest);
    }
}

fn handle_line(to: &PumpTargets, line: &str) {
    if let Some((text, seen)) = &to.watch_for {
        if line.contains(text.as_str()) {
            seen.store(true, Ordering::Relaxed);
        }
    }
    to.log.remember(line);
    to.console.service_line(to.idx, &to.name, line);
}
