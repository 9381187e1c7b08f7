//! A plan the way a person reviews it before spending GPU time: per service the command a
//! shell would run (env included), GPUs, ports, readiness probe, dependencies and each
//! generated file.

use super::Plan;
use crate::vocab::{Probe, RestartMode, Service};
use std::fmt::Write;

/// Quotes `s` for a POSIX shell when it needs it (shlex's quoting; a word holding a NUL,
/// which no shell word can, is shown escaped).
pub fn shell_quote(s: &str) -> String {
    shlex::try_quote(s)
        .map(|q| q.into_owned())
        .unwrap_or_else(|_| s.escape_debug().to_string())
}

/// How the printed command sets a variable the supervisor fills with the cluster's
/// engine key: from the running cluster, never the key itself.
pub const ENGINE_KEY_FROM: &str = "\"$(pdctl secret --engine-key)\"";

/// How the printed command sets a variable whose value the topology keeps secret (a hub
/// token, `Service::hidden_env`): from the shell's own, never the value.
pub fn hidden_env_from(var: &str) -> String {
    format!("\"${var}\"")
}

/// The service's command as a copy-pasteable shell command: env (a variable the engine
/// key fills shown as read from `pdctl secret --engine-key`, a secret the topology sets as
/// read from the shell's environment), program, then one flag (with its values) per line.
pub fn shell_command(svc: &Service) -> String {
    let mut lines: Vec<String> = Vec::new();
    let has_env = !svc.env.is_empty() || !svc.secret_env.is_empty() || !svc.hidden_env.is_empty();
    if has_env {
        let mut env: Vec<String> = svc
            .env
            .iter()
            .filter(|(k, _)| !svc.secret_env.contains(k))
            .map(|(k, v)| format!("{k}={}", shell_quote(v)))
            .collect();
        env.extend(
            svc.secret_env
                .iter()
                .map(|k| format!("{k}={ENGINE_KEY_FROM}")),
        );
        env.extend(
            svc.hidden_env
                .iter()
                .map(|k| format!("{k}={}", hidden_env_from(k))),
        );
        lines.push(env.join(" "));
    }
    let mut current = String::new();
    for (i, arg) in svc.argv.iter().enumerate() {
        let starts_flag = arg.starts_with("--") && i > 0;
        if starts_flag && !current.is_empty() {
            lines.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(&shell_quote(arg));
    }
    if !current.is_empty() {
        lines.push(current);
    }
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let indent = if i >= 2 || (i == 1 && !has_env) {
            "  "
        } else {
            ""
        };
        out.push_str(indent);
        out.push_str(l);
        if i + 1 < lines.len() {
            out.push_str(" \\\n");
        }
    }
    out
}

/// One line describing a probe.
pub fn describe_probe(p: &Probe) -> String {
    match p {
        Probe::Http {
            url,
            status,
            body_contains,
        } => match body_contains {
            Some(b) => format!("GET {url} -> {status} containing {b:?}"),
            None => format!("GET {url} -> {status}"),
        },
        Probe::Tcp { host, port } => format!("TCP connect {host}:{port}"),
        Probe::LogLine { contains } => format!("log line containing {contains:?}"),
    }
}

/// One service of the plan, numbered `n`: where it runs, what it waits for and needs, how
/// its readiness is probed and it is restarted, its command and its files.
fn render_service(o: &mut String, n: usize, svc: &crate::vocab::Service) {
    let gpus = if svc.gpus.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = svc.gpus.iter().map(u32::to_string).collect();
        match svc.gpu_memory_share {
            Some(share) => format!("  GPU {} ({share} of its memory)", list.join(",")),
            None => format!("  GPU {}", list.join(",")),
        }
    };
    let _ = writeln!(
        o,
        "{}. {}  on {} ({}){gpus}",
        n, svc.name, svc.node, svc.host
    );
    if !svc.depends_on.is_empty() {
        let _ = writeln!(o, "   after    {}", svc.depends_on.join(", "));
    }
    if let Some(note) = &svc.gpu_memory_note {
        let _ = writeln!(o, "   memory   {note}");
    }
    if !svc.ports.is_empty() {
        let ports: Vec<String> = svc.ports.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(o, "   ports    {}", ports.join(", "));
    }
    let _ = writeln!(
        o,
        "   ready    {} (within {} s)",
        describe_probe(&svc.probe),
        svc.startup_timeout_s
    );
    let mode = match svc.restart.mode {
        RestartMode::OnFailure => "on-failure",
        RestartMode::Always => "always",
        RestartMode::Never => "never",
    };
    let with = if svc.restart_with.is_empty() {
        String::new()
    } else {
        format!(", together with {}", svc.restart_with.join(", "))
    };
    let _ = writeln!(o, "   restart  {mode}{with}");
    for c in &svc.checks {
        let what = match c {
            crate::vocab::Check::FileExists { path, .. } => {
                format!("{} exists", path.display())
            }
            crate::vocab::Check::PythonModule { python, module, .. } => {
                format!("{python} can import {module}")
            }
        };
        let _ = writeln!(o, "   needs    {what}");
    }
    for d in &svc.dirs {
        let _ = writeln!(o, "   dir      {} (must be writable)", d.display());
    }
    let _ = writeln!(o, "   command");
    for line in shell_command(svc).lines() {
        let _ = writeln!(o, "     {line}");
    }
    for f in &svc.files {
        let _ = writeln!(o, "   file {}", f.path.display());
        for line in f.content.lines() {
            let _ = writeln!(o, "     {line}");
        }
    }
}

/// The whole plan as text.
pub fn render(plan: &Plan, source_note: &str, missing: &[String]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "cluster {} ({source_note})", plan.cluster);
    let engine = match (&plan.vllm_version, plan.vllm_version_source) {
        (Some(v), Some(crate::vocab::VersionSource::Assumed)) => {
            format!("vllm {v} (assumed: no vLLM found; `up` needs it)")
        }
        (Some(v), Some(crate::vocab::VersionSource::Installed)) => format!("vllm {v} (installed)"),
        (Some(v), _) => format!("vllm {v}"),
        (None, _) => "sim (simulated engines)".to_string(),
    };
    let _ = writeln!(
        o,
        "  engine {engine}, connector {}, proxy protocol {}",
        plan.connector, plan.protocol
    );
    let _ = writeln!(o, "  state dir {}", plan.state_dir.display());
    if let Some(url) = &plan.proxy_url {
        let _ = writeln!(o, "  clients send requests to {url}");
    }
    for (i, svc) in plan.services.iter().enumerate() {
        let _ = writeln!(o);
        render_service(&mut o, i + 1, svc);
    }
    if !plan.warnings.is_empty() || !missing.is_empty() {
        let _ = writeln!(o);
    }
    for w in &plan.warnings {
        let _ = writeln!(o, "warning: {w}");
    }
    for m in missing {
        let _ = writeln!(o, "missing: {m}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_only_what_a_shell_would_split() {
        assert_eq!(shell_quote("--port"), "--port");
        assert_eq!(shell_quote("/a/b.json"), "/a/b.json");
        // What a shell reads back is the word itself, one word.
        for word in [
            r#"{"kv_role":"kv_producer"}"#,
            "it's",
            "",
            "a b",
            "$HOME",
            "x;y",
        ] {
            let quoted = shell_quote(word);
            assert_ne!(quoted, word, "{word:?} needs quotes");
            assert_eq!(
                shlex::split(&quoted),
                Some(vec![word.to_string()]),
                "{quoted}"
            );
        }
    }
}
