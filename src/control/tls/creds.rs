//! A node's credentials on the channel as its state dir keeps them.

use super::{
    CA_CERT, HEAD_CERT, NODE_CERT, NODE_KEY, NODE_NAME, TlsError, cert_hash, make_dir, read_text,
    write_private,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;

/// A node's credentials on the channel: the cluster's CA certificate, the node's own
/// certificate and key, and (on a node other than the head) the head's certificate, the
/// only one it takes for the head's. `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeCreds {
    pub node: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    /// The head's certificate as this node learned it (at its join, or handed over SSH);
    /// replaced only through a rotation the head signs with it ([`super::Accepted`]).
    /// None on the head, and in what an older pdctl kept (such a node joins again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_pem: Option<String>,
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
            head_pem: read_text(&dir.join(HEAD_CERT))?,
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
        if let Some(head) = &self.head_pem {
            write_private(&dir.join(HEAD_CERT), head)?;
        }
        write_private(&dir.join(NODE_NAME), &format!("{}\n", self.node))
    }

    /// SHA-256 of the head's certificate these credentials take for the head's.
    pub fn head_hash(&self) -> Option<String> {
        let pem = self.head_pem.as_ref()?;
        CertificateDer::from_pem_slice(pem.as_bytes())
            .ok()
            .map(|d| cert_hash(&d))
    }

    /// SHA-256 of the CA certificate these credentials trust.
    pub fn ca_hash(&self) -> String {
        CertificateDer::from_pem_slice(self.ca_pem.as_bytes())
            .map(|d| cert_hash(&d))
            .unwrap_or_else(|_| "(unreadable)".into())
    }

    /// Whether every part parses.
    fn check(&self) -> Result<(), String> {
        if let Some(head) = &self.head_pem {
            CertificateDer::from_pem_slice(head.as_bytes())
                .map_err(|e| format!("the head's certificate: {e}"))?;
        }
        self.parts().map(|_| ())
    }

    pub(super) fn parts(
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
