//! Writing a service's log: `logs/<service>.log` with size-based rotation, plus the last
//! lines kept in memory for progress display and failure messages.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Rotate when a log file reaches this size, unless `--log-max-bytes` says otherwise.
pub const DEFAULT_MAX_BYTES: u64 = 20 * 1024 * 1024;
/// Rotated files kept (`.1` newest .. `.N` oldest), unless `--log-keep` says otherwise.
pub const DEFAULT_KEEP: u32 = 3;
/// Starts the lines the supervisor writes into a service's log itself (they are not the
/// service's output, and failure reports leave them out).
pub const NOTE_PREFIX: &str = "[pdctl] ";
/// Lines remembered per service for "last log" displays.
const RECENT_LINES: usize = 40;

/// `<path>.<i>`: the i-th rotated copy of a log (1 = most recent).
pub fn rotated_path(path: &Path, i: u32) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(format!(".{i}"));
    PathBuf::from(s)
}

/// An append-only file that moves itself aside to `.1` (shifting older copies) once it
/// reaches `max_bytes`, keeping `keep` old copies.
#[derive(Debug)]
pub struct RotatingFile {
    path: PathBuf,
    file: File,
    len: u64,
    max_bytes: u64,
    keep: u32,
}

impl RotatingFile {
    /// Opens `path` for appending (creating it); rotates first if it is already full.
    pub fn open(path: &Path, max_bytes: u64, keep: u32) -> std::io::Result<RotatingFile> {
        let file = open_append(path)?;
        let len = file.metadata()?.len();
        let mut f = RotatingFile {
            path: path.to_path_buf(),
            file,
            len,
            max_bytes: max_bytes.max(1),
            keep,
        };
        if f.len >= f.max_bytes {
            f.rotate()?;
        }
        Ok(f)
    }

    /// Appends `buf`, rotating afterwards if the file is now full (so a chunk is never
    /// split across two files).
    pub fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.file.write_all(buf)?;
        self.len += buf.len() as u64;
        if self.len >= self.max_bytes {
            self.rotate()?;
        }
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        if self.keep == 0 {
            let _ = std::fs::remove_file(&self.path);
            self.file = open_append(&self.path)?;
        } else {
            for i in (1..self.keep).rev() {
                let from = rotated_path(&self.path, i);
                if from.exists() {
                    std::fs::rename(&from, rotated_path(&self.path, i + 1))?;
                }
            }
            std::fs::rename(&self.path, rotated_path(&self.path, 1))?;
            self.file = open_append(&self.path)?;
        }
        self.len = 0;
        Ok(())
    }
}

