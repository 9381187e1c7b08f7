//! A cluster's state directory: where its lock, run record, plan, control socket and logs
//! live, and the lock that makes one cluster of a name run once per state root.

use crate::supervisor::SupervisorError;
use crate::supervisor::process::procfs;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The longest path a Unix socket can bind on Linux (`sun_path` is 108 bytes with a NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Paths inside one cluster's state dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir {
    pub dir: PathBuf,
}

impl StateDir {
    pub fn new(dir: impl Into<PathBuf>) -> StateDir {
        StateDir { dir: dir.into() }
    }
    /// The flock held by the running supervisor.
    pub fn lock_path(&self) -> PathBuf {
        self.dir.join("lock")
    }
    /// The run record: supervisor pid, run id, every child's pid and process group.
    pub fn record_path(&self) -> PathBuf {
        self.dir.join("run.json")
    }
    /// The plan the supervisor executes (what `up -d` hands to `pdctl supervise`).
    pub fn plan_path(&self) -> PathBuf {
        self.dir.join("plan.json")
    }
    /// The head's change journal: the change in progress and its step, written before
    /// each step (`crate::ops` keeps it; a supervisor's clean stop removes it).
    pub fn journal_path(&self) -> PathBuf {
        self.dir.join("journal.json")
    }
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join(crate::vocab::SOCKET_NAME)
    }
    pub fn logs_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }
    /// `logs/<service>.log`; rotated copies are `<service>.log.1`, `.2`, ...
    pub fn log_path(&self, service: &str) -> PathBuf {
        self.logs_dir().join(format!("{service}.log"))
    }
    /// What a detached supervisor itself prints (its stdout and stderr).
    pub fn supervisor_log_path(&self) -> PathBuf {
        self.log_path(SUPERVISOR_LOG_NAME)
    }

    /// Creates the dir and its `logs/` (mode 0700: they hold the control socket, the plan
    /// with its `[engine.env]` values, the keys). One that exists already must be this
    /// user's and writable by nobody else (else `UnsafeStateDir`, exit 2); it is made 0700,
    /// and files of an older pdctl in it (`tls/` too) lose every bit for others.
    pub fn create(&self) -> Result<(), SupervisorError> {
        use std::os::unix::fs::DirBuilderExt;
        let mk = |p: &Path| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(p)
                .map_err(|e| SupervisorError::io("create the state directory", p, e))?;
            make_private(p)
        };
        mk(&self.dir)?;
        mk(&self.logs_dir())?;
        for dir in [self.dir.clone(), self.logs_dir(), self.dir.join("tls")] {
            tighten_files(&dir);
        }
        Ok(())
    }

    /// Takes the cluster lock without waiting. `Busy` names the supervisor holding it.
    pub fn lock(&self) -> Result<ClusterLock, SupervisorError> {
        let path = self.lock_path();
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| SupervisorError::io("open the cluster lock", &path, e))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(ClusterLock { lock, path }),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(SupervisorError::AlreadyRunning {
                dir: self.dir.clone(),
                pid: read_record(self).ok().flatten().map(|r| r.supervisor_pid),
            }),
            Err((_, errno)) => Err(SupervisorError::io(
                "lock the cluster",
                &path,
                std::io::Error::from(errno),
            )),
        }
    }

    /// Removes what only makes sense while a supervisor runs; logs and generated files stay.
    pub fn remove_runtime(&self) {
        for p in [self.socket_path(), self.record_path(), self.plan_path()] {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Refuses directory `dir` when another user owns it or group or others may write it
/// (whoever can write it can swap the files pdctl reads: the plan, the keys); else makes
/// it 0700.
pub fn make_private(dir: &Path) -> Result<(), SupervisorError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| SupervisorError::io("read the state directory", dir, e))?;
    let me = nix::unistd::geteuid().as_raw();
    let why = if !meta.is_dir() {
        Some("it is not a directory (a link or a file)".to_string())
    } else if meta.uid() != me {
        Some(format!(
            "it is owned by user {} and pdctl runs as user {me}",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "group or others may write it (mode {:o})",
            meta.mode() & 0o777
        ))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(SupervisorError::UnsafeStateDir {
            path: dir.to_path_buf(),
            why,
        });
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| SupervisorError::io("make private (0700)", dir, e))?;
    }
    Ok(())
}

