//! Hands the relay every chunk of decode's streamed body that has arrived, at once, so
//! that events that come together go to the client in one write.
//!
//! hyper's client hands a response body over one HTTP chunk at a time, each a wake-up of
//! its connection task, and a streaming engine writes one chunk per event. Relayed as they
//! came, a fast stream cost one `writev` to the client per event: on the proxy-CPU bench
//! (18 events per answer, engines at zero latency) 20 system calls per request and most of
//! the proxy's CPU. When the engine has already sent the next chunk, it is two scheduler
//! turns away; on a fast stream ([`FAST`]) the relay waits up to [`TURNS`] turns for it
//! (microseconds; never a timer) before it writes what it has. A stream paced by the engine
//! (a token every few milliseconds) is relayed exactly as before, chunk by chunk, without
//! waiting: there the turns would find nothing and only cost the runtime a poll each.
//!
//! It runs in the relay's own poll (the client connection's task): a reader task of its own
//! between the two was tried and cost a cross-thread wake-up per chunk, which on an idle
//! runtime doubled the CPU of a slow stream.

use super::upstream::innermost_cause;
use bytes::{Bytes, BytesMut};
use hyper::body::{Body as _, Incoming};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Scheduler turns to wait for a chunk that is on its way before writing what is in hand.
const TURNS: u32 = 3;

/// Chunks closer together than this mark a fast stream, the only kind worth waiting for.
const FAST: Duration = Duration::from_millis(1);

/// A write to the client holds at most about this much.
const GATHER_MAX: usize = 64 * 1024;

/// What decode's body gave next.
#[derive(Debug)]
pub enum Next {
    /// Everything that arrived since the last call, in one piece.
    Data(Bytes),
    /// The body ended (cleanly as far as HTTP goes).
    Ended,
    /// The body broke off: why.
    Broke(String),
}

/// Decode's body, read so that chunks arriving together come out together. Dropping it
/// drops the body (which cancels the decode request).
pub struct Gathered {
    body: Incoming,
    data: BytesMut,
    /// The end or break seen while gathering, given after `data`.
    held: Option<Next>,
    /// When the last chunk arrived, and whether it came fast after the one before.
    last: Instant,
    fast: bool,
    /// Turns waited for the next chunk since the last one came.
    turns: u32,
    turn: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Gathered {
    /// Starts reading `body`, whose first chunk has just been taken.
    pub fn start(body: Incoming) -> Gathered {
        Gathered {
            body,
            data: BytesMut::new(),
            held: None,
            last: Instant::now(),
            fast: false,
            turns: 0,
            turn: None,
        }
    }

    /// Everything gathered since the last call, else the end, else Pending.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Next> {
        if let Some(turn) = &mut self.turn {
            if turn.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.turn = None;
        }
        loop {
            let next = match self.held.take() {
                Some(end) => end,
                None => match poll_body(&mut self.body, cx) {
                    Poll::Ready(next) => next,
                    Poll::Pending if self.data.is_empty() => return Poll::Pending,
                    Poll::Pending if self.fast && self.turns < TURNS => {
                        self.turns += 1;
                        let mut turn: Pin<Box<dyn Future<Output = ()> + Send>> =
                            Box::pin(tokio::task::yield_now());
                        if turn.as_mut().poll(cx).is_pending() {
                            self.turn = Some(turn);
                            return Poll::Pending;
                        }
                        continue;
                    }
                    Poll::Pending => return Poll::Ready(self.take()),
                },
            };
            match next {
                Next::Data(chunk) => {
                    let now = Instant::now();
                    self.fast = now - self.last < FAST;
                    self.last = now;
                    self.turns = 0;
                    self.data.extend_from_slice(&chunk);
                    if self.data.len() >= GATHER_MAX {
                        return Poll::Ready(self.take());
                    }
                }
                end if !self.data.is_empty() => {
                    self.held = Some(end);
                    return Poll::Ready(self.take());
                }
                end => return Poll::Ready(end),
            }
        }
    }

    fn take(&mut self) -> Next {
        self.turns = 0;
        Next::Data(self.data.split().freeze())
    }
}

/// The next frame of the body, trailers skipped.
fn poll_body(body: &mut Incoming, cx: &mut Context<'_>) -> Poll<Next> {
    loop {
        return match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(chunk) => Poll::Ready(Next::Data(chunk)),
                Err(_trailers) => continue,
            },
            Poll::Ready(Some(Err(e))) => Poll::Ready(Next::Broke(format!(
                "the stream broke off: {}",
                innermost_cause(&e)
            ))),
            Poll::Ready(None) => Poll::Ready(Next::Ended),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::sync::mpsc;

    /// An engine whose streamed answer is whatever the test sends into the channel.
    async fn engine() -> (String, mpsc::UnboundedSender<Bytes>) {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let rx = Arc::new(Mutex::new(Some(rx)));
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || {
                let rx = rx.lock().unwrap().take().expect("one request");
                async move {
                    let events = futures_util::stream::unfold(rx, |mut rx| async move {
                        rx.recv()
                            .await
                            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
                    });
                    axum::body::Body::from_stream(events)
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, tx)
    }

    async fn body_of(url: &str) -> Incoming {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let resp = client.get(url.parse().unwrap()).await.unwrap();
        resp.into_body()
    }

    async fn next(g: &mut Gathered) -> Next {
        tokio::time::timeout(
            Duration::from_secs(10),
            std::future::poll_fn(|cx| g.poll_next(cx)),
        )
        .await
        .expect("the gathered stream hangs")
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_burst_goes_out_in_fewer_pieces_whole_and_in_order_then_the_end() {
        let (url, tx) = engine().await;
        let mut g = Gathered::start(body_of(&url).await);
        let events: Vec<String> = (0..10).map(|i| format!("data: {i}\n\n")).collect();
        for e in &events {
            tx.send(Bytes::from(e.clone())).unwrap();
        }
        drop(tx);
        let (mut got, mut pieces) = (String::new(), 0);
        loop {
            match next(&mut g).await {
                Next::Data(d) => {
                    got.push_str(std::str::from_utf8(&d).unwrap());
                    pieces += 1;
                }
                Next::Ended => break,
                Next::Broke(why) => panic!("broke: {why}"),
            }
        }
        assert_eq!(got, events.concat());
        assert!(
            pieces < events.len(),
            "{pieces} pieces for {} events",
            events.len()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_event_is_handed_over_without_waiting_for_the_next() {
        // The engine sends the second event only once the first has come through: a
        // gatherer that held events back for more would hang here.
        let (url, tx) = engine().await;
        let mut g = Gathered::start(body_of(&url).await);
        for i in 0..3 {
            tx.send(Bytes::from(format!("data: {i}\n\n"))).unwrap();
            match next(&mut g).await {
                Next::Data(d) => assert_eq!(d, format!("data: {i}\n\n")),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn dropping_it_drops_the_body_and_closes_the_engine_connection() {
        let (url, tx) = engine().await;
        let g = Gathered::start(body_of(&url).await);
        tx.send(Bytes::from_static(b"data: 0\n\n")).unwrap();
        drop(g);
        // The engine sees its client go: its stream's sends fail once the connection is
        // closed and the response stream is dropped.
        let closed = tokio::time::timeout(Duration::from_secs(10), tx.closed()).await;
        assert!(closed.is_ok(), "the engine's stream was never dropped");
    }
}
