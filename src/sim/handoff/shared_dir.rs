//! The shared-directory handoff (two-step protocol, like vLLM's ExampleConnector): the
//! prefill writes each full block of the prompt to `--kv-dir` as one file named by the
//! block's hash, holding the block's token ids; the decode loads them from there.
//! Files are written under a temporary name and renamed, so a reader never sees half a
//! file. The directory is never cleaned by the sim (as with ExampleConnector).

use super::HandoffError;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn block_path(dir: &Path, hash: u64) -> PathBuf {
    dir.join(format!("{hash:016x}.kv"))
}

fn block_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Writes the blocks not yet in `dir`; returns how many it wrote.
pub fn save(
    dir: &Path,
    tokens: &[u32],
    hashes: &[u64],
    block_size: usize,
) -> std::io::Result<usize> {
    let mut written = 0;
    for (i, h) in hashes.iter().enumerate() {
        let path = block_path(dir, *h);
        if path.exists() {
            continue;
        }
        let tmp = dir.join(format!(
            ".{h:016x}.{}.{}.tmp",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Relaxed)
        ));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&block_bytes(&tokens[i * block_size..(i + 1) * block_size]))?;
        drop(f);
        std::fs::rename(&tmp, &path)?;
        written += 1;
    }
    Ok(written)
}

/// Checks that every block from `from` on is in `dir` with the right tokens.
/// All or nothing: one missing block means the decode recomputes.
pub fn load(
    dir: &Path,
    tokens: &[u32],
    hashes: &[u64],
    from: usize,
    block_size: usize,
) -> Result<(), HandoffError> {
    for (i, h) in hashes.iter().enumerate().skip(from) {
        let path = block_path(dir, *h);
        let data = std::fs::read(&path).map_err(|cause| HandoffError::MissingBlock {
            index: i + 1,
            of: hashes.len(),
            dir: dir.display().to_string(),
            cause,
        })?;
        if data != block_bytes(&tokens[i * block_size..(i + 1) * block_size]) {
            return Err(HandoffError::OtherTokens {
                path: path.display().to_string(),
                index: i + 1,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::cache::block_hashes;

    #[test]
    fn saved_blocks_load_and_missing_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("pdctl-sim-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = block_hashes(&tokens, 16);
        let err = load(&dir, &tokens, &hashes, 0, 16).unwrap_err().to_string();
        assert!(err.contains("block 1 of 2"), "{err}");
        assert_eq!(save(&dir, &tokens, &hashes, 16).unwrap(), 2);
        assert_eq!(
            save(&dir, &tokens, &hashes, 16).unwrap(),
            0,
            "already there"
        );
        load(&dir, &tokens, &hashes, 0, 16).unwrap();
        // A corrupted block is caught.
        std::fs::write(block_path(&dir, hashes[1]), b"xx").unwrap();
        assert!(
            load(&dir, &tokens, &hashes, 0, 16)
                .unwrap_err()
                .to_string()
                .contains("other tokens")
        );
        load(&dir, &tokens, &hashes, 2, 16).unwrap();
        let leftovers = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")
            })
            .count();
        assert_eq!(leftovers, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
