//! The head's certificate rotated. The other nodes take for the head's only the
//! certificate they learned at their join (or were handed over SSH); a new one reaches
//! them only as a rotation the head's certificate of now signs ([`HeadRotation`]):
//! staged on the head (`pdctl join-token --rotate-head`, or its `up` when its certificate
//! nears its end), announced in the head's status answers, taken by each node, and put to
//! use at the head's next `up`. A leaked head key is shut out by rotating away from it.

use super::book::{Book, HeadRotation, Issued};
use super::ca::ClusterCa;
use super::creds::NodeCreds;
use super::{
    NEXT_CERT, NEXT_KEY, RENEW_WITHIN_S, TlsError, cert_hash, now_s, read_text, write_private,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Labels what a rotation's signature signs.
const ROTATION_LABEL: &[u8] = b"pdctl-head-rotation-v1";

/// What a rotation's signature signs: a label, the head's name (its length first) and the
/// next certificate's SHA-256 (hex).
pub(super) fn rotation_message(head: &str, next_sha256: &str) -> Vec<u8> {
    let mut m = ROTATION_LABEL.to_vec();
    m.extend_from_slice(&(head.len() as u32).to_be_bytes());
    m.extend_from_slice(head.as_bytes());
    m.extend_from_slice(next_sha256.as_bytes());
    m
}

/// Whether `rotation` of `head`'s certificate is signed by the key of `head_pem` (the
/// head's certificate a node takes now).
pub(super) fn rotation_holds(head_pem: &str, head: &str, rotation: &HeadRotation) -> bool {
    let (Ok(der), Ok(signature)) = (
        CertificateDer::from_pem_slice(head_pem.as_bytes()),
        hex::decode(&rotation.signature),
    ) else {
        return false;
    };
    if cert_hash(&der) != rotation.signed_by
        || hash_of(&rotation.cert_pem).as_ref() != Some(&rotation.sha256)
    {
        return false;
    }
    let Ok(cert) = webpki::EndEntityCert::try_from(&der) else {
        return false;
    };
    cert.verify_signature(
        webpki::ring::ECDSA_P256_SHA256,
        &rotation_message(head, &rotation.sha256),
        &signature,
    )
    .is_ok()
}

/// On the head: stages a rotation of its certificate `current` (the head's credentials of
/// now): a new key and certificate signed by `ca`, kept in `tls/next.key` and
/// `tls/next.pem` first, then recorded in the book with the signature of `current`'s key,
/// so the running supervisor announces it. A rotation staged before is replaced.
pub fn stage_head_rotation(ca: &ClusterCa, current: &NodeCreds) -> Result<HeadRotation, TlsError> {
    use rcgen::SigningKey;
    let (next, issued) = ca.sign_new(&current.node, "head")?;
    write_private(&ca.dir().join(NEXT_KEY), &next.key_pem)?;
    write_private(&ca.dir().join(NEXT_CERT), &next.cert_pem)?;
    let bad = |why: String| TlsError::Bad {
        path: ca.dir().to_path_buf(),
        why,
    };
    let key = rcgen::KeyPair::from_pem(&current.key_pem)
        .map_err(|e| bad(format!("the head's key: {e}")))?;
    let der = CertificateDer::from_pem_slice(current.cert_pem.as_bytes())
        .map_err(|e| bad(format!("the head's certificate: {e}")))?;
    let signature = key
        .sign(&rotation_message(&current.node, &issued.sha256))
        .map_err(|e| TlsError::Make(e.to_string()))?;
    let rotation = HeadRotation {
        serial: issued.serial,
        sha256: issued.sha256,
        issued_s: issued.issued_s,
        not_after_s: issued.not_after_s,
        signed_by: cert_hash(&der),
        signature: hex::encode(signature),
        cert_pem: next.cert_pem,
    };
    let staged = rotation.clone();
    Book::update(ca.dir(), move |b| {
        b.head_next = Some(staged);
        Ok(())
    })?
    .map_err(TlsError::Make)?;
    Ok(rotation)
}

/// The head's own credentials at its `up`, and what became of them.
#[derive(Debug)]
pub struct HeadAtUp {
    pub creds: NodeCreds,
    /// What changed, for `up` to say (None: the certificate of before, unchanged).
    pub note: Option<String>,
}

/// On the head, at its `up`: its own credentials. A rotation staged is put to use (the
/// other nodes took its certificate while the head ran); a certificate missing, of another
/// CA, revoked or expired is made anew (nodes that joined must join again: nothing vouches
/// for the new one); one with less than [`RENEW_WITHIN_S`] left is kept and a rotation is
/// staged, put to use at the next `up`.
pub fn head_creds_at_up(ca: &ClusterCa, head: &str) -> Result<HeadAtUp, TlsError> {
    let dir = ca.dir();
    if let Some(creds) = take_rotation(ca, head)? {
        let note = format!(
            "the head's certificate rotated to the one staged (SHA-256 {}); the nodes took it while the head ran, and a node that did not joins again",
            short(&creds)
        );
        return Ok(HeadAtUp {
            creds,
            note: Some(note),
        });
    }
    let book = Book::read(dir)?;
    let kept = NodeCreds::read(dir)?;
    let usable = kept.clone().filter(|c| {
        let issued = book.issued.get(head);
        c.node == head
            && c.ca_hash() == ca.hash()
            && issued.is_some_and(|i| Some(&i.sha256) == hash_of(&c.cert_pem).as_ref())
            && issued.is_some_and(|i| i.not_after_s > now_s())
    });
    let Some(creds) = usable else {
        let creds = ca.issue(head, "head")?;
        creds.write(dir)?;
        let note = kept.map(|_| {
            "the head's certificate was missing from its book, of another CA or expired: a new one was made, which nodes that joined do not take (join them again)".to_string()
        });
        return Ok(HeadAtUp { creds, note });
    };
    let ending = book
        .issued
        .get(head)
        .is_some_and(|i| i.not_after_s < now_s() + RENEW_WITHIN_S);
    if ending && book.head_next.is_none() {
        let staged = stage_head_rotation(ca, &creds)?;
        let note = format!(
            "the head's certificate ends within 30 days: its next one (SHA-256 {}) is staged, announced to the nodes now and put to use at the next `up`",
            &staged.sha256[..16]
        );
        return Ok(HeadAtUp {
            creds,
            note: Some(note),
        });
    }
    Ok(HeadAtUp { creds, note: None })
}

/// SHA-256 of the certificate in `pem`.
pub(super) fn hash_of(pem: &str) -> Option<String> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .ok()
        .map(|d| cert_hash(&d))
}