fn open_append(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // A service's output is this user's only (docs/security.md).
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

#[derive(Debug)]
struct Sink {
    file: Option<RotatingFile>,
    /// False while the last byte written was not a newline (a note must start a line).
    at_line_start: bool,
}

/// One service's log: the rotating file, its most recent lines, and the last line that
/// looked like an error.
#[derive(Debug)]
pub struct ServiceLog {
    /// The service's name (in warnings about the file).
    pub name: String,
    file: Mutex<Sink>,
    recent: Mutex<VecDeque<String>>,
    /// The last error-looking output line since [`Self::forget_errors`], however many
    /// lines came after it (a traceback's last line is often followed by shutdown chatter).
    last_error: Mutex<Option<String>>,
}

impl ServiceLog {
    /// Opens `path`; when that fails the service still runs, its output kept only in memory.
    pub fn open(name: &str, path: &Path, max_bytes: u64, keep: u32) -> ServiceLog {
        let file = match RotatingFile::open(path, max_bytes, keep) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!("cannot write {}: {e}", path.display());
                None
            }
        };
        ServiceLog {
            name: name.to_string(),
            file: Mutex::new(Sink {
                file,
                at_line_start: true,
            }),
            recent: Mutex::new(VecDeque::with_capacity(RECENT_LINES)),
            last_error: Mutex::new(None),
        }
    }

    /// A log with no file, for services this node does not run.
    pub fn memory_only(name: &str) -> ServiceLog {
        ServiceLog {
            name: name.to_string(),
            file: Mutex::new(Sink {
                file: None,
                at_line_start: true,
            }),
            recent: Mutex::new(VecDeque::new()),
            last_error: Mutex::new(None),
        }
    }

    /// Appends raw output bytes to the file.
    pub fn append(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut sink = self.file.lock().unwrap_or_else(|e| e.into_inner());
        sink.at_line_start = bytes.ends_with(b"\n");
        if let Some(f) = sink.file.as_mut() {
            if let Err(e) = f.write(bytes) {
                tracing::warn!("writing the log of {}: {e}", self.name);
            }
        }
    }

    /// Remembers a complete output line for [`Self::last_lines`] (and, if it looks like
    /// an error, for [`Self::last_error`]), without colour codes (they would garble
    /// progress lines and failure reports).
    pub fn remember(&self, line: &str) {
        let plain = strip_ansi(line);
        if looks_like_error(&plain) {
            *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(plain.trim().to_string());
        }
        let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() == RECENT_LINES {
            r.pop_front();
        }
        r.push_back(plain);
    }

    /// Writes a line of the supervisor's own into the log (`[pdctl] <time> <text>`), so a
    /// reader of the file sees starts, exits and restarts where they happened.
    pub fn note(&self, text: &str) {
        let fresh_line = self
            .file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .at_line_start;
        let sep = if fresh_line { "" } else { "\n" };
        self.append(format!("{sep}{NOTE_PREFIX}{} {text}\n", utc_timestamp()).as_bytes());
    }

    /// The last `n` output lines, oldest first.
    pub fn last_lines(&self, n: usize) -> Vec<String> {
        let r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        r.iter().skip(r.len().saturating_sub(n)).cloned().collect()
    }

    /// The most recent non-empty output line.
    pub fn last_line(&self) -> Option<String> {
        let r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        r.iter().rev().find(|l| !l.trim().is_empty()).cloned()
    }

    /// The last output line that looked like an error (see [`looks_like_error`]) since
    /// [`Self::forget_errors`].
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Forgets the last error line: a new run starts, and an error of the run before must
    /// not be blamed for how this one ends.
    pub fn forget_errors(&self) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Whether an output line looks like an error report: a Python exception or traceback
/// (`RuntimeError: ...`, `Traceback (most recent call last):`), an error or fatal log
/// level (`ERROR`, `CRITICAL`, `FATAL`), a Rust panic, or the words `error` / `fatal`
/// (`error: unrecognized arguments`). Words that merely contain them (`errors=0`,
/// `stderr`) do not count.
pub fn looks_like_error(line: &str) -> bool {
    // An HTTP access log line (`"POST /v1/completions HTTP/1.1" 500 Internal Server
    // Error`) reports a response, not the error behind it, which comes on its own line.
    if line.contains(" HTTP/1.1\" ") || line.contains(" HTTP/1.0\" ") {
        return false;
    }
    const MARKS: [&str; 8] = [
        "Error",
        "ERROR",
        "Exception",
        "Traceback",
        "CRITICAL",
        "FATAL",
        "Fatal",
        "panicked at",
    ];
    MARKS.iter().any(|m| line.contains(m)) || has_word(line, "error") || has_word(line, "fatal")
}

/// `word` in `line` with no letter or digit right before or after it.
fn has_word(line: &str, word: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    line.match_indices(word).any(|(i, _)| {
        !alnum(line[..i].chars().next_back()) && !alnum(line[i + word.len()..].chars().next())
    })
}

