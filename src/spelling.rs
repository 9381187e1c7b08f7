//! How pdctl spells its enum values (`two-step`, `prefix-aware`, `decode`): the command-line
//! spelling clap derives, used wherever a value is written back out (planned argv, logs,
//! reports), so the two never drift apart.

/// The command-line spelling of a clap value enum.
pub fn value_name<T: clap::ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .expect("no skipped variants")
        .get_name()
        .to_string()
}
