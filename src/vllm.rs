//! vLLM versions: parsing, comparing, and asking a Python which one it has.
//!
//! Every connector template is keyed on the vLLM version (flag names and connector
//! classes changed many times), so the version is an input to planning.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A vLLM release as major.minor.patch; suffixes such as `.post1`, `rc2` or `+cpu` are
/// kept for display but do not take part in comparisons.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    /// The text as written (e.g. `0.10.1.post1+cpu`).
    pub text: String,
}

impl Version {
    /// A version from its numbers (for ranges and tests).
    pub const fn new(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
            text: String::new(),
        }
    }

    fn key(&self) -> (u32, u32, u32) {
        (self.major, self.minor, self.patch)
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl Eq for Version {}
impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Version {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.text.is_empty() {
            write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
        } else {
            f.write_str(&self.text)
        }
    }
}

/// A version string that is not `MAJOR.MINOR[.PATCH][suffix]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a vLLM version (expected e.g. 0.9.2, 0.10.1.post1, 0.32.0+cpu)")]
pub struct BadVersion(pub String);

impl FromStr for Version {
    type Err = BadVersion;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let bad = || BadVersion(s.to_string());
        let t_noprefix = t.strip_prefix('v').unwrap_or(t);
        let mut nums = [0u32; 3];
        let mut rest = t_noprefix;
        for (i, slot) in nums.iter_mut().enumerate() {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                if i < 2 {
                    return Err(bad());
                }
                break;
            }
            *slot = digits.parse().map_err(|_| bad())?;
            rest = &rest[digits.len()..];
            if i < 2 {
                match rest.strip_prefix('.') {
                    Some(r) => rest = r,
                    None if i == 1 => break,
                    None => return Err(bad()),
                }
            }
        }
        Ok(Version {
            major: nums[0],
            minor: nums[1],
            patch: nums[2],
            text: t.to_string(),
        })
    }
}

/// An inclusive range of versions a template serves; `None` ends are open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionRange {
    pub min: Option<(u32, u32, u32)>,
    pub max: Option<(u32, u32, u32)>,
}

impl VersionRange {
    /// `min..=max`.
    pub const fn between(min: (u32, u32, u32), max: (u32, u32, u32)) -> Self {
        VersionRange {
            min: Some(min),
            max: Some(max),
        }
    }
    /// `min..`.
    pub const fn from(min: (u32, u32, u32)) -> Self {
        VersionRange {
            min: Some(min),
            max: None,
        }
    }
    /// True when `v` lies in the range.
    pub fn contains(&self, v: &Version) -> bool {
        self.min.is_none_or(|m| v.key() >= m) && self.max.is_none_or(|m| v.key() <= m)
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A patch of 99 or more stands for "every patch release of a.b".
        let show = |(a, b, c): (u32, u32, u32)| {
            if c >= 99 {
                format!("{a}.{b}.x")
            } else {
                format!("{a}.{b}.{c}")
            }
        };
        match (self.min, self.max) {
            (Some(a), Some(b)) => write!(f, "{} to {}", show(a), show(b)),
            (Some(a), None) => write!(f, "{} and later", show(a)),
            (None, Some(b)) => write!(f, "up to {}", show(b)),
            (None, None) => f.write_str("every version"),
        }
    }
}

/// Why the installed vLLM version could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error(
        "cannot run `{python}` to ask for the vLLM version: {source}; set engine.python in the topology to the python that has vLLM, or pin engine.vllm_version"
    )]
    Spawn {
        python: String,
        source: std::io::Error,
    },
    #[error(
        "`{python}` has no importable vllm ({detail}); install it (./install.sh --with-vllm), set engine.python, or pin engine.vllm_version"
    )]
    NotInstalled { python: String, detail: String },
    #[error(
        "the search for `{python}` on PATH and in pdctl's venvs is turned off ({IGNORE_INSTALLED_ENV} is set)"
    )]
    LookupOff { python: String },
    #[error(transparent)]
    Bad(#[from] BadVersion),
}

/// Set (to anything but empty or `0`), pdctl plans as on a bare machine: `python3` is not
/// looked up on PATH or in pdctl's venvs to ask for a vLLM version, and NVML is not asked
/// for GPUs. A configured `engine.python` path and `--gpus` still count. The tests set it
/// so they give the same result on every machine; a user can set it to see the plan a
/// machine without vLLM or GPUs would get.
pub const IGNORE_INSTALLED_ENV: &str = "PDCTL_IGNORE_INSTALLED";

