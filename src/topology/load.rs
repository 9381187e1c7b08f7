//! Reading a topology: TOML syntax, serde types, then the checks of [`super::validate`];
//! every failure becomes a [`TopologyError`] at file:line:col with the key at fault.

use super::locate::Locator;
use super::{Problem, TopologyError};
use crate::spelling::suggestion;
use std::path::{Path, PathBuf};

/// Where a topology came from, for messages such as "using profile sim-1p1d".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    Profile(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Profile(name) => write!(f, "profile {name}"),
        }
    }
}

/// A parsed and checked topology with what is needed to locate later problems in it.
#[derive(Debug, Clone)]
pub struct Topology {
    pub spec: super::Topology,
    pub source: Source,
    pub locator: Locator,
    /// The head node: `head` when written, else the first node in the file.
    pub head: String,
}

impl Topology {
    /// Places a planner problem in the file, at the first of its keys the file writes.
    pub fn locate(&self, p: Problem) -> TopologyError {
        let key = std::iter::once(&p.key)
            .chain(&p.also)
            .find(|k| self.locator.writes(k))
            .unwrap_or(&p.key)
            .clone();
        self.locator.error(&key, p.message, p.hint)
    }
}

/// Reads and checks a topology file.
pub fn load_file(path: &Path) -> Result<Topology, TopologyError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TopologyError {
        file: file.clone(),
        line: 1,
        col: 1,
        key: "(file)".into(),
        message: format!("cannot read the topology: {e}"),
        hint: Some(
            "check the path given with -f, or run `pdctl profiles` for built-in ones".into(),
        ),
    })?;
    load_str(&text, Source::File(path.to_path_buf()), file)
}

/// Parses and checks topology text; `file` is what errors call it.
pub fn load_str(text: &str, source: Source, file: String) -> Result<Topology, TopologyError> {
    let locator = Locator::new(file, text);
    let mut spec: super::Topology = toml::from_str(text).map_err(|e| serde_error(&locator, &e))?;
    spec.ssh = super::nodes::ssh_destinations(text);
    let order = locator.table_key_order("nodes");
    let head = spec
        .head
        .clone()
        .or_else(|| order.first().cloned())
        .or_else(|| spec.nodes.keys().next().cloned())
        .unwrap_or_default();
    let t = Topology {
        spec,
        source,
        locator,
        head,
    };
    super::validate::check(&t.spec, &t.head).map_err(|p| t.locate(p))?;
    Ok(t)
}

/// Checks a topology again after a caller changed its spec (`pdctl scale` setting instance
/// counts), locating problems in the text it was read from.
pub fn recheck(t: &Topology) -> Result<(), TopologyError> {
    super::validate::check(&t.spec, &t.head).map_err(|p| t.locate(p))
}

/// Turns a toml/serde error into a located one, with "did you mean" for unknown keys and
/// unknown values.
fn serde_error(locator: &Locator, e: &toml::de::Error) -> TopologyError {
    let msg = e.message().trim().to_string();
    let span = e.span().unwrap_or(0..0);
    let offset = span.start;
    // A span over the whole document means the error is about the top level.
    let whole = span.start == 0 && (span.is_empty() || span.end + 1 >= locator.text_len());
    let at_path = if whole {
        String::new()
    } else {
        locator.path_at(offset).unwrap_or_default()
    };
    if let Some(unknown) = backticked_after(&msg, "unknown field ") {
        let expected = expected_list(&msg);
        let hint = suggestion(&unknown, &expected)
            .map(|s| format!("did you mean `{s}`?"))
            .or_else(|| {
                (!expected.is_empty()).then(|| format!("known keys here: {}", expected.join(", ")))
            });
        let key = if at_path.ends_with(&unknown) || at_path.is_empty() {
            if at_path.is_empty() {
                unknown.clone()
            } else {
                at_path
            }
        } else {
            format!("{at_path}.{unknown}")
        };
        return locator.error_at(offset, &key, format!("unknown key `{unknown}`"), hint);
    }
    if let Some(value) = backticked_after(&msg, "unknown variant ") {
        let expected = expected_list(&msg);
        let hint = suggestion(&value, &expected)
            .map(|s| format!("did you mean `{s}`?"))
            .or_else(|| Some(format!("one of: {}", expected.join(", "))));
        return locator.error_at(
            offset,
            key_or(&at_path),
            format!("unknown value `{value}`"),
            hint,
        );
    }
    if let Some(field) = backticked_after(&msg, "missing field ") {
        let key = if at_path.is_empty() {
            field.clone()
        } else {
            format!("{at_path}.{field}")
        };
        return locator.error_at(
            offset,
            &key,
            format!("required key `{field}` is missing"),
            Some(format!("add `{field} = ...` here")),
        );
    }
    if msg.starts_with("invalid type") || msg.starts_with("invalid value") {
        return locator.error_at(offset, key_or(&at_path), msg, None);
    }
    // Syntax errors: toml's message is already specific (and may span several lines);
    // the document cannot be walked, so the key is read off the line itself.
    let first = msg.lines().next().unwrap_or("invalid TOML").to_string();
    let key = if at_path.is_empty() {
        locator.key_on_line_of(offset)
    } else {
        at_path
    };
    locator.error_at(offset, key_or(&key), format!("invalid TOML: {first}"), None)
}