/// Takes every permission for group and others off the regular files right in `dir`
/// (what an older pdctl wrote 0644); best effort.
fn tighten_files(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        let mode = meta.permissions().mode();
        if meta.is_file() && mode & 0o077 != 0 {
            let _ =
                std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(mode & 0o700));
        }
    }
}

/// Makes every file and folder this process (and the services it starts) creates readable
/// by this user only (umask 077): the state dir's files hold the plan with `[engine.env]`
/// values, the logs, the journal. Called by the commands that write a state dir.
pub fn private_umask() {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
}

/// Name of the detached supervisor's own log in `logs/`.
pub const SUPERVISOR_LOG_NAME: &str = "supervisor";

/// The exclusive flock on `<state_dir>/lock`; released when the holding process exits.
#[derive(Debug)]
pub struct ClusterLock {
    lock: Flock<File>,
    /// For error messages.
    path: PathBuf,
}

impl ClusterLock {
    /// Lets a child process inherit the lock: clears close-on-exec and leaks this handle
    /// so dropping it never unlocks the open file the child now shares. Returns the fd.
    pub fn hand_off(self) -> Result<RawFd, SupervisorError> {
        use nix::fcntl::{FcntlArg, FdFlag, fcntl};
        let fd = self.lock.as_raw_fd();
        fcntl(&*self.lock, FcntlArg::F_SETFD(FdFlag::empty()))
            .map_err(|e| SupervisorError::io("pass the cluster lock on", &self.path, e.into()))?;
        std::mem::forget(self);
        Ok(fd)
    }

    /// Adopts a lock inherited from `up -d` as file descriptor `fd`, an open description
    /// of `path`.
    ///
    /// # Safety
    /// `fd` must be an open descriptor of the lock file that this process owns.
    pub unsafe fn adopt(fd: RawFd, path: PathBuf) -> Result<ClusterLock, SupervisorError> {
        use nix::fcntl::{FcntlArg, FdFlag, fcntl};
        // SAFETY: the caller passes a descriptor it owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let _ = fcntl(&file, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(ClusterLock { lock, path }),
            Err((_, errno)) => Err(SupervisorError::io(
                "take over the cluster lock",
                &path,
                std::io::Error::from(errno),
            )),
        }
    }
}

/// One spawned process, as recorded for a later `up` or `down` to clean up after a crash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildRecord {
    pub pid: i32,
    /// Equal to `pid`: every service leads its own process group.
    pub pgid: i32,
    pub start_ticks: u64,
}

/// `run.json`: who runs this cluster, and which processes it spawned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub cluster: String,
    pub node: String,
    pub supervisor_pid: i32,
    pub supervisor_start_ticks: u64,
    /// Value of `RUN_MARKER_ENV` in every service's environment.
    pub run_id: String,
    pub started_unix_s: u64,
    /// Service name -> its current process.
    pub children: BTreeMap<String, ChildRecord>,
}

impl RunRecord {
    /// A record for this process starting to supervise `cluster` on `node`.
    pub fn new_for_this_process(cluster: &str, node: &str) -> RunRecord {
        RunRecord {
            cluster: cluster.to_string(),
            node: node.to_string(),
            supervisor_pid: std::process::id() as i32,
            supervisor_start_ticks: procfs::own_start_ticks(),
            run_id: format!("{:016x}", rand::random::<u64>()),
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            children: BTreeMap::new(),
        }
    }

    /// True while the supervisor that wrote this record still runs.
    pub fn supervisor_alive(&self) -> bool {
        procfs::is_same_process_alive(self.supervisor_pid, self.supervisor_start_ticks)
    }
}

/// Reads `run.json`; `Ok(None)` when there is none.
pub fn read_record(state: &StateDir) -> Result<Option<RunRecord>, SupervisorError> {
    let path = state.record_path();
    match std::fs::read(&path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| SupervisorError::BadRecord {
                    path,
                    reason: e.to_string(),
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SupervisorError::io("read the run record", &path, e)),
    }
}

/// Writes `contents` to `path` atomically (temp file + rename), so readers never see half,
/// and synced, so what it says survives a crash of this process or of the machine.
pub fn write_atomic(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(contents)?;
    // On disk before the rename, and the rename on disk before this returns: a crash or
    // a power cut leaves the old file or the new one, never an empty one.
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => Ok(()),
    }
}