/// True when [`IGNORE_INSTALLED_ENV`] asks pdctl to ignore what this machine has.
pub fn ignoring_installed() -> bool {
    std::env::var_os(IGNORE_INSTALLED_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Where the vLLM version a plan is made for came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionSource {
    /// Read from the vLLM installed in `engine.python` (`vllm_version = "auto"`).
    Installed,
    /// Written in the topology.
    Pinned,
    /// `"auto"` found no vLLM: the newest version pdctl has templates for. A plan made
    /// so can be read but not run (`up` refuses it).
    Assumed,
}

/// The version to plan for, the python that runs vLLM, and why the version was assumed.
#[derive(Debug)]
pub struct Resolved {
    /// The python to run vLLM with: where `"auto"` found vLLM, else as configured.
    pub python: String,
    pub version: Version,
    pub source: VersionSource,
    /// Why no installed vLLM answered, when the version is assumed.
    pub not_found: Option<DetectError>,
}

impl Resolved {
    /// One line for a person when the version was assumed: where pdctl looked, what it
    /// assumed, and how to plan for the real thing.
    pub fn assumed_note(&self) -> Option<String> {
        let why = self.not_found.as_ref()?;
        Some(format!(
            "no vLLM found ({}; looked in {}): planned for vLLM {}, the newest pdctl has templates for; pin engine.vllm_version or install vLLM (./install.sh --with-vllm) to plan for the one you will run",
            why.reason(),
            where_looked(&self.python),
            self.version
        ))
    }
}

impl DetectError {
    /// The error without its advice (for lines that give their own).
    pub fn reason(&self) -> String {
        match self {
            DetectError::Spawn { python, source } => format!("cannot run `{python}`: {source}"),
            DetectError::NotInstalled { python, detail } => {
                format!("`{python}` has no importable vllm: {detail}")
            }
            other => other.to_string(),
        }
    }
}

/// Where [`find_python`] looks for `configured`, in words.
pub fn where_looked(configured: &str) -> String {
    if configured.contains('/') {
        configured.to_string()
    } else if ignoring_installed() {
        format!("nowhere: {IGNORE_INSTALLED_ENV} is set")
    } else {
        format!(
            "PATH, PDCTL_TOOLS_PATH, {}/bin and ~/.local/share/pdctl/venv/bin",
            crate::tools::SYSTEM_VENV
        )
    }
}

/// The vLLM version to plan for: a pinned one as written; for `"auto"`, the one installed
/// in `python` (see [`find_python`]), else `newest` marked [`VersionSource::Assumed`], so a
/// plan can be read on a machine that has no vLLM yet.
pub fn resolve(vllm_version: &str, python: &str, newest: &Version) -> Result<Resolved, BadVersion> {
    if vllm_version != "auto" {
        return Ok(Resolved {
            python: python.to_string(),
            version: vllm_version.parse()?,
            source: VersionSource::Pinned,
            not_found: None,
        });
    }
    Ok(match find_python(python) {
        Ok((found, version)) => Resolved {
            python: found,
            version,
            source: VersionSource::Installed,
            not_found: None,
        },
        Err(e) => Resolved {
            python: python.to_string(),
            version: newest.clone(),
            source: VersionSource::Assumed,
            not_found: Some(e),
        },
    })
}

/// The Python that prints the vLLM version of the interpreter running it.
///
/// `import vllm` imports torch and takes 7 to 17 s on a loaded machine (measured with the
/// CPU build 0.32.0), so every `pdctl plan` and `up` paid that. vLLM writes its version
/// into `vllm/_version.py` (setuptools-scm), which is read here without importing the
/// package; `vllm.__version__` is the fallback for trees without that file. The package
/// must still be findable, so "no vllm" stays an error.
const DETECT_SCRIPT: &str = r#"
import importlib.util, os, sys
spec = importlib.util.find_spec("vllm")
if spec is None:
    sys.exit("ModuleNotFoundError: No module named 'vllm'")
for d in spec.submodule_search_locations or []:
    f = os.path.join(d, "_version.py")
    if os.path.isfile(f):
        try:
            s = importlib.util.spec_from_file_location("_pdctl_vllm_version", f)
            m = importlib.util.module_from_spec(s)
            s.loader.exec_module(m)
            sys.stdout.write(str(m.__version__))
            sys.exit(0)
        except Exception:
            break
import vllm
sys.stdout.write(vllm.__version__)
"#;

/// Asks `python` for its vLLM version (what `vllm_version = "auto"` means).
pub fn detect(python: &str) -> Result<Version, DetectError> {
    detect_with_env(python, &[])
}

fn detect_with_env(python: &str, env: &[(&str, &str)]) -> Result<Version, DetectError> {
    let program = crate::tools::find_program(python)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| python.to_string());
    let out = std::process::Command::new(&program)
        .args(["-c", DETECT_SCRIPT])
        .env("VLLM_LOGGING_LEVEL", "ERROR")
        .envs(env.iter().copied())
        .output()
        .map_err(|source| DetectError::Spawn {
            python: python.to_string(),
            source,
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(DetectError::NotInstalled {
            python: python.to_string(),
            detail: last.trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// The python that runs vLLM, and its vLLM version. A configured path is used as is; a
/// bare name (`python3`) is tried on PATH first and then in the pdctl tools venvs, and the
/// first one that has vllm wins (so an activated venv is found, and so is the venv
/// `install.sh --with-vllm` fills).
pub fn find_python(configured: &str) -> Result<(String, Version), DetectError> {
    if configured.contains('/') {
        return detect(configured).map(|v| (configured.to_string(), v));
    }
    if ignoring_installed() {
        return Err(DetectError::LookupOff {
            python: configured.to_string(),
        });
    }
    let dirs = crate::tools::search_dirs_for(configured);
    let mut first_err = None;
    let mut tried = std::collections::HashSet::new();
    for dir in dirs {
        let candidate = dir.join(configured);
        let Ok(real) = candidate.canonicalize() else {
            continue;
        };
        if !tried.insert(real) {
            continue;
        }
        let path = candidate.display().to_string();
        match detect(&path) {
            Ok(v) => return Ok((path, v)),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    Err(first_err.unwrap_or_else(|| DetectError::Spawn {
        python: configured.to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "not found on PATH or in the pdctl venv",
        ),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        s.parse().unwrap()
    }

    #[test]
    fn parses_the_forms_vllm_ships() {
        assert_eq!(v("0.9.2"), Version::new(0, 9, 2));
        assert_eq!(v("0.10.1.post1"), Version::new(0, 10, 1));
        assert_eq!(v("0.11.0rc2"), Version::new(0, 11, 0));
        assert_eq!(v("0.32.0+cpu"), Version::new(0, 32, 0));
        assert_eq!(v("v0.13"), Version::new(0, 13, 0));
        assert_eq!(v("0.10.1.post1").to_string(), "0.10.1.post1");
    }

    #[test]
    fn rejects_what_is_not_a_version() {
        for bad in ["", "auto", "latest", "0", "x.y.z", "0.x"] {
            assert!(bad.parse::<Version>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn orders_numerically_not_textually() {
        assert!(v("0.10.0") > v("0.9.2"));
        assert!(v("0.13.0") > v("0.12.9"));
    }

    #[test]
    fn ranges_are_inclusive_and_say_what_they_cover() {
        let r = VersionRange::between((0, 9, 0), (0, 12, 0));
        assert!(r.contains(&v("0.9.0")) && r.contains(&v("0.12.0.post1")));
        assert!(!r.contains(&v("0.13.0")) && !r.contains(&v("0.8.5")));
        assert_eq!(r.to_string(), "0.9.0 to 0.12.0");
        assert_eq!(
            VersionRange::from((0, 13, 0)).to_string(),
            "0.13.0 and later"
        );
    }

    #[test]
    fn detect_reports_a_missing_python_clearly() {
        let err = detect("no-such-python-pdctl").unwrap_err().to_string();
        assert!(err.contains("no-such-python-pdctl"), "{err}");
        assert!(
            err.contains("engine.python") || err.contains("vllm_version"),
            "{err}"
        );
    }
    /// A fake `vllm` package in a temp dir, put first on PYTHONPATH.
    fn fake_vllm(tag: &str, init: &str, version_file: Option<&str>) -> std::path::PathBuf {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let root =
            std::env::temp_dir().join(format!("pdctl-vllm-{tag}-{}-{n}", std::process::id()));
        let pkg = root.join("vllm");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(pkg.join("__init__.py"), init).unwrap();
        if let Some(v) = version_file {
            std::fs::write(pkg.join("_version.py"), v).unwrap();
        }
        root
    }

    fn detect_fake(root: &std::path::Path) -> Result<Version, DetectError> {
        let path = root.display().to_string();
        detect_with_env(
            "python3",
            &[("PYTHONPATH", &path), ("PYTHONDONTWRITEBYTECODE", "1")],
        )
    }

    #[test]
    fn detect_reads_the_version_file_without_importing_vllm() {
        // An __init__ that fails stands for the torch import detection must not pay.
        let root = fake_vllm(
            "file",
            "raise ImportError('imported the package')\n",
            Some("__version__ = version = '0.32.0+cpu'\n"),
        );
        let v = detect_fake(&root);
        std::fs::remove_dir_all(&root).unwrap();
        let v = v.unwrap();
        assert_eq!(v, Version::new(0, 32, 0));
        assert_eq!(v.to_string(), "0.32.0+cpu");
    }

    #[test]
    fn detect_falls_back_to_importing_vllm() {
        let root = fake_vllm("import", "__version__ = '0.9.2'\n", None);
        let v = detect_fake(&root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(v.unwrap(), Version::new(0, 9, 2));
        // A broken version file is not trusted either.
        let root = fake_vllm("broken", "__version__ = '0.10.1.post1'\n", Some("oops(\n"));
        let v = detect_fake(&root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(v.unwrap().to_string(), "0.10.1.post1");
    }

    #[test]
    fn detect_says_why_a_broken_vllm_does_not_import() {
        let root = fake_vllm(
            "broken-import",
            "raise ModuleNotFoundError(\"No module named 'torch'\")\n",
            None,
        );
        let err = detect_fake(&root);
        std::fs::remove_dir_all(&root).unwrap();
        match err {
            Err(DetectError::NotInstalled { detail, .. }) => {
                assert!(detail.contains("No module named 'torch'"), "{detail}")
            }
            other => panic!("expected NotInstalled, got {other:?}"),
        }
    }
}
