//! MooncakeConnector V0 over the Mooncake transfer engine (vLLM 0.6.4 to 0.10.0 with
//! VLLM_USE_V1=0). One prefill and one decode share a transfer-engine
//! form mooncake.json; the pair is fixed (kv_parallel_size 2), so only 1P1D.
//!
//! Ports: each side listens on te_port + TP rank; on a shared host decode's port is +100
//! (Mooncake would add it anyway; pdctl writes it so the plan shows the real port).

use super::*;
use crate::topology::MooncakeMetadata;

pub struct MooncakeTe;

const V0: VersionRange = VersionRange::between((0, 6, 4), (0, 10, 0));

const ABOUT: About = About {
    kind: ConnectorKind::MooncakeTe,
    classes: "MooncakeConnector V0, transfer engine",
    versions: &[V0],
};

impl Connector for MooncakeTe {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn check(&self, t: &Topology, _: Option<&Version>) -> Result<(), Problem> {
        for (role, n) in [
            ("prefill", t.prefill.instances),
            ("decode", t.decode.instances),
        ] {
            if n != 1 {
                return Err(Problem::new(
                    format!("{role}.instances"),
                    format!("mooncake-te pairs exactly one prefill with one decode (kv_parallel_size 2), not {n}"),
                )
                .hint("set instances = 1, or use mooncake-store for NPMD"));
            }
        }
        if t.connector.metadata == MooncakeMetadata::P2p {
            return Err(Problem::new(
                "connector.metadata",
                "the V0 transfer engine needs a metadata server: etcd or http",
            )
            .hint("set connector.metadata = \"etcd\" (or \"http\": mooncake_master's)"));
        }
        Ok(())
    }
    fn needs(&self, c: &ConnectorSection, _: Option<&Version>) -> Needs {
        Needs::mooncake_metadata(c.metadata)
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some((
            "mooncake",
            "MooncakeConnector V0 imports its transfer engine (pip install mooncake-transfer-engine)",
        ))
    }
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx {
            cx, inst, ports, ..
        } = at;
        let c = &cx.topology.connector;
        let p_host = &cx.prefill_hosts[0];
        let d_host = &cx.decode_hosts[0];
        let d_port = if p_host == d_host {
            c.te_port + 100
        } else {
            c.te_port
        };
        let (mine, rank) = if inst.role == Role::Prefill {
            (c.te_port, 0)
        } else {
            (d_port, 1)
        };
        let owner = format!("{} (transfer engine)", inst.name);
        for r in 0..inst.tp as u16 {
            ports.claim(&inst.host, mine + r, &owner).map_err(|clash| {
                Problem::new(
                    "connector.te_port",
                    format!(
                        "transfer-engine port {} of {} is already {}",
                        clash.port, inst.name, clash.holder
                    ),
                )
                .hint("choose another connector.te_port")
            })?;
        }
        let (metadata, backend) = match c.metadata {
            MooncakeMetadata::Http => (
                format!(
                    "http://{}/metadata",
                    cx.master_http_metadata.as_ref().expect("planned")
                ),
                "http",
            ),
            _ => (cx.etcd.as_ref().expect("etcd planned").to_string(), "etcd"),
        };
        let file = json!({
            "prefill_url": format!("{p_host}:{}", c.te_port),
            "decode_url": format!("{d_host}:{d_port}"),
            "metadata_server": metadata,
            "metadata_backend": backend,
            "protocol": c.transport,
            "device_name": c.device_name,
        });
        let path = cx.files_dir.join("mooncake-te.json");
        let mut kv = transfer_config(
            c,
            "MooncakeConnector",
            producer_consumer(inst.role),
            json!({}),
        );
        kv["kv_rank"] = json!(rank);
        kv["kv_parallel_size"] = json!(2);
        kv["kv_buffer_size"] = json!(2e9);
        let mut launch = Launch {
            kv_transfer_config: kv,
            ..Launch::default()
        };
        launch
            .env
            .insert("MOONCAKE_CONFIG_PATH".into(), path.display().to_string());
        launch.env.insert("VLLM_USE_V1".into(), "0".into());
        launch.files.push(GeneratedFile {
            path,
            content: serde_json::to_string_pretty(&file).expect("json"),
        });
        launch.rank_ports("transfer-engine", mine, inst.tp as u16);
        Ok(launch)
    }
}
