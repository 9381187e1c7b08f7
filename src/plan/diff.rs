//! What differs between the plan a cluster runs and the plan of a changed topology, as the
//! short list `pdctl apply` prints and then carries out.
//!
//! It compares plans, not topologies, so a change is judged by what would really run
//! differently (an edited comment or a default spelled out changes nothing). Instances
//! added or removed, an engine's command, environment, files, GPUs or ports changed, and
//! the proxy's settings changed can all be done while serving; a change to what every
//! instance shares (the engine kind, the connector and its protocol, the model, the node
//! layout, etcd / mooncake_master / the LMCache server) cannot, and is refused with the
//! reason unless the cluster is recreated.

use super::Plan;
use crate::child_config::ChildSettings;
use crate::child_config::proxy;
use crate::vocab::{GeneratedFile, Role, Service};
use std::collections::BTreeSet;

/// What turning `running` into `wanted` takes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlanDiff {
    /// Changes that cannot be made to a running cluster, one sentence each.
    pub refused: Vec<String>,
    /// Instances to start, in plan order.
    pub added: Vec<String>,
    /// Instances to drain and stop, highest-numbered first.
    pub removed: Vec<String>,
    /// Instances to restart one at a time with their new settings, with what changed.
    pub rolled: Vec<(String, Vec<String>)>,
    /// What changed in the proxy's command: its instance lists, which a running proxy
    /// takes from the supervisor, and maybe its settings (see the next two).
    pub proxy: Vec<String>,
    /// Settings the running proxy takes in place (policies, limits, timeouts), as
    /// `--flag old -> new`.
    pub proxy_live: Vec<String>,
    /// What changed that the proxy takes only when it restarts (its address, protocol,
    /// environment...), by flag or kind.
    pub proxy_restart: Vec<String>,
    /// How the `[rebalance]` table changes (added, removed, the keys changed), when it
    /// does. Not a change to what runs (so [`PlanDiff::is_empty`] leaves it out): the
    /// head's rebalancer takes the kept table at its next look.
    pub rebalance: Option<String>,
}

impl PlanDiff {
    /// True when the running cluster already is what the file describes.
    pub fn is_empty(&self) -> bool {
        self.refused.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
            && self.rolled.is_empty()
            && self.proxy.is_empty()
            && self.proxy_live.is_empty()
            && self.proxy_restart.is_empty()
    }

    /// The short list a person reads before the change is carried out (`+` start, `-`
    /// drain and stop, `~` roll or reconfigure, `!` refused).
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(self.refused.iter().map(|r| format!("! {r}")));
        out.extend(
            self.added
                .iter()
                .map(|s| format!("+ {s}: start, then join routing")),
        );
        out.extend(
            self.removed
                .iter()
                .map(|s| format!("- {s}: leave routing, drain, stop")),
        );
        for (s, why) in &self.rolled {
            out.push(format!("~ {s}: restart with {}", why.join("; ")));
        }
        if !self.proxy.is_empty() {
            let how = match (self.proxy_live.is_empty(), self.proxy_restart.is_empty()) {
                (_, false) => format!(
                    " (in effect after `pdctl restart proxy`: {})",
                    self.proxy_restart.join(", ")
                ),
                (false, true) => " (in place, no restart)".to_string(),
                (true, true) => String::new(),
            };
            out.push(format!("~ proxy: {}{how}", self.proxy.join("; ")));
        }
        if let Some(how) = &self.rebalance {
            out.push(format!("~ [rebalance]: {how} (taken in place)"));
        }
        out
    }
}

/// How the `[rebalance]` table changes from `running` to `wanted`: `added`, `removed`,
/// or its changed keys as `key old -> new`.
fn rebalance_change(running: &Plan, wanted: &Plan) -> Option<String> {
    let table = |p: &Plan| {
        p.rebalance
            .as_ref()
            .map(|r| serde_json::to_value(&r.table).unwrap_or_default())
    };
    match (table(running), table(wanted)) {
        (None, None) => None,
        (None, Some(_)) => Some("added".into()),
        (Some(_), None) => Some("removed".into()),
        (Some(old), Some(new)) if old == new => None,
        (Some(old), Some(new)) => {
            let shown = |v: Option<&serde_json::Value>| match v {
                None | Some(serde_json::Value::Null) => "-".to_string(),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => match v.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
                    _ => v.to_string(),
                },
            };
            let keys: BTreeSet<&String> = old
                .as_object()
                .into_iter()
                .chain(new.as_object())
                .flat_map(|o| o.keys())
                .collect();
            let changed: Vec<String> = keys
                .into_iter()
                .filter(|k| old.get(*k) != new.get(*k))
                .map(|k| format!("{k} {} -> {}", shown(old.get(k)), shown(new.get(k))))
                .collect();
            Some(changed.join(", "))
        }
    }
}

