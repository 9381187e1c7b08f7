//! Deterministic output, as greedy decoding of a real model: each generated token is a
//! function of the whole sequence before it (the prompt's token ids and the tokens
//! generated so far) and of the choice index. So the same prompt gives the same text on
//! every instance and topology (tests compare answers across them), and a prompt that is
//! another request's prompt followed by the first k tokens it generated goes on with
//! exactly the tokens that request generated after them, ending where it would have
//! ended: what the proxy relies on when it continues a stream whose decode died on
//! another decode (docs/proxy.md, "Streams that go on"). Sampling parameters such as
//! `temperature`, `top_p` and `seed` are accepted and ignored.
//!
//! Each generated token is one word from a fixed list with its leading space, or a
//! comma or full stop: pieces that the simulator's tokenizer reads back as exactly one
//! token each, so `completion_tokens` matches the text.

use super::tokenizer::token_id;
use std::sync::OnceLock;

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

/// A full stop and a comma: the pieces that are not words.
const PUNCTUATION: [&str; 2] = [".", ","];

/// The sequence's state before its first token: the choice index mixed in, so the
/// choices of one prompt differ.
fn start(choice: u32) -> u64 {
    0x6a09_e667_f3bc_c908u64 ^ u64::from(choice).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The state once token `id` is part of the sequence.
fn fold(state: u64, id: u32) -> u64 {
    mix(state ^ u64::from(id).wrapping_mul(0xd6e8_feb8_6659_fd93))
}

/// How many tokens the simulated model "wants" to write before EOS, counted from the
/// state where its answer began.
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

/// The token ids of [`WORDS`] and [`PUNCTUATION`], computed once.
fn ids() -> &'static ([u32; 64], [u32; 2]) {
    static IDS: OnceLock<([u32; 64], [u32; 2])> = OnceLock::new();
    IDS.get_or_init(|| (WORDS.map(token_id), PUNCTUATION.map(token_id)))
}

/// The piece the model writes next in `state`, after the token `prev`: a comma or full
/// stop now and then, never right after another one (nor first in an empty sequence).
fn predict(state: u64, prev: Option<u32>) -> (&'static str, u32) {
    let (words, punct) = ids();
    let r = state >> 32;
    let after_word = prev.is_some_and(|p| !punct.contains(&p));
    if after_word && r % 11 == 0 {
        let i = usize::from(r % 3 != 0);
        (PUNCTUATION[i], punct[i])
    } else {
        let i = (state % WORDS.len() as u64) as usize;
        (WORDS[i], words[i])
    }
}

/// One output sequence of the model, from its prompt on.
#[derive(Debug, Clone)]
pub struct Pieces {
    state: u64,
    prev: Option<u32>,
    /// Tokens at the end of the prompt that are the model's own continuation (a prompt
    /// that carries an answer begun elsewhere): they count towards the natural length.
    pub already: u32,
    /// Where the model would end its answer, counted from where the answer began.
    pub natural: u32,
}

impl Pieces {
    /// The sequence that `prompt` (token ids) begins, for choice `choice`. The answer is
    /// taken to begin after the last prompt token the model would not have written
    /// itself: tokens after it are an answer being continued, so the natural length is
    /// counted from there and the same answer ends at the same token however much of it
    /// the prompt carries.
    pub fn new(prompt: &[u32], choice: u32) -> Pieces {
        let mut state = start(choice);
        let mut prev = None;
        let mut began = state;
        let mut already = 0u32;
        for &t in prompt {
            let own = predict(state, prev).1 == t;
            state = fold(state, t);
            prev = Some(t);
            if own {
                already += 1;
            } else {
                already = 0;
                began = state;
            }
        }
        Pieces {
            state,
            prev,
            already,
            natural: natural_length(began),
        }
    }

    /// The next token: its text and its id.
    pub fn next_piece(&mut self) -> (&'static str, u32) {
        let (piece, id) = predict(self.state, self.prev);
        self.state = fold(self.state, id);
        self.prev = Some(id);
        (piece, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::tokenizer;

    fn text(prompt: &[u32], n: usize) -> String {
        let mut p = Pieces::new(prompt, 0);
        (0..n).map(|_| p.next_piece().0).collect()
    }

    fn ids(prompt: &[u32], choice: u32, n: usize) -> Vec<u32> {
        let mut p = Pieces::new(prompt, choice);
        (0..n).map(|_| p.next_piece().1).collect()
    }

    #[test]
    fn same_prompt_same_text_other_prompt_other_text() {
        let a = tokenizer::encode("San Francisco is a");
        let b = tokenizer::encode("Tell me about Roger Federer");
        assert_eq!(text(&a, 30), text(&a, 30));
        assert_ne!(text(&a, 30), text(&b, 30));
        assert_ne!(ids(&a, 0, 30), ids(&a, 1, 30));
    }

    #[test]
    fn generated_text_tokenizes_back_to_the_same_count_and_ids() {
        for n in 0..50u32 {
            let prompt: Vec<u32> = (0..n + 3).map(|i| i * 7 + n).collect();
            let t = text(&prompt, 40);
            assert_eq!(tokenizer::count(&t), 40, "prompt {n}");
            assert_eq!(tokenizer::encode(&t), ids(&prompt, 0, 40), "prompt {n}");
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
    fn a_prompt_carrying_part_of_its_answer_goes_on_with_the_rest_and_ends_there() {
        let prompt = tokenizer::encode("Tell me about Roger Federer and his");
        let whole = Pieces::new(&prompt, 0);
        assert_eq!(whole.already, 0);
        let answer = ids(&prompt, 0, 120);
        for k in [1usize, 5, 20, 77] {
            let mut carried = prompt.clone();
            carried.extend_from_slice(&answer[..k]);
            let go_on = Pieces::new(&carried, 0);
            assert_eq!(go_on.already as usize, k, "k={k}");
            assert_eq!(go_on.natural, whole.natural, "k={k}");
            assert_eq!(ids(&carried, 0, 120 - k), answer[k..], "k={k}");
        }
    }

    #[test]
    fn long_prompts_depend_on_all_their_tokens() {
        let mut a: Vec<u32> = (0..1000).collect();
        let first = ids(&a, 0, 10);
        a[999] = 7;
        assert_ne!(first, ids(&a, 0, 10));
        a[999] = 999;
        a[3] = 4;
        assert_ne!(first, ids(&a, 0, 10));
    }
}
