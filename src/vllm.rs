//! Asking a Python which vLLM version it has (the version as a value is
//! [`crate::vocab::Version`]).
//!
//! Every connector template is keyed on the vLLM version (flag names and connector
//! classes changed many times), so the version is an input to planning.

use crate::vocab::{BadVersion, Version, VersionSource};

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

/// Prints the directory of the `vllm` package the interpreter would import, without
/// importing it.
const PACKAGE_DIR_SCRIPT: &str = r#"
import importlib.util, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    sys.exit("ModuleNotFoundError: No module named 'vllm'")
sys.stdout.write(list(spec.submodule_search_locations)[0])
"#;

/// The directory of the `vllm` package `python` has (where its connectors' source can be
/// read), or None when it has none or pdctl is told to ignore what this machine has and
/// `python` is a bare name.
pub fn package_dir(python: &str) -> Option<std::path::PathBuf> {
    if !python.contains('/') && ignoring_installed() {
        return None;
    }
    package_dir_with_env(python, &[])
}

fn package_dir_with_env(python: &str, env: &[(&str, &str)]) -> Option<std::path::PathBuf> {
    let program = crate::tools::find_program(python)?;
    let out = std::process::Command::new(program)
        .args(["-c", PACKAGE_DIR_SCRIPT])
        .envs(env.iter().copied())
        .output()
        .ok()?;
    let dir = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && dir.is_dir()).then_some(dir)
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
    fn package_dir_is_found_without_importing_vllm() {
        let root = fake_vllm("dir", "raise ImportError('imported the package')\n", None);
        let path = root.display().to_string();
        let env = [
            ("PYTHONPATH", path.as_str()),
            ("PYTHONDONTWRITEBYTECODE", "1"),
        ];
        let dir = package_dir_with_env("python3", &env);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            dir.unwrap().canonicalize().ok(),
            root.join("vllm").canonicalize().ok()
        );
        assert_eq!(package_dir_with_env("no-such-python-pdctl", &env), None);
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
