//! The cluster's certificate authority, which only the head holds: it signs every node's
//! certificate and records it in the book.

use super::book::{Book, Issued};
use super::creds::NodeCreds;
use super::{
    CA_CERT, CA_KEY, CERT_LIFETIME_S, NODE_CERT, TlsError, cert_hash, make_dir, node_dns, now_s,
    read_text, write_private, ymd,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::path::{Path, PathBuf};

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

    /// The CA's certificate (PEM).
    pub(super) fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The folder of the CA and its book (a state dir's `tls/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new certificate and key for `node`, signed by this CA; good as a server and as
    /// a client, for that node's name only, for [`CERT_LIFETIME_S`]. Recorded in the book
    /// as the node's latest (`how`: `head`, `ssh`, `join`): the one before is refused from
    /// now on. A node other than the head (`how` other than `head`) is given the head's
    /// own certificate, kept in this same folder, as the only one it takes for the head's.
    pub fn issue(&self, node: &str, how: &str) -> Result<NodeCreds, TlsError> {
        let (mut creds, issued) = self.sign_new(node, how)?;
        if how != "head" {
            creds.head_pem = read_text(&self.dir.join(NODE_CERT))?;
        }
        Book::update(&self.dir, |b| {
            b.issued.insert(node.to_string(), issued);
            Ok(())
        })?
        .map_err(TlsError::Make)?;
        Ok(creds)
    }

    /// A new key and certificate for `node` as [`ClusterCa::issue`] makes them, and its
    /// entry for the book, not recorded yet (for a caller that holds the book).
    pub(super) fn sign_new(&self, node: &str, how: &str) -> Result<(NodeCreds, Issued), TlsError> {
        let key =
            rcgen::KeyPair::generate_for(KEY_ALG).map_err(|e| TlsError::Make(e.to_string()))?;
        let (cert_pem, issued) = self.sign(node, &key, how)?;
        let creds = NodeCreds {
            node: node.to_string(),
            ca_pem: self.cert_pem.clone(),
            cert_pem,
            key_pem: key.serialize_pem(),
            head_pem: None,
        };
        Ok((creds, issued))
    }

    /// A certificate (PEM) for `node`'s public key `public`, signed by this CA as
    /// [`ClusterCa::issue`] signs them, with its entry for the book (not recorded).
    pub(super) fn sign(
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
pub(super) const KEY_ALG: &rcgen::SignatureAlgorithm = &rcgen::PKCS_ECDSA_P256_SHA256;

/// A node's new public key as it asks for a certificate: the uncompressed P-256 point.
pub(super) struct NewPublicKey(pub(super) Vec<u8>);

impl rcgen::PublicKeyData for NewPublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        KEY_ALG
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::tls::book::{Pending, RENEW_GRACE_S};

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
        assert!(book.accepts("a", &der), "within the grace");
        let long_ago = now_s() - RENEW_GRACE_S - 1;
        book.issued.get_mut("a").unwrap().pending = Some(pending(long_ago));
        assert!(!book.accepts("a", &der), "past the grace");
    }
}
