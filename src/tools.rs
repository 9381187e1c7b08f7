//! Finding the programs a plan runs.
//!
//! A plan names programs bare (`etcd`, `mooncake_master`, `python3`, `pdctl`) so it reads
//! the same on every machine; `up` resolves them with these functions (`plan::resolve`
//! applies them to a plan). install.sh puts the Python tools (mooncake_master, and vLLM
//! when asked) into a virtualenv that is searched before PATH.

use std::path::{Path, PathBuf};

/// The name plans use for this very binary (the simulator and the proxy run as `pdctl`).
pub const SELF_PROGRAM: &str = "pdctl";

/// Where install.sh puts the tools virtualenv when run as root.
pub const SYSTEM_VENV: &str = "/opt/pdctl/venv";

/// Directories searched for programs, in order: `$PDCTL_TOOLS_PATH` (colon-separated),
/// the system venv, the per-user venv (`~/.local/share/pdctl/venv`), then `$PATH`.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(extra) = std::env::var_os("PDCTL_TOOLS_PATH") {
        dirs.extend(std::env::split_paths(&extra));
    }
    dirs.push(Path::new(SYSTEM_VENV).join("bin"));
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".local/share/pdctl/venv/bin"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs
}

/// The full path of `program`: itself when it contains a `/`, this binary for
/// [`SELF_PROGRAM`], else the first executable of that name in [`search_dirs`] (PATH
/// first for `python*`, so an activated venv wins over pdctl's tools venv).
pub fn find_program(program: &str) -> Option<PathBuf> {
    if program == SELF_PROGRAM {
        return std::env::current_exe().ok();
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return is_executable(&p).then_some(p);
    }
    search_dirs_for(program)
        .into_iter()
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

/// The directories searched for `program`, in order: [`search_dirs`], with PATH first for
/// `python*` (the python that runs vLLM is the user's, an activated venv, before pdctl's).
pub fn search_dirs_for(program: &str) -> Vec<PathBuf> {
    let mut dirs = search_dirs();
    if program.starts_with("python") {
        let path: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.splice(0..0, path);
    }
    dirs
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// A program a plan needs that this machine does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingProgram {
    pub service: String,
    pub program: String,
}

impl MissingProgram {
    /// What to do about it, in words a user can act on.
    pub fn hint(&self) -> &'static str {
        match self.program.as_str() {
            "etcd" => "install it with ./install.sh (Debian package etcd-server)",
            "mooncake_master" => {
                "install it with ./install.sh (PyPI mooncake-transfer-engine[-non-cuda] into the pdctl venv)"
            }
            "lmcache_server" => "pip install lmcache into the python that runs vLLM",
            p if p.starts_with("python") => {
                "install vLLM with ./install.sh --with-vllm, or set engine.python in the topology"
            }
            _ => "install it, or put its directory in PDCTL_TOOLS_PATH",
        }
    }
}

impl std::fmt::Display for MissingProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let order = if self.program.starts_with("python") {
            format!("PATH, PDCTL_TOOLS_PATH, {SYSTEM_VENV}/bin, ~/.local/share/pdctl/venv/bin")
        } else {
            format!("PDCTL_TOOLS_PATH, {SYSTEM_VENV}/bin, ~/.local/share/pdctl/venv/bin, PATH")
        };
        write!(
            f,
            "{}: program `{}` not found (searched {order}): {}",
            self.service,
            self.program,
            self.hint()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_program_is_this_binary() {
        assert_eq!(find_program(SELF_PROGRAM), std::env::current_exe().ok());
    }

    #[test]
    fn finds_sh_on_path_and_not_a_made_up_name() {
        assert!(find_program("sh").is_some());
        assert!(find_program("no-such-program-pdctl-test").is_none());
    }

    #[test]
    fn absolute_paths_are_checked_not_searched() {
        assert_eq!(find_program("/bin/sh"), Some(PathBuf::from("/bin/sh")));
        assert_eq!(find_program("/nonexistent/sh"), None);
    }
}
