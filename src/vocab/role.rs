//! What a service is for. Lives in `vocab` because the planner names services by it, the
//! connectors place files per role, the control protocol reports it, the supervisor orders
//! starts by it and the proxy picks legs by it: no one of them owns it.

use serde::{Deserialize, Serialize};

/// What a service is for; decides start order and how `pdctl logs <role>` groups them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Etcd,
    MooncakeMaster,
    LmcacheServer,
    Prefill,
    Decode,
    Proxy,
}

impl Role {
    /// The name used in the CLI, JSON and service names.
    /// The service name of instance `index` of this role: `prefill-0`, `decode-3`.
    pub fn instance_name(self, index: u32) -> String {
        format!("{}-{index}", self.as_str())
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Etcd => "etcd",
            Role::MooncakeMaster => "mooncake-master",
            Role::LmcacheServer => "lmcache-server",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Proxy => "proxy",
        }
    }

    /// Engines are the prefill and decode instances (the GPU-holding processes).
    pub fn is_engine(self) -> bool {
        matches!(self, Role::Prefill | Role::Decode)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
