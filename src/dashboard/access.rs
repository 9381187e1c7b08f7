//! The proxy's access log read as it grows: the one line per request the proxy writes
//! anyway (`request ok request_id=... prefill=... decode=... status=... kv_handoff=...`),
//! which says what no counter does: which prefill -> decode pair served a request, how its
//! KV handoff went, its whole time, and the request id of a failure; and the line the relay
//! writes when it continues a stream on another decode (`stream continued: decode A ->
//! decode B`), which says from which decode to which each hop of a migrated stream went.
//! Reading the file the supervisor already writes adds nothing to the proxy's request path.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The text before the fields of an access line: the proxy's record target and the
/// message's first word.
const MARK: &str = "pdctl::proxy::record: request ";

/// The text before a hop's two decodes: the relay's target and its message's first words.
const HOP_MARK: &str = "pdctl::proxy::relay: stream continued: decode ";

/// Bytes read at most per look: a burst beyond this is skipped, not read late.
const MAX_READ: u64 = 4 * 1024 * 1024;

/// One request, as its access line tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct Access {
    pub request_id: String,
    /// `ok`, or the error the client was sent.
    pub outcome: String,
    /// The instances' URLs (None: the request never reached that leg).
    pub prefill: Option<String>,
    pub decode: Option<String>,
    pub status: u16,
    pub ttft_ms: Option<f64>,
    pub total_ms: Option<f64>,
    pub retries: u32,
    /// Times its stream was continued on another decode (`decode` is the last one).
    pub migrations: u32,
    /// `ok` (the KV was handed over), a miss reason, or None (no handoff was made).
    pub kv_handoff: Option<String>,
}

/// One hop of a migrated stream: its decode broke off and the stream went on on another.
#[derive(Debug, Clone, PartialEq)]
pub struct Hop {
    pub request_id: String,
    /// The decodes' URLs, as the access line names instances.
    pub from: String,
    pub to: String,
}

/// A line of the proxy's log the dashboard reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// A request ended.
    Access(Access),
    /// A stream was continued on another decode (logged when it was, before its end).
    Hop(Hop),
}

/// Reads one line of the proxy's log; None for a line that is neither a request's end nor
/// a stream's hop.
pub fn parse_line(line: &str) -> Option<Line> {
    match parse_hop(line) {
        Some(h) => Some(Line::Hop(h)),
        None => parse(line).map(Line::Access),
    }
}

/// Reads a hop line: `... stream continued: decode FROM -> decode TO, ... request_id=ID`.
fn parse_hop(line: &str) -> Option<Hop> {
    let at = line.find(HOP_MARK)?;
    let rest = &line[at + HOP_MARK.len()..];
    let (from, rest) = rest.split_once(" -> decode ")?;
    let to = rest.split([',', ' ']).next()?;
    let id_at = rest.rfind(" request_id=")? + " request_id=".len();
    let request_id = rest[id_at..].split_whitespace().next()?;
    Some(Hop {
        request_id: request_id.to_string(),
        from: from.to_string(),
        to: to.to_string(),
    })
}

impl Access {
    /// True when the client got an error (4xx/5xx, a client gone is 499).
    pub fn failed(&self) -> bool {
        self.status >= 400
    }
}

/// Reads one access line; None for any other line.
fn parse(line: &str) -> Option<Access> {
    let at = line.find(MARK)?;
    let rest = &line[at + MARK.len()..];
    let fields_at = rest.find(" request_id=")?;
    let outcome = rest[..fields_at].trim().to_string();
    let mut a = Access {
        request_id: String::new(),
        outcome,
        prefill: None,
        decode: None,
        status: 0,
        ttft_ms: None,
        total_ms: None,
        retries: 0,
        migrations: 0,
        kv_handoff: None,
    };
    for pair in rest[fields_at..].split_whitespace() {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        let given = (v != "-").then(|| v.to_string());
        match k {
            "request_id" => a.request_id = v.to_string(),
            "prefill" => a.prefill = given,
            "decode" => a.decode = given,
            "status" => a.status = v.parse().unwrap_or(0),
            "ttft_ms" => a.ttft_ms = v.parse().ok(),
            "total_ms" => a.total_ms = v.parse().ok(),
            "retries" => a.retries = v.parse().unwrap_or(0),
            "migrations" => a.migrations = v.parse().unwrap_or(0),
            "kv_handoff" => a.kv_handoff = given,
            _ => {}
        }
    }
    (!a.request_id.is_empty()).then_some(a)
}

/// A log file followed from where the last look ended (from its end at the first look:
/// the page shows what happens from now on); a file that shrank was rotated, and is read
/// again from its start.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    offset: Option<u64>,
    partial: String,
}

