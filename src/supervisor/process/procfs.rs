//! What `/proc` says about processes: start times (so a recorded pid is only trusted while
//! it still names the same process), process groups, zombies, and the run marker every
//! service inherits in its environment (so stale or orphaned processes are found even when
//! they left their group).
//!
//! Why `/proc` is read here by hand rather than through `sysinfo`: what the supervisor
//! needs is exactly what `sysinfo` does not give or gives too coarsely. It needs the process
//! group (to signal a service's whole group) and `sysinfo` has none; it needs the start time
//! in clock ticks, with the pid the identity that tells a recorded process from a later one
//! reusing its pid, and `sysinfo` rounds it to seconds; it needs our own run marker from
//! `/proc/PID/environ` and the kernel log's OOM records for one pid; and the watchdog polls
//! one `stat` line per process, where `sysinfo` refreshes many files for every process on
//! the machine. Process trees and memory totals, what `sysinfo` does well, the supervisor
//! does not use.

use std::path::Path;

/// Environment variable set on every service a supervisor spawns; its value is the run id.
/// Grandchildren inherit it, which is how a dead supervisor's leftovers are recognised.
pub const RUN_MARKER_ENV: &str = "PDCTL_RUN_ID";

/// The fields of `/proc/<pid>/stat` the supervisor needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: i32,
    pub ppid: i32,
    pub pgrp: i32,
    /// Session id: a detached supervisor leads its own session, and every process it
    /// starts, and everything they fork, stays in it unless it calls setsid itself.
    pub session: i32,
    /// One letter: `R`, `S`, `D`, `Z` (zombie), `T`, ...
    pub state: char,
    /// Clock ticks after boot when the process started; with the pid, a unique identity.
    pub start_ticks: u64,
}

impl ProcInfo {
    /// A zombie has exited and only waits to be reaped: it holds no port, GPU or memory.
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z' || self.state == 'X'
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name may hold spaces and parentheses,
/// so fields are counted after the last `)`.
pub fn parse_stat(line: &str) -> Option<ProcInfo> {
    let pid = line.split_whitespace().next()?.parse().ok()?;
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcInfo {
        pid,
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        session: f.get(3)?.parse().ok()?,
        // Field 22 of stat(5); the state is field 3, so index 22 - 3 = 19 here.
        start_ticks: f.get(19)?.parse().ok()?,
    })
}

/// The process with this pid, if it exists.
pub fn process(pid: i32) -> Option<ProcInfo> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&line)
}

/// True while `pid` is a running (not zombie) process that started at `start_ticks`.
pub fn is_same_process_alive(pid: i32, start_ticks: u64) -> bool {
    process(pid).is_some_and(|p| p.start_ticks == start_ticks && !p.is_zombie())
}

/// Every process visible in `/proc`.
pub fn all_processes() -> Vec<ProcInfo> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(process)
        .collect()
}

/// Pids of the live (not zombie) members of process group `pgrp`.
pub fn live_group_members(pgrp: i32) -> Vec<i32> {
    all_processes()
        .into_iter()
        .filter(|p| p.pgrp == pgrp && !p.is_zombie())
        .map(|p| p.pid)
        .collect()
}

/// True when `/proc/<pid>/environ` holds exactly `key=value`. Processes of other users
/// cannot be read and count as not marked.
pub fn has_env(pid: i32, key: &str, value: &str) -> bool {
    let Ok(env) = std::fs::read(Path::new("/proc").join(pid.to_string()).join("environ")) else {
        return false;
    };
    let wanted = format!("{key}={value}");
    env.split(|b| *b == 0).any(|e| e == wanted.as_bytes())
}

/// Live processes carrying the run marker `run_id` (services, their children, anything
/// they forked), never this process itself.
pub fn marked_processes(run_id: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    all_processes()
        .into_iter()
        .filter(|p| p.pid != me && !p.is_zombie())
        .filter(|p| has_env(p.pid, RUN_MARKER_ENV, run_id))
        .map(|p| p.pid)
        .collect()
}

