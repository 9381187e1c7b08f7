//! Port claims shared by every planning step: the engines, the support services and the
//! proxy all book their fixed ports here, so a clash names the key to change. It sits below
//! `build`, `engines` and `support` so none of them imports another for it.

use crate::connectors::PortBook;
use crate::topology::Problem;

/// The key that sets a planned port, for clash messages.
fn port_key(service: &str, port_name: &str) -> String {
    let role = service.split('-').next().unwrap_or(service);
    match (service, port_name) {
        ("etcd", "client") => "etcd.client_port".into(),
        ("etcd", "peer") => "etcd.peer_port".into(),
        ("mooncake-master", "rpc") => "mooncake_master.rpc_port".into(),
        ("mooncake-master", "metrics") => "mooncake_master.metrics_port".into(),
        ("mooncake-master", "http-metadata") => "mooncake_master.http_metadata_port".into(),
        ("lmcache-server", _) => "lmcache_server.port".into(),
        ("proxy", _) => "proxy.port".into(),
        (_, "http") => format!("{role}.base_port"),
        (_, "bootstrap") => "connector.bootstrap_port".into(),
        (_, "transfer engine") => "connector.te_port".into(),
        (_, n) if n.starts_with("side-channel") => "connector.side_channel_port".into(),
        _ => "connector".into(),
    }
}

/// Claims a fixed port for `service`, or says which key to change.
pub(super) fn claim(
    ports: &mut PortBook,
    host: &str,
    port: u16,
    service: &str,
    name: &str,
) -> Result<(), Problem> {
    ports
        .claim(host, port, &format!("{service} ({name})"))
        .map_err(|clash| {
            let (holder_service, holder_port) = clash
                .holder
                .split_once(" (")
                .map(|(s, p)| (s.to_string(), p.trim_end_matches(')').to_string()))
                .unwrap_or_default();
            Problem::new(
                port_key(service, name),
                format!(
                    "port {port} on {host} is wanted by {service} ({name}) but is already {}'s",
                    clash.holder
                ),
            )
            .hint("give each service on a node its own port")
            .also(port_key(&holder_service, &holder_port))
        })
}
