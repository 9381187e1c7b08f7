//! The cluster secret: what the engine key is derived from (a node started by hand proves
//! its join token instead, [`crate::control::tls::JoinToken`]). Everything between the
//! supervisors travels inside mutually authenticated TLS 1.3 (docs/security.md).

use hmac::{KeyInit, Mac};
use std::path::{Path, PathBuf};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The environment variable that gives a node the cluster's secret (the head writes it to
/// its state dir at the first `up`; other nodes take it from here or `--secret-file`).
pub const SECRET_ENV: &str = "PDCTL_CLUSTER_SECRET";

/// The environment variable that gives a node started by hand its join token (`pdctl
/// join-token` on the head prints it; `up --join-token-file FILE` is the other way).
pub const JOIN_TOKEN_ENV: &str = "PDCTL_JOIN_TOKEN";

/// The cluster secret's file name inside a cluster's state dir (mode 0600, kept across `down`/`up`).
pub const SECRET_FILE: &str = "cluster.secret";

/// The environment variable that sets the engines' key for `up` (every node of the cluster
/// the same), instead of the one derived from the cluster's secret; also how the proxy
/// takes the key it sends to the engines.
pub const ENGINE_KEY_ENV: &str = crate::vocab::PROXY_ENGINE_KEY_VAR;

/// File in a cluster's state dir holding an engine key the user set (mode 0600); absent
/// when the key is the one derived from the secret.
pub const ENGINE_KEY_FILE: &str = "engine.key";

/// The label under which the engine key is derived from the secret.
const ENGINE_KEY_LABEL: &[u8] = b"pdctl-engine-key-v1";

/// Bytes of randomness in a secret pdctl makes, and in each nonce.
const RANDOM_BYTES: usize = 32;

/// The text of `file` (trimmed), if it exists: a secret or a key pdctl wrote whole, so
/// one shorter than 16 characters was damaged or edited.
fn read_long_enough(file: &Path) -> Result<Option<String>, SecretError> {
    read_kept(file)?
        .map(|text| long_enough(&text, &file.display().to_string()))
        .transpose()
}

/// `text` trimmed, when it has at least 16 characters.
fn long_enough(text: &str, origin: &str) -> Result<String, SecretError> {
    let t = text.trim();
    if t.len() < 16 {
        return Err(SecretError::TooShort {
            origin: origin.to_string(),
            hint: "pdctl wrote that file whole, so it was damaged or edited: put back a copy of it, or remove it and run `pdctl up` on the head again (it makes a new one; nodes that joined with the old one join again)",
        });
    }
    Ok(t.to_string())
}

/// A per-cluster secret. Its `Debug` never shows it, so it cannot reach a log by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(String);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Why a secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the cluster secret {} is empty or shorter than 16 characters; {hint}",
        origin
    )]
    TooShort { origin: String, hint: &'static str },
    #[error(
        "the cluster secret {origin} holds about {bits} bits of randomness, fewer than {MIN_SECRET_BITS}: leave it out (the head makes a random one) or use one such as `openssl rand -hex 32` prints"
    )]
    Weak { origin: String, bits: u32 },
    #[error(
        "the client key kept in {} {why}: remove the file and run `up` again with PDCTL_API_KEY set",
        path.display()
    )]
    BadClientKey { path: PathBuf, why: &'static str },
}

/// The text of `file`, or None when there is none: the one reader of the kept secret and
/// client key.
fn read_kept(file: &Path) -> Result<Option<String>, SecretError> {
    read_if_there(file).map_err(|source| SecretError::Io {
        what: "read",
        path: file.to_path_buf(),
        source,
    })
}

/// The text of `path`, or none when there is no such file: the one reader of kept
/// secrets, keys and certificates (each caller names the file in its own error).
pub(crate) fn read_if_there(path: &Path) -> Result<Option<String>, std::io::Error> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Keeps `value` as one line in `file` (mode 0600, synced): the one writer of the kept
/// secret and client key.
fn write_kept(file: &Path, value: &str) -> Result<(), SecretError> {
    write_private(file, format!("{value}\n").as_bytes()).map_err(|(what, source)| SecretError::Io {
        what,
        path: file.to_path_buf(),
        source,
    })
}

/// The randomness a cluster secret the user chooses must hold at least (estimated by
/// [`estimated_bits`]).
pub const MIN_SECRET_BITS: u32 = 128;

/// The randomness `text` holds at most, estimated as its length times the entropy of its
/// characters' frequencies (so repeats and a small alphabet count for little): 64 random
/// hex digits give about 250 bits, `password1234password1234` about 90.
pub fn estimated_bits(text: &str) -> u32 {
    let mut counts = std::collections::HashMap::new();
    let mut n = 0f64;
    for c in text.chars() {
        *counts.entry(c).or_insert(0u32) += 1;
        n += 1.0;
    }
    let per_char: f64 = counts
        .values()
        .map(|&k| {
            let p = f64::from(k) / n;
            -p * p.log2()
        })
        .sum();
    (per_char * n) as u32
}

