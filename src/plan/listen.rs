//! Which address each listener binds: no wider than it must be. A service listens on its
//! node's address only when something on another node (or, for the proxy, a client) must
//! reach it; everything else listens on loopback. On one node that is everything but the
//! proxy. A node whose address is a loopback address already (127.0.0.2 for a test's
//! second "node") keeps it: it is no wider than 127.0.0.1, and two such nodes on one
//! machine must not share one loopback address.

use crate::topology::Topology;
use crate::vocab::{Role, Service};
use std::collections::BTreeSet;

/// Whether `addr` reaches only this machine.
pub fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The loopback address a service on a node at `addr` binds when nobody elsewhere needs it.
pub fn loopback_of(addr: &str) -> String {
    if is_loopback(addr) {
        addr.to_string()
    } else {
        "127.0.0.1".to_string()
    }
}

/// Where the engines and the proxy run, to tell which listeners other nodes reach.
pub(super) struct Reach<'a> {
    t: &'a Topology,
    prefill_nodes: BTreeSet<String>,
    decode_nodes: BTreeSet<String>,
    /// The proxy's node; None when the topology runs no proxy (then clients somewhere
    /// reach the engines themselves).
    proxy_node: Option<String>,
}

impl<'a> Reach<'a> {
    pub fn new(
        t: &'a Topology,
        placed: impl IntoIterator<Item = (Role, String)>,
        head: &str,
    ) -> Self {
        let (mut prefill_nodes, mut decode_nodes) = (BTreeSet::new(), BTreeSet::new());
        for (role, node) in placed {
            if role == Role::Prefill {
                prefill_nodes.insert(node);
            } else {
                decode_nodes.insert(node);
            }
        }
        let proxy_node = t
            .proxy
            .enabled
            .then(|| t.proxy.node.clone().unwrap_or_else(|| head.to_string()));
        Reach {
            t,
            prefill_nodes,
            decode_nodes,
            proxy_node,
        }
    }

    /// The address a listener of a service on `node` binds: the node's when `reached`
    /// from another node, else loopback.
    pub fn addr(&self, node: &str, reached: bool) -> String {
        let written = &self.t.nodes[node];
        if reached {
            written.clone()
        } else {
            loopback_of(written)
        }
    }

    /// Whether an engine runs on a node other than `node` (so the shared services and the
    /// KV transfer listeners there must be reachable from it).
    pub fn engines_elsewhere(&self, node: &str) -> bool {
        self.prefill_nodes
            .iter()
            .chain(&self.decode_nodes)
            .any(|n| n != node)
    }

    /// Whether a decode instance runs on a node other than `node`.
    pub fn decode_elsewhere(&self, node: &str) -> bool {
        self.decode_nodes.iter().any(|n| n != node)
    }

    /// Whether the engines' HTTP port on `node` is reached from elsewhere: by the proxy on
    /// another node (or by clients when pdctl runs no proxy), or, for a prefill whose
    /// decode instances pull KV through its HTTP address (`pull_via_http`: the simulator's
    /// handoff, Mooncake's bootstrap host), by a decode on another node.
    pub fn engine_http(&self, node: &str, role: Role, pull_via_http: bool) -> bool {
        let proxy_elsewhere = self.proxy_node.as_deref().is_none_or(|p| p != node);
        proxy_elsewhere || (role == Role::Prefill && pull_via_http && self.decode_elsewhere(node))
    }
}

/// The port names of listeners that take no authentication, by kind, as the plan books
/// them (per engine, the KV transfer listeners; per shared service, what engines use).
const UNAUTHENTICATED: &[(Role, &str, &str)] = &[
    (Role::Prefill, "side-channel", "NIXL side channels"),
    (Role::Decode, "side-channel", "NIXL side channels"),
    (
        Role::Prefill,
        "transfer-engine",
        "Mooncake transfer engines",
    ),
    (Role::Decode, "transfer-engine", "Mooncake transfer engines"),
    (Role::Prefill, "bootstrap", "Mooncake bootstrap servers"),
    (
        Role::Etcd,
        "client",
        "etcd's client port (no authentication: Mooncake's etcd client cannot log in)",
    ),
    (Role::MooncakeMaster, "rpc", "mooncake_master's RPC port"),
    (
        Role::MooncakeMaster,
        "http-metadata",
        "mooncake_master's HTTP metadata server",
    ),
    (Role::LmcacheServer, "server", "the LMCache server"),
];

