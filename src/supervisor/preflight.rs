//! Pre-flight: every reason `up` would fail, found before anything is spawned and
//! reported all at once (exit 2) — programs, ports, GPUs, writable directories. It asks
//! nothing again that `plan::resolve` found: the programs it missed and its GPU inventory
//! come in as arguments.

use crate::plan::Plan;
use crate::plan::resolve::Machine;
use crate::supervisor::state_dir::state::{MAX_SOCKET_PATH, StateDir};
use crate::tools::MissingProgram;
use crate::vocab::Check;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;

/// `  - problem` lines.
pub fn bullet_list(problems: &[String]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Checks `plan` for node `node`, whose programs resolve already looked for (`missing` is
/// what it did not find) and whose GPUs `machine` holds (NVML is asked at most once per
/// command, shared with planning). Returns every problem found; empty means go.
pub fn check(
    plan: &Plan,
    node: &str,
    missing: &[MissingProgram],
    machine: &Machine,
    state: &StateDir,
) -> Vec<String> {
    let mut problems = Vec::new();
    check_programs(plan, node, missing, &mut problems);
    check_dependencies(plan, &mut problems);
    check_signals(plan, node, &mut problems);
    check_ports(plan, node, &mut problems);
    check_gpus(plan, node, machine, &mut problems);
    check_dirs(plan, node, &mut problems);
    check_requirements(plan, node, &mut problems);
    check_pairs(plan, &mut problems);
    let sock = state.socket_path();
    if sock.as_os_str().len() > MAX_SOCKET_PATH {
        problems.push(format!(
            "the control socket path {} is longer than {MAX_SOCKET_PATH} bytes, the limit of \
             a Unix socket: use a shorter --state-dir",
            sock.display()
        ));
    }
    problems
}

/// Checks only the services `added` of `plan` on node `node`, before `pdctl scale` or
/// `apply` starts them in a running cluster: their programs, ports, GPUs, directories and
/// Python modules (the shared services and the state dir were checked at `up`).
pub fn check_added(
    plan: &Plan,
    added: &[String],
    node: &str,
    missing: &[MissingProgram],
    machine: &Machine,
) -> Vec<String> {
    let mut sub = plan.clone();
    sub.services.retain(|s| added.contains(&s.name));
    if sub.services.is_empty() {
        return Vec::new();
    }
    let missing: Vec<MissingProgram> = missing
        .iter()
        .filter(|m| added.contains(&m.service))
        .cloned()
        .collect();
    let mut problems = Vec::new();
    check_programs(&sub, node, &missing, &mut problems);
    check_signals(&sub, node, &mut problems);
    check_ports(&sub, node, &mut problems);
    check_gpus(&sub, node, machine, &mut problems);
    check_dirs(&sub, node, &mut problems);
    check_requirements(&sub, node, &mut problems);
    problems
}

/// Prefill/decode pairs that cannot hand KV over (another model, another block size,
/// tensor-parallel sizes the connector cannot bridge), each named with both sides; what
/// the connector may bridge is left to `pdctl check`.
fn check_pairs(plan: &Plan, problems: &mut Vec<String>) {
    for m in crate::plan::pairs::mismatches(plan) {
        if m.fatal {
            problems.push(m.to_string());
        }
    }
}

fn check_programs(plan: &Plan, node: &str, missing: &[MissingProgram], problems: &mut Vec<String>) {
    for svc in plan.local_services(node) {
        if svc.argv.is_empty() {
            problems.push(format!("{}: the plan gives no command to run", svc.name));
        }
        for m in missing.iter().filter(|m| m.service == svc.name) {
            problems.push(m.to_string());
        }
    }
}

/// The plan's own checks (a model's files, Python packages), each asked once however many
/// services need it, and reported with the services that need it.
fn check_requirements(plan: &Plan, node: &str, problems: &mut Vec<String>) {
    let mut needed: Vec<(&Check, Vec<&str>)> = Vec::new();
    for svc in plan.local_services(node) {
        for c in &svc.checks {
            match needed.iter_mut().find(|(k, _)| *k == c) {
                Some((_, who)) => who.push(&svc.name),
                None => needed.push((c, vec![&svc.name])),
            }
        }
    }
    for (check, who) in needed {
        let who = who.join(", ");
        match check {
            Check::FileExists { path, fix } => {
                if !path.is_file() {
                    problems.push(format!("{who}: {} does not exist; {fix}", path.display()));
                }
            }
            Check::PythonModule {
                python,
                module,
                fix,
            } => {
                if let Err(why) = python_finds(python, module) {
                    problems.push(format!(
                        "{who}: `{python}` cannot import {module} ({why}); {fix}"
                    ));
                }
            }
        }
    }
}

/// Why a python cannot import a module, worded for the line preflight prints.
#[derive(Debug, thiserror::Error)]
enum PythonMissing {
    /// The interpreter itself is not on PATH.
    #[error("not found")]
    NoPython,
    /// The interpreter could not be started.
    #[error("{0}")]
    Spawn(std::io::Error),
    /// `find_spec` found nothing.
    #[error("no module named '{0}'")]
    NoModule(String),
    /// The interpreter failed otherwise: its last line of stderr.
    #[error("{0}")]
    Failed(String),
}

/// Whether `python` finds `module`, without importing it (importing vllm takes seconds).
fn python_finds(python: &str, module: &str) -> Result<(), PythonMissing> {
    let program = crate::tools::find_program(python).ok_or(PythonMissing::NoPython)?;
    let out = std::process::Command::new(program)
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)",
            module,
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(PythonMissing::Spawn)?;
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) => Err(PythonMissing::NoModule(module.to_string())),
        _ => Err(PythonMissing::Failed(
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("it failed")
                .trim()
                .to_string(),
        )),
    }
}

