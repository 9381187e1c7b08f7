//! The head's book (`tls/book.json`): each node's latest certificate (and a renewed one
//! not used yet), and each join token as the head keeps it (never its secret).

use super::{TlsError, cert_hash, make_dir, now_s, read_text, write_private};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The head's book of certificates issued and join tokens made (mode 0600).
pub(super) const BOOK: &str = "book.json";
/// Held (flock) while the book is read and written again: `pdctl join-token` and the
/// head's supervisor both change it.
const BOOK_LOCK: &str = "book.lock";

/// How a certificate renewed over the channel is recorded in the book.
pub(super) const RENEWED: &str = "renew";

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
    /// Of the head only: the rotation of its certificate staged, which the other nodes
    /// take when the head's certificate of now signed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<HeadRotation>,
}

/// A rotation of the head's certificate, staged by `pdctl join-token --rotate-head` (or
/// by the head's `up` when its certificate nears its end) and put to use at the head's
/// next `up`: the next certificate, and the signature by which the head's certificate of
/// now vouches for it. The other nodes, which take no other certificate for the head's,
/// learn it from the head's status answers and take the next one from then on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadRotation {
    /// The next certificate's serial number and SHA-256 (hex).
    pub serial: String,
    pub sha256: String,
    pub issued_s: u64,
    pub not_after_s: u64,
    /// SHA-256 of the head's certificate whose key signed it.
    pub signed_by: String,
    /// ECDSA P-256 SHA-256 signature (DER, hex) of the rotation's message by that key.
    pub signature: String,
    /// The next certificate itself (public), which the nodes keep.
    pub cert_pem: String,
}

/// The head's book (`tls/book.json`): each node's latest certificate and the join tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Book {
    #[serde(default)]
    pub issued: BTreeMap<String, Issued>,
    #[serde(default)]
    pub tokens: Vec<TokenRecord>,
    /// The rotation of the head's certificate staged, if any (its key and certificate wait
    /// in `tls/next.key`, `tls/next.pem`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_next: Option<HeadRotation>,
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
    pub fn accepts(&self, node: &str, cert: &[u8]) -> bool {
        let hash = cert_hash(cert);
        self.issued.get(node).is_some_and(|i| match &i.pending {
            Some(p) if p.sha256 == hash => true,
            Some(p) if now_s() >= p.issued_s + RENEW_GRACE_S => false,
            _ => i.sha256 == hash,
        })
    }

    /// Whether `node` using `hash` (a certificate [`Book::accepts`] accepts) is news
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

    /// The certificate accepted of each node, as the head tells the nodes; one of
    /// `marked` (the certificates a node came by with a join token or a renewal that the
    /// book held when the head's supervisor started, [`Book::renewable`]) is marked for
    /// renewal. Nodes started over SSH are given a new one at every `up` of the head
    /// instead, and the head makes its own again.
    pub fn accepted(&self, marked: &BTreeSet<String>) -> BTreeMap<String, Accepted> {
        self.issued
            .iter()
            .map(|(node, i)| {
                let accepted = Accepted {
                    sha256: i.sha256.clone(),
                    serial: i.serial.clone(),
                    not_after_s: i.not_after_s,
                    pending: i.pending.as_ref().map(|p| p.sha256.clone()),
                    renew: marked.contains(&i.sha256),
                    rotation: self.head_next.clone().filter(|_| i.how == "head"),
                };
                (node.clone(), accepted)
            })
            .collect()
    }

    /// The certificates (SHA-256) a node came by with a join token or a renewal: what the
    /// head's supervisor marks for renewal when it finds them in the book at its start. A
    /// set, not a time: a node that joined in the same second the supervisor started is
    /// told to renew exactly when it joined before it.
    pub fn renewable(&self) -> BTreeSet<String> {
        self.issued
            .values()
            .filter(|i| i.how == "join" || i.how == RENEWED)
            .map(|i| i.sha256.clone())
            .collect()
    }
}
