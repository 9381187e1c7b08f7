//! Fetching a Hugging Face model into the cache the engines read, before they start: the
//! step `pdctl pull` runs alone and `pdctl up` runs first.
//!
//! Without it vLLM downloads the model inside its own start-up: every engine fetches the
//! same files, nothing says how much is left, and `startup_timeout_s` counts the download,
//! so a large model is killed as "failed to start" and begun again. Here the download is
//! judged by progress instead: the engines' own Python (vLLM depends on huggingface_hub,
//! which gives the endpoint, the token and the file list) runs a small script shipped in
//! this binary ([`SCRIPT`]) that fetches only what vLLM loads, into the hub cache's layout,
//! resuming a partial file. This side watches the bytes grow on disk, reports them, and
//! kills and retries a download that sent no byte for [`stall_after`]. The token
//! (`HF_TOKEN`) reaches that process through its environment only: never its argv, a log
//! or the plan.

use crate::model_files;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The fetch script, run as `python -c SCRIPT list|fetch ...` (see its header).
pub const SCRIPT: &str = include_str!("hub_fetch.py");

/// Seconds without a byte after which a download is called stalled, killed and tried again
/// (resuming); `PDCTL_FETCH_STALL_S` sets another.
pub const DEFAULT_STALL_S: u64 = 60;

/// The variable that sets the stall limit in seconds.
pub const STALL_ENV: &str = "PDCTL_FETCH_STALL_S";

/// Tries in a row that move no byte (stalled or cut) before the fetch gives up.
pub const TRIES: u32 = 5;

/// The pause before a try after failed ones: 1 s, doubling (at most 32 s).
const RESUME_AFTER: crate::backoff::Backoff =
    crate::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(32));

/// How long the hub's file list is waited for.
const LIST_TIMEOUT: Duration = Duration::from_secs(20);

/// The hub huggingface_hub talks to when HF_ENDPOINT does not say.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The stall limit: `PDCTL_FETCH_STALL_S`, else [`DEFAULT_STALL_S`].
pub fn stall_after() -> Duration {
    let s = std::env::var(STALL_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(DEFAULT_STALL_S);
    Duration::from_secs(s)
}

/// Why a model could not be fetched. Each says what to do; [`FetchError::is_usage`] tells
/// the ones a person must fix (exit 2) from a network that failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "cannot fetch {model}: `{python}` has no usable huggingface_hub ({why}); it comes with vLLM: set engine.python to the Python that has vLLM, or put the model in {cache} yourself"
    )]
    NoHub {
        model: String,
        python: String,
        why: String,
        cache: String,
    },
    #[error(
        "{model} is gated or private: the hub at {endpoint} refused it {with_token} (HTTP {status}){or_missing}; accept its terms at {page} and set HF_TOKEN (in [engine.env] or the environment) to a token that has access"
    )]
    Gated {
        model: String,
        endpoint: String,
        page: String,
        status: u16,
        with_token: &'static str,
        /// Said when the hub's answer is also the one it gives for an id it lacks.
        or_missing: &'static str,
    },
    #[error(
        "model {model} was not found on the hub at {endpoint} (HTTP {status}): check [model] name against {page}"
    )]
    NotFound {
        model: String,
        endpoint: String,
        page: String,
        status: u16,
    },
    #[error(
        "{model} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE forbids fetching it: unset HF_HUB_OFFLINE, fetch it where the hub is reachable into that cache, or set [model] name to a local directory"
    )]
    Offline { model: String, cache: String },
    #[error(
        "{model} needs {need} more in {dir} and {free} is free there: free some space, or set HF_HUB_CACHE in [engine.env] to a disk with room"
    )]
    NoRoom {
        model: String,
        need: String,
        free: String,
        dir: String,
    },
    #[error(
        "fetching {model} failed {tries} times in a row without a byte ({last}); the partial files stay in {cache} and the next `pdctl pull` or `pdctl up` resumes them"
    )]
    Stalled {
        model: String,
        tries: u32,
        last: String,
        cache: String,
    },
    #[error("fetching {model} failed: {why}")]
    Failed { model: String, why: String },
}

impl FetchError {
    /// Whether a person must change something (token, name, disk, settings) before a try
    /// can succeed: exit code 2, as for bad input.
    pub fn is_usage(&self) -> bool {
        !matches!(self, FetchError::Stalled { .. } | FetchError::Failed { .. })
    }
}

