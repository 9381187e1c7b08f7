//! The legs' client on hyper's connection-level HTTP/1.1 client (`hyper::client::conn::http1`)
//! with a small pool of its own, the candidate that issue 25 asks to measure against h1.rs.
//! Each connection's future is polled by whoever uses the connection (the leg while it
//! waits for the head, the relay while it reads the body), never by a task of its own, so
//! no chunk of an answer crosses tasks.

use super::errors::LegFailure;
use super::h1::{BodyError, Client, Response};
use super::upstream::innermost_cause;
use axum::http::{HeaderValue, Method, Request, Uri, header};
use bytes::{Bytes, BytesMut};
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_IDLE: usize = 1024;

/// One connection: its request sender and the future that does its reads and writes.
pub struct Pooled {
    send: SendRequest<Full<Bytes>>,
    conn: Connection<TokioIo<TcpStream>, Full<Bytes>>,
}

impl std::fmt::Debug for Pooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pooled")
    }
}

/// Idle connections per engine.
#[derive(Debug, Default)]
pub struct Pool {
    idle: Mutex<HashMap<String, VecDeque<(Pooled, Instant)>>>,
}

impl Pool {
    fn take(&self, authority: &str) -> Option<Pooled> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let conns = idle.get_mut(authority)?;
        while let Some((mut p, since)) = conns.pop_back() {
            if since.elapsed() >= IDLE_TIMEOUT {
                conns.clear();
                return None;
            }
            // Polled once: a connection the engine closed ends here.
            let mut cx = Context::from_waker(Waker::noop());
            if Pin::new(&mut p.conn).poll(&mut cx).is_pending() && p.send.is_ready() {
                return Some(p);
            }
        }
        None
    }

    fn put(&self, authority: String, p: Pooled) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let conns = idle.entry(authority).or_default();
        while conns
            .front()
            .is_some_and(|(_, since)| since.elapsed() >= IDLE_TIMEOUT)
        {
            conns.pop_front();
        }
        if conns.len() < MAX_IDLE {
            conns.push_back((p, Instant::now()));
        }
    }
}

/// An answer's body being read off its connection.
#[derive(Debug)]
pub struct Body {
    incoming: Incoming,
    conn: Option<Pooled>,
    back_to: Option<(Arc<Pool>, String)>,
    pending_error: Option<BodyError>,
    ended: bool,
}

enum Fail {
    Early(String),
    Leg(LegFailure),
}

fn fail_of(e: &hyper::Error) -> Fail {
    let io = std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>());
    if e.is_canceled() || e.is_incomplete_message() || io {
        Fail::Early(innermost_cause(e))
    } else if e.is_parse() {
        Fail::Leg(LegFailure::BadAnswer(format!(
            "a response that is not HTTP/1.1 ({e})"
        )))
    } else {
        Fail::Leg(LegFailure::Body(innermost_cause(e)))
    }
}

