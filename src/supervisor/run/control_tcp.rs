//! The supervisors' TCP control channel: the same requests as the Unix socket, served at
//! the node's address to the other nodes' supervisors once they have proven the cluster's
//! secret ([`crate::control::auth`]). A peer that fails the handshake is refused and logged.

use crate::control::auth::{self, Secret};
use crate::supervisor::run::control_server::{Handlers, Origin, connection};
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::TcpListener;

/// How long a peer may take over the handshake.
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(5);

/// Accepts peers until the listener fails; each connection gets its own task.
pub async fn serve(listener: TcpListener, handlers: Handlers, secret: Secret, cluster: String) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("control channel: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (h, secret, cluster) = (handlers.clone(), secret.clone(), cluster.clone());
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut read = BufReader::new(read);
            let shake = auth::accept(&mut read, &mut write, &secret, &cluster);
            match tokio::time::timeout(HANDSHAKE_WITHIN, shake).await {
                Ok(Ok(())) => connection(read, write, h, Origin::Peer).await,
                Ok(Err(e)) => {
                    tracing::warn!("control channel: refused a connection from {from}: {e}");
                    h.ctx.console.event(&format!(
                        "control channel: refused a connection from {from}: {e}"
                    ));
                }
                Err(_) => tracing::warn!(
                    "control channel: {from} did not finish the handshake within {HANDSHAKE_WITHIN:?}"
                ),
            }
        });
    }
}
