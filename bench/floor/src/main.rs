//! The floor: the least a prefill/decode proxy does for one non-streamed or streamed
//! completion under the NIXL protocol, on hyper. Prefill gets the request with
//! `max_tokens` 1 and `do_remote_decode`; its `kv_transfer_params` go into the decode
//! request; decode's answer is relayed as it comes. No routing (one prefill, one decode),
//! no metrics, no checks of what the engines answer, no retries, no limits, no log.
//!
//! `pdctl-floor PORT PREFILL_URL DECODE_URL` (URLs as `http://HOST:PORT`). Any GET is
//! answered 200 (what the bench scripts wait on); any POST is proxied to the same path.
//! Several engines of a leg, comma-separated, are taken in turn (one counter): the least
//! routing there is, so that bench/scale-cost.sh can tell what spreading the legs over many
//! engines costs on the machine from what pdctl's routing costs.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Map, Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Answer = Response<BoxBody<Bytes, hyper::Error>>;

/// The engines and the pooled client that reaches them.
struct Floor {
    client: Client<HttpConnector, Full<Bytes>>,
    prefill: Vec<String>,
    decode: Vec<String>,
    turn: AtomicUsize,
}

fn urls(list: &str) -> Vec<String> {
    list.split(',')
        .map(|u| u.trim_end_matches('/').to_string())
        .collect()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, port, prefill, decode] = args.as_slice() else {
        eprintln!("usage: pdctl-floor PORT PREFILL_URL DECODE_URL");
        std::process::exit(2);
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let floor = Arc::new(Floor {
        client: Client::builder(TokioExecutor::new()).build(connector),
        prefill: urls(prefill),
        decode: urls(decode),
        turn: AtomicUsize::new(0),
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port.parse::<u16>().unwrap()))
        .await
        .expect("the port is free");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let floor = floor.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(floor.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(f: Arc<Floor>, req: Request<Incoming>) -> Result<Answer, Infallible> {
    if req.method() == Method::GET {
        return Ok(plain(StatusCode::OK, "{}"));
    }
    Ok(two_legs(&f, req)
        .await
        .unwrap_or_else(|why| plain(StatusCode::BAD_GATEWAY, &why)))
}

/// Prefill, then decode with what prefill handed over; decode's answer as it comes.
async fn two_legs(f: &Floor, req: Request<Incoming>) -> Result<Answer, String> {
    let path = req.uri().path().to_string();
    let body = req.into_body().collect().await.map_err(|e| e.to_string())?;
    let Ok(Value::Object(mut original)) = serde_json::from_slice(&body.to_bytes()) else {
        return Ok(plain(StatusCode::BAD_REQUEST, "a JSON object, please"));
    };
    let mut first = original.clone();
    first.insert("max_tokens".into(), json!(1));
    first.insert("stream".into(), json!(false));
    first.remove("stream_options");
    first.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false}),
    );
    let turn = f.turn.fetch_add(1, Ordering::Relaxed);
    let prefill = &f.prefill[turn % f.prefill.len()];
    let decode = &f.decode[turn % f.decode.len()];
    let answer = post(f, prefill, &path, &first).await?;
    let bytes = answer
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    let answer: Value = serde_json::from_slice(&bytes.to_bytes()).map_err(|e| e.to_string())?;
    if let Some(params) = answer.get("kv_transfer_params") {
        original.insert("kv_transfer_params".into(), params.clone());
    }
    let decoded = post(f, decode, &path, &original).await?;
    Ok(decoded.map(BodyExt::boxed))
}

async fn post(
    f: &Floor,
    base: &str,
    path: &str,
    body: &Map<String, Value>,
) -> Result<Response<Incoming>, String> {
    let req = Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .map_err(|e| e.to_string())?;
    f.client.request(req).await.map_err(|e| e.to_string())
}

fn plain(status: StatusCode, text: &str) -> Answer {
    let body = Full::new(Bytes::from(text.to_string()))
        .map_err(|never| match never {})
        .boxed();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r
}
