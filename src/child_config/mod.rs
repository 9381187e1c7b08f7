//! `--config FILE` for the processes pdctl starts as itself (`pdctl proxy`, `pdctl sim`):
//! one struct per command serves as its flags (clap) and as its TOML config file (serde),
//! with the same names (a flag's id is its field's key: `--rate-limit` is `rate_limit`)
//! and the same defaults (the struct's `Default`, which the clap attributes read).
//!
//! The planner writes the file, the plan shows it, the supervisor writes it before the
//! start, and the command line is `pdctl proxy --config FILE`. The plan also keeps the
//! same values typed ([`ChildSettings`], `Plan::settings`): what `plan::diff` compares,
//! export turns into a pod's flags and the supervisor sends a running proxy. Flags given beside
//! `--config` override the file's values (a simulated role's own `args` in a topology ride
//! on the command line that way). Secrets are never in the file: they come from the
//! environment (`PDCTL_API_KEY`, `VLLM_API_KEY`), a file naming one is refused.
//!
//! [`Configured::resolve`] reads through a given function, so [`from_service`] can build
//! the struct from a planned service (its argv and generated files) without touching disk
//! (the planner resolves a sim's role flags over its file this way, once).
//!
//! The two structs live here, in [`proxy`] and [`sim`], not in `crate::proxy` and
//! `crate::sim`: the planner writes them, compares them and export reads them, and
//! the planner sits below the proxy and the simulator. This module sits above the
//! topology (its errors are located as a topology's are) and below the connectors and the
//! planner; see `tests/layers.rs`.

pub mod proxy;
pub mod sim;

use crate::topology::{backticked_after, expected_list};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// A command whose arguments can also come from a config file.
pub trait ChildConfig:
    Args + FromArgMatches + Serialize + DeserializeOwned + Clone + Default
{
    /// The subcommand (`proxy`, `sim`), for messages and for reading a planned argv.
    const COMMAND: &'static str;
    /// Keys a file must write unless their flag is given (the sim's `port`).
    const REQUIRED: &'static [&'static str] = &[];
    /// Copies the fields serde skips (secrets from the environment) from the flags.
    fn keep_secrets(&mut self, flags: &Self);
}

/// A config file that cannot be used: located (file:line:col, key, hint) as a topology
/// error is, and reported the same way.
pub type ConfigFileError = crate::topology::TopologyError;

impl ConfigFileError {
    fn whole(file: &Path, message: String, hint: Option<String>) -> ConfigFileError {
        ConfigFileError {
            file: file.display().to_string(),
            line: 1,
            col: 1,
            key: "(file)".into(),
            message,
            hint,
        }
    }
}

/// `T`'s flags plus `--config FILE`, remembering which flags the command line gave.
#[derive(Debug, Clone)]
pub struct Configured<T> {
    pub config: Option<PathBuf>,
    /// The flags as parsed, defaults filled in.
    pub flags: T,
    /// Ids (= serde keys) of the flags written on the command line.
    pub given: Vec<String>,
}

const CONFIG_ID: &str = "config";

impl<T: ChildConfig> Args for Configured<T> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        T::augment_args(cmd).arg(config_arg())
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        T::augment_args_for_update(cmd).arg(config_arg())
    }
}

fn config_arg() -> clap::Arg {
    clap::Arg::new(CONFIG_ID)
        .long("config")
        .value_name("FILE")
        .value_parser(clap::value_parser!(PathBuf))
        .help("Read the settings from this TOML file (keys are the flags' names with `_`: rate_limit = 40); flags given as well override the file")
}

impl<T: ChildConfig> FromArgMatches for Configured<T> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let ids = arg_ids::<T>();
        let given = m
            .ids()
            .map(|id| id.as_str())
            .filter(|id| ids.iter().any(|a| a == id))
            .filter(|id| m.value_source(id) == Some(ValueSource::CommandLine))
            .map(str::to_string)
            .collect();
        Ok(Configured {
            config: m.get_one::<PathBuf>(CONFIG_ID).cloned(),
            flags: T::from_arg_matches(m)?,
            given,
        })
    }
    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// The ids of `T`'s own arguments (not its groups).
