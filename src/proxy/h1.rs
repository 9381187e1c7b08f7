//! The legs' own HTTP/1.1 client (prefill and decode): a keep-alive pool of plain TCP
//! connections per engine, one request written in one piece, and the answer's body read
//! straight off the socket and de-chunked in the reader's own task.
//!
//! Why not hyper's client, which the proxy's own calls use (upstream.rs): hyper hands a response
//! body over one HTTP chunk at a time from its connection task, through a channel, each
//! chunk a wake-up of both tasks. A streaming engine writes one chunk per SSE event, so an
//! 18-event answer cost 36 task switches even when all of it arrived in one `recv`; that
//! hand-over was most of what a streamed request cost beyond a JSON one (docs/proxy.md,
//! "CPU per request"). Here the relay polls the socket itself: whatever has arrived is
//! de-chunked and handed on in one piece, so a fast stream is one read and one write, and a
//! stream paced by the engine is relayed event by event as it comes. The prefill leg uses
//! it too: no connection task to wake, one read for a whole answer.
//!
//! Connections: nodelay, the same TCP keepalive, user timeout and connect timeout as the
//! proxy's other client, kept idle for [`IDLE_TIMEOUT`] at most [`MAX_IDLE`] per engine, taken most
//! recently used first. An idle connection the engine has closed is dropped when taken; a
//! reused one that fails before any byte of an answer (the engine closed it as the request
//! went out) is retried on the next one, finally on a fresh connection, whose failure is the
//! leg's. A body dropped before its end drops its connection, which is how an engine learns
//! that the client went away.

use super::errors::LegFailure;
use crate::vocab::TcpLiveness;
use axum::http::HeaderValue;
use bytes::{Buf, Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long an unused connection to an engine is kept open: less than the 5 s after which
/// vLLM's server (uvicorn's `--timeout-keep-alive`) closes an idle one itself, so a kept
/// connection is one the engine still has. A sweep every this long drops older ones, so
/// the connections a burst of 1000 streams left are gone seconds after it, with the memory
/// they pinned (docs/proxy.md, "Memory").
const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Idle connections kept per engine: enough for every stream of a busy proxy to find one.
const MAX_IDLE: usize = 1024;

/// The most read from an engine's socket at once, into a scratch buffer on the stack: only
/// the bytes that arrived are copied into the body's buffer, so a connection costs memory
/// for what it holds, not for the room a read might have needed (1000 streams waiting for
/// their next event hold no read buffer at all).
const READ_SIZE: usize = 16 * 1024;

/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;

/// Largest chunk-size line (or trailer line) accepted.
const MAX_LINE: usize = 4096;

/// Headers read from a response head at most.
const MAX_HEADERS: usize = 64;

/// A request body up to this size goes out in the same write as the head.
const COPY_BODY_MAX: usize = 16 * 1024;

/// The client: connection pools per engine, settings shared by all.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    connect_timeout: Duration,
    tcp: TcpLiveness,
    /// The whole `authorization` header line, when engines want a key.
    auth: Option<Vec<u8>>,
    idle: Mutex<HashMap<String, VecDeque<Idle>>>,
    /// Whether the task that drops expired idle connections runs.
    sweeping: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
struct Idle {
    conn: TcpStream,
    since: Instant,
}

/// An engine's answer whose head has arrived.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub content_type: Option<HeaderValue>,
    pub body: Body,
}

/// The body of an answer, read as it arrives.
#[derive(Debug)]
pub struct Body {
    conn: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    /// The pool to give the connection back to once the body has ended, if it may be reused.
    back_to: Option<(Arc<Inner>, String)>,
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// `content-length`: bytes still to come.
    Length(u64),
    /// `transfer-encoding: chunked`.
    Chunked(Chunk),
    /// Neither: the body runs until the engine closes the connection.
    Eof,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: bytes still to come.
    Data(u64),
    /// After a chunk's data: expecting its line end.
    DataEnd,
    /// After the last (empty) chunk: trailer lines up to an empty one.
    Trailer,
}

