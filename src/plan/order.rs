//! Which steps of a change go before its new capacity, and why: the one exception to
//! "start first, drain last".
//!
//! A change starts its new instances first, restarts the changed ones one at a time and
//! removes the leaving ones last, so capacity never dips. But a GPU's memory is not free
//! until the instance holding it lets go: a vLLM started there finds its memory taken and
//! fails (or takes memory it was not planned for). So, on the same node:
//!
//! - an instance leaving the plan whose GPU a starting instance takes is drained, stopped
//!   and removed first;
//! - an instance that stays on its GPU but with a smaller share of it (under
//!   `engine.instances_per_gpu`, a new instance comes to share it) is drained and restarted
//!   with that share first.
//!
//! One instance fewer serves meanwhile. Pure: the two plans and their diff in, the steps
//! that go first out.

use super::Plan;
use super::diff::PlanDiff;
use crate::vocab::Service;

/// How an instance frees the GPU memory a starting instance takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Frees {
    /// It leaves the plan: drained, stopped and removed.
    Leaves,
    /// It stays on its GPUs with a smaller share of each (`to`, a fraction of its
    /// memory): drained and restarted with it.
    Shrinks { to: f64 },
}

/// An instance that frees GPU memory before the instances that take it start.
#[derive(Debug, Clone, PartialEq)]
pub struct FreeFirst {
    /// The instance that lets go: a leaving one, or a changed one whose share shrinks.
    pub instance: String,
    /// The node it runs on.
    pub node: String,
    /// How it lets go.
    pub frees: Frees,
    /// Each instance that starts on its GPUs (added, or restarted onto them), with the
    /// GPUs of it that one takes.
    pub taken_by: Vec<(String, Vec<u32>)>,
}

impl FreeFirst {
    /// The sentence `--dry-run` and the change's progress say.
    pub fn line(&self) -> String {
        let starters: Vec<&str> = self.taken_by.iter().map(|(s, _)| s.as_str()).collect();
        let (what, verb) = match self.frees {
            Frees::Leaves => ("drained, stopped and removed".to_string(), "takes"),
            Frees::Shrinks { to } => (
                format!("drained and restarted with {to} of its GPUs"),
                "shares",
            ),
        };
        let why: Vec<String> = self
            .taken_by
            .iter()
            .map(|(s, gpus)| format!("{s} {verb} its {}", gpu_words(gpus)))
            .collect();
        format!(
            "{} is {what} before {} {}: {} (one instance fewer serves meanwhile)",
            self.instance,
            starters.join(", "),
            if starters.len() == 1 {
                "starts"
            } else {
                "start"
            },
            why.join(", ")
        )
    }
}

/// "GPU 3", "GPUs 2, 3".
fn gpu_words(gpus: &[u32]) -> String {
    let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
    format!(
        "GPU{} {}",
        if gpus.len() == 1 { "" } else { "s" },
        list.join(", ")
    )
}

/// What goes before the new capacity of `diff` (from `running` to `wanted`): each leaving
/// instance (in the diff's removal order) that holds, in `running`, a GPU of its node that
/// a starting instance is given in `wanted`; then each changed instance (in the diff's
/// order) that keeps its GPUs with a smaller share of them, one of which a starting
/// instance is given. Starting instances are the added ones and the changed ones restarted
/// onto other GPUs or onto a larger share of theirs (a GPU shared by fewer instances once
/// the change is made). Empty when nothing starts on a GPU another instance holds (the
/// simulator, vLLM on CPU, GPUs that were free).
pub fn free_first(running: &Plan, wanted: &Plan, diff: &PlanDiff) -> Vec<FreeFirst> {
    let both = |name: &str| Some((running.service(name)?, wanted.service(name)?));
    let shares = |old: &Service, new: &Service| (old.gpu_memory_share, new.gpu_memory_share);
    let moved = diff.rolled.iter().map(|(name, _)| name).filter(|name| {
        both(name).is_some_and(|(old, new)| {
            let grows = matches!(shares(old, new), (Some(was), Some(will)) if will > was);
            old.gpus != new.gpus || grows
        })
    });
    let starters: Vec<&Service> = diff
        .added
        .iter()
        .chain(moved)
        .filter_map(|name| wanted.service(name))
        .filter(|s| !s.gpus.is_empty())
        .collect();
    let mut out = Vec::new();
    for name in &diff.removed {
        let Some(old) = running.service(name) else {
            continue;
        };
        out.extend(first(old, Frees::Leaves, &starters));
    }
    for (name, _) in &diff.rolled {
        let Some((old, new)) = both(name) else {
            continue;
        };
        if let (Some(was), Some(to)) = shares(old, new)
            && to < was
            && old.gpus == new.gpus
        {
            out.extend(first(old, Frees::Shrinks { to }, &starters));
        }
    }
    out
}

