//! `GET /v1/models`: the models of every usable instance, merged (one entry per id). One
//! instance down never turns this into a 500; only when no instance answers is it a 503.

use super::Proxy;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// Longest wait for one instance's model list.
const MODELS_TIMEOUT: Duration = Duration::from_secs(3);

/// The handler.
pub async fn list(State(p): State<Arc<Proxy>>) -> Response {
    let asked: Vec<_> = p
        .pools
        .snapshot()
        .all()
        .filter(|i| i.is_usable())
        .cloned()
        .collect();
    let answers = futures_util::future::join_all(asked.iter().map(|i| {
        let url = format!("{}/v1/models", i.url);
        let upstream = p.upstream.clone();
        async move {
            let (status, body) = upstream
                .get(&url, MODELS_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
            if status != 200 {
                return Err(format!("answered {status}"));
            }
            serde_json::from_slice::<Value>(&body).map_err(|e| format!("answered non-JSON ({e})"))
        }
    }))
    .await;
    let mut data: Vec<Value> = Vec::new();
    let mut failures = Vec::new();
    for (inst, answer) in asked.iter().zip(answers) {
        match answer {
            Ok(v) => merge(&mut data, &v),
            Err(e) => {
                tracing::warn!("/v1/models: {} {e}", inst.url);
                failures.push(format!("{} {e}", inst.url));
            }
        }
    }
    if data.is_empty() && (asked.is_empty() || !failures.is_empty()) {
        let detail = if asked.is_empty() {
            "no instance is usable".to_string()
        } else {
            failures.join("; ")
        };
        let body = json!({"error": {
            "message": format!("no instance answered /v1/models: {detail}"),
            "type": "service_unavailable", "param": null, "code": 503,
        }});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Adds the `data` entries of one answer whose `id` is not listed yet.
fn merge(into: &mut Vec<Value>, answer: &Value) {
    let Some(items) = answer.get("data").and_then(Value::as_array) else {
        return;
    };
    for m in items {
        let id = m.get("id");
        if id.is_some() && !into.iter().any(|x| x.get("id") == id) {
            into.push(m.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_deduplicated_by_id() {
        let mut data = Vec::new();
        merge(
            &mut data,
            &json!({"data": [{"id": "a", "owned_by": "p"}, {"id": "b"}]}),
        );
        merge(&mut data, &json!({"data": [{"id": "a", "owned_by": "d"}]}));
        merge(&mut data, &json!({"nothing": true}));
        let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["a", "b"]);
    }
}
