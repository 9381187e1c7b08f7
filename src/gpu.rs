//! GPU inventory: what NVML says this machine has, or what the user says it has.
//!
//! Plans are made anywhere (a laptop, CI): with no NVIDIA driver, `--gpus 0,1,2,3` or
//! `PDCTL_GPUS` supplies an inventory, and `pdctl gpus` says in one line why NVML failed.
//! A GPU may be declared with the memory to plan with (`--gpus 0:80GiB`): engines sharing it
//! then get their KV cache size from it, as they would from NVML's free memory.

use serde::{Deserialize, Serialize};

/// One GPU as the planner and `pdctl gpus` see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    /// None when the inventory came from `--gpus` rather than NVML.
    pub uuid: Option<String>,
    pub name: Option<String>,
    pub memory_total_mib: Option<u64>,
    pub memory_used_mib: Option<u64>,
    /// PIDs of compute processes already on this GPU (someone else's vLLM, say).
    pub processes: Vec<u32>,
}

impl Gpu {
    /// A GPU known only by its index (from `--gpus`).
    pub fn declared(index: u32) -> Gpu {
        Gpu {
            index,
            uuid: None,
            name: None,
            memory_total_mib: None,
            memory_used_mib: None,
            processes: Vec::new(),
        }
    }

    /// A GPU as the user declares it: by index, with the memory to plan with when given
    /// (taken as free: nothing else is known to hold any of it).
    pub fn from_declared(d: &Declared) -> Gpu {
        let mut g = Gpu::declared(d.index);
        if let Some(mib) = d.memory_mib {
            g.memory_total_mib = Some(mib);
            g.memory_used_mib = Some(0);
        }
        g
    }

    /// MiB of memory free for new engines, when known (NVML's total less what is used, or
    /// the size declared with `--gpus N:SIZE`).
    pub fn free_mib(&self) -> Option<u64> {
        match (self.memory_total_mib, self.memory_used_mib) {
            (Some(total), Some(used)) => Some(total.saturating_sub(used)),
            _ => None,
        }
    }

    /// Why this GPU may be a poor choice, if it may: busy with other processes, or little
    /// free memory (under a quarter of its total).
    pub fn busy_reason(&self) -> Option<String> {
        if !self.processes.is_empty() {
            return Some(format!(
                "GPU {} already runs {} compute process(es) (pid {})",
                self.index,
                self.processes.len(),
                self.processes
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        match (self.memory_total_mib, self.memory_used_mib) {
            (Some(total), Some(used)) if total > 0 && (total - used.min(total)) * 4 < total => {
                Some(format!(
                    "GPU {} has only {} MiB of {} MiB free",
                    self.index,
                    total - used.min(total),
                    total
                ))
            }
            _ => None,
        }
    }
}

/// One GPU of `--gpus` / `PDCTL_GPUS`: `2`, or `2:80GiB` with the memory to plan with
/// (planning without NVML, the KV cache of engines sharing that GPU is sized from it).
/// Kept in a running cluster's `topology.json` as its text, e.g. `"2:81920MiB"` (an index
/// alone is kept as a number, as older pdctl wrote it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    pub index: u32,
    /// The memory to plan with, in MiB.
    pub memory_mib: Option<u64>,
}

impl From<u32> for Declared {
    fn from(index: u32) -> Declared {
        Declared {
            index,
            memory_mib: None,
        }
    }
}

/// A `--gpus` entry that is not `INDEX` or `INDEX:SIZE`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a GPU: write its index (0) or its index and memory (0:80GiB, 0:81920MiB)")]
pub struct BadDeclared(pub String);

impl std::str::FromStr for Declared {
    type Err = BadDeclared;
    fn from_str(s: &str) -> Result<Declared, BadDeclared> {
        let bad = || BadDeclared(s.to_string());
        let (index, size) = match s.trim().split_once(':') {
            Some((i, m)) => (i, Some(m)),
            None => (s.trim(), None),
        };
        let index = index.trim().parse().map_err(|_| bad())?;
        let memory_mib = match size {
            None => None,
            Some(m) => Some(mebibytes(m).ok_or_else(bad)?),
        };
        Ok(Declared { index, memory_mib })
    }
}

impl std::fmt::Display for Declared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.memory_mib {
            Some(m) => write!(f, "{}:{m}MiB", self.index),
            None => write!(f, "{}", self.index),
        }
    }
}

