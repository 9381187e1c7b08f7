//! The change journal: what the head's supervisor is about to do, written to its state dir
//! (`journal.json`, synced to disk) before each step of a change, so that a supervisor
//! started after a crash, a reboot or a `kill -9` knows which change was cut short, from
//! which plan to which, and how far it got — and finishes or undoes it
//! ([`super::recover`]) before it takes any other change.

use crate::control::operation::ChangeOptions;
use crate::plan::Plan;
use crate::plan::source::ClusterSource;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A change in progress, as the head last wrote it down.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Journal {
    /// The change as `status` names it (`scale decode=2`).
    pub what: String,
    /// When it started (Unix time, ms).
    pub started_ms: u64,
    /// What it turns into what.
    pub kind: JournalKind,
    /// How it is carried out (drain timeout, state root).
    pub how: ChangeOptions,
    /// The step it is on (`decode-1: add`), written before the step is taken.
    pub step: String,
    /// The nodes told of that step so far (their supervisors answered).
    #[serde(default)]
    pub told: Vec<String>,
    /// The steps finished (for a restart: the instances restarted).
    #[serde(default)]
    pub done: Vec<String>,
    /// A step failed and the change is being undone (back to the plan it started from).
    #[serde(default)]
    pub undoing: bool,
}

/// What a journaled change does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "kebab-case")]
pub enum JournalKind {
    /// `scale`, `apply`: the cluster from one plan to another.
    Plans {
        /// The last consistent plan: what ran before the change.
        from: Box<Plan>,
        /// The plan the change makes.
        wanted: Box<Plan>,
        /// topology.json before the change (None: started from a plan file).
        #[serde(default)]
        from_source: Option<Box<ClusterSource>>,
        /// topology.json once the change is made.
        #[serde(default)]
        wanted_source: Option<Box<ClusterSource>>,
    },
    /// `restart`: these instances, one at a time (drained when `drained`).
    Restart {
        services: Vec<String>,
        drained: bool,
    },
}

/// Why the journal cannot be kept.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot write the change journal {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the change journal {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the change journal {} is not one pdctl wrote ({source}); move it away to start without it", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// The journal's path in the state dir `dir`.
pub fn path(dir: &Path) -> PathBuf {
    crate::supervisor::StateDir::new(dir).journal_path()
}

impl Journal {
    /// Writes it to the state dir `dir`, whole and synced, before the step it names.
    pub fn write(&self, dir: &Path) -> Result<(), JournalError> {
        let path = path(dir);
        let json = serde_json::to_vec_pretty(self).expect("journals serialize");
        crate::supervisor::write_atomic(&path, &json)
            .map_err(|source| JournalError::Write { path, source })
    }

    /// The journal left in `dir`, if a change was cut short there.
    pub fn read(dir: &Path) -> Result<Option<Journal>, JournalError> {
        let path = path(dir);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(JournalError::Read { path, source }),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| JournalError::Parse { path, source })
    }

    /// Removes the journal of `dir` once its change is finished or undone (synced: a
    /// crash right after must not bring it back).
    pub fn clear(dir: &Path) -> Result<(), JournalError> {
        let path = path(dir);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(JournalError::Write { path, source }),
        }
        crate::supervisor::sync_dir(dir).map_err(|source| JournalError::Write { path, source })
    }

    /// The next step: written (synced) before it is taken, with no node told yet.
    pub fn step(&mut self, dir: &Path, step: &str) -> Result<(), JournalError> {
        self.step = step.to_string();
        self.told.clear();
        self.write(dir)
    }

    /// `node`'s supervisor answered the step.
    pub fn told(&mut self, dir: &Path, node: &str) -> Result<(), JournalError> {
        self.told.push(node.to_string());
        self.write(dir)
    }

    /// The step `name` is finished.
    pub fn finished(&mut self, dir: &Path, name: &str) -> Result<(), JournalError> {
        self.done.push(name.to_string());
        self.write(dir)
    }
}

/// The file that says a journal could not be read and was set aside: while it exists
/// the head takes no change (`begin` refuses, the rebalancer too) until the user says
/// they have seen it with `pdctl ack-journal` ([`acknowledge`]). It holds the line
/// `status` shows.
pub const SET_ASIDE_MARK: &str = "journal.unacknowledged";

/// The command that acknowledges a journal set aside (docs/operations.md).
pub const ACK_COMMAND: &str = "pdctl ack-journal";

/// A journal that could not be read, moved aside to `moved_to`.
#[derive(Debug, Clone, PartialEq)]
pub struct SetAside {
    /// The line `status` shows and `begin` refuses with.
    pub notice: String,
}

