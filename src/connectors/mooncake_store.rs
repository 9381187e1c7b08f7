//! MooncakeStoreConnector: KV goes through a Mooncake store (mooncake_master + metadata
//! server) that every instance mounts. V0 (vLLM up to 0.10.0, VLLM_USE_V1=0) and
//! V1 (0.21.0 and later); both use the two-step proxy protocol, unless `connector.multi` on
//! V1 wraps it in a MultiConnector with MooncakeConnector (transfer_id protocol).
//!
//! Each instance reads a store-form mooncake.json (MOONCAKE_CONFIG_PATH) naming its own host.

use super::*;
use crate::topology::MooncakeMetadata;

pub struct MooncakeStore;

const V0: VersionRange = VersionRange::between((0, 7, 0), (0, 10, 0));
const V1: VersionRange = VersionRange::from((0, 21, 0));

const ABOUT: About = About {
    kind: ConnectorKind::MooncakeStore,
    classes: "MooncakeStoreConnector",
    versions: &[V0, V1],
};

fn is_v1(v: Option<&Version>) -> bool {
    v.is_some_and(|v| V1.contains(v))
}

/// The store-form mooncake.json for one instance.
fn store_json(cx: &ClusterCtx, host: &str) -> Result<Value, Problem> {
    let c = &cx.topology.connector;
    let metadata = match c.metadata {
        MooncakeMetadata::Etcd => format!(
            "etcd://{}",
            cx.etcd.as_ref().expect("etcd planned when needed")
        ),
        MooncakeMetadata::Http => format!(
            "http://{}/metadata",
            cx.master_http_metadata
                .as_ref()
                .expect("http metadata planned when needed")
        ),
        MooncakeMetadata::P2p => "P2PHANDSHAKE".to_string(),
    };
    let master = cx.master.as_ref().expect("master planned when needed");
    Ok(json!({
        "local_hostname": host,
        "metadata_server": metadata,
        "protocol": c.transport,
        "device_name": c.device_name,
        "master_server_address": master.to_string(),
        "global_segment_size": size_bytes("connector.global_segment_size", &c.global_segment_size)?,
        "local_buffer_size": size_bytes("connector.local_buffer_size", &c.local_buffer_size)?,
    }))
}

impl Connector for MooncakeStore {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn check(&self, t: &Topology, v: Option<&Version>) -> Result<(), Problem> {
        if let Some(v) = v.filter(|v| t.connector.multi && !V1.contains(v)) {
            return Err(Problem::new(
                "connector.multi",
                format!(
                    "MultiConnector with MooncakeConnector needs vLLM 0.21.0 or later, not {v}"
                ),
            )
            .hint("set multi = false, or pin engine.vllm_version to 0.21.0 or later"));
        }
        if t.connector.multi {
            super::mooncake::check_cpu(
                t,
                v,
                "connector.multi",
                "multi = true (MultiConnector with MooncakeConnector)",
            )?;
        }
        Ok(())
    }
    /// V1 alone, two-step: vLLM (0.32 seen) answers the prefill request while its KV is
    /// still being put into the store (the put runs on a sender thread; the request does
    /// not wait for it), so a decode request sent at once can miss and recompute. Measured
    /// on 2 loaded CPUs: 3 to 6 of 20-30 back-to-back requests missed, none with a 0.5 s
    /// pause between the legs. The answer stays right; only the handoff is lost.
    fn warnings(&self, t: &Topology, v: &Version) -> Vec<String> {
        if V1.contains(v) && !t.connector.multi {
            vec![format!(
                "connector mooncake-store on vLLM {v}: the store is filled after prefill answers, so decode can miss a prompt's KV and recompute it (silently, with the right answer); set connector.multi = true (MooncakeConnector hands KV over, the store keeps prefixes) where the GPU build is used"
            )]
        } else {
            Vec::new()
        }
    }
    fn needs(&self, c: &ConnectorSection, _: Option<&Version>) -> Needs {
        // The store itself is mooncake_master, whatever serves the metadata.
        Needs {
            mooncake_master: true,
            ..Needs::mooncake_metadata(c.metadata)
        }
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some((
            "mooncake",
            "MooncakeStoreConnector imports its store client (pip install mooncake-transfer-engine)",
        ))
    }
    fn protocol(&self, c: &ConnectorSection, v: Option<&Version>) -> ProxyProtocol {
        if c.multi && (v.is_none() || is_v1(v)) {
            ProxyProtocol::Mooncake
        } else {
            ProxyProtocol::TwoStep
        }
    }
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx { cx, v, inst, .. } = at;
        let c = &cx.topology.connector;
        let path = cx.files_dir.join(format!("{}.mooncake.json", inst.name));
        let content = serde_json::to_string_pretty(&store_json(cx, &inst.listen)?).expect("json");
        let mut launch = Launch::default();
        launch
            .env
            .insert("MOONCAKE_CONFIG_PATH".into(), path.display().to_string());
        launch
            .env
            .insert("VLLM_HOST_IP".into(), inst.listen.clone());
        launch.files.push(GeneratedFile { path, content });
        let role = producer_consumer(inst.role);
        if !V1.contains(v) {
            launch.env.insert("VLLM_USE_V1".into(), "0".into());
            launch.kv_transfer_config =
                transfer_config(c, "MooncakeStoreConnector", role, json!({}));
        } else if c.multi {
            let store = transfer_config(c, "MooncakeStoreConnector", "kv_both", json!({}));
            let p2p = super::mooncake::v1_config(c, inst.role);
            launch.kv_transfer_config = json!({
                "kv_connector": "MultiConnector",
                "kv_role": role,
                "kv_connector_extra_config": { "connectors": [p2p, store] },
            });
            super::mooncake::v1_env(inst, &mut launch);
        } else {
            launch.kv_transfer_config =
                transfer_config(c, "MooncakeStoreConnector", role, json!({}));
        }
        Ok(launch)
    }
}
