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
//! certificate the head accepts of each node, so a node refuses a replaced one too.

use super::auth::Secret;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Folder of a cluster's state dir that holds its TLS files (mode 0700).
pub const TLS_DIR: &str = "tls";
const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";
const NODE_CERT: &str = "node.pem";
const NODE_KEY: &str = "node.key";
const NODE_NAME: &str = "node.name";
/// The head's book of certificates issued and join tokens made (mode 0600).
const BOOK: &str = "book.json";
/// Held (flock) while the book is read and written again: `pdctl join-token` and the
/// head's supervisor both change it.
const BOOK_LOCK: &str = "book.lock";

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

/// The label under which a join is exported from the TLS session (RFC 5705), so a proof
/// of the secret made for one session is worth nothing in another.
pub const JOIN_EXPORTER_LABEL: &[u8] = b"EXPORTER-pdctl-join-v1";
/// The label under which a renewal's proof of the new key is exported from the session.
pub const RENEW_EXPORTER_LABEL: &[u8] = b"EXPORTER-pdctl-renew-v1";
/// How a certificate renewed over the channel is recorded in the book.
const RENEWED: &str = "renew";

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

/// One certificate the head issued a node: the only one it accepts from that node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    /// The certificate's serial number (hex), as `openssl x509 -serial` shows it.
    pub serial: String,
    /// SHA-256 of the certificate (hex): what a connection's certificate is matched by.
    pub sha256: String,
    /// When it was issued and when it expires (Unix seconds).
    pub issued_s: u64,
    pub not_after_s: u64,
    /// How the node came by it: `head`, `ssh`, `join` or `renew`.
    pub how: String,
    /// A renewed certificate the head sent the node and the node has not used yet: both
    /// are accepted until it does (then the new one replaces this entry) or until
    /// [`RENEW_GRACE_S`] has passed (then only the new one is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Pending>,
}

/// A renewal answered, kept until its node first uses the certificate: a node whose
/// answer was lost asks again with the same key and is sent the same certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub serial: String,
    pub sha256: String,
    pub issued_s: u64,
    pub not_after_s: u64,
    /// The new public key it certifies (hex), as the renewal asked.
    pub public: String,
    /// The certificate itself (public), to send again.
    pub cert_pem: String,
}

/// How long a node's certificate stays accepted after the head answered its renewal
/// without the node having used the new one: long enough for every retry of a node
/// stopped or cut off for a while, short enough that a key left behind stops working.
pub const RENEW_GRACE_S: u64 = 86_400;

/// A join token as the head keeps it: never the token's secret, only the public half of
/// the key its secret derives ([`JoinToken::verifier`]), which checks a join's proof but
/// cannot make one: whoever reads the book cannot redeem the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// What names the token (`--revoke ID`); printed in the token, not secret.
    pub id: String,
    /// The one node it lets join.
    pub node: String,
    /// The Ed25519 public key (hex) of the token's proof key.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub verifier: String,
    /// What an older pdctl kept instead (SHA-256 of the secret, which was the proof's key
    /// itself): such a token is refused, and a new one must be made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    pub created_s: u64,
    pub expires_s: u64,
    /// When the node it joined first spoke with the certificate it was given: the token is
    /// spent then, not when the answer was sent (an answer lost on the way leaves the
    /// token good for the same node once more).
    #[serde(default)]
    pub used_s: Option<u64>,
    /// SHA-256 of the certificate the last join with this token was given, until its node
    /// uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed: Option<String>,
    #[serde(default)]
    pub revoked: bool,
}

impl TokenRecord {
    /// `unused`, `answered` (a join was answered; its node has not used the certificate
    /// yet), `used`, `revoked` or `expired`, at `now`.
    pub fn state(&self, now: u64) -> &'static str {
        if self.revoked {
            "revoked"
        } else if self.used_s.is_some() {
            "used"
        } else if now >= self.expires_s {
            "expired"
        } else if self.handed.is_some() {
            "answered"
        } else {
            "unused"
        }
    }
}

/// What the head tells the other nodes of one node's certificate, with its status: the
/// one certificate it accepts of that node, and whether that node should renew it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    /// SHA-256 of the certificate (hex).
    pub sha256: String,
    /// Its serial number (hex).
    pub serial: String,
    /// When it expires (Unix seconds).
    pub not_after_s: u64,
    /// SHA-256 of a renewed certificate the node has not used yet, accepted as well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
    /// The node should ask for a new one ([`RenewRequest`]): it joined (or renewed)
    /// before the head's supervisor started, i.e. before the head's latest `up`.
    #[serde(default)]
    pub renew: bool,
}

/// The head's book (`tls/book.json`): each node's latest certificate and the join tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Book {
    #[serde(default)]
    pub issued: BTreeMap<String, Issued>,
    #[serde(default)]
    pub tokens: Vec<TokenRecord>,
}

impl Book {
    /// The book kept in `dir` (empty when there is none).
    pub fn read(dir: &Path) -> Result<Book, TlsError> {
        let path = dir.join(BOOK);
        match read_text(&path)? {
            None => Ok(Book::default()),
            Some(text) => serde_json::from_str(&text).map_err(|e| TlsError::Book {
                path,
                why: format!("not one pdctl wrote ({e})"),
            }),
        }
    }

    /// Reads the book of `dir`, lets `f` change it and keeps it again (0600, synced),
    /// holding the book's lock throughout; `f`'s answer, or its refusal (kept unchanged).
    pub fn update<T>(
        dir: &Path,
        f: impl FnOnce(&mut Book) -> Result<T, String>,
    ) -> Result<Result<T, String>, TlsError> {
        use std::os::unix::fs::OpenOptionsExt;
        make_dir(dir)?;
        let lock_path = dir.join(BOOK_LOCK);
        let io = |what, source| TlsError::Io {
            what,
            path: lock_path.clone(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| io("open", e))?;
        let _held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| io("lock", e.into()))?;
        let mut book = Book::read(dir)?;
        let answer = f(&mut book);
        if answer.is_ok() {
            let json = serde_json::to_string_pretty(&book).expect("books serialize");
            write_private(&dir.join(BOOK), &json)?;
        }
        Ok(answer)
    }

    /// Whether `cert` is a certificate the head accepts of `node`: the latest issued it,
    /// or a renewed one it has not used yet (its current one then for [`RENEW_GRACE_S`]).
    pub fn is_latest(&self, node: &str, cert: &[u8]) -> bool {
        let hash = cert_hash(cert);
        self.issued.get(node).is_some_and(|i| match &i.pending {
            Some(p) if p.sha256 == hash => true,
            Some(p) if now_s() >= p.issued_s + RENEW_GRACE_S => false,
            _ => i.sha256 == hash,
        })
    }