impl Serialize for Declared {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.memory_mib {
            None => s.serialize_u32(self.index),
            Some(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Declared {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Declared, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Index(u32),
            Text(String),
        }
        match Form::deserialize(d)? {
            Form::Index(i) => Ok(Declared::from(i)),
            Form::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `80GiB`, `80GB`, `81920MiB`, `1.5TiB` in MiB (binary units, as nvidia-smi counts: GB is
/// read as GiB); None when it is no size or zero.
fn mebibytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().ok()?;
    let per_unit: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "M" | "MB" | "MIB" => 1.0,
        "G" | "GB" | "GIB" => 1024.0,
        "T" | "TB" | "TIB" => 1024.0 * 1024.0,
        _ => return None,
    };
    let mib = (n * per_unit) as u64;
    (mib > 0).then_some(mib)
}

/// Why NVML could not give an inventory.
#[derive(Debug, thiserror::Error)]
#[error("no NVIDIA GPU inventory: {reason}")]
pub struct GpuError {
    /// Which way it failed, for callers that say it differently (no driver at all).
    pub kind: GpuErrorKind,
    pub reason: String,
}

/// Which way asking NVML failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuErrorKind {
    /// NVML could not be loaded: no NVIDIA driver here.
    NoDriver,
    /// NVML answered, with an error (counting or opening a device).
    Nvml,
    /// NVML was not asked (`PDCTL_IGNORE_INSTALLED` is set).
    NotAsked,
}

/// Asks NVML for every GPU. Never panics: a machine without the driver gets an error
/// saying so in one line.
pub fn detect() -> Result<Vec<Gpu>, GpuError> {
    use nvml_wrapper::Nvml;
    let nvml = Nvml::init().map_err(|e| GpuError {
        kind: GpuErrorKind::NoDriver,
        reason: format!(
            "NVML could not be loaded ({e}); no NVIDIA driver here? Use --gpus 0,1,... or PDCTL_GPUS to plan anyway"
        ),
    })?;
    let count = nvml.device_count().map_err(|e| GpuError {
        kind: GpuErrorKind::Nvml,
        reason: format!("NVML could not count devices: {e}"),
    })?;
    let mut gpus = Vec::with_capacity(count as usize);
    for i in 0..count {
        let dev = nvml.device_by_index(i).map_err(|e| GpuError {
            kind: GpuErrorKind::Nvml,
            reason: format!("NVML could not open GPU {i}: {e}"),
        })?;
        let mem = dev.memory_info().ok();
        gpus.push(Gpu {
            index: i,
            uuid: dev.uuid().ok(),
            name: dev.name().ok(),
            memory_total_mib: mem.as_ref().map(|m| m.total / (1024 * 1024)),
            memory_used_mib: mem.as_ref().map(|m| m.used / (1024 * 1024)),
            processes: dev
                .running_compute_processes()
                .map(|ps| ps.into_iter().map(|p| p.pid).collect())
                .unwrap_or_default(),
        });
    }
    Ok(gpus)
}

/// NVML kept open to ask, every few seconds, how much GPU memory each process holds (the
/// supervisor's usage sampler, `pdctl status`); opening NVML costs more than asking.
pub struct ProcessMemory {
    nvml: nvml_wrapper::Nvml,
}

impl ProcessMemory {
    /// NVML, or `None` on a machine without an NVIDIA driver (or with
    /// [`crate::vllm::IGNORE_INSTALLED_ENV`] set, as for planning).
    pub fn open() -> Option<ProcessMemory> {
        if crate::vllm::ignoring_installed() {
            return None;
        }
        nvml_wrapper::Nvml::init()
            .ok()
            .map(|nvml| ProcessMemory { nvml })
    }

