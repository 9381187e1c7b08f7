//! The requests a benchmark sends: random prompts, shared-prefix groups, or
//! ShareGPT conversations. Deterministic for a given seed.

use super::args::{BenchArgs, DatasetKind, Strategy};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::Path;

/// Completion length when `--output-len` is not given (random and prefix datasets).
pub const DEFAULT_OUTPUT_LEN: usize = 64;

/// One request of a benchmark.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    pub prompt: String,
    pub max_tokens: usize,
    /// `prefill=HOST:PORT;decode=HOST:PORT` when the strategy designates a pair.
    pub user: Option<String>,
    /// The shared-context group (prefix dataset).
    pub group: Option<usize>,
}

/// A dataset that cannot be built from these arguments.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("--dataset sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")]
    NoPath,
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is not ShareGPT JSON (a list of {{\"conversations\": [{{\"from\", \"value\"}}]}}): {source}"
    )]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error(
        "{path} has no usable conversation (each needs a human turn and a reply of 4 to 1024 words)"
    )]
    Empty { path: String },
    #[error(
        "--strategy {strategy} needs the instance lists: give --prefill and --decode HOST:PORT, or run against a pdctl cluster"
    )]
    NoInstances { strategy: &'static str },
    #[error("--num-prompts must be at least 1")]
    NoPrompts,
}

/// Words prompts are made of: common English, so real tokenizers see ~1 token per word.
const WORDS: &[&str] = &[
    "the",
    "model",
    "serves",
    "requests",
    "from",
    "many",
    "users",
    "while",
    "prefill",
    "and",
    "decode",
    "run",
    "on",
    "separate",
    "machines",
    "so",
    "each",
    "stage",
    "gets",
    "its",
    "own",
    "hardware",
    "cache",
    "blocks",
    "move",
    "between",
    "them",
    "over",
    "fast",
    "links",
    "when",
    "a",
    "prompt",
    "arrives",
    "first",
    "token",
    "comes",
    "after",
    "whole",
    "context",
    "is",
    "read",
    "then",
    "tokens",
    "follow",
    "one",
    "by",
    "long",
    "documents",
    "share",
    "their",
    "beginning",
    "which",
    "lets",
    "engine",
    "reuse",
    "work",
    "it",
    "did",
    "before",
    "city",
    "river",
    "bridge",
    "light",
    "morning",
    "story",
    "garden",
    "window",
    "music",
    "road",
];

fn words(rng: &mut StdRng, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    out
}

/// Builds the requests the arguments describe. `prefill`/`decode` are HOST:PORT lists
/// for designation strategies.
pub fn build(
    args: &BenchArgs,
    prefill: &[String],
    decode: &[String],
) -> Result<Vec<BenchRequest>, DatasetError> {
    if args.workload.num_prompts == 0 {
        return Err(DatasetError::NoPrompts);
    }
    let mut rng = StdRng::seed_from_u64(args.workload.seed);
    let mut reqs = match args.workload.dataset {
        DatasetKind::Random => (0..args.workload.num_prompts)
            .map(|_| BenchRequest {
                prompt: words(&mut rng, args.workload.input_len),
                max_tokens: args.workload.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
                user: None,
                group: None,
            })
            .collect(),
        DatasetKind::Prefix => prefix_groups(args, &mut rng),
        DatasetKind::Sharegpt => {
            let path = args
                .workload
                .dataset_path
                .as_deref()
                .ok_or(DatasetError::NoPath)?;
            let convs = load_sharegpt(path)?;
            (0..args.workload.num_prompts)
                .map(|i| {
                    let c = &convs[i % convs.len()];
                    BenchRequest {
                        prompt: c.prompt.clone(),
                        max_tokens: args
                            .workload
                            .output_len
                            .map_or(c.reply_words, |cap| c.reply_words.min(cap)),
                        user: None,
                        group: None,
                    }
                })
                .collect()
        }
    };
    designate(&mut reqs, args.strategy, prefill, decode, &mut rng)?;
    Ok(reqs)
}

