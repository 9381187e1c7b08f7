//! `pdctl export k8s`: every built-in profile exports in all three formats; every document
//! is valid for the API it targets (RoleBasedGroup v1alpha2 of RBG v0.7.0, LeaderWorkerSet
//! v1 and DisaggregatedSet v1 of LWS v0.10.0, Kubernetes' own kinds); each role's command is
//! the plan's argv but for the documented rewrites; no Service takes a name a controller
//! creates or adopts; every image names a version; the proxy is ready only when engines
//! are; what a pod cannot express is said.
//!
//! Schemas: Kubernetes' own kinds (PodTemplateSpec, Service, ConfigMap, Deployment,
//! ObjectMeta) come from the k8s-openapi crate's JSON schemas (schemars), written once to
//! tests/data/k8s/core-schemas.json by tools/k8s-schemas (so the test build does not
//! compile k8s-openapi; rerun the tool when its pin moves). The RBG and LWS
//! wrappers are tests/data/k8s/*.yaml (see the README there), written in a CRD's
//! openAPIV3Schema dialect, which [`openapi_to_json_schema`] converts for the `jsonschema`
//! crate:
//! - an object schema with `properties` but no `additionalProperties` and no
//!   `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`: the API
//!   server prunes, and `kubectl apply` (strict field validation) refuses, unknown fields;
//! - `nullable: true` adds `"null"` to the type;
//! - `x-kubernetes-int-or-string` without `anyOf` becomes `anyOf: [integer, string]`;
//! - `format` (int32, int64, quantity ...) is dropped: not JSON Schema formats;
//! - `x-kubernetes-validations` (CEL rules), list types and map keys are dropped: they
//!   need an API server to check.
//!
//! With `PDCTL_K8S_CRD_DIR` naming a directory that holds the upstream CRD files
//! (`workloads.x-k8s.io_rolebasedgroups.yaml`, `leaderworkerset.x-k8s.io_leaderworkersets.yaml`,
//! `disaggregatedset.x-k8s.io_disaggregatedsets.yaml`), every document is also checked
//! against their full openAPIV3Schema, converted the same way.

use crate::common;

use common::pdctl;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// Every built-in profile.
fn profiles() -> Vec<&'static str> {
    pdctl::profiles::ALL.iter().map(|p| p.name).collect()
}

/// Every `--format`.
const FORMATS: [&str; 3] = ["rbg", "lws", "disaggregatedset"];