    /// Whether `node` using `hash` (a certificate [`Book::is_latest`] accepts) is news
    /// to the book: a renewed certificate's first use, or a join's.
    pub fn unconfirmed(&self, node: &str, hash: &str) -> bool {
        let renewed = self
            .issued
            .get(node)
            .and_then(|i| i.pending.as_ref())
            .is_some_and(|p| p.sha256 == hash);
        let joined = self
            .tokens
            .iter()
            .any(|t| t.node == node && t.used_s.is_none() && t.handed.as_deref() == Some(hash));
        renewed || joined
    }

    /// Records that `node` used the certificate `hash`: a renewed one replaces the one
    /// before (refused from now on), and the join token that handed it is spent.
    pub fn confirm(&mut self, node: &str, hash: &str, now: u64) {
        if let Some(i) = self.issued.get_mut(node)
            && let Some(p) = i.pending.take_if(|p| p.sha256 == hash)
        {
            *i = Issued {
                serial: p.serial,
                sha256: p.sha256,
                issued_s: p.issued_s,
                not_after_s: p.not_after_s,
                how: RENEWED.to_string(),
                pending: None,
            };
        }
        for t in self.tokens.iter_mut() {
            if t.node == node && t.used_s.is_none() && t.handed.as_deref() == Some(hash) {
                t.used_s = Some(now);
            }
        }
    }

    /// The certificate accepted of each node, as the head tells the nodes; one that a
    /// node came by with a join token or a renewal before `started_s` (the start of the
    /// head's supervisor) is marked for renewal. Nodes started over SSH are given a new
    /// one at every `up` of the head instead, and the head makes its own again.
    pub fn accepted(&self, started_s: u64) -> BTreeMap<String, Accepted> {
        self.issued
            .iter()
            .map(|(node, i)| {
                let renewable = i.how == "join" || i.how == RENEWED;
                let accepted = Accepted {
                    sha256: i.sha256.clone(),
                    serial: i.serial.clone(),
                    not_after_s: i.not_after_s,
                    pending: i.pending.as_ref().map(|p| p.sha256.clone()),
                    renew: renewable && i.issued_s < started_s,
                };
                (node.clone(), accepted)
            })
            .collect()
    }
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

fn ca_params(cluster: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("pdctl cluster {cluster} CA"),
    );
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn read_text(path: &Path) -> Result<Option<String>, TlsError> {
    super::auth::read_if_there(path).map_err(|source| TlsError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    })
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

/// The cluster's certificate authority, which only the head holds, with the folder of
/// its book.
pub struct ClusterCa {
    dir: PathBuf,
    cluster: String,
    key: rcgen::KeyPair,
    cert_pem: String,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterCa({}, {})", self.cluster, self.hash())
    }
}

impl ClusterCa {
    /// The CA kept in `dir` (a state dir's `tls/`), if the head made one there.
    pub fn load(dir: &Path, cluster: &str) -> Result<Option<ClusterCa>, TlsError> {
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        let (Some(cert_pem), Some(key_pem)) = (read_text(&cert_path)?, read_text(&key_path)?)
        else {
            return Ok(None);
        };
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(|e| TlsError::Bad {
            path: key_path.clone(),
            why: e.to_string(),
        })?;
        CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| TlsError::Bad {
            path: cert_path.clone(),
            why: e.to_string(),
        })?;
        Ok(Some(ClusterCa {
            dir: dir.to_path_buf(),
            cluster: cluster.to_string(),
            key,
            cert_pem,
        }))
    }

    /// The CA kept in `dir` (a state dir's `tls/`), or a new one made and kept there.
    pub fn load_or_make(dir: &Path, cluster: &str) -> Result<ClusterCa, TlsError> {
        if let Some(ca) = ClusterCa::load(dir, cluster)? {
            return Ok(ca);
        }
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        make_dir(dir)?;
        let key = rcgen::KeyPair::generate().map_err(|e| TlsError::Make(e.to_string()))?;
        let cert = ca_params(cluster)
            .self_signed(&key)
            .map_err(|e| TlsError::Make(e.to_string()))?;
        write_private(&key_path, &key.serialize_pem())?;
        write_private(&cert_path, &cert.pem())?;
        Ok(ClusterCa {
            dir: dir.to_path_buf(),
            cluster: cluster.to_string(),
            key,
            cert_pem: cert.pem(),
        })
    }

    /// SHA-256 of the CA's certificate (what join tokens pin).
    pub fn hash(&self) -> String {
        let der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .expect("the CA certificate was read or made as PEM");
        cert_hash(&der)
    }

    /// The folder of the CA and its book (a state dir's `tls/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new certificate and key for `node`, signed by this CA; good as a server and as
    /// a client, for that node's name only, for [`CERT_LIFETIME_S`]. Recorded in the book
    /// as the node's latest (`how`: `head`, `ssh`, `join`): the one before is refused from
    /// now on.
    pub fn issue(&self, node: &str, how: &str) -> Result<NodeCreds, TlsError> {
        let (creds, issued) = self.sign_new(node, how)?;
        Book::update(&self.dir, |b| {
            b.issued.insert(node.to_string(), issued);
            Ok(())
        })?
        .map_err(TlsError::Make)?;
        Ok(creds)
    }

    /// A new key and certificate for `node` as [`ClusterCa::issue`] makes them, and its
    /// entry for the book, not recorded yet (for a caller that holds the book).
    fn sign_new(&self, node: &str, how: &str) -> Result<(NodeCreds, Issued), TlsError> {
        let key =
            rcgen::KeyPair::generate_for(KEY_ALG).map_err(|e| TlsError::Make(e.to_string()))?;
        let (cert_pem, issued) = self.sign(node, &key, how)?;
        let creds = NodeCreds {
            node: node.to_string(),
            ca_pem: self.cert_pem.clone(),
            cert_pem,
            key_pem: key.serialize_pem(),
        };
        Ok((creds, issued))
    }

    /// A certificate (PEM) for `node`'s public key `public`, signed by this CA as
    /// [`ClusterCa::issue`] signs them, with its entry for the book (not recorded).
    fn sign(
        &self,
        node: &str,
        public: &impl rcgen::PublicKeyData,
        how: &str,
    ) -> Result<(String, Issued), TlsError> {
        let make = |e: rcgen::Error| TlsError::Make(e.to_string());
        let now = now_s();
        let not_after_s = now + CERT_LIFETIME_S;
        let mut serial: [u8; 16] = rand::random();
        serial[0] &= 0x7f;
        serial[0] |= 0x01;
        let issuer = rcgen::Issuer::new(ca_params(&self.cluster), &self.key);
        let mut p = rcgen::CertificateParams::new(vec![node_dns(node)]).map_err(make)?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("pdctl node {node} of cluster {}", self.cluster),
        );
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        p.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let (y, m, d) = ymd(now.saturating_sub(86_400));
        p.not_before = rcgen::date_time_ymd(y, m, d);
        let (y, m, d) = ymd(not_after_s);
        p.not_after = rcgen::date_time_ymd(y, m, d);
        let cert = p.signed_by(public, &issuer).map_err(make)?;
        let issued = Issued {
            serial: hex::encode(serial),
            sha256: cert_hash(cert.der()),
            issued_s: now,
            not_after_s,
            how: how.to_string(),
            pending: None,
        };
        Ok((cert.pem(), issued))
    }
}

