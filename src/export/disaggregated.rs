//! One DisaggregatedSet (`disaggregatedset.x-k8s.io/v1`, LeaderWorkerSet v0.10.0's API
//! made for prefill/decode serving) holding the engine roles, and Deployments for the proxy
//! and support services.
//!
//! The DisaggregatedSet creates a LeaderWorkerSet per role and revision
//! (`<set>-<slice>-<revision>-<role>`) and rolls a template change out to all roles in
//! step, never leaving one role without the other. Each role's `spec` is a LeaderWorkerSet
//! spec, the same groups of one pod as `--format lws`. Replicas are the role's
//! `spec.replicas` (scaling mode `Static`): the set has no `scale` subresource, so a role is
//! resized by editing that field (docs/kubernetes.md says how, and how to hand a running
//! role to a DisaggregatedSetRoleScaler, which has one).

use super::{DISAGGREGATED_SET_API_VERSION, Manifests, Options, Parts, labels, lws, metadata};
use serde_json::{Value, json};

/// Deployments for the roles that are not engines, then the DisaggregatedSet, after the
/// ConfigMaps and Services they use.
pub fn manifests(parts: Parts, o: &Options) -> Manifests {
    let mut documents = parts.objects;
    let mut warnings = parts.warnings;
    let mut roles: Vec<Value> = Vec::new();
    for r in &parts.roles {
        if r.role.is_engine() {
            roles.push(json!({
                "name": r.role.as_str(),
                "metadata": {"labels": labels(&parts.name, Some(r.role))},
                "spec": lws::group_spec(r),
            }));
        } else {
            documents.push(lws::deployment(&parts.name, r, o));
        }
    }
    documents.push(json!({
        "apiVersion": DISAGGREGATED_SET_API_VERSION,
        "kind": "DisaggregatedSet",
        "metadata": metadata(&parts.name, &parts.name, None, o),
        "spec": {"roles": roles},
    }));
    if parts.roles.iter().any(|r| !r.depends_on.is_empty()) {
        warnings.push(lws::no_start_order("--format disaggregatedset"));
    }
    warnings.push(
        "--format disaggregatedset: the proxy follows prefill and decode through pdctl's Services, which select a role's ready pods of every revision, so during a rollout old and new pods are paired freely: roll out only changes under which they still understand each other (not another model, connector or KV layout)".into(),
    );
    Manifests {
        documents,
        rewrites: parts.rewrites,
        warnings,
    }
}
