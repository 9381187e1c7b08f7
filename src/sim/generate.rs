//! Deterministic output: the tokens a sequence generates depend only on its prompt's
//! token ids and its choice index, so the same prompt gives the same text on every
//! instance and topology (tests compare answers across them). Sampling parameters such
//! as `temperature`, `top_p` and `seed` are accepted and ignored.
//!
//! Each generated token is one word from a fixed list with its leading space, or a
//! comma or full stop: pieces that the simulator's tokenizer reads back as exactly one
//! token each, so `completion_tokens` matches the text.

use super::tokenizer::fnv1a;

const WORDS: [&str; 64] = [
    " the",
    " city",
    " of",
    " light",
    " and",
    " river",
    " a",
    " long",
    " history",
    " with",
    " many",
    " small",
    " streets",
    " that",
    " people",
    " love",
    " to",
    " walk",
    " in",
    " summer",
    " its",
    " bridges",
    " old",
    " markets",
    " new",
    " ideas",
    " are",
    " built",
    " on",
    " hills",
    " near",
    " the",
    " sea",
    " where",
    " ships",
    " once",
    " came",
    " from",
    " far",
    " away",
    " today",
    " it",
    " is",
    " known",
    " for",
    " food",
    " music",
    " art",
    " science",
    " parks",
    " quiet",
    " mornings",
    " bright",
    " evenings",
    " simple",
    " houses",
    " tall",
    " towers",
    " green",
    " gardens",
    " every",
    " season",
    " brings",
    " change",
];

/// Shortest and longest natural answer (the point where the model would emit EOS).
const NATURAL_MIN: u64 = 48;
const NATURAL_SPAN: u64 = 208;

/// The seed of one output sequence: a hash of the prompt's token ids and the choice index.
pub fn sequence_seed(prompt_tokens: &[u32], choice: u32) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64 ^ u64::from(choice).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for chunk in prompt_tokens.chunks(64) {
        let mut buf = [0u8; 256];
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h = mix(h ^ fnv1a(&buf[..chunk.len() * 4]));
    }
    h
}

/// How many tokens the simulated model "wants" to write before EOS for this seed.
pub fn natural_length(seed: u64) -> u32 {
    (NATURAL_MIN + mix(seed ^ 0x5151) % NATURAL_SPAN) as u32
}

/// splitmix64's finaliser: a cheap, well-spread 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The token pieces of one sequence, in order.
#[derive(Debug, Clone)]
pub struct Pieces {
    state: u64,
    index: u32,
}

impl Pieces {
    /// The pieces for a sequence with this seed (see [`sequence_seed`]).
    pub fn new(seed: u64) -> Pieces {
        Pieces {
            state: seed,
            index: 0,
        }
    }

    /// The next token's text.
    pub fn next_piece(&mut self) -> &'static str {
        self.state = mix(self.state);
        self.index += 1;
        // A comma or full stop now and then, never twice in a row or first.
        let r = self.state >> 32;
        if self.index > 1 && r % 11 == 0 {
            if r % 3 == 0 { "." } else { "," }
        } else {
            WORDS[(self.state % WORDS.len() as u64) as usize]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::tokenizer;

    fn text(seed: u64, n: usize) -> String {
        let mut p = Pieces::new(seed);
        (0..n).map(|_| p.next_piece()).collect()
    }

    #[test]
    fn same_prompt_same_text_other_prompt_other_text() {
        let a = tokenizer::encode("San Francisco is a");
        let b = tokenizer::encode("Tell me about Roger Federer");
        let sa = sequence_seed(&a, 0);
        assert_eq!(text(sa, 30), text(sequence_seed(&a, 0), 30));
        assert_ne!(text(sa, 30), text(sequence_seed(&b, 0), 30));
        assert_ne!(text(sa, 30), text(sequence_seed(&a, 1), 30));
    }

    #[test]
    fn generated_text_tokenizes_back_to_the_same_count() {
        for seed in 0..50u64 {
            assert_eq!(tokenizer::count(&text(seed, 40)), 40, "seed {seed}");
        }
    }

    #[test]
    fn natural_length_is_within_bounds() {
        for seed in 0..1000u64 {
            let n = u64::from(natural_length(seed));
            assert!((NATURAL_MIN..NATURAL_MIN + NATURAL_SPAN).contains(&n));
        }
    }

    #[test]
    fn long_prompts_hash_all_their_tokens() {
        let mut a: Vec<u32> = (0..1000).collect();
        let s1 = sequence_seed(&a, 0);
        a[999] = 7;
        assert_ne!(s1, sequence_seed(&a, 0));
    }
}