fn arg_ids<T: Args>() -> Vec<String> {
    T::augment_args(clap::Command::new("ids"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect()
}

impl<T: ChildConfig> Configured<T> {
    /// Parses an argv that starts after the subcommand (`--config F --itl-ms 3`).
    pub fn parse_args<I, S>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let cmd = Self::augment_args(clap::Command::new(T::COMMAND).no_binary_name(true));
        let m = cmd.try_get_matches_from(args)?;
        Self::from_arg_matches(&m)
    }

    /// The settings: the flags alone, or the file with the given flags over it. `read`
    /// returns the file's text (from disk for a command line, from the plan for a spec).
    pub fn resolve(
        self,
        read: impl FnOnce(&Path) -> std::io::Result<String>,
    ) -> Result<T, ConfigFileError> {
        let Some(path) = self.config.clone() else {
            return Ok(self.flags);
        };
        let text = read(&path).map_err(|e| {
            ConfigFileError::whole(
                &path,
                format!("cannot read the {} config: {e}", T::COMMAND),
                None,
            )
        })?;
        let from_file: T = parse_file(&path, &text, &self.given)?;
        let mut merged = serde_json::to_value(&from_file).map_err(|e| internal(&path, e))?;
        let flags = serde_json::to_value(&self.flags).map_err(|e| internal(&path, e))?;
        for id in &self.given {
            overlay(&mut merged, &flags, id);
        }
        let mut out: T = serde_json::from_value(merged).map_err(|e| internal(&path, e))?;
        out.keep_secrets(&self.flags);
        Ok(out)
    }
}

fn internal(path: &Path, e: serde_json::Error) -> ConfigFileError {
    ConfigFileError::whole(path, format!("cannot combine with the flags: {e}"), None)
}

/// Sets `key` in `into` (top level, else in the table holding it) to its value in `from`.
fn overlay(into: &mut serde_json::Value, from: &serde_json::Value, key: &str) {
    if let Some(v) = from.get(key) {
        into[key] = v.clone();
        return;
    }
    let Some(tables) = from.as_object() else {
        return;
    };
    for (table, inner) in tables {
        if let Some(v) = inner.get(key) {
            into[table.as_str()][key] = v.clone();
        }
    }
}

/// Reads a config file's text, every mistake located at its key.
fn parse_file<T: ChildConfig>(
    path: &Path,
    text: &str,
    given: &[String],
) -> Result<T, ConfigFileError> {
    let at = |offset: usize, key: String, message: String, hint: Option<String>| {
        let (line, col) = line_col(text, offset);
        ConfigFileError {
            file: path.display().to_string(),
            line,
            col,
            key,
            message,
            hint,
        }
    };
    let de = toml::Deserializer::parse(text).map_err(|e| {
        let first = e.message().lines().next().unwrap_or("invalid TOML").trim();
        at(
            e.span().map_or(0, |s| s.start),
            "(document)".into(),
            format!("invalid TOML: {first}"),
            None,
        )
    })?;
    let value: T = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let offset = inner.span().map_or(0, |s| s.start);
        let msg = inner.message().trim().to_string();
        let key = if path == "." {
            "(document)".into()
        } else {
            path
        };
        if let Some(unknown) = backticked_after(&msg, "unknown field ") {
            let expected = expected_list(&msg);
            let secret = unknown.contains("api_key");
            let hint = if secret {
                Some(
                    "keys are not read from files: set them in the environment (see --help)".into(),
                )
            } else {
                crate::spelling::suggestion(&unknown, &expected)
                    .map(|s| format!("did you mean `{s}`?"))
            };
            return at(offset, key, format!("unknown key `{unknown}`"), hint);
        }
        if let Some(value) = backticked_after(&msg, "unknown variant ") {
            let expected = expected_list(&msg);
            return at(
                offset,
                key,
                format!("unknown value `{value}`"),
                Some(format!("one of: {}", expected.join(", "))),
            );
        }
        at(offset, key, msg, None)
    })?;
    let table: toml::Table = toml::from_str(text).unwrap_or_default();
    for required in T::REQUIRED {
        if !table.contains_key(*required) && !given.iter().any(|g| g == required) {
            return Err(at(
                0,
                required.to_string(),
                format!("required key `{required}` is missing"),
                Some(format!(
                    "add `{required} = ...` or give --{}",
                    required.replace('_', "-")
                )),
            ));
        }
    }
    Ok(value)
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// The file a planned `pdctl proxy|sim --config FILE` reads, among its generated files.
pub fn config_file<'a>(
    argv: &[String],
    files: impl IntoIterator<Item = (&'a Path, &'a str)>,
) -> Option<(&'a Path, &'a str)> {
    let at = argv.iter().position(|a| a == "--config")?;
    let path = Path::new(argv.get(at + 1)?);
    files.into_iter().find(|(p, _)| *p == path)
}