/// Why one exchange on one connection failed.
enum Fail {
    /// The connection failed before any byte of an answer: on a reused connection the
    /// engine most likely closed it while idle, and the request may go out on another.
    Early(String),
    /// Anything else: the leg's failure.
    Leg(LegFailure),
}

impl Client {
    /// A client with the other legs' connect timeout, TCP keepalive and user timeout,
    /// sending `engine_key` as a bearer token.
    pub fn new(
        connect_timeout: Duration,
        tcp: TcpLiveness,
        engine_key: Option<&HeaderValue>,
    ) -> Client {
        let auth = engine_key.map(|k| {
            let mut line = b"authorization: ".to_vec();
            line.extend_from_slice(k.as_bytes());
            line.extend_from_slice(b"\r\n");
            line
        });
        Client {
            inner: Arc::new(Inner {
                connect_timeout,
                tcp,
                auth,
                idle: Mutex::new(HashMap::new()),
                sweeping: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// POSTs a JSON body to `base` (`http://HOST:PORT`) + `path` with `X-Request-Id`;
    /// returns the answer once its head is in (any status), or why there is none.
    pub async fn post_json(
        &self,
        base: &str,
        path: &str,
        body: &[u8],
        request_id: &str,
    ) -> Result<Response, LegFailure> {
        let authority = authority(base)?;
        if HeaderValue::from_str(request_id).is_err() {
            return Err(LegFailure::BadAnswer(format!(
                "request id {request_id:?} is not a header value"
            )));
        }
        let mut head = Vec::with_capacity(256 + body.len().min(COPY_BODY_MAX));
        let _ = write!(
            head,
            "POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nx-request-id: {request_id}\r\n",
            body.len()
        );
        if let Some(auth) = &self.inner.auth {
            head.extend_from_slice(auth);
        }
        head.extend_from_slice(b"\r\n");
        let rest = if body.len() <= COPY_BODY_MAX {
            head.extend_from_slice(body);
            &[][..]
        } else {
            body
        };
        loop {
            let (conn, reused) = match self.inner.take(authority) {
                Some(conn) => (conn, true),
                None => (self.inner.connect(authority).await?, false),
            };
            match exchange(conn, &head, rest).await {
                Ok((status, content_type, mut body, reusable)) => {
                    if reusable {
                        body.back_to = Some((self.inner.clone(), authority.to_string()));
                    }
                    return Ok(Response {
                        status,
                        content_type,
                        body,
                    });
                }
                Err(Fail::Early(_)) if reused => continue,
                Err(Fail::Early(msg)) => return Err(LegFailure::Body(msg)),
                Err(Fail::Leg(f)) => return Err(f),
            }
        }
    }
}

/// `HOST:PORT` of a base URL `http://HOST:PORT` (checked at start-up, so this fails only on
/// a bug or a scheme the proxy does not speak).
fn authority(base: &str) -> Result<&str, LegFailure> {
    base.strip_prefix("http://")
        .map(|a| a.trim_end_matches('/'))
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .ok_or_else(|| {
            LegFailure::BadAnswer(format!("cannot request {base}: not http://HOST:PORT"))
        })
}

impl Inner {
    /// The most recently used idle connection to `authority` that is still open. The pool
    /// is locked only to take one out: checking it (a `recv`) under the lock made the
    /// worker threads wait on each other (a futex sleep and wake-up for every other leg).
    fn take(&self, authority: &str) -> Option<TcpStream> {
        loop {
            let Idle { conn, since } = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                idle.get_mut(authority)?.pop_back()?
            };
            if since.elapsed() >= IDLE_TIMEOUT {
                // Those left are older still: the next put or sweep drops them.
                return None;
            }
            // Readable while idle means closed by the engine (or unasked-for bytes): either
            // way not usable. Nothing to read is the healthy case.
            let mut probe = [0u8; 1];
            if let Err(e) = conn.try_read(&mut probe)
                && e.kind() == std::io::ErrorKind::WouldBlock
            {
                return Some(conn);
            }
        }
    }

    /// Keeps a connection whose answer has been read completely for the next request.
    fn put(self: &Arc<Self>, authority: String, conn: TcpStream) {
        self.start_sweeping();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let conns = idle.entry(authority).or_default();
        while conns
            .front()
            .is_some_and(|i| i.since.elapsed() >= IDLE_TIMEOUT)
        {
            conns.pop_front();
        }
        if conns.len() < MAX_IDLE {
            conns.push_back(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Starts, once, the task that drops idle connections older than [`IDLE_TIMEOUT`]
    /// every [`IDLE_TIMEOUT`] (and ends with the client).
    fn start_sweeping(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(self);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(IDLE_TIMEOUT).await;
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                if pool.sweep() > 0 {
                    crate::allocator::return_free_memory();
                }
            }
        });
    }

    /// Drops the idle connections older than [`IDLE_TIMEOUT`]; returns how many.
    fn sweep(&self) -> usize {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0;
        for conns in idle.values_mut() {
            while conns
                .front()
                .is_some_and(|i| i.since.elapsed() >= IDLE_TIMEOUT)
            {
                conns.pop_front();
                dropped += 1;
            }
            if conns.is_empty() {
                // Its room too: a burst grew it to as many as it held.
                *conns = VecDeque::new();
            }
        }
        dropped
    }

    async fn connect(&self, authority: &str) -> Result<TcpStream, LegFailure> {
        let conn = tokio::time::timeout(self.connect_timeout, TcpStream::connect(authority))
            .await
            .map_err(|_| {
                LegFailure::ConnectTimeout(format!(
                    "no connection within {:?} (--connect-timeout-ms)",
                    self.connect_timeout
                ))
            })?
            .map_err(|e| LegFailure::of_connect(&e))?;
        conn.set_nodelay(true)
            .map_err(|e| LegFailure::Connect(e.to_string()))?;
        // A peer that goes silent (a machine cut off) ends the connection in seconds:
        // keepalive while the leg waits for bytes, the user timeout while it sends.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(self.tcp.keepalive_idle())
            .with_interval(self.tcp.keepalive_interval())
            .with_retries(self.tcp.tcp_keepalive_count);
        let sock = socket2::SockRef::from(&conn);
        sock.set_tcp_keepalive(&keepalive)
            .and_then(|()| sock.set_tcp_user_timeout(Some(self.tcp.user_timeout())))
            .map_err(|e| LegFailure::Connect(e.to_string()))?;
        Ok(conn)
    }
}

/// Writes the request and reads the answer's head.
async fn exchange(
    mut conn: TcpStream,
    head: &[u8],
    rest: &[u8],
) -> Result<(u16, Option<HeaderValue>, Body, bool), Fail> {
    let sent = async {
        conn.write_all(head).await?;
        if !rest.is_empty() {
            conn.write_all(rest).await?;
        }
        Ok::<_, std::io::Error>(())
    };
    sent.await
        .map_err(|e| Fail::Early(format!("sending the request failed: {e}")))?;
    let mut buf = BytesMut::new();
    loop {
        let got = match conn.readable().await {
            Ok(()) => read_arrived(&conn, &mut buf),
            Err(e) => Err(e),
        };
        let got = match got {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            other => other,
        };
        let early = buf.is_empty();
        match got {
            Ok(0) if early => {
                return Err(Fail::Early("the connection closed before an answer".into()));
            }
            Ok(0) => {
                return Err(Fail::Leg(LegFailure::Body(
                    "the connection closed in the middle of the answer's head".into(),
                )));
            }
            Err(e) if early => return Err(Fail::Early(e.to_string())),
            Err(e) => return Err(Fail::Leg(LegFailure::Body(e.to_string()))),
            Ok(_) => {}
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut headers);
        let len = match parsed.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => {
                return Err(bad(format!("a response head over {MAX_HEAD} bytes")));
            }
            Err(e) => return Err(bad(format!("a response head that is not HTTP/1.1 ({e})"))),
        };
        let status = parsed.code.unwrap_or(0);
        if (100..200).contains(&status) {
            // An interim answer (100 Continue...): the real one follows.
            buf.advance(len);
            continue;
        }
        let HeadFacts {
            content_type,
            framing,
            reusable,
        } = head_facts(status, &parsed)?;
        buf.advance(len);
        let body = Body {
            conn: Some(conn),
            buf,
            framing,
            // Named by the caller, which knows the pool, when `reusable`.
            back_to: None,
            ended: false,
        };
        return Ok((status, content_type, body, reusable));
    }
}

/// What a final answer's head says of its body and its connection.
struct HeadFacts {
    content_type: Option<HeaderValue>,
    framing: Framing,
    /// The connection may carry another request once the body is read.
    reusable: bool,
}

/// Reads the headers of a final answer's head: its content type, how its body is framed
/// (length, chunks, or up to the connection's end) and whether the connection stays open.
fn head_facts(status: u16, parsed: &httparse::Response) -> Result<HeadFacts, Fail> {
    let mut content_type = None;
    let mut length = None;
    let mut chunked = false;
    let mut reusable = parsed.version == Some(1);
    for h in parsed.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-type") {
            content_type = HeaderValue::from_bytes(h.value).ok();
        } else if name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| bad("a content-length that is not a number".into()))?;
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    reusable = false;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && parsed.version == Some(0) {
                    reusable = true;
                }
            }
        }
    }
    let framing = if status == 204 || status == 304 {
        Framing::Length(0)
    } else if chunked {
        Framing::Chunked(Chunk::Size)
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        reusable = false;
        Framing::Eof
    };
    Ok(HeadFacts {
        content_type,
        framing,
        reusable,
    })
}