/// One file of the model as the hub lists it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct HubFile {
    /// Its path in the repository.
    pub name: String,
    pub size: u64,
    /// Its name under `blobs/` in the cache (the LFS sha256, else the git blob id).
    pub blob: String,
}

/// What the hub says of a model: the commit `main` points at and the files vLLM loads.
#[derive(Debug, Clone, Deserialize)]
pub struct Listing {
    pub commit: String,
    pub files: Vec<HubFile>,
    /// Its config.json, when asked for and given.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
}

impl Listing {
    /// Bytes of every listed file.
    pub fn total(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// The model's size from this list (weights and config), for planning before the fetch.
    pub fn size(&self) -> model_files::ModelSize {
        let weights: Vec<(String, u64)> = self
            .files
            .iter()
            .filter(|f| f.name.ends_with(".safetensors") || f.name.ends_with(".bin"))
            .map(|f| (f.name.clone(), f.size))
            .collect();
        model_files::from_hub_list(&weights, self.config.as_ref())
    }
}

/// One event the script prints.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
enum Event {
    Files {
        #[serde(flatten)]
        listing: Listing,
        /// Bytes of those files on disk before this try fetched any.
        #[serde(default)]
        present: Option<u64>,
    },
    FileDone {
        #[allow(dead_code)]
        name: String,
    },
    Done {
        snapshot: PathBuf,
    },
    Error {
        kind: String,
        message: String,
        #[serde(default)]
        status: Option<u16>,
        #[serde(default)]
        need: Option<u64>,
        #[serde(default)]
        free: Option<u64>,
        #[serde(default)]
        dir: Option<String>,
    },
}

/// What a running fetch reports.
#[derive(Debug)]
pub enum Report<'a> {
    /// How far it has come.
    Progress(&'a Progress),
    /// A try failed (cut, stalled, a network error): the next one, resuming, begins after
    /// `pause`.
    Retry { why: &'a str, pause: Duration },
}

/// How far a fetch has come, as reported while it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Bytes on disk of the files being fetched (those there before included).
    pub done: u64,
    pub total: u64,
    /// Bytes that were there when this fetch began.
    pub had: u64,
    /// Bytes a second over the last few seconds.
    pub rate: f64,
    pub elapsed: Duration,
}

impl Progress {
    /// Seconds left at the current rate, when it moves.
    pub fn left(&self) -> Option<Duration> {
        (self.rate > 0.0).then(|| {
            Duration::from_secs_f64(self.total.saturating_sub(self.done) as f64 / self.rate)
        })
    }

    /// `1.20 / 3.10 GiB (38%), 45.2 MiB/s, 43 s left`: what `pull`, `up` and `status` show.
    pub fn text(&self) -> String {
        let pct = (self.done as f64 * 100.0 / self.total.max(1) as f64).floor() as u64;
        let mut t = format!("{} ({pct}%)", done_of_total(self.done, self.total));
        if self.done < self.total && self.rate > 0.0 {
            t.push_str(&format!(", {}/s", bytes(self.rate as u64)));
            if let Some(left) = self.left() {
                t.push_str(&format!(", {} left", duration(left)));
            }
        }
        t
    }
}

/// `1.20 / 3.10 GiB` (both in the unit of the total).
pub fn done_of_total(done: u64, total: u64) -> String {
    let (div, unit) = unit_of(total);
    format!(
        "{:.2} / {:.2} {unit}",
        done as f64 / div as f64,
        total as f64 / div as f64
    )
}

/// Bytes in the largest unit under them: `45.2 MiB`, `3.10 GiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    let (div, unit) = unit_of(n);
    if div == 1 {
        format!("{n} B")
    } else {
        format!("{:.1} {unit}", n as f64 / div as f64)
    }
}

fn unit_of(n: u64) -> (u64, &'static str) {
    match n {
        n if n >= 1 << 30 => (1 << 30, "GiB"),
        n if n >= 1 << 20 => (1 << 20, "MiB"),
        n if n >= 1 << 10 => (1 << 10, "KiB"),
        _ => (1, "B"),
    }
}

fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// A model to fetch and how: the engines' Python and environment decide the cache, the
/// endpoint and the token, as they will for the engines. A plan carries one (its `env`
/// without the token, its `python` as the topology writes it) for the nodes that run from
/// a plan and for the engines `scale` and `apply` add.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct Source {
    /// The hub id, `org/name`.
    pub model: String,
    /// The Python that has huggingface_hub (the engines' own).
    pub python: String,
    /// The engines' environment from the topology (`[engine.env]`): HF_HOME, HF_HUB_CACHE,
    /// HF_ENDPOINT, HF_TOKEN there win over this process's.
    pub env: BTreeMap<String, String>,
}