    /// Bytes of GPU memory per pid, summed over every GPU, for the processes NVML lists
    /// (compute and graphics, a process in both counted once per GPU); a process NVML
    /// gives no figure for is left out.
    pub fn by_pid(&self) -> std::collections::HashMap<u32, u64> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let mut out = std::collections::HashMap::new();
        let count = self.nvml.device_count().unwrap_or(0);
        for dev in (0..count).filter_map(|i| self.nvml.device_by_index(i).ok()) {
            let compute = dev.running_compute_processes().unwrap_or_default();
            let graphics = dev.running_graphics_processes().unwrap_or_default();
            let on_this_gpu: std::collections::HashMap<u32, u64> = compute
                .into_iter()
                .chain(graphics)
                .filter_map(|p| match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some((p.pid, bytes)),
                    UsedGpuMemory::Unavailable => None,
                })
                .collect();
            for (pid, bytes) in on_this_gpu {
                *out.entry(pid).or_insert(0) += bytes;
            }
        }
        out
    }
}

/// The inventory to plan with: the declared GPUs when given, else NVML's answer.
/// `Err` carries NVML's reason so callers can say why there are no GPUs.
pub fn inventory(declared: Option<&[Declared]>) -> Result<Vec<Gpu>, GpuError> {
    match declared {
        Some(list) => Ok(list.iter().map(Gpu::from_declared).collect()),
        None if crate::vllm::ignoring_installed() => Err(GpuError {
            kind: GpuErrorKind::NotAsked,
            reason: format!(
                "NVML is not asked because {} is set; use --gpus 0,1,... or PDCTL_GPUS to plan with GPUs",
                crate::vllm::IGNORE_INSTALLED_ENV
            ),
        }),
        None => detect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_inventory_needs_no_driver() {
        let inv = inventory(Some(&[0.into(), 1.into(), 3.into()])).unwrap();
        assert_eq!(
            inv.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 1, 3]
        );
        assert!(inv.iter().all(|g| g.busy_reason().is_none()));
    }

    #[test]
    fn busy_gpus_are_named() {
        let mut g = Gpu::declared(2);
        g.processes = vec![4242];
        assert!(g.busy_reason().unwrap().contains("pid 4242"));
        let mut full = Gpu::declared(1);
        full.memory_total_mib = Some(80_000);
        full.memory_used_mib = Some(70_000);
        assert!(
            full.busy_reason()
                .unwrap()
                .contains("10000 MiB of 80000 MiB free")
        );
    }

    #[test]
    fn a_declared_gpu_may_carry_its_memory() {
        let d: Declared = "1:80GiB".parse().unwrap();
        assert_eq!(d.index, 1);
        assert_eq!(d.memory_mib, Some(81920));
        let g = Gpu::from_declared(&d);
        assert_eq!(g.free_mib(), Some(81920));
        assert_eq!(
            "0:81920MiB".parse::<Declared>().unwrap().memory_mib,
            Some(81920)
        );
        assert_eq!("2".parse::<Declared>().unwrap(), Declared::from(2));
        assert_eq!(Gpu::from_declared(&Declared::from(2)).free_mib(), None);
        for bad in ["x", "0:", "0:80", "0:lots", "0:0GiB", "-1"] {
            assert!(bad.parse::<Declared>().is_err(), "{bad}");
        }
        // Kept in topology.json as a number (as older pdctl wrote it) or as its text.
        let kept: Vec<Declared> = serde_json::from_str(r#"[0, "1:80GiB"]"#).unwrap();
        assert_eq!(kept, vec![Declared::from(0), d]);
        assert_eq!(serde_json::to_string(&kept).unwrap(), r#"[0,"1:81920MiB"]"#);
    }
}
