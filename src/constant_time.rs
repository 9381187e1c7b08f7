//! The one way pdctl compares a secret with what a peer sent: in time that says nothing
//! of how much of the secret a guess got right.
//!
//! Both sides are hashed first (SHA-256, as vLLM compares API keys), so neither the
//! position of the first difference nor the secret's length shows in the time taken;
//! the digests are then compared byte by byte without an early exit.

use sha2::{Digest, Sha256};

/// Whether `given` equals `secret`, compared in constant time (for API keys, engine keys,
/// proofs: anything a client could probe byte by byte).
pub fn equal(given: &[u8], secret: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(given), Sha256::digest(secret));
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_only_when_every_byte_and_the_length_match() {
        assert!(equal(b"s3cret-key-0123456", b"s3cret-key-0123456"));
        assert!(equal(b"", b""));
        assert!(!equal(b"s3cret-key-0123457", b"s3cret-key-0123456"));
        assert!(!equal(b"s3cret-key-012345", b"s3cret-key-0123456"));
        assert!(!equal(b"", b"s3cret-key-0123456"));
        assert!(!equal(b"S3cret-key-0123456", b"s3cret-key-0123456"));
    }
}