/// Live processes of the session led by `leader`, never this process itself. A session
/// id stays taken while any member lives, so once the leader (a detached supervisor) is
/// dead, its members are exactly what it left behind, including processes that rewrote
/// their environment (vLLM's `VLLM::EngineCore` sets its process title over it, which
/// hides the run marker).
pub fn session_members(leader: i32) -> Vec<i32> {
    let me = std::process::id() as i32;
    all_processes()
        .into_iter()
        .filter(|p| p.session == leader && p.pid != me && p.pid != leader && !p.is_zombie())
        .map(|p| p.pid)
        .collect()
}

/// This process's own start time, recorded so a later `up` can tell whether the
/// supervisor that wrote a record still lives.
pub fn own_start_ticks() -> u64 {
    process(std::process::id() as i32)
        .map(|p| p.start_ticks)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_with_spaces_and_parens() {
        let line =
            "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 0 0";
        let p = parse_stat(line).unwrap();
        assert_eq!((p.pid, p.ppid, p.pgrp, p.state), (4242, 1, 4242, 'S'));
        assert_eq!(p.session, 4242);
        assert_eq!(p.start_ticks, 987654);
        assert!(!p.is_zombie());
    }

    #[test]
    fn truncated_lines_are_rejected_not_panicking() {
        assert_eq!(parse_stat("12 (x) S 1"), None);
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("abc (x) S 1 2"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_made_up_start_time_is_not() {
        let me = std::process::id() as i32;
        let ticks = own_start_ticks();
        assert!(ticks > 0);
        assert!(is_same_process_alive(me, ticks));
        assert!(!is_same_process_alive(me, ticks + 1));
    }

    #[test]
    fn marker_is_found_only_on_the_marked_child() {
        let id = format!("unit-{}", std::process::id());
        let mut marked = std::process::Command::new("sleep")
            .arg("5")
            .env(RUN_MARKER_ENV, &id)
            .spawn()
            .unwrap();
        let mut plain = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let found = marked_processes(&id);
        let _ = marked.kill();
        let _ = plain.kill();
        let _ = marked.wait();
        let _ = plain.wait();
        assert_eq!(found, vec![marked.id() as i32]);
    }
}

/// Whether the kernel log says its OOM killer killed `pid` (read from /dev/kmsg, which
/// needs root or CAP_SYSLOG: without it the answer is "not known", false).
pub fn oom_killed(pid: u32) -> bool {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut kmsg) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open("/dev/kmsg")
    else {
        return false;
    };
    // One record per read; EAGAIN at the end of the buffer.
    let mut buf = vec![0u8; 8192];
    let mut found = false;
    for _ in 0..100_000 {
        match kmsg.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => found |= mentions_oom_kill(&String::from_utf8_lossy(&buf[..n]), pid),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // EPIPE: a record was overwritten while reading; the rest is still readable.
            Err(e) if e.raw_os_error() == Some(nix::libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    found
}

/// Whether one kernel log record is the OOM killer's report on `pid`.
fn mentions_oom_kill(record: &str, pid: u32) -> bool {
    record.contains(&format!("Killed process {pid} "))
        || (record.contains("oom-kill:") && record.contains(&format!(",pid={pid},")))
}

#[cfg(test)]
mod oom_tests {
    use super::*;

    #[test]
    fn the_oom_killers_report_names_the_pid() {
        let line =
            "3,1234,5678,-;Out of memory: Killed process 4242 (python3) total-vm:1kB, anon-rss:1kB";
        assert!(mentions_oom_kill(line, 4242));
        assert!(!mentions_oom_kill(line, 424));
        let line = "6,1,2,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python3,pid=4242,uid=0";
        assert!(mentions_oom_kill(line, 4242));
        assert!(!oom_killed(u32::MAX));
    }
}
