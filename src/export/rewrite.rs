//! The values of a plan that are true of one host and not of a pod: bind addresses,
//! addresses of other services, an engine's own address, GPU indices. Each is rewritten
//! the same documented way (listed in `docs/kubernetes.md` and in the header of every
//! export), and anything still naming a host afterwards is reported, never left silently.

use crate::plan::Plan;
use crate::vocab::{Role, Service};
use std::collections::BTreeMap;

/// The bind address every server in a pod listens on.
pub const ANY: &str = "0.0.0.0";

/// Written into a generated file where the pod's own address belongs; an init container
/// replaces it with the pod IP before the engine starts.
pub const POD_IP_MARK: &str = "@POD_IP@";

/// Env var the downward API fills with the pod IP (and `$(POD_IP)` in arguments reads).
pub const POD_IP_ENV: &str = "POD_IP";

/// Env var the downward API fills with the pod name.
pub const POD_NAME_ENV: &str = "POD_NAME";

/// How host-specific spellings become pod ones for one plan.
#[derive(Debug)]
pub struct Rewriter {
    /// `HOST:PORT` of every planned port -> `SERVICE:PORT` of its role's Service, longest
    /// key first (so `10.0.0.1:80` never matches inside `10.0.0.1:8000`).
    endpoints: Vec<(String, String)>,
    /// Every node address the plan uses.
    hosts: Vec<String>,
}

/// Whether `c` may continue a host name or address (so a match ending before it is partial).
fn continues(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
}

/// Replaces whole occurrences of `from` in `text` (not inside a longer address or name).
pub fn replace_whole(text: &str, from: &str, to: &str) -> String {
    if from.is_empty() {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut before: Option<char> = None;
    while let Some(pos) = rest.find(from) {
        let prev = if pos == 0 {
            before
        } else {
            rest[..pos].chars().next_back()
        };
        let next = rest[pos + from.len()..].chars().next();
        let tail_is_port = from.contains(':') && next.is_some_and(|c| c.is_ascii_digit());
        let whole = !continues(prev) && !continues(next) && !tail_is_port;
        out.push_str(&rest[..pos]);
        out.push_str(if whole { to } else { from });
        before = from.chars().next_back();
        rest = &rest[pos + from.len()..];
    }
    out.push_str(rest);
    out
}

/// Whether `text` names `host` as a whole word.
pub fn names_host(text: &str, host: &str) -> bool {
    replace_whole(text, host, "\u{0}") != text
}

/// Flags whose value is an address to listen on: it becomes [`ANY`] (each pod listens on
/// its own IP). Besides vLLM's and etcd's, mooncake_master's bind flags.
pub fn is_bind_flag(flag: &str) -> bool {
    matches!(
        flag,
        "--host" | "--bind" | "--rpc_address" | "--metrics_host" | "--http_metadata_server_host"
    ) || flag.starts_with("--listen-")
}

impl Rewriter {
    /// The rewriter for `plan`, its Services named by `service_name(role)`.
    pub fn new(plan: &Plan, service_name: impl Fn(Role) -> String) -> Rewriter {
        let mut endpoints: BTreeMap<String, String> = BTreeMap::new();
        for svc in &plan.services {
            let first = plan.by_role(svc.role).next().unwrap_or(svc);
            for (name, port) in &svc.ports {
                let pod_port = first.ports.get(name).copied().unwrap_or(*port);
                endpoints.insert(
                    format!("{}:{port}", svc.host),
                    format!("{}:{pod_port}", service_name(svc.role)),
                );
            }
        }
        let mut endpoints: Vec<(String, String)> = endpoints.into_iter().collect();
        endpoints.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let mut hosts: Vec<String> = plan.nodes.values().cloned().collect();
        hosts.extend(plan.services.iter().map(|s| s.host.clone()));
        hosts.sort();
        hosts.dedup();
        Rewriter { endpoints, hosts }
    }

    /// `text` with every planned `HOST:PORT` turned into its Service's `NAME:PORT`.
    pub fn endpoints(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (from, to) in &self.endpoints {
            if out.contains(from.as_str()) {
                out = replace_whole(&out, from, to);
            }
        }
        out
    }

    /// The argv of `svc` as it runs in a pod: the program by name (found on the image's
    /// PATH), bind addresses `0.0.0.0`, other services by Service name.
    pub fn argv(&self, svc: &Service) -> Vec<String> {
        let mut out = Vec::with_capacity(svc.argv.len());
        let Some(program) = svc.argv.first() else {
            return out;
        };
        out.push(program_name(program));
        let mut prev: Option<&str> = None;
        for arg in &svc.argv[1..] {
            let after_flag = prev.filter(|p| p.starts_with("--") && !p.contains('='));
            let rewritten = if after_flag.is_some_and(is_bind_flag) {
                escape_dollar(&bind_value(arg, &svc.host))
            } else if let Some((flag, value)) = arg.split_once('=')
                && flag.starts_with("--")
                && is_bind_flag(flag)
            {
                escape_dollar(&format!("{flag}={}", bind_value(value, &svc.host)))
            } else if arg == &svc.host && after_flag.is_some() {
                // The service's own address as another flag's value is what it tells
                // others to reach it at (`--kv-host`): the pod IP.
                format!("$({POD_IP_ENV})")
            } else if arg == &svc.host {
                // A bare address among the arguments is where the program listens
                // (`lmcache_server HOST PORT`).
                ANY.to_string()
            } else {
                escape_dollar(&self.endpoints(arg))
            };
            prev = Some(arg);
            out.push(rewritten);
        }
        out
    }

    /// Node addresses still named in `text` (what no rule covered).
    pub fn leftover_hosts(&self, text: &str) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|h| names_host(text, h))
            .cloned()
            .collect()
    }
}