/// Runs `pdctl export k8s` with `args`: stdout, stderr, exit code.
fn export(args: &[&str]) -> (String, String, i32) {
    let mut full = vec!["export", "k8s"];
    full.extend_from_slice(args);
    let out = pdctl(&full).output().unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

/// The documents of a YAML stream.
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).expect("every document is YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Exports `profile` in `format` (exit 0 asserted) and parses the documents.
fn exported(profile: &str, format: &str) -> (Vec<Value>, String) {
    let (out, err, code) = export(&["-p", profile, "--format", format, "-o", "-"]);
    assert_eq!(code, 0, "export k8s -p {profile} --format {format}: {err}");
    (documents(&out), err)
}

/// The plan of `profile` as `pdctl plan --json` prints it, planned with the state root the
/// export uses (so paths agree) and GPUs enough for every instance.
fn plan(profile: &str) -> Value {
    let json = common::stdout_of(&mut pdctl(&[
        "plan",
        "-p",
        profile,
        "--json",
        "--state-dir",
        "/var/lib/pdctl",
        "--gpus",
        "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
    ]));
    serde_json::from_str(&json).unwrap()
}

// ---------------------------------------------------------------- schemas

/// Converts an openAPIV3Schema (CRD dialect) in place into JSON Schema the validator
/// checks the way the API server does (see the module comment for each rule).
fn openapi_to_json_schema(s: &mut Value) {
    let Some(obj) = s.as_object_mut() else {
        return;
    };
    if obj.remove("nullable") == Some(Value::Bool(true))
        && let Some(t) = obj.get("type").cloned()
    {
        obj.insert("type".into(), json!([t, "null"]));
    }
    for k in [
        "format",
        "x-kubernetes-validations",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
        "x-kubernetes-embedded-resource",
    ] {
        obj.remove(k);
    }
    if obj.remove("x-kubernetes-int-or-string") == Some(Value::Bool(true))
        && !obj.contains_key("anyOf")
    {
        obj.insert(
            "anyOf".into(),
            json!([{"type": "integer"}, {"type": "string"}]),
        );
    }
    let open = obj.remove("x-kubernetes-preserve-unknown-fields") == Some(Value::Bool(true));
    if obj.contains_key("properties") && !obj.contains_key("additionalProperties") && !open {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "$defs", "definitions"] {
        if let Some(Value::Object(map)) = obj.get_mut(key) {
            map.values_mut().for_each(openapi_to_json_schema);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(v) = obj.get_mut(key) {
            openapi_to_json_schema(v);
        }
    }
    for key in ["anyOf", "allOf", "oneOf", "prefixItems"] {
        if let Some(Value::Array(list)) = obj.get_mut(key) {
            list.iter_mut().for_each(openapi_to_json_schema);
        }
    }
}

/// The schema of a Kubernetes kind from tests/data/k8s/core-schemas.json (k8s-openapi's,
/// written by tools/k8s-schemas), split into its body and its `$defs`.
fn core_schema(kind: &str) -> (Value, serde_json::Map<String, Value>) {
    static ALL: OnceLock<Value> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        let path = format!(
            "{}/tests/data/k8s/core-schemas.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    });
    let mut v = all
        .get(kind)
        .unwrap_or_else(|| panic!("core-schemas.json has no {kind}: rerun tools/k8s-schemas"))
        .clone();
    let defs = v
        .as_object_mut()
        .unwrap()
        .remove("$defs")
        .and_then(|d| d.as_object().cloned())
        .unwrap_or_default();
    v.as_object_mut().unwrap().remove("$schema");
    (v, defs)
}

/// Replaces the `x-pdctl-pod-template` / `x-pdctl-object-meta` markers of a wrapper schema
/// by Kubernetes' schemas (whose `$defs` the caller puts at the root).
fn fill_markers(s: &mut Value, pod: &Value, meta: &Value) {
    if s.get("x-pdctl-pod-template") == Some(&Value::Bool(true)) {
        *s = pod.clone();
        return;
    }
    if s.get("x-pdctl-object-meta") == Some(&Value::Bool(true)) {
        *s = meta.clone();
        return;
    }
    match s {
        Value::Object(m) => m.values_mut().for_each(|v| fill_markers(v, pod, meta)),
        Value::Array(a) => a.iter_mut().for_each(|v| fill_markers(v, pod, meta)),
        _ => {}
    }
}

/// Compiled validators by kind.
fn validators() -> &'static BTreeMap<&'static str, jsonschema::Validator> {
    static V: OnceLock<BTreeMap<&'static str, jsonschema::Validator>> = OnceLock::new();
    V.get_or_init(|| {
        let mut out = BTreeMap::new();
        let compile = |mut body: Value, defs: serde_json::Map<String, Value>| {
            body["$defs"] = Value::Object(defs);
            openapi_to_json_schema(&mut body);
            jsonschema::validator_for(&body).expect("the schema compiles")
        };
        let (pod, mut defs) = core_schema("PodTemplateSpec");
        let (meta, meta_defs) = core_schema("ObjectMeta");
        defs.extend(meta_defs);
        for (kind, file) in [
            ("RoleBasedGroup", "rolebasedgroup-v1alpha2.yaml"),
            ("LeaderWorkerSet", "leaderworkerset-v1.yaml"),
            ("DisaggregatedSet", "disaggregatedset-v1.yaml"),
        ] {
            let path = format!("{}/tests/data/k8s/{file}", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).unwrap();
            let mut wrapper: Value = serde_yaml_ng::from_str(&text).unwrap();
            fill_markers(&mut wrapper, &pod, &meta);
            out.insert(kind, compile(wrapper, defs.clone()));
        }
        let (s, d) = core_schema("Service");
        out.insert("Service", compile(s, d));
        let (s, d) = core_schema("ConfigMap");
        out.insert("ConfigMap", compile(s, d));
        let (s, d) = core_schema("Deployment");
        out.insert("Deployment", compile(s, d));
        out
    })
}

/// Validators from the upstream CRD files in `PDCTL_K8S_CRD_DIR`, when set.
fn upstream_validators() -> &'static BTreeMap<&'static str, jsonschema::Validator> {
    static V: OnceLock<BTreeMap<&'static str, jsonschema::Validator>> = OnceLock::new();
    V.get_or_init(|| {
        let mut out = BTreeMap::new();
        let Some(dir) = std::env::var_os("PDCTL_K8S_CRD_DIR") else {
            return out;
        };
        for (kind, file, version) in [
            (
                "RoleBasedGroup",
                "workloads.x-k8s.io_rolebasedgroups.yaml",
                "v1alpha2",
            ),
            (
                "LeaderWorkerSet",
                "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
                "v1",
            ),
            (
                "DisaggregatedSet",
                "disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
                "v1",
            ),
        ] {
            let path = std::path::Path::new(&dir).join(file);
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("PDCTL_K8S_CRD_DIR: {}: {e}", path.display()));
            let crd: Value = serde_yaml_ng::from_str(&text).unwrap();
            let served = crd["spec"]["versions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == version && v["served"] == true)
                .unwrap_or_else(|| panic!("{file} serves no {version}"));
            let mut schema = served["schema"]["openAPIV3Schema"].clone();
            openapi_to_json_schema(&mut schema);
            out.insert(kind, jsonschema::validator_for(&schema).unwrap());
        }
        out
    })
}

/// Every schema error of `doc`, with where it is.
fn schema_errors(doc: &Value) -> Vec<String> {
    let kind = doc["kind"].as_str().unwrap_or("?");
    let check = |v: &jsonschema::Validator, source: &str| -> Vec<String> {
        v.iter_errors(doc)
            .map(|e| {
                format!(
                    "{kind} {} ({source}) at {}: {e}",
                    doc["metadata"]["name"],
                    e.instance_path()
                )
            })
            .collect()
    };
    let mut errors = match validators().get(kind) {
        Some(v) => check(v, "pdctl's schema"),
        None => vec![format!("{kind}: no schema for this kind")],
    };
    if let Some(v) = upstream_validators().get(kind) {
        errors.extend(check(v, "upstream CRD"));
    }
    if kind == "DisaggregatedSet" {
        errors.extend(disaggregated_set_cel(doc));
    }
    errors
}

/// The CEL rule of the DisaggregatedSet CRD (v0.10.0) a validator without an API server
/// skips: the replicas of the roles not scaled externally are all above 0 or all 0.
fn disaggregated_set_cel(doc: &Value) -> Vec<String> {
    let Some(roles) = doc["spec"]["roles"].as_array() else {
        return vec![];
    };
    let static_replicas: Vec<u64> = roles
        .iter()
        .filter(|r| r["scaling"]["mode"] != "External")
        .map(|r| r["spec"]["replicas"].as_u64().unwrap_or(0))
        .collect();
    if static_replicas.iter().all(|n| *n > 0) || static_replicas.iter().all(|n| *n == 0) {
        vec![]
    } else {
        vec![format!(
            "DisaggregatedSet {}: replicas must be zero for all non-External roles or non-zero for all ({static_replicas:?})",
            doc["metadata"]["name"]
        )]
    }
}

#[test]
fn the_schemas_catch_a_misspelt_field_and_a_wrong_type() {
    let (docs, _) = exported("sim-1p1d", "rbg");
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    assert!(schema_errors(group).is_empty());
    let mut bad = group.clone();
    bad["spec"]["roles"][0]["replica"] = json!(1);
    assert!(
        !schema_errors(&bad).is_empty(),
        "an unknown role field passed"
    );
    let mut bad = group.clone();
    bad["spec"]["roles"][0]["standalonePattern"]["template"]["spec"]["containers"][0]["comand"] =
        json!(["x"]);
    assert!(
        !schema_errors(&bad).is_empty(),
        "a misspelt container field passed"
    );
    let mut bad = group.clone();
    bad["spec"]["roles"][0]["replicas"] = json!("one");
    assert!(
        !schema_errors(&bad).is_empty(),
        "a string replica count passed"
    );
    let (docs, _) = exported("sim-1p1d", "disaggregatedset");
    let set = docs
        .iter()
        .find(|d| d["kind"] == "DisaggregatedSet")
        .unwrap();
    assert!(schema_errors(set).is_empty());
    let mut bad = set.clone();
    bad["spec"]["roles"][0]["spec"]["replica"] = json!(1);
    assert!(
        !schema_errors(&bad).is_empty(),
        "an unknown LWS spec field passed"
    );
    let mut bad = set.clone();
    bad["spec"]["roles"][1]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
        [0]["imag"] = json!("x");
    assert!(
        !schema_errors(&bad).is_empty(),
        "a misspelt container field passed"
    );
    let mut bad = set.clone();
    bad["spec"]["roles"][0]["spec"]["replicas"] = json!(0);
    assert!(
        !schema_errors(&bad).is_empty(),
        "one role at 0 replicas and the other not passed (the CRD's CEL rule)"
    );
}

#[test]
fn every_profile_exports_in_all_three_formats_and_every_document_is_valid() {
    for profile in profiles() {
        for format in FORMATS {
            let (docs, _) = exported(profile, format);
            let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
            let count = |kind: &str| kinds.iter().filter(|k| **k == kind).count();
            match format {
                "rbg" => assert_eq!(count("RoleBasedGroup"), 1, "{profile}: {kinds:?}"),
                "lws" => assert_eq!(
                    count("LeaderWorkerSet"),
                    2,
                    "{profile}: one per engine role: {kinds:?}"
                ),
                _ => {
                    assert_eq!(count("DisaggregatedSet"), 1, "{profile}: {kinds:?}");
                    let set = docs
                        .iter()
                        .find(|d| d["kind"] == "DisaggregatedSet")
                        .unwrap();
                    let roles: Vec<&str> = common::field_strs(&set["spec"]["roles"], "name");
                    assert_eq!(roles, ["prefill", "decode"], "{profile}");
                    assert_eq!(count("LeaderWorkerSet"), 0, "{profile}: the set makes them");
                }
            }
            for d in &docs {
                let errors = schema_errors(d);
                assert!(
                    errors.is_empty(),
                    "{profile} {format}:\n{}",
                    errors.join("\n")
                );
            }
        }
    }
}

// ---------------------------------------------------------------- the plan's argv

/// Each role's pod template, by role name, from either format.
fn templates(docs: &[Value]) -> BTreeMap<String, (Value, u64)> {
    let mut out = BTreeMap::new();
    for d in docs {
        match d["kind"].as_str() {
            Some("RoleBasedGroup") => {
                for r in d["spec"]["roles"].as_array().unwrap() {
                    out.insert(
                        r["name"].as_str().unwrap().to_string(),
                        (
                            r["standalonePattern"]["template"].clone(),
                            r["replicas"].as_u64().unwrap(),
                        ),
                    );
                }
            }
            Some("DisaggregatedSet") => {
                for r in d["spec"]["roles"].as_array().unwrap() {
                    out.insert(
                        r["name"].as_str().unwrap().to_string(),
                        (
                            r["spec"]["leaderWorkerTemplate"]["workerTemplate"].clone(),
                            r["spec"]["replicas"].as_u64().unwrap(),
                        ),
                    );
                }
            }
            Some("LeaderWorkerSet") => {
                out.insert(
                    d["metadata"]["labels"]["app.kubernetes.io/component"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                    (
                        d["spec"]["leaderWorkerTemplate"]["workerTemplate"].clone(),
                        d["spec"]["replicas"].as_u64().unwrap(),
                    ),
                );
            }
            Some("Deployment") => {
                out.insert(
                    d["metadata"]["labels"]["app.kubernetes.io/component"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                    (
                        d["spec"]["template"].clone(),
                        d["spec"]["replicas"].as_u64().unwrap(),
                    ),
                );
            }
            _ => {}
        }
    }
    out
}

/// The argv a planned service stands for: `pdctl proxy|sim --config FILE` is its config
/// file (among the service's generated files) read back and written as the flags it
/// holds, which is what a pod runs; any other service's argv as planned.
fn planned_flags(svc: &Value) -> Vec<String> {
    let s: pdctl::vocab::Service = serde_json::from_value(svc.clone()).unwrap();
    let files = s
        .files
        .iter()
        .map(|f| (f.path.as_path(), f.content.as_str()));
    let flags = match s.argv[1].as_str() {
        "proxy" => pdctl::child_config::from_service::<pdctl::child_config::proxy::ProxyArgs>(
            &s.argv, files,
        )
        .unwrap()
        .to_argv(),
        "sim" => {
            pdctl::child_config::from_service::<pdctl::child_config::sim::SimArgs>(&s.argv, files)
                .unwrap()
                .to_argv()
        }
        _ => return s.argv,
    };
    assert_eq!(s.argv[2], "--config", "{:?}", s.argv);
    let mut argv = s.argv[..2].to_vec();
    argv.extend(flags);
    argv
}

/// The plan's argv of a service with exactly the rewrites docs/kubernetes.md lists:
/// argv[0] without its directory; the value of --host / --listen-* (and a bare own address
/// among the arguments) 0.0.0.0; `HOST:PORT` of a planned service its Service name and the
/// port of its role's first instance; `$(` escaped; the sim's --instance the pod name; the
/// proxy's engine URLs one --prefill-dns / --decode-dns, no --supervisor-socket.
fn expected_argv(plan: &Value, svc: &Value, service_of: &dyn Fn(&str) -> String) -> Vec<String> {
    let host = svc["host"].as_str().unwrap();
    let services = plan["services"].as_array().unwrap();
    let first_port = |role: &str, name: &str| {
        services.iter().find(|s| s["role"] == role).unwrap()["ports"][name]
            .as_u64()
            .unwrap()
    };
    let mut endpoints: Vec<(String, String)> = Vec::new();
    for s in services {
        let role = s["role"].as_str().unwrap();
        for (name, port) in s["ports"].as_object().unwrap() {
            endpoints.push((
                format!("{}:{port}", s["host"].as_str().unwrap()),
                format!("{}:{}", service_of(role), first_port(role, name)),
            ));
        }
    }
    endpoints.sort_by_key(|e| std::cmp::Reverse(e.0.len()));
    let argv = planned_flags(svc);
    let mut out = vec![argv[0].rsplit('/').next().unwrap().to_string()];
    let is_proxy = svc["role"] == "proxy";
    let mut i = 1;
    while i < argv.len() {
        let a = &argv[i];
        let prev = &argv[i - 1];
        if is_proxy && (a == "--prefill" || a == "--decode" || a == "--supervisor-socket") {
            i += 2;
            continue;
        }
        let v = if pdctl::export::rewrite::is_bind_flag(prev) {
            a.replace(&format!("//{host}:"), "//0.0.0.0:")
                .replace(host, "0.0.0.0")
                .replace("127.0.0.1", "0.0.0.0")
        } else if prev == "--instance" && argv[1] == "sim" {
            "$(POD_NAME)".to_string()
        } else if a == host {
            "0.0.0.0".to_string()
        } else {
            let mut v = a.clone();
            for (from, to) in &endpoints {
                // Whole addresses only: a port must not match the start of a longer one.
                let mut rebuilt = String::new();
                let mut rest = v.as_str();
                while let Some(p) = rest.find(from.as_str()) {
                    let next = rest[p + from.len()..].chars().next();
                    let whole = !next.is_some_and(|c| c.is_ascii_alphanumeric());
                    rebuilt.push_str(&rest[..p]);
                    rebuilt.push_str(if whole { to } else { from });
                    rest = &rest[p + from.len()..];
                }
                rebuilt.push_str(rest);
                v = rebuilt;
            }
            v
        };
        out.push(v);
        if is_proxy && prev == "--port" {
            out.extend([
                "--prefill-dns".into(),
                format!(
                    "{}:{}",
                    service_of("prefill"),
                    first_port("prefill", "http")
                ),
                "--decode-dns".into(),
                format!("{}:{}", service_of("decode"), first_port("decode", "http")),
            ]);
        }
        i += 1;
    }
    out
}

#[test]
fn every_role_runs_the_plans_argv_but_for_the_documented_rewrites() {
    for profile in profiles() {
        let plan = plan(profile);
        let (docs, _) = exported(profile, "rbg");
        let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
        let name = group["metadata"]["name"].as_str().unwrap().to_string();
        let service_of = |role: &str| format!("{name}-{role}-svc");
        let tpl = templates(&docs);
        let services = plan["services"].as_array().unwrap();
        let mut roles: Vec<&str> = services
            .iter()
            .map(|s| s["role"].as_str().unwrap())
            .collect();
        roles.dedup();
        assert_eq!(
            tpl.keys().map(String::as_str).collect::<Vec<_>>().len(),
            roles.len(),
            "{profile}: one role per planned role"
        );
        for role in roles {
            let first = services.iter().find(|s| s["role"] == role).unwrap();
            let count = services.iter().filter(|s| s["role"] == role).count() as u64;
            let (template, replicas) = &tpl[role];
            assert_eq!(*replicas, count, "{profile} {role}: replicas = instances");
            let command: Vec<String> = template["spec"]["containers"][0]["command"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                command,
                expected_argv(&plan, first, &service_of),
                "{profile} {role}"
            );
            // Env: the plan's, less CUDA_VISIBLE_DEVICES, the own address from the pod.
            let env = template["spec"]["containers"][0]["env"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let host = first["host"].as_str().unwrap();
            for (k, v) in first["env"].as_object().unwrap() {
                let got = env.iter().find(|e| e["name"] == k.as_str());
                if k == "CUDA_VISIBLE_DEVICES" {
                    assert!(
                        got.is_none(),
                        "{profile} {role}: {k} must be the device plugin's"
                    );
                } else if v == host {
                    assert_eq!(
                        got.unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
                        "status.podIP",
                        "{profile} {role}: {k}"
                    );
                } else {
                    assert!(got.is_some(), "{profile} {role}: {k} missing");
                }
            }
        }
    }
}

#[test]
fn four_p_four_d_is_a_role_based_group_with_the_plans_kv_transfer_config() {
    let (out, _, code) = export(&["-p", "4p4d", "-o", "-"]);
    assert_eq!(code, 0);
    let docs = documents(&out);
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    assert_eq!(group["apiVersion"], "workloads.x-k8s.io/v1alpha2");
    let roles = group["spec"]["roles"].as_array().unwrap();
    let role = |n: &str| roles.iter().find(|r| r["name"] == n).unwrap();
    assert_eq!(role("prefill")["replicas"], 4);
    assert_eq!(role("decode")["replicas"], 4);
    assert_eq!(role("proxy")["replicas"], 1);
    let kv = |argv: &[Value]| {
        let i = argv
            .iter()
            .position(|a| a == "--kv-transfer-config")
            .unwrap();
        argv[i + 1].as_str().unwrap().to_string()
    };
    let plan = plan("4p4d");
    for leg in ["prefill", "decode"] {
        let planned = plan["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["role"] == leg)
            .unwrap();
        let c = &role(leg)["standalonePattern"]["template"]["spec"]["containers"][0];
        assert_eq!(
            kv(c["command"].as_array().unwrap()),
            kv(planned["argv"].as_array().unwrap())
        );
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1");
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/health");
        assert_eq!(c["image"], format!("vllm/vllm-openai:v{}", newest()));
    }
    // The proxy finds the engines through their headless Services.
    let proxy = &role("proxy")["standalonePattern"]["template"]["spec"]["containers"][0];
    let argv = common::strs(&proxy["command"]);
    assert_eq!(&argv[..2], ["pdctl", "proxy"]);
    let dns = argv[argv.iter().position(|a| *a == "--prefill-dns").unwrap() + 1];
    let svc = docs
        .iter()
        .find(|d| {
            d["kind"] == "Service"
                && format!("{}:8100", d["metadata"]["name"].as_str().unwrap()) == dns
        })
        .unwrap_or_else(|| panic!("no Service named by --prefill-dns {dns}"));
    assert_eq!(
        svc["spec"]["clusterIP"], "None",
        "engines' Services are headless"
    );
    assert_eq!(
        svc["spec"]["publishNotReadyAddresses"], false,
        "they list ready pods only"
    );
    assert!(
        docs.iter().any(|d| d["kind"] == "Service"
            && d["spec"]["type"] == "ClusterIP"
            && d["spec"]["selector"]["app.kubernetes.io/component"] == "proxy"),
        "a Service in front of the proxy"
    );
    assert_eq!(role("proxy")["dependencies"], json!(["prefill", "decode"]));
}

#[test]
fn generated_files_are_config_maps_and_the_own_address_is_the_pods() {
    let (docs, _) = exported("mooncake-store-4p4d", "rbg");
    let cm = docs
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap"
                && d["metadata"]["labels"]["app.kubernetes.io/component"] == "prefill"
        })
        .expect("the prefill's mooncake.json is a ConfigMap");
    let (key, text) = cm["data"].as_object().unwrap().iter().next().unwrap();
    assert!(key.ends_with(".mooncake.json"));
    let file: Value = serde_json::from_str(text.as_str().unwrap()).unwrap();
    assert_eq!(
        file["local_hostname"], "@POD_IP@",
        "filled in by the init container"
    );
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    let name = group["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        file["metadata_server"],
        format!("etcd://{name}-etcd-svc:2379")
    );
    assert_eq!(
        file["master_server_address"],
        format!("{name}-mooncake-master-svc:50001")
    );
    let roles = group["spec"]["roles"].as_array().unwrap();
    let names: Vec<&str> = roles.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["etcd", "mooncake-master", "prefill", "decode", "proxy"]
    );
    let prefill = roles.iter().find(|r| r["name"] == "prefill").unwrap();
    assert_eq!(prefill["dependencies"], json!(["etcd", "mooncake-master"]));
    let spec = &prefill["standalonePattern"]["template"]["spec"];
    assert_eq!(spec["initContainers"][0]["name"], "render-files");
    for svc in ["etcd", "mooncake-master"] {
        assert!(
            docs.iter()
                .any(|d| d["kind"] == "Service"
                    && d["metadata"]["name"] == format!("{name}-{svc}-svc")),
            "{svc} has a Service"
        );
    }
}

// ---------------------------------------------------------------- what cannot be expressed

#[test]
fn what_a_pod_cannot_express_is_said() {
    let (docs, err) = exported("sim-1p1d", "rbg");
    assert!(err.contains("engine = \"sim\""), "{err}");
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    let c = &group["spec"]["roles"][0]["standalonePattern"]["template"]["spec"]["containers"][0];
    assert_eq!(
        (c["command"][0].as_str(), c["command"][1].as_str()),
        (Some("pdctl"), Some("sim"))
    );
    assert!(c.get("resources").is_none(), "the simulator needs no GPU");

    let (out, err, code) = export(&["-p", "shared-storage-1p1d", "--kv-pvc", "pd-kv"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("/mnt/pd_kv is PersistentVolumeClaim pd-kv"),
        "{err}"
    );
    assert!(out.contains("claimName: pd-kv"), "{out}");

    let (_, err) = exported("2node-4p4d", "rbg");
    assert!(err.contains("[nodes] pinning dropped"), "{err}");
    let (out, _, code) = export(&["-p", "2node-4p4d", "--node-label", "pdctl.io/node"]);
    assert_eq!(code, 0);
    let docs = documents(&out);
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    let decode = group["spec"]["roles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "decode")
        .unwrap();
    assert_eq!(
        decode["standalonePattern"]["template"]["spec"]["nodeSelector"],
        json!({"pdctl.io/node": "decode-node"})
    );
}

#[test]
fn bad_input_is_exit_code_2_with_what_to_change() {
    let (_, err, code) = export(&["-p", "4p4d", "--kv-pvc", "Not_A_Name"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--kv-pvc"), "{err}");
    let (_, err, code) = export(&["-p", "no-such-profile"]);
    assert_eq!(code, 2, "{err}");
    let (_, _, code) = export(&["-p", "4p4d", "--format", "helm"]);
    assert_eq!(code, 2);
}

#[test]
fn output_to_a_directory_writes_one_file_per_object() {
    let dir = common::TempDir::new("export-k8s");
    let (out, err, code) = export(&["-p", "sim-1p1d", "-o", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let written: Vec<&str> = out.lines().collect();
    assert!(
        written
            .iter()
            .any(|p| p.ends_with("rolebasedgroup-sim-1p1d.yaml")),
        "{out}"
    );
    for p in written {
        let docs = documents(&std::fs::read_to_string(p).unwrap());
        assert_eq!(docs.len(), 1, "{p}");
    }
}

#[test]
fn the_yaml_in_docs_kubernetes_md_is_what_export_prints() {
    let doc = std::fs::read_to_string(format!("{}/docs/kubernetes.md", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let start = doc
        .find("```yaml\n")
        .expect("docs/kubernetes.md shows the YAML")
        + 8;
    let shown = &doc[start..start + doc[start..].find("```").unwrap()];
    let (out, _, code) = export(&["-p", "4p4d"]);
    assert_eq!(code, 0);
    let printed: String = out
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        shown, printed,
        "docs/kubernetes.md is out of date: paste `pdctl export k8s -p 4p4d | grep -v '^#'`"
    );
}

// ---------------------------------------------------------------- what a cluster accepts

/// The Service names the workload controllers create or adopt for `docs`: RBG v0.7.0 adopts
/// `<group>-<role>` as a role's headless Service when it exists, else creates
/// `s-<group>-<role>` (both cut to 63 characters); LWS v0.10.0 names its headless Service
/// after the LeaderWorkerSet and, per group, after the leader pod (`<lws>-<index>`).
fn controller_service_names(docs: &[Value]) -> Vec<String> {
    let cut = |s: String| s[..s.len().min(63)].trim_end_matches('-').to_string();
    let mut names = Vec::new();
    for d in docs {
        let name = d["metadata"]["name"].as_str().unwrap_or_default();
        match d["kind"].as_str() {
            Some("RoleBasedGroup") => {
                for r in d["spec"]["roles"].as_array().unwrap() {
                    let role = r["name"].as_str().unwrap();
                    names.push(cut(format!("{name}-{role}")));
                    names.push(cut(format!("s-{name}-{role}")));
                }
            }
            Some("LeaderWorkerSet") => {
                names.push(name.to_string());
                let replicas = d["spec"]["replicas"].as_u64().unwrap();
                names.extend((0..replicas).map(|i| format!("{name}-{i}")));
            }
            _ => {}
        }
    }
    names
}

/// Whether `service` has the shape of a name the DisaggregatedSet controller (v0.10.0)
/// gives its LeaderWorkerSets (`<set>-<slice>-<revision>-<role>`, whose headless Services
/// LWS names alike) or its per-revision Services (the same with `-prv`).
fn is_disaggregated_set_name(set: &str, roles: &[&str], service: &str) -> bool {
    let Some(rest) = service.strip_prefix(&format!("{set}-")) else {
        return false;
    };
    let rest = rest.strip_suffix("-prv").unwrap_or(rest);
    let parts: Vec<&str> = rest.splitn(3, '-').collect();
    parts.len() == 3
        && parts[0].chars().all(|c| c.is_ascii_digit())
        && roles.iter().any(|r| parts[2] == *r)
}

#[test]
fn no_exported_service_takes_a_name_a_controller_creates_or_adopts() {
    for profile in profiles() {
        for format in FORMATS {
            let (docs, _) = exported(profile, format);
            let services: Vec<&str> = docs
                .iter()
                .filter(|d| d["kind"] == "Service")
                .map(|d| d["metadata"]["name"].as_str().unwrap())
                .collect();
            assert!(!services.is_empty(), "{profile} {format}");
            let taken = controller_service_names(&docs);
            for s in &services {
                assert!(
                    !taken.iter().any(|t| t == s),
                    "{profile} {format}: Service {s} is a name the controller manages ({taken:?})"
                );
            }
            if let Some(set) = docs.iter().find(|d| d["kind"] == "DisaggregatedSet") {
                let name = set["metadata"]["name"].as_str().unwrap();
                let roles = common::field_strs(&set["spec"]["roles"], "name");
                for s in &services {
                    assert!(
                        !is_disaggregated_set_name(name, &roles, s),
                        "{profile}: Service {s} has the shape of the DisaggregatedSet's names"
                    );
                }
            }
        }
    }
    // The check itself: the names the issue found taken are caught.
    let (docs, _) = exported("4p4d", "rbg");
    let taken = controller_service_names(&docs);
    assert!(taken.contains(&"pd-4p4d-prefill".to_string()));
    assert!(taken.contains(&"s-pd-4p4d-proxy".to_string()));
    assert!(is_disaggregated_set_name(
        "pd-4p4d",
        &["prefill", "decode"],
        "pd-4p4d-0-7f9c2d1b-prefill-prv"
    ));
}

/// Every image of every container and init container in `docs`.
fn images_of(docs: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for (template, _) in templates(docs).values() {
        for key in ["containers", "initContainers"] {
            for c in template["spec"][key].as_array().into_iter().flatten() {
                out.push(c["image"].as_str().unwrap().to_string());
            }
        }
    }
    out
}

/// The tag of an image reference (after the last `:` of its last path segment).
fn tag_of(image: &str) -> Option<&str> {
    image.rsplit('/').next()?.split_once(':').map(|(_, t)| t)
}

#[test]
fn every_image_names_a_version_and_the_roles_get_images_that_have_their_programs() {
    let version = env!("CARGO_PKG_VERSION");
    for profile in profiles() {
        for format in FORMATS {
            let (docs, _) = exported(profile, format);
            for image in images_of(&docs) {
                let tag = tag_of(&image).unwrap_or_else(|| panic!("{profile}: {image} has no tag"));
                assert!(
                    tag.trim_start_matches('v')
                        .split('.')
                        .take(2)
                        .all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())),
                    "{profile} {format}: {image} names no version"
                );
            }
            // Who runs what: pdctl's own image has pdctl and mooncake_master (the Dockerfile).
            for (role, (template, _)) in templates(&docs) {
                let c = &template["spec"]["containers"][0];
                let (image, program) = (c["image"].as_str().unwrap(), &c["command"][0]);
                match role.as_str() {
                    "proxy" | "mooncake-master" => {
                        assert_eq!(image, format!("pdctl:{version}"), "{profile} {role}")
                    }
                    "etcd" => assert_eq!(image, "quay.io/coreos/etcd:v3.5.21"),
                    "lmcache-server" => assert_eq!(image, "lmcache/vllm-openai:v0.5.5"),
                    _ if program == "pdctl" => assert_eq!(image, format!("pdctl:{version}")),
                    _ => assert!(
                        image.starts_with("vllm/vllm-openai:v")
                            || image.starts_with("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v"),
                        "{profile} {role}: {image}"
                    ),
                }
            }
        }
    }
    // The simulator's cluster runs mooncake_master from pdctl's image, never a vLLM one.
    let (docs, _) = exported("sim-4p4d", "rbg");
    let tpl = templates(&docs);
    let master = &tpl["mooncake-master"].0["spec"]["containers"][0];
    assert_eq!(master["command"][0], "mooncake_master");
    assert_eq!(master["image"], format!("pdctl:{version}"));
    // A CPU profile gets vLLM's CPU image of the planned version, and says so.
    let (docs, err) = exported("cpu-1p1d", "rbg");
    let prefill = &templates(&docs)["prefill"].0["spec"]["containers"][0];
    assert_eq!(
        prefill["image"],
        format!(
            "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{}",
            newest()
        )
    );
    assert!(
        prefill.get("resources").is_none(),
        "no GPU for the CPU build"
    );
    assert!(err.contains("vLLM's CPU image"), "{err}");
}

#[test]
fn the_engine_image_follows_the_planned_version_and_an_assumed_one_is_marked() {
    // The tests blind pdctl to installed vLLM: "auto" is assumed, and the header says so.
    let (out, err, code) = export(&["-p", "nixl-1p1d"]);
    assert_eq!(code, 0, "{err}");
    let image = format!("vllm/vllm-openai:v{}", newest());
    assert!(out.contains(&format!("image: {image}")), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("#") && l.contains(&image) && l.contains("ASSUMED")),
        "the header marks the assumed version"
    );
    // A pinned version is its image, with no mark.
    let dir = common::TempDir::new("export-pinned");
    let file = dir.path().join("pinned.toml");
    let topology = std::fs::read_to_string(format!(
        "{}/profiles/nixl-1p1d.toml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
    .replace("vllm_version = \"auto\"", "vllm_version = \"0.11.0\"");
    assert!(
        topology.contains("0.11.0"),
        "nixl-1p1d pins no version to replace"
    );
    std::fs::write(&file, topology).unwrap();
    let (out, err, code) = export(&["-f", file.to_str().unwrap(), "--format", "rbg", "-o", "-"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("image: vllm/vllm-openai:v0.11.0"), "{out}");
    assert!(!err.contains("ASSUMED"), "{err}");
    // An image the user gives is used and named as one pdctl cannot vouch for, `latest` too.
    let (out, err, code) = export(&[
        "-p",
        "lmcache-1p1d",
        "--image",
        "registry.example/vllm-lmcache:latest",
        "--pdctl-image",
        "registry.example/pdctl:0.1.0",
    ]);
    assert_eq!(code, 0, "{err}");
    let docs = documents(&out);
    let tpl = templates(&docs);
    for role in ["prefill", "decode", "lmcache-server"] {
        assert_eq!(
            tpl[role].0["spec"]["containers"][0]["image"], "registry.example/vllm-lmcache:latest",
            "{role}: the engines' image has their LMCache"
        );
    }
    assert!(
        err.contains("--image registry.example/vllm-lmcache:latest is your image")
            && err.contains("names no version"),
        "{err}"
    );
    assert!(
        err.contains("--pdctl-image registry.example/pdctl:0.1.0 is your image"),
        "{err}"
    );
}

/// `GET path` on 127.0.0.1:port: the status code, or None when nothing answers.
fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = String::new();
    s.read_to_string(&mut head).ok()?;
    head.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn the_proxy_pod_is_ready_only_when_a_prefill_and_a_decode_are_usable_and_warmed() {
    for format in FORMATS {
        let (docs, _) = exported("nixl-1p1d", format);
        let proxy = &templates(&docs)["proxy"].0["spec"]["containers"][0];
        // The plan's own readiness: a pair usable and its KV path warmed.
        assert_eq!(
            proxy["readinessProbe"]["httpGet"]["path"], "/health?warmed",
            "{format}"
        );
        assert_eq!(proxy["livenessProbe"]["httpGet"]["path"], "/health");
    }
    // The exported command, run here with engine names that resolve to nothing: alive, not
    // ready, as the probes will see it in a pod whose engines are not up yet.
    let (docs, _) = exported("nixl-1p1d", "rbg");
    let proxy = &templates(&docs)["proxy"].0["spec"]["containers"][0];
    let port = common::free_port();
    let mut argv: Vec<String> = common::strs(&proxy["command"])
        .iter()
        .map(|s| s.to_string())
        .collect();
    let at = |flag: &str, argv: &[String]| argv.iter().position(|a| a == flag).unwrap() + 1;
    let i = at("--port", &argv);
    argv[i] = port.to_string();
    let i = at("--host", &argv);
    argv[i] = "127.0.0.1".into();
    assert_eq!(argv[0], "pdctl");
    let child = std::process::Command::new(common::pdctl_bin())
        .args(&argv[1..])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _guard = common::ChildGuard(child);
    let live = common::wait_until(std::time::Duration::from_secs(30), || {
        http_status(port, "/health") == Some(200)
    });
    assert!(live, "the exported proxy command does not answer /health");
    let path = proxy["readinessProbe"]["httpGet"]["path"].as_str().unwrap();
    assert_eq!(
        http_status(port, path),
        Some(503),
        "readiness {path} must fail while no engine is usable"
    );
}

#[test]
fn scaling_works_as_each_format_writes_it() {
    // RBG: the CRD has no scale subresource; engine roles get a scaling adapter that has one.
    let (docs, _) = exported("4p4d", "rbg");
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    for r in group["spec"]["roles"].as_array().unwrap() {
        let engine = r["name"] == "prefill" || r["name"] == "decode";
        assert_eq!(
            r["scalingAdapter"]["enable"].as_bool().unwrap_or(false),
            engine,
            "{}",
            r["name"]
        );
    }
    // mooncake-te pairs one prefill with one decode: nothing invites scaling it.
    let (docs, _) = exported("mooncake-te-1p1d", "rbg");
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    assert!(
        group["spec"]["roles"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r.get("scalingAdapter").is_none())
    );
    // DisaggregatedSet: Static roles whose replicas are the plan's instances.
    let (docs, _) = exported("4p4d", "disaggregatedset");
    let set = docs
        .iter()
        .find(|d| d["kind"] == "DisaggregatedSet")
        .unwrap();
    for r in set["spec"]["roles"].as_array().unwrap() {
        assert!(
            r.get("scaling").is_none(),
            "Static: the seed of External is 1"
        );
        assert_eq!(r["spec"]["replicas"], 4);
    }
    // The docs say the same.
    let doc = std::fs::read_to_string(format!("{}/docs/kubernetes.md", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    assert!(doc.contains("kubectl scale rolebasedgroupscalingadapter pd-4p4d-prefill"));
    assert!(doc.contains("kubectl scale leaderworkerset pd-4p4d-prefill"));
    assert!(!doc.contains("needs nothing else"));
}

#[test]
fn one_gpu_sharing_is_exported_as_whole_gpus_and_said() {
    let (docs, err) = exported("1gpu-1p1d", "rbg");
    let tpl = templates(&docs);
    for role in ["prefill", "decode"] {
        let c = &tpl[role].0["spec"]["containers"][0];
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1", "{role}");
        assert!(
            !common::strs(&c["command"]).contains(&"--gpu-memory-utilization"),
            "{role}: a whole GPU carries no share"
        );
    }
    assert!(
        err.contains("a pod gets whole GPUs")
            && err.contains("--gpu-memory-utilization 0.45")
            && !err.contains("stay in the vLLM flags"),
        "{err}"
    );
}

#[test]
fn the_dockerfile_builds_the_image_the_exports_name() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dockerfile = std::fs::read_to_string(format!("{root}/Dockerfile")).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    let (out, _, _) = export(&["-p", "mooncake-store-4p4d"]);
    let default = format!("pdctl:{version}");
    assert!(out.contains(&format!("image: {default}")));
    assert!(
        dockerfile.contains(&format!("docker build -t {default} .")),
        "the Dockerfile's build command tags the image the exports name"
    );
    assert!(dockerfile.contains(&format!("org.opencontainers.image.version=\"{version}\"")));
    // It carries both programs the pods run from it, on PATH, and mooncake_master at the
    // version install.sh installs.
    assert!(
        dockerfile.contains("COPY --from=build /src/target/release/pdctl /usr/local/bin/pdctl")
    );
    assert!(dockerfile.contains("ENV PATH=/opt/pdctl/venv/bin:"));
    let install = std::fs::read_to_string(format!("{root}/install.sh")).unwrap();
    let pin = install
        .lines()
        .find_map(|l| l.strip_prefix("NONCUDA_PIN=${PDCTL_MOONCAKE_PIN-"))
        .and_then(|l| l.strip_suffix('}'))
        .expect("install.sh pins mooncake");
    assert!(
        dockerfile.contains(&format!("mooncake-transfer-engine-non-cuda{pin}")),
        "Dockerfile and install.sh install the same mooncake ({pin})"
    );
    let docs = documents(&out);
    for (role, (template, _)) in templates(&docs) {
        let c = &template["spec"]["containers"][0];
        if c["image"] == default.as_str() {
            let program = c["command"][0].as_str().unwrap();
            assert!(
                ["pdctl", "mooncake_master"].contains(&program),
                "{role} runs {program} from the pdctl image, which has only pdctl and mooncake_master"
            );
        }
    }
}

/// The vLLM version an "auto" plan assumes without vLLM (the newest templated one).
fn newest() -> String {
    pdctl::connectors::NEWEST_TEMPLATED.to_string()
}

#[test]
fn a_hub_token_in_the_topology_is_read_from_a_secret_not_written_in_the_manifest() {
    let dir = common::TempDir::new("export-token");
    let file = dir.path().join("t.toml");
    let token = "hf_exportTestToken_42";
    std::fs::write(
        &file,
        format!(
            "[model]\nname = \"org/tiny\"\n[engine]\nvllm_version = \"0.26.0\"\n[engine.env]\nHF_TOKEN = \"{token}\"\n[connector]\nkind = \"nixl\"\n"
        ),
    )
    .unwrap();
    let (out, err, code) = export(&["-f", file.to_str().unwrap(), "--format", "rbg", "-o", "-"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains(token) && !err.contains(token), "{out}\n{err}");
    let docs = documents(&out);
    let group = docs.iter().find(|d| d["kind"] == "RoleBasedGroup").unwrap();
    for role in group["spec"]["roles"].as_array().unwrap() {
        let template = &role["standalonePattern"]["template"];
        let Some(c) = template["spec"]["containers"].get(0) else {
            continue;
        };
        if !["prefill", "decode"].contains(&role["name"].as_str().unwrap_or("")) {
            continue;
        }
        let env = c["env"].as_array().unwrap();
        let hf = env
            .iter()
            .find(|e| e["name"] == "HF_TOKEN")
            .unwrap_or_else(|| panic!("{c}"));
        assert_eq!(
            hf["valueFrom"]["secretKeyRef"],
            json!({"name": "pdctl-hub-token", "key": "HF_TOKEN"}),
            "{hf}"
        );
    }
    assert!(
        out.contains("kubectl create secret generic pdctl-hub-token --from-literal=HF_TOKEN=..."),
        "{out}"
    );
}