impl ClusterSecret {
    /// A secret from text (a file pdctl keeps, a key it derives): at least 16 characters.
    pub fn from_text(text: &str, origin: &str) -> Result<ClusterSecret, SecretError> {
        long_enough(text, origin).map(ClusterSecret)
    }

    /// A cluster secret the user chose (`PDCTL_CLUSTER_SECRET`, `--secret-file`): refused
    /// below [`MIN_SECRET_BITS`] of estimated randomness.
    /// A short one is refused as weak too, with the same advice (not the advice for a
    /// kept file, which a person does not choose).
    pub fn chosen(text: &str, origin: &str) -> Result<ClusterSecret, SecretError> {
        let bits = estimated_bits(text.trim());
        if bits < MIN_SECRET_BITS {
            return Err(SecretError::Weak {
                origin: origin.to_string(),
                bits,
            });
        }
        ClusterSecret::from_text(text, origin)
    }

    /// A new random secret (64 hex digits).
    pub fn random() -> ClusterSecret {
        ClusterSecret(hex::encode(rand::random::<[u8; RANDOM_BYTES]>()))
    }

    /// The secret as written in its file; for `pdctl secret`, which a person asks for.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Reads `file`, if it exists.
    pub fn read(file: &Path) -> Result<Option<ClusterSecret>, SecretError> {
        Ok(read_long_enough(file)?.map(ClusterSecret))
    }

    /// Writes the secret to `file` with mode 0600 (created so, never readable by others).
    pub fn write(&self, file: &Path) -> Result<(), SecretError> {
        write_kept(file, &self.0)
    }

    /// The key every engine of the cluster requires (`VLLM_API_KEY`) and the proxy sends:
    /// HMAC-SHA256 of a fixed label under the secret, so each node that holds the secret
    /// has the same key without it being sent anywhere, and the key does not reveal the
    /// secret (a process that can read an engine's environment cannot join the control
    /// channel).
    pub fn engine_key(&self) -> EngineKey {
        EngineKey(hex::encode(
            self.mac(ENGINE_KEY_LABEL).finalize().into_bytes(),
        ))
    }

    fn mac(&self, label: &[u8]) -> HmacSha256 {
        let mut m = <HmacSha256 as KeyInit>::new_from_slice(self.0.as_bytes())
            .expect("HMAC takes keys of any length");
        m.update(label);
        m
    }
}

/// The environment variable of `up` that sets the proxy's client key (its `/v1/*` routes
/// answer 401 without it); what clients send.
pub const CLIENT_KEY_ENV: &str = crate::vocab::PROXY_CLIENT_KEY_VAR;

/// File in a node's state dir holding the client key its proxy requires (mode 0600): kept
/// by the head's `up` from [`CLIENT_KEY_ENV`], handed to a node started over SSH in its
/// bundle or to a node that joins in the answer to its join; absent when no key is set.
pub const CLIENT_KEY_FILE: &str = "client.key";

/// The client key the proxy requires. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientKey(String);

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientKey(..)")
    }
}

impl ClientKey {
    /// A key from text the user gave: not empty, all visible ASCII (it travels in an
    /// `Authorization` header).
    pub fn from_text(text: &str, origin: &str) -> Result<ClientKey, EngineKeyError> {
        let t = text.trim();
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(EngineKeyError {
                origin: origin.to_string(),
                why: "is empty or has characters an HTTP header cannot carry",
            });
        }
        Ok(ClientKey(t.to_string()))
    }

    /// The key itself, for the proxy's environment and the bundle a node is handed.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// The key kept in `file`, if there is one; a file that holds no usable key is an
    /// error, never a proxy left without its key.
    pub fn read(file: &Path) -> Result<Option<ClientKey>, SecretError> {
        read_kept(file)?
            .map(|text| {
                ClientKey::from_text(&text, "").map_err(|e| SecretError::BadClientKey {
                    path: file.to_path_buf(),
                    why: e.why,
                })
            })
            .transpose()
    }

    /// Keeps the key in `file` (mode 0600, synced).
    pub fn write(&self, file: &Path) -> Result<(), SecretError> {
        write_kept(file, &self.0)
    }
}

/// The key the engines of a cluster require: derived from its secret, or set by the user
/// (`PDCTL_ENGINE_API_KEY`). Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct EngineKey(String);

impl std::fmt::Debug for EngineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineKey(..)")
    }
}

/// Why a key the user gave cannot be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "{origin}: the engine key {why}; use at least 16 visible ASCII characters (or leave it unset: pdctl derives one from the cluster's secret)"
)]
pub struct EngineKeyError {
    origin: String,
    why: &'static str,
}