/// Why an answer's body broke off or cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the engine closed the connection before the answer was complete")]
    Closed,
    #[error("reading the answer failed: {0}")]
    Read(#[from] std::io::Error),
    #[error("a chunk size that is not a number: {0:?}")]
    ChunkSize(String),
    #[error("a chunk longer than its size")]
    ChunkTooLong,
    #[error("a chunk line over {MAX_LINE} bytes")]
    LineTooLong,
}

/// Reads what has arrived on `conn` (at most [`READ_SIZE`]) and appends it to `buf`,
/// which grows by exactly that; `WouldBlock` when nothing has.
fn read_arrived(conn: &TcpStream, buf: &mut BytesMut) -> std::io::Result<usize> {
    let mut scratch = [0u8; READ_SIZE];
    let n = conn.try_read(&mut scratch)?;
    buf.extend_from_slice(&scratch[..n]);
    Ok(n)
}

fn bad(msg: String) -> Fail {
    Fail::Leg(LegFailure::BadAnswer(msg))
}

impl Body {
    /// Everything of the body that has arrived since the last call, in one piece (never
    /// empty); `None` at its end; `Err` with why when it broke off.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        loop {
            let (out, done) = match self.decode() {
                Ok(d) => d,
                Err(msg) => return Poll::Ready(Some(Err(self.broke(msg)))),
            };
            if self.buf.is_empty() {
                // Whatever the buffer shares with what was handed on is freed with that:
                // a stream waiting for its next event holds no buffer.
                self.buf = BytesMut::new();
            }
            if done {
                self.finish();
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(out)));
            }
            if done {
                return Poll::Ready(None);
            }
            let Some(conn) = &self.conn else {
                return Poll::Ready(None);
            };
            match read_arrived(conn, &mut self.buf) {
                Ok(0) if self.framing == Framing::Eof => {
                    self.ended = true;
                    self.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => return Poll::Ready(Some(Err(self.broke(BodyError::Closed)))),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    match conn.poll_read_ready(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            return Poll::Ready(Some(Err(self.broke(e.into()))));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Poll::Ready(Some(Err(self.broke(e.into())))),
            }
        }
    }

    /// The next piece of the body, waiting for it.
    pub async fn next(&mut self) -> Option<Result<Bytes, BodyError>> {
        std::future::poll_fn(|cx| self.poll_data(cx)).await
    }

    /// The whole body, refusing more than `limit` bytes.
    pub async fn read_all(mut self, limit: usize) -> Result<Bytes, LegFailure> {
        let mut all = BytesMut::new();
        while let Some(piece) = self.next().await {
            let piece = piece.map_err(|e| LegFailure::Body(e.to_string()))?;
            if all.len() + piece.len() > limit {
                return Err(LegFailure::BadAnswer(format!(
                    "an answer larger than {limit} bytes"
                )));
            }
            if all.is_empty() && self.ended {
                return Ok(piece); // all of it in one piece: no copy
            }
            all.extend_from_slice(&piece);
        }
        Ok(all.freeze())
    }

    fn broke(&mut self, e: BodyError) -> BodyError {
        self.ended = true;
        self.conn = None;
        e
    }

    /// The body's end: its connection goes back to the pool when nothing else came on it.
    fn finish(&mut self) {
        self.ended = true;
        let conn = self.conn.take();
        if let (Some(conn), Some((pool, authority))) = (conn, self.back_to.take())
            && self.buf.is_empty()
        {
            pool.put(authority, conn);
        }
    }

    /// Takes what the buffer holds of the body: the data, and whether the body ended.
    fn decode(&mut self) -> Result<(Bytes, bool), BodyError> {
        match &mut self.framing {
            Framing::Length(left) => {
                let take = (*left).min(self.buf.len() as u64) as usize;
                *left -= take as u64;
                Ok((self.buf.split_to(take).freeze(), *left == 0))
            }
            Framing::Eof => Ok((self.buf.split().freeze(), false)),
            Framing::Chunked(state) => dechunk(&mut self.buf, state),
        }
    }
}

