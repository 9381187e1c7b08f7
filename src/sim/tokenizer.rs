//! The simulator's tokenizer: a fixed, documented rule so prompt and completion token
//! counts mean something, and token ids are the same in every process (prefill and
//! decode must agree on block hashes).
//!
//! The rule, applied left to right:
//! - a run of ASCII letters/digits (or of any non-ASCII characters), at most
//!   [`MAX_WORD_BYTES`] bytes, is one token; a single space right before it joins it
//!   (`" Francisco"`), as byte-pair tokenizers do;
//! - every other character (punctuation, newline, a space not followed by a word) is a
//!   token of its own.
//!
//! So `"San Francisco is a"` is 4 tokens, like a real tokenizer would make it.
//! A token's id is the FNV-1a hash of its bytes folded into [`VOCAB_SIZE`].

/// Ids fall in `0..VOCAB_SIZE`, like a real vocabulary.
pub const VOCAB_SIZE: u32 = 100_000;

/// Longest word token in bytes; longer runs are split (as real tokenizers split rare words).
pub const MAX_WORD_BYTES: usize = 12;

/// The byte-level FNV-1a hash: stable across processes and machines (unlike std's hasher).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The id of one token's text.
pub fn token_id(piece: &str) -> u32 {
    (fnv1a(piece.as_bytes()) % u64::from(VOCAB_SIZE)) as u32
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b >= 0x80
}

/// Calls `f` with each token's text, in order.
pub fn for_each_piece(text: &str, mut f: impl FnMut(&str)) {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        if bytes[i] == b' ' && i + 1 < bytes.len() && is_word_byte(bytes[i + 1]) {
            i += 1;
        }
        if is_word_byte(bytes[i]) {
            let limit = (i + MAX_WORD_BYTES).min(bytes.len());
            while i < limit && is_word_byte(bytes[i]) {
                i += 1;
            }
            // Never split a multi-byte character.
            while !text.is_char_boundary(i) {
                i += 1;
            }
        } else {
            i += text[i..].chars().next().map_or(1, char::len_utf8);
        }
        f(&text[start..i]);
    }
}

/// The token ids of `text`, appended to `out`.
pub fn encode_into(text: &str, out: &mut Vec<u32>) {
    for_each_piece(text, |p| out.push(token_id(p)));
}

/// The token ids of `text`.
pub fn encode(text: &str) -> Vec<u32> {
    let mut v = Vec::with_capacity(text.len() / 4 + 1);
    encode_into(text, &mut v);
    v
}

/// How many tokens `text` has.
pub fn count(text: &str) -> usize {
    let mut n = 0;
    for_each_piece(text, |_| n += 1);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let mut v = Vec::new();
        for_each_piece(text, |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn words_take_their_leading_space() {
        assert_eq!(
            pieces("San Francisco is a"),
            ["San", " Francisco", " is", " a"]
        );
    }

    #[test]
    fn punctuation_and_newlines_are_single_tokens() {
        assert_eq!(
            pieces("Hi, you!\n  ok"),
            ["Hi", ",", " you", "!", "\n", " ", " ok"]
        );
    }

    #[test]
    fn long_words_are_split_and_utf8_stays_whole() {
        assert_eq!(pieces("abcdefghijklmnop"), ["abcdefghijkl", "mnop"]);
        let s = "ééééééééé";
        assert_eq!(pieces(s).concat(), s);
        assert!(pieces(s).len() >= 2);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let s = "The quick  brown\tfox -- 42 times; 日本語 ok.";
        assert_eq!(pieces(s).concat(), s);
        assert_eq!(count(s), pieces(s).len());
    }

    #[test]
    fn ids_are_stable_and_in_range() {
        // Fixed values: a change here breaks handoffs between sims of different builds.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let ids = encode("San Francisco is a");
        assert_eq!(ids, encode("San Francisco is a"));
        assert!(ids.iter().all(|&i| i < VOCAB_SIZE));
        assert_ne!(token_id("San"), token_id(" San"));
    }

    #[test]
    fn empty_text_has_no_tokens() {
        assert!(encode("").is_empty());
        assert_eq!(count(""), 0);
    }
}