/// The message of a log line without the logger's prefix, for short displays:
/// `RuntimeError: x` from vLLM's `ERROR 11-22 05:19:57 [core.py:812] RuntimeError: x`
/// (also behind a worker's `(EngineCore_DP0 pid=12) ` tag) and from pdctl's own
/// `2026-01-02T03:04:05.123456Z ERROR pdctl::sim::server: RuntimeError: x`. Any other
/// line comes back as it is, trimmed.
pub fn log_message(line: &str) -> &str {
    const LEVELS: [&str; 8] = [
        "ERROR", "CRITICAL", "FATAL", "WARNING", "WARN", "INFO", "DEBUG", "TRACE",
    ];
    let mut s = line.trim();
    if s.starts_with('(') {
        if let Some(i) = s.find(") ") {
            s = s[i + 2..].trim_start();
        }
    }
    let mut words = s.split_whitespace();
    let (first, second) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if LEVELS.contains(&first) {
        // vLLM: `LEVEL MM-DD HH:MM:SS [file.py:line] message`.
        if let Some(i) = s.find("] ") {
            return s[i + 2..].trim_start();
        }
    } else if LEVELS.contains(&second) {
        // tracing: `TIMESTAMP LEVEL target: message`.
        let rest = s[first.len()..].trim_start()[second.len()..].trim_start();
        if let Some((target, message)) = rest.split_once(": ") {
            if !target.is_empty() && !target.contains(char::is_whitespace) {
                return message.trim_start();
            }
        }
    }
    s
}

/// Splits a byte stream into display lines. A carriage return (progress bars redrawing
/// one line) keeps only the text after it; very long lines are cut at 8 KiB.
#[derive(Debug, Default)]
pub struct LineSplitter {
    carry: Vec<u8>,
}

const MAX_LINE: usize = 8 * 1024;

impl LineSplitter {
    /// Feeds a chunk; returns the lines it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for &b in chunk {
            if b == b'\n' {
                out.push(Self::finish(&mut self.carry));
            } else {
                self.carry.push(b);
                if self.carry.len() >= MAX_LINE {
                    out.push(Self::finish(&mut self.carry));
                }
            }
        }
        out
    }

    /// What is left without a newline at the end of the stream.
    pub fn rest(&mut self) -> Option<String> {
        (!self.carry.is_empty()).then(|| Self::finish(&mut self.carry))
    }

    fn finish(buf: &mut Vec<u8>) -> String {
        let line = String::from_utf8_lossy(buf);
        let trimmed = line.trim_end_matches('\r');
        let shown = trimmed.rsplit('\r').next().unwrap_or("").to_string();
        buf.clear();
        shown
    }
}

/// `text` without ANSI escape sequences (colours, cursor movement): `ESC [ ... final`
/// and two-byte `ESC x` forms.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        // `ESC x` drops x; `ESC [` also drops parameters up to a final byte in '@'..='~'.
        if chars.next() == Some('[') {
            for f in chars.by_ref() {
                if ('@'..='~').contains(&f) {
                    break;
                }
            }
        }
    }
    out
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_timestamp() -> String {
    format_utc(time::OffsetDateTime::now_utc().unix_timestamp())
}

