//! What each local service's processes use, for `pdctl status`: CPU and resident memory
//! (sysinfo, read from `/proc`) of the service's process and every process below it, as
//! vLLM's API server starts an EngineCore process (and workers with tensor parallelism)
//! that holds most of the memory; and the GPU memory NVML reports for those processes.
//!
//! A background task of the supervisor samples every [`SAMPLE_EVERY`], never per status
//! request: CPU use is the time spent between two samples, so a service's first sample
//! has none.

use crate::gpu::ProcessMemory;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// How often the supervisor samples: often enough for a person watching `status`, rare
/// enough that reading every process's `/proc` entries costs nothing noticeable.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// The use of one service's process tree at the last sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Percent of one core (200 = two cores busy) since the previous sample; `None` at the
    /// first sample of this process.
    pub cpu_percent: Option<f32>,
    /// Resident memory, in bytes (memory shared between the processes counted in each).
    pub rss_bytes: u64,
    /// GPU memory held, in bytes; `None` without NVML or when NVML lists none of them.
    pub gpu_memory_bytes: Option<u64>,
}

/// Keeps what the previous sample saw (sysinfo's CPU figures are differences).
pub struct Sampler {
    system: System,
    gpu: Option<ProcessMemory>,
    /// Processes known at the previous sample.
    seen: HashSet<Pid>,
}

impl Sampler {
    /// A sampler that has seen nothing yet; NVML is opened here, once, when there is one.
    /// Fails where sysinfo cannot read processes at all (no `/proc`).
    pub fn new() -> Result<Sampler, sysinfo::Error> {
        Ok(Sampler {
            system: System::new()?,
            gpu: ProcessMemory::open(),
            seen: HashSet::new(),
        })
    }

    /// Reads every process once and returns the use of the tree below each of `roots`
    /// (their pids); a root that no longer runs is left out.
    pub fn sample(&mut self, roots: &[u32]) -> HashMap<u32, Usage> {
        self.system.refresh_processes_specifics(
            ProcessesToUpdate::All,
            true,
            ProcessRefreshKind::nothing()
                .with_cpu()
                .with_memory()
                .without_tasks(),
        );
        let processes = self.system.processes();
        let mut children: HashMap<Pid, Vec<Pid>> = HashMap::new();
        for (pid, p) in processes {
            if p.thread_kind().is_none()
                && let Some(parent) = p.parent()
            {
                children.entry(parent).or_default().push(*pid);
            }
        }
        let gpu = self.gpu.as_ref().map(ProcessMemory::by_pid);
        let mut out = HashMap::new();
        for &root in roots {
            let root_pid = Pid::from_u32(root);
            if !processes.contains_key(&root_pid) {
                continue;
            }
            let mut tree = vec![root_pid];
            let mut seen_here = HashSet::from([root_pid]);
            let mut i = 0;
            while i < tree.len() {
                for c in children.get(&tree[i]).into_iter().flatten() {
                    if seen_here.insert(*c) {
                        tree.push(*c);
                    }
                }
                i += 1;
            }
            let mut usage = Usage {
                cpu_percent: self.seen.contains(&root_pid).then_some(0.0),
                rss_bytes: 0,
                gpu_memory_bytes: None,
            };
            for pid in &tree {
                let p = &processes[pid];
                if let Some(cpu) = usage.cpu_percent.as_mut() {
                    *cpu += p.cpu_usage();
                }
                usage.rss_bytes += p.memory();
                if let Some(bytes) = gpu.as_ref().and_then(|g| g.get(&pid.as_u32())) {
                    *usage.gpu_memory_bytes.get_or_insert(0) += bytes;
                }
            }
            out.insert(root, usage);
        }
        self.seen = processes.keys().copied().collect();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    /// Kills the child (and its shell's busy child) when the test ends, pass or fail.
    struct Reap(Child, u32);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = Command::new("kill").arg(self.1.to_string()).status();
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_tree_is_summed_and_cpu_comes_from_the_second_sample() {
        // A shell that waits, and below it a busy loop holding a 32 MiB string: the
        // root itself uses next to nothing, its child does.
        let child = Command::new("sh")
            .args([
                "-c",
                r#"sh -c 'x=$(head -c 33554432 /dev/zero | tr "\0" a); while :; do :; done' & echo $!; wait"#,
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let root = child.id();
        let mut out = child;
        let busy: u32 = {
            use std::io::BufRead;
            let mut line = String::new();
            std::io::BufReader::new(out.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            line.trim().parse().unwrap()
        };
        let _reap = Reap(out, busy);
        let me = std::process::id();
        let mut s = Sampler::new().unwrap();
        let first = s.sample(&[me, root, 4_000_000_000]);
        assert!(
            !first.contains_key(&4_000_000_000),
            "a gone root is left out"
        );
        assert_eq!(
            first[&root].cpu_percent, None,
            "no CPU figure from one sample"
        );
        // The child builds its string first (well under a second alone; the wait is
        // generous for a loaded machine), then loops.
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while s.sample(&[busy])[&busy].rss_bytes <= 32 << 20 && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(500));
        }
        // A whole interval of the busy loop alone.
        std::thread::sleep(Duration::from_secs(1));
        let second = s.sample(&[me, root, busy]);
        let (tree, alone) = (second[&root], second[&busy]);
        assert!(
            alone.rss_bytes > 32 << 20,
            "the busy child's string: {alone:?}"
        );
        assert!(
            tree.rss_bytes > alone.rss_bytes,
            "the root's tree counts its child: {tree:?} vs {alone:?}"
        );
        let cpu = tree
            .cpu_percent
            .expect("a CPU figure from the second sample");
        assert!(
            cpu > 5.0,
            "the busy child's CPU counts in its root's tree: {cpu}"
        );
        // This test's process is the shell's parent: its tree holds them both.
        assert!(second[&me].rss_bytes > tree.rss_bytes, "{:?}", second[&me]);
        if ProcessMemory::open().is_none() {
            assert_eq!(tree.gpu_memory_bytes, None, "no NVML, no GPU figure");
        }
    }
}