impl EngineKey {
    /// A key from text the user gave: at least 16 characters, all visible ASCII (it
    /// travels in an `Authorization` header).
    pub fn from_text(text: &str, origin: &str) -> Result<EngineKey, EngineKeyError> {
        let t = text.trim();
        let why = if t.len() < 16 {
            Some("is shorter than 16 characters")
        } else if !t.bytes().all(|b| b.is_ascii_graphic()) {
            Some("has characters an HTTP header cannot carry")
        } else {
            None
        };
        match why {
            Some(why) => Err(EngineKeyError {
                origin: origin.to_string(),
                why,
            }),
            None => Ok(EngineKey(t.to_string())),
        }
    }

    /// The key itself, for the environment of the services that need it and for
    /// `pdctl secret --engine-key`.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Reads a key the user set from `file` (kept by `up`), if it exists.
    pub fn read(file: &Path) -> Result<Option<EngineKey>, SecretError> {
        Ok(read_long_enough(file)?.map(EngineKey))
    }

    /// Writes the key to `file` with mode 0600.
    pub fn write(&self, file: &Path) -> Result<(), SecretError> {
        write_kept(file, &self.0)
    }
}

/// The engine key of the cluster whose state dir is `dir`: the one the user set at `up`
/// (kept in [`ENGINE_KEY_FILE`]), else the one derived from its secret; None when the
/// directory has neither.
pub fn kept_engine_key(dir: &Path) -> Result<Option<EngineKey>, SecretError> {
    if let Some(k) = EngineKey::read(&dir.join(ENGINE_KEY_FILE))? {
        return Ok(Some(k));
    }
    Ok(ClusterSecret::read(&dir.join(SECRET_FILE))?.map(|s| s.engine_key()))
}

/// Writes `bytes` to `path` through a temporary file created with mode 0600 and renamed
/// over it, so what holds a secret or a key is never readable by others, not even for a
/// moment; the file, then its directory, synced, so a crash or a power cut leaves the old
/// key or the new one, never an empty file. The error says which step failed (`create`,
/// `write` or `sync`).
pub(crate) fn write_private(
    path: &Path,
    bytes: &[u8],
) -> Result<(), (&'static str, std::io::Error)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| ("create", e))?;
    f.write_all(bytes).map_err(|e| ("write", e))?;
    f.sync_all().map_err(|e| ("sync", e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| ("write", e))?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| ("sync", e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_client_key_file_without_a_usable_key_is_an_error_not_an_open_proxy() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("client.key");
        assert_eq!(ClientKey::read(&file).unwrap(), None, "no file: no key");
        std::fs::write(&file, "\n").unwrap();
        let err = ClientKey::read(&file).unwrap_err().to_string();
        assert!(
            err.contains("client.key") && err.contains("PDCTL_API_KEY"),
            "{err}"
        );
        let key = ClientKey::from_text("k-123", "test").unwrap();
        key.write(&file).unwrap();
        assert_eq!(ClientKey::read(&file).unwrap(), Some(key));
    }

    #[test]
    fn chosen_secrets_below_128_bits_of_randomness_are_refused() {
        let random = ClusterSecret::random();
        assert!(estimated_bits(random.reveal()) > 200);
        assert!(ClusterSecret::chosen(random.reveal(), "env").is_ok());
        for weak in [
            "0123456789abcdef0123",
            "password1234password1234password1234",
            &"a".repeat(200),
            "correct-horse-battery",
            "pass1234",
        ] {
            let e = ClusterSecret::chosen(weak, "PDCTL_CLUSTER_SECRET").unwrap_err();
            assert!(e.to_string().contains("fewer than 128"), "{weak}: {e}");
        }
    }

    #[test]
    fn secrets_are_long_enough_and_never_shown_by_debug() {
        assert!(ClusterSecret::from_text("short", "env").is_err());
        let s = ClusterSecret::from_text("0123456789abcdef0123", "env").unwrap();
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
        assert_eq!(ClusterSecret::random().reveal().len(), 64);
    }

    #[test]
    fn the_engine_key_is_the_same_from_the_same_secret_and_reveals_nothing_of_it() {
        let s = ClusterSecret::from_text("0123456789abcdef0123", "env").unwrap();
        let k = s.engine_key();
        assert_eq!(k, s.engine_key());
        assert_ne!(k, ClusterSecret::random().engine_key());
        assert_eq!(k.reveal().len(), 64);
        assert!(!k.reveal().contains(s.reveal()));
        assert_eq!(format!("{k:?}"), "EngineKey(..)");
    }

    #[test]
    fn engine_keys_users_set_must_fit_a_header() {
        assert!(EngineKey::from_text("short", "env").is_err());
        let e = EngineKey::from_text("sixteen chars and a space", "PDCTL_ENGINE_API_KEY")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("PDCTL_ENGINE_API_KEY: "), "{e}");
        assert!(EngineKey::from_text(" 0123456789abcdef\n", "env").is_ok());
    }

    #[test]
    fn secret_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join(SECRET_FILE);
        let s = ClusterSecret::random();
        s.write(&f).unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(ClusterSecret::read(&f).unwrap(), Some(s));
    }
}