/// `old` freeing its GPUs as `frees` says, when one of `starters` on its node takes one.
fn first(old: &Service, frees: Frees, starters: &[&Service]) -> Option<FreeFirst> {
    let taken_by: Vec<(String, Vec<u32>)> = starters
        .iter()
        .filter(|s| s.node == old.node && s.name != old.name)
        .filter_map(|s| {
            let shared: Vec<u32> = s
                .gpus
                .iter()
                .copied()
                .filter(|g| old.gpus.contains(g))
                .collect();
            (!shared.is_empty()).then(|| (s.name.clone(), shared))
        })
        .collect();
    (!taken_by.is_empty()).then(|| FreeFirst {
        instance: old.name.clone(),
        node: old.node.clone(),
        frees,
        taken_by,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{Role, Service};

    /// A plan of engines on node `local` unless named `node/name`, each with its GPUs.
    fn plan(engines: &[(&str, &[u32])]) -> Plan {
        let services = engines
            .iter()
            .map(|(name, gpus)| {
                let (node, name) = name.split_once('/').unwrap_or(("local", name));
                engine(node, name, gpus)
            })
            .collect();
        Plan::for_tests("local", services)
    }

    fn engine(node: &str, name: &str, gpus: &[u32]) -> Service {
        let role = if name.starts_with("prefill") {
            Role::Prefill
        } else {
            Role::Decode
        };
        let mut svc = Service::new(name, role, node, ["vllm"]);
        svc.gpus = gpus.to_vec();
        svc
    }

    fn diff_of(added: &[&str], removed: &[&str], rolled: &[&str]) -> PlanDiff {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        PlanDiff {
            added: names(added),
            removed: names(removed),
            rolled: rolled
                .iter()
                .map(|s| (s.to_string(), vec!["GPUs".to_string()]))
                .collect(),
            ..PlanDiff::default()
        }
    }

    #[test]
    fn a_leaving_instance_whose_gpu_a_new_one_takes_goes_first_and_says_why() {
        // 2P2D -> 3P1D with sticky GPUs: prefill-2 gets decode-1's GPU 3.
        let running = plan(&[
            ("prefill-0", &[0]),
            ("prefill-1", &[1]),
            ("decode-0", &[2]),
            ("decode-1", &[3]),
        ]);
        let wanted = plan(&[
            ("prefill-0", &[0]),
            ("prefill-1", &[1]),
            ("prefill-2", &[3]),
            ("decode-0", &[2]),
        ]);
        let first = free_first(
            &running,
            &wanted,
            &diff_of(&["prefill-2"], &["decode-1"], &[]),
        );
        assert_eq!(
            first,
            [FreeFirst {
                instance: "decode-1".into(),
                node: "local".into(),
                frees: Frees::Leaves,
                taken_by: vec![("prefill-2".into(), vec![3])],
            }]
        );
        assert_eq!(
            first[0].line(),
            "decode-1 is drained, stopped and removed before prefill-2 starts: prefill-2 takes its GPU 3 (one instance fewer serves meanwhile)"
        );
    }

    #[test]
    fn new_instances_on_free_gpus_leave_the_removals_last() {
        // 2P1D on 4 GPUs -> 3P0... : prefill-2 on the free GPU 3, decode-1 leaves GPU 2.
        let running = plan(&[("prefill-0", &[0]), ("decode-0", &[1]), ("decode-1", &[2])]);
        let wanted = plan(&[("prefill-0", &[0]), ("prefill-1", &[3]), ("decode-0", &[1])]);
        let d = diff_of(&["prefill-1"], &["decode-1"], &[]);
        assert_eq!(free_first(&running, &wanted, &d), []);
    }

    #[test]
    fn only_a_gpu_of_the_same_node_counts() {
        let running = plan(&[
            ("a/prefill-0", &[0]),
            ("b/decode-0", &[0]),
            ("b/decode-1", &[1]),
        ]);
        let wanted = plan(&[
            ("a/prefill-0", &[0]),
            ("a/prefill-1", &[1]),
            ("b/decode-0", &[0]),
        ]);
        let d = diff_of(&["prefill-1"], &["decode-1"], &[]);
        assert_eq!(free_first(&running, &wanted, &d), []);
        let wanted = plan(&[
            ("a/prefill-0", &[0]),
            ("b/prefill-1", &[1]),
            ("b/decode-0", &[0]),
        ]);
        let first = free_first(&running, &wanted, &d);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].node, "b");
    }

    #[test]
    fn an_instance_restarted_onto_a_leaving_ones_gpus_frees_them_first_too() {
        // decode-0 goes from one GPU to two (tensor parallel), onto decode-1's GPU 3.
        let running = plan(&[("prefill-0", &[0]), ("decode-0", &[2]), ("decode-1", &[3])]);
        let wanted = plan(&[("prefill-0", &[0]), ("decode-0", &[2, 3])]);
        let d = diff_of(&[], &["decode-1"], &["decode-0"]);
        let first = free_first(&running, &wanted, &d);
        assert_eq!(first[0].taken_by, [("decode-0".to_string(), vec![3])]);
        // A changed instance that keeps its GPUs takes nothing from anyone.
        let wanted = plan(&[("prefill-0", &[0]), ("decode-0", &[2])]);
        assert_eq!(free_first(&running, &wanted, &d), []);
    }

    #[test]
    fn an_instance_restarted_with_a_larger_share_of_a_leaving_ones_gpu_frees_it_first() {
        // prefill-2 leaves GPU 0, which it shared with prefill-0: prefill-0 is restarted
        // with all of vLLM's 0.9 instead of half of it, which it can take once prefill-2
        // has stopped.
        let mut running = plan(&[("prefill-0", &[0]), ("prefill-2", &[0]), ("decode-0", &[1])]);
        let mut wanted = plan(&[("prefill-0", &[0]), ("decode-0", &[1])]);
        running.services[0].gpu_memory_share = Some(0.45);
        wanted.services[0].gpu_memory_share = Some(0.9);
        let d = diff_of(&[], &["prefill-2"], &["prefill-0"]);
        let first = free_first(&running, &wanted, &d);
        assert_eq!(first[0].taken_by, [("prefill-0".to_string(), vec![0])]);
    }

    #[test]
    fn an_instance_whose_share_shrinks_for_a_new_one_is_restarted_first() {
        // prefill-2 comes to share GPU 0 with prefill-0, which goes from 0.9 to 0.45 of it.
        let mut running = plan(&[("prefill-0", &[0]), ("decode-0", &[1])]);
        let mut wanted = plan(&[("prefill-0", &[0]), ("prefill-2", &[0]), ("decode-0", &[1])]);
        running.services[0].gpu_memory_share = Some(0.9);
        wanted.services[0].gpu_memory_share = Some(0.45);
        let d = diff_of(&["prefill-2"], &[], &["prefill-0"]);
        let first = free_first(&running, &wanted, &d);
        assert_eq!(
            first,
            [FreeFirst {
                instance: "prefill-0".into(),
                node: "local".into(),
                frees: Frees::Shrinks { to: 0.45 },
                taken_by: vec![("prefill-2".into(), vec![0])],
            }]
        );
        assert_eq!(
            first[0].line(),
            "prefill-0 is drained and restarted with 0.45 of its GPUs before prefill-2 starts: prefill-2 shares its GPU 0 (one instance fewer serves meanwhile)"
        );
        // A share that shrinks on a GPU nothing new comes to (only the settings changed)
        // keeps its place among the changed instances.
        let d = diff_of(&[], &[], &["prefill-0"]);
        let alone = plan(&[("prefill-0", &[0]), ("decode-0", &[1])]);
        let mut smaller = alone.clone();
        smaller.services[0].gpu_memory_share = Some(0.45);
        let mut alone = alone;
        alone.services[0].gpu_memory_share = Some(0.9);
        assert_eq!(free_first(&alone, &smaller, &d), []);
    }

    #[test]
    fn several_starters_on_one_leaving_gpu_set_and_undo_mirrors_it() {
        // decode-1 held GPUs 2 and 3 (tensor parallel); two new prefills take one each.
        let running = plan(&[
            ("prefill-0", &[0]),
            ("decode-0", &[1]),
            ("decode-1", &[2, 3]),
        ]);
        let wanted = plan(&[
            ("prefill-0", &[0]),
            ("prefill-1", &[2]),
            ("prefill-2", &[3]),
            ("decode-0", &[1]),
        ]);
        let d = diff_of(&["prefill-1", "prefill-2"], &["decode-1"], &[]);
        let first = free_first(&running, &wanted, &d);
        assert_eq!(
            first[0].line(),
            "decode-1 is drained, stopped and removed before prefill-1, prefill-2 start: prefill-1 takes its GPU 2, prefill-2 takes its GPU 3 (one instance fewer serves meanwhile)"
        );
        // Undoing the change is the change from `wanted` back to `running`: the new
        // prefills go first, so decode-1 finds its GPUs free again.
        let back = diff_of(&["decode-1"], &["prefill-2", "prefill-1"], &[]);
        let first: Vec<String> = free_first(&wanted, &running, &back)
            .into_iter()
            .map(|f| f.instance)
            .collect();
        assert_eq!(first, ["prefill-2", "prefill-1"]);
    }

    #[test]
    fn engines_without_gpus_never_go_first() {
        let running = plan(&[("prefill-0", &[]), ("decode-0", &[]), ("decode-1", &[])]);
        let wanted = plan(&[("prefill-0", &[]), ("prefill-1", &[]), ("decode-0", &[])]);
        let d = diff_of(&["prefill-1"], &["decode-1"], &[]);
        assert_eq!(free_first(&running, &wanted, &d), []);
    }
}
