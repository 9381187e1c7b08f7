//! `pdctl logs <role|service> [-f] [-n N]`: reading the log files, including rotated
//! copies, and following them across rotation and restarts.

use crate::supervisor::{SUPERVISOR_LOG_NAME, colour_wanted, rotated_path};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Rotated copies looked at when reading history.
const MAX_ROTATED: u32 = 20;

/// Service names that have a log in `logs_dir`, sorted (`prefill-2` before `prefill-10`).
pub fn services_with_logs(logs_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(logs_dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_suffix(".log").map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort_by_key(|n| natural_key(n));
    names
}

fn natural_key(name: &str) -> (String, u64) {
    match name.rsplit_once('-') {
        Some((base, n)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => {
            (base.to_string(), n.parse().unwrap_or(0))
        }
        _ => (name.to_string(), 0),
    }
}

/// A `pdctl logs TARGET` that names nothing with logs here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no service or role `{target}` has logs here; services with logs: {}", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
pub struct NoSuchLogs {
    /// What was asked for.
    pub target: String,
    /// The services that have logs, to choose from.
    pub known: Vec<String>,
}

/// The services `target` names: one service (`prefill-2`, `etcd`), every instance of a
/// role (`prefill` = `prefill-0`, `prefill-1`, ...), or all services when `None` (the
/// supervisor's own log only when asked for by name).
pub fn resolve(names: &[String], target: Option<&str>) -> Result<Vec<String>, NoSuchLogs> {
    let Some(t) = target else {
        return Ok(names
            .iter()
            .filter(|n| *n != SUPERVISOR_LOG_NAME)
            .cloned()
            .collect());
    };
    if names.iter().any(|n| n == t) {
        return Ok(vec![t.to_string()]);
    }
    let role: Vec<String> = names
        .iter()
        .filter(|n| {
            n.strip_prefix(t)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|i| !i.is_empty() && i.chars().all(|c| c.is_ascii_digit()))
        })
        .cloned()
        .collect();
    if role.is_empty() {
        Err(NoSuchLogs {
            target: t.to_string(),
            known: names.to_vec(),
        })
    } else {
        Ok(role)
    }
}

/// The last `n` lines (all when `None`) of a log and its rotated copies, oldest first.
pub fn history(path: &Path, n: Option<usize>) -> Vec<String> {
    let mut files: Vec<PathBuf> = (1..=MAX_ROTATED)
        .map(|i| rotated_path(path, i))
        .take_while(|p| p.exists())
        .collect();
    files.reverse();
    files.push(path.to_path_buf());
    let mut lines: std::collections::VecDeque<String> = Default::default();
    // Newest file first, so a small -n reads only the newest file.
    for f in files.iter().rev() {
        let text = std::fs::read(f).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        let mut chunk: Vec<String> = text.lines().map(str::to_string).collect();
        if let Some(n) = n {
            let need = n.saturating_sub(lines.len());
            chunk.drain(..chunk.len().saturating_sub(need));
        }
        for l in chunk.into_iter().rev() {
            lines.push_front(l);
        }
        if n.is_some_and(|n| lines.len() >= n) {
            break;
        }
    }
    lines.into()
}

/// Follows one log file like `tail -F`: keeps reading the file it has open, and when the
/// path now names a different file (rotation) or a shorter one, moves over to it.
#[derive(Debug)]
pub struct Follower {
    path: PathBuf,
    file: Option<File>,
    inode: u64,
    pos: u64,
    carry: Vec<u8>,
}

impl Follower {
    /// A follower of `path` that has read nothing yet.
    fn unopened(path: &Path) -> Follower {
        Follower {
            path: path.to_path_buf(),
            file: None,
            inode: 0,
            pos: 0,
            carry: Vec::new(),
        }
    }

    #[cfg(test)]
    /// Starts at the current end of `path` (history was printed already).
    pub fn at_end(path: &Path) -> Follower {
        let mut f = Follower::unopened(path);
        if let Ok(mut file) = File::open(path) {
            f.inode = file.metadata().map(|m| m.ino()).unwrap_or(0);
            f.pos = file.seek(SeekFrom::End(0)).unwrap_or(0);
            f.file = Some(file);
        }
        f
    }

    /// Opens `path` from its start and returns, with the follower, the last `n` lines
    /// written so far (all when `None`, rotated copies included). Following continues
    /// exactly where that history ends, so no line is lost or shown twice.
    pub fn with_history(path: &Path, n: Option<usize>) -> (Follower, Vec<String>) {
        let mut f = Follower::unopened(path);
        let current = f.poll();
        let mut lines = match n {
            Some(n) if current.len() >= n => Vec::new(),
            _ => {
                let older = n.map(|n| n - current.len());
                let rotated = rotated_path(path, 1);
                history(&rotated, older)
            }
        };
        lines.extend(current);
        if let Some(n) = n {
            lines.drain(..lines.len().saturating_sub(n));
        }
        (f, lines)
    }

    /// Complete lines written since the last call.
    pub fn poll(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        self.read_available(&mut out);
        match std::fs::metadata(&self.path) {
            Ok(m) if self.file.is_none() || m.ino() != self.inode => {
                // Rotated (or created): the old file was read to its end above.
                if let Ok(file) = File::open(&self.path) {
                    self.file = Some(file);
                    self.inode = m.ino();
                    self.pos = 0;
                    self.read_available(&mut out);
                }
            }
            Ok(m) if m.len() < self.pos => {
                if let Some(f) = self.file.as_mut() {
                    let _ = f.seek(SeekFrom::Start(0));
                }
                self.pos = 0;
                self.read_available(&mut out);
            }
            _ => {}
        }
        out
    }

    fn read_available(&mut self, out: &mut Vec<String>) {
        let Some(file) = self.file.as_mut() else {
            return;
        };
        let mut buf = Vec::new();
        if let Ok(n) = file.read_to_end(&mut buf) {
            self.pos += n as u64;
        }
        for &b in &buf {
            if b == b'\n' {
                out.push(String::from_utf8_lossy(&self.carry).into_owned());
                self.carry.clear();
            } else {
                self.carry.push(b);
            }
        }
    }
}

/// Prints lines with an aligned `name | ` prefix, unless one service was asked for by name.
#[derive(Debug)]
pub struct Printer {
    prefix: bool,
    width: usize,
    colour: bool,
}

impl Printer {
    /// `by_name`: the user named one service (`pdctl logs decode-0`), so its lines need no
    /// prefix; a role (`pdctl logs decode`) is prefixed even when it has one instance.
    pub fn new(names: &[String], by_name: bool) -> Printer {
        Printer {
            prefix: !(by_name && names.len() == 1),
            width: names.iter().map(|n| n.len()).max().unwrap_or(0),
            colour: colour_wanted(),
        }
    }

    /// Writes the lines; `false` when stdout is closed (`pdctl logs | head`).
    pub fn print(&self, out: &mut dyn Write, idx: usize, name: &str, lines: &[String]) -> bool {
        for l in lines {
            let r = if !self.prefix {
                writeln!(out, "{l}")
            } else if self.colour {
                let code = ["36", "33", "32", "35", "34", "31"][idx % 6];
                writeln!(out, "\x1b[{code}m{name:<w$} |\x1b[0m {l}", w = self.width)
            } else {
                writeln!(out, "{name:<w$} | {l}", w = self.width)
            };
            if r.is_err() {
                return false;
            }
        }
        out.flush().is_ok()
    }
}

/// Prints the last `n` lines of each target, then follows them until `still_running`
/// says the cluster is gone, prints what is left and returns.
pub fn follow(
    targets: &[(String, PathBuf)],
    n: Option<usize>,
    printer: &Printer,
    mut still_running: impl FnMut() -> bool,
) {
    let mut stdout = std::io::stdout();
    let mut followers = Vec::with_capacity(targets.len());
    for (i, (name, path)) in targets.iter().enumerate() {
        let (f, lines) = Follower::with_history(path, n);
        if !printer.print(&mut stdout, i, name, &lines) {
            return;
        }
        followers.push(f);
    }
    let mut checks = 0u32;
    loop {
        for (i, f) in followers.iter_mut().enumerate() {
            let lines = f.poll();
            if !printer.print(&mut stdout, i, &targets[i].0, &lines) {
                return;
            }
        }
        checks += 1;
        if checks % 10 == 0 && !still_running() {
            for (i, f) in followers.iter_mut().enumerate() {
                let lines = f.poll();
                printer.print(&mut stdout, i, &targets[i].0, &lines);
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn roles_expand_to_their_instances_and_unknown_names_list_what_exists() {
        let all = names(&[
            "decode-0",
            "etcd",
            "prefill-0",
            "prefill-1",
            "prefill-10",
            "supervisor",
        ]);
        assert_eq!(
            resolve(&all, Some("prefill")).unwrap(),
            names(&["prefill-0", "prefill-1", "prefill-10"])
        );
        assert_eq!(
            resolve(&all, Some("prefill-1")).unwrap(),
            names(&["prefill-1"])
        );
        assert_eq!(resolve(&all, None).unwrap().len(), 5);
        let err = resolve(&all, Some("pre")).unwrap_err();
        assert_eq!(err.target, "pre");
        assert_eq!(err.known, all);
        let err = err.to_string();
        assert!(
            err.contains("`pre`") && err.contains("decode-0, etcd"),
            "{err}"
        );
    }

    #[test]
    fn natural_order_puts_ten_after_two() {
        let mut v = names(&["p-10", "p-2", "etcd"]);
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(v, names(&["etcd", "p-2", "p-10"]));
    }

    #[test]
    fn history_spans_rotated_copies_and_follow_crosses_a_rotation() {
        let d = std::env::temp_dir().join(format!("pdctl-logs-cmd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("x.log");
        std::fs::write(rotated_path(&p, 2), "a\nb\n").unwrap();
        std::fs::write(rotated_path(&p, 1), "c\n").unwrap();
        std::fs::write(&p, "d\ne\n").unwrap();
        assert_eq!(history(&p, None), names(&["a", "b", "c", "d", "e"]));
        assert_eq!(history(&p, Some(3)), names(&["c", "d", "e"]));
        assert_eq!(history(&p, Some(1)), names(&["e"]));

        let mut f = Follower::at_end(&p);
        assert!(f.poll().is_empty());
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"f\ng")
            .unwrap();
        assert_eq!(f.poll(), names(&["f"]));
        // Rotate: the old file gets its last line, a new file starts.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"h\n")
            .unwrap();
        std::fs::rename(&p, rotated_path(&p, 1)).unwrap();
        std::fs::write(&p, "i\n").unwrap();
        assert_eq!(f.poll(), names(&["gh", "i"]));
        let _ = std::fs::remove_dir_all(&d);
    }
}