/// Compares the running plan with the wanted one.
pub fn diff(running: &Plan, wanted: &Plan) -> PlanDiff {
    let mut d = PlanDiff {
        rebalance: rebalance_change(running, wanted),
        ..PlanDiff::default()
    };
    refuse_shared(running, wanted, &mut d.refused);
    for s in &wanted.services {
        match running.service(&s.name) {
            None if s.role.is_engine() => d.added.push(s.name.clone()),
            None => d.refused.push(format!(
                "{} would be added: only prefill and decode instances can be added to a running cluster",
                s.name
            )),
            Some(old) if s.role == Role::Proxy => {
                let typed = typed(running, wanted, &s.name);
                d.proxy = changes(old, s, typed);
                (d.proxy_live, d.proxy_restart) = proxy_changes(old, s, typed);
            }
            Some(old) if s.role.is_engine() => {
                let why = changes(old, s, typed(running, wanted, &s.name));
                if !why.is_empty() {
                    d.rolled.push((s.name.clone(), why));
                }
            }
            Some(old) => {
                let why = changes(old, s, typed(running, wanted, &s.name));
                if !why.is_empty() {
                    d.refused.push(format!(
                        "{} would change ({}): every instance depends on it",
                        s.name,
                        why.join("; ")
                    ));
                }
            }
        }
    }
    let mut removed: Vec<&Service> = running
        .services
        .iter()
        .filter(|s| wanted.service(&s.name).is_none())
        .collect();
    removed.sort_by_key(|s| std::cmp::Reverse(instance_number(&s.name)));
    for s in removed {
        if s.role.is_engine() {
            d.removed.push(s.name.clone());
        } else {
            d.refused.push(format!(
                "{} would be removed: only prefill and decode instances can be removed from a running cluster",
                s.name
            ));
        }
    }
    d
}

/// The typed settings of service `name` in both plans, when pdctl runs it as itself in
/// both: compared as values.
fn typed<'a>(
    running: &'a Plan,
    wanted: &'a Plan,
    name: &str,
) -> Option<(&'a ChildSettings, &'a ChildSettings)> {
    Some((running.settings_of(name)?, wanted.settings_of(name)?))
}

/// The plan-wide settings every instance shares.
fn refuse_shared(running: &Plan, wanted: &Plan, refused: &mut Vec<String>) {
    let mut same = |what: &str, old: String, new: String| {
        if old != new {
            refused.push(format!(
                "{what} would change from {old} to {new}: every instance would have to restart at once"
            ));
        }
    };
    same(
        "the cluster name",
        running.cluster.clone(),
        wanted.cluster.clone(),
    );
    same("the engine", running.engine.clone(), wanted.engine.clone());
    same(
        "the connector",
        running.connector.clone(),
        wanted.connector.clone(),
    );
    same(
        "the proxy protocol",
        running.protocol.clone(),
        wanted.protocol.clone(),
    );
    same(
        "the vLLM version",
        format!("{:?}", running.vllm_version),
        format!("{:?}", wanted.vllm_version),
    );
    same(
        "the node layout",
        format!("{:?} (head {})", running.nodes, running.head_node),
        format!("{:?} (head {})", wanted.nodes, wanted.head_node),
    );
    let models = |p: &Plan| -> BTreeSet<String> {
        p.services
            .iter()
            .filter(|s| s.role.is_engine())
            .filter_map(|s| model_of(s, p.settings_of(&s.name)))
            .collect()
    };
    let (old, new) = (models(running), models(wanted));
    if !old.is_empty() && !new.is_empty() && old != new {
        same("the model", join(&old), join(&new));
    }
}

fn join(set: &BTreeSet<String>) -> String {
    set.iter().cloned().collect::<Vec<_>>().join(", ")
}

