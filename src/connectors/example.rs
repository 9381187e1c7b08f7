//! SharedStorageConnector (vLLM 0.9.0 to 0.12.x) and its rename ExampleConnector (0.13.0 and
//! later): prefill writes KV files into a directory decode reads. Two-step proxy protocol.

use super::*;

pub struct Example;

const SHARED_STORAGE: VersionRange = VersionRange::between((0, 9, 0), (0, 12, 99));
const EXAMPLE: VersionRange = VersionRange::from((0, 13, 0));

impl Connector for Example {
    fn kind(&self) -> ConnectorKind {
        ConnectorKind::Example
    }
    fn describe(&self) -> &'static str {
        "SharedStorageConnector / ExampleConnector"
    }
    fn versions(&self) -> &'static [VersionRange] {
        &[SHARED_STORAGE, EXAMPLE]
    }
    fn check(&self, t: &Topology, v: Option<&Version>) -> Result<(), Problem> {
        // Before 0.22 it calls .cuda() unconditionally, so the CPU build cannot load it.
        if let Some(v) = v
            && t.engine.device == crate::topology::Device::Cpu
            && *v < Version::new(0, 22, 0)
        {
            return Err(Problem::new(
                "engine.device",
                format!("the shared-storage connector of vLLM {v} needs CUDA (it works on CPU from 0.22.0)"),
            )
            .hint("use vLLM 0.22.0 or later for device = \"cpu\""));
        }
        Ok(())
    }
    fn needs(&self, _: &ConnectorSection, _: Option<&Version>) -> Needs {
        Needs::default()
    }
    fn protocol(&self, _: &ConnectorSection, _: Option<&Version>) -> ProxyProtocol {
        ProxyProtocol::TwoStep
    }
    fn launch(
        &self,
        cx: &ClusterCtx,
        v: &Version,
        inst: &InstanceCtx,
        _: &mut PortBook,
    ) -> Result<Launch, Problem> {
        let class = if EXAMPLE.contains(v) {
            "ExampleConnector"
        } else {
            "SharedStorageConnector"
        };
        let dir = cx.shared_dir.display().to_string();
        Ok(Launch {
            kv_transfer_config: transfer_config(
                &cx.topology.connector,
                class,
                producer_consumer(inst.role),
                json!({ "shared_storage_path": dir }),
            ),
            dirs: vec![cx.shared_dir.clone()],
            ..Launch::default()
        })
    }
}
