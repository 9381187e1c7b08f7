//! Exit codes and how errors reach the terminal.

use std::process::ExitCode;

/// An error that carries the exit code it should end the process with
/// (2 = bad input: topology, arguments, pre-flight; 3 = nothing running).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ExitError {
    pub code: u8,
    pub message: String,
}

impl ExitError {
    /// Bad input: the user must change a file or an argument (exit 2).
    pub fn usage(message: impl Into<String>) -> anyhow::Error {
        ExitError {
            code: 2,
            message: message.into(),
        }
        .into()
    }

    /// Nothing is running where something was expected (exit 3).
    pub fn nothing_running(message: impl Into<String>) -> anyhow::Error {
        ExitError {
            code: 3,
            message: message.into(),
        }
        .into()
    }
}

/// The exit code an error stands for: its own when it carries one, 2 for the library errors
/// that are bad input (a topology or profile, `pdctl proxy` / `pdctl sim` / `pdctl bench` arguments, a pre-flight
/// problem, a running cluster, an unknown node), else 1.
pub fn code_of(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|e| {
            if let Some(x) = e.downcast_ref::<ExitError>() {
                Some(x.code)
            } else if e.is::<crate::topology::TopologyError>()
                || e.is::<crate::plan::resolve::ResolveError>()
                || e.is::<crate::plan::resolve::NoStateRoot>()
                || e.is::<crate::proxy::ConfigError>()
                || e.is::<crate::sim::SimConfigError>()
                || e.is::<crate::bench::UsageError>()
            {
                Some(2)
            } else if let Some(f) = e.downcast_ref::<crate::model_fetch::FetchError>() {
                Some(if f.is_usage() { 2 } else { 1 })
            } else {
                e.downcast_ref::<crate::supervisor::SupervisorError>()
                    .filter(|s| s.is_usage())
                    .map(|_| 2)
            }
        })
        .unwrap_or(1)
}

/// Prints `err` with its causes and returns the exit code it stands for.
pub fn report(err: anyhow::Error) -> ExitCode {
    let code = code_of(&err);
    eprintln!("{}", message(&err));
    ExitCode::from(code)
}

/// `error: ...` with each cause on a line of its own, leaving out a cause whose text the
/// lines before already carry (thiserror messages often spell out their source).
fn message(err: &anyhow::Error) -> String {
    let mut text = format!("error: {err}");
    for cause in err.chain().skip(1) {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(&format!("\n  caused by: {line}"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::SupervisorError;
    use anyhow::Context;

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let busy = std::io::Error::other("address in use");
        let e = anyhow::Error::from(crate::proxy::ConfigError::Listen {
            addr: "127.0.0.1:8000".into(),
            port: 8000,
            source: busy,
        });
        assert_eq!(
            message(&e).matches("address in use").count(),
            1,
            "{}",
            message(&e)
        );
        let wrapped = anyhow::Error::from(std::io::Error::other("refused")).context("connecting");
        assert_eq!(message(&wrapped), "error: connecting\n  caused by: refused");
    }

    #[test]
    fn codes_follow_the_error_wherever_it_sits_in_the_chain() {
        let unknown = || SupervisorError::UnknownNode {
            node: "x".into(),
            known: "main".into(),
        };
        assert_eq!(code_of(&anyhow::Error::from(unknown())), 2);
        let wrapped = Err::<(), _>(unknown()).context("starting").unwrap_err();
        assert_eq!(code_of(&wrapped), 2);
        assert_eq!(code_of(&ExitError::nothing_running("none")), 3);
        assert_eq!(code_of(&ExitError::usage("bad")), 2);
        assert_eq!(code_of(&anyhow::anyhow!("spawn failed")), 1);
        let io = SupervisorError::io(
            "open",
            std::path::Path::new("/x"),
            std::io::Error::other("e"),
        );
        assert_eq!(
            code_of(&anyhow::Error::from(io)),
            1,
            "a failure, not bad input"
        );
    }
}