/// The program's name without its directory: images put programs elsewhere than this host.
pub fn program_name(program: &str) -> String {
    std::path::Path::new(program)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| program.to_string())
}

/// A listen address: the host's own address becomes [`ANY`], also inside a URL.
/// The address a bind flag listens on, in a pod: the service's own address, and loopback
/// (where the plan keeps what only its own node reaches — in a cluster every role is a pod
/// of its own, reached over the pod network), become [`ANY`].
fn bind_value(value: &str, host: &str) -> String {
    if value == host || value == LOOPBACK {
        ANY.to_string()
    } else {
        replace_whole(&replace_whole(value, host, ANY), LOOPBACK, ANY)
    }
}

/// The loopback address the plan binds what no other node reaches to.
const LOOPBACK: &str = "127.0.0.1";

/// Kubernetes expands `$(NAME)` in command and args; a literal `$(` must be written `$$(`.
pub fn escape_dollar(s: &str) -> String {
    s.replace("$(", "$$(")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_become_any_whether_the_nodes_or_loopback() {
        assert_eq!(bind_value("10.0.0.1", "10.0.0.1"), ANY);
        assert_eq!(bind_value("127.0.0.1", "10.0.0.1"), ANY);
        assert_eq!(
            bind_value("http://127.0.0.1:2379", "10.0.0.1"),
            "http://0.0.0.0:2379"
        );
        assert_eq!(
            bind_value("http://10.0.0.1:2379", "10.0.0.1"),
            "http://0.0.0.0:2379"
        );
    }

    #[test]
    fn only_whole_addresses_are_replaced() {
        assert_eq!(
            replace_whole("http://10.0.0.1:80/x", "10.0.0.1:80", "etcd:80"),
            "http://etcd:80/x"
        );
        assert_eq!(
            replace_whole("http://10.0.0.1:8000", "10.0.0.1:80", "etcd:80"),
            "http://10.0.0.1:8000",
            "a port must not match the start of a longer port"
        );
        assert_eq!(
            replace_whole("110.0.0.1:80", "10.0.0.1:80", "x"),
            "110.0.0.1:80"
        );
        assert!(names_host("lm://127.0.0.1:10080", "127.0.0.1"));
        assert!(!names_host("127.0.0.10", "127.0.0.1"));
    }

    #[test]
    fn programs_lose_their_directory_and_dollars_are_escaped() {
        assert_eq!(
            program_name("/opt/pdctl/venv/bin/mooncake_master"),
            "mooncake_master"
        );
        assert_eq!(program_name("python3"), "python3");
        assert_eq!(escape_dollar("a$(b)"), "a$$(b)");
    }
}