/// The kind of key every node certificate holds: ECDSA P-256 (rcgen's default).
const KEY_ALG: &rcgen::SignatureAlgorithm = &rcgen::PKCS_ECDSA_P256_SHA256;

/// A node's new public key as it asks for a certificate: the uncompressed P-256 point.
struct NewPublicKey(Vec<u8>);

impl rcgen::PublicKeyData for NewPublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        KEY_ALG
    }
}

/// Year, month and day (UTC) of Unix time `s`, for a certificate's dates.
pub fn ymd(s: u64) -> (i32, u8, u8) {
    let t = i64::try_from(s)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or(time::PrimitiveDateTime::MAX.assume_utc());
    (t.year(), t.month().into(), t.day())
}

/// A node's credentials on the channel: the cluster's CA certificate, and the node's own
/// certificate and key. `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeCreds {
    pub node: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for NodeCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeCreds({}, ca {})", self.node, self.ca_hash())
    }
}

impl NodeCreds {
    /// The credentials kept in `dir` (a state dir's `tls/`), if there are any.
    pub fn read(dir: &Path) -> Result<Option<NodeCreds>, TlsError> {
        let parts = (
            read_text(&dir.join(NODE_NAME))?,
            read_text(&dir.join(CA_CERT))?,
            read_text(&dir.join(NODE_CERT))?,
            read_text(&dir.join(NODE_KEY))?,
        );
        let (Some(node), Some(ca_pem), Some(cert_pem), Some(key_pem)) = parts else {
            return Ok(None);
        };
        let creds = NodeCreds {
            node: node.trim().to_string(),
            ca_pem,
            cert_pem,
            key_pem,
        };
        creds.check().map_err(|why| TlsError::Bad {
            path: dir.to_path_buf(),
            why,
        })?;
        Ok(Some(creds))
    }

    /// Keeps the credentials in `dir`, every file readable by its owner only.
    pub fn write(&self, dir: &Path) -> Result<(), TlsError> {
        make_dir(dir)?;
        write_private(&dir.join(CA_CERT), &self.ca_pem)?;
        write_private(&dir.join(NODE_CERT), &self.cert_pem)?;
        write_private(&dir.join(NODE_KEY), &self.key_pem)?;
        write_private(&dir.join(NODE_NAME), &format!("{}\n", self.node))
    }

    /// SHA-256 of the CA certificate these credentials trust.
    pub fn ca_hash(&self) -> String {
        CertificateDer::from_pem_slice(self.ca_pem.as_bytes())
            .map(|d| cert_hash(&d))
            .unwrap_or_else(|_| "(unreadable)".into())
    }

    /// Whether every part parses.
    fn check(&self) -> Result<(), String> {
        self.parts().map(|_| ())
    }

    fn parts(
        &self,
    ) -> Result<
        (
            CertificateDer<'static>,
            Vec<CertificateDer<'static>>,
            PrivateKeyDer<'static>,
        ),
        String,
    > {
        let ca = CertificateDer::from_pem_slice(self.ca_pem.as_bytes())
            .map_err(|e| format!("the CA certificate: {e}"))?;
        let cert = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .map_err(|e| format!("the node certificate: {e}"))?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| format!("the node key: {e}"))?;
        Ok((ca.clone(), vec![cert, ca], key))
    }
}

/// A node's side of the channel, made once at start: how it connects to the other
/// nodes (as a client showing its certificate) and how it accepts them (as a server
/// asking for theirs), and, on the head, what it needs to let nodes join. A renewed
/// certificate replaces both configurations for the connections made from then on.
pub struct PeerTls {
    /// The cluster's name, for messages.
    pub cluster: String,
    /// This node.
    pub node: String,
    /// The head node: the only one that may ask another to run, stop or change services.
    pub head: String,
    /// Every node of the cluster, for telling which one a peer's certificate names.
    nodes: Vec<String>,
    /// What this node shows and trusts now (replaced when it renews its certificate).
    current: std::sync::RwLock<Current>,
    /// On the head: the CA, to answer joins and renewals and to accept from each node
    /// only the latest certificate its book records.
    authority: Option<ClusterCa>,
    /// Where this node keeps its credentials (a state dir's `tls/`): a renewed
    /// certificate and key are written there before they are used.
    kept_in: Option<PathBuf>,
    /// When this was made (Unix seconds): on the head, the start of its supervisor.
    started_s: u64,
    /// Elsewhere: the SHA-256 of the certificates the head accepts of each node (its
    /// current one, and a renewed one not used yet), from its last status answer (None
    /// before the first).
    learned: std::sync::RwLock<Option<BTreeMap<String, Vec<String>>>>,
    /// Elsewhere: the key (PEM) of a renewal asked whose certificate is not installed
    /// yet, asked for again with the same key (the head then sends the same certificate).
    renew_key: std::sync::Mutex<Option<String>>,
    /// How many renewed certificates this node has installed: a connection kept from
    /// before one is opened again, so the head sees the new one used and drops the old.
    installed: std::sync::atomic::AtomicU64,
}

/// The credentials a node uses now, and the TLS configurations made of them.
struct Current {
    creds: NodeCreds,
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls({} of {})", self.node, self.cluster)
    }
}

/// What a node sends the head, over a connection its current certificate opened, to
/// renew it: a new public key and a proof that it holds the key. The head certifies the
/// key for the node the connection's certificate names; the request names no node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// The new public key: an uncompressed P-256 point, hex.
    pub renew: String,
    /// An ECDSA P-256 SHA-256 signature (DER, hex) by the new key of the session's
    /// keying material exported under [`RENEW_EXPORTER_LABEL`].
    pub proof: String,
}

/// A renewal under way on a node: the new key (kept here until the head's certificate
/// for it comes back) and the request that asks for it. `Debug` never shows the key.
pub struct Renewal {
    key: rcgen::KeyPair,
    /// What is sent to the head.
    pub request: RenewRequest,
}

