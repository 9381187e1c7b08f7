//! Server-sent events, the one wire format every streamed OpenAI answer uses: the one
//! reader of events in the crate ([`Events`], used by the bench client and the tests) and
//! the relay's cheap check that a stream ended with `data: [DONE]` ([`DoneTail`]), both
//! with the rules of the SSE specification: a line ends with `\n`, `\r\n` or `\r`; an empty
//! line ends an event; `data:` lines (one optional space after the colon) are joined with
//! `\n`; lines starting with `:` are comments.

/// The event vLLM (and every OpenAI-compatible server) ends a complete stream with.
pub const DONE: &str = "[DONE]";

/// One event: its `data:` lines joined (empty for an event without data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub data: String,
}

/// Splits a byte stream into events as chunks arrive, whatever the chunks' boundaries.
///
/// Lines are read in place: the bytes of lines already read are dropped once per
/// [`Events::push`], not once per line (a chunk of 18 events used to be shifted down 36
/// times), and a `data` line is copied once, into the event it belongs to.
#[derive(Debug, Default)]
pub struct Events {
    /// Bytes pushed and not dropped yet; those before `start` are read.
    pending: Vec<u8>,
    /// Where the next line starts in `pending`.
    start: usize,
    /// Where in `pending` the end of the next line is being searched from.
    scanned: usize,
    /// `data` lines of the event being read.
    data: Vec<String>,
    /// A `\r` ended the last line: a `\n` right after it belongs to it.
    after_cr: bool,
}

impl Events {
    /// Adds the next chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.start > 0 {
            self.pending.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        self.pending.extend_from_slice(chunk);
    }

    /// The next complete event, if the bytes pushed so far hold one.
    pub fn next_event(&mut self) -> Option<Event> {
        loop {
            if self.after_cr && self.start < self.pending.len() {
                if self.pending[self.start] == b'\n' {
                    self.start += 1;
                    self.scanned = self.scanned.max(self.start);
                }
                self.after_cr = false;
            }
            let Some(end) = memchr::memchr2(b'\n', b'\r', &self.pending[self.scanned..])
                .map(|p| p + self.scanned)
            else {
                self.scanned = self.pending.len();
                return None;
            };
            let line = &self.pending[self.start..end];
            self.after_cr = self.pending[end] == b'\r';
            let event = line_of(&mut self.data, line);
            self.start = end + 1;
            self.scanned = self.start;
            if event.is_some() {
                return event;
            }
        }
    }

    /// What is left when the stream ends: an event not closed by an empty line (the
    /// specification drops it; readers of whole bodies keep it to see everything sent).
    pub fn finish(mut self) -> Option<Event> {
        let rest = &self.pending[self.start..];
        if !rest.is_empty() {
            line_of(&mut self.data, rest);
        }
        (!self.data.is_empty()).then(|| joined(&mut self.data))
    }
}

/// Reads one line into the event being read (`data`); the event when the line ends it.
fn line_of(data: &mut Vec<String>, line: &[u8]) -> Option<Event> {
    if line.is_empty() {
        if data.is_empty() {
            return None;
        }
        return Some(joined(data));
    }
    if let Some(value) = line.strip_prefix(b"data:") {
        let value = value.strip_prefix(b" ").unwrap_or(value);
        data.push(match std::str::from_utf8(value) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(value).into_owned(),
        });
    }
    None
}

/// The event of the `data` lines read, which are taken.
fn joined(data: &mut Vec<String>) -> Event {
    let data = if data.len() == 1 {
        data.pop().unwrap_or_default()
    } else {
        std::mem::take(data).join("\n")
    };
    Event { data }
}

/// The `data` of every event in a whole body, in order (the last one kept even when the
/// body does not end with an empty line).
pub fn data_of(body: &[u8]) -> Vec<String> {
    let mut events = Events::default();
    events.push(body);
    let mut out = Vec::new();
    while let Some(e) = events.next_event() {
        out.push(e.data);
    }
    out.extend(events.finish().map(|e| e.data));
    out
}

/// The end of a stream seen so far, trailing whitespace left out: enough to tell whether
/// its last event is `data: [DONE]`, at a cost per chunk that does not grow with the chunk
/// (a copy of at most a dozen bytes, no allocation). The relay keeps one per stream
/// instead of splitting every event, which it does not otherwise need.
#[derive(Debug, Default)]
pub struct DoneTail {
    /// The last bytes up to the last one that is not whitespace.
    last: [u8; DONE_LINE.len() + 1],
    len: usize,
    /// Whether earlier bytes were dropped from `last`.
    cut: bool,
    /// The last whitespace byte after `last`, if any came since.
    gap: Option<u8>,
}

/// The line that ends a complete stream.
const DONE_LINE: &[u8] = b"data: [DONE]";

