//! NixlConnector (every V1 vLLM): decode pulls KV from prefill; the proxy copies the
//! prefill's returned kv_transfer_params into the decode request.
//!
//! Side channel: VLLM_NIXL_SIDE_CHANNEL_PORT defaults to 5557 up to 0.11 and 5600 from 0.12;
//! before 0.12 each TP rank opens port + rank, from 0.12 one port per engine. The host must
//! be the node's address when prefill and decode are on different machines.

use super::*;

pub struct Nixl;

const NIXL: VersionRange = VersionRange::from((0, 9, 0));

const ABOUT: About = About {
    kind: ConnectorKind::Nixl,
    classes: "NixlConnector",
    versions: &[NIXL],
};

/// True when vLLM opens one side-channel port per engine rather than per TP rank.
fn one_port_per_engine(v: &Version) -> bool {
    *v >= Version::new(0, 12, 0)
}

impl Connector for Nixl {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some(("nixl", "NixlConnector imports it (pip install nixl)"))
    }
    fn protocol(&self, _: &ConnectorSection, _: Option<&Version>) -> ProxyProtocol {
        ProxyProtocol::Nixl
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
        let mut launch = Launch {
            kv_transfer_config: transfer_config(c, "NixlConnector", "kv_both", json!({})),
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
