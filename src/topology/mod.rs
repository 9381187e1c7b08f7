//! The topology file: serde types, defaults and validation.

/// A topology that cannot be used, located at file:line:col with the key at fault.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{col}: {key}: {message}")]
pub struct TopologyError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub key: String,
    pub message: String,
}
