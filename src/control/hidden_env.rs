//! The secret values the topology sets for the engines (hub tokens, see
//! [`crate::vocab::HiddenEnv`]), kept in the cluster's state dir in a file of their own
//! (mode 0600) instead of the plan: `up` writes it (on a node started over SSH, from what
//! the head handed it), `apply` rewrites it, and the supervisor reads it each time it
//! starts a service that names such a variable.

use crate::vocab::HiddenEnv;
use std::path::{Path, PathBuf};

/// The file in a cluster's state dir.
pub const HIDDEN_ENV_FILE: &str = "hidden-env.json";

/// Why the kept values cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum HiddenEnvError {
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is not the list of secret variables pdctl keeps ({why}): remove it and run `pdctl up` again",
        path.display()
    )]
    Parse { path: PathBuf, why: String },
}

/// Keeps `env` in the state dir `dir` (mode 0600); an empty one removes the file, so no
/// value from an earlier topology lingers.
pub fn keep(dir: &Path, env: &HiddenEnv) -> Result<(), HiddenEnvError> {
    let path = dir.join(HIDDEN_ENV_FILE);
    if env.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(HiddenEnvError::Io {
                what: "remove",
                path,
                source: e,
            }),
            _ => Ok(()),
        };
    }
    let json = serde_json::to_vec(env).expect("hidden env serializes");
    super::auth::write_private(&path, &json).map_err(|(what, source)| HiddenEnvError::Io {
        what,
        path,
        source,
    })
}

/// The values kept in the state dir `dir` (none when it has no file).
pub fn kept(dir: &Path) -> Result<HiddenEnv, HiddenEnvError> {
    let path = dir.join(HIDDEN_ENV_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HiddenEnv::default()),
        Err(source) => {
            return Err(HiddenEnvError::Io {
                what: "read",
                path,
                source,
            });
        }
    };
    // serde's message could quote the value: only its position is said.
    serde_json::from_slice(&bytes).map_err(|e| HiddenEnvError::Parse {
        path,
        why: format!("bad JSON at line {} column {}", e.line(), e.column()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn kept_values_are_read_back_from_a_private_file_and_an_empty_set_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(kept(dir.path()).unwrap(), HiddenEnv::default());
        let mut env = HiddenEnv::default();
        env.0.insert(
            "prefill".into(),
            BTreeMap::from([("HF_TOKEN".to_string(), "hf_abc".to_string())]),
        );
        keep(dir.path(), &env).unwrap();
        let file = dir.path().join(HIDDEN_ENV_FILE);
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(kept(dir.path()).unwrap(), env);
        assert_eq!(
            env.get(crate::vocab::Role::Prefill, "HF_TOKEN"),
            Some("hf_abc")
        );
        assert!(!format!("{env:?}").contains("hf_abc"), "{env:?}");
        keep(dir.path(), &HiddenEnv::default()).unwrap();
        assert!(!file.exists());
    }

    #[test]
    fn a_broken_file_is_named_without_quoting_its_content() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(HIDDEN_ENV_FILE), "{\"prefill\": hf_secret").unwrap();
        let e = kept(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(HIDDEN_ENV_FILE) && !e.contains("hf_secret"),
            "{e}"
        );
    }
}
