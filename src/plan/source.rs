//! What a running cluster was made from, kept in its state dir (`topology.json`) so that
//! `pdctl scale` can plan the same cluster again with other instance counts, and `apply`
//! can say what it changes: the topology's text, what it is called, the GPUs declared with
//! `--gpus`, and the counts `scale` set since.

use crate::topology::{self, LoadedTopology, Source, TopologyError};
use crate::vocab::Role;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The file in a cluster's state dir.
pub const SOURCE_FILE: &str = "topology.json";

/// A cluster's topology as it was given, and how `scale` changed it since.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSource {
    /// What errors call the topology: its path, or `<profile NAME>`.
    pub label: String,
    /// The profile's name, when it came from one.
    #[serde(default)]
    pub profile: Option<String>,
    /// The topology file's text as it was read.
    pub text: String,
    /// `--gpus` when given (else NVML is asked again).
    #[serde(default)]
    pub gpus: Option<Vec<crate::gpu::Declared>>,
    /// Instances per role set by `pdctl scale` since (`prefill`, `decode`).
    #[serde(default)]
    pub scaled: BTreeMap<String, u32>,
}

/// Why a cluster's source cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a cluster source pdctl wrote: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ClusterSource {
    /// The source of a loaded topology, as `up` keeps it: the text it was read from, with
    /// the values of the hub tokens it sets ([`hidden_env_of`]) replaced by
    /// [`HIDDEN_VALUE`], so the state dir's copy, the journal and the change requests never
    /// hold them (plans made from it again name those variables only).
    pub fn of(t: &LoadedTopology, gpus: Option<Vec<crate::gpu::Declared>>) -> ClusterSource {
        let mut text = t.locator.text().to_string();
        for value in hidden_env_of(&t.spec).values().filter(|v| !v.is_empty()) {
            for quote in ['"', '\''] {
                text = text.replace(
                    &format!("{quote}{value}{quote}"),
                    &format!("\"{HIDDEN_VALUE}\""),
                );
            }
        }
        ClusterSource {
            label: t.locator.file.clone(),
            profile: match &t.source {
                Source::Profile(name) => Some(name.clone()),
                Source::File(_) => None,
            },
            text,
            gpus,
            scaled: BTreeMap::new(),
        }
    }

    /// Reads `topology.json` of the state dir `dir`; None when the cluster has none (it
    /// was started from a plan file, or by an older pdctl).
    pub fn read(dir: &Path) -> Result<Option<ClusterSource>, SourceError> {
        let path = dir.join(SOURCE_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(SourceError::Read { path, source }),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| SourceError::Parse { path, source })
    }

    /// Writes it into the state dir `dir` (whole or not at all).
    pub fn write(&self, dir: &Path) -> Result<(), SourceError> {
        let path = dir.join(SOURCE_FILE);
        let json = serde_json::to_vec_pretty(self).expect("sources serialize");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| SourceError::Write { path, source })
    }

    /// The topology with the counts `scale` set applied and checked again.
    pub fn topology(&self) -> Result<LoadedTopology, TopologyError> {
        let source = match &self.profile {
            Some(name) => Source::Profile(name.clone()),
            None => Source::File(PathBuf::from(&self.label)),
        };
        let mut t = topology::load_str(&self.text, source, self.label.clone())?;
        for (role, n) in &self.scaled {
            match role.as_str() {
                "prefill" => t.spec.prefill.instances = *n,
                "decode" => t.spec.decode.instances = *n,
                _ => {}
            }
        }
        topology::recheck(&t)?;
        Ok(t)
    }

    /// The `[rebalance]` table as the plan carries it: what the head's rebalancer judges
    /// by while this source is kept (None: it has none).
    pub fn rebalance(&self) -> Result<Option<crate::vocab::RebalancePlan>, TopologyError> {
        let t = self.topology()?;
        Ok(t.spec
            .rebalance
            .clone()
            .map(|table| crate::vocab::RebalancePlan {
                table,
                prefill_gpus: t.spec.prefill.gpus_per_instance,
                decode_gpus: t.spec.decode.gpus_per_instance,
            }))
    }
}

/// What a kept topology says in place of a hub token's value (see [`ClusterSource::of`]).
pub const HIDDEN_VALUE: &str = "(kept secret by pdctl)";

/// The hub tokens ([`crate::vocab::HUB_TOKEN_VARS`]) the topology sets for each engine
/// role: `[engine.env]`, overridden by the role's own `env`, as the plan sets the rest.
pub fn hidden_env_of(spec: &crate::topology::Topology) -> crate::vocab::HiddenEnv {
    let mut out = crate::vocab::HiddenEnv::default();
    for (role, section) in [(Role::Prefill, &spec.prefill), (Role::Decode, &spec.decode)] {
        let vars: BTreeMap<String, String> = crate::vocab::HUB_TOKEN_VARS
            .iter()
            .filter_map(|var| {
                let value = section.env.get(*var).or(spec.engine.env.get(*var))?;
                (value != HIDDEN_VALUE).then(|| (var.to_string(), value.clone()))
            })
            .collect();
        if !vars.is_empty() {
            out.0.insert(role.as_str().to_string(), vars);
        }
    }
    out
}

/// The role a `scale` target names (`prefill`, `decode`), or None.
pub fn scalable_role(name: &str) -> Option<Role> {
    match name {
        "prefill" => Some(Role::Prefill),
        "decode" => Some(Role::Decode),
        _ => None,
    }
}
