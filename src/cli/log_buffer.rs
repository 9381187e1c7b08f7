//! A buffered access log for the proxy, the way nginx's `access_log ... buffer= flush=` is.
//!
//! The proxy writes one info line per request (`request ok ...`, target
//! [`ACCESS_LOG_TARGET`]). Writing each with its own `write(2)` cost about a tenth of the
//! proxy's CPU per request under load (docs/proxy.md). Those lines are gathered here and
//! written together when [`FLUSH_BYTES`] have gathered or every [`FLUSH_EVERY`]; every other
//! line (a warning, a state change) first writes out what is gathered and then itself at
//! once, so the log keeps its order and nothing but access lines is ever late. An idle
//! proxy's flusher sleeps until a line comes. What is
//! gathered is also written when the process ends normally ([`LogBuffer::flush`]); a
//! SIGKILL can lose at most the last [`FLUSH_EVERY`] of access lines.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tracing_subscriber::fmt::MakeWriter;

/// The tracing target of the proxy's one-line-per-request log.
pub const ACCESS_LOG_TARGET: &str = "pdctl::proxy::record";
/// Gathered access lines are written at least this often.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// ... or as soon as this many bytes have gathered.
pub const FLUSH_BYTES: usize = 32 * 1024;

/// Standard error with the proxy's access lines gathered; cheap to clone.
#[derive(Clone, Default)]
pub struct LogBuffer {
    gathered: Arc<Mutex<Vec<u8>>>,
    /// Signalled when a line is gathered into an empty buffer, so an idle proxy's flusher
    /// sleeps instead of waking ten times a second.
    arrived: Arc<Condvar>,
}

impl LogBuffer {
    /// A buffer with a background thread writing it out every [`FLUSH_EVERY`].
    pub fn start() -> Self {
        let buffer = LogBuffer::default();
        let flusher = buffer.clone();
        let _ = std::thread::Builder::new()
            .name("log-flush".into())
            .spawn(move || {
                loop {
                    {
                        let gathered = flusher.gathered.lock().unwrap_or_else(|e| e.into_inner());
                        let _unused = flusher
                            .arrived
                            .wait_while(gathered, |g| g.is_empty())
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    std::thread::sleep(FLUSH_EVERY);
                    flusher.flush();
                }
            });
        buffer
    }

    /// Writes out whatever has gathered.
    pub fn flush(&self) {
        let mut gathered = self.gathered.lock().unwrap_or_else(|e| e.into_inner());
        write_out(&mut gathered);
    }
}

fn write_out(gathered: &mut Vec<u8>) {
    if !gathered.is_empty() {
        let _ = std::io::stderr().lock().write_all(gathered);
        gathered.clear();
    }
}

/// The writer for one event: gathers it or writes it through.
pub struct EventWriter {
    gathered: Arc<Mutex<Vec<u8>>>,
    arrived: Arc<Condvar>,
    gather: bool,
}

impl Write for EventWriter {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut gathered = self.gathered.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = gathered.is_empty();
        gathered.extend_from_slice(line);
        if !self.gather || gathered.len() >= FLUSH_BYTES {
            write_out(&mut gathered);
        } else if was_empty {
            self.arrived.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogBuffer {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter {
            gathered: self.gathered.clone(),
            arrived: self.arrived.clone(),
            gather: false,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> EventWriter {
        EventWriter {
            gathered: self.gathered.clone(),
            arrived: self.arrived.clone(),
            gather: meta.target() == ACCESS_LOG_TARGET && *meta.level() >= tracing::Level::INFO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(buffer: &LogBuffer, gather: bool) -> EventWriter {
        EventWriter {
            gathered: buffer.gathered.clone(),
            arrived: buffer.arrived.clone(),
            gather,
        }
    }

    #[test]
    fn access_lines_gather_and_any_other_line_writes_them_out_first() {
        let buffer = LogBuffer::default();
        writer(&buffer, true).write_all(b"request ok 1\n").unwrap();
        writer(&buffer, true).write_all(b"request ok 2\n").unwrap();
        assert_eq!(
            &*buffer.gathered.lock().unwrap(),
            b"request ok 1\nrequest ok 2\n"
        );
        writer(&buffer, false).write_all(b"WARN x\n").unwrap();
        assert!(buffer.gathered.lock().unwrap().is_empty());
    }

    #[test]
    fn a_full_buffer_is_written_without_waiting_for_the_timer() {
        let buffer = LogBuffer::default();
        let line = vec![b'x'; FLUSH_BYTES / 2 + 1];
        writer(&buffer, true).write_all(&line).unwrap();
        assert_eq!(buffer.gathered.lock().unwrap().len(), line.len());
        writer(&buffer, true).write_all(&line).unwrap();
        assert!(buffer.gathered.lock().unwrap().is_empty());
    }
}
