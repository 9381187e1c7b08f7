//! Join tokens: what a node started by hand is given, what the head keeps of it, and the
//! proof a joining node sends.

use super::pinned::PinnedCa;
use super::{TlsError, provider, server_name};
use rustls::ClientConfig;
use sha2::Digest;
use std::sync::Arc;

/// The label under which a join is exported from the TLS session (RFC 5705), so a proof
/// of the secret made for one session is worth nothing in another.
pub const JOIN_EXPORTER_LABEL: &[u8] = b"EXPORTER-pdctl-join-v1";

/// What a node started by hand is given to join: the CA's hash (so it trusts no other
/// server), the token's id and its random secret (so the head lets that one node in,
/// once), as `PD2<sha256 of the CA certificate>::<id>.<secret>` (as k3s's
/// `K10<hash>::...` and kubeadm's `<id>.<secret>` tokens). The head keeps only the
/// secret's SHA-256.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub ca_hash: String,
    pub id: String,
    pub secret: TokenSecret,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JoinToken(PD2{}::{}..)", self.ca_hash, self.id)
    }
}

const TOKEN_PREFIX: &str = "PD2";

/// A join token's random secret (256 bits, 64 hex digits): what seeds the key a join is
/// proven with ([`JoinToken::proof`]). Only the token carries it; the head keeps the
/// proof key's public half. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSecret(pub(super) String);

impl std::fmt::Debug for TokenSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSecret(..)")
    }
}

impl TokenSecret {
    /// A new random secret.
    pub fn random() -> TokenSecret {
        TokenSecret(hex::encode(rand::random::<[u8; 32]>()))
    }

    /// The secret as the token prints it.
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl JoinToken {
    /// A new token for the CA whose hash is `ca_hash`: a random id (64 bits) and secret
    /// (256 bits).
    pub fn new(ca_hash: &str) -> JoinToken {
        JoinToken {
            ca_hash: ca_hash.to_string(),
            id: hex::encode(rand::random::<[u8; 8]>()),
            secret: TokenSecret::random(),
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
        let secret = TokenSecret(secret.to_ascii_lowercase());
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
