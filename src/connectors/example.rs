//! SharedStorageConnector (vLLM 0.9.0 to 0.12.x) and its rename ExampleConnector (0.13.0 and
//! later): prefill writes KV files into a directory decode reads. Two-step proxy protocol.
//!
//! Pairs: the default (`Pairing::same`). Its files are `<hash of the prompt>/<layer>.safetensors`
//! with no TP rank in the name, the prompt cut to the saver's block size and looked up cut
//! to the loader's (0.9.0 shared_storage_connector.py:38, 362, 377; 0.33.0
//! example_connector.py:50, 435, 452): other TP or block sizes on the two sides do not meet.

use super::*;

pub struct Example;

const SHARED_STORAGE: VersionRange = VersionRange::between((0, 9, 0), (0, 12, 99));
const EXAMPLE: VersionRange = VersionRange::from((0, 13, 0));

const ABOUT: About = About {
    kind: ConnectorKind::Example,
    classes: "SharedStorageConnector / ExampleConnector",
    versions: &[SHARED_STORAGE, EXAMPLE],
};

impl Connector for Example {
    fn about(&self) -> &'static About {
        &ABOUT
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
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx { cx, v, inst, .. } = at;
        let class = if EXAMPLE.contains(v) {
            "ExampleConnector"
        } else {
            "SharedStorageConnector"
        };
        let dir = cx.shared_dir.display().to_string();
        Ok(Launch {
            args: if inst.role == Role::Prefill {
                producer_args(cx)
            } else {
                Vec::new()
            },
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

/// The producer stores a request's KV when the request is first scheduled. With chunked
/// prefill (on by default in every vLLM that has this connector) a prompt longer than one
/// step's token budget is stored cut short, and decode dies loading it (`shape mismatch` in
/// `inject_kv_into_layer`, seen on vLLM 0.26 with an 880-token prompt and a 272-token
/// piece). So prefill schedules every prompt whole: chunked prefill off, and a batch token
/// budget of at least the model length (vLLM's own default when chunking is off and the
/// length is not given here).
fn producer_args(cx: &ClusterCtx) -> Vec<String> {
    let mut args = vec!["--no-enable-chunked-prefill".to_string()];
    if let Some(n) = cx.topology.model.max_model_len {
        args.extend(["--max-num-batched-tokens".to_string(), n.to_string()]);
    }
    args
}
