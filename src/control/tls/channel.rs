//! A node's side of the channel: the TLS configurations made of its credentials, and which
//! certificate of each node it accepts.

use super::book::{Accepted, Book, HeadRotation};
use super::ca::ClusterCa;
use super::creds::NodeCreds;
use super::rotation::{hash_of, rotation_holds};
use super::{
    HEAD_CERT, HEAD_NEXT, RENEW_WITHIN_S, TlsError, cert_hash, now_s, provider, read_text, remove,
    server_name, write_private,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    pub(super) nodes: Vec<String>,
    /// What this node shows and trusts now (replaced when it renews its certificate).
    pub(super) current: std::sync::RwLock<Current>,
    /// On the head: the CA, to answer joins and renewals and to accept from each node
    /// only the latest certificate its book records.
    pub(super) authority: Option<ClusterCa>,
    /// Where this node keeps its credentials (a state dir's `tls/`): a renewed
    /// certificate and key are written there before they are used.
    pub(super) creds_dir: Option<PathBuf>,
    /// On the head: the certificates of nodes that joined or renewed that its book held
    /// when this was made (the start of its supervisor), each marked for renewal.
    renew_at_start: std::collections::BTreeSet<String>,
    /// Elsewhere: the SHA-256 of the certificates the head accepts of each node (its
    /// current one, and a renewed one not used yet), from its last status answer (None
    /// before the first).
    vouched: std::sync::RwLock<Option<BTreeMap<String, Vec<String>>>>,
    /// Elsewhere: the head's next certificate (PEM), from a rotation its certificate of
    /// now signed: taken for the head's as well, and instead of it once the head shows it.
    head_next: std::sync::RwLock<Option<String>>,
    /// Elsewhere: the key (PEM) of a renewal asked whose certificate is not installed
    /// yet, asked for again with the same key (the head then sends the same certificate).
    pub(super) renew_key: std::sync::Mutex<Option<String>>,
    /// How many renewed certificates this node has installed: a connection kept from
    /// before one is opened again, so the head sees the new one used and drops the old.
    pub(super) installed: std::sync::atomic::AtomicU64,
}

/// The credentials a node uses now, and the TLS configurations made of them.
pub(super) struct Current {
    pub(super) creds: NodeCreds,
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls({} of {})", self.node, self.cluster)
    }
}