impl std::fmt::Debug for Renewal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Renewal({})", self.request.renew)
    }
}

/// The client and server configurations of `creds`.
fn configs(creds: &NodeCreds) -> Result<Current, TlsError> {
    let (ca, chain, key) = creds.parts().map_err(TlsError::Config)?;
    let config = |e: &dyn std::fmt::Display| TlsError::Config(e.to_string());
    let mut roots = RootCertStore::empty();
    roots.add(ca).map_err(|e| config(&e))?;
    let roots = Arc::new(roots);
    let client = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config(&e))?
        .with_root_certificates(roots.clone())
        .with_client_auth_cert(chain.clone(), key.clone_key())
        .map_err(|e| config(&e))?;
    // A client without a certificate gets through the handshake only to join (and
    // only on the head, with a token); everything else wants a node's certificate.
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| config(&e))?;
    let server = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| config(&e))?;
    Ok(Current {
        creds: creds.clone(),
        client: Arc::new(client),
        server: Arc::new(server),
    })
}

impl PeerTls {
    /// The channel of `creds.node`, in a cluster of `nodes` whose head is `head`.
    /// `authority`: on the head, the CA with which it lets nodes started by hand join and
    /// whose book says which certificate of each node is the latest.
    pub fn new(
        cluster: &str,
        head: &str,
        nodes: Vec<String>,
        creds: &NodeCreds,
        authority: Option<ClusterCa>,
    ) -> Result<PeerTls, TlsError> {
        Ok(PeerTls {
            cluster: cluster.to_string(),
            node: creds.node.clone(),
            head: head.to_string(),
            nodes,
            current: std::sync::RwLock::new(configs(creds)?),
            authority,
            kept_in: None,
            started_s: now_s(),
            learned: std::sync::RwLock::new(None),
            renew_key: std::sync::Mutex::new(None),
            installed: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The same, keeping a renewed certificate and key in `dir` (a state dir's `tls/`,
    /// where `creds` came from).
    pub fn keeping_in(mut self, dir: &Path) -> PeerTls {
        self.kept_in = Some(dir.to_path_buf());
        self
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The credentials this node uses now.
    pub fn creds(&self) -> NodeCreds {
        self.current().creds.clone()
    }

    /// Whether `cert` is the certificate accepted of `node`: on the head, the latest its
    /// book records (a node that joined again, renewed, or was started again over SSH
    /// has a new one; the old is refused); elsewhere the one the head last said it
    /// accepts (any the CA signed before the head's first answer, and always for the
    /// head's own, which a node must reach to learn anything).
    /// On the head, a renewed certificate's first use replaces the one before, and a
    /// join's spends its token ([`Book::confirm`]).
    pub fn is_latest(&self, node: &str, cert: &CertificateDer<'_>) -> bool {
        match &self.authority {
            Some(ca) => {
                let Ok(book) = Book::read(ca.dir()) else {
                    return false;
                };
                if !book.is_latest(node, cert) {
                    return false;
                }
                let hash = cert_hash(cert);
                if book.unconfirmed(node, &hash) {
                    let confirmed = Book::update(ca.dir(), |b| {
                        b.confirm(node, &hash, now_s());
                        Ok(())
                    });
                    if let Err(e) = confirmed {
                        tracing::warn!("recording node {node}'s first use of its certificate: {e}");
                    }
                }
                true
            }
            None if node == self.head => true,
            None => {
                let learned = self.learned.read().unwrap_or_else(|e| e.into_inner());
                let hash = cert_hash(cert);
                learned
                    .as_ref()
                    .is_none_or(|m| m.get(node).is_some_and(|h| h.contains(&hash)))
            }
        }
    }

    /// On the head: the certificate it accepts of each node, for its answers to the
    /// nodes' status polls (None elsewhere, or when the book cannot be read).
    pub fn accepted(&self) -> Option<BTreeMap<String, Accepted>> {
        let ca = self.authority.as_ref()?;
        Book::read(ca.dir())
            .ok()
            .map(|b| b.accepted(self.started_s))
    }

    /// Elsewhere: takes what the head said it accepts of each node, refusing every other
    /// certificate from then on. Whether this node should renew its own now (`Some`: why),
    /// which it should when the head accepts the one it has and marks it for renewal, or
    /// when less than [`RENEW_WITHIN_S`] is left of it.
    pub fn learn(&self, accepted: &BTreeMap<String, Accepted>) -> Option<&'static str> {
        if self.authority.is_some() {
            return None;
        }
        let hashes = accepted
            .iter()
            .map(|(n, a)| {
                let both = std::iter::once(a.sha256.clone()).chain(a.pending.clone());
                (n.clone(), both.collect())
            })
            .collect();
        *self.learned.write().unwrap_or_else(|e| e.into_inner()) = Some(hashes);
        let mine = accepted.get(&self.node)?;
        let own = CertificateDer::from_pem_slice(self.current().creds.cert_pem.as_bytes()).ok()?;
        if mine.sha256 != cert_hash(&own) {
            return None;
        }
        if mine.renew {
            Some("the head's `up` renews the certificates of nodes that joined")
        } else if mine.not_after_s < now_s() + RENEW_WITHIN_S {
            Some("it expires within 30 days")
        } else {
            None
        }
    }

    /// Elsewhere: a new key, and the request that asks the head to certify it, proven for
    /// the session whose keying material exported under [`RENEW_EXPORTER_LABEL`] is
    /// `binding`.
    /// A renewal asked before and not installed (its answer lost) asks again with the
    /// same key.
    pub fn renewal(&self, binding: &[u8]) -> Result<Renewal, TlsError> {
        use rcgen::SigningKey;
        let make = |e: rcgen::Error| TlsError::Make(e.to_string());
        let mut kept = self.renew_key.lock().unwrap_or_else(|e| e.into_inner());
        let key = match kept.as_deref().map(rcgen::KeyPair::from_pem) {
            Some(Ok(key)) => key,
            _ => {
                let key = rcgen::KeyPair::generate_for(KEY_ALG).map_err(make)?;
                *kept = Some(key.serialize_pem());
                key
            }
        };
        let proof = key.sign(binding).map_err(make)?;
        let request = RenewRequest {
            renew: hex::encode(key.public_key_raw()),
            proof: hex::encode(&proof),
        };
        Ok(Renewal { key, request })
    }

    /// On the head: a certificate (PEM) for the new key of `req`, for `node` — the node
    /// named by the certificate `cert` that opened this connection (with `binding`, its
    /// exported keying material), which must still be one the head accepts of that node.
    /// Two-phase: the new one is accepted besides the old until the node uses it
    /// ([`Book::confirm`]); asked again for the same key (the answer was lost), the same
    /// certificate is sent again. Why not, otherwise.
    pub fn answer_renewal(
        &self,
        node: &str,
        cert: &CertificateDer<'_>,
        req: &RenewRequest,
        binding: &[u8],
    ) -> Result<String, String> {
        let Some(ca) = &self.authority else {
            return Err(format!(
                "node {} is not the head ({}): certificates are renewed by the head",
                self.node, self.head
            ));
        };
        if node == self.head {
            return Err("the head renews its own certificate at its `up`".into());
        }
        if !self.is_latest(node, cert) {
            return Err(format!(
                "this connection's certificate of node {node} is no longer the one the head accepts (renewed, joined again or revoked): it renews nothing"
            ));
        }
        let public = hex::decode(&req.renew)
            .ok()
            .filter(|k| k.len() == 65 && k[0] == 4)
            .ok_or("the new key is not an uncompressed P-256 point in hex")?;
        let proof = hex::decode(&req.proof).map_err(|_| "the proof is not hex")?;
        let verifier = provider()
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(scheme, _)| *scheme == rustls::SignatureScheme::ECDSA_NISTP256_SHA256)
            .and_then(|(_, algs)| algs.first().copied())
            .ok_or("this build verifies no P-256 signature")?;
        verifier
            .verify_signature(&public, binding, &proof)
            .map_err(|_| "the proof is not a signature of this session by the new key")?;
        let answered = Book::update(ca.dir(), |book| {
            let Some(entry) = book.issued.get_mut(node) else {
                return Err(format!("the head's book has no certificate of node {node}"));
            };
            if let Some(p) = entry.pending.as_ref().filter(|p| p.public == req.renew) {
                return Ok(p.cert_pem.clone());
            }
            let (cert_pem, issued) = ca
                .sign(node, &NewPublicKey(public), RENEWED)
                .map_err(|e| e.to_string())?;
            entry.pending = Some(Pending {
                serial: issued.serial,
                sha256: issued.sha256,
                issued_s: issued.issued_s,
                not_after_s: issued.not_after_s,
                public: req.renew.clone(),
                cert_pem: cert_pem.clone(),
            });
            Ok(cert_pem)
        });
        answered.map_err(|e| e.to_string())?
    }

    /// Elsewhere: takes the certificate the head sent for `renewal`'s key — it must be
    /// for this node, signed by the cluster's CA and hold that key — keeps it and the key
    /// (0600, synced) where this node keeps its credentials, and uses them for every
    /// connection made from now on. The credentials now used.
    pub fn install(&self, renewal: Renewal, cert_pem: &str) -> Result<NodeCreds, TlsError> {
        use rustls::client::danger::ServerCertVerifier;
        let old = self.creds();
        let creds = NodeCreds {
            node: old.node.clone(),
            ca_pem: old.ca_pem.clone(),
            cert_pem: cert_pem.to_string(),
            key_pem: renewal.key.serialize_pem(),
        };
        let bad = |why: String| TlsError::Config(format!("the renewed certificate: {why}"));
        let (ca, chain, key) = creds.parts().map_err(bad)?;
        let signer = provider()
            .key_provider
            .load_private_key(key)
            .map_err(|e| bad(e.to_string()))?;
        rustls::sign::CertifiedKey::new(chain.clone(), signer)
            .keys_match()
            .map_err(|e| bad(format!("it does not hold the new key ({e})")))?;
        let mut roots = RootCertStore::empty();
        roots.add(ca).map_err(|e| bad(e.to_string()))?;
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| bad(e.to_string()))?
            .verify_server_cert(
                &chain[0],
                &[],
                &server_name(&self.node),
                &[],
                UnixTime::now(),
            )
            .map_err(|e| {
                bad(format!(
                    "not one the cluster's CA made for node {} ({e})",
                    self.node
                ))
            })?;
        let next = configs(&creds)?;
        if let Some(dir) = &self.kept_in {
            creds.write(dir)?;
        }
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
        *self.renew_key.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.installed
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(creds)
    }

    /// How many renewed certificates this node has installed since it started: a
    /// connection opened before the latest carries the old certificate.
    pub fn installed(&self) -> u64 {
        self.installed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connects to `node`'s supervisor over `stream`, checking its certificate names it.
    pub async fn connect(
        &self,
        node: &str,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let client = self.current().client.clone();
        let tls = tokio_rustls::TlsConnector::from(client)
            .connect(server_name(node), stream)
            .await?;
        let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
        if !cert.is_some_and(|c| self.is_latest(node, c)) {
            return Err(std::io::Error::other(format!(
                "node {node} showed a certificate that is not the one the head accepts of it (replaced: it renewed, joined again or was started again; or revoked)"
            )));
        }
        Ok(tls)
    }

    /// The acceptor for connections from other nodes.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current().server.clone())
    }

    /// The node a verified client certificate names, if any of the cluster's (on the
    /// head: only when it is the latest the head issued that node).
    pub fn node_of(&self, cert: &CertificateDer<'_>) -> Option<String> {
        let parsed = rustls::server::ParsedCertificate::try_from(cert).ok()?;
        self.nodes
            .iter()
            .find(|n| rustls::client::verify_server_name(&parsed, &server_name(n)).is_ok())
            .filter(|n| self.is_latest(n, cert))
            .cloned()
    }

    /// On the head: new credentials for `node` when `proof` shows, for this session
    /// (`binding`, exported from it), the secret of join token `token` — one made for
    /// that node, not used, revoked nor expired (it is used up by this join); why not,
    /// otherwise.
    pub fn answer_join(
        &self,
        node: &str,
        token: &str,
        proof: &str,
        binding: &[u8],
    ) -> Result<NodeCreds, String> {
        let Some(ca) = &self.authority else {
            return Err(format!(
                "node {} is not the head ({}): nodes join the head",
                self.node, self.head
            ));
        };
        if node == self.head || !self.nodes.iter().any(|n| n == node) {
            return Err(format!(
                "node `{node}` cannot join cluster {}: its nodes other than the head ({}) are {}",
                self.cluster,
                self.head,
                self.nodes
                    .iter()
                    .filter(|n| **n != self.head)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Book::update(ca.dir(), |book| {
            let t = redeemable(book, node, token, proof, binding)?;
            let id = t.id.clone();
            // Signed and recorded with the book held: the node's certificate before is
            // refused from now on; the token is spent once the new one is used.
            let (creds, issued) = ca.sign_new(node, "join").map_err(|e| e.to_string())?;
            if let Some(t) = book.tokens.iter_mut().find(|t| t.id == id) {
                t.handed = Some(issued.sha256.clone());
            }
            book.issued.insert(node.to_string(), issued);
            Ok(creds)
        })
        .map_err(|e| e.to_string())?
    }
}

/// The token `token` of `book` when `proof` proves it for `node` over this session
/// (`binding`) and it may join that node now: made for it, not used, revoked nor expired
/// (a join answered whose certificate its node has not used yet may be asked again, the
/// answer lost on the way); why not, otherwise.
fn redeemable<'b>(
    book: &'b Book,
    node: &str,
    token: &str,
    proof: &str,
    binding: &[u8],
) -> Result<&'b TokenRecord, String> {
    let now = now_s();
    let again = format!("on the head, `pdctl join-token --node {node}` makes a new one");
    let Some(t) = book.tokens.iter().find(|t| t.id == token) else {
        return Err("wrong join token: this head made none with its id".to_string());
    };
    if t.verifier.is_empty() {
        return Err(format!(
            "the join token {} was made by an older pdctl, whose book could redeem it; {again}",
            t.id
        ));
    }
    if !proof_holds(&t.verifier, node, binding, proof) {
        return Err("wrong join token: the secret in it is not the one this head made".into());
    }
    match t.state(now) {
        "revoked" => return Err(format!("the join token {} was revoked; {again}", t.id)),
        "used" => {
            return Err(format!(
                "the join token {} was used already (a token joins once); {again}",
                t.id
            ));
        }
        "expired" => {
            return Err(format!(
                "the join token {} expired {} s ago; {again}",
                t.id,
                now - t.expires_s
            ));
        }
        _ => {}
    }
    if t.node != node {
        return Err(format!(
            "the join token {} was made for node {}, not {node}; {again}",
            t.id, t.node
        ));
    }
    Ok(t)
}

/// What a node started by hand is given to join: the CA's hash (so it trusts no other
/// server), the token's id and its random secret (so the head lets that one node in,
/// once), as `PD2<sha256 of the CA certificate>::<id>.<secret>` (as k3s's
/// `K10<hash>::...` and kubeadm's `<id>.<secret>` tokens). The head keeps only the
/// secret's SHA-256.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub ca_hash: String,
    pub id: String,
    pub secret: Secret,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JoinToken(PD2{}::{}..)", self.ca_hash, self.id)
    }
}

const TOKEN_PREFIX: &str = "PD2";

impl JoinToken {
    /// A new token for the CA whose hash is `ca_hash`: a random id (64 bits) and secret
    /// (256 bits).
    pub fn new(ca_hash: &str) -> JoinToken {
        JoinToken {
            ca_hash: ca_hash.to_string(),
            id: hex::encode(rand::random::<[u8; 8]>()),
            secret: Secret::random(),
        }
    }

