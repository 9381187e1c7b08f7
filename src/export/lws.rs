//! LeaderWorkerSets (`leaderworkerset.x-k8s.io/v1`) for the engine roles, Deployments for
//! the proxy and the support services. Each engine instance is one group of `size: 1`: the
//! plan runs an instance as one process, so its pod is the group's leader; groups of more
//! pods (tensor parallel across nodes) need a Ray bootstrap the plan does not describe.
//! Both kinds have a `scale` subresource, so `kubectl scale` resizes a role.

use super::{
    LWS_API_VERSION, Manifests, Options, Parts, RolePod, metadata, selector, workload_name,
};
use serde_json::{Value, json};

/// One LeaderWorkerSet per engine role and one Deployment per other role, after the
/// ConfigMaps and Services they use.
pub fn manifests(parts: Parts, o: &Options) -> Manifests {
    let mut documents = parts.objects;
    let mut warnings = parts.warnings;
    for r in &parts.roles {
        if r.role.is_engine() {
            documents.push(json!({
                "apiVersion": LWS_API_VERSION,
                "kind": "LeaderWorkerSet",
                "metadata": metadata(&parts.name, &workload_name(&parts.name, r.role), Some(r.role), o),
                "spec": group_spec(r),
            }));
        } else {
            documents.push(deployment(&parts.name, r, o));
        }
    }
    if parts.roles.iter().any(|r| !r.depends_on.is_empty()) {
        warnings.push(no_start_order("--format lws"));
    }
    Manifests {
        documents,
        rewrites: parts.rewrites,
        warnings,
    }
}

/// The LeaderWorkerSet spec of an engine role: `replicas` groups of one pod.
pub(super) fn group_spec(r: &RolePod) -> Value {
    json!({
        "replicas": r.replicas,
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": 1,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "workerTemplate": r.template,
        },
    })
}

/// The Deployment of a role that is not an engine (proxy, etcd, mooncake-master,
/// lmcache-server).
pub(super) fn deployment(name: &str, r: &RolePod, o: &Options) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, &workload_name(name, r.role), Some(r.role), o),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector(name, r.role)},
            "template": r.template,
        },
    })
}

/// What happens without RBG's dependencies, for `format`.
pub(super) fn no_start_order(format: &str) -> String {
    format!(
        "{format} has no start order: a pod that starts before what it needs (etcd, the master) fails and is restarted by Kubernetes until it is there; --format rbg keeps the plan's order"
    )
}
