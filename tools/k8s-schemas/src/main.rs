//! Prints the JSON schemas (JSON Schema 2020-12, as schemars writes them) of the Kubernetes
//! kinds that `pdctl export k8s` emits or embeds, keyed by kind, for tests/export.rs.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, PodTemplateSpec, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Map, Value};

/// The schema of one type, as schemars writes it, less its `description`s (prose that
/// validates nothing and is most of the file's size).
fn schema<T: schemars::JsonSchema>() -> Value {
    let mut v = serde_json::to_value(schemars::schema_for!(T)).expect("a schema is JSON");
    drop_descriptions(&mut v);
    v
}

/// Removes every `description` string of a schema, at any depth (a property named
/// `description` is an object there, and stays).
fn drop_descriptions(v: &mut Value) {
    match v {
        Value::Object(m) => {
            if m.get("description").is_some_and(Value::is_string) {
                m.remove("description");
            }
            m.values_mut().for_each(drop_descriptions);
        }
        Value::Array(a) => a.iter_mut().for_each(drop_descriptions),
        _ => {}
    }
}

fn main() {
    let mut out = Map::new();
    out.insert(
        "_about".into(),
        Value::String(
            "Written by tools/k8s-schemas from k8s-openapi 0.29.0 (feature latest) with schemars 1.2.3, descriptions left out; do not edit by hand".into(),
        ),
    );
    out.insert("PodTemplateSpec".into(), schema::<PodTemplateSpec>());
    out.insert("ObjectMeta".into(), schema::<ObjectMeta>());
    out.insert("Service".into(), schema::<Service>());
    out.insert("ConfigMap".into(), schema::<ConfigMap>());
    out.insert("Deployment".into(), schema::<Deployment>());
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Object(out)).expect("JSON prints")
    );
}