/// The model an engine serves: a simulated engine's `model` (its typed settings), or
/// `vllm serve MODEL` / `--model MODEL`.
fn model_of(s: &Service, settings: Option<&ChildSettings>) -> Option<String> {
    if let Some(sim) = settings.and_then(ChildSettings::sim) {
        return Some(sim.model.clone());
    }
    let argv = &s.argv;
    let after = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .and_then(|i| argv.get(i + 1))
            .cloned()
    };
    after("--model").or_else(|| after("serve").filter(|m| !m.starts_with('-')))
}

/// How the proxy's change is taken: (settings it changes in place, what waits for its
/// restart), from its typed settings. Its instance lists are neither: it follows the
/// supervisor's services.
fn proxy_changes(
    old: &Service,
    new: &Service,
    typed: Option<(&ChildSettings, &ChildSettings)>,
) -> (Vec<String>, Vec<String>) {
    let mut restart = Vec::new();
    if old.env != new.env {
        restart.push("its environment".to_string());
    }
    if other_files(old) != other_files(new) {
        restart.push("its files".to_string());
    }
    match typed.and_then(|(a, b)| Some((a.proxy()?, b.proxy()?))) {
        Some((a, b)) => {
            restart.extend(proxy::restart_only(a, b).into_iter().map(String::from));
            (proxy::live_changes(a, b), restart)
        }
        None => {
            if old.argv != new.argv {
                restart.push("its command".to_string());
            }
            (Vec::new(), restart)
        }
    }
}

/// A service's generated files but the config file its typed settings are written to
/// (`--config FILE` of `pdctl proxy` / `pdctl sim`): those settings are compared as values.
fn other_files(s: &Service) -> Vec<&GeneratedFile> {
    let files = s
        .files
        .iter()
        .map(|f| (f.path.as_path(), f.content.as_str()));
    let own = crate::child_config::config_file(&s.argv, files).map(|(path, _)| path);
    s.files
        .iter()
        .filter(|f| Some(f.path.as_path()) != own)
        .collect()
}

/// The arguments typed settings stand for, as `pdctl proxy` / `pdctl sim` would take them
/// (so a change reads as the setting that changed: `--itl-ms 4` -> `3`).
fn settings_argv(settings: &ChildSettings) -> Vec<String> {
    match settings {
        ChildSettings::Proxy(a) => a.to_argv(),
        ChildSettings::Sim(a) => a.to_argv(),
    }
}

/// What differs between two versions of one service, one phrase per kind of change.
fn changes(
    old: &Service,
    new: &Service,
    typed: Option<(&ChildSettings, &ChildSettings)>,
) -> Vec<String> {
    let mut why = Vec::new();
    let (old_files, new_files): (Vec<GeneratedFile>, Vec<GeneratedFile>) = match typed {
        // pdctl's own processes: their settings as values (the flags on their command line
        // are in them), the program itself, and any other file.
        Some((a, b)) => {
            if old.argv.first() != new.argv.first() {
                why.push(format!(
                    "program {} -> {}",
                    old.argv.first().map_or("", String::as_str),
                    new.argv.first().map_or("", String::as_str)
                ));
            }
            if a != b {
                why.push(format!(
                    "arguments {}",
                    argv_change(&settings_argv(a), &settings_argv(b))
                ));
            }
            let cloned = |s: &Service| other_files(s).into_iter().cloned().collect();
            (cloned(old), cloned(new))
        }
        None => {
            if old.argv != new.argv {
                why.push(format!("arguments {}", argv_change(&old.argv, &new.argv)));
            }
            (old.files.clone(), new.files.clone())
        }
    };
    if old.env != new.env {
        let keys: BTreeSet<&String> = old
            .env
            .iter()
            .chain(new.env.iter())
            .filter(|(k, _)| old.env.get(*k) != new.env.get(*k))
            .map(|(k, _)| k)
            .collect();
        let keys: Vec<&str> = keys.into_iter().map(String::as_str).collect();
        why.push(format!("environment {}", keys.join(", ")));
    }
    if old.gpus != new.gpus {
        why.push(format!("GPUs {:?} -> {:?}", old.gpus, new.gpus));
    }
    if old.ports != new.ports {
        why.push(format!("ports {:?} -> {:?}", old.ports, new.ports));
    }
    if old_files != new_files {
        why.extend(file_changes(&old_files, &new_files));
    }
    if old.node != new.node {
        why.push(format!("node {} -> {}", old.node, new.node));
    }
    why
}