/// Syncs directory `dir`'s entries (a file created, renamed or removed in it) to disk.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// The running supervisor's copy of its record, rewritten on every change.
#[derive(Debug)]
pub struct RecordWriter {
    path: PathBuf,
    record: Mutex<RunRecord>,
}

impl RecordWriter {
    /// Writes the first version of the record.
    pub fn create(state: &StateDir, record: RunRecord) -> Result<RecordWriter, SupervisorError> {
        let w = RecordWriter {
            path: state.record_path(),
            record: Mutex::new(record),
        };
        w.flush()
            .map_err(|e| SupervisorError::io("write the run record", &w.path, e))?;
        Ok(w)
    }

    pub fn run_id(&self) -> String {
        self.lock().run_id.clone()
    }

    /// Records that `service` now runs as `pid` (its own process group).
    pub fn child_started(&self, service: &str, pid: i32) {
        let start_ticks = procfs::process(pid).map(|p| p.start_ticks).unwrap_or(0);
        self.lock().children.insert(
            service.to_string(),
            ChildRecord {
                pid,
                pgid: pid,
                start_ticks,
            },
        );
        self.flush_or_warn();
    }

    /// Records that `service` no longer runs.
    pub fn child_gone(&self, service: &str) {
        self.lock().children.remove(service);
        self.flush_or_warn();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RunRecord> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the record with its lock held, so two services' updates cannot interleave:
    /// an older copy landing after a newer one would leave a live child out of the file.
    fn flush(&self) -> std::io::Result<()> {
        let record = self.lock();
        let bytes = serde_json::to_vec_pretty(&*record).expect("records serialize");
        write_atomic(&self.path, &bytes)
    }

    fn flush_or_warn(&self) {
        if let Err(e) = self.flush() {
            tracing::warn!("could not update {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_state(tag: &str) -> StateDir {
        let d = std::env::temp_dir().join(format!("pdctl-state-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let s = StateDir::new(d);
        s.create().unwrap();
        s
    }

    #[test]
    fn second_lock_is_refused_and_names_the_holder() {
        let s = temp_state("lock");
        let rec = RunRecord::new_for_this_process("c1", "main");
        let _w = RecordWriter::create(&s, rec).unwrap();
        let _held = s.lock().unwrap();
        match s.lock() {
            Err(SupervisorError::AlreadyRunning { pid, .. }) => {
                assert_eq!(pid, Some(std::process::id() as i32))
            }
            other => panic!("expected AlreadyRunning, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&s.dir);
    }

    #[test]
    fn record_round_trips_and_tracks_children() {
        let s = temp_state("record");
        let w = RecordWriter::create(&s, RunRecord::new_for_this_process("c2", "main")).unwrap();
        w.child_started("etcd", std::process::id() as i32);
        let r = read_record(&s).unwrap().unwrap();
        assert_eq!(r.cluster, "c2");
        assert!(r.supervisor_alive());
        assert_eq!(r.children["etcd"].pgid, std::process::id() as i32);
        w.child_gone("etcd");
        assert!(read_record(&s).unwrap().unwrap().children.is_empty());
        s.remove_runtime();
        assert!(read_record(&s).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&s.dir);
    }

    #[test]
    fn concurrent_updates_leave_every_live_child_in_the_file() {
        let s = temp_state("concurrent");
        let w = std::sync::Arc::new(
            RecordWriter::create(&s, RunRecord::new_for_this_process("c3", "main")).unwrap(),
        );
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (w, state) = (w.clone(), StateDir::new(s.dir.clone()));
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let name = format!("svc-{t}-{i}");
                        w.child_started(&name, 1);
                        // Whole every time: writers never leave a torn file behind.
                        read_record(&state).expect("a readable record");
                        w.child_gone(&name);
                    }
                    w.child_started(&format!("live-{t}"), 1);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let r = read_record(&s).unwrap().unwrap();
        let names: Vec<&String> = r.children.keys().collect();
        assert_eq!(names.len(), 8, "{names:?}");
        assert!(names.iter().all(|n| n.starts_with("live-")), "{names:?}");
        let _ = std::fs::remove_dir_all(&s.dir);
    }

    #[test]
    fn a_garbled_record_is_an_error_naming_the_file() {
        let s = temp_state("garbled");
        std::fs::write(s.record_path(), "{not json").unwrap();
        let err = read_record(&s).unwrap_err().to_string();
        assert!(err.contains("run.json"), "{err}");
        let _ = std::fs::remove_dir_all(&s.dir);
    }
}