fn check_dependencies(plan: &Plan, problems: &mut Vec<String>) {
    for svc in &plan.services {
        for dep in svc.depends_on.iter().chain(&svc.restart_with) {
            if plan.service(dep).is_none() {
                problems.push(format!(
                    "{} names `{dep}` (depends_on / restart_with), which is not in the plan",
                    svc.name
                ));
            }
        }
    }
}

fn check_signals(plan: &Plan, node: &str, problems: &mut Vec<String>) {
    for svc in plan.local_services(node) {
        if crate::supervisor::run::stop::parse_signal(&svc.shutdown.signal).is_none() {
            problems.push(format!(
                "{}: unknown shutdown signal {:?} (use a name like SIGTERM or SIGINT)",
                svc.name, svc.shutdown.signal
            ));
        }
    }
}

fn check_ports(plan: &Plan, node: &str, problems: &mut Vec<String>) {
    let mut owners: BTreeMap<(String, u16), String> = BTreeMap::new();
    for svc in plan.local_services(node) {
        for (label, &port) in &svc.ports {
            let who = format!("{} ({label})", svc.name);
            if let Some(first) = owners.insert((svc.host.clone(), port), who.clone()) {
                problems.push(format!(
                    "port {port} on {} is planned twice: {first} and {who}",
                    svc.host
                ));
                continue;
            }
            if let Err(e) = TcpListener::bind((svc.host.as_str(), port)) {
                problems.push(port_problem(&svc.name, label, &svc.host, port, &e, node));
            }
        }
    }
}

fn port_problem(
    service: &str,
    label: &str,
    host: &str,
    port: u16,
    e: &std::io::Error,
    node: &str,
) -> String {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "{service}: port {port} ({label}) on {host} is already in use; stop what holds it \
             (`ss -ltnp 'sport = :{port}'` shows it) or choose another port in the topology"
        ),
        std::io::ErrorKind::AddrNotAvailable => format!(
            "{service}: cannot listen on {host}:{port}: {host} is not an address of this \
             machine; is this machine really node `{node}`? (use --node to pick the node)"
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "{service}: port {port} ({label}) on {host} needs privileges; choose a port above 1023"
        ),
        _ => format!("{service}: cannot listen on {host}:{port} ({label}): {e}"),
    }
}

fn check_gpus(plan: &Plan, node: &str, machine: &Machine, problems: &mut Vec<String>) {
    let needed: BTreeMap<u32, &str> = plan
        .local_services(node)
        .flat_map(|s| s.gpus.iter().map(move |g| (*g, s.name.as_str())))
        .collect();
    if needed.is_empty() {
        return;
    }
    match machine.gpus() {
        Err(e) => problems.push(format!(
            "the plan needs GPU(s) {} on node {node}, but {e}",
            needed
                .keys()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )),
        Ok(inv) => {
            for short in crate::plan::gpu_fit::check(plan.local_services(node), inv) {
                problems.push(format!(
                    "{short}: free that GPU, lower engine.gpu_memory_utilization, or set engine.kv_cache_memory"
                ));
            }
            let have: Vec<u32> = inv.iter().map(|g| g.index).collect();
            for (gpu, who) in &needed {
                if !have.contains(gpu) {
                    problems.push(format!(
                        "{who} needs GPU {gpu}, which this machine does not have (GPUs here: {})",
                        if have.is_empty() {
                            "none".to_string()
                        } else {
                            have.iter()
                                .map(|g| g.to_string())
                                .collect::<Vec<_>>()
                                .join(",")
                        }
                    ));
                }
            }
        }
    }
}

