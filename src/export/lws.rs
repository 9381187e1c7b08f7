//! LeaderWorkerSets (`leaderworkerset.x-k8s.io/v1`) for the engine roles, Deployments for
//! the proxy and the support services. Each engine instance is one group of `size: 1`: the
//! plan runs an instance as one process, so its pod is the group's leader; groups of more
//! pods (tensor parallel across nodes) need a Ray bootstrap the plan does not describe.

use super::{LWS_API_VERSION, Manifests, Options, Parts, k8s_name, metadata, selector};
use serde_json::json;

/// One LeaderWorkerSet per engine role and one Deployment per other role, after the
/// ConfigMaps and Services they use.
pub fn manifests(parts: Parts, o: &Options) -> Manifests {
    let mut documents = parts.objects;
    let mut warnings = parts.warnings;
    let mut ordered = false;
    for r in &parts.roles {
        let object = k8s_name(&format!("{}-{}", parts.name, r.role.as_str()), 63);
        ordered |= !r.depends_on.is_empty();
        if r.role.is_engine() {
            documents.push(json!({
                "apiVersion": LWS_API_VERSION,
                "kind": "LeaderWorkerSet",
                "metadata": metadata(&parts.name, &object, Some(r.role), o),
                "spec": {
                    "replicas": r.replicas,
                    "startupPolicy": "LeaderCreated",
                    "leaderWorkerTemplate": {
                        "size": 1,
                        "restartPolicy": "RecreateGroupOnPodRestart",
                        "workerTemplate": r.template,
                    },
                },
            }));
        } else {
            documents.push(json!({
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": metadata(&parts.name, &object, Some(r.role), o),
                "spec": {
                    "replicas": r.replicas,
                    "selector": {"matchLabels": selector(&parts.name, r.role)},
                    "template": r.template,
                },
            }));
        }
    }
    if ordered {
        warnings.push(
            "--format lws has no start order: a pod that starts before what it needs (etcd, the master) fails and is restarted by Kubernetes until it is there; --format rbg keeps the plan's order".into(),
        );
    }
    Manifests {
        documents,
        rewrites: parts.rewrites,
        warnings,
    }
}
