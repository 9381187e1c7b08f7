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

/// Prints `err` with its causes and returns the exit code it stands for.
pub fn report(err: anyhow::Error) -> ExitCode {
    let code = err
        .chain()
        .find_map(|e| e.downcast_ref::<ExitError>().map(|x| x.code))
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<crate::topology::TopologyError>()
                    .map(|_| 2)
            })
        })
        .unwrap_or(1);
    eprintln!("error: {err}");
    for cause in err.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    ExitCode::from(code)
}