fn check_dirs(plan: &Plan, node: &str, problems: &mut Vec<String>) {
    for svc in plan.local_services(node) {
        let file_dirs = svc.files.iter().filter_map(|f| f.path.parent());
        for dir in svc.dirs.iter().map(|d| d.as_path()).chain(file_dirs) {
            if let Err(why) = writable_dir(dir) {
                problems.push(format!("{}: directory {}: {why}", svc.name, dir.display()));
            }
        }
    }
}

/// Why a directory a service needs cannot be used, worded to follow "directory DIR: ".
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// `create_dir_all` failed.
    #[error("cannot be created ({0})")]
    Create(std::io::Error),
    /// The directory exists but a file cannot be written in it.
    #[error("is not writable ({0}); fix its permissions or choose another")]
    NotWritable(std::io::Error),
}

/// Creates `dir` if needed and proves it writable by creating and removing a file.
pub fn writable_dir(dir: &Path) -> Result<(), DirError> {
    std::fs::create_dir_all(dir).map_err(DirError::Create)?;
    let probe = dir.join(format!(".pdctl-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(DirError::NotWritable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::testing;
    use crate::vocab::Service;

    fn svc(name: &str, argv0: &str, port: u16) -> Service {
        Service {
            role: crate::vocab::Role::Decode,
            argv: vec![argv0.into()],
            ..testing::tcp_service(name, "main", port)
        }
    }

    fn plan(services: Vec<Service>) -> Plan {
        testing::plan("main", services)
    }

    #[test]
    fn all_problems_are_reported_together() {
        let busy = TcpListener::bind("127.0.0.1:0").unwrap();
        let busy_port = busy.local_addr().unwrap().port();
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let free_port = free.local_addr().unwrap().port();
        drop(free);
        let mut bad_gpu = svc("d1", "sh", free_port);
        bad_gpu.gpus = vec![7];
        bad_gpu.depends_on = vec!["ghost".into()];
        bad_gpu.dirs = vec!["/proc/pdctl-cannot-create".into()];
        let mut p = plan(vec![svc("d0", "no-such-program-pdctl", busy_port), bad_gpu]);
        let state = StateDir::new("/tmp/pdctl-preflight-unit");
        let missing = crate::plan::resolve::resolve_programs(&mut p);
        let machine = Machine::new(Some(vec![0.into(), 1.into()]));
        let problems = check(&p, "main", &missing, &machine, &state);
        let text = problems.join("\n");
        assert_eq!(problems.len(), 5, "{text}");
        assert!(
            text.contains("program `no-such-program-pdctl` not found"),
            "{text}"
        );
        assert!(text.contains(&format!(
            "port {busy_port} (http) on 127.0.0.1 is already in use"
        )));
        assert!(text.contains("d1 needs GPU 7, which this machine does not have (GPUs here: 0,1)"));
        assert!(text.contains("`ghost`"));
        assert!(text.contains("/proc/pdctl-cannot-create: cannot be created"));
        // The program that was found is now a full path.
        assert!(p.services[1].argv[0].starts_with('/'));
    }

    #[test]
    fn a_port_planned_twice_and_a_foreign_address_are_named() {
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let mut other_host = svc("e", "sh", port + 1);
        other_host.host = "192.0.2.1".into();
        let mut p = plan(vec![svc("a", "sh", port), svc("b", "sh", port), other_host]);
        let missing = crate::plan::resolve::resolve_programs(&mut p);
        let machine = Machine::new(None);
        let problems = check(&p, "main", &missing, &machine, &StateDir::new("/tmp/x"));
        let text = problems.join("\n");
        assert!(
            text.contains(&format!(
                "port {port} on 127.0.0.1 is planned twice: a (http) and b (http)"
            )),
            "{text}"
        );
        assert!(
            text.contains("192.0.2.1 is not an address of this machine"),
            "{text}"
        );
        assert_eq!(problems.len(), 2, "{text}");
    }
}
