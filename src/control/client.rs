//! Client side of the control socket: one request, one response.

use super::{Request, Response, StatusReport};
use crate::vocab::Service;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Why a control request did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no supervisor answers on {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("the supervisor on {path} closed the connection without answering")]
    NoAnswer { path: String },
    #[error("the supervisor on {path} did not answer within {secs} s")]
    Timeout { path: String, secs: u64 },
    #[error("talking to the supervisor on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("the supervisor on {path} sent an answer this pdctl cannot read: {source}")]
    Decode {
        path: String,
        source: serde_json::Error,
    },
    #[error("the supervisor on {path} answered: {message}")]
    Refused { path: String, message: String },
    #[error("the supervisor on {path} answered {what} where {asked} was asked for")]
    Unexpected {
        path: String,
        asked: &'static str,
        what: String,
    },
}

/// Asks the supervisor on `socket` for its status report.
pub async fn status(socket: &Path, timeout: Duration) -> Result<StatusReport, ControlError> {
    ask(
        socket,
        &Request::Status,
        timeout,
        "its status",
        |r| match r {
            Response::Status(report) => Ok(report),
            other => Err(other),
        },
    )
    .await
}

/// Asks the supervisor on `socket` how service `name` is started now (after any
/// `Replace`).
pub async fn spec(socket: &Path, name: &str, timeout: Duration) -> Result<Service, ControlError> {
    let req = Request::Spec {
        service: name.to_string(),
    };
    ask(socket, &req, timeout, "a service's spec", |r| match r {
        Response::Spec { service } => Ok(*service),
        other => Err(other),
    })
    .await
}

/// Sends `req` and takes the answer `pick` accepts; an error answer is `Refused`, any
/// other `Unexpected` (what was `asked` for named).
async fn ask<T>(
    socket: &Path,
    req: &Request,
    timeout: Duration,
    asked: &'static str,
    pick: impl FnOnce(Response) -> Result<T, Response>,
) -> Result<T, ControlError> {
    let path = socket.display().to_string();
    match pick(send(socket, req, timeout).await?) {
        Ok(t) => Ok(t),
        Err(Response::Error { message }) => Err(ControlError::Refused { path, message }),
        Err(other) => Err(ControlError::Unexpected {
            path,
            asked,
            what: format!("{other:?}"),
        }),
    }
}

/// Sends `req` to the supervisor listening on `socket` and waits up to `timeout` for its answer.
pub async fn send(
    socket: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Response, ControlError> {
    let path = socket.display().to_string();
    let work = async {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|source| ControlError::Connect {
                path: path.clone(),
                source,
            })?;
        let (read, mut write) = stream.into_split();
        let mut line = serde_json::to_string(req).expect("requests serialize");
        line.push('\n');
        let io = |source| ControlError::Io {
            path: path.clone(),
            source,
        };
        write.write_all(line.as_bytes()).await.map_err(io)?;
        let mut reader = BufReader::new(read);
        let mut answer = String::new();
        let n = reader.read_line(&mut answer).await.map_err(io)?;
        if n == 0 {
            return Err(ControlError::NoAnswer { path: path.clone() });
        }
        serde_json::from_str(&answer).map_err(|source| ControlError::Decode {
            path: path.clone(),
            source,
        })
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(ControlError::Timeout {
            path,
            secs: timeout.as_secs(),
        }),
    }
}