/// Takes the data of every whole or partial chunk in `buf`, in one piece (a copy only when
/// there are several), and whether the last chunk and its trailers have been read.
fn dechunk(buf: &mut BytesMut, state: &mut Chunk) -> Result<(Bytes, bool), BodyError> {
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    let mut add = |piece: Bytes| match (&first, &mut more) {
        (None, _) => first = Some(piece),
        (Some(f), None) => {
            let mut m = BytesMut::with_capacity(f.len() + piece.len() + 1024);
            m.extend_from_slice(f);
            m.extend_from_slice(&piece);
            more = Some(m);
        }
        (Some(_), Some(m)) => m.extend_from_slice(&piece),
    };
    let done = loop {
        match *state {
            Chunk::Size => {
                let Some(line) = take_line(buf)? else {
                    break false;
                };
                let digits = line[..]
                    .split(|&b| b == b';')
                    .next()
                    .unwrap_or(&[])
                    .trim_ascii();
                let size = std::str::from_utf8(digits)
                    .ok()
                    .filter(|d| !d.is_empty())
                    .and_then(|d| u64::from_str_radix(d, 16).ok())
                    .ok_or_else(|| {
                        BodyError::ChunkSize(String::from_utf8_lossy(&line).into_owned())
                    })?;
                *state = if size == 0 {
                    Chunk::Trailer
                } else {
                    Chunk::Data(size)
                };
            }
            Chunk::Data(left) => {
                if buf.is_empty() {
                    break false;
                }
                let take = left.min(buf.len() as u64) as usize;
                add(buf.split_to(take).freeze());
                *state = if left == take as u64 {
                    Chunk::DataEnd
                } else {
                    Chunk::Data(left - take as u64)
                };
            }
            Chunk::DataEnd => {
                match buf.first() {
                    None => break false,
                    Some(b'\n') => buf.advance(1),
                    Some(b'\r') if buf.len() < 2 => break false,
                    Some(b'\r') if buf[1] == b'\n' => buf.advance(2),
                    Some(_) => return Err(BodyError::ChunkTooLong),
                }
                *state = Chunk::Size;
            }
            Chunk::Trailer => {
                let Some(line) = take_line(buf)? else {
                    break false;
                };
                if line.is_empty() {
                    break true;
                }
            }
        }
    };
    let out = match (first, more) {
        (_, Some(m)) => m.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    };
    Ok((out, done))
}

