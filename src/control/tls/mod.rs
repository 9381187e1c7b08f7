//! The supervisors' channel between machines: TLS 1.3 (rustls, ring provider) with a
//! certificate authority of the cluster's own, made by the head at its first `up` and kept
//! in its state dir, and a certificate per node signed by it. Both sides of every
//! connection show their certificate and check the other's against the cluster's CA, so
//! nothing a node says to another can be read or changed on the way, and a node knows
//! which node it talks to (the certificate names it): that is what decides what a peer
//! may ask ([`crate::control::PeerRequest`]).
//!
//! A node the head starts over SSH gets its certificate and key through the SSH
//! connection. A node started by hand joins: its join token ([`JoinToken`], made by
//! `pdctl join-token` on the head for one node, good once, expiring) pins the CA (the
//! SHA-256 of its certificate) and carries a random secret of its own; the node checks
//! the head's certificate chains to exactly that CA before it proves the token (a
//! signature bound to this TLS session by an Ed25519 key the token's secret seeds,
//! [`JoinToken::proof`]; the head keeps only the public half, which cannot prove) and
//! takes the certificate the head issues it. The token is spent when the node first uses
//! that certificate, so a join whose answer was lost is asked again. Only the head holds
//! the CA's key and the cluster's secret.
//!
//! The head keeps a book of what it issued ([`Book`], `tls/book.json`): each node's
//! latest certificate (serial, SHA-256, expiry) and each join token (its hash, node,
//! expiry, use). It accepts from a node only the latest certificate it issued it, so a
//! node joining again, or started again over SSH, revokes the one before.
//!
//! Certificates are renewed over the channel itself ([`RenewRequest`]): a node makes a
//! new key and asks the head, over a connection its current certificate opened, to
//! certify it; the head signs it for the node that certificate names (never a name the
//! node gives) and records it as pending: the old one stays accepted until the node first
//! uses the new one (or [`RENEW_GRACE_S`] passes), and a renewal asked again for the same
//! key is sent the same certificate, so a lost answer locks no node out. A node asks when the head's
//! answer to its status poll says so ([`Accepted::renew`]: a certificate that joined,
//! or was renewed, before the head's supervisor started, i.e. at every `up` of the head)
//! or when less than [`RENEW_WITHIN_S`] is left. The same answer tells the nodes which
//! certificate the head accepts of each node, so a node refuses a replaced one too. The
//! head's own certificate is the exception: a node takes only the one it learned at its
//! join, or one a rotation signed by it names (`rotation.rs`).
//!
//! # Rooms
//!
//! Lowest first; each file imports only from those above it in this list and from this
//! `mod.rs` (the words they all share: paths, [`TlsError`], hashes, names, file helpers).
//!
//! - `book.rs`: the head's book ([`Book`]): what it issued each node, its join tokens.
//! - `creds.rs`: a node's credentials ([`NodeCreds`]) as kept in its state dir.
//! - `ca.rs`: the cluster's CA ([`ClusterCa`]), which signs node certificates.
//! - `pinned.rs`: the verifier a joining node trusts the head with (the pinned CA).
//! - `token.rs`: join tokens ([`JoinToken`], [`TokenSecret`]) and their proofs.
//! - `rotation.rs`: the head's certificate rotated, signed by the one before.
//! - `channel.rs`: a node's side of the channel ([`PeerTls`]): its configurations and
//!   which certificate of each node it accepts.
//! - `join.rs`: the head answering a join.
//! - `renewal.rs`: a node renewing its certificate, and the head answering it.

mod book;
mod ca;
mod channel;
mod creds;
mod join;
mod pinned;
mod renewal;
mod rotation;
mod token;

pub use book::{Accepted, Book, HeadRotation, Issued, Pending, RENEW_GRACE_S, TokenRecord};
pub use ca::ClusterCa;
pub use channel::PeerTls;
pub use creds::NodeCreds;
pub use renewal::{RENEW_EXPORTER_LABEL, RenewRequest, Renewal};
pub use rotation::{HeadAtUp, head_creds_at_up, stage_head_rotation};
pub use token::{JOIN_EXPORTER_LABEL, JoinToken, TokenSecret, proof_holds};

