//! Reading one request or answer (a JSON line) with a bound on its length: a longer
//! frame is refused after reading at most the bound, never buffered whole, never echoed.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The longest request another node's supervisor may send (1 MiB): a plan's service
/// with its files and settings is far shorter.
pub const PEER_FRAME_MAX: usize = 1 << 20;

/// The longest line a client without a certificate may send (a join), as before the
/// handshake of old: 4 KiB.
pub const UNAUTHENTICATED_FRAME_MAX: usize = 4096;

/// The longest request on this machine's Unix socket, and the longest answer a client
/// reads (a status report of a large cluster, a service's settings, log lines).
pub const LOCAL_FRAME_MAX: usize = 16 << 20;

/// Why no frame was read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("a frame longer than {max} bytes was refused")]
    TooLong { max: usize },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Reads the next frame (without its newline) into `buf`; Ok(false) at the end of the
/// input. At most `max` bytes (plus what the reader had buffered) are ever held.
pub async fn read_frame(
    r: &mut (impl AsyncBufRead + Unpin),
    max: usize,
    buf: &mut Vec<u8>,
) -> Result<bool, FrameError> {
    buf.clear();
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return Ok(!buf.is_empty());
        }
        if let Some(i) = avail.iter().position(|&b| b == b'\n') {
            if buf.len() + i > max {
                return Err(FrameError::TooLong { max });
            }
            buf.extend_from_slice(&avail[..i]);
            r.consume(i + 1);
            return Ok(true);
        }
        let n = avail.len();
        if buf.len() + n > max {
            return Err(FrameError::TooLong { max });
        }
        buf.extend_from_slice(avail);
        r.consume(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_are_read_up_to_the_bound_and_no_further() {
        let input = b"{\"a\":1}\n\nlast".to_vec();
        let mut r = tokio::io::BufReader::new(&input[..]);
        let mut buf = Vec::new();
        assert!(read_frame(&mut r, 16, &mut buf).await.unwrap());
        assert_eq!(buf, b"{\"a\":1}");
        assert!(read_frame(&mut r, 16, &mut buf).await.unwrap());
        assert!(buf.is_empty());
        assert!(read_frame(&mut r, 16, &mut buf).await.unwrap());
        assert_eq!(buf, b"last");
        assert!(!read_frame(&mut r, 16, &mut buf).await.unwrap());

        let long = vec![b'x'; 1000];
        let mut r = tokio::io::BufReader::with_capacity(64, &long[..]);
        let e = read_frame(&mut r, 100, &mut buf).await.unwrap_err();
        assert!(matches!(e, FrameError::TooLong { max: 100 }));
        assert!(buf.len() <= 100, "{}", buf.len());
    }
}