/// The prefix-caching workload: G groups, each a long shared context; request i belongs to group
/// i mod G and adds its own question, so groups interleave as users' traffic would.
fn prefix_groups(args: &BenchArgs, rng: &mut StdRng) -> Vec<BenchRequest> {
    let groups = args.workload.prefix_groups.max(1);
    let contexts: Vec<String> = (0..groups)
        .map(|g| {
            format!(
                "Shared context #{g}: {}",
                words(rng, args.workload.prefix_len)
            )
        })
        .collect();
    (0..args.workload.num_prompts)
        .map(|i| {
            let g = i % groups;
            let question = words(rng, args.workload.input_len);
            BenchRequest {
                prompt: format!("{} Question {i}: {question}", contexts[g]),
                max_tokens: args.workload.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
                user: None,
                group: Some(g),
            }
        })
        .collect()
}

/// Sets `user` per the strategy, as hand-written PD test scripts do.
fn designate(
    reqs: &mut [BenchRequest],
    strategy: Strategy,
    prefill: &[String],
    decode: &[String],
    rng: &mut StdRng,
) -> Result<(), DatasetError> {
    let name = match strategy {
        Strategy::None => return Ok(()),
        Strategy::Random => "random",
        Strategy::Designate => "designate",
        Strategy::Rr => "rr",
    };
    if prefill.is_empty() || decode.is_empty() {
        return Err(DatasetError::NoInstances { strategy: name });
    }
    for (i, r) in reqs.iter_mut().enumerate() {
        let (p, d) = match strategy {
            Strategy::Designate => {
                let g = r.group.unwrap_or(i);
                (g % prefill.len(), g % decode.len())
            }
            Strategy::Rr => (i % prefill.len(), i % decode.len()),
            _ => (
                rng.random_range(0..prefill.len()),
                rng.random_range(0..decode.len()),
            ),
        };
        r.user = Some(format!(
            "prefill={};decode={}",
            host_port(&prefill[p]),
            host_port(&decode[d])
        ));
    }
    Ok(())
}

/// `http://h:p/` -> `h:p`.
pub fn host_port(url: &str) -> String {
    let s = url
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    s.trim_end_matches('/').to_string()
}

/// One usable ShareGPT conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub prompt: String,
    pub prompt_words: usize,
    pub reply_words: usize,
}

#[derive(serde::Deserialize)]
struct ShareGptEntry {
    #[serde(default)]
    conversations: Vec<ShareGptTurn>,
}

#[derive(serde::Deserialize)]
struct ShareGptTurn {
    from: String,
    value: String,
}

