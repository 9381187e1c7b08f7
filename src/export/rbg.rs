//! One RoleBasedGroup (RBG, `workloads.x-k8s.io/v1alpha2`) holding every role of the plan:
//! RBG starts a role only after the roles it depends on are ready, which is the plan's
//! start order, and scales each role by its `replicas`.
//!
//! The RoleBasedGroup CRD has no `scale` subresource, so `kubectl scale` cannot reach a
//! role; each scalable role gets `scalingAdapter.enable`, for which RBG creates a
//! RoleBasedGroupScalingAdapter named `<group>-<role>` that has one
//! (`kubectl scale rolebasedgroupscalingadapter <group>-<role> --replicas=N`).

use super::{Manifests, Options, Parts, RBG_API_VERSION, metadata};
use serde_json::{Value, json};

/// The RoleBasedGroup after the ConfigMaps and Services it uses.
pub fn manifests(parts: Parts, o: &Options) -> Manifests {
    let roles: Vec<Value> = parts
        .roles
        .iter()
        .map(|r| {
            let mut role = json!({
                "name": r.role.as_str(),
                "replicas": r.replicas,
                "standalonePattern": {"template": r.template},
            });
            if !r.depends_on.is_empty() {
                role["dependencies"] = json!(r.depends_on);
            }
            if r.scalable {
                role["scalingAdapter"] = json!({"enable": true});
            }
            role
        })
        .collect();
    let group = json!({
        "apiVersion": RBG_API_VERSION,
        "kind": "RoleBasedGroup",
        "metadata": metadata(&parts.name, &parts.name, None, o),
        "spec": {"roles": roles},
    });
    let mut documents = parts.objects;
    documents.push(group);
    Manifests {
        documents,
        rewrites: parts.rewrites,
        warnings: parts.warnings,
    }
}
