//! What a running cluster's instances hold, as data the planner is given: a change
//! (`scale`, `apply`, the rebalancer's moves) plans its wanted cluster with it, so an
//! instance it keeps stays on the GPUs and ports it runs on, and a new one gets what is
//! left. Planned from scratch, GPUs and per-node port ranges (NIXL side channels, Mooncake
//! bootstrap ports) go out in placement order: a kept instance could be moved onto a GPU
//! or port another instance still runs on, and restarted for nothing (docs/operations.md).

use super::Plan;
use crate::vocab::Role;
use std::collections::BTreeMap;

/// What one running instance holds on its node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The node it runs on (GPU indices are per node).
    pub node: String,
    /// The address its ports are booked under (the node's, as the topology writes it).
    pub host: String,
    /// Its role: an instance is kept only as the same role.
    pub role: Role,
    /// The GPUs it was given, in order (as `CUDA_VISIBLE_DEVICES` lists them).
    pub gpus: Vec<u32>,
    /// The ports it listens on besides its HTTP port (which the topology fixes).
    pub ports: Vec<u16>,
}

/// What each running engine holds, by service name; empty for a fresh cluster (then the
/// plan is exactly what `pdctl up` plans).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    by_name: BTreeMap<String, Held>,
}

impl Holdings {
    /// What the engines of `running` hold.
    pub fn of(running: &Plan) -> Holdings {
        let by_name = running
            .services
            .iter()
            .filter(|s| s.role.is_engine())
            .map(|s| {
                let held = Held {
                    node: s.node.clone(),
                    host: s.host.clone(),
                    role: s.role,
                    gpus: s.gpus.clone(),
                    ports: s
                        .ports
                        .iter()
                        .filter(|(name, _)| name.as_str() != "http")
                        .map(|(_, port)| *port)
                        .collect(),
                };
                (s.name.clone(), held)
            })
            .collect();
        Holdings { by_name }
    }

    /// What instance `name` holds, if it runs.
    pub fn get(&self, name: &str) -> Option<&Held> {
        self.by_name.get(name)
    }

    /// Every running instance and what it holds.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Held)> {
        self.by_name.iter()
    }

    /// True when no engine runs (a fresh cluster).
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}