/// The first 16 hex digits of `creds`' certificate's SHA-256.
fn short(creds: &NodeCreds) -> String {
    hash_of(&creds.cert_pem)
        .map(|h| h[..16].to_string())
        .unwrap_or_default()
}

/// Puts a staged rotation to use: the next key and certificate become the head's (kept
/// first), then the book records it as the head's, then the staged files go. Asked again
/// after a crash between, it does the same again. None when nothing is staged.
fn take_rotation(ca: &ClusterCa, head: &str) -> Result<Option<NodeCreds>, TlsError> {
    let dir = ca.dir();
    let Some(next) = Book::read(dir)?.head_next else {
        return Ok(None);
    };
    let (Some(cert_pem), Some(key_pem)) = (
        read_text(&dir.join(NEXT_CERT))?,
        read_text(&dir.join(NEXT_KEY))?,
    ) else {
        return Err(TlsError::Bad {
            path: dir.join(NEXT_CERT),
            why: "a rotation of the head's certificate is staged in the book, but its key or certificate is missing; stage it again with `pdctl join-token --rotate-head`".into(),
        });
    };
    if hash_of(&cert_pem).as_ref() != Some(&next.sha256) {
        return Err(TlsError::Bad {
            path: dir.join(NEXT_CERT),
            why: "it is not the certificate the book's staged rotation names; stage it again with `pdctl join-token --rotate-head`".into(),
        });
    }
    let creds = NodeCreds {
        node: head.to_string(),
        ca_pem: ca.cert_pem().to_string(),
        cert_pem,
        key_pem,
        head_pem: None,
    };
    creds.write(dir)?;
    let head_name = head.to_string();
    Book::update(dir, move |b| {
        b.issued.insert(
            head_name,
            Issued {
                serial: next.serial,
                sha256: next.sha256,
                issued_s: next.issued_s,
                not_after_s: next.not_after_s,
                how: "head".into(),
                pending: None,
            },
        );
        b.head_next = None;
        Ok(())
    })?
    .map_err(TlsError::Make)?;
    for f in [NEXT_CERT, NEXT_KEY] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    Ok(Some(creds))
}