/// The Python the engines run: `configured` (engine.python) when it is a path, else the
/// one with vLLM pdctl finds, else the name as written (PATH).
pub fn engine_python(configured: &str) -> String {
    if configured.contains('/') {
        return configured.to_string();
    }
    crate::vllm::find_python(configured)
        .map(|(p, _)| p)
        .unwrap_or_else(|_| configured.to_string())
}

impl Source {
    /// The fetch of this node for a planned source: its Python found here, and the
    /// secret variables the plan names only (`tokens`, from the values kept for the
    /// engines) added to its environment.
    pub fn runnable<'a>(&self, tokens: impl IntoIterator<Item = (&'a str, &'a str)>) -> Source {
        let mut env = self.env.clone();
        for (k, v) in tokens {
            env.entry(k.to_string()).or_insert_with(|| v.to_string());
        }
        Source {
            model: self.model.clone(),
            python: engine_python(&self.python),
            env,
        }
    }

    /// Fetches it for `node` saying what it does in the lines `pull`, `up` and a change
    /// that adds engines print (without their `pdctl: `): where from, bytes done / total,
    /// rate and time left every `every`, each retry, then what was fetched. `shown` gets
    /// each progress said (for `status`).
    pub fn fetch_saying(
        &self,
        node: &str,
        every: Duration,
        say: &mut dyn FnMut(String),
        shown: &mut dyn FnMut(&Progress),
    ) -> Result<PathBuf, FetchError> {
        say(format!(
            "fetching {} for node {node} from {} into {}",
            self.model,
            self.endpoint(),
            self.cache().display()
        ));
        let started = Instant::now();
        let mut last: Option<Instant> = None;
        let mut latest: Option<Progress> = None;
        let snapshot = self.fetch(&mut |r: Report| match r {
            Report::Retry { why, pause } => say(format!(
                "fetching {}: the try failed ({why}); again in {} s, resuming",
                self.model,
                pause.as_secs()
            )),
            Report::Progress(p) => {
                if last.is_none_or(|l| l.elapsed() >= every) {
                    say(format!("fetching {}: {}", self.model, p.text()));
                    shown(p);
                    last = Some(Instant::now());
                }
                latest = Some(p.clone());
            }
        })?;
        let fetched = latest
            .as_ref()
            .map(|p| {
                format!(
                    "{} ({} fetched now)",
                    bytes(p.total),
                    bytes(p.total.saturating_sub(p.had))
                )
            })
            .unwrap_or_default();
        say(format!(
            "fetched {} {fetched} in {:.1} s: {}",
            self.model,
            started.elapsed().as_secs_f64(),
            snapshot.display()
        ));
        Ok(snapshot)
    }

    /// Whether the cache the engines read lacks the model (what makes a node fetch it).
    pub fn missing(&self) -> bool {
        model_files::cached(&self.model, &self.env).is_err()
    }

    fn var(&self, k: &str) -> Option<String> {
        self.env
            .get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .filter(|v| !v.is_empty())
    }

    /// The hub cache the engines read (and this fetch writes).
    pub fn cache(&self) -> PathBuf {
        model_files::hub_cache(&self.env)
    }

    /// The hub's address: HF_ENDPOINT, else huggingface.co.
    pub fn endpoint(&self) -> String {
        self.var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string()
    }

    /// The model's page on the hub, named in errors.
    pub fn page(&self) -> String {
        format!("{}/{}", self.endpoint(), self.model)
    }

    /// Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids downloads.
    pub fn offline(&self) -> bool {
        ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"].iter().any(|k| {
            self.var(k).is_some_and(|v| {
                matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
            })
        })
    }

    fn has_token(&self) -> bool {
        self.var("HF_TOKEN").is_some() || self.var("HUGGING_FACE_HUB_TOKEN").is_some()
    }

    /// The script's command: the engines' environment added, the token among it (never in
    /// argv), the cache given as HF_HUB_CACHE so the script and the engines agree.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.python);
        c.arg("-c").arg(SCRIPT).args(args);
        c.envs(&self.env)
            .env("HF_HUB_CACHE", self.cache())
            .env("HF_HUB_DISABLE_TELEMETRY", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// The hub's list of the files vLLM loads (with config.json when `with_config`), asked
    /// once; None of the refusals is retried.
    pub fn list(&self, with_config: bool) -> Result<Listing, FetchError> {
        if self.offline() {
            return Err(self.offline_error());
        }
        let mut args = vec!["list", self.model.as_str(), "main"];
        if with_config {
            args.push("--config");
        }
        let no_hub = |why: String| FetchError::NoHub {
            model: self.model.clone(),
            python: self.python.clone(),
            why,
            cache: self.cache().display().to_string(),
        };
        let mut child = self
            .command(&args)
            .spawn()
            .map_err(|e| no_hub(e.to_string()))?;
        let (mut so, mut se) = (
            child.stdout.take().expect("piped"),
            child.stderr.take().expect("piped"),
        );
        let read_out = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut so, &mut v);
            v
        });
        let read_err = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut se, &mut v);
            v
        });
        // A hub that does not answer is waited for this long, no longer.
        let deadline = Instant::now() + LIST_TIMEOUT;
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(FetchError::Failed {
                    model: self.model.clone(),
                    why: format!(
                        "the hub at {} did not list its files within {} s",
                        self.endpoint(),
                        LIST_TIMEOUT.as_secs()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = child.wait().map_err(|e| no_hub(e.to_string()))?;
        let stdout = read_out.join().unwrap_or_default();
        let stderr = read_err.join().unwrap_or_default();
        let stdout = String::from_utf8_lossy(&stdout);
        for line in stdout.lines() {
            match serde_json::from_str::<Event>(line) {
                Ok(Event::Files { listing, .. }) => return Ok(listing),
                Ok(Event::Error {
                    kind,
                    message,
                    status,
                    need,
                    free,
                    dir,
                }) => {
                    return Err(self.refusal(&kind, message, status, (need, free, dir)));
                }
                _ => {}
            }
        }
        Err(FetchError::Failed {
            model: self.model.clone(),
            why: format!(
                "`{}` printed no file list ({status}): {}",
                self.python,
                last_line(&String::from_utf8_lossy(&stderr))
            ),
        })
    }

    fn offline_error(&self) -> FetchError {
        FetchError::Offline {
            model: self.model.clone(),
            cache: self.cache().display().to_string(),
        }
    }

    /// The error for one the script reported.
    fn refusal(
        &self,
        kind: &str,
        message: String,
        status: Option<u16>,
        (need, free, dir): (Option<u64>, Option<u64>, Option<String>),
    ) -> FetchError {
        let model = self.model.clone();
        match kind {
            "no-hub" => FetchError::NoHub {
                model,
                python: self.python.clone(),
                why: message,
                cache: self.cache().display().to_string(),
            },
            "gated" | "unauthorized" => FetchError::Gated {
                or_missing: if kind == "unauthorized" && !self.has_token() {
                    " (or it does not exist: to a caller without a token the hub answers both alike)"
                } else {
                    ""
                },
                model,
                endpoint: self.endpoint(),
                page: self.page(),
                status: status.unwrap_or(401),
                with_token: if self.has_token() {
                    "with the token in HF_TOKEN"
                } else {
                    "without a token"
                },
            },
            "not-found" | "revision-not-found" => FetchError::NotFound {
                model,
                endpoint: self.endpoint(),
                page: self.page(),
                status: status.unwrap_or(404),
            },
            "offline" => self.offline_error(),
            "no-room" => FetchError::NoRoom {
                model,
                need: bytes(need.unwrap_or(0)),
                free: bytes(free.unwrap_or(0)),
                dir: dir.unwrap_or_else(|| self.cache().display().to_string()),
            },
            _ => FetchError::Failed {
                model,
                why: message,
            },
        }
    }

    /// Fetches the model's files into the cache, calling `report` about four times a
    /// second with the progress, and once per failed try; a try that moves no byte for
    /// [`stall_after`] is killed and begun again (resuming), with a growing pause, until
    /// [`TRIES`] in a row moved nothing. Returns the snapshot directory.
    pub fn fetch(&self, report: &mut dyn FnMut(Report)) -> Result<PathBuf, FetchError> {
        if self.offline() {
            return Err(self.offline_error());
        }
        let stall = stall_after();
        let started = Instant::now();
        let mut had = None;
        let mut failed_in_a_row = 0u32;
        loop {
            let before = self.bytes_on_disk(None);
            match self.one_try(stall, started, &mut had, report) {
                Ok(dir) => return Ok(dir),
                Err(Try::Refused(e)) => return Err(e),
                Err(Try::Again(why)) => {
                    let moved = self.bytes_on_disk(None) > before;
                    failed_in_a_row = if moved { 1 } else { failed_in_a_row + 1 };
                    if failed_in_a_row >= TRIES {
                        return Err(FetchError::Stalled {
                            model: self.model.clone(),
                            tries: failed_in_a_row,
                            last: why,
                            cache: self.cache().display().to_string(),
                        });
                    }
                    let pause = RESUME_AFTER.after(failed_in_a_row);
                    report(Report::Retry { why: &why, pause });
                    std::thread::sleep(pause);
                }
            }
        }
    }

    /// Bytes under the model's blobs/ of `files` (whole or partial), or of every blob.
    fn bytes_on_disk(&self, files: Option<&[HubFile]>) -> u64 {
        let blobs = self
            .cache()
            .join(format!("models--{}", self.model.replace('/', "--")))
            .join("blobs");
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
        match files {
            Some(files) => files
                .iter()
                .map(|f| {
                    let whole = blobs.join(&f.blob);
                    size(&whole)
                        .or_else(|| size(&blobs.join(format!("{}.incomplete", f.blob))))
                        .unwrap_or(0)
                })
                .sum(),
            None => std::fs::read_dir(&blobs)
                .map(|d| {
                    d.filter_map(|e| e.ok().and_then(|e| e.metadata().ok()))
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0),
        }
    }

    /// One run of the script, watched: its progress reported every 250 ms, killed when
    /// no byte moved for `stall`.
    fn one_try(
        &self,
        stall: Duration,
        started: Instant,
        had: &mut Option<u64>,
        report: &mut dyn FnMut(Report),
    ) -> Result<PathBuf, Try> {
        let timeout = (stall.as_secs() + 30).to_string();
        let cache_arg = self.cache().display().to_string();
        let mut child = self
            .command(&["fetch", &self.model, "main", &cache_arg, &timeout])
            .spawn()
            .map_err(|e| {
                Try::Refused(FetchError::NoHub {
                    model: self.model.clone(),
                    python: self.python.clone(),
                    why: e.to_string(),
                    cache: cache_arg.clone(),
                })
            })?;
        let output = ScriptOutput::read(&mut child);
        let mut files: Option<Vec<HubFile>> = None;
        let mut present = None;
        let mut last_moved = (Instant::now(), 0u64);
        let mut rate = Rate::default();
        let status = loop {
            if files.is_none() {
                (files, present) = output.listing();
            }
            if let Some(f) = &files {
                let done = self.bytes_on_disk(Some(f));
                let now = Instant::now();
                if done != last_moved.1 {
                    last_moved = (now, done);
                }
                report(Report::Progress(&Progress {
                    done,
                    total: f.iter().map(|x| x.size).sum(),
                    had: *had.get_or_insert(present.unwrap_or(done)),
                    rate: rate.add(now, done),
                    elapsed: started.elapsed(),
                }));
            }
            if let Some(status) = child.try_wait().ok().flatten() {
                break Some(status);
            }
            if last_moved.0.elapsed() > stall {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        let (events, stderr) = output.finish();
        let Some(status) = status else {
            return Err(Try::Again(format!("no byte for {} s", stall.as_secs())));
        };
        self.outcome(events, status, &stderr)
    }

    /// How a run of the script that ended went, from its last word: its snapshot, an
    /// error worth another try or one that is not, or an end without a word.
    fn outcome(
        &self,
        events: Vec<Event>,
        status: std::process::ExitStatus,
        stderr: &str,
    ) -> Result<PathBuf, Try> {
        for e in events.into_iter().rev() {
            match e {
                Event::Done { snapshot } => return Ok(snapshot),
                Event::Error {
                    kind,
                    message,
                    status,
                    need,
                    free,
                    dir,
                } => {
                    return Err(match kind.as_str() {
                        "network" | "http" => Try::Again(message),
                        _ => Try::Refused(self.refusal(&kind, message, status, (need, free, dir))),
                    });
                }
                _ => {}
            }
        }
        Err(Try::Again(format!(
            "`{}` ended ({status}) without finishing: {}",
            self.python,
            last_line(stderr)
        )))
    }
}

/// The fetch script's output as it runs: its events (one JSON object a line on stdout)
/// gathered by one thread, its stderr by another.
struct ScriptOutput {
    events: Arc<Mutex<Vec<Event>>>,
    reader: std::thread::JoinHandle<()>,
    err_reader: std::thread::JoinHandle<String>,
}

impl ScriptOutput {
    /// Starts reading `child`'s stdout and stderr (both piped).
    fn read(child: &mut std::process::Child) -> ScriptOutput {
        let events: Arc<Mutex<Vec<Event>>> = Arc::default();
        let stdout = child.stdout.take().expect("piped");
        let sink = events.clone();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(e) = serde_json::from_str::<Event>(&line) {
                    sink.lock().expect("events lock").push(e);
                }
            }
        });
        let mut stderr = child.stderr.take().expect("piped");
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        ScriptOutput {
            events,
            reader,
            err_reader,
        }
    }

    /// The hub's file list and the bytes already present, once the script said them.
    fn listing(&self) -> (Option<Vec<HubFile>>, Option<u64>) {
        self.events
            .lock()
            .expect("events lock")
            .iter()
            .find_map(|e| match e {
                Event::Files { listing, present } => Some((Some(listing.files.clone()), *present)),
                _ => None,
            })
            .unwrap_or((None, None))
    }

    /// Every event and the whole stderr, once the script has ended.
    fn finish(self) -> (Vec<Event>, String) {
        let _ = self.reader.join();
        let stderr = self.err_reader.join().unwrap_or_default();
        let events = std::mem::take(&mut *self.events.lock().expect("events lock"));
        (events, stderr)
    }
}

/// The download's rate over the last 10 s, from the bytes on disk sampled as it goes.
#[derive(Default)]
struct Rate {
    /// When each sample was taken and the bytes on disk then, oldest first.
    samples: std::collections::VecDeque<(Instant, u64)>,
}

impl Rate {
    /// Adds the sample of `bytes` at `now`; bytes a second over the samples of the last 10 s.
    fn add(&mut self, now: Instant, bytes: u64) -> f64 {
        self.samples.push_back((now, bytes));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(10))
        {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((t0, b0)), Some((t1, b1))) if t1 > t0 => {
                b1.saturating_sub(*b0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// How one try of the script ended, when it did not finish.
enum Try {
    /// Worth another try (cut, stalled, a network error).
    Again(String),
    /// Another try would end the same.
    Refused(FetchError),
}

fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_reads_as_a_person_expects() {
        let gib = 1u64 << 30;
        let p = Progress {
            done: gib * 12 / 10,
            total: gib * 31 / 10,
            had: 0,
            rate: 45.2 * (1 << 20) as f64,
            elapsed: Duration::from_secs(20),
        };
        assert_eq!(p.text(), "1.20 / 3.10 GiB (38%), 45.2 MiB/s, 43 s left");
        let whole = Progress {
            done: p.total,
            ..p.clone()
        };
        assert_eq!(whole.text(), "3.10 / 3.10 GiB (100%)");
    }

    #[test]
    fn the_token_reaches_the_fetch_through_its_environment_only() {
        let s = Source {
            model: "org/m".into(),
            python: "python3".into(),
            env: BTreeMap::from([("HF_TOKEN".to_string(), "hf_secret_42".to_string())]),
        };
        let c = s.command(&["fetch", "org/m", "main", "/cache", "90"]);
        assert!(
            c.get_args()
                .all(|a| !a.to_string_lossy().contains("hf_secret_42")),
            "{c:?}"
        );
        assert!(
            c.get_envs()
                .any(|(k, v)| k == "HF_TOKEN" && v.is_some_and(|v| v == "hf_secret_42"))
        );
    }

    #[test]
    fn refusals_say_what_to_do_and_which_are_a_persons_to_fix() {
        let s = Source {
            model: "org/gated".into(),
            python: "python3".into(),
            env: BTreeMap::from([("HF_ENDPOINT".to_string(), "http://hub.test/".to_string())]),
        };
        let e = s.refusal("unauthorized", "401".into(), Some(401), (None, None, None));
        let text = e.to_string();
        assert!(
            text.contains("HF_TOKEN") && text.contains("http://hub.test/org/gated"),
            "{text}"
        );
        assert!(e.is_usage());
        let e = s.refusal(
            "no-room",
            String::new(),
            None,
            (Some(3 << 30), Some(1 << 30), Some("/d".into())),
        );
        assert_eq!(
            e.to_string(),
            "org/gated needs 3.0 GiB more in /d and 1.0 GiB is free there: free some space, or set HF_HUB_CACHE in [engine.env] to a disk with room"
        );
        assert!(
            !s.refusal("network", "cut".into(), None, (None, None, None))
                .is_usage()
        );
    }
}