/// The client and server configurations of `creds`.
pub(super) fn configs(creds: &NodeCreds) -> Result<Current, TlsError> {
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
        let renew_at_start = authority
            .as_ref()
            .and_then(|ca| Book::read(ca.dir()).ok())
            .map(|b| b.renewable())
            .unwrap_or_default();
        Ok(PeerTls {
            cluster: cluster.to_string(),
            node: creds.node.clone(),
            head: head.to_string(),
            nodes,
            current: std::sync::RwLock::new(configs(creds)?),
            authority,
            creds_dir: None,
            renew_at_start,
            vouched: std::sync::RwLock::new(None),
            head_next: std::sync::RwLock::new(None),
            renew_key: std::sync::Mutex::new(None),
            installed: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The same, keeping a renewed certificate and key in `dir` (a state dir's `tls/`,
    /// where `creds` came from), and the head's next certificate once it announces one
    /// (read back from there: a rotation taken before a restart holds).
    pub fn keeping_in(mut self, dir: &Path) -> PeerTls {
        match read_text(&dir.join(HEAD_NEXT)) {
            Ok(next) => self.head_next = std::sync::RwLock::new(next),
            Err(e) => tracing::warn!("the head's next certificate: {e}"),
        }
        self.creds_dir = Some(dir.to_path_buf());
        self
    }

    pub(super) fn current(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The credentials this node uses now.
    pub fn creds(&self) -> NodeCreds {
        self.current().creds.clone()
    }

    /// Whether this node accepts `cert` as `node`'s: on the head, when its book does
    /// ([`PeerTls::book_accepts`]); elsewhere, for the head, [`PeerTls::accepts_as_head`],
    /// and for any other node, [`PeerTls::head_vouches_for`].
    pub fn accepts(&self, node: &str, cert: &CertificateDer<'_>) -> bool {
        match &self.authority {
            Some(ca) => self.book_accepts(ca, node, cert),
            None if node == self.head => self.accepts_as_head(cert),
            None => self.head_vouches_for(node, cert),
        }
    }

    /// On the head: whether `cert` is one its book accepts of `node` (the latest it issued
    /// it, or a renewed one not used yet: a node that joined again, renewed, or was
    /// started again over SSH has a new one, and the old is refused). A renewed
    /// certificate's first use replaces the one before, and a join's spends its token
    /// ([`Book::confirm`]).
    fn book_accepts(&self, ca: &ClusterCa, node: &str, cert: &CertificateDer<'_>) -> bool {
        let Ok(book) = Book::read(ca.dir()) else {
            return false;
        };
        if !book.accepts(node, cert) {
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

    /// Elsewhere: whether `cert` is the head's certificate this node takes: the one it
    /// learned at its join (or was handed over SSH), or the next one of a rotation that
    /// one signed ([`PeerTls::learn`]). The head showing the next one makes it the only
    /// one from then on (kept first), so the one before, and its key, are refused.
    fn accepts_as_head(&self, cert: &CertificateDer<'_>) -> bool {
        let hash = cert_hash(cert);
        if self.current().creds.head_hash().as_ref() == Some(&hash) {
            return true;
        }
        let next = self
            .head_next
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(next) = next.filter(|pem| hash_of(pem).as_ref() == Some(&hash)) else {
            return false;
        };
        if let Some(dir) = &self.creds_dir {
            let kept = write_private(&dir.join(HEAD_CERT), &next)
                .and_then(|()| remove(&dir.join(HEAD_NEXT)));
            if let Err(e) = kept {
                tracing::warn!("keeping the head's rotated certificate: {e}");
            }
        }
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        current.creds.head_pem = Some(next);
        *self.head_next.write().unwrap_or_else(|e| e.into_inner()) = None;
        tracing::info!(
            "the head uses its rotated certificate: the one before is refused from now on"
        );
        true
    }

    /// Elsewhere: takes the head's rotation of its certificate when the certificate this
    /// node takes for the head's signed it: the next one is kept (before it is taken), and
    /// taken for the head's as well from now on.
    fn take_rotation(&self, rotation: &HeadRotation) {
        let Some(head_pem) = self.current().creds.head_pem.clone() else {
            return;
        };
        let next = self
            .head_next
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if next.as_deref() == Some(rotation.cert_pem.as_str()) {
            return;
        }
        if !rotation_holds(&head_pem, &self.head, rotation) {
            tracing::warn!(
                "the head announced a rotation of its certificate that the one this node takes did not sign: ignored"
            );
            return;
        }
        if let Some(dir) = &self.creds_dir
            && let Err(e) = write_private(&dir.join(HEAD_NEXT), &rotation.cert_pem)
        {
            tracing::warn!("keeping the head's next certificate: {e}; not taken");
            return;
        }
        *self.head_next.write().unwrap_or_else(|e| e.into_inner()) =
            Some(rotation.cert_pem.clone());
        tracing::info!(
            "the head's certificate is rotating (next SHA-256 {}): taken, used at the head's next `up`",
            &rotation.sha256[..16.min(rotation.sha256.len())]
        );
    }

    /// Elsewhere: whether `cert` is one the head last said it accepts of `node` (any the
    /// CA signed before the head's first answer).
    fn head_vouches_for(&self, node: &str, cert: &CertificateDer<'_>) -> bool {
        let vouched = self.vouched.read().unwrap_or_else(|e| e.into_inner());
        let hash = cert_hash(cert);
        vouched
            .as_ref()
            .is_none_or(|m| m.get(node).is_some_and(|h| h.contains(&hash)))
    }

    /// On the head: the certificate it accepts of each node, for its answers to the
    /// nodes' status polls (None elsewhere, or when the book cannot be read).
    pub fn accepted(&self) -> Option<BTreeMap<String, Accepted>> {
        let ca = self.authority.as_ref()?;
        Book::read(ca.dir())
            .ok()
            .map(|b| b.accepted(&self.renew_at_start))
    }

    /// Elsewhere: takes what the head said it accepts of each node, refusing every other
    /// certificate from then on. Whether this node should renew its own now (`Some`: why),
    /// which it should when the head accepts the one it has and marks it for renewal, or
    /// when less than [`RENEW_WITHIN_S`] is left of it.
    pub fn learn(&self, accepted: &BTreeMap<String, Accepted>) -> Option<&'static str> {
        if self.authority.is_some() {
            return None;
        }
        if let Some(rotation) = accepted.get(&self.head).and_then(|a| a.rotation.as_ref()) {
            self.take_rotation(rotation);
        }
        let hashes = accepted
            .iter()
            .map(|(n, a)| {
                let both = std::iter::once(a.sha256.clone()).chain(a.pending.clone());
                (n.clone(), both.collect())
            })
            .collect();
        *self.vouched.write().unwrap_or_else(|e| e.into_inner()) = Some(hashes);
        let mine = accepted.get(&self.node)?;
        let current =
            CertificateDer::from_pem_slice(self.current().creds.cert_pem.as_bytes()).ok()?;
        if mine.sha256 != cert_hash(&current) {
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
}

impl PeerTls {
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
        if !cert.is_some_and(|c| self.accepts(node, c)) {
            return Err(std::io::Error::other(self.refusal(node)));
        }
        Ok(tls)
    }

    /// Why `node`'s certificate was refused, for the error of a connection to it.
    fn refusal(&self, node: &str) -> String {
        if self.authority.is_some() || node != self.head {
            return format!(
                "node {node} showed a certificate that is not the one the head accepts of it (replaced: it renewed, joined again or was started again; or revoked)"
            );
        }
        match self.current().creds.head_pem {
            Some(_) => format!(
                "node {node} (the head) showed a certificate that is not the one this node takes for the head's (learned at its join, changed only by a rotation the head signs): an old or stolen head key, or a head made anew; if the head was made anew, on it run `pdctl join-token --node {}` and join again",
                self.node
            ),
            None => format!(
                "this node knows no certificate of the head (its credentials were kept by an older pdctl): on the head run `pdctl join-token --node {}` and join again",
                self.node
            ),
        }
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
            .filter(|n| self.accepts(n, cert))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::tls::NODE_KEY;

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

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_node_takes_for_the_heads_only_the_certificate_it_learned_or_one_that_one_rotated_to() {
        use crate::control::tls::rotation::{head_creds_at_up, stage_head_rotation};
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let head = ca.issue("head", "head").unwrap();
        head.write(dir.path()).unwrap();
        let nodes: Vec<String> = ["head", "a"].map(String::from).to_vec();
        let a_creds = ca.issue("a", "ssh").unwrap();
        assert_eq!(a_creds.head_pem.as_deref(), Some(head.cert_pem.as_str()));
        let kept = dir.path().join("a");
        a_creds.write(&kept).unwrap();
        let a = PeerTls::new("c1", "head", nodes.clone(), &a_creds, None)
            .unwrap()
            .keeping_in(&kept);
        // Another certificate the CA signed for the head's name (an old one, a stolen key's):
        // refused from the first contact on.
        let (other_head, _) = ca.sign_new("head", "head").unwrap();
        assert!(a.accepts("head", &der(&head.cert_pem)));
        assert!(!a.accepts("head", &der(&other_head.cert_pem)));

        let head_tls = PeerTls::new(
            "c1",
            "head",
            nodes.clone(),
            &head,
            ClusterCa::load(dir.path(), "c1").unwrap(),
        )
        .unwrap();
        let staged = stage_head_rotation(&ca, &head).unwrap();
        // A rotation to a certificate the head's did not sign is not taken.
        let mut forged = staged.clone();
        forged.cert_pem = other_head.cert_pem.clone();
        forged.sha256 = cert_hash(&der(&other_head.cert_pem));
        let mut said = head_tls.accepted().unwrap();
        let real = said.clone();
        said.get_mut("head").unwrap().rotation = Some(forged);
        a.learn(&said);
        assert!(!a.accepts("head", &der(&other_head.cert_pem)), "forged");
        // The head's status answers announce the real one: taken, and kept.
        assert_eq!(real["head"].rotation.as_ref(), Some(&staged));
        a.learn(&real);
        assert!(kept.join(HEAD_NEXT).exists());
        // A restart of the node keeps it; the head's next `up` puts it to use.
        let a = PeerTls::new(
            "c1",
            "head",
            nodes,
            &NodeCreds::read(&kept).unwrap().unwrap(),
            None,
        )
        .unwrap()
        .keeping_in(&kept);
        let at_up = head_creds_at_up(&ca, "head").unwrap();
        assert_eq!(at_up.creds.cert_pem, staged.cert_pem);
        assert!(at_up.note.unwrap().contains("rotated"));
        let book = Book::read(dir.path()).unwrap();
        assert!(book.head_next.is_none());
        assert_eq!(book.issued["head"].sha256, staged.sha256);
        assert!(a.accepts("head", &der(&at_up.creds.cert_pem)));
        // From then on the old certificate (and its key) is refused, also after a restart.
        assert!(!a.accepts("head", &der(&head.cert_pem)), "the old one");
        let kept_creds = NodeCreds::read(&kept).unwrap().unwrap();
        assert_eq!(
            kept_creds.head_pem.as_deref(),
            Some(staged.cert_pem.as_str())
        );
        assert!(!kept.join(HEAD_NEXT).exists());
        let again = head_creds_at_up(&ca, "head").unwrap();
        assert_eq!(again.creds, at_up.creds);
        assert!(again.note.is_none(), "{:?}", again.note);
    }

    #[test]
    fn a_head_certificate_near_its_end_is_kept_and_its_rotation_staged_at_up() {
        use crate::control::tls::rotation::head_creds_at_up;
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let first = head_creds_at_up(&ca, "head").unwrap();
        assert!(first.note.is_none(), "the first `up` says nothing");
        Book::update(dir.path(), |b| {
            b.issued.get_mut("head").unwrap().not_after_s = now_s() + 86_400;
            Ok(())
        })
        .unwrap()
        .unwrap();
        let at_up = head_creds_at_up(&ca, "head").unwrap();
        assert_eq!(at_up.creds, first.creds, "kept until its rotation is used");
        assert!(at_up.note.unwrap().contains("staged"));
        assert!(Book::read(dir.path()).unwrap().head_next.is_some());
    }
}
