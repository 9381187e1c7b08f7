//! MooncakeConnector V1 (vLLM 0.16.0 and later, with the bootstrap server): prefill pushes
//! KV to decode over the Mooncake transfer engine, matched by a transfer_id the proxy
//! gives both legs; decode finds the prefill through its bootstrap server
//! (VLLM_MOONCAKE_BOOTSTRAP_PORT, one per prefill instance on a host).
//!
//! 0.13 to 0.15 had the connector with other handshake fields; pdctl's proxy speaks the
//! transfer_id form only, so those versions get a clear error instead of a silent mismatch.

use super::pairing::{BlockRule, PpRule, TpRule};
use super::*;

pub struct MooncakeV1;

const BOOTSTRAP: VersionRange = VersionRange::from((0, 16, 0));

/// vLLM whose MooncakeConnector maps different TP sizes: 0.16.0 raises "Mooncake:
/// Heterogeneous TP is not supported yet." (mooncake/mooncake_connector.py:825 and 1157);
/// 0.20.0 has `_get_tp_ratio` (mooncake_connector.py:84), either size dividing the other,
/// as 0.33.0 (mooncake_connector.py:153 to 171). 0.17 to 0.19 were not read: refused.
const HETERO_TP: VersionRange = VersionRange::from((0, 20, 0));

/// vLLM whose MooncakeConnector takes pipeline parallelism: 0.16.0 and 0.20.0 raise "Mooncake
/// Transfer Engine does not support pipeline parallelism yet." (mooncake_connector.py:496,
/// 771); 0.25.0 keeps a pp_rank per worker (mooncake_connector.py:968, 1945); 0.33.0 aligns
/// equal sizes and refuses some layouts when they differ (mooncake_connector.py:586 to 603).
const PIPELINE: VersionRange = VersionRange::from((0, 25, 0));

const ABOUT: About = About {
    kind: ConnectorKind::Mooncake,
    classes: "MooncakeConnector V1 with bootstrap server",
    versions: &[BOOTSTRAP],
};

/// The kv_transfer_config of a MooncakeConnector V1 side (also used inside MultiConnector).
pub(super) fn v1_config(c: &ConnectorSection, role: Role) -> Value {
    // mooncake_protocol defaults to rdma; machines without RDMA need tcp (key from 0.14).
    transfer_config(
        c,
        "MooncakeConnector",
        producer_consumer(role),
        json!({ "mooncake_protocol": c.transport }),
    )
}

/// Env of a MooncakeConnector V1 side: the bootstrap port (prefill) and the address the
/// transfer engine advertises.
pub(super) fn v1_env(inst: &InstanceCtx, launch: &mut Launch) {
    launch
        .env
        .insert("VLLM_HOST_IP".into(), inst.listen.clone());
    if let Some(p) = inst.bootstrap_port {
        launch
            .env
            .insert("VLLM_MOONCAKE_BOOTSTRAP_PORT".into(), p.to_string());
        launch.ports.insert("bootstrap".into(), p);
    }
}

/// MooncakeConnector V1 on vLLM's CPU build. vLLM 0.32's connector asks torch for the
/// current CUDA device when it starts (`torch.accelerator.current_device_index()` in
/// mooncake_connector.py), so the CPU build fails at engine start with "Found no NVIDIA
/// driver on your system" (seen with `connector.multi = true`, which wraps it). Refused
/// unless the installed vLLM's file was read and has no such call, or guards it
/// ([`starts_on_cpu`]).
pub(super) fn cpu_problem(key: &str, what: &str) -> Problem {
    Problem::new(
        key,
        format!("{what} needs CUDA: vLLM's MooncakeConnector looks up the current CUDA device when it starts (`torch.accelerator.current_device_index()` in mooncake_connector.py), so vLLM's CPU build (device = \"cpu\") cannot load it"),
    )
    .hint("on device = \"cpu\" use connector kind \"example\", or \"mooncake-store\" without multi; a vLLM whose installed mooncake_connector.py guards that call (torch.accelerator.is_available()) is planned, when pdctl plans on the machine that has it")
}

