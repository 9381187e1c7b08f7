//! Starting service processes so that none outlives the supervisor.
//!
//! Each service gets its own process group (so a stop signal reaches its children too),
//! stdin from /dev/null, and stdout+stderr merged into one pipe the supervisor reads.
//! `PR_SET_PDEATHSIG` kills a service when its parent dies. That signal fires when the
//! *thread* that forked the child exits, not the process, and tokio's blocking-pool
//! threads exit when idle; so every fork happens on one dedicated thread that lives as
//! long as the supervisor. Grandchildren are covered by the [`crate::supervisor::process::watchdog`].

use nix::fcntl::OFlag;
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use tokio::sync::oneshot;

/// What to run: the plan's argv (argv[0] already a full path) and environment.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub argv: Vec<String>,
    /// Added to the supervisor's own environment.
    pub env: BTreeMap<String, String>,
    /// Taken out of the supervisor's own environment first (secrets the service must not
    /// inherit), unless `env` sets them.
    pub env_remove: Vec<String>,
    pub cwd: PathBuf,
}

/// A started service process.
#[derive(Debug)]
pub struct Spawned {
    pub child: tokio::process::Child,
    /// Also its process group id.
    pub pid: i32,
    /// The read end of its merged stdout+stderr.
    pub output: tokio::net::unix::pipe::Receiver,
}

type Reply = oneshot::Sender<std::io::Result<(tokio::process::Child, OwnedFd)>>;

/// Handle to the spawning thread; cheap to clone. The thread ends when every handle is
/// dropped, which also delivers the parent-death signal to its children: keep one alive
/// until all services are stopped.
#[derive(Debug, Clone)]
pub struct Spawner {
    jobs: std::sync::mpsc::Sender<(SpawnSpec, Reply)>,
}

impl Spawner {
    /// Starts the spawning thread inside the runtime of `handle` (tokio registers each
    /// child for reaping there).
    pub fn start(handle: tokio::runtime::Handle) -> std::io::Result<Spawner> {
        let (tx, rx) = std::sync::mpsc::channel::<(SpawnSpec, Reply)>();
        std::thread::Builder::new()
            .name("pdctl-spawner".into())
            .spawn(move || {
                let _guard = handle.enter();
                for (spec, reply) in rx {
                    let _ = reply.send(spawn_now(&spec));
                }
            })?;
        Ok(Spawner { jobs: tx })
    }

    /// Forks and execs `spec` on the spawning thread.
    pub async fn spawn(&self, spec: SpawnSpec) -> std::io::Result<Spawned> {
        let (tx, rx) = oneshot::channel();
        let gone = || std::io::Error::other("the spawning thread is gone");
        self.jobs.send((spec, tx)).map_err(|_| gone())?;
        let (child, read) = rx.await.map_err(|_| gone())??;
        let pid = child
            .id()
            .ok_or_else(|| std::io::Error::other("child exited before its pid was read"))?
            as i32;
        let output = tokio::net::unix::pipe::Receiver::from_owned_fd(read)?;
        Ok(Spawned { child, pid, output })
    }
}

fn spawn_now(spec: &SpawnSpec) -> std::io::Result<(tokio::process::Child, OwnedFd)> {
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "empty command line",
        ));
    };
    let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let write_err = write.try_clone()?;
    let mut cmd = tokio::process::Command::new(program);
    for k in &spec.env_remove {
        cmd.env_remove(k);
    }
    cmd.args(args)
        .envs(&spec.env)
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(write))
        .stderr(Stdio::from(write_err))
        .process_group(0);
    let parent = nix::unistd::getpid();
    // SAFETY: only async-signal-safe calls (prctl, getppid) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The supervisor may have died between fork and prctl: then nobody would
            // ever deliver the signal, so give up now.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other("supervisor died during spawn"));
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    // Dropping `cmd` closes our copies of the pipe's write end, so EOF arrives when the
    // service (and everything that inherited its stdout) is gone.
    drop(cmd);
    Ok((child, read))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn output_of_both_streams_arrives_and_the_child_leads_its_group() {
        let spawner = Spawner::start(tokio::runtime::Handle::current()).unwrap();
        let mut s = spawner
            .spawn(SpawnSpec {
                argv: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "echo out; echo err >&2; echo $X".into(),
                ],
                env: BTreeMap::from([("X".to_string(), "from-env".to_string())]),
                env_remove: vec![],
                cwd: std::env::temp_dir(),
            })
            .await
            .unwrap();
        let info = crate::supervisor::process::procfs::process(s.pid);
        let mut text = String::new();
        s.output.read_to_string(&mut text).await.unwrap();
        let status = s.child.wait().await.unwrap();
        assert!(status.success());
        assert_eq!(text, "out\nerr\nfrom-env\n");
        if let Some(info) = info {
            assert_eq!(info.pgrp, s.pid, "the service leads its own process group");
        }
    }

    #[tokio::test]
    async fn a_missing_program_is_an_error_not_a_panic() {
        let spawner = Spawner::start(tokio::runtime::Handle::current()).unwrap();
        let err = spawner
            .spawn(SpawnSpec {
                argv: vec!["/nonexistent/program".into()],
                env: BTreeMap::new(),
                env_remove: vec![],
                cwd: std::env::temp_dir(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }
}