fn key_or(path: &str) -> &str {
    if path.is_empty() { "(document)" } else { path }
}

/// The text between the first pair of backticks after `prefix`.
pub(crate) fn backticked_after(msg: &str, prefix: &str) -> Option<String> {
    let rest = &msg[msg.find(prefix)? + prefix.len()..];
    let rest = rest.strip_prefix('`')?;
    Some(rest[..rest.find('`')?].to_string())
}

/// serde's "expected one of `a`, `b`" (or "expected `a`") list.
pub(crate) fn expected_list(msg: &str) -> Vec<String> {
    let Some(i) = msg.find("expected") else {
        return Vec::new();
    };
    msg[i..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> TopologyError {
        load_str(text, Source::Profile("t".into()), "t.toml".into()).unwrap_err()
    }

    #[test]
    fn unknown_key_is_located_with_a_suggestion() {
        let e = err("[model]\nname = \"m\"\n[prefill]\ninstnces = 2\n");
        assert_eq!((e.line, e.col), (4, 1), "{e}");
        assert_eq!(e.key, "prefill.instnces");
        assert_eq!(e.hint.as_deref(), Some("did you mean `instances`?"));
    }

    #[test]
    fn unknown_value_lists_the_choices() {
        let e = err("[model]\nname = \"m\"\n[proxy]\npolicy = \"round_robin\"\n");
        assert_eq!(e.key, "proxy.policy", "{e}");
        assert_eq!(e.line, 4);
        assert_eq!(e.hint.as_deref(), Some("did you mean `round-robin`?"));
    }

    #[test]
    fn missing_model_name_says_what_to_add() {
        let e = err("[model]\nserved_name = \"m\"\n");
        assert_eq!(e.key, "model.name", "{e}");
        assert!(e.message.contains("missing"));
    }

    #[test]
    fn wrong_type_names_the_key() {
        let e = err("[model]\nname = \"m\"\n[decode]\ninstances = \"two\"\n");
        assert_eq!(e.key, "decode.instances", "{e}");
        assert_eq!(e.line, 4);
    }

    #[test]
    fn a_network_setting_of_zero_is_located_and_the_rest_default() {
        let e = err("[model]\nname = \"m\"\n[network]\ntcp_keepalive_count = 0\n");
        assert_eq!(
            (e.key.as_str(), e.line),
            ("network.tcp_keepalive_count", 4),
            "{e}"
        );
        assert!(e.message.contains("at least 1"), "{e}");
        let t = load_str(
            "[model]\nname = \"m\"\n[network]\ntcp_user_timeout_s = 20\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        assert_eq!(t.spec.network.tcp_user_timeout_s, 20);
        assert_eq!(t.spec.network.tcp_keepalive_idle_s, 4);
    }

    #[test]
    fn a_health_setting_of_zero_is_located_and_the_rest_default() {
        let e = err("[model]\nname = \"m\"\n[health]\nfailed_probes = 0\n");
        assert_eq!((e.key.as_str(), e.line), ("health.failed_probes", 4), "{e}");
        assert!(e.message.contains("at least 1"), "{e}");
        let t = load_str(
            "[model]\nname = \"m\"\n[health]\nprobe_timeout_s = 30\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        assert_eq!(t.spec.health.probe_timeout_s, 30);
        let d = crate::vocab::HealthSettings::default();
        assert_eq!(t.spec.health.failed_probes, d.failed_probes);
        assert_eq!(t.spec.health.cut_off_after_s, d.cut_off_after_s);
    }

    #[test]
    fn syntax_errors_are_located() {
        let e = err("[model]\nname = \"m\n");
        assert_eq!(e.line, 2, "{e}");
        assert!(e.message.starts_with("invalid TOML"));
    }

    #[test]
    fn the_short_file_gets_defaults() {
        let t = load_str(
            "[model]\nname = \"m\"\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        assert_eq!(t.head, "local");
        assert_eq!(t.spec.prefill.instances, 1);
        assert_eq!(t.spec.proxy.port, 8000);
    }

    #[test]
    fn the_rebalance_table_is_read_with_its_defaults() {
        let t = load_str(
            "[model]\nname = \"m\"\n[rebalance]\nttft_p90_ms = 1500\nmode = \"act\"\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        let r = t.spec.rebalance.expect("[rebalance] is kept");
        assert_eq!(r.ttft_p90_ms, Some(1500.0));
        assert_eq!(r.mode, crate::vocab::RebalanceMode::Act);
        assert_eq!((r.min_prefill, r.min_decode), (1, 1));
        assert_eq!((r.window_s, r.cooldown_s, r.budget), (30, 120, None));
    }

    #[test]
    fn rebalance_mistakes_are_located() {
        let e = err("[model]\nname = \"m\"\n[rebalance]\nttft_p90ms = 1\n");
        assert_eq!((e.key.as_str(), e.line), ("rebalance.ttft_p90ms", 4), "{e}");
        assert_eq!(e.hint.as_deref(), Some("did you mean `ttft_p90_ms`?"));
        let e = err("[model]\nname = \"m\"\n[rebalance]\nitl_p90_ms = 50\nmode = \"auto\"\n");
        assert_eq!((e.key.as_str(), e.line), ("rebalance.mode", 5), "{e}");
        let e = err("[model]\nname = \"m\"\n[rebalance]\nwindow_s = 10\n");
        assert_eq!(e.key, "rebalance", "{e}");
        assert!(e.message.contains("no objective"), "{e}");
        let e = err("[model]\nname = \"m\"\n[rebalance]\nitl_p90_ms = 50\nbudget = 1\n");
        assert_eq!((e.key.as_str(), e.line), ("rebalance.budget", 5), "{e}");
        assert!(e.message.contains("less than the bounds need (2"), "{e}");
        let e = err(
            "[model]\nname = \"m\"\n[rebalance]\nitl_p90_ms = 50\nbudget = 4\ngpu_budget = 4\n",
        );
        assert_eq!((e.key.as_str(), e.line), ("rebalance.gpu_budget", 6), "{e}");
        let e = err("[model]\nname = \"m\"\n[rebalance]\nitl_p90_ms = -3\n");
        assert_eq!((e.key.as_str(), e.line), ("rebalance.itl_p90_ms", 4), "{e}");
    }

    #[test]
    fn the_dashboard_table_is_read_and_its_mistakes_are_located() {
        let t = load_str(
            "[model]\nname = \"m\"\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        assert_eq!(t.spec.dashboard, crate::vocab::Dashboard::default());
        let t = load_str(
            "[model]\nname = \"m\"\n[dashboard]\nbind = \"0.0.0.0\"\nport = 9100\n",
            Source::Profile("t".into()),
            "t".into(),
        )
        .unwrap();
        assert_eq!(
            (t.spec.dashboard.bind.as_str(), t.spec.dashboard.port),
            ("0.0.0.0", 9100)
        );
        let e = err("[model]\nname = \"m\"\n[dashboard]\nprot = 9100\n");
        assert_eq!((e.key.as_str(), e.line), ("dashboard.prot", 4), "{e}");
        assert_eq!(e.hint.as_deref(), Some("did you mean `port`?"));
        let e = err("[model]\nname = \"m\"\n[dashboard]\nbind = \"localhost\"\n");
        assert_eq!((e.key.as_str(), e.line), ("dashboard.bind", 4), "{e}");
        assert!(e.message.contains("not an IP address"), "{e}");
        let e = err("[model]\nname = \"m\"\n[dashboard]\nport = 8000\n");
        assert_eq!((e.key.as_str(), e.line), ("dashboard.port", 4), "{e}");
        assert!(e.message.contains("also proxy.port"), "{e}");
    }
}