/// Formats seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC); a time past what a
/// calendar date holds (year 9999) reads as that end.
pub fn format_utc(secs: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(if secs < 0 {
        time::PrimitiveDateTime::MIN.assume_utc()
    } else {
        time::PrimitiveDateTime::MAX.assume_utc()
    });
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pdctl-logfile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn rotation_keeps_the_newest_copies_and_drops_the_oldest() {
        let d = temp("rotate");
        let p = d.join("svc.log");
        let mut f = RotatingFile::open(&p, 10, 2).unwrap();
        for chunk in ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc", "dd"] {
            f.write(chunk.as_bytes()).unwrap();
        }
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        assert_eq!(read(&p), "dd");
        assert_eq!(read(&rotated_path(&p, 1)), "cccccccccc");
        assert_eq!(read(&rotated_path(&p, 2)), "bbbbbbbbbb");
        assert!(!rotated_path(&p, 3).exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn reopening_a_full_file_rotates_it_first() {
        let d = temp("reopen");
        let p = d.join("svc.log");
        std::fs::write(&p, "0123456789").unwrap();
        let mut f = RotatingFile::open(&p, 10, 1).unwrap();
        f.write(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(
            std::fs::read_to_string(rotated_path(&p, 1)).unwrap(),
            "0123456789"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn splitter_handles_partial_lines_crlf_and_progress_bars() {
        let mut s = LineSplitter::default();
        assert_eq!(s.feed(b"hel"), Vec::<String>::new());
        assert_eq!(s.feed(b"lo\r\nwor"), vec!["hello"]);
        assert_eq!(s.feed(b"ld\n 10%\r 50%\r100%\n"), vec!["world", "100%"]);
        assert_eq!(s.feed(b"tail"), Vec::<String>::new());
        assert_eq!(s.rest().as_deref(), Some("tail"));
        assert_eq!(s.rest(), None);
    }

    #[test]
    fn recent_lines_are_bounded_and_ordered() {
        let d = temp("recent");
        let log = ServiceLog::open("x", &d.join("x.log"), 1 << 20, 1);
        for i in 0..100 {
            log.remember(&format!("line {i}"));
        }
        assert_eq!(log.last_lines(2), vec!["line 98", "line 99"]);
        assert_eq!(log.last_line().as_deref(), Some("line 99"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn error_lines_are_told_from_ordinary_ones() {
        for line in [
            "RuntimeError: shape mismatch",
            "Traceback (most recent call last):",
            "ERROR 11-22 05:19:57 [core.py:812] EngineCore failed",
            "torch.OutOfMemoryError: CUDA out of memory",
            "vllm: error: unrecognized arguments: --bogus",
            "fatal: not a git repository",
            "thread 'main' panicked at src/main.rs:2:5:",
            "Exception in thread Thread-1",
        ] {
            assert!(looks_like_error(line), "{line}");
        }
        for line in [
            "INFO:     Shutting down",
            "INFO 11-22 05:19:57 [api_server.py:1] non-default args: errors=0",
            "writing to stderr",
            "Loading weights took 41.2 seconds",
            "INFO:     127.0.0.1:34120 - \"POST /v1/completions HTTP/1.1\" 500 Internal Server Error",
        ] {
            assert!(!looks_like_error(line), "{line}");
        }
    }

    #[test]
    fn the_last_error_line_outlives_later_output_until_forgotten() {
        let d = temp("lasterror");
        let log = ServiceLog::open("x", &d.join("x.log"), 1 << 20, 1);
        log.remember("starting");
        assert_eq!(log.last_error(), None);
        log.remember("\x1b[31mERROR\x1b[0m first failure");
        log.remember("RuntimeError: shape mismatch");
        for i in 0..100 {
            log.remember(&format!("INFO shutting down step {i}"));
        }
        assert_eq!(
            log.last_error().as_deref(),
            Some("RuntimeError: shape mismatch")
        );
        log.forget_errors();
        assert_eq!(log.last_error(), None);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn log_prefixes_are_dropped_from_the_message() {
        assert_eq!(
            log_message("ERROR 11-22 05:19:57 [core.py:812] RuntimeError: shape mismatch"),
            "RuntimeError: shape mismatch"
        );
        assert_eq!(
            log_message("(EngineCore_DP0 pid=123) ERROR 11-22 05:19:57 [core.py:812] boom: x"),
            "boom: x"
        );
        assert_eq!(
            log_message("2026-01-02T03:04:05.123456Z ERROR pdctl::sim::server: fault: exiting"),
            "fault: exiting"
        );
        assert_eq!(
            log_message("  RuntimeError: plain  "),
            "RuntimeError: plain"
        );
        assert_eq!(
            log_message("INFO:     Shutting down"),
            "INFO:     Shutting down"
        );
    }

    #[test]
    fn colour_codes_are_stripped_and_plain_text_kept() {
        let coloured = "\x1b[2m2026-11-22T05:19:57Z\x1b[0m \x1b[32m INFO\x1b[0m ready: [ok]";
        assert_eq!(
            strip_ansi(coloured),
            "2026-11-22T05:19:57Z  INFO ready: [ok]"
        );
        assert_eq!(strip_ansi("no codes [1] here"), "no codes [1] here");
        assert_eq!(strip_ansi("cut \x1b["), "cut ");
    }

    #[test]
    fn utc_formatting_matches_known_dates() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(format_utc(-1), "1969-12-31T23:59:59Z");
        assert_eq!(format_utc(20_784 * 86_400), "2026-11-27T00:00:00Z");
    }
}