impl DoneTail {
    /// Takes note of the next chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        let Some(end) = chunk.iter().rposition(|b| !b.is_ascii_whitespace()) else {
            if let Some(&b) = chunk.last() {
                self.gap = Some(b);
            }
            return;
        };
        if let Some(b) = self.gap.take() {
            self.append(&[b]);
        }
        self.append(&chunk[..=end]);
        self.gap = chunk[end + 1..].last().copied();
    }

    fn append(&mut self, bytes: &[u8]) {
        let room = self.last.len();
        if bytes.len() >= room {
            self.last.copy_from_slice(&bytes[bytes.len() - room..]);
            self.cut |= self.len > 0 || bytes.len() > room;
            self.len = room;
            return;
        }
        let keep = self.len.min(room - bytes.len());
        self.cut |= keep < self.len;
        self.last.copy_within(self.len - keep..self.len, 0);
        self.last[keep..keep + bytes.len()].copy_from_slice(bytes);
        self.len = keep + bytes.len();
    }

    /// Whether the last event is `data: [DONE]` (on a line of its own).
    pub fn is_done(&self) -> bool {
        let Some(before) = self.last[..self.len].strip_suffix(DONE_LINE) else {
            return false;
        };
        match before {
            [] => !self.cut,
            [.., b'\n' | b'\r'] => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<String> {
        let mut events = Events::default();
        let mut out = Vec::new();
        for c in chunks {
            events.push(c);
            while let Some(e) = events.next_event() {
                out.push(e.data);
            }
        }
        out
    }

    #[test]
    fn every_line_ending_ends_events_and_chunk_boundaries_do_not_matter() {
        let want = ["{\"a\":1}", "[DONE]"];
        for body in [
            "data: {\"a\":1}\n\ndata: [DONE]\n\n",
            "data: {\"a\":1}\r\n\r\ndata: [DONE]\r\n\r\n",
            "data: {\"a\":1}\r\rdata: [DONE]\r\r",
            "data:{\"a\":1}\n\n: a comment\ndata: [DONE]\n\n",
        ] {
            assert_eq!(split(&[body.as_bytes()]), want, "{body:?}");
            // Cut anywhere, even between \r and \n.
            for cut in 0..body.len() {
                let (a, b) = body.as_bytes().split_at(cut);
                assert_eq!(split(&[a, b]), want, "{body:?} cut at {cut}");
            }
            let bytes: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
            assert_eq!(split(&bytes), want, "{body:?} byte by byte");
        }
    }

    #[test]
    fn data_lines_of_one_event_are_joined_and_an_unclosed_last_event_is_kept_by_data_of() {
        assert_eq!(split(&[b"data: a\ndata: b\n\n"]), ["a\nb"]);
        assert_eq!(split(&[b"data: x\n"]), Vec::<String>::new());
        assert_eq!(data_of(b"data: x\n\ndata: y"), ["x", "y"]);
        assert_eq!(data_of(b"event: ping\n\n\n\ndata: z\n\n"), ["z"]);
    }

    fn ends_done(chunks: &[&str]) -> bool {
        let mut end = DoneTail::default();
        for c in chunks {
            end.push(c.as_bytes());
        }
        end.is_done()
    }

    #[test]
    fn a_stream_is_complete_when_its_last_event_is_done() {
        let event = "data: {\"choices\":[{\"text\":\" a\"}]}\n\n";
        assert!(ends_done(&[event, "data: [DONE]\n\n"]));
        assert!(ends_done(&["data: [DONE]\n\n"]));
        assert!(ends_done(&["data: [DONE]"]));
        assert!(ends_done(&[&format!("{event}data: [DONE]\r\n\r\n")]));
        // Split anywhere, even byte by byte, and followed by empty or blank chunks.
        let whole = format!("{event}{event}data: [DONE]\n\n");
        for cut in 0..whole.len() {
            assert!(
                ends_done(&[&whole[..cut], &whole[cut..], "", "\n"]),
                "{cut}"
            );
        }
        let bytes: Vec<String> = whole.chars().map(String::from).collect();
        let bytes: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert!(ends_done(&bytes));
    }

    #[test]
    fn a_stream_cut_short_or_done_only_inside_text_is_not_complete() {
        let event = "data: {\"choices\":[{\"text\":\" a\"}]}\n\n";
        assert!(!ends_done(&[]));
        assert!(!ends_done(&[event]));
        assert!(!ends_done(&[event, "data: [DO"]));
        // The marker as generated text inside an event, then the stream breaks off.
        assert!(!ends_done(&["data: {\"text\":\"data: [DONE]\"}\n\n"]));
        assert!(!ends_done(&[event, "xdata: [DONE]\n\n"]));
        // More events after [DONE]: the last event is what counts.
        assert!(!ends_done(&["data: [DONE]\n\n", event]));
    }
}
