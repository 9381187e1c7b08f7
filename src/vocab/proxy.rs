//! How the proxy splits a request and picks instances, as names. Lives in `vocab` because
//! the connectors choose the protocol, a topology names the policies, the planner writes
//! both into the proxy's settings and the proxy acts on them.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// How one client request is split over a prefill and a decode instance. Chosen by the
/// connector (see `connectors`), never by the user directly in a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyProtocol {
    /// Prefill copy with max_tokens=1, wait, then the original to decode.
    TwoStep,
    /// kv_transfer_params handshake (NixlConnector): prefill's returned params go to decode.
    Nixl,
    /// Mooncake V1: a shared transfer_id, decode told the prefill's bootstrap address.
    Mooncake,
    /// NixlPushConnector: both legs at once, decode told where the prefill is (learned from
    /// that prefill's first answer), prefill writes the KV into decode's blocks.
    NixlPush,
}

/// How an instance is picked for one leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    RoundRobin,
    Random,
    LeastLoaded,
    PrefixAware,
}
