//! Whether a prefill engine and a decode engine can hand KV to each other, as the plan
//! starts them: the same model, the same KV block size, and tensor-parallel sizes the
//! connector can bridge. Read from each engine's command line (or a simulated engine's
//! generated config), so `up`'s pre-flight refuses a pair that would fail before any GPU
//! time is spent; `pdctl check` asks the running engines the same questions.

use super::{Plan, Role, Service};
use crate::child_config::ChildSettings;
use crate::connectors::Connector;
use crate::connectors::pairing::sizes_that_work;
use crate::topology::{Problem, RoleSection, Topology};
use crate::vocab::Version;
use std::fmt;

/// vLLM's KV block size when `--block-size` is not given (CUDA).
pub const VLLM_DEFAULT_BLOCK_SIZE: u32 = 16;

/// What a KV handoff needs two engines to agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFacts {
    pub name: String,
    pub role: Role,
    /// The model it loads (`--model`, or the positional one after `serve`).
    pub model: Option<String>,
    pub tensor_parallel: u32,
    pub block_size: u32,
    /// Whether the plan sets the block size (`--block-size`; a simulated engine's own):
    /// when it does not, vLLM's platform picks it (16 on CUDA, 128 on the CPU build), so a
    /// running engine's is not compared with `block_size`.
    pub block_size_set: bool,
    /// Its context length (`--max-model-len`; a simulated engine's own), None when vLLM
    /// takes the model's.
    pub max_model_len: Option<u32>,
    /// Its KV cache dtype (`--kv-cache-dtype`, vLLM's `auto` when unset).
    pub kv_cache_dtype: String,
}

/// The facts of one engine service (a simulated one's from its typed `settings`); None
/// for a service that is not an engine.
pub fn engine_facts(svc: &Service, settings: Option<&ChildSettings>) -> Option<EngineFacts> {
    if !svc.role.is_engine() {
        return None;
    }
    if let Some(sim) = settings.and_then(ChildSettings::sim) {
        let sim = sim.clone();
        return Some(EngineFacts {
            name: svc.name.clone(),
            role: svc.role,
            model: Some(sim.model),
            tensor_parallel: 1,
            block_size: sim.model_params.block_size,
            block_size_set: true,
            max_model_len: Some(sim.model_params.max_model_len),
            kv_cache_dtype: "auto".into(),
        });
    }
    let argv = &svc.argv;
    let model = flag(argv, &["--model"]).or_else(|| {
        argv.iter()
            .position(|a| a == "serve")
            .and_then(|i| argv.get(i + 1))
            .filter(|m| !m.starts_with('-'))
            .cloned()
    });
    let number = |names: &[&str], default: u32| {
        flag(argv, names)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Some(EngineFacts {
        name: svc.name.clone(),
        role: svc.role,
        model,
        tensor_parallel: number(&["--tensor-parallel-size", "-tp"], 1),
        block_size: number(&["--block-size"], VLLM_DEFAULT_BLOCK_SIZE),
        block_size_set: flag(argv, &["--block-size"]).is_some(),
        max_model_len: flag(argv, &["--max-model-len"]).and_then(|v| v.parse().ok()),
        kv_cache_dtype: flag(argv, &["--kv-cache-dtype"]).unwrap_or_else(|| "auto".into()),
    })
}

/// The value of the last of `names` on a command line (`--x v` or `--x=v`).
fn flag(argv: &[String], names: &[&str]) -> Option<String> {
    let mut found = None;
    for (i, a) in argv.iter().enumerate() {
        for n in names {
            if a == n {
                found = argv.get(i + 1).cloned();
            } else if let Some(v) = a.strip_prefix(&format!("{n}=")) {
                found = Some(v.to_string());
            }
        }
    }
    found
}

/// One thing a prefill and a decode engine disagree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// `model`, `KV block size`, `tensor-parallel size`, `vLLM version`.
    pub what: &'static str,
    pub prefill: String,
    pub prefill_value: String,
    pub decode: String,
    pub decode_value: String,
    /// False when the connector may bridge it (NIXL with different TP sizes): a warning.
    pub fatal: bool,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} {}) and {} ({} {}) differ in {}: {}",
            self.prefill,
            self.what,
            self.prefill_value,
            self.decode,
            self.what,
            self.decode_value,
            self.what,
            consequence(self.what, self.fatal)
        )
    }
}