/// One phrase per generated file that differs: "generated file proxy.toml without
/// `retries = 2`, with `retries = 5`" (lines only the old file had, then the new one's;
/// each setting of pdctl's own config files is one line), or that it is new or gone.
fn file_changes(old: &[GeneratedFile], new: &[GeneratedFile]) -> Vec<String> {
    let name = |f: &GeneratedFile| {
        f.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| f.path.display().to_string())
    };
    let mut out = Vec::new();
    for f in new {
        match old.iter().find(|o| o.path == f.path) {
            Some(o) if o.content == f.content => {}
            Some(o) => {
                let lines = |t: &str| -> Vec<String> { t.lines().map(str::to_string).collect() };
                out.push(format!(
                    "generated file {} {}",
                    name(f),
                    list_change(&lines(&o.content), &lines(&f.content))
                ));
            }
            None => out.push(format!("generated file {} added", f.path.display())),
        }
    }
    for o in old.iter().filter(|o| !new.iter().any(|f| f.path == o.path)) {
        out.push(format!("generated file {} removed", o.path.display()));
    }
    out
}

/// "without `--a 1`, with `--a 2`": the arguments only the old command had, then those only the new one has
/// (a flag and its value counted together).
fn argv_change(old: &[String], new: &[String]) -> String {
    let pairs = |argv: &[String]| -> Vec<String> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < argv.len() {
            let a = &argv[i];
            match argv.get(i + 1) {
                Some(v) if a.starts_with("--") && !a.contains('=') && !v.starts_with("--") => {
                    out.push(format!("{a} {v}"));
                    i += 2;
                }
                _ => {
                    out.push(a.clone());
                    i += 1;
                }
            }
        }
        out
    };
    list_change(&pairs(old), &pairs(new))
}

/// "without `a`, with `b`": the items only `o` has, then those only `n` has.
fn list_change(o: &[String], n: &[String]) -> String {
    let mut parts: Vec<String> = o
        .iter()
        .filter(|a| !n.contains(a))
        .map(|a| format!("without `{a}`"))
        .collect();
    parts.extend(
        n.iter()
            .filter(|a| !o.contains(a))
            .map(|a| format!("with `{a}`")),
    );
    if parts.is_empty() {
        "reordered".into()
    } else {
        parts.join(", ")
    }
}