use rustls::pki_types::ServerName;
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Folder of a cluster's state dir that holds its TLS files (mode 0700).
pub const TLS_DIR: &str = "tls";
const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";
const NODE_CERT: &str = "node.pem";
const NODE_KEY: &str = "node.key";
const NODE_NAME: &str = "node.name";
/// On a node other than the head: the head's certificate it takes for the head's.
const HEAD_CERT: &str = "head.pem";
/// On a node other than the head: the head's next certificate, once the head announced a
/// rotation signed with the one before.
const HEAD_NEXT: &str = "head-next.pem";
/// On the head: the key and certificate of a rotation staged (`pdctl join-token
/// --rotate-head`), put to use at the head's next `up`.
const NEXT_CERT: &str = "next.pem";
const NEXT_KEY: &str = "next.key";

/// How long a node certificate is good for. The head's own is made again at its `up`
/// when less than [`RENEW_WITHIN_S`] is left, a node's started over SSH at every `up` of
/// the head; a node that joined renews its own over the channel at every `up` of the
/// head ([`RenewRequest`]).
pub const CERT_LIFETIME_S: u64 = 365 * 86_400;
/// A certificate with less than this left is made again: the head's own at its `up`, a
/// running node's over the channel.
pub const RENEW_WITHIN_S: u64 = 30 * 86_400;
/// How long a join token is good for unless `--ttl` says otherwise.
pub const DEFAULT_TOKEN_TTL_S: u64 = 3600;

/// What can go wrong with the channel's certificates and keys.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {why}; remove the folder to make new credentials (on the head) or join again", path.display())]
    Bad { path: PathBuf, why: String },
    #[error("making the cluster's certificates: {0}")]
    Make(String),
    #[error("setting up TLS: {0}")]
    Config(String),
    #[error(
        "the join token is not one `pdctl join-token` prints ({0}); on the head run `pdctl join-token --node NODE` and give the whole line"
    )]
    Token(&'static str),
    #[error("the head's book of certificates and join tokens {}: {why}", path.display())]
    Book { path: PathBuf, why: String },
}

/// Seconds since the Unix epoch now.
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The TLS provider every side uses: ring, TLS 1.3 only.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The DNS name a node's certificate is made for: its name in hex (node names are free
/// text; hex is unambiguous and always a valid DNS label), split in labels of 60.
pub fn node_dns(node: &str) -> String {
    let hex = hex::encode(node.as_bytes());
    let hex = if hex.is_empty() {
        "00".to_string()
    } else {
        hex
    };
    let labels: Vec<&str> = hex
        .as_bytes()
        .chunks(60)
        .map(|c| std::str::from_utf8(c).expect("hex is ASCII"))
        .collect();
    format!("n{}.node.pdctl", labels.join(".n"))
}

fn server_name(node: &str) -> ServerName<'static> {
    ServerName::try_from(node_dns(node)).expect("node_dns makes valid DNS names")
}

/// SHA-256 of a certificate, hex: what a join token pins.
pub fn cert_hash(der: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(der))
}

fn read_text(path: &Path) -> Result<Option<String>, TlsError> {
    super::auth::read_if_there(path).map_err(|source| TlsError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    })
}

/// Removes the file `path` if it is there.
fn remove(path: &Path) -> Result<(), TlsError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TlsError::Io {
            what: "remove",
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes `text` to `path` (atomically), readable by its owner only.
fn write_private(path: &Path, text: &str) -> Result<(), TlsError> {
    super::auth::write_private(path, text.as_bytes()).map_err(|(what, source)| TlsError::Io {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn make_dir(dir: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| TlsError::Io {
            what: "create",
            path: dir.to_path_buf(),
            source,
        })
}

/// Year, month and day (UTC) of Unix time `s`, for a certificate's dates.
pub fn ymd(s: u64) -> (i32, u8, u8) {
    let t = i64::try_from(s)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or(time::PrimitiveDateTime::MAX.assume_utc());
    (t.year(), t.month().into(), t.day())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_become_dns_names_one_to_one() {
        assert_eq!(node_dns("head"), "n68656164.node.pdctl");
        assert_ne!(node_dns("Head"), node_dns("head"));
        let long = "x".repeat(45);
        assert!(ServerName::try_from(node_dns(&long)).is_ok());
        assert!(ServerName::try_from(node_dns("a b_ü")).is_ok());
    }
}
