//! How pdctl spells its enum values (`two-step`, `prefix-aware`, `decode`): the command-line
//! spelling clap derives, used wherever a value is written back out (planned argv, logs,
//! reports), so the two never drift apart; and the one "did you mean" for names given
//! wrongly (topology keys and values, node and profile names).

/// The command-line spelling of a clap value enum.
pub fn value_name<T: clap::ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .expect("no skipped variants")
        .get_name()
        .to_string()
}

/// The closest known name, when it is close enough to be a typo.
pub fn suggestion(given: &str, known: &[String]) -> Option<String> {
    known
        .iter()
        .map(|k| (strsim::damerau_levenshtein(given, k), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
        .or_else(|| {
            let g = given.replace('_', "-").to_lowercase();
            known
                .iter()
                .find(|k| k.replace('_', "-").to_lowercase() == g)
                .cloned()
        })
}
