//! LMCache with a remote lmcache server: prefill stores KV to the server, decode
//! retrieves it; two-step proxy protocol. LMCacheConnector (V0, vLLM up to 0.10.0,
//! VLLM_USE_V1=0, experimental yaml keys) and LMCacheConnectorV1 (0.10.1 and later).
//! Both sides need PYTHONHASHSEED=0 so chunk hashes agree.

use super::*;

pub struct Lmcache;

const V0: VersionRange = VersionRange::between((0, 7, 0), (0, 10, 0));
const V1: VersionRange = VersionRange::from((0, 10, 1));

const ABOUT: About = About {
    kind: ConnectorKind::Lmcache,
    classes: "LMCacheConnector / LMCacheConnectorV1 with an lmcache server",
    versions: &[V0, V1],
};

/// The lmcache server's command line and environment for vLLM `v` (None: the newest form):
/// `python -m lmcache.v1.server HOST PORT cpu` for V1, `lmcache_server HOST PORT` before.
/// PYTHONHASHSEED=0 as for the engines, so every process hashes chunks alike.
pub fn server_command(
    python: &str,
    v: Option<&Version>,
    host: &str,
    port: u16,
) -> (Vec<String>, BTreeMap<String, String>) {
    let argv = if is_v1(v) {
        vec![
            python.to_string(),
            "-m".into(),
            "lmcache.v1.server".into(),
            host.to_string(),
            port.to_string(),
            "cpu".into(),
        ]
    } else {
        vec!["lmcache_server".into(), host.to_string(), port.to_string()]
    };
    (argv, hash_seed_env())
}

/// The environment both the engines and the server need.
fn hash_seed_env() -> BTreeMap<String, String> {
    BTreeMap::from([("PYTHONHASHSEED".to_string(), "0".to_string())])
}

/// True when the planned version uses LMCacheConnectorV1 (and the v1 server); the
/// simulator and unknown versions get the V1 form.
fn is_v1(v: Option<&Version>) -> bool {
    v.is_none_or(|v| V1.contains(v))
}

fn yaml(cx: &ClusterCtx, v1: bool) -> String {
    let c = &cx.topology.connector;
    let server = cx.lmcache.as_ref().expect("lmcache server planned");
    let mut y = format!("chunk_size: {}\n", c.lmcache_chunk_size);
    if v1 {
        y.push_str("local_cpu: true\n");
    } else {
        y.push_str("local_device: \"cpu\"\npipelined_backend: false\n");
    }
    y.push_str(&format!(
        "max_local_cpu_size: {}\nremote_url: \"lm://{server}\"\nremote_serde: \"naive\"\n",
        c.lmcache_max_local_cpu_size
    ));
    y
}

impl Connector for Lmcache {
    fn about(&self) -> &'static About {
        &ABOUT
    }
    fn needs(&self, _: &ConnectorSection, _: Option<&Version>) -> Needs {
        Needs {
            lmcache_server: true,
            ..Needs::default()
        }
    }
    fn python_module(&self) -> Option<(&'static str, &'static str)> {
        Some((
            "lmcache",
            "the LMCache connectors import it (pip install lmcache)",
        ))
    }
    fn launch(&self, at: LaunchCtx) -> Result<Launch, Problem> {
        let LaunchCtx { cx, v, inst, .. } = at;
        let v1 = is_v1(Some(v));
        let path = cx.files_dir.join(format!("{}.lmcache.yaml", inst.name));
        let mut launch = Launch::default();
        if v1 {
            launch.kv_transfer_config = transfer_config(
                &cx.topology.connector,
                "LMCacheConnectorV1",
                "kv_both",
                json!({}),
            );
        } else {
            launch.kv_transfer_config = transfer_config(
                &cx.topology.connector,
                "LMCacheConnector",
                producer_consumer(inst.role),
                json!({}),
            );
            launch.env.insert("VLLM_USE_V1".into(), "0".into());
            launch
                .env
                .insert("LMCACHE_USE_EXPERIMENTAL".into(), "True".into());
        }
        launch
            .env
            .insert("LMCACHE_CONFIG_FILE".into(), path.display().to_string());
        launch.env.extend(hash_seed_env());
        launch.files.push(GeneratedFile {
            path,
            content: yaml(cx, v1),
        });
        Ok(launch)
    }
    /// LMCache stores and finds KV in chunks of `chunk_size` tokens: a prompt's last
    /// partial chunk is decode's to compute, up to a chunk less one token (and never less
    /// than vLLM's own last block).
    fn decode_leaves(&self, c: &ConnectorSection, block_size: u32) -> u32 {
        c.lmcache_chunk_size.max(block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_may_compute_a_prompts_last_partial_chunk() {
        let c = ConnectorSection {
            lmcache_chunk_size: 256,
            ..ConnectorSection::default()
        };
        assert_eq!(Lmcache.decode_leaves(&c, 16), 256);
        assert_eq!(Lmcache.decode_leaves(&c, 512), 512);
        assert_eq!(super::super::example::Example.decode_leaves(&c, 16), 16);
    }
}