/// Where MooncakeConnector V1 lives in the vLLM package: 0.16.0 and later in
/// `v1/mooncake/`, before in `v1/`.
const SOURCE_FILES: &[&str] = &[
    "distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
    "distributed/kv_transfer/kv_connector/v1/mooncake_connector.py",
];

/// The call that raises without an accelerator (vLLM 0.33.0 mooncake_connector.py:1242).
const ACCELERATOR_CALL: &str = "torch.accelerator.current_device_index()";

/// Whether MooncakeConnector's source (`text`) starts on vLLM's CPU build: it does not ask
/// torch for the accelerator's device, or asks only behind `torch.accelerator.is_available()`.
pub fn starts_on_cpu(text: &str) -> bool {
    let calls = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .any(|l| l.contains(ACCELERATOR_CALL));
    !calls || text.contains("torch.accelerator.is_available()")
}

/// Refuses MooncakeConnector on vLLM's CPU build unless the installed vLLM's source was read
/// and starts there (`engine.cpu_ready`).
pub(super) fn check_cpu(
    t: &Topology,
    v: Option<&Version>,
    key: &str,
    what: &str,
) -> Result<(), Problem> {
    let cpu = t.engine.device == crate::topology::Device::Cpu;
    if v.is_some() && cpu && !t.engine.cpu_ready.contains(&ConnectorKind::Mooncake) {
        return Err(cpu_problem(key, what));
    }
    Ok(())
}

impl Connector for MooncakeV1 {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn check(&self, t: &Topology, v: Option<&Version>) -> Result<(), Problem> {
        check_cpu(t, v, "connector.kind", "MooncakeConnector")
    }
    fn cpu_source(&self) -> Option<CpuSource> {
        Some(CpuSource {
            files: SOURCE_FILES,
            starts_on_cpu,
        })
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some((
            "mooncake",
            "MooncakeConnector imports its transfer engine (pip install mooncake-transfer-engine)",
        ))
    }
    fn protocol(&self, _: &ConnectorSection, _: Option<&Version>) -> ProxyProtocol {
        ProxyProtocol::Mooncake
    }
    /// Blocks are copied region by region with the same length on both sides (0.33.0's
    /// `_validate_asymmetric_region_lengths`, mooncake_connector.py:349 to 355): one block
    /// size.
    fn pairing(&self, _: &ConnectorSection, v: &Version) -> Pairing {
        Pairing {
            class: "MooncakeConnector",
            tp: if HETERO_TP.contains(v) {
                TpRule::EitherDivides
            } else {
                TpRule::Equal
            },
            pp: if PIPELINE.contains(v) {
                PpRule::Equal
            } else {
                PpRule::OnlyOne
            },
            block: BlockRule::Equal,
            // 0.33 counts replicated ranks as one (`min(tp, total_num_kv_heads)`,
            // mooncake_connector.py:338 to 341).
            larger_within_kv_heads: None,
        }
    }
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx { cx, inst, .. } = at;
        let mut launch = Launch {
            kv_transfer_config: v1_config(&cx.topology.connector, inst.role),
            ..Launch::default()
        };
        v1_env(inst, &mut launch);
        Ok(launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_build_is_refused_only_where_the_source_asks_for_an_accelerator() {
        let unpatched = "        self.vllm_config = vllm_config\n        self.device_id = torch.accelerator.current_device_index()\n";
        assert!(!starts_on_cpu(unpatched));
        let guarded = "        if torch.accelerator.is_available():\n            self.device_id = torch.accelerator.current_device_index()\n";
        assert!(starts_on_cpu(guarded));
        assert!(starts_on_cpu(
            "# torch.accelerator.current_device_index() was here\nself.device_id = 0\n"
        ));
    }
}
