//! A node's side of the channel: the TLS configurations made of its credentials, and which
//! certificate of each node it accepts.

use super::book::{Accepted, Book};
use super::ca::ClusterCa;
use super::creds::NodeCreds;
use super::{RENEW_WITHIN_S, TlsError, cert_hash, now_s, provider, server_name};
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
    /// When this was made (Unix seconds): on the head, the start of its supervisor.
    started_s: u64,
    /// Elsewhere: the SHA-256 of the certificates the head accepts of each node (its
    /// current one, and a renewed one not used yet), from its last status answer (None
    /// before the first).
    vouched: std::sync::RwLock<Option<BTreeMap<String, Vec<String>>>>,
    /// Elsewhere: the key (PEM) of a renewal asked whose certificate is not installed
    /// yet, asked for again with the same key (the head then sends the same certificate).
    pub(super) renew_key: std::sync::Mutex<Option<String>>,
    /// How many renewed certificates this node has installed: a connection kept from
    /// before one is opened again, so the head sees the new one used and drops the old.
    pub(super) installed: std::sync::atomic::AtomicU64,
}

/// The credentials a node uses now, and the TLS configurations made of them.
pub(super) struct Current {
    creds: NodeCreds,
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
        Ok(PeerTls {
            cluster: cluster.to_string(),
            node: creds.node.clone(),
            head: head.to_string(),
            nodes,
            current: std::sync::RwLock::new(configs(creds)?),
            authority,
            creds_dir: None,
            started_s: now_s(),
            vouched: std::sync::RwLock::new(None),
            renew_key: std::sync::Mutex::new(None),
            installed: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The same, keeping a renewed certificate and key in `dir` (a state dir's `tls/`,
    /// where `creds` came from).
    pub fn keeping_in(mut self, dir: &Path) -> PeerTls {
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

    /// Elsewhere: whether `cert` passes for the head's (any the CA signed for the head's
    /// name: a node must reach the head to learn anything).
    fn accepts_as_head(&self, _cert: &CertificateDer<'_>) -> bool {
        true
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
}