fn consequence(what: &str, fatal: bool) -> &'static str {
    match what {
        "model" => "decode cannot use KV computed by another model; serve the same model on both",
        "KV block size" if fatal => {
            "the handoff maps blocks one to one, so it fails or decode recomputes; give both the same --block-size"
        }
        "KV block size" => {
            "NixlConnector splits blocks only where one size is a multiple of the other, in the direction its vLLM version reads (`pdctl plan` checked it); `pdctl check` proves the pair"
        }
        "tensor-parallel size" if fatal => {
            "this connector moves KV between equal tensor-parallel layouts only; give both roles the same gpus_per_instance"
        }
        "tensor-parallel size" => {
            "NIXL (vLLM 0.9.1 on) and Mooncake (0.20 on) bridge sizes that divide one another, as `pdctl plan` checked for the planned version; `pdctl check` proves the pair"
        }
        _ => "the two ends of a handoff must run the same vLLM; install one version for both",
    }
}

/// Compares a prefill's facts with a decode's.
pub fn compare(prefill: &EngineFacts, decode: &EngineFacts, connector: &str) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let mut differ = |what: &'static str, p: String, d: String, fatal: bool| {
        if p != d {
            out.push(Mismatch {
                what,
                prefill: prefill.name.clone(),
                prefill_value: p,
                decode: decode.name.clone(),
                decode_value: d,
                fatal,
            });
        }
    };
    let show = |m: &Option<String>| m.clone().unwrap_or_else(|| "?".into());
    if prefill.model.is_some() && decode.model.is_some() {
        differ("model", show(&prefill.model), show(&decode.model), true);
    }
    // What `pdctl plan` checked against the connector's rules for the planned vLLM
    // ([`check_settings`]) is a warning here: only those connectors map any difference.
    differ(
        "KV block size",
        prefill.block_size.to_string(),
        decode.block_size.to_string(),
        connector != "nixl",
    );
    differ(
        "tensor-parallel size",
        prefill.tensor_parallel.to_string(),
        decode.tensor_parallel.to_string(),
        !matches!(connector, "nixl" | "mooncake"),
    );
    out
}

/// Every prefill/decode pair's mismatches in `plan`, one per kind and pair of values
/// (a 4P4D with one block size each way says so once, not sixteen times).
pub fn mismatches(plan: &Plan) -> Vec<Mismatch> {
    let facts = |role| {
        plan.by_role(role)
            .filter_map(|s| engine_facts(s, plan.settings_of(&s.name)))
            .collect::<Vec<_>>()
    };
    let (prefill, decode) = (facts(Role::Prefill), facts(Role::Decode));
    // Simulated engines map no difference, whatever connector they stand in for.
    let connector = if plan.engine == "vllm" {
        plan.connector.as_str()
    } else {
        ""
    };
    let mut out: Vec<Mismatch> = Vec::new();
    for p in &prefill {
        for d in &decode {
            for m in compare(p, d, connector) {
                let seen = out.iter().any(|o| {
                    o.what == m.what
                        && o.prefill_value == m.prefill_value
                        && o.decode_value == m.decode_value
                });
                if !seen {
                    out.push(m);
                }
            }
        }
    }
    out
}

/// One setting of one role as its vLLM engines get it, and the topology key it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Setting {
    /// None where neither the topology nor the args set it (vLLM's default).
    value: Option<String>,
    key: String,
}

/// The last value of one of `flags` in `engine.args` then `role`'s args (vLLM takes the last
/// one given, and pdctl writes the role's args after the engine's), else `default`.
fn setting(t: &Topology, role: Role, flags: &[&str], default: Setting) -> Setting {
    let role_args = &role_section(t, role).args;
    let mut found = default;
    for (key, args) in [
        ("engine.args".to_string(), &t.engine.args),
        (format!("{role}.args"), role_args),
    ] {
        if let Some(v) = flag(args, flags) {
            found = Setting {
                value: Some(v),
                key: key.clone(),
            };
        }
    }
    found
}

fn role_section(t: &Topology, role: Role) -> &RoleSection {
    if role == Role::Prefill {
        &t.prefill
    } else {
        &t.decode
    }
}

