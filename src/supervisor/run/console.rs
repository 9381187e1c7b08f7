//! What a supervisor prints: in the foreground, service output as `name | line` (coloured
//! on a terminal) plus its own events as `pdctl | ...`; detached, only its events with a
//! timestamp (they go to `logs/supervisor.log`).
//!
//! Printing happens on one thread fed by a bounded queue, so a stalled terminal never
//! stalls a service: lines that do not fit are counted and the count is reported.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};

const QUEUE: usize = 4096;
const PALETTE: [&str; 6] = ["36", "33", "32", "35", "34", "31"];

/// How the supervisor talks to its stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsoleMode {
    /// `pdctl up` in the foreground: stream service output once the cluster is healthy.
    Foreground { colour: bool },
    /// `pdctl supervise` behind `up -d`: timestamped events only.
    Detached,
}

/// Cheap-to-clone handle used by every service task.
#[derive(Debug, Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    mode: ConsoleMode,
    width: usize,
    streaming: AtomicBool,
    dropped: AtomicU64,
    queue: SyncSender<Msg>,
}

/// What the printing thread receives.
#[derive(Debug)]
enum Msg {
    Line(String),
    /// Flush stdout, then acknowledge: everything queued before is printed.
    Flush(std::sync::mpsc::Sender<()>),
}

impl Console {
    /// Starts the printing thread; `names` (the services) set the width of the name column.
    pub fn start(mode: ConsoleMode, names: Vec<String>) -> Console {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("pdctl-console".into())
            .spawn(move || print_loop(rx))
            .expect("spawn the console thread");
        let width = names.iter().map(|n| n.len()).max().unwrap_or(0).max(5);
        Console {
            inner: Arc::new(Inner {
                mode,
                width,
                streaming: AtomicBool::new(false),
                dropped: AtomicU64::new(0),
                queue: tx,
            }),
        }
    }

    /// From now on service output is printed (foreground only).
    pub fn start_streaming(&self) {
        self.inner.streaming.store(true, Ordering::SeqCst);
    }

    /// One line of output from service `idx`, called `name` (services added while
    /// running were not among the names the console started with).
    pub fn service_line(&self, idx: usize, name: &str, line: &str) {
        if matches!(self.inner.mode, ConsoleMode::Foreground { .. })
            && self.inner.streaming.load(Ordering::Relaxed)
        {
            self.push(self.prefixed(name, idx, line));
        }
    }

    /// Something the supervisor did or saw (a restart, a failure, a stop).
    pub fn event(&self, text: &str) {
        match self.inner.mode {
            ConsoleMode::Detached => {
                self.push(format!(
                    "{} {text}",
                    crate::supervisor::state_dir::logfile::utc_timestamp()
                ));
            }
            ConsoleMode::Foreground { .. } => {
                if self.inner.streaming.load(Ordering::Relaxed) {
                    self.push(self.prefixed("pdctl", usize::MAX, text));
                }
            }
        }
    }

    /// A block printed as is (the status table).
    pub fn block(&self, text: &str) {
        self.push(text.trim_end().to_string());
    }

    fn prefixed(&self, name: &str, idx: usize, line: &str) -> String {
        let width = self.inner.width;
        match self.inner.mode {
            ConsoleMode::Foreground { colour: true } => {
                let code = if idx == usize::MAX {
                    "1"
                } else {
                    PALETTE[idx % PALETTE.len()]
                };
                format!("\x1b[{code}m{name:<width$} |\x1b[0m {line}")
            }
            _ => format!("{name:<width$} | {line}"),
        }
    }

    fn push(&self, line: String) {
        match self.inner.queue.try_send(Msg::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
        let dropped = self.inner.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let note =
                format!("[pdctl: {dropped} line(s) not shown here; the log files have them]");
            if self.inner.queue.try_send(Msg::Line(note)).is_err() {
                self.inner.dropped.fetch_add(dropped, Ordering::Relaxed);
            }
        }
    }

    /// Waits (at most a second) until everything queued so far is printed.
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        if self.inner.queue.send(Msg::Flush(tx)).is_ok() {
            let _ = rx.recv_timeout(std::time::Duration::from_secs(1));
        }
    }
}

fn print_loop(rx: Receiver<Msg>) {
    let stdout = std::io::stdout();
    for msg in rx {
        let mut out = stdout.lock();
        match msg {
            // A closed stdout (`pdctl up | head`) must not stop the supervisor.
            Msg::Line(line) => {
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
            Msg::Flush(ack) => {
                let _ = out.flush();
                let _ = ack.send(());
            }
        }
    }
}

/// True when stdout is a terminal and NO_COLOR is not set.
pub fn colour_wanted() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
