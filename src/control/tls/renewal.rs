//! Renewal over the channel: a node asks the head to certify a new key of its own, and the
//! head answers (two-phase: the old certificate stays accepted until the new one is used).

use super::book::{Book, Pending, RENEWED};
use super::ca::{KEY_ALG, NewPublicKey};
use super::channel::{PeerTls, configs};
use super::creds::NodeCreds;
use super::{TlsError, provider, server_name};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, UnixTime};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The label under which a renewal's proof of the new key is exported from the session.
pub const RENEW_EXPORTER_LABEL: &[u8] = b"EXPORTER-pdctl-renew-v1";

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

impl PeerTls {
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
        if !self.accepts(node, cert) {
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
            head_pem: old.head_pem.clone(),
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
        if let Some(dir) = &self.creds_dir {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::tls::ca::ClusterCa;
    use crate::control::tls::cert_hash;
    use rustls::pki_types::pem::PemObject;

    #[test]
    fn a_join_in_the_book_at_the_heads_start_is_renewed_even_in_the_same_second() {
        // CI: the head's supervisor started again within the second of the worker's join,
        // and a rule by seconds (issued before the start) never asked the worker to renew.
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let nodes: Vec<String> = ["head", "a", "b"].map(String::from).to_vec();
        let head_creds = ca.issue("head", "head").unwrap();
        ca.issue("a", "join").unwrap();
        let head = PeerTls::new("c1", "head", nodes, &head_creds, Some(ca)).unwrap();
        let later = ClusterCa::load(dir.path(), "c1").unwrap().unwrap();
        later.issue("b", "join").unwrap();
        let said = head.accepted().unwrap();
        assert!(said["a"].renew, "joined before this start: renews");
        assert!(!said["b"].renew, "joined since: keeps its certificate");
        assert!(!said["head"].renew);
    }

    #[test]
    fn a_node_renews_over_the_channel_for_its_own_name_and_the_old_certificate_goes() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::load_or_make(dir.path(), "c1").unwrap();
        let nodes: Vec<String> = ["head", "a", "b"].map(String::from).to_vec();
        let head_creds = ca.issue("head", "head").unwrap();
        head_creds.write(dir.path()).unwrap();
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
        let accepted = head.accepted().unwrap();
        assert!(accepted["a"].renew && !accepted["head"].renew);
        assert_eq!(accepted, book.accepted(&book.renewable()));
        assert_eq!(
            a.learn(&accepted),
            Some("the head's `up` renews the certificates of nodes that joined")
        );
        assert_eq!(
            a.learn(&book.accepted(&Default::default())),
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
        assert!(head.accepted().unwrap()["a"].renew, "still asked to renew");
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
            !head.accepted().unwrap()["a"].renew,
            "renewed since the head's start: not asked again"
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
        assert_eq!(a.learn(&book.accepted(&Default::default())), None);
        assert_eq!(a.node_of(&der(&b_old.cert_pem)), None, "replaced");
        assert_eq!(a.node_of(&der(&b_new.cert_pem)).as_deref(), Some("b"));
        assert!(a.accepts("head", &der(&head_creds.cert_pem)));
    }

    /// A certificate of node `a` for a key no renewal holds.
    fn lost_other(dir: &tempfile::TempDir) -> String {
        let ca = ClusterCa::load(dir.path(), "c1").unwrap().unwrap();
        let key = rcgen::KeyPair::generate_for(KEY_ALG).unwrap();
        ca.sign("a", &key, "join").unwrap().0
    }
}