/// A setting read as a size (TP, PP, block size), `default` when unset or not a number.
fn size_of(s: &Setting, default: u32) -> u32 {
    s.value
        .as_deref()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// What no connector maps, compared for equality: (what, vLLM's default when unset, why
/// a difference breaks the pair).
const SAME: [(&str, &str, &str); 5] = [
    (
        "model",
        "",
        "KV computed by one model is meaningless to another",
    ),
    (
        "model revision",
        "the default branch",
        "other weights give other KV, which decode would read without noticing",
    ),
    (
        "dtype",
        "auto",
        "the KV layouts differ (NIXL refuses the handshake, others copy wrong bytes)",
    ),
    (
        "KV cache dtype",
        "auto",
        "the KV layouts differ (NIXL refuses the handshake, others copy wrong bytes)",
    ),
    (
        "context length (max_model_len)",
        "the model's",
        "decode refuses prompts prefill accepted, after the prefill work is done",
    ),
];

/// The settings of `role` a handoff needs the other role to match or map.
struct RoleSide {
    tp: Setting,
    pp: Setting,
    block: Setting,
    /// The settings of [`SAME`], in its order.
    same: Vec<Setting>,
}

impl RoleSide {
    fn of(t: &Topology, role: Role) -> RoleSide {
        let r = role_section(t, role);
        let unset = || Setting {
            value: None,
            key: format!("{role}.args"),
        };
        let tp = setting(
            t,
            role,
            &["--tensor-parallel-size", "-tp"],
            Setting {
                value: Some(r.gpus_per_instance.to_string()),
                key: format!("{role}.gpus_per_instance"),
            },
        );
        let model = Setting {
            value: Some(t.model.name.clone()),
            key: "model.name".into(),
        };
        let context = Setting {
            value: t.model.max_model_len.map(|n| n.to_string()),
            key: "model.max_model_len".into(),
        };
        RoleSide {
            tp,
            pp: setting(t, role, &["--pipeline-parallel-size", "-pp"], unset()),
            block: setting(t, role, &["--block-size"], unset()),
            same: vec![
                setting(t, role, &["--model"], model),
                setting(t, role, &["--revision"], unset()),
                setting(t, role, &["--dtype"], unset()),
                setting(t, role, &["--kv-cache-dtype"], unset()),
                setting(t, role, &["--max-model-len"], context),
            ],
        }
    }
}

/// A refusal naming both roles, the keys that set each side and the setting compared;
/// located at the decode's key (the prefill's when the file writes only that).
fn pair_problem(what: &str, default: &str, (p, d): (&Setting, &Setting), why: String) -> Problem {
    let show = |s: &Setting| match &s.value {
        Some(v) => format!("{what} {v}, from {}", s.key),
        None => format!("{what} {default}, vLLM's default"),
    };
    let (first, other) = if d.key.starts_with("decode.") || !p.key.starts_with("prefill.") {
        (&d.key, &p.key)
    } else {
        (&p.key, &d.key)
    };
    Problem::new(
        first.clone(),
        format!(
            "prefill ({}) and decode ({}) cannot hand KV to each other: {why}",
            show(p),
            show(d)
        ),
    )
    .also(other.clone())
}

/// Refuses a prefill/decode pair that the connector cannot carry KV across on vLLM `v`:
/// tensor-parallel and pipeline-parallel sizes and KV block sizes outside what
/// [`Connector::pairing`] maps, and any difference in what no connector maps ([`SAME`]).
/// Each error names both roles, the keys and what would work.
/// `kv_heads`: the model's KV heads, where its config.json was read.
pub fn check_settings(
    t: &Topology,
    conn: &dyn Connector,
    v: &Version,
    kv_heads: Option<u64>,
) -> Result<(), Problem> {
    let rules = conn.pairing(&t.connector, v);
    let by = |says: &str| format!("{} on vLLM {v} maps {says}", rules.class);
    let (p, d) = (
        RoleSide::of(t, Role::Prefill),
        RoleSide::of(t, Role::Decode),
    );
    let (ptp, dtp) = (size_of(&p.tp, 1), size_of(&d.tp, 1));
    if !rules.tp.allows(ptp, dtp) {
        let decodes = sizes_that_work(rules.tp, ptp, 8.max(ptp), false);
        let prefills = sizes_that_work(rules.tp, dtp, 8.max(dtp), true);
        return Err(
            pair_problem("tensor-parallel size", "1", (&p.tp, &d.tp), by(rules.tp.says())).hint(
                format!(
                    "give decode a tensor-parallel size of {} (decode.gpus_per_instance), or prefill one of {} (prefill.gpus_per_instance)",
                    list(&decodes),
                    list(&prefills)
                ),
            ),
        );
    }
    check_kv_heads(&rules, v, (&p.tp, ptp), (&d.tp, dtp), kv_heads)?;
    let (ppp, dpp) = (size_of(&p.pp, 1), size_of(&d.pp, 1));
    if !rules.pp.allows(ppp, dpp) {
        return Err(
            pair_problem("pipeline-parallel size", "1", (&p.pp, &d.pp), by(rules.pp.says()))
                .hint("remove --pipeline-parallel-size from the role's args (give its GPUs to tensor parallelism instead)"),
        );
    }
    let default = VLLM_DEFAULT_BLOCK_SIZE;
    let (pb, db) = (size_of(&p.block, default), size_of(&d.block, default));
    if !rules.block.allows(pb, db) {
        let what = "KV block size";
        return Err(pair_problem(
            what,
            &default.to_string(),
            (&p.block, &d.block),
            by(rules.block.says()),
        )
        .hint("give both roles the same --block-size, once in engine.args"));
    }
    for (i, (what, default, why)) in SAME.iter().enumerate() {
        let (ps, ds) = (&p.same[i], &d.same[i]);
        if ps.value != ds.value {
            return Err(pair_problem(what, default, (ps, ds), format!("no connector maps a different {what}: {why}"))
                .hint("give both roles the same value: set it once in [model] or engine.args, not in one role's args"));
        }
    }
    Ok(())
}

/// Refuses a larger tensor-parallel size on the side whose heads the connector cannot read
/// replicated ([`crate::connectors::Pairing::larger_within_kv_heads`]) where it exceeds the
/// model's KV heads.
fn check_kv_heads(
    rules: &crate::connectors::Pairing,
    v: &Version,
    (p, ptp): (&Setting, u32),
    (d, dtp): (&Setting, u32),
    kv_heads: Option<u64>,
) -> Result<(), Problem> {
    let (Some(side), Some(heads)) = (rules.larger_within_kv_heads, kv_heads) else {
        return Ok(());
    };
    let (big, small) = if side == Role::Prefill {
        (ptp, dtp)
    } else {
        (dtp, ptp)
    };
    if big <= small || u64::from(big) <= heads {
        return Ok(());
    }
    Err(pair_problem(
        "tensor-parallel size",
        "1",
        (p, d),
        format!(
            "{} on vLLM {v} takes a larger {side} tensor-parallel size only while it does not replicate the model's {heads} KV heads ({side} has {big} ranks)",
            rules.class
        ),
    )
    .hint(format!(
        "give {side} at most {heads} ranks ({side}.gpus_per_instance), or the other role as many as {side}"
    )))
}

/// `1, 2 or 4`.
fn list(xs: &[u32]) -> String {
    let s: Vec<String> = xs.iter().map(u32::to_string).collect();
    match s.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => "none".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(name: &str, role: Role, extra: &[&str]) -> Service {
        let mut argv: Vec<String> = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.extend(["--model".into(), "Qwen/Qwen2.5-7B-Instruct".into()]);
        argv.extend(extra.iter().map(|s| s.to_string()));
        Service::new(name, role, "local", argv)
    }

    #[test]
    fn engine_facts_come_from_the_command_line() {
        let f = engine_facts(
            &vllm(
                "decode-0",
                Role::Decode,
                &["--tensor-parallel-size", "4", "--block-size=32"],
            ),
            None,
        )
        .unwrap();
        assert_eq!(f.model.as_deref(), Some("Qwen/Qwen2.5-7B-Instruct"));
        assert_eq!((f.tensor_parallel, f.block_size), (4, 32));
        let plain = engine_facts(&vllm("prefill-0", Role::Prefill, &[]), None).unwrap();
        assert_eq!((plain.tensor_parallel, plain.block_size), (1, 16));
        let serve = Service::new(
            "prefill-1",
            Role::Prefill,
            "local",
            ["vllm", "serve", "m/x"],
        );
        assert_eq!(
            engine_facts(&serve, None).unwrap().model.as_deref(),
            Some("m/x")
        );
        let proxy = Service::new("proxy", Role::Proxy, "local", ["pdctl"]);
        assert_eq!(engine_facts(&proxy, None), None);
    }

    fn nixl(prefill_tp: u32, decode_tp: u32, mode: &str) -> Topology {
        let text = format!(
            "[model]\nname = \"m\"\n[engine]\nvllm_version = \"0.33.0\"\n[connector]\nkind = \"nixl\"\nnixl_mode = \"{mode}\"\n[prefill]\ngpus_per_instance = {prefill_tp}\n[decode]\ngpus_per_instance = {decode_tp}\n"
        );
        crate::topology::load_str(
            &text,
            crate::topology::Source::Profile("t".into()),
            "t.toml".into(),
        )
        .unwrap()
        .spec
    }

    /// NIXL reads a larger remote TP (prefill in pull mode, decode in push mode) only
    /// while it does not replicate the model's KV heads; unknown heads are not refused.
    #[test]
    fn a_larger_nixl_side_is_held_to_the_models_kv_heads() {
        let conn = crate::connectors::for_kind(crate::topology::ConnectorKind::Nixl);
        let v: Version = "0.33.0".parse().unwrap();
        let pull = nixl(4, 2, "pull");
        let e = check_settings(&pull, conn, &v, Some(2)).unwrap_err();
        assert_eq!(e.key, "decode.gpus_per_instance");
        assert!(
            e.message
                .contains("model's 2 KV heads (prefill has 4 ranks)"),
            "{}",
            e.message
        );
        assert!(e.hint.unwrap().contains("give prefill at most 2 ranks"));
        check_settings(&pull, conn, &v, Some(4)).unwrap();
        check_settings(&pull, conn, &v, None).unwrap();
        // A larger decode reads its heads from one prefill rank: fine in pull mode.
        check_settings(&nixl(2, 4, "pull"), conn, &v, Some(2)).unwrap();
        let push = nixl(2, 4, "push");
        assert!(check_settings(&push, conn, &v, Some(2)).is_err());
        check_settings(&nixl(4, 2, "push"), conn, &v, Some(2)).unwrap();
    }

    /// Block sizes NIXL maps on real vLLM (`pdctl plan` checked the ratio) are a warning
    /// before `up`; between simulated engines, which map nothing, they stay a refusal.
    #[test]
    fn only_real_engines_get_what_their_connector_maps() {
        let services = vec![
            vllm("prefill-0", Role::Prefill, &[]),
            vllm("decode-0", Role::Decode, &["--block-size", "32"]),
        ];
        let real = Plan::for_tests("local", services);
        let got = mismatches(&real);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(!got[0].fatal, "{}", got[0]);
        let sim = Plan {
            engine: "sim".into(),
            ..real
        };
        assert!(mismatches(&sim)[0].fatal);
    }

    #[test]
    fn mismatches_name_both_sides_and_say_what_to_do() {
        let p = engine_facts(&vllm("prefill-0", Role::Prefill, &[]), None).unwrap();
        let d = engine_facts(
            &vllm(
                "decode-0",
                Role::Decode,
                &["--tensor-parallel-size", "4", "--block-size", "32"],
            ),
            None,
        )
        .unwrap();
        let got = compare(&p, &d, "example");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            got[0].to_string(),
            "prefill-0 (KV block size 16) and decode-0 (KV block size 32) differ in KV block size: \
             the handoff maps blocks one to one, so it fails or decode recomputes; give both the same --block-size"
        );
        assert!(got[1].fatal && got[1].to_string().contains("gpus_per_instance"));
        // NIXL may bridge different TP sizes: a warning, not a refusal.
        let nixl = compare(&p, &d, "nixl");
        assert!(!nixl[1].fatal && nixl[1].to_string().contains("pdctl check"));
        assert!(
            !nixl[0].fatal,
            "NIXL maps block sizes that are multiples: {nixl:?}"
        );
        let mooncake = compare(&p, &d, "mooncake");
        assert!(mooncake[0].fatal && !mooncake[1].fatal, "{mooncake:?}");
        assert!(compare(&p, &p, "nixl").is_empty());
    }
}
