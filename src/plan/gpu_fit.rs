//! Whether the planned engines fit in the memory their GPUs have free.
//!
//! vLLM refuses to start when a GPU has less free memory than `gpu_memory_utilization`
//! of its total; with instances sharing a GPU the shares add up. Pure: `plan` asks it with
//! NVML's inventory (when there is one) and `up` asks it again just before starting.

use crate::gpu::Gpu;
use crate::vocab::Service;
use std::collections::BTreeMap;

/// One GPU the services planned on it do not fit: what they ask, what is free, who holds
/// the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct Shortfall {
    pub gpu: u32,
    /// The services and the fraction of the GPU each asks for.
    pub asked: Vec<(String, f64)>,
    pub total_mib: u64,
    pub free_mib: u64,
    /// Compute processes already on the GPU.
    pub holders: Vec<u32>,
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sum: f64 = self.asked.iter().map(|(_, s)| s).sum();
        let who: Vec<String> = self.asked.iter().map(|(n, s)| format!("{n} {s}")).collect();
        write!(
            f,
            "GPU {} has {} MiB free of {} MiB, and {} will take {:.0} MiB of it ({})",
            self.gpu,
            self.free_mib,
            self.total_mib,
            who.join(" + "),
            sum * self.total_mib as f64,
            if self.holders.is_empty() {
                "no compute process holds the rest; another user's context or a display may"
                    .to_string()
            } else {
                format!(
                    "the rest is held by pid {}",
                    self.holders
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        )
    }
}

/// The GPUs of `inventory` whose free memory cannot hold the shares the services of
/// `node` ask for. GPUs whose memory is unknown (declared with `--gpus`) are not judged.
pub fn check<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    inventory: &[Gpu],
) -> Vec<Shortfall> {
    let mut asked: BTreeMap<u32, Vec<(String, f64)>> = BTreeMap::new();
    for s in services {
        if let Some(share) = s.gpu_memory_share {
            for g in &s.gpus {
                asked.entry(*g).or_default().push((s.name.clone(), share));
            }
        }
    }
    let mut out = Vec::new();
    for (gpu, who) in asked {
        let Some(g) = inventory.iter().find(|g| g.index == gpu) else {
            continue;
        };
        let (Some(total), Some(used)) = (g.memory_total_mib, g.memory_used_mib) else {
            continue;
        };
        let free = total.saturating_sub(used);
        let want: f64 = who.iter().map(|(_, s)| s).sum::<f64>() * total as f64;
        if want > free as f64 {
            out.push(Shortfall {
                gpu,
                asked: who,
                total_mib: total,
                free_mib: free,
                holders: g.processes.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(name: &str, gpu: u32, share: f64) -> Service {
        let mut s: Service = serde_json::from_value(serde_json::json!({
            "name": name, "role": "decode", "node": "local", "host": "127.0.0.1",
            "argv": ["x"], "env": {}, "gpus": [gpu], "ports": {}, "files": [],
            "depends_on": [], "probe": {"kind": "tcp", "host": "127.0.0.1", "port": 1},
            "url": null, "startup_timeout_s": 1,
            "restart": {"mode": "never", "backoff_initial_ms": 1, "backoff_max_ms": 1,
                        "max_restarts": 1, "window_s": 1, "liveness_failures": 1},
            "restart_with": [], "shutdown": {"signal": "SIGTERM", "timeout_s": 1}, "dirs": []
        }))
        .unwrap();
        s.gpu_memory_share = Some(share);
        s
    }

    fn gpu(index: u32, total: u64, used: u64, pids: &[u32]) -> Gpu {
        Gpu {
            index,
            uuid: None,
            name: Some("H100".into()),
            memory_total_mib: Some(total),
            memory_used_mib: Some(used),
            processes: pids.to_vec(),
        }
    }

    #[test]
    fn shares_of_one_gpu_add_up_against_its_free_memory() {
        let both = [engine("prefill-0", 0, 0.45), engine("decode-0", 0, 0.45)];
        // 80 GiB, 1 GiB used: 0.9 of it fits.
        assert!(check(&both, &[gpu(0, 81920, 1024, &[])]).is_empty());
        // 20 GiB used by someone else: 72 GiB asked, 60 GiB free.
        let short = check(&both, &[gpu(0, 81920, 20480, &[4242])]);
        assert_eq!(short.len(), 1);
        let text = short[0].to_string();
        assert!(
            text.starts_with("GPU 0 has 61440 MiB free of 81920 MiB"),
            "{text}"
        );
        assert!(text.contains("prefill-0 0.45 + decode-0 0.45"), "{text}");
        assert!(text.contains("pid 4242"), "{text}");
    }

    #[test]
    fn gpus_of_unknown_memory_are_not_judged() {
        let one = [engine("decode-0", 0, 0.9)];
        assert!(check(&one, &[Gpu::declared(0)]).is_empty());
    }
}
