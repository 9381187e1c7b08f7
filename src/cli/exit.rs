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
/// that are bad input (a topology, a pre-flight problem, a running cluster, an unknown
/// node), else 1.
pub fn code_of(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|e| {
            if let Some(x) = e.downcast_ref::<ExitError>() {
                Some(x.code)
            } else if e.is::<crate::topology::TopologyError>() {
                Some(2)
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
    eprintln!("error: {err}");
    for cause in err.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::SupervisorError;
    use anyhow::Context;

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