    /// The token as `pdctl join-token` prints it.
    pub fn reveal(&self) -> String {
        format!(
            "{TOKEN_PREFIX}{}::{}.{}",
            self.ca_hash,
            self.id,
            self.secret.reveal()
        )
    }

    /// The key the token's secret derives (Ed25519, seeded by a labelled SHA-256 of the
    /// secret): what a join's proof is signed with.
    fn proof_key(&self) -> ring::signature::Ed25519KeyPair {
        let seed = sha2::Sha256::new()
            .chain_update(TOKEN_KEY_LABEL)
            .chain_update(self.secret.reveal().as_bytes())
            .finalize();
        ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .expect("any 32 bytes seed an Ed25519 key")
    }

    /// The public half of the proof key (hex): what the head keeps of the token. It
    /// checks a proof; neither the secret nor the proof key can be had from it.
    pub fn verifier(&self) -> String {
        use ring::signature::KeyPair;
        hex::encode(self.proof_key().public_key().as_ref())
    }

    /// The proof of this token a node joining as `node` sends over the session whose
    /// exported keying material is `binding`: a signature of both by the proof key, worth
    /// nothing for another node or in another session.
    pub fn proof(&self, node: &str, binding: &[u8]) -> String {
        hex::encode(self.proof_key().sign(&join_message(node, binding)).as_ref())
    }
}

/// Labels the seed of a join token's proof key.
const TOKEN_KEY_LABEL: &[u8] = b"pdctl-join-token-key-v3";

/// What a join's proof signs: a label, the node (its length first) and the session.
fn join_message(node: &str, binding: &[u8]) -> Vec<u8> {
    let mut m = b"pdctl-join-v3".to_vec();
    m.extend_from_slice(&(node.len() as u32).to_be_bytes());
    m.extend_from_slice(node.as_bytes());
    m.extend_from_slice(binding);
    m
}

/// Whether `proof` (hex) is a signature of `node` and `binding` by the key whose public
/// half is `verifier` (hex), as [`JoinToken::proof`] makes them.
pub fn proof_holds(verifier: &str, node: &str, binding: &[u8], proof: &str) -> bool {
    let (Ok(public), Ok(sig)) = (hex::decode(verifier), hex::decode(proof)) else {
        return false;
    };
    ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, public)
        .verify(&join_message(node, binding), &sig)
        .is_ok()
}