/// Reads ShareGPT JSON: the first human turn is the prompt, the reply after it sets the
/// output length; conversations too short (< 4 words) or too long (> 1024 words in,
/// > 2048 in total) are skipped, as vLLM's benchmark does with tokens.
pub fn load_sharegpt(path: &Path) -> Result<Vec<Conversation>, DatasetError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Read {
        path: p.clone(),
        source,
    })?;
    let entries: Vec<ShareGptEntry> =
        serde_json::from_str(&text).map_err(|source| DatasetError::Parse {
            path: p.clone(),
            source,
        })?;
    let convs: Vec<Conversation> = entries
        .iter()
        .filter_map(|e| {
            let human = e.conversations.iter().position(|t| t.from == "human")?;
            let reply = e.conversations.get(human + 1)?;
            let prompt = e.conversations[human].value.clone();
            let prompt_words = prompt.split_whitespace().count();
            let reply_words = reply.value.split_whitespace().count();
            let ok = prompt_words >= 4
                && reply_words >= 4
                && prompt_words <= 1024
                && prompt_words + reply_words <= 2048;
            ok.then_some(Conversation {
                prompt,
                prompt_words,
                reply_words,
            })
        })
        .collect();
    if convs.is_empty() {
        return Err(DatasetError::Empty { path: p });
    }
    Ok(convs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        let mut v = vec!["bench"];
        v.extend(extra);
        Cmd::parse_from(v).a
    }

    #[test]
    fn random_prompts_are_reproducible_and_sized() {
        let a = args(&["--num-prompts", "5", "--input-len", "20", "--seed", "7"]);
        let x = build(&a, &[], &[]).unwrap();
        let y = build(&a, &[], &[]).unwrap();
        assert_eq!(x, y);
        assert!(x.iter().all(|r| r.prompt.split_whitespace().count() == 20));
        assert_ne!(x[0].prompt, x[1].prompt);
    }

    #[test]
    fn prefix_groups_share_their_context_and_interleave() {
        let a = args(&[
            "--dataset",
            "prefix",
            "--num-prompts",
            "8",
            "--prefix-groups",
            "2",
            "--prefix-len",
            "50",
        ]);
        let r = build(&a, &[], &[]).unwrap();
        assert_eq!(
            r.iter().map(|r| r.group.unwrap()).collect::<Vec<_>>(),
            [0, 1, 0, 1, 0, 1, 0, 1]
        );
        let ctx = |s: &str| s.split(" Question").next().unwrap().to_string();
        assert_eq!(ctx(&r[0].prompt), ctx(&r[2].prompt));
        assert_ne!(ctx(&r[0].prompt), ctx(&r[1].prompt));
        assert_ne!(r[0].prompt, r[2].prompt);
    }

    #[test]
    fn strategies_designate_pairs_like_seed_001() {
        let p = vec![
            "http://10.0.0.1:8100".to_string(),
            "10.0.0.1:8101".to_string(),
        ];
        let d = vec!["10.0.0.2:8200".to_string()];
        // Four prompts in `groups` prefix groups, paired by `strategy`.
        let prefix = |groups: &str, strategy: &str| {
            args(&[
                "--dataset",
                "prefix",
                "--num-prompts",
                "4",
                "--prefix-groups",
                groups,
                "--strategy",
                strategy,
            ])
        };
        let a = prefix("2", "designate");
        let r = build(&a, &p, &d).unwrap();
        assert_eq!(
            r[0].user.as_deref(),
            Some("prefill=10.0.0.1:8100;decode=10.0.0.2:8200")
        );
        assert_eq!(r[0].user, r[2].user);
        assert_ne!(r[0].user, r[1].user);
        let a = prefix("1", "rr");
        let r = build(&a, &p, &d).unwrap();
        assert_ne!(r[0].user, r[1].user, "rr moves on request by request");
        let e = build(&a, &[], &[]).unwrap_err();
        assert!(e.to_string().contains("--prefill and --decode"));
    }

    #[test]
    fn sharegpt_takes_the_first_human_turn_and_skips_unusable_ones() {
        let dir = std::env::temp_dir().join(format!("pdctl-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("s.json");
        std::fs::write(
            &f,
            r#"[{"id":"a","conversations":[{"from":"human","value":"Tell me about the absolute legend Roger Federer"},{"from":"gpt","value":"Roger Federer is widely regarded as one of the greatest"}]},
                {"id":"b","conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"hello there friend how are you"}]},
                {"id":"c","conversations":[{"from":"gpt","value":"no human turn here at all"}]}]"#,
        )
        .unwrap();
        let c = load_sharegpt(&f).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].prompt_words, 8);
        assert_eq!(c[0].reply_words, 10);
        std::fs::write(&f, "{\"not\": \"a list\"}").unwrap();
        assert!(matches!(load_sharegpt(&f), Err(DatasetError::Parse { .. })));
        std::fs::write(&f, "[]").unwrap();
        assert!(matches!(load_sharegpt(&f), Err(DatasetError::Empty { .. })));
        assert!(matches!(
            load_sharegpt(&dir.join("missing.json")),
            Err(DatasetError::Read { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