/// The one warning of a plan over several nodes: the listeners other nodes reach that
/// have no authentication by design, with their ports, and what to do about them.
pub(super) fn open_by_design(services: &[Service], reach: &Reach) -> Option<String> {
    let mut kinds: Vec<(&str, Vec<u16>)> = Vec::new();
    for s in services {
        if is_loopback(&reach.addr(&s.node, reach.engines_elsewhere(&s.node))) {
            continue;
        }
        for (role, prefix, what) in UNAUTHENTICATED {
            if s.role != *role {
                continue;
            }
            let ports = s
                .ports
                .iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(_, p)| *p);
            match kinds.iter_mut().find(|(w, _)| w == what) {
                Some((_, list)) => list.extend(ports),
                None => kinds.push((what, ports.collect())),
            }
        }
    }
    kinds.retain(|(_, ports)| !ports.is_empty());
    // Mooncake's transfer engine (store, connector V1) also opens RPC ports of its own
    // choosing, in 15000-17000 unless MC_MIN_RPC_PORT / MC_MAX_RPC_PORT say otherwise.
    let engines_own_ports = services.iter().any(|s| {
        s.role.is_engine()
            && !is_loopback(&reach.addr(&s.node, reach.engines_elsewhere(&s.node)))
            && (s.env.contains_key("MOONCAKE_CONFIG_PATH") || s.env.contains_key("VLLM_HOST_IP"))
    });
    if kinds.is_empty() && !engines_own_ports {
        return None;
    }
    let mut parts: Vec<String> = kinds
        .into_iter()
        .map(|(what, mut ports)| {
            ports.sort_unstable();
            ports.dedup();
            format!("{what} (port {})", ranges(&ports))
        })
        .collect();
    if engines_own_ports {
        parts.push(
            "the RPC ports Mooncake's transfer engine picks in each engine (15000-17000)".into(),
        );
    }
    Some(format!(
        "across nodes these listeners take no authentication, by design of the software behind them: {}; keep the nodes on a private network or firewall these ports to the cluster's nodes (docs/security.md)",
        parts.join(", ")
    ))
}

/// mooncake_master's HTTP metadata server listens on every address whatever
/// `--http_metadata_server_host` says (its server is made with a port alone, in the
/// versions pdctl installs): said whenever a plan starts one.
pub(super) fn binds_every_address(services: &[Service]) -> Option<String> {
    let port = services
        .iter()
        .find(|s| s.role == Role::MooncakeMaster)
        .and_then(|s| s.ports.get("http-metadata"))?;
    Some(format!(
        "mooncake-master: its HTTP metadata server listens on every address (port {port}), whatever --http_metadata_server_host says, and takes no authentication; firewall the port to the cluster's nodes, or use connector.metadata = \"etcd\" (docs/security.md)"
    ))
}

/// `5600-5603, 8080`: sorted ports with consecutive runs joined.
fn ranges(ports: &[u16]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ports.len() {
        let mut j = i;
        while j + 1 < ports.len() && ports[j + 1] == ports[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            ports[i].to_string()
        } else {
            format!("{}-{}", ports[i], ports[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_stay_themselves() {
        assert!(is_loopback("127.0.0.2") && is_loopback("::1") && is_loopback("localhost"));
        assert!(!is_loopback("10.0.0.1") && !is_loopback("gpu-a") && !is_loopback("0.0.0.0"));
        assert_eq!(loopback_of("127.0.0.3"), "127.0.0.3");
        assert_eq!(loopback_of("10.0.13.1"), "127.0.0.1");
    }

    #[test]
    fn port_lists_join_runs() {
        assert_eq!(
            ranges(&[5600, 5601, 5602, 7000, 8080, 8081]),
            "5600-5602, 7000, 8080-8081"
        );
        assert_eq!(ranges(&[]), "");
    }
}