impl JoinToken {
    /// Reads a token a person gave.
    pub fn parse(text: &str) -> Result<JoinToken, TlsError> {
        let t = text.trim();
        if t.starts_with("PD1") {
            return Err(TlsError::Token(
                "it is an old kind that carried the cluster's secret, no longer taken",
            ));
        }
        let rest = t
            .strip_prefix(TOKEN_PREFIX)
            .ok_or(TlsError::Token("it does not start with PD2"))?;
        let (hash, tail) = rest
            .split_once("::")
            .ok_or(TlsError::Token("no `::` after the CA's hash"))?;
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TlsError::Token("the CA's hash is not 64 hex digits"));
        }
        let (id, secret) = tail
            .split_once('.')
            .ok_or(TlsError::Token("no `.` between the token's id and secret"))?;
        if id.len() != 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TlsError::Token("the token's id is not 16 hex digits"));
        }
        if secret.len() != 64 || !secret.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TlsError::Token("the token's secret is not 64 hex digits"));
        }
        let secret = Secret::from_text(secret, "the join token")
            .map_err(|_| TlsError::Token("the secret in it is too short"))?;
        Ok(JoinToken {
            ca_hash: hash.to_ascii_lowercase(),
            id: id.to_ascii_lowercase(),
            secret,
        })
    }

    /// A client config that trusts only a server whose chain holds the pinned CA (and is
    /// signed by it), and shows no certificate of its own.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let verifier = PinnedCa {
            hash: self.ca_hash.clone(),
            provider: provider(),
        };
        Ok(ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth())
    }

    /// Connects to the head for a join.
    pub async fn connect(
        &self,
        head: &str,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let config = self.client_config().map_err(std::io::Error::other)?;
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name(head), stream)
            .await
    }
}

