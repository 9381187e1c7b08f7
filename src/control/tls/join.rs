//! The head answering a join: a node started by hand proves its token and is given its
//! certificate.

use super::book::{Book, TokenRecord};
use super::channel::PeerTls;
use super::creds::NodeCreds;
use super::now_s;
use super::token::proof_holds;

impl PeerTls {
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
            let (mut creds, issued) = ca.sign_new(node, "join").map_err(|e| e.to_string())?;
            // The head's certificate this session showed: the only one the node takes
            // for the head's from now on.
            creds.head_pem = Some(self.creds().cert_pem);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::tls::CERT_LIFETIME_S;
    use crate::control::tls::book::BOOK;
    use crate::control::tls::ca::ClusterCa;
    use crate::control::tls::token::{JoinToken, TokenSecret};
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

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
            first.head_pem.as_deref(),
            Some(head.cert_pem.as_str()),
            "a node joining learns the head's certificate"
        );
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
            if value.len() < 16 {
                continue;
            }
            let secret = TokenSecret(value.to_string());
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
}