/// The number in `decode-3`, for removing the highest-numbered instances first.
fn instance_number(name: &str) -> u32 {
    name.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::child_config::proxy::ProxyArgs;
    use std::collections::BTreeMap;

    fn service(name: &str, role: Role, argv: &[&str]) -> Service {
        Service::new(name, role, "local", argv.iter().copied())
    }

    fn plan(decodes: u32, decode_args: &[&str]) -> Plan {
        let mut services = vec![
            service("etcd", Role::Etcd, &["etcd"]),
            service("prefill-0", Role::Prefill, &["vllm", "serve", "m1"]),
        ];
        for i in 0..decodes {
            let mut argv = vec!["vllm", "serve", "m1"];
            argv.extend_from_slice(decode_args);
            services.push(service(&format!("decode-{i}"), Role::Decode, &argv));
        }
        services.push(service(
            "proxy",
            Role::Proxy,
            &["pdctl", "proxy", "--config", "/state/c/files/proxy.toml"],
        ));
        let proxy = ProxyArgs {
            prefill: vec!["h:1".into()],
            decode: vec!["h:2".into()],
            ..ProxyArgs::default()
        };
        Plan {
            nodes: BTreeMap::from([("local".into(), "127.0.0.1".into())]),
            vllm_version: Some("0.11.0".into()),
            settings: BTreeMap::from([("proxy".into(), ChildSettings::Proxy(Box::new(proxy)))]),
            ..Plan::for_tests("local", services)
        }
    }

    /// The proxy's typed settings in a test plan, to change.
    fn proxy_args(p: &mut Plan) -> &mut ProxyArgs {
        match p.settings.get_mut("proxy") {
            Some(ChildSettings::Proxy(a)) => a,
            other => panic!("no proxy settings: {other:?}"),
        }
    }

    #[test]
    fn the_same_plan_needs_nothing() {
        let p = plan(4, &[]);
        assert!(diff(&p, &p).is_empty());
        assert!(diff(&p, &p).lines().is_empty());
    }

    #[test]
    fn scaling_down_removes_the_highest_numbered_first_and_up_adds_in_order() {
        let d = diff(&plan(4, &[]), &plan(2, &[]));
        assert_eq!(d.removed, ["decode-3", "decode-2"]);
        assert!(d.added.is_empty() && d.refused.is_empty() && d.rolled.is_empty());
        let d = diff(&plan(2, &[]), &plan(4, &[]));
        assert_eq!(d.added, ["decode-2", "decode-3"]);
        assert_eq!(
            d.lines(),
            [
                "+ decode-2: start, then join routing",
                "+ decode-3: start, then join routing"
            ]
        );
    }

    #[test]
    fn a_changed_decode_flag_rolls_every_decode_and_says_which_flag() {
        let d = diff(
            &plan(2, &["--max-num-seqs", "128"]),
            &plan(2, &["--max-num-seqs", "256"]),
        );
        assert!(d.refused.is_empty());
        let names: Vec<&str> = d.rolled.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(names, ["decode-0", "decode-1"]);
        assert_eq!(
            d.rolled[0].1,
            ["arguments without `--max-num-seqs 128`, with `--max-num-seqs 256`"]
        );
    }

    #[test]
    fn what_every_instance_shares_is_refused_with_the_reason() {
        let old = plan(2, &[]);
        let mut new = plan(2, &[]);
        new.connector = "mooncake".into();
        for s in new.services.iter_mut().filter(|s| s.role.is_engine()) {
            s.argv[2] = "m2".into();
        }
        new.services[0].argv.push("--quota".into());
        let d = diff(&old, &new);
        let said = d.refused.join("\n");
        assert!(
            said.contains("the connector would change from nixl to mooncake"),
            "{said}"
        );
        assert!(
            said.contains("the model would change from m1 to m2"),
            "{said}"
        );
        assert!(
            said.contains("etcd would change (arguments with `--quota`)"),
            "{said}"
        );
        assert!(
            d.lines()
                .iter()
                .all(|l| !l.starts_with("! ") || said.contains(&l[2..]))
        );
    }

    fn real_plan(prefill: u32, decode: u32, extra: &str) -> Plan {
        use crate::gpu::Gpu;
        use crate::plan::{PlanInput, build_plan};
        use crate::topology::{Source, load_str};
        let text = format!(
            "[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.11.0\"\n[connector]\nkind = \"nixl\"\n\
             [prefill]\ninstances = {prefill}\n[decode]\ninstances = {decode}\n{extra}"
        );
        let t = load_str(&text, Source::Profile("t".into()), "t.toml".into()).unwrap();
        let gpus: Vec<Gpu> = (0..8).map(Gpu::declared).collect();
        build_plan(&PlanInput {
            topology: &t.spec,
            head: &t.head,
            gpus: &gpus,
            gpu_note: None,
            model: Err("not read in this test".into()),
            version: Some("0.11.0".parse().unwrap()),
            version_source: crate::vocab::VersionSource::Pinned,
            state_root: "/state".into(),
            local_node: None,
            held: Default::default(),
        })
        .unwrap()
    }

    #[test]
    fn scaling_a_real_plan_leaves_the_other_instances_as_they_are() {
        let d = diff(&real_plan(4, 4, ""), &real_plan(4, 2, ""));
        assert_eq!(d.removed, ["decode-3", "decode-2"]);
        assert!(d.added.is_empty() && d.rolled.is_empty(), "{:?}", d.lines());
        assert!(d.refused.is_empty(), "{:?}", d.refused);
        // The proxy's list of decode instances shrinks, in place.
        assert_eq!(d.proxy.len(), 1, "{:?}", d.proxy);
        assert!(d.proxy_live.is_empty() && d.proxy_restart.is_empty());
        assert!(
            d.proxy[0].starts_with("arguments without `--decode "),
            "{:?}",
            d.proxy
        );
        let d = diff(&real_plan(4, 2, ""), &real_plan(4, 4, ""));
        assert_eq!(d.added, ["decode-2", "decode-3"]);
        assert!(
            d.rolled.is_empty() && d.refused.is_empty(),
            "{:?}",
            d.lines()
        );
    }

    #[test]
    fn proxy_settings_change_in_place() {
        let old = plan(1, &[]);
        let mut new = plan(1, &[]);
        proxy_args(&mut new).decode_policy = Some(crate::vocab::PolicyName::LeastLoaded);
        let d = diff(&old, &new);
        assert_eq!(d.proxy, ["arguments with `--decode-policy least-loaded`"]);
        assert_eq!(
            d.proxy_live,
            ["--decode-policy round-robin -> least-loaded"]
        );
        assert!(d.proxy_restart.is_empty(), "{:?}", d.proxy_restart);
        assert_eq!(
            d.lines(),
            ["~ proxy: arguments with `--decode-policy least-loaded` (in place, no restart)"]
        );
        proxy_args(&mut new).port = 9001;
        let proxy = new.services.last_mut().unwrap();
        proxy.env.insert("RUST_LOG".into(), "debug".into());
        let d = diff(&old, &new);
        assert_eq!(d.proxy_restart, ["its environment", "--port"]);
        assert!(
            d.lines()[0]
                .ends_with("(in effect after `pdctl restart proxy`: its environment, --port)"),
            "{:?}",
            d.lines()
        );
        assert!(d.rolled.is_empty() && d.refused.is_empty());
    }

    #[test]
    fn a_changed_config_file_is_a_change_of_its_service() {
        // The proxy's settings live in its config file: a changed one is a settings change.
        let d = diff(
            &real_plan(1, 1, ""),
            &real_plan(1, 1, "[proxy]\nretries = 5\n"),
        );
        assert_eq!(
            d.proxy,
            ["arguments without `--retries 2`, with `--retries 5`"]
        );
        assert_eq!(d.proxy_live, ["--retries 2 -> 5"]);
        assert!(d.proxy_restart.is_empty(), "{:?}", d.proxy_restart);
        // A simulated engine's config file: its instances roll, the setting named.
        let sim_of = |model: &str, extra: &str| {
            let text = format!(
                "[model]\nname = \"{model}\"\n[engine]\nkind = \"sim\"\n[decode]\ninstances = 2\n{extra}"
            );
            let t = crate::topology::load_str(
                &text,
                crate::topology::Source::Profile("t".into()),
                "t.toml".into(),
            )
            .unwrap();
            crate::plan::build_plan(&crate::plan::PlanInput {
                topology: &t.spec,
                head: &t.head,
                gpus: &[],
                gpu_note: None,
                model: Err("not read in this test".into()),
                version: None,
                version_source: crate::vocab::VersionSource::Pinned,
                state_root: "/state".into(),
                local_node: None,
                held: Default::default(),
            })
            .unwrap()
        };
        let sim = |extra: &str| sim_of("m", extra);
        let d = diff(&sim(""), &sim("[engine.sim]\nitl_ms = 3.0\n"));
        let names: Vec<&str> = d.rolled.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(names, ["prefill-0", "decode-0", "decode-1"]);
        assert_eq!(
            d.rolled[1].1,
            ["arguments without `--itl-ms 10`, with `--itl-ms 3`"]
        );
        // The same from a role's `args` (flags over the file) reads the same way.
        let d = diff(&sim(""), &sim("args = [\"--itl-ms\", \"3\"]\n"));
        let names: Vec<&str> = d.rolled.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(names, ["decode-0", "decode-1"]);
        assert_eq!(
            d.rolled[0].1,
            ["arguments without `--itl-ms 10`, with `--itl-ms 3`"]
        );
        assert!(
            d.refused.is_empty() && d.proxy.is_empty(),
            "{:?}",
            d.lines()
        );
        // The model a sim serves is in its file, and shared by every instance.
        let d = diff(&sim(""), &sim_of("m2", ""));
        assert!(
            d.refused
                .iter()
                .any(|r| r.contains("the model would change from m to m2")),
            "{:?}",
            d.lines()
        );
    }

    #[test]
    fn a_changed_rebalance_table_is_listed_with_its_keys_and_changes_nothing_that_runs() {
        let table = |text: &str| crate::vocab::RebalancePlan {
            table: toml::from_str(text).unwrap(),
            prefill_gpus: 1,
            decode_gpus: 1,
        };
        let mut old = plan(1, &[]);
        old.rebalance = Some(table("ttft_p90_ms = 200\nmode = \"advise\"\n"));
        let mut new = plan(1, &[]);
        new.rebalance = Some(table("ttft_p90_ms = 300\nmode = \"act\"\n"));
        let d = diff(&old, &new);
        assert!(d.is_empty(), "{d:?}");
        assert_eq!(
            d.lines(),
            vec!["~ [rebalance]: mode advise -> act, ttft_p90_ms 200 -> 300 (taken in place)"]
        );
        assert_eq!(diff(&old, &old).rebalance, None);
        new.rebalance = None;
        assert_eq!(diff(&old, &new).rebalance.as_deref(), Some("removed"));
        assert_eq!(diff(&new, &old).rebalance.as_deref(), Some("added"));
    }
}