/// Trusts the CA whose certificate has the pinned hash, found in the chain the server
/// sends, and checks the server's certificate against it as any CA would be.
#[derive(Debug)]
struct PinnedCa {
    hash: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| cert_hash(c) == self.hash)
            .ok_or_else(|| {
                rustls::Error::General("the server's CA is not the one the join token pins".into())
            })?;
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
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

    #[test]
    fn tokens_round_trip_and_bad_ones_say_why() {
        let t = JoinToken::new(&"ab".repeat(32));
        assert_eq!(JoinToken::parse(&t.reveal()).unwrap(), t);
        assert!(!format!("{t:?}").contains(t.secret.reveal()));
        assert_eq!(t.secret.reveal().len(), 64, "256 bits");
        assert_ne!(JoinToken::new(&t.ca_hash).secret, t.secret);
        let old = format!("PD1{}::{}", t.ca_hash, t.secret.reveal());
        for bad in ["", "K10abc::x", "PD2abc::0123456789abcdef0", "PD2", &old] {
            assert!(JoinToken::parse(bad).is_err(), "{bad}");
        }
    }

    /// A token for `node` good for `ttl_s`, recorded in the book of `ca`.
    fn token_for(ca: &ClusterCa, node: &str, ttl_s: i64) -> JoinToken {
        let t = JoinToken::new(&ca.hash());
        let now = now_s();
        let record = TokenRecord {
            id: t.id.clone(),
            node: node.to_string(),
            verifier: t.verifier(),
            hash: None,
            created_s: now,
            expires_s: now.saturating_add_signed(ttl_s),
            used_s: None,
            handed: None,
            revoked: false,
        };
        Book::update(ca.dir(), |b| {
            b.tokens.push(record);
            Ok(())
        })
        .unwrap()
        .unwrap();
        t
    }

    #[test]
    fn a_join_token_lets_one_node_join_once_in_its_time_and_the_old_certificate_goes() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let head = ca.issue("head", "head").unwrap();
        let nodes: Vec<String> = ["head", "a", "b"].map(String::from).to_vec();
        let ca2 = ClusterCa::load(dir.path(), "c1").unwrap().unwrap();
        let tls = PeerTls::new("c1", "head", nodes, &head, Some(ca2)).unwrap();
        let join =
            |t: &JoinToken, node: &str| tls.answer_join(node, &t.id, &t.proof(node, b"s1"), b"s1");

        let t = token_for(&ca, "a", 3600);
        let e = join(&t, "b").unwrap_err();
        assert!(e.contains("made for node a, not b"), "{e}");
        // A proof for another session, or with another secret, proves nothing.
        let e = tls
            .answer_join("a", &t.id, &t.proof("a", b"s2"), b"s1")
            .unwrap_err();
        assert!(e.contains("wrong join token"), "{e}");
        let der = |c: &NodeCreds| CertificateDer::from_pem_slice(c.cert_pem.as_bytes()).unwrap();
        // The answer to a join lost on the way: the same token joins the same node once
        // more (never another), and the certificate of the lost answer is replaced.
        let lost = join(&t, "a").expect("the token joins");
        let e = join(&t, "b").unwrap_err();
        assert!(e.contains("made for node a, not b"), "{e}");
        let first = join(&t, "a").expect("asked again, the join is answered again");
        assert_eq!(
            tls.node_of(&der(&lost)),
            None,
            "the lost answer's is replaced"
        );
        // Spent once the node speaks with the certificate it got.
        assert_eq!(tls.node_of(&der(&first)).as_deref(), Some("a"));
        let e = join(&t, "a").unwrap_err();
        assert!(e.contains("used already"), "{e}");

        let expired = token_for(&ca, "a", -1);
        let e = join(&expired, "a").unwrap_err();
        assert!(e.contains("expired"), "{e}");

        let again = join(&token_for(&ca, "a", 3600), "a").unwrap();
        assert_eq!(tls.node_of(&der(&again)).as_deref(), Some("a"));
        assert_eq!(
            tls.node_of(&der(&first)),
            None,
            "the certificate before is revoked"
        );
        let book = Book::read(dir.path()).unwrap();
        assert!(
            !std::fs::read_to_string(dir.path().join(BOOK))
                .unwrap()
                .contains(t.secret.reveal())
        );
        assert_eq!(book.issued["a"].how, "join");
        assert!(book.issued["a"].not_after_s > now_s() + CERT_LIFETIME_S - 10);
    }

    #[test]
    fn a_node_renews_over_the_channel_for_its_own_name_and_the_old_certificate_goes() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let nodes: Vec<String> = ["head", "a", "b"].map(String::from).to_vec();
        let head_creds = ca.issue("head", "head").unwrap();
        let a_old = ca.issue("a", "join").unwrap();
        let b_old = ca.issue("b", "join").unwrap();
        let head = PeerTls::new("c1", "head", nodes.clone(), &head_creds, Some(ca)).unwrap();
        let kept = dir.path().join("a");
        let a = PeerTls::new("c1", "head", nodes, &a_old, None)
            .unwrap()
            .keeping_in(&kept);
        let der = |pem: &str| CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();

        // Joined before the head's supervisor started: marked; the head's own is not.
        let book = Book::read(dir.path()).unwrap();
        let accepted = book.accepted(now_s() + 10);
        assert!(accepted["a"].renew && !accepted["head"].renew);
        assert_eq!(
            a.learn(&accepted),
            Some("the head's `up` renews the certificates of nodes that joined")
        );
        assert_eq!(
            a.learn(&book.accepted(now_s() - 10)),
            None,
            "joined since: kept"
        );

        let renewal = a.renewal(b"session-1").unwrap();
        let e = head
            .answer_renewal("a", &der(&a_old.cert_pem), &renewal.request, b"session-2")
            .unwrap_err();
        assert!(e.contains("not a signature of this session"), "{e}");
        let e = head
            .answer_renewal(
                "head",
                &der(&head_creds.cert_pem),
                &renewal.request,
                b"session-1",
            )
            .unwrap_err();
        assert!(e.contains("its own certificate at its `up`"), "{e}");
        let lost = head
            .answer_renewal("a", &der(&a_old.cert_pem), &renewal.request, b"session-1")
            .expect("renewed");
        // The answer is lost on the way (the node never installs it): the old certificate
        // is still accepted, and the node asking again (its same new key, another
        // session) is sent the same certificate.
        drop(renewal);
        assert_eq!(head.node_of(&der(&a_old.cert_pem)).as_deref(), Some("a"));
        let again = a.renewal(b"session-2").unwrap();
        let cert_pem = head
            .answer_renewal("a", &der(&a_old.cert_pem), &again.request, b"session-2")
            .expect("renewed again");
        assert_eq!(cert_pem, lost, "the same answer");
        let book = Book::read(dir.path()).unwrap();
        assert_eq!(book.issued["a"].sha256, cert_hash(&der(&a_old.cert_pem)));
        assert!(
            book.accepted(now_s() + 10)["a"].renew,
            "still asked to renew"
        );
        // Installed and used once, the new one is the only one accepted.
        let now_used = a.install(again, &cert_pem).unwrap();
        assert_eq!(a.creds(), now_used);
        assert_eq!(NodeCreds::read(&kept).unwrap(), Some(now_used.clone()));
        assert_ne!(now_used.key_pem, a_old.key_pem);
        assert_eq!(head.node_of(&der(&cert_pem)).as_deref(), Some("a"));
        assert_eq!(head.node_of(&der(&a_old.cert_pem)), None);
        let stale = a.renewal(b"session-1").unwrap();
        let e = head
            .answer_renewal("a", &der(&a_old.cert_pem), &stale.request, b"session-1")
            .unwrap_err();
        assert!(e.contains("no longer the one the head accepts"), "{e}");
        let book = Book::read(dir.path()).unwrap();
        assert_eq!(book.issued["a"].how, RENEWED);
        assert_eq!(book.issued["a"].sha256, cert_hash(&der(&cert_pem)));
        assert!(book.issued["a"].pending.is_none());
        assert!(
            !book
                .accepted(book.issued["a"].issued_s)
                .get("a")
                .unwrap()
                .renew
        );

        // A certificate for another key is not taken.
        let e = a.install(stale, &lost_other(&dir)).unwrap_err().to_string();
        assert!(e.contains("does not hold the new key"), "{e}");
        assert_eq!(a.creds(), now_used);

        // A node takes the head's word on the others: b's replaced certificate is refused.
        let b_new = ClusterCa::load(dir.path(), "c1")
            .unwrap()
            .unwrap()
            .issue("b", "join")
            .unwrap();
        assert_eq!(a.node_of(&der(&b_old.cert_pem)).as_deref(), Some("b"));
        let book = Book::read(dir.path()).unwrap();
        assert_eq!(a.learn(&book.accepted(0)), None);
        assert_eq!(a.node_of(&der(&b_old.cert_pem)), None, "replaced");
        assert_eq!(a.node_of(&der(&b_new.cert_pem)).as_deref(), Some("b"));
        assert!(a.is_latest("head", &der(&head_creds.cert_pem)));
    }

    /// A certificate of node `a` for a key no renewal holds.
    fn lost_other(dir: &tempfile::TempDir) -> String {
        let ca = ClusterCa::load(dir.path(), "c1").unwrap().unwrap();
        let key = rcgen::KeyPair::generate_for(KEY_ALG).unwrap();
        ca.sign("a", &key, "join").unwrap().0
    }

    #[test]
    fn a_renewed_certificate_never_used_stops_the_old_one_only_after_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let old = ca.issue("a", "join").unwrap();
        let der = CertificateDer::from_pem_slice(old.cert_pem.as_bytes()).unwrap();
        let pending = |issued_s| Pending {
            serial: "01".into(),
            sha256: "ab".repeat(32),
            issued_s,
            not_after_s: issued_s + CERT_LIFETIME_S,
            public: "04".into(),
            cert_pem: String::new(),
        };
        let mut book = Book::read(dir.path()).unwrap();
        book.issued.get_mut("a").unwrap().pending = Some(pending(now_s()));
        assert!(book.is_latest("a", &der), "within the grace");
        let long_ago = now_s() - RENEW_GRACE_S - 1;
        book.issued.get_mut("a").unwrap().pending = Some(pending(long_ago));
        assert!(!book.is_latest("a", &der), "past the grace");
    }

    /// A join proof made as an older pdctl made them, with `key` as the HMAC key.
    fn keyed_by(key: &str, node: &str, binding: &[u8]) -> String {
        use hmac::{KeyInit, Mac};
        let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key.as_bytes()).unwrap();
        m.update(b"pdctl-join-v1");
        m.update(node.as_bytes());
        m.update(binding);
        hex::encode(m.finalize().into_bytes())
    }

    #[test]
    fn the_book_alone_cannot_redeem_a_token() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let head = ca.issue("head", "head").unwrap();
        let nodes: Vec<String> = ["head", "a"].map(String::from).to_vec();
        let ca2 = ClusterCa::load(dir.path(), "c1").unwrap().unwrap();
        let tls = PeerTls::new("c1", "head", nodes, &head, Some(ca2)).unwrap();
        let t = token_for(&ca, "a", 3600);
        let text = std::fs::read_to_string(dir.path().join(BOOK)).unwrap();
        assert!(!text.contains(t.secret.reveal()));
        // Whatever the book holds of the token, used as its secret or as its proof's key
        // (which an older pdctl kept), proves nothing.
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let kept = json["tokens"][0].as_object().unwrap();
        let mut tried = 0;
        for value in kept.values().filter_map(|v| v.as_str()) {
            let Ok(secret) = Secret::from_text(value, "the book") else {
                continue;
            };
            let forged = JoinToken {
                ca_hash: t.ca_hash.clone(),
                id: t.id.clone(),
                secret,
            };
            for proof in [forged.proof("a", b"s1"), keyed_by(value, "a", b"s1")] {
                let e = tls.answer_join("a", &t.id, &proof, b"s1").unwrap_err();
                assert!(e.contains("wrong join token"), "{value}: {e}");
            }
            tried += 1;
        }
        assert!(tried >= 1, "the book keeps something of the token: {text}");
        assert!(
            tls.answer_join("a", &t.id, &t.proof("a", b"s1"), b"s1")
                .is_ok()
        );
    }

    #[test]
    fn the_ca_is_kept_and_its_certificates_name_their_node() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let again = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        assert_eq!(ca.hash(), again.hash());
        let creds = again.issue("worker", "ssh").unwrap();
        assert_eq!(creds.ca_hash(), ca.hash());
        let nodes = vec!["head".to_string(), "worker".to_string()];
        let tls = PeerTls::new("c1", "head", nodes, &creds, None).unwrap();
        let cert = CertificateDer::from_pem_slice(creds.cert_pem.as_bytes()).unwrap();
        assert_eq!(tls.node_of(&cert).as_deref(), Some("worker"));
        let kept = dir.path().join("kept");
        creds.write(&kept).unwrap();
        assert_eq!(NodeCreds::read(&kept).unwrap(), Some(creds));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(kept.join(NODE_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
