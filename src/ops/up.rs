//! `pdctl up` of a topology, from the topology to a cluster ready to start, in one pass:
//! the topology and this machine's facts about it are resolved, the cluster's state dir
//! is locked, the model this node's engines lack is fetched, and the plan is built from
//! it, each once and in that order, so the plan is sized from the model's own files and
//! no second of the download is counted in an engine's `startup_timeout_s`. The command
//! line parses the arguments and prints ([`UpSteps`]); the supervisor is handed what
//! comes out ([`Ready`]).

use crate::model_fetch::Source;
use crate::plan::Plan;
use crate::plan::resolve::{LoadedPlan, Request, Resolved};
use crate::plan::source::ClusterSource;
use crate::supervisor::{ClusterLock, StateDir};
use std::process::ExitCode;

/// What `up` shows on its way and how it applies a topology to a cluster that runs
/// already: the command line's part.
pub trait UpSteps {
    /// The cluster runs already from this state dir: the topology is applied to it
    /// instead; the exit code of that.
    fn apply_to_running(&mut self, cluster: &str) -> anyhow::Result<ExitCode>;
    /// Fetches `source` for `node`, showing its progress (and keeping it in `state` for
    /// `status`); an error is a refusal before anything starts.
    fn fetch(
        &mut self,
        source: &Source,
        node: &str,
        cluster: &str,
        state: &StateDir,
    ) -> anyhow::Result<()>;
}

/// A cluster ready to be started on this node: its plan, its state dir, and the lock
/// that keeps a second `up` out of it.
pub struct Ready {
    pub loaded: LoadedPlan,
    pub state: StateDir,
    pub lock: ClusterLock,
}

/// How `up` of a topology went before anything starts.
pub enum Up {
    /// Ready to start (boxed: a plan is large, an exit code is not).
    Ready(Box<Ready>),
    /// The cluster ran already and the topology was applied to it, with this exit code.
    Applied(ExitCode),
}

/// Resolves the topology `req` points at and this machine's facts, applies it to the
/// cluster when that runs already, else locks the state dir, fetches what this node's
/// engines lack and builds the plan: each step once, in that order.
pub fn prepare(req: &Request, steps: &mut dyn UpSteps) -> anyhow::Result<Up> {
    let resolved = Resolved::read(req)?;
    if let Some(v) = &resolved.version_note {
        return Err(anyhow::Error::new(v.refusal.clone()));
    }
    let state = StateDir::new(&resolved.state_dir);
    let root = state.dir.parent().unwrap_or(&state.dir);
    if crate::supervisor::select::running(root, Some(resolved.cluster()))?
        .is_some_and(|f| f.state.dir == state.dir)
    {
        return Ok(Up::Applied(steps.apply_to_running(resolved.cluster())?));
    }
    state.create()?;
    let lock = state.lock()?;
    if let Ok(source) = resolved.model_to_fetch() {
        steps.fetch(&source, &resolved.node, resolved.cluster(), &state)?;
    }
    let loaded = as_it_ran(resolved, req, &state)?;
    Ok(Up::Ready(Box::new(Ready {
        loaded,
        state,
        lock,
    })))
}

