//! GPU inventory: what NVML says this machine has, or what the user says it has.
//!
//! Plans are made anywhere (a laptop, CI): with no NVIDIA driver, `--gpus 0,1,2,3` or
//! `PDCTL_GPUS` supplies an inventory, and `pdctl gpus` says in one line why NVML failed.

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

/// Why NVML could not give an inventory.
#[derive(Debug, thiserror::Error)]
#[error("no NVIDIA GPU inventory: {reason}")]
pub struct GpuError {
    pub reason: String,
}

/// Asks NVML for every GPU. Never panics: a machine without the driver gets an error
/// saying so in one line.
pub fn detect() -> Result<Vec<Gpu>, GpuError> {
    use nvml_wrapper::Nvml;
    let nvml = Nvml::init().map_err(|e| GpuError {
        reason: format!(
            "NVML could not be loaded ({e}); no NVIDIA driver here? Use --gpus 0,1,... or PDCTL_GPUS to plan anyway"
        ),
    })?;
    let count = nvml.device_count().map_err(|e| GpuError {
        reason: format!("NVML could not count devices: {e}"),
    })?;
    let mut gpus = Vec::with_capacity(count as usize);
    for i in 0..count {
        let dev = nvml.device_by_index(i).map_err(|e| GpuError {
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

/// The inventory to plan with: the declared indices when given, else NVML's answer.
/// `Err` carries NVML's reason so callers can say why there are no GPUs.
pub fn inventory(declared: Option<&[u32]>) -> Result<Vec<Gpu>, GpuError> {
    match declared {
        Some(list) => Ok(list.iter().copied().map(Gpu::declared).collect()),
        None if crate::vllm::ignoring_installed() => Err(GpuError {
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
        let inv = inventory(Some(&[0, 1, 3])).unwrap();
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
}
