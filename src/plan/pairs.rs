//! Whether a prefill engine and a decode engine can hand KV to each other, as the plan
//! starts them: the same model, the same KV block size, and tensor-parallel sizes the
//! connector can bridge. Read from each engine's command line (or a simulated engine's
//! generated config), so `up`'s pre-flight refuses a pair that would fail before any GPU
//! time is spent; `pdctl check` asks the running engines the same questions.

use super::{Plan, Role, Service};
use crate::child_config::ChildSettings;
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
        "KV block size" => {
            "the handoff maps blocks one to one, so it fails or decode recomputes; give both the same --block-size"
        }
        "tensor-parallel size" if fatal => {
            "this connector moves KV between equal tensor-parallel layouts only; give both roles the same gpus_per_instance"
        }
        "tensor-parallel size" => {
            "NixlConnector bridges different sizes only on recent vLLM and dense models (older ones fail with NIXL_ERR_NOT_FOUND); `pdctl check` proves the pair"
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
    differ(
        "KV block size",
        prefill.block_size.to_string(),
        decode.block_size.to_string(),
        true,
    );
    differ(
        "tensor-parallel size",
        prefill.tensor_parallel.to_string(),
        decode.tensor_parallel.to_string(),
        connector != "nixl",
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
    let mut out: Vec<Mismatch> = Vec::new();
    for p in &prefill {
        for d in &decode {
            for m in compare(p, d, &plan.connector) {
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
        assert!(!nixl[1].fatal && nixl[1].to_string().contains("NIXL_ERR_NOT_FOUND"));
        assert!(compare(&p, &p, "nixl").is_empty());
    }
}