/// The next line of `buf` without its line end, taken out of it; `None` until it is whole.
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>, BodyError> {
    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
        if buf.len() > MAX_LINE {
            return Err(BodyError::LineTooLong);
        }
        return Ok(None);
    };
    let mut line = buf.split_to(end + 1);
    line.truncate(end);
    if line.last() == Some(&b'\r') {
        line.truncate(end - 1);
    }
    Ok(Some(line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn dechunk_all(pieces: &[&[u8]]) -> (Vec<u8>, bool) {
        let mut buf = BytesMut::new();
        let mut state = Chunk::Size;
        let mut out = Vec::new();
        let mut done = false;
        for p in pieces {
            buf.extend_from_slice(p);
            let (data, d) = dechunk(&mut buf, &mut state).unwrap();
            out.extend_from_slice(&data);
            done = d;
        }
        (out, done)
    }

    #[test]
    fn chunks_are_joined_whatever_the_read_boundaries() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\ntrailer: x\r\n\r\n";
        assert_eq!(dechunk_all(&[wire]), (b"hello, world".to_vec(), true));
        for cut in 0..wire.len() {
            let (a, b) = wire.split_at(cut);
            assert_eq!(
                dechunk_all(&[a, b]),
                (b"hello, world".to_vec(), true),
                "{cut}"
            );
        }
        let bytes: Vec<&[u8]> = wire.chunks(1).collect();
        assert_eq!(dechunk_all(&bytes), (b"hello, world".to_vec(), true));
        // Bare \n line ends are read too; an unfinished body is not done.
        assert_eq!(dechunk_all(&[b"3\nabc\n0\n\n"]), (b"abc".to_vec(), true));
        assert_eq!(dechunk_all(&[b"3\r\nabc\r\n"]), (b"abc".to_vec(), false));
    }

    #[test]
    fn a_malformed_chunk_is_an_error() {
        let mut state = Chunk::Size;
        assert!(dechunk(&mut BytesMut::from(&b"zz\r\n"[..]), &mut state).is_err());
        let mut state = Chunk::Size;
        assert!(dechunk(&mut BytesMut::from(&b"2\r\nabc\r\n"[..]), &mut state).is_err());
    }

    #[test]
    fn only_plain_http_base_urls_are_requested() {
        assert_eq!(
            authority("http://127.0.0.1:8200").unwrap(),
            "127.0.0.1:8200"
        );
        assert_eq!(authority("http://[::1]:8200/").unwrap(), "[::1]:8200");
        assert!(authority("https://h:1").is_err());
        assert!(authority("http://h:1/v1").is_err());
    }

    /// Reads one request (head and content-length body) off a test engine's connection;
    /// false when the client closed it instead.
    async fn read_request(conn: &mut TcpStream) -> bool {
        let mut buf = Vec::new();
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if buf.len() >= end + 4 + len {
                    return true;
                }
            }
            let mut more = [0u8; 4096];
            match conn.read(&mut more).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&more[..n]),
            }
        }
    }

    fn client() -> Client {
        Client::new(Duration::from_secs(2), TcpLiveness::default(), None)
    }

    #[tokio::test]
    async fn connections_are_reused_and_one_the_engine_closed_is_replaced() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            // The first connection answers two requests (one whole, one chunked), then the
            // engine closes it as an idle keep-alive timeout would.
            let (mut a, _) = listener.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert!(read_request(&mut a).await);
            a.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            assert!(read_request(&mut a).await);
            a.write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
            )
            .await
            .unwrap();
            drop(a);
            let (mut b, _) = listener.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert!(read_request(&mut b).await);
            b.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 4\r\n\r\nbusy")
                .await
                .unwrap();
            let _ = read_request(&mut b).await;
        });
        let c = client();
        let r = c
            .post_json(&base, "/v1/completions", b"{}", "id-1")
            .await
            .unwrap();
        assert_eq!(
            (r.status, &r.body.read_all(1024).await.unwrap()[..]),
            (200, &b"ok"[..])
        );
        let r = c
            .post_json(&base, "/v1/completions", b"{}", "id-2")
            .await
            .unwrap();
        assert_eq!(&r.body.read_all(1024).await.unwrap()[..], b"hi");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = c
            .post_json(&base, "/v1/completions", b"{}", "id-3")
            .await
            .unwrap();
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(r.status, 503);
        assert_eq!(r.content_type.unwrap(), "text/plain");
        assert_eq!(&r.body.read_all(1024).await.unwrap()[..], b"busy");
    }

    #[tokio::test]
    async fn a_body_dropped_midway_closes_its_connection_and_a_cut_body_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (seen_tx, seen) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut a, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut a).await);
            a.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nevent1\r\n")
                .await
                .unwrap();
            // The client went away: the engine sees its connection close.
            let _ = seen_tx.send(!read_request(&mut a).await);
            let (mut b, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut b).await);
            b.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nevent1\r\n")
                .await
                .unwrap();
        });
        let c = client();
        let mut r = c
            .post_json(&base, "/v1/completions", b"{}", "id-1")
            .await
            .unwrap();
        assert_eq!(&r.body.next().await.unwrap().unwrap()[..], b"event1");
        drop(r);
        let closed = tokio::time::timeout(Duration::from_secs(5), seen)
            .await
            .unwrap()
            .unwrap();
        assert!(closed, "the engine saw the connection close");
        let mut r = c
            .post_json(&base, "/v1/completions", b"{}", "id-2")
            .await
            .unwrap();
        assert_eq!(&r.body.next().await.unwrap().unwrap()[..], b"event1");
        let err = r.body.next().await.unwrap().unwrap_err().to_string();
        assert!(err.contains("before the answer was complete"), "{err}");
        assert!(r.body.next().await.is_none());
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_failure() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let base = format!("http://127.0.0.1:{port}");
        let err = client()
            .post_json(&base, "/v1/completions", b"{}", "id")
            .await
            .unwrap_err();
        assert!(matches!(err, LegFailure::Connect(_)), "{err}");
    }

    /// A listener whose accept queue is full drops new SYNs, so a connect to it hangs, as
    /// one to a frozen or busy machine does.
    fn unaccepting_listener() -> (socket2::Socket, Vec<std::net::TcpStream>) {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        sock.bind(&addr.into()).unwrap();
        sock.listen(0).unwrap();
        let addr = sock.local_addr().unwrap().as_socket().unwrap();
        let mut held = Vec::new();
        for _ in 0..4 {
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            if s.connect_timeout(&addr.into(), Duration::from_millis(300))
                .is_err()
            {
                return (sock, held);
            }
            held.push(s.into());
        }
        panic!("a listener with a backlog of 0 took 4 connections unaccepted");
    }

    #[tokio::test]
    async fn a_connect_that_times_out_is_slowness_not_a_refusal() {
        let (listener, _held) = unaccepting_listener();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        let client = Client::new(Duration::from_millis(300), TcpLiveness::default(), None);
        let err = client
            .post_json(&format!("http://{addr}"), "/v1/completions", b"{}", "id")
            .await
            .unwrap_err();
        assert!(matches!(err, LegFailure::ConnectTimeout(_)), "{err}");
        assert!(err.to_string().contains("--connect-timeout-ms"), "{err}");
    }
}
