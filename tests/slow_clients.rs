//! The proxy's client port against clients that cannot authenticate or will not finish:
//! half-sent requests (slowloris), idle kept-alive connections, more connections than the
//! cap, a wrong key with a large body announced. Each must be closed or refused in its
//! time while a normal client is still served (docs/security.md, "Slow and idle clients").

use crate::common::proxy as fake;

use fake::{FakeEngine, ProxyProcess, proxy_args};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "client-secret";

fn completion() -> serde_json::Value {
    json!({"model": "fake-model", "prompt": "x", "max_tokens": 4})
}

/// Reads `s` until the proxy closes it or `by` passes: the bytes read and whether it
/// closed (end of stream or reset) in time.
async fn closed_by(s: &mut TcpStream, by: Instant) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = by.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, false),
        }
    }
}

/// Open file descriptors of process `pid`.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or_else(|e| panic!("cannot count the proxy's descriptors: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_half_sent_requests_are_closed_in_the_header_timeout_and_others_are_served() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    // The default: long enough that all 2,000 are connected and held before the first
    // is closed, even with five other tests on the machine's two cores.
    let timeout_s = 10;
    let args = proxy_args(
        &[&p],
        &[&d],
        &["--header-read-timeout-s", &timeout_s.to_string()],
    );
    let proxy = ProxyProcess::start_with_env(&args, &[("PDCTL_API_KEY", KEY)]).await;
    let before = descriptors(proxy.pid());

    // 2,000 connections that each send half a request line and then nothing.
    let addr = format!("127.0.0.1:{}", proxy.port);
    let mut half = Vec::new();
    for _ in 0..20 {
        let batch = (0..100).map(|_| async {
            let mut s = TcpStream::connect(&addr).await.expect("connect");
            s.write_all(b"POST /v1/comp").await.expect("half a request");
            (s, Instant::now())
        });
        half.extend(futures_util::future::join_all(batch).await);
    }
    assert_eq!(half.len(), 2000);
    // The proxy takes them from its listen queue as it gets the CPU (tests run side by
    // side on two cores): wait until it holds them.
    let holds = crate::common::eventually(Duration::from_secs(5), || async {
        descriptors(proxy.pid()) >= before + 1900
    })
    .await;
    let held = descriptors(proxy.pid());
    assert!(holds, "the proxy holds {held} descriptors, {before} before");

    // Meanwhile a normal client is answered.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = format!("{}/v1/completions", proxy.url);
    let mut answered = 0;
    for _ in 0..100 {
        let r = client
            .post(&url)
            .bearer_auth(KEY)
            .json(&completion())
            .send()
            .await;
        if r.is_ok_and(|r| r.status() == 200) {
            answered += 1;
        }
    }
    assert!(
        answered >= 95,
        "a normal client got {answered} answers of 100"
    );

    // Every half request is closed within the header timeout (a second's slack for a
    // loaded machine), counted from when it was sent.
    let slack = Duration::from_secs(timeout_s + 1);
    let mut open = 0;
    for (s, sent) in half.iter_mut() {
        let (_, closed) = closed_by(s, *sent + slack).await;
        if !closed {
            open += 1;
        }
    }
    assert_eq!(
        open, 0,
        "half requests still open {slack:?} after they were sent"
    );
    drop(half);
    let settled = crate::common::eventually(Duration::from_secs(5), || async {
        descriptors(proxy.pid()) <= before + 10
    })
    .await;
    assert!(
        settled,
        "the proxy still holds {} descriptors ({before} before)",
        descriptors(proxy.pid())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_is_answered_503_saying_why_and_served_once_one_closes() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let args = proxy_args(&[&p], &[&d], &["--max-client-connections", "4"]);
    let proxy = ProxyProcess::start(&args).await;
    let addr = format!("127.0.0.1:{}", proxy.port);
    // The proxy's own /health wait may still hold a kept-alive connection: let it close.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(&addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut over = TcpStream::connect(&addr).await.unwrap();
    let (said, closed) = closed_by(&mut over, Instant::now() + Duration::from_secs(5)).await;
    let said = String::from_utf8_lossy(&said);
    assert!(closed, "the connection past the cap was left open");
    assert!(said.starts_with("HTTP/1.1 503"), "{said}");
    assert!(said.contains("max_client_connections"), "{said}");
    drop(idle);
    let served = crate::common::eventually(Duration::from_secs(5), || async {
        reqwest::get(format!("{}/health", proxy.url))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(served, "no client served once the idle connections closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_and_a_wrong_key_is_refused_before_the_body() {
    let (p, d) = (FakeEngine::start("P").await, FakeEngine::start("D").await);
    let args = proxy_args(&[&p], &[&d], &["--header-read-timeout-s", "2"]);
    let proxy = ProxyProcess::start_with_env(&args, &[("PDCTL_API_KEY", KEY)]).await;
    let addr = format!("127.0.0.1:{}", proxy.port);

    // One request answered on a kept-alive connection, then silence: closed after the limit.
    let mut kept = TcpStream::connect(&addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    let answered = Instant::now();
    let (_, closed) = closed_by(&mut kept, answered + Duration::from_secs(4)).await;
    assert!(
        closed,
        "an idle kept-alive connection stayed open past the limit"
    );
    assert!(
        answered.elapsed() >= Duration::from_millis(1500),
        "closed after {:?}, before the limit",
        answered.elapsed()
    );

    // A wrong key with a megabyte announced and not sent: refused on the headers.
    let mut wrong = TcpStream::connect(&addr).await.unwrap();
    wrong
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nope\r\n\
              content-type: application/json\r\ncontent-length: 1048576\r\n\r\n",
        )
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(2), wrong.read(&mut buf))
        .await
        .expect("no answer before the body was sent")
        .unwrap();
    let said = String::from_utf8_lossy(&buf[..n]);
    assert!(said.starts_with("HTTP/1.1 401"), "{said}");
}