/// The plan, built once: after a supervisor that died without `pdctl down` (a crash, a
/// reboot, `kill -9`), given the topology it was started from, the cluster as it ran,
/// with the instance counts `pdctl scale` set since (kept in topology.json), so the node
/// comes back to what its peers run rather than shrinking the cluster; and each instance
/// on the GPUs it ran on (plan.json), as a change planned it, so the plan matches the one
/// a journaled change started from or was making (GPUs planned afresh would differ after a
/// change, and the change would be set aside). Otherwise the topology's own plan.
fn as_it_ran(resolved: Resolved, req: &Request, state: &StateDir) -> anyhow::Result<LoadedPlan> {
    let died =
        matches!(crate::supervisor::read_record(state), Ok(Some(r)) if !r.supervisor_alive());
    if !died {
        return Ok(resolved.plan()?);
    }
    let given = ClusterSource::of(&resolved.topology, req.gpus.clone());
    let held = std::fs::read_to_string(state.plan_path())
        .ok()
        .and_then(|text| serde_json::from_str::<Plan>(&text).ok())
        .map(|ran| crate::plan::Holdings::of(&ran))
        .unwrap_or_default();
    let kept = match ClusterSource::read(&state.dir) {
        Ok(Some(k)) => Some(k),
        _ => None,
    };
    let same = kept.as_ref().is_some_and(|k| {
        k.text == given.text && k.profile == given.profile && k.gpus == given.gpus
    });
    let (source, scaled) = match kept {
        Some(k) if same && !k.scaled.is_empty() => {
            let counts: Vec<String> = k.scaled.iter().map(|(r, n)| format!("{r}={n}")).collect();
            (k, Some(counts.join(" ")))
        }
        _ if held.is_empty() => return Ok(resolved.plan()?),
        _ => (given, None),
    };
    let mut again = source.plan(&resolved.node, resolved.state_root(), &held)?;
    again.source_note = match scaled {
        Some(counts) => format!(
            "{}, with the counts `pdctl scale` set ({counts}) as it ran before its supervisor died",
            resolved.source_note
        ),
        None => resolved.source_note.clone(),
    };
    again.node = resolved.node.clone();
    again.source = Some(source);
    Ok(again)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The steps `prepare` asked of the command line, in order; a fetch fails with
    /// `fetch_fails` when set.
    #[derive(Default)]
    struct Recorded {
        calls: Vec<String>,
        fetch_fails: Option<&'static str>,
    }

    impl UpSteps for Recorded {
        fn apply_to_running(&mut self, cluster: &str) -> anyhow::Result<ExitCode> {
            self.calls.push(format!("apply {cluster}"));
            Ok(ExitCode::SUCCESS)
        }

        fn fetch(
            &mut self,
            source: &Source,
            node: &str,
            cluster: &str,
            state: &StateDir,
        ) -> anyhow::Result<()> {
            let locked = matches!(
                state.lock(),
                Err(crate::supervisor::SupervisorError::AlreadyRunning { .. })
            );
            self.calls.push(format!(
                "fetch {} on {node} of {cluster} (locked: {locked})",
                source.model
            ));
            match self.fetch_fails {
                Some(why) => anyhow::bail!("{why}"),
                None => Ok(()),
            }
        }
    }

    fn vllm_topology(dir: &std::path::Path) -> std::path::PathBuf {
        let file = dir.join("t.toml");
        let text = format!(
            "cluster = \"fetching\"\n[model]\nname = \"org/tiny\"\nmax_model_len = 4096\n\
             [engine]\nvllm_version = \"0.26.0\"\ndevice = \"cpu\"\npython = \"{}\"\n\
             [engine.env]\nHF_ENDPOINT = \"http://127.0.0.1:9\"\nHF_HUB_CACHE = \"{}\"\n\
             [connector]\nkind = \"nixl\"\n",
            dir.join("no-python").display(),
            dir.join("hub").display()
        );
        std::fs::write(&file, text).unwrap();
        file
    }

    #[test]
    fn a_simulated_cluster_is_planned_without_a_fetch_under_a_lock_a_second_up_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let req = Request {
            profile: Some("sim-1p1d".into()),
            state_dir: Some(root.path().to_path_buf()),
            ..Request::default()
        };
        let mut steps = Recorded::default();
        let Up::Ready(ready) = prepare(&req, &mut steps).unwrap() else {
            panic!("nothing runs yet, so nothing is applied");
        };
        assert!(steps.calls.is_empty(), "{:?}", steps.calls);
        assert_eq!(ready.state.dir, root.path().join("sim-1p1d"));
        assert_eq!(ready.loaded.plan.state_dir, ready.state.dir);
        assert!(!ready.loaded.plan.services.is_empty());
        let second = prepare(&req, &mut steps).err().expect("the lock is held");
        assert!(
            matches!(
                second.downcast_ref(),
                Some(crate::supervisor::SupervisorError::AlreadyRunning { .. })
            ),
            "{second:#}"
        );
    }

    #[test]
    fn the_missing_model_is_fetched_once_under_the_lock_and_a_refused_fetch_plans_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let req = Request {
            file: Some(vllm_topology(dir.path())),
            state_dir: Some(dir.path().join("state")),
            ..Request::default()
        };
        let mut steps = Recorded {
            fetch_fails: Some("org/tiny is gated"),
            ..Recorded::default()
        };
        let e = prepare(&req, &mut steps).err().expect("the fetch refused");
        assert_eq!(e.to_string(), "org/tiny is gated");
        assert_eq!(
            steps.calls,
            ["fetch org/tiny on local of fetching (locked: true)"]
        );
    }

    #[test]
    fn a_node_the_topology_lacks_is_refused_before_any_state_dir_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let req = Request {
            file: Some(vllm_topology(dir.path())),
            state_dir: Some(dir.path().join("state")),
            node: Some("elsewhere".into()),
            ..Request::default()
        };
        let mut steps = Recorded::default();
        let e = prepare(&req, &mut steps).err().expect("no such node");
        assert!(
            format!("{e:#}").contains("--node elsewhere is not a node"),
            "{e:#}"
        );
        assert!(steps.calls.is_empty());
        assert!(!dir.path().join("state").exists());
    }
}