/// Why a planned service's settings cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum FromServiceError {
    #[error("the argv is not `pdctl {0} ...`")]
    NotThisCommand(&'static str),
    #[error("the argv does not parse: {0}")]
    Flags(String),
    #[error(transparent)]
    File(#[from] ConfigFileError),
}

/// The settings of a planned `pdctl proxy` / `pdctl sim` service from its argv and its
/// generated files (path, content), without touching disk: the file named by `--config`
/// must be one of `files`.
pub fn from_service<'a, T: ChildConfig>(
    argv: &[String],
    files: impl IntoIterator<Item = (&'a Path, &'a str)>,
) -> Result<T, FromServiceError> {
    if argv.get(1).map(String::as_str) != Some(T::COMMAND) {
        return Err(FromServiceError::NotThisCommand(T::COMMAND));
    }
    let parsed = Configured::<T>::parse_args(&argv[2..])
        .map_err(|e| FromServiceError::Flags(first_line(&e.to_string())))?;
    let files: Vec<(&Path, &str)> = files.into_iter().collect();
    Ok(parsed.resolve(|path| {
        files
            .iter()
            .find(|(p, _)| *p == path)
            .map(|(_, c)| c.to_string())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not among the service's generated files",
                )
            })
    })?)
}

fn first_line(s: &str) -> String {
    s.lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_string()
}

/// The settings of a service pdctl runs as itself, typed: the plan keeps them beside the
/// service's command (`Plan::settings`), `plan::diff` compares them field by field, and
/// the supervisor hands a running proxy its new ones as they are (`Request::WatchSettings`).
/// The generated config file carries the same values for the process's start; nothing
/// reads it back.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChildSettings {
    Proxy(Box<proxy::ProxyArgs>),
    Sim(Box<sim::SimArgs>),
}

impl ChildSettings {
    /// The proxy's settings, when these are a proxy's.
    pub fn proxy(&self) -> Option<&proxy::ProxyArgs> {
        match self {
            ChildSettings::Proxy(a) => Some(a),
            ChildSettings::Sim(_) => None,
        }
    }

    /// A simulated engine's settings, when these are a sim's.
    pub fn sim(&self) -> Option<&sim::SimArgs> {
        match self {
            ChildSettings::Sim(a) => Some(a),
            ChildSettings::Proxy(_) => None,
        }
    }
}