/// POSTs `body` on a pooled or fresh connection (see h1::Client::post_json).
pub async fn post_json(
    client: &Client,
    pool: &Arc<Pool>,
    authority: &str,
    path: &str,
    body: &[u8],
    request_id: &str,
) -> Result<Response, LegFailure> {
    let uri: Uri = path
        .parse()
        .map_err(|e| LegFailure::BadAnswer(format!("cannot request {path}: {e}")))?;
    let host = HeaderValue::from_str(authority)
        .map_err(|_| LegFailure::BadAnswer(format!("{authority} is not a host")))?;
    let id = HeaderValue::from_str(request_id).map_err(|_| {
        LegFailure::BadAnswer(format!("request id {request_id:?} is not a header value"))
    })?;
    let body = Bytes::copy_from_slice(body);
    loop {
        let (mut p, reused) = match pool.take(authority) {
            Some(p) => (p, true),
            None => {
                let tcp = client.connect_tcp(authority).await?;
                let (send, conn) = http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(|e| LegFailure::Connect(innermost_cause(&e)))?;
                (Pooled { send, conn }, false)
            }
        };
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        let h = req.headers_mut();
        h.insert(header::HOST, host.clone());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert("x-request-id", id.clone());
        if let Some(k) = client.engine_key() {
            h.insert(header::AUTHORIZATION, k.clone());
        }
        let mut answer = std::pin::pin!(p.send.send_request(req));
        let got = std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = answer.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(|e| fail_of(&e)));
            }
            match Pin::new(&mut p.conn).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(_) => match answer.as_mut().poll(cx) {
                    Poll::Ready(r) => Poll::Ready(r.map_err(|e| fail_of(&e))),
                    Poll::Pending => Poll::Ready(Err(Fail::Early(
                        "the connection closed before an answer".into(),
                    ))),
                },
            }
        })
        .await;
        match got {
            Ok(resp) => {
                let (parts, incoming) = resp.into_parts();
                return Ok(Response::from_hyper(
                    parts.status.as_u16(),
                    parts.headers.get(header::CONTENT_TYPE).cloned(),
                    Body {
                        incoming,
                        conn: Some(p),
                        back_to: Some((pool.clone(), authority.to_string())),
                        pending_error: None,
                        ended: false,
                    },
                ));
            }
            Err(Fail::Early(_)) if reused => continue,
            Err(Fail::Early(msg)) => return Err(LegFailure::Body(msg)),
            Err(Fail::Leg(f)) => return Err(f),
        }
    }
}

impl Body {
    /// Everything of the body that has arrived, in one piece; `None` at its end.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        if let Some(e) = self.pending_error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        let mut first: Option<Bytes> = None;
        let mut more: Option<BytesMut> = None;
        loop {
            let mut conn_gone = self.conn.is_none();
            if let Some(p) = &mut self.conn
                && Pin::new(&mut p.conn).poll(cx).is_ready()
            {
                self.conn = None;
                conn_gone = true;
            }
            let step = Pin::new(&mut self.incoming).poll_frame(cx);
            let out = |first: Option<Bytes>, more: Option<BytesMut>| match (first, more) {
                (_, Some(m)) => Some(m.freeze()),
                (f, None) => f,
            };
            match step {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers
                    };
                    if data.is_empty() {
                        continue;
                    }
                    match (&first, &mut more) {
                        (None, _) => first = Some(data),
                        (Some(f), None) => {
                            let mut m = BytesMut::with_capacity(f.len() + data.len());
                            m.extend_from_slice(f);
                            m.extend_from_slice(&data);
                            more = Some(m);
                        }
                        (Some(_), Some(m)) => m.extend_from_slice(&data),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.ended = true;
                    self.conn = None;
                    let err = if e.is_incomplete_message() {
                        BodyError::Closed
                    } else {
                        BodyError::Read(std::io::Error::other(innermost_cause(&e)))
                    };
                    return match out(first, more) {
                        Some(d) => {
                            self.pending_error = Some(err);
                            Poll::Ready(Some(Ok(d)))
                        }
                        None => Poll::Ready(Some(Err(err))),
                    };
                }
                Poll::Ready(None) => {
                    self.finish();
                    return Poll::Ready(out(first, more).map(Ok));
                }
                Poll::Pending => {
                    return match out(first, more) {
                        Some(d) => Poll::Ready(Some(Ok(d))),
                        None if conn_gone => {
                            self.ended = true;
                            Poll::Ready(Some(Err(BodyError::Closed)))
                        }
                        None => Poll::Pending,
                    };
                }
            }
        }
    }

    fn finish(&mut self) {
        self.ended = true;
        if let (Some(mut p), Some((pool, authority))) = (self.conn.take(), self.back_to.take()) {
            let mut cx = Context::from_waker(Waker::noop());
            if Pin::new(&mut p.conn).poll(&mut cx).is_pending() {
                pool.put(authority, p);
            }
        }
    }

    /// Whether the whole body has been read.
    pub fn ended(&self) -> bool {
        self.ended
    }
}