/// Moves the journal of `dir` that could not be read (`why`) aside to
/// `journal.json.bad-<time>` (kept for the user to read; never overwritten: a second one
/// gets its own time) and leaves [`SET_ASIDE_MARK`] saying so, both synced.
pub fn set_aside(dir: &Path, why: &JournalError) -> Result<SetAside, JournalError> {
    let from = path(dir);
    let time = crate::supervisor::format_utc(crate::control::operation::now_ms() as i64 / 1000)
        .replace(':', "-");
    let mut to = dir.join(format!("journal.json.bad-{time}"));
    let mut n = 1;
    while to.exists() {
        to = dir.join(format!("journal.json.bad-{time}.{n}"));
        n += 1;
    }
    let io = |path: &Path, source| JournalError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::rename(&from, &to).map_err(|e| io(&from, e))?;
    let notice = format!(
        "the change journal could not be read ({}) and was moved aside to {}: a change cut short may be left half done; the nodes were reconciled with the plan; read it, then `{ACK_COMMAND}` lets changes run again",
        why.short(),
        to.display()
    );
    let mark = dir.join(SET_ASIDE_MARK);
    crate::supervisor::write_atomic(&mark, format!("{notice}\n").as_bytes())
        .map_err(|e| io(&mark, e))?;
    Ok(SetAside { notice })
}

/// The notice of a journal set aside and not yet acknowledged in `dir`, if any.
pub fn unacknowledged(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(SET_ASIDE_MARK))
        .ok()
        .map(|t| t.trim().to_string())
}

/// The user has seen the journal set aside: changes run again. The notice acknowledged,
/// None when there was none.
pub fn acknowledge(dir: &Path) -> Result<Option<String>, JournalError> {
    let notice = unacknowledged(dir);
    let mark = dir.join(SET_ASIDE_MARK);
    match std::fs::remove_file(&mark) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(JournalError::Write { path: mark, source }),
    }
    crate::supervisor::sync_dir(dir)
        .map_err(|source| JournalError::Write { path: mark, source })?;
    Ok(notice)
}

impl JournalError {
    /// What went wrong, without the path (the notice names the new one).
    fn short(&self) -> String {
        match self {
            JournalError::Write { source, .. } | JournalError::Read { source, .. } => {
                source.to_string()
            }
            JournalError::Parse { source, .. } => format!("not JSON pdctl wrote: {source}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal() -> Journal {
        Journal {
            what: "restart --rolling decode".into(),
            started_ms: 1,
            kind: JournalKind::Restart {
                services: vec!["decode-0".into(), "decode-1".into()],
                drained: true,
            },
            how: ChangeOptions {
                dry_run: false,
                drain_timeout_s: 60,
                state_root: PathBuf::from("/state"),
            },
            step: "planned".into(),
            told: vec![],
            done: vec![],
            undoing: false,
        }
    }

    #[test]
    fn each_step_is_on_disk_before_it_is_taken_and_clear_removes_it() {
        let dir = std::env::temp_dir().join(format!("pdctl-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut j = journal();
        assert_eq!(Journal::read(&dir).unwrap(), None);
        j.write(&dir).unwrap();
        j.step(&dir, "decode-0: restart").unwrap();
        j.told(&dir, "worker").unwrap();
        let back = Journal::read(&dir).unwrap().expect("written");
        assert_eq!(back.step, "decode-0: restart");
        assert_eq!(back.told, ["worker"]);
        j.finished(&dir, "decode-0").unwrap();
        j.step(&dir, "decode-1: restart").unwrap();
        let back = Journal::read(&dir).unwrap().expect("written");
        assert_eq!(
            (back.done, back.told),
            (vec!["decode-0".to_string()], vec![])
        );
        Journal::clear(&dir).unwrap();
        assert_eq!(Journal::read(&dir).unwrap(), None);
        std::fs::write(path(&dir), "{").unwrap();
        let err = Journal::read(&dir).unwrap_err().to_string();
        assert!(err.contains("not one pdctl wrote"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_journal_set_aside_is_kept_and_waits_for_acknowledgement() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        std::fs::write(path(dir), "{\"what\": \"scale deco").unwrap();
        let err = Journal::read(dir).unwrap_err();
        let aside = set_aside(dir, &err).unwrap();
        assert!(!path(dir).exists());
        let kept: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("journal.json.bad-"))
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join(&kept[0])).unwrap(),
            "{\"what\": \"scale deco"
        );
        assert!(aside.notice.contains(&kept[0]) && aside.notice.contains(ACK_COMMAND));
        assert_eq!(unacknowledged(dir), Some(aside.notice.clone()));
        assert_eq!(acknowledge(dir).unwrap(), Some(aside.notice));
        assert_eq!(unacknowledged(dir), None);
        assert_eq!(acknowledge(dir).unwrap(), None);
    }
}