/// The file text the planner writes for `value` (TOML, defaults spelled out).
pub fn to_file<T: ChildConfig>(value: &T) -> String {
    toml::to_string(value).expect("a child config serialises to TOML")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{PolicyName, ProxyProtocol, SimModel};
    use proxy::ProxyArgs;
    use sim::SimArgs;

    /// Parses `args` (after the subcommand) with `file` as the text of `c.toml`.
    fn load<T: ChildConfig>(args: &[&str], file: &str) -> Result<T, ConfigFileError> {
        Configured::<T>::parse_args(args).unwrap().resolve(|p| {
            assert_eq!(p, Path::new("c.toml"));
            Ok(file.to_string())
        })
    }

    fn every_proxy_setting() -> ProxyArgs {
        ProxyArgs {
            host: "10.0.0.1".into(),
            port: 8030,
            prefill: vec!["http://10.0.0.2:8100".into(), "http://10.0.0.2:8101".into()],
            decode: vec!["http://10.0.0.3:8200".into()],
            prefill_dns: vec!["pd-prefill:8100".into()],
            decode_dns: vec!["pd-decode:8200".into()],
            bootstrap_ports: vec![8998, 8999, 9000],
            protocol: ProxyProtocol::Mooncake,
            kv_load_failure_policy: crate::topology::KvLoadFailurePolicy::Fail,
            handoff_leaves_tokens: 256,
            decode_prompt_tokens_details: true,
            policy: PolicyName::LeastLoaded,
            prefill_policy: Some(PolicyName::PrefixAware),
            decode_policy: Some(PolicyName::Random),
            scrape_metrics: true,
            no_warmup: true,
            warmed_within_s: 45,
            rate_limit: 40.5,
            max_concurrent: 100,
            queue_size: 7,
            connect_timeout_ms: 1_500,
            prefill_timeout_s: 60,
            first_byte_timeout_s: 61,
            total_timeout_s: 62,
            retries: 5,
            restart_wait_s: 3,
            migration_limit: 5,
            migration_max_tokens: 1_000,
            drain_grace_s: 4,
            max_body_bytes: 1024,
            tcp_keepalive_idle_s: 5,
            tcp_keepalive_interval_s: 3,
            tcp_keepalive_count: 4,
            tcp_user_timeout_s: 20,
            api_key: None,
            engine_api_key: None,
            supervisor_socket: Some("/run/pd/control.sock".into()),
            health_interval_ms: 250,
            header_read_timeout_s: 7,
            max_client_connections: 900,
        }
    }

    fn every_sim_setting() -> SimArgs {
        sim::every_setting()
    }

    #[test]
    fn a_written_config_reads_back_as_the_same_settings() {
        let proxy = every_proxy_setting();
        let text = to_file(&proxy);
        assert!(text.contains("rate_limit = 40.5"), "{text}");
        assert_eq!(
            load::<ProxyArgs>(&["--config", "c.toml"], &text).unwrap(),
            proxy
        );
        let sim = every_sim_setting();
        let text = to_file(&sim);
        assert!(text.contains("[model_params]\n"), "{text}");
        assert_eq!(
            load::<SimArgs>(&["--config", "c.toml"], &text).unwrap(),
            sim
        );
        // The defaults are the flags' defaults: an empty proxy file is `pdctl proxy` with
        // no settings, a sim file needs only its port.
        let flags = Configured::<ProxyArgs>::parse_args(["--prefill", "h:1", "--decode", "h:2"])
            .unwrap()
            .flags;
        let from_file: ProxyArgs = load(
            &["--config", "c.toml"],
            "prefill = [\"h:1\"]\ndecode = [\"h:2\"]\n",
        )
        .unwrap();
        assert_eq!(from_file, flags);
        let flags = Configured::<SimArgs>::parse_args(["--port", "9"])
            .unwrap()
            .flags;
        assert_eq!(
            load::<SimArgs>(&["--config", "c.toml"], "port = 9\n").unwrap(),
            flags
        );
        assert_eq!(flags.model_params, SimModel::default());
    }

    #[test]
    fn the_flags_written_for_a_pod_parse_back_into_the_same_settings() {
        let proxy = every_proxy_setting();
        let parsed = Configured::<ProxyArgs>::parse_args(proxy.to_argv()).unwrap();
        assert_eq!(parsed.flags, proxy);
        assert!(parsed.config.is_none());
    }

    #[test]
    fn flags_beside_the_file_override_it_and_only_those() {
        let file = "prefill = [\"h:1\"]\ndecode = [\"h:2\"]\nrate_limit = 40.0\nretries = 5\n";
        let a: ProxyArgs = load(&["--config", "c.toml", "--rate-limit", "3"], file).unwrap();
        assert_eq!((a.rate_limit, a.retries), (3.0, 5));
        assert_eq!(a.prefill, ["h:1"]);
        let a: ProxyArgs = load(&["--config", "c.toml", "--decode", "h:9"], file).unwrap();
        assert_eq!(a.decode, ["h:9"]);
        // A latency flag lands in the model's table.
        let a: SimArgs = load(
            &["--config", "c.toml", "--itl-ms", "3"],
            "port = 9\n[model_params]\nitl_ms = 4.0\nmax_num_seqs = 8\n",
        )
        .unwrap();
        assert_eq!(
            (a.model_params.itl_ms, a.model_params.max_num_seqs),
            (3.0, 8)
        );
        // A sim's port may come from a flag alone.
        let a: SimArgs = load(&["--config", "c.toml", "--port", "7"], "").unwrap();
        assert_eq!(a.port, 7);
    }

    #[test]
    fn a_bad_key_is_located_with_a_suggestion() {
        let e =
            load::<ProxyArgs>(&["--config", "c.toml"], "port = 8000\nretires = 3\n").unwrap_err();
        assert_eq!((e.file.as_str(), e.line, e.col), ("c.toml", 2, 1), "{e}");
        assert_eq!(e.key, "retires");
        assert_eq!(e.hint.as_deref(), Some("did you mean `retries`?"));
        assert!(
            e.to_string()
                .starts_with("c.toml:2:1: retires: unknown key"),
            "{e}"
        );
        let e = load::<SimArgs>(
            &["--config", "c.toml"],
            "port = 1\n[model_params]\nitl_m = 3.0\n",
        )
        .unwrap_err();
        assert_eq!((e.line, e.key.as_str()), (3, "model_params.itl_m"), "{e}");
        assert_eq!(e.hint.as_deref(), Some("did you mean `itl_ms`?"));
        let e = load::<ProxyArgs>(&["--config", "c.toml"], "port = \"eighty\"\n").unwrap_err();
        assert_eq!((e.line, e.key.as_str()), (1, "port"), "{e}");
        let e =
            load::<ProxyArgs>(&["--config", "c.toml"], "policy = \"round_robin\"\n").unwrap_err();
        assert_eq!(e.key, "policy", "{e}");
        assert!(e.message.contains("round_robin"), "{e}");
        assert!(e.hint.unwrap().contains("round-robin"));
        let e = load::<ProxyArgs>(&["--config", "c.toml"], "port = [\n").unwrap_err();
        assert!(e.message.starts_with("invalid TOML"), "{e}");
        let e = load::<SimArgs>(&["--config", "c.toml"], "role = \"decode\"\n").unwrap_err();
        assert_eq!(e.key, "port", "{e}");
        assert!(e.message.contains("missing"), "{e}");
        let e = Configured::<ProxyArgs>::parse_args(["--config", "nowhere.toml"])
            .unwrap()
            .resolve(|p| std::fs::read_to_string(p))
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("nowhere.toml:1:1: (file): cannot read the proxy config"),
            "{e}"
        );
    }

    #[test]
    fn keys_are_never_read_from_a_file_but_from_the_environment_beside_it() {
        let e = load::<ProxyArgs>(&["--config", "c.toml"], "api_key = \"s3cret\"\n").unwrap_err();
        assert_eq!(e.key, "api_key", "{e}");
        assert!(e.hint.unwrap().contains("environment"));
        let a: ProxyArgs =
            load(&["--config", "c.toml", "--api-key", "k1"], "retries = 1\n").unwrap();
        assert_eq!(a.api_key.as_deref(), Some("k1"));
        let keyed = ProxyArgs {
            api_key: Some("s3cret".into()),
            engine_api_key: Some("s3cret".into()),
            ..every_proxy_setting()
        };
        assert!(!to_file(&keyed).contains("s3cret"));
        let keyed = SimArgs {
            api_key: Some("s3cret".into()),
            ..every_sim_setting()
        };
        assert!(!to_file(&keyed).contains("s3cret"));
    }

    /// Every flag is a key of the file under the same name (else a flag beside `--config`
    /// could not override it).
    #[test]
    fn every_flag_has_its_key() {
        fn check<T: ChildConfig>(value: &T, secrets: &[&str]) {
            let v = serde_json::to_value(value).unwrap();
            for id in arg_ids::<T>() {
                let found = v.get(&id).is_some()
                    || v.as_object()
                        .unwrap()
                        .values()
                        .any(|t| t.get(&id).is_some());
                assert!(
                    found || secrets.contains(&id.as_str()),
                    "{} {id}",
                    T::COMMAND
                );
            }
        }
        check(&every_proxy_setting(), &["api_key", "engine_api_key"]);
        check(&every_sim_setting(), &["api_key"]);
    }

    #[test]
    fn a_planned_service_is_read_from_its_argv_and_files_without_disk() {
        let text = to_file(&every_sim_setting());
        let argv: Vec<String> = [
            "pdctl",
            "sim",
            "--config",
            "/s/files/prefill-1.sim.toml",
            "--itl-ms",
            "2",
        ]
        .map(String::from)
        .to_vec();
        let files = [(Path::new("/s/files/prefill-1.sim.toml"), text.as_str())];
        let a: SimArgs = from_service(&argv, files).unwrap();
        assert_eq!(a.model_params.itl_ms, 2.0);
        assert_eq!(a.model, "qwen");
        let e = from_service::<SimArgs>(&argv, []).unwrap_err();
        assert!(
            e.to_string()
                .contains("not among the service's generated files"),
            "{e}"
        );
        let e = from_service::<ProxyArgs>(&argv, files).unwrap_err();
        assert!(
            matches!(e, FromServiceError::NotThisCommand("proxy")),
            "{e}"
        );
        // The flags form of older plans reads too.
        let old: Vec<String> = [
            "pdctl",
            "proxy",
            "--prefill",
            "h:1",
            "--decode",
            "h:2",
            "--retries",
            "4",
        ]
        .map(String::from)
        .to_vec();
        let a: ProxyArgs = from_service(&old, []).unwrap();
        assert_eq!(
            (a.retries, a.decode.as_slice()),
            (4, ["h:2".to_string()].as_slice())
        );
    }
}
