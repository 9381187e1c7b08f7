//! What a planned engine's KV moves over, as its connector configures it: UCX's
//! transports and devices for NIXL, the protocol for Mooncake, the directory for the
//! shared-storage connector, the handoff of a simulated engine. `pdctl check` prints it,
//! and warns when it is TCP on a machine that has RDMA devices.

use crate::child_config::ChildSettings;
use crate::vocab::Service;
use serde_json::Value;

/// The KV path of one engine, in words, and whether it is plain TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transport {
    pub text: String,
    pub tcp: bool,
}

/// The transport `svc` (a prefill or decode engine of a plan with connector `connector`;
/// a simulated one's typed `settings`) is configured with.
pub fn of(connector: &str, svc: &Service, settings: Option<&ChildSettings>) -> Transport {
    if let Some(sim) = settings.and_then(ChildSettings::sim) {
        let handoff = crate::spelling::value_name(sim.handoff);
        return Transport {
            text: format!("simulated {handoff} handoff (no KV bytes move)"),
            tcp: false,
        };
    }
    let kv = kv_transfer_config(svc);
    match connector {
        "nixl" => {
            let tls = svc.env.get("UCX_TLS");
            let devices = svc.env.get("UCX_NET_DEVICES");
            let tcp = tls.is_some_and(|t| {
                let t = t.to_ascii_lowercase();
                t.split(',').any(|x| x.trim() == "tcp")
                    && !t.split(',').any(|x| {
                        matches!(
                            x.trim(),
                            "rc" | "ud" | "dc" | "rc_x" | "ud_x" | "dc_x" | "ib" | "all"
                        )
                    })
            });
            Transport {
                text: format!(
                    "NIXL over UCX: UCX_TLS={}, UCX_NET_DEVICES={}",
                    tls.map_or("(unset: UCX picks)", String::as_str),
                    devices.map_or("(unset: UCX picks)", String::as_str)
                ),
                tcp,
            }
        }
        "mooncake" => {
            let protocol = kv["kv_connector_extra_config"]["mooncake_protocol"]
                .as_str()
                .unwrap_or("rdma (MooncakeConnector's default)")
                .to_string();
            Transport {
                tcp: protocol == "tcp",
                text: format!("Mooncake transfer engine, protocol {protocol}"),
            }
        }
        "mooncake-store" | "mooncake-te" => {
            let protocol = mooncake_json(svc)
                .and_then(|v| v["protocol"].as_str().map(str::to_string))
                .unwrap_or_else(|| "?".into());
            Transport {
                tcp: protocol == "tcp",
                text: format!("Mooncake ({connector}), protocol {protocol}"),
            }
        }
        "example" => Transport {
            text: format!(
                "a shared directory ({})",
                kv["kv_connector_extra_config"]["shared_storage_path"]
                    .as_str()
                    .unwrap_or("?")
            ),
            tcp: false,
        },
        other => Transport {
            text: format!("{other} (its own server)"),
            tcp: false,
        },
    }
}

/// The `--kv-transfer-config` JSON on the engine's command line (Null when absent).
fn kv_transfer_config(svc: &Service) -> Value {
    svc.argv
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .and_then(|i| svc.argv.get(i + 1))
        .and_then(|j| serde_json::from_str(j).ok())
        .unwrap_or(Value::Null)
}

/// The mooncake.json the engine reads (`MOONCAKE_CONFIG_PATH`), among its generated files.
fn mooncake_json(svc: &Service) -> Option<Value> {
    let path = svc.env.get("MOONCAKE_CONFIG_PATH")?;
    let file = svc
        .files
        .iter()
        .find(|f| f.path.to_str() == Some(path.as_str()))?;
    serde_json::from_str(&file.content).ok()
}

/// The RDMA devices this machine has (`/sys/class/infiniband`), for the TCP warning.
pub fn rdma_devices() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Role;

    fn engine(argv: &[&str], env: &[(&str, &str)]) -> Service {
        let mut s = Service::new("decode-0", Role::Decode, "local", argv.to_vec());
        for (k, v) in env {
            s.env.insert(k.to_string(), v.to_string());
        }
        s
    }

    #[test]
    fn nixl_names_ucx_and_tells_tcp_only() {
        let t = of(
            "nixl",
            &engine(&["python3"], &[("UCX_TLS", "tcp,cuda_copy")]),
            None,
        );
        assert!(t.tcp, "{t:?}");
        assert_eq!(
            t.text,
            "NIXL over UCX: UCX_TLS=tcp,cuda_copy, UCX_NET_DEVICES=(unset: UCX picks)"
        );
        assert!(
            !of(
                "nixl",
                &engine(&["python3"], &[("UCX_TLS", "rc,tcp")]),
                None
            )
            .tcp
        );
        assert!(!of("nixl", &engine(&["python3"], &[]), None).tcp);
    }

    #[test]
    fn mooncake_names_its_protocol() {
        let kv = r#"{"kv_connector":"MooncakeConnector","kv_connector_extra_config":{"mooncake_protocol":"tcp"}}"#;
        let t = of(
            "mooncake",
            &engine(&["python3", "--kv-transfer-config", kv], &[]),
            None,
        );
        assert_eq!(
            t,
            Transport {
                text: "Mooncake transfer engine, protocol tcp".into(),
                tcp: true
            }
        );
    }
}
