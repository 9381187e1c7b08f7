//! A TCP relay in front of an engine that can freeze as a loaded machine does: while
//! frozen it accepts nothing and its accept queue is full, so a new connection to it times
//! out in `connect` (the kernel drops the SYN) instead of being refused, and the
//! connections it relayed are cut. The engine behind it runs on, the same process.

use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::watch;

/// The relay; dropped, it stops.
pub struct Gate {
    /// Where clients connect: `http://127.0.0.1:PORT`.
    pub base: String,
    addr: SocketAddr,
    frozen: watch::Sender<bool>,
    /// Connections the test holds in the accept queue to keep it full.
    held: Mutex<Vec<TcpStream>>,
    task: tokio::task::JoinHandle<()>,
}

impl Gate {
    /// A relay to `target` (`HOST:PORT`) on a port of its own, open.
    pub fn open(target: &str) -> Gate {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a socket");
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        sock.bind(&any.into()).expect("bind the gate");
        // The smallest accept queue: one connection, so a second fills it.
        sock.listen(0).expect("listen");
        sock.set_nonblocking(true).unwrap();
        let addr = sock.local_addr().unwrap().as_socket().unwrap();
        let listener = tokio::net::TcpListener::from_std(sock.into()).unwrap();
        let (frozen, rx) = watch::channel(false);
        let task = tokio::spawn(relay(listener, target.to_string(), rx));
        Gate {
            base: format!("http://{addr}"),
            addr,
            frozen,
            held: Mutex::new(Vec::new()),
            task,
        }
    }

    /// Stops accepting, cuts what it relays and fills its accept queue: from now on a
    /// connect to it times out.
    pub async fn freeze(&self) {
        self.frozen.send_replace(true);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let addr = self.addr;
        let held = tokio::task::spawn_blocking(move || {
            let mut held = Vec::new();
            for _ in 0..8 {
                match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
                    Ok(s) => held.push(s),
                    Err(_) => return held,
                }
            }
            panic!("the gate's accept queue never filled: 8 connections queued");
        })
        .await
        .unwrap();
        *self.held.lock().unwrap() = held;
    }

    /// Accepts again.
    pub fn thaw(&self) {
        self.held.lock().unwrap().clear();
        self.frozen.send_replace(false);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accepts while open and relays each connection to `target`; freezing cuts them all.
async fn relay(
    listener: tokio::net::TcpListener,
    target: String,
    mut frozen: watch::Receiver<bool>,
) {
    let mut relays = tokio::task::JoinSet::new();
    loop {
        if *frozen.borrow_and_update() {
            relays.abort_all();
            if frozen.changed().await.is_err() {
                return;
            }
            continue;
        }
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((mut client, _)) = accepted else { continue };
                let target = target.clone();
                while relays.try_join_next().is_some() {}
                relays.spawn(async move {
                    if let Ok(mut engine) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut engine).await;
                    }
                });
            }
            changed = frozen.changed() => if changed.is_err() { return },
        }
    }
}