impl Tail {
    /// Follows `path` (which need not exist yet).
    pub fn new(path: &Path) -> Tail {
        Tail {
            path: path.to_path_buf(),
            offset: None,
            partial: String::new(),
        }
    }

    /// The complete lines written since the last look.
    pub fn new_lines(&mut self) -> Vec<String> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let from = match self.offset {
            None => len,
            Some(o) if o > len => 0,
            Some(o) => o.max(len.saturating_sub(MAX_READ)),
        };
        self.offset = Some(len);
        if from >= len || f.seek(SeekFrom::Start(from)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::with_capacity((len - from) as usize);
        if f.take(len - from).read_to_end(&mut buf).is_err() {
            return Vec::new();
        }
        let text = std::mem::take(&mut self.partial) + &String::from_utf8_lossy(&buf);
        let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
        self.partial = lines.pop().unwrap_or_default();
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "2026-12-03T14:00:00.123456Z  INFO pdctl::proxy::record: request ok request_id=ab-12 route=/v1/completions stream=true prefill=http://127.0.0.1:8100 decode=http://127.0.0.1:8201 status=200 prefill_ms=12.5 decode_first_byte_ms=3.0 ttft_ms=16.1 total_ms=120.4 retries=1 migrations=2 kv_handoff=ok";

    #[test]
    fn an_access_line_gives_its_pair_handoff_and_times() {
        let a = parse(OK).unwrap();
        assert_eq!(a.request_id, "ab-12");
        assert_eq!(a.outcome, "ok");
        assert_eq!(a.prefill.as_deref(), Some("http://127.0.0.1:8100"));
        assert_eq!(a.decode.as_deref(), Some("http://127.0.0.1:8201"));
        assert_eq!((a.status, a.retries, a.migrations), (200, 1, 2));
        assert_eq!((a.ttft_ms, a.total_ms), (Some(16.1), Some(120.4)));
        assert_eq!(a.kv_handoff.as_deref(), Some("ok"));
        assert!(!a.failed());
    }

    #[test]
    fn a_failure_keeps_its_message_and_id_and_other_lines_are_not_requests() {
        let line = "2026-12-03T14:00:01Z  INFO pdctl::proxy::record: request no decode instance is healthy (3 tried) request_id=cd-34 route=/v1/completions stream=false prefill=http://p:1 decode=- status=503 prefill_ms=- decode_first_byte_ms=- ttft_ms=- total_ms=4.0 retries=0 kv_handoff=-";
        let a = parse(line).unwrap();
        assert_eq!(a.outcome, "no decode instance is healthy (3 tried)");
        assert_eq!((a.request_id.as_str(), a.status), ("cd-34", 503));
        assert_eq!((&a.decode, &a.kv_handoff, a.ttft_ms), (&None, &None, None));
        assert!(a.failed());
        assert_eq!(
            parse("2026-12-03T14:00:01Z  WARN pdctl::proxy::health: decode-1 down"),
            None
        );
    }

    #[test]
    fn a_hop_line_gives_its_request_and_both_decodes() {
        let line = "2026-12-03T14:00:00.5Z  INFO pdctl::proxy::relay: stream continued: decode http://127.0.0.1:8201 -> decode http://127.0.0.1:8202, 7 tokens carried as token ids (continuation 1) request_id=ab-12";
        assert_eq!(
            parse_line(line),
            Some(Line::Hop(Hop {
                request_id: "ab-12".into(),
                from: "http://127.0.0.1:8201".into(),
                to: "http://127.0.0.1:8202".into(),
            }))
        );
        assert!(matches!(parse_line(OK), Some(Line::Access(a)) if a.request_id == "ab-12"));
        let other = "2026-12-03T14:00:00Z  INFO pdctl::proxy::relay: decode broke off after the answer's last token; the proxy ends the stream request_id=ab-12";
        assert_eq!(parse_line(other), None);
    }

    #[test]
    fn the_tail_starts_at_the_end_keeps_partial_lines_and_follows_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy.log");
        std::fs::write(&path, "old line\n").unwrap();
        let mut t = Tail::new(&path);
        assert!(
            t.new_lines().is_empty(),
            "what was there before is not news"
        );
        let append = |s: &str| {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap();
            f.write_all(s.as_bytes()).unwrap();
        };
        append("one\ntw");
        assert_eq!(t.new_lines(), ["one"]);
        append("o\n");
        assert_eq!(t.new_lines(), ["two"]);
        std::fs::write(&path, "fresh\n").unwrap();
        assert_eq!(t.new_lines(), ["fresh"]);
    }
}
