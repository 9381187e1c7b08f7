//! `pdctl check`: proves the KV path of a running cluster, pair by pair. For each prefill
//! -> decode pair it asks both engines what a handoff needs them to agree on (model, KV
//! block size, vLLM version; tensor-parallel sizes come from the plan), then sends one
//! probe request through the proxy pinned to that pair, and holds the decode's own
//! counter `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` to having
//! grown by the probe prompt's full blocks: a handoff that silently fell back to a
//! recompute shows there and nowhere else.
//!
//! The engines answer only the cluster's engine key, the proxy only the client key
//! (`PDCTL_API_KEY`) when one is set: [`Clients`] sends each its own. A pair whose models
//! cannot be compared (an engine that does not say which it serves) fails, saying so.

use crate::plan::pairs::{EngineFacts, Mismatch, compare};
use serde::Serialize;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Why `pdctl check` could not learn what it asks an engine or the proxy. The caller
/// tells a client key problem (the user's to fix) from an engine that did not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// Nothing answered at `url` (refused, timed out, no route).
    #[error("cannot reach {url}: {why}")]
    Unreachable { url: String, why: String },
    /// It answered, but the answer could not be read whole.
    #[error("{url}: {why}")]
    Unreadable { url: String, why: String },
    /// The proxy refused the client key that was sent.
    #[error(
        "the proxy refused the client key in PDCTL_API_KEY ({url} answered {status}); set it to the key the cluster was started with"
    )]
    KeyRefused { url: String, status: String },
    /// The proxy asks for a client key and none was sent.
    #[error(
        "the proxy asks for a client key ({url} answered {status}); set PDCTL_API_KEY to the key the cluster was started with"
    )]
    KeyNeeded { url: String, status: String },
    /// The proxy's model list names no model (the reason says what it answered).
    #[error("{0}")]
    NoModel(String),
    /// An engine of a pair did not say which model it serves, so the pair's models
    /// cannot be compared.
    #[error(
        "cannot compare the models of the pair: {engine} did not say which model it serves ({why})"
    )]
    ModelUnknown { engine: String, why: String },
}

/// The decode counter a received handoff adds to.
pub const EXTERNAL_KV_SERIES: &str = "vllm:prompt_tokens_by_source_total";

/// One running engine to check.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Its facts as the plan starts it (name, role, model, TP, block size).
    pub planned: EngineFacts,
    pub url: String,
}

/// The HTTP clients of a check: one for the engines (with the engine key), one for the
/// proxy (with the client key, when the proxy asks for one).
#[derive(Debug, Clone)]
pub struct Clients {
    pub engines: reqwest::Client,
    pub proxy: reqwest::Client,
}

impl Clients {
    /// Clients sending `engine_key` to the engines and `client_key` to the proxy.
    pub fn new(engine_key: Option<&str>, client_key: Option<&str>) -> reqwest::Result<Clients> {
        let build = |key: Option<&str>| {
            let mut headers = reqwest::header::HeaderMap::new();
            if let Some(k) = key
                && let Ok(v) = format!("Bearer {k}").parse()
            {
                headers.insert(reqwest::header::AUTHORIZATION, v);
            }
            reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .default_headers(headers)
                .build()
        };
        Ok(Clients {
            engines: build(engine_key)?,
            proxy: build(client_key)?,
        })
    }
}

/// What a running engine says of itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Answered {
    pub version: Option<String>,
    /// The model it serves; `None` when it did not say (see `model_unknown`).
    pub model: Option<String>,
    /// Why `model` is not known: what its `/v1/models` answered.
    pub model_unknown: Option<String>,
    pub block_size: Option<u32>,
    /// Its context length, as its `/v1/models` lists it (`max_model_len`).
    pub max_model_len: Option<u32>,
    /// Its KV cache dtype, as `vllm:cache_config_info` labels it (`cache_dtype`).
    pub kv_cache_dtype: Option<String>,
    /// Tokens its handoffs brought so far (the external_kv_transfer counter).
    pub external_tokens: Option<f64>,
}

/// The sizes one engine of a pair runs with, as it answers (the tensor-parallel size as
/// planned: vLLM reports it neither in `/v1/models` nor in its metrics).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineSizes {
    pub engine: String,
    pub tensor_parallel_planned: u32,
    pub block_size: Option<u32>,
    pub max_model_len: Option<u32>,
    pub kv_cache_dtype: Option<String>,
}

impl EngineSizes {
    /// What `engine` answered of its sizes.
    pub fn of(e: &Engine, a: &Answered) -> EngineSizes {
        EngineSizes {
            engine: e.planned.name.clone(),
            tensor_parallel_planned: e.planned.tensor_parallel,
            block_size: a.block_size,
            max_model_len: a.max_model_len,
            kv_cache_dtype: a.kv_cache_dtype.clone(),
        }
    }
}

impl std::fmt::Display for EngineSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let said = |v: Option<String>| v.unwrap_or_else(|| "not said".into());
        write!(
            f,
            "{} TP {} (planned), KV block {}, context {}, KV dtype {}",
            self.engine,
            self.tensor_parallel_planned,
            said(self.block_size.map(|b| b.to_string())),
            said(self.max_model_len.map(|n| n.to_string())),
            said(self.kv_cache_dtype.clone())
        )
    }
}

/// Where a running engine's answered sizes differ from what the plan started it with,
/// one line each ("decode-0 runs with KV block size 16, the plan says 32"); what it does
/// not say is not compared.
pub fn against_plan(e: &Engine, a: &Answered) -> Vec<String> {
    let p = &e.planned;
    let mut out = Vec::new();
    let mut differ = |what: &str, running: Option<String>, planned: Option<String>| {
        if let (Some(r), Some(pl)) = (running, planned)
            && r != pl
        {
            out.push(format!(
                "{} runs with {what} {r}, the plan says {pl}",
                p.name
            ));
        }
    };
    differ(
        "KV block size",
        a.block_size.map(|b| b.to_string()),
        p.block_size_set.then(|| p.block_size.to_string()),
    );
    differ(
        "context length",
        a.max_model_len.map(|n| n.to_string()),
        p.max_model_len.map(|n| n.to_string()),
    );
    differ(
        "KV cache dtype",
        a.kv_cache_dtype.clone(),
        Some(p.kv_cache_dtype.clone()),
    );
    out
}

/// The outcome for one prefill -> decode pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairResult {
    pub prefill: String,
    pub decode: String,
    /// True when the probe's KV reached the decode.
    pub moved: bool,
    pub prompt_tokens: u64,
    /// The prompt's full blocks: what the handoff must bring.
    pub expected_tokens: u64,
    /// How much the decode's external_kv_transfer counter grew.
    pub external_tokens: f64,
    /// The model both engines serve, when both said and they agree.
    pub model: Option<String>,
    pub elapsed_ms: f64,
    /// Handed-off tokens per second of the probe, end to end.
    pub tokens_per_s: f64,
    /// Mismatches between the two running engines (named with both sides).
    pub mismatches: Vec<String>,
    /// The sizes each engine of the pair answered.
    pub sizes: Vec<EngineSizes>,
    /// Where an engine runs with other sizes than the plan gave it: fails the pair.
    pub against_plan: Vec<String>,
    /// Why the KV did not move, or what else went wrong.
    pub problem: Option<String>,
}

impl PairResult {
    /// The pair before its probe: nothing moved, nothing measured, no problem yet.
    pub fn untried(prefill: &Engine, decode: &Engine) -> PairResult {
        PairResult {
            prefill: prefill.planned.name.clone(),
            decode: decode.planned.name.clone(),
            moved: false,
            prompt_tokens: 0,
            expected_tokens: 0,
            external_tokens: 0.0,
            model: None,
            elapsed_ms: 0.0,
            tokens_per_s: 0.0,
            mismatches: Vec::new(),
            sizes: Vec::new(),
            against_plan: Vec::new(),
            problem: None,
        }
    }
}

/// Asks an engine its version, model, block size and handoff counter.
pub async fn ask(client: &reqwest::Client, url: &str) -> Result<Answered, CheckError> {
    let get = |path: &str| {
        let u = format!("{url}{path}");
        let c = client.clone();
        async move {
            let r = c
                .get(&u)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .map_err(|e| CheckError::Unreachable {
                    url: u.clone(),
                    why: crate::error_text::chain(&e),
                })?;
            let status = r.status();
            let text = r.text().await.map_err(|e| CheckError::Unreadable {
                url: u.clone(),
                why: e.to_string(),
            })?;
            Ok::<_, CheckError>((status, text, u))
        }
    };
    let (_, version, _) = get("/version").await?;
    let version: Value = serde_json::from_str(&version).unwrap_or_default();
    let (status, models, models_url) = get("/v1/models").await?;
    let (_, metrics, _) = get("/metrics").await?;
    let cache_label = |name: &str| {
        crate::prometheus::samples(&metrics)
            .find(|s| s.name == "vllm:cache_config_info")
            .and_then(|s| crate::prometheus::label_value(s.labels, name))
    };
    let block_size = cache_label("block_size").and_then(|b| b.parse().ok());
    let listed: Value = serde_json::from_str(&models).unwrap_or_default();
    let max_model_len = listed["data"][0]["max_model_len"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok());
    let (model, model_unknown) = served_model(status, &models, &models_url);
    Ok(Answered {
        version: version["version"].as_str().map(str::to_string),
        model,
        model_unknown,
        block_size,
        max_model_len,
        kv_cache_dtype: cache_label("cache_dtype"),
        external_tokens: external_tokens(&metrics),
    })
}

/// The model the proxy lists first (the one the probes ask for); Err says what went wrong,
/// naming the client key when the proxy asks for one (`keyed`: one was sent).
pub async fn proxy_model(
    client: &reqwest::Client,
    proxy: &str,
    keyed: bool,
) -> Result<String, CheckError> {
    let url = format!("{proxy}/v1/models");
    let r = client
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| CheckError::Unreachable {
            url: url.clone(),
            why: crate::error_text::chain(&e),
        })?;
    let status = r.status();
    let body = r.text().await.unwrap_or_default();
    if status == reqwest::StatusCode::UNAUTHORIZED {
        let status = status.to_string();
        return Err(if keyed {
            CheckError::KeyRefused { url, status }
        } else {
            CheckError::KeyNeeded { url, status }
        });
    }
    match served_model(status, &body, &url) {
        (Some(m), _) => Ok(m),
        (None, why) => Err(CheckError::NoModel(why.unwrap_or_default())),
    }
}

/// The model a `/v1/models` answer names, or why it names none.
fn served_model(
    status: reqwest::StatusCode,
    body: &str,
    url: &str,
) -> (Option<String>, Option<String>) {
    let v: Value = serde_json::from_str(body).unwrap_or_default();
    match v["data"][0]["id"].as_str() {
        Some(m) if status.is_success() => (Some(m.to_string()), None),
        _ if !status.is_success() => (
            None,
            Some(format!(
                "GET {url} answered {status}: {}",
                crate::error_text::answer_message(body.as_bytes())
            )),
        ),
        _ => (None, Some(format!("GET {url} lists no model"))),
    }
}

/// The model both engines of a pair serve; Err says why it cannot be compared (an engine
/// that did not say), which fails the pair. Different models are a fatal mismatch
/// ([`running_mismatches`]), not this.
pub fn pair_model(
    prefill: &Engine,
    p: &Answered,
    decode: &Engine,
    d: &Answered,
) -> Result<Option<String>, CheckError> {
    let unknown = |e: &Engine, a: &Answered| CheckError::ModelUnknown {
        engine: e.planned.name.clone(),
        why: a
            .model_unknown
            .as_deref()
            .unwrap_or("no answer")
            .to_string(),
    };
    match (&p.model, &d.model) {
        (Some(pm), Some(dm)) => Ok((pm == dm).then(|| pm.clone())),
        (None, _) => Err(unknown(prefill, p)),
        (_, None) => Err(unknown(decode, d)),
    }
}

/// The sum of the decode's external_kv_transfer prompt tokens over its engines.
pub fn external_tokens(metrics: &str) -> Option<f64> {
    let mut total = None;
    for s in crate::prometheus::samples(metrics).filter(|s| s.name == EXTERNAL_KV_SERIES) {
        if crate::prometheus::label_value(s.labels, "source").as_deref()
            == Some("external_kv_transfer")
        {
            *total.get_or_insert(0.0) += s.value;
        }
    }
    total
}

/// What the two running engines disagree on, as they answer (plan facts corrected by
/// what they say).
pub fn running_mismatches(
    prefill: &Engine,
    p: &Answered,
    decode: &Engine,
    d: &Answered,
    connector: &str,
) -> Vec<Mismatch> {
    let live = |e: &Engine, a: &Answered| EngineFacts {
        model: a.model.clone().or_else(|| e.planned.model.clone()),
        block_size: a.block_size.unwrap_or(e.planned.block_size),
        ..e.planned.clone()
    };
    let mut out = compare(&live(prefill, p), &live(decode, d), connector);
    // The served name may differ from the planned path: compare what they serve (an
    // engine that does not say fails the pair by [`pair_model`]).
    out.retain(|m| m.what != "model" || p.model.is_some() && d.model.is_some());
    if let (Some(pv), Some(dv)) = (&p.version, &d.version)
        && pv != dv
    {
        out.push(Mismatch {
            what: "vLLM version",
            prefill: prefill.planned.name.clone(),
            prefill_value: pv.clone(),
            decode: decode.planned.name.clone(),
            decode_value: dv.clone(),
            fatal: true,
        });
    }
    out
}

/// The full blocks of a `prompt_tokens` prompt, which a handoff brings (vLLM computes the
/// last token itself, so a prompt of whole blocks hands over one block less).
pub fn full_block_tokens(prompt_tokens: u64, block_size: u32) -> u64 {
    let bs = u64::from(block_size.max(1));
    (prompt_tokens.saturating_sub(1) / bs) * bs
}

/// A prompt of about `words` tokens that no engine has cached (its first words are
/// unique), so the decode can only get its KV by the handoff.
pub fn probe_prompt(words: usize, nonce: u64) -> String {
    const WORDS: [&str; 12] = [
        "check", "the", "path", "that", "moves", "cache", "blocks", "from", "prefill", "to",
        "decode", "now",
    ];
    let mut p = format!("pdctl check {nonce:016x}");
    for i in 0..words.saturating_sub(3) {
        p.push(' ');
        p.push_str(WORDS[(i * 7 + nonce as usize) % WORDS.len()]);
    }
    p
}

/// Sends the probe through the proxy, pinned to the pair with the `user` designation, and
/// measures what reached the decode.
pub async fn probe(
    clients: &Clients,
    proxy: &str,
    model: &str,
    prefill: &Engine,
    decode: &Engine,
    words: usize,
    block_size: u32,
) -> PairResult {
    let mut r = PairResult::untried(prefill, decode);
    let client = &clients.engines;
    let before = match ask(client, &decode.url).await {
        Ok(a) => a.external_tokens,
        Err(e) => {
            r.problem = Some(e.to_string());
            return r;
        }
    };
    let Some(before) = before else {
        r.problem = Some(format!(
            "{} has no {EXTERNAL_KV_SERIES}{{source=\"external_kv_transfer\"}} counter (vLLM 0.26 or later has it): the handoff cannot be proved",
            decode.planned.name
        ));
        return r;
    };
    let host_port = |u: &str| {
        u.trim_start_matches("http://")
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .to_string()
    };
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let body = json!({
        "model": model,
        "prompt": probe_prompt(words, nonce),
        "max_tokens": 2,
        "temperature": 0.0,
        "user": format!("prefill={};decode={}", host_port(&prefill.url), host_port(&decode.url)),
    });
    let t = Instant::now();
    let answer = clients
        .proxy
        .post(format!("{proxy}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await;
    let answer = match answer {
        Ok(a) => a,
        Err(e) => {
            r.problem = Some(format!(
                "the probe through {proxy} failed: {}",
                crate::error_text::chain(&e)
            ));
            return r;
        }
    };
    let status = answer.status();
    let text = answer.text().await.unwrap_or_default();
    r.elapsed_ms = t.elapsed().as_secs_f64() * 1e3;
    if !status.is_success() {
        r.problem = Some(format!(
            "the probe got HTTP {status}: {}",
            crate::error_text::answer_message(text.as_bytes())
        ));
        return r;
    }
    let v: Value = serde_json::from_str(&text).unwrap_or_default();
    r.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    r.expected_tokens = full_block_tokens(r.prompt_tokens, block_size);
    measure(client, decode, before, block_size, &mut r).await;
    r
}

/// How much of the probe's prompt reached the decode by handoff (its counter's growth
/// since `before`), and the verdict.
async fn measure(
    client: &reqwest::Client,
    decode: &Engine,
    before: f64,
    block_size: u32,
    r: &mut PairResult,
) {
    // vLLM updates its counters as the step's stats come in: give them a moment.
    let end = Instant::now() + Duration::from_secs(3);
    loop {
        let now = ask(client, &decode.url)
            .await
            .ok()
            .and_then(|a| a.external_tokens)
            .unwrap_or(before);
        r.external_tokens = now - before;
        if r.external_tokens >= r.expected_tokens as f64 || Instant::now() >= end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    r.moved = r.expected_tokens > 0 && r.external_tokens >= r.expected_tokens as f64;
    r.tokens_per_s = r.expected_tokens as f64 / (r.elapsed_ms / 1e3).max(1e-9);
    if !r.moved {
        r.problem = Some(if r.expected_tokens == 0 {
            format!(
                "the probe's prompt ({} tokens) fills no KV block of {block_size}: give a longer --prompt-tokens",
                r.prompt_tokens
            )
        } else {
            format!(
                "the KV did NOT move: {} took {} of the prompt's {} full-block tokens by handoff and computed the rest itself (a silent recompute: see its log and the connector's transport)",
                decode.planned.name, r.external_tokens, r.expected_tokens
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handoff_brings_the_full_blocks_before_the_last_token() {
        assert_eq!(full_block_tokens(70, 16), 64);
        assert_eq!(full_block_tokens(64, 16), 48);
        assert_eq!(full_block_tokens(65, 16), 64);
        assert_eq!(full_block_tokens(10, 16), 0);
    }

    #[test]
    fn the_handoff_counter_sums_over_engines() {
        let page = "vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"external_kv_transfer\"} 64\n\
                    vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"local_compute\"} 6\n\
                    vllm:prompt_tokens_by_source_total{engine=\"1\",source=\"external_kv_transfer\"} 32\n";
        assert_eq!(external_tokens(page), Some(96.0));
        assert_eq!(external_tokens("vllm:num_requests_running 0\n"), None);
    }

    fn engine(name: &str) -> Engine {
        Engine {
            planned: EngineFacts {
                name: name.into(),
                role: crate::vocab::Role::Decode,
                model: Some("/models/m".into()),
                tensor_parallel: 1,
                block_size: 16,
                block_size_set: true,
                max_model_len: Some(4096),
                kv_cache_dtype: "auto".into(),
            },
            url: "http://h:1".into(),
        }
    }

    #[test]
    fn an_engine_that_does_not_say_its_model_fails_the_pair_saying_why() {
        let ok = reqwest::StatusCode::OK;
        let models = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
        assert_eq!(served_model(ok, models, "u"), (Some("m".into()), None));
        let (m, why) = served_model(
            reqwest::StatusCode::UNAUTHORIZED,
            r#"{"error":"Unauthorized"}"#,
            "http://h:1/v1/models",
        );
        assert_eq!(m, None);
        assert!(
            why.unwrap()
                .starts_with("GET http://h:1/v1/models answered 401")
        );
        let (p, d) = (engine("prefill-0"), engine("decode-0"));
        let said = |m: &str| Answered {
            model: Some(m.into()),
            ..Answered::default()
        };
        assert_eq!(
            pair_model(&p, &said("m"), &d, &said("m")),
            Ok(Some("m".into()))
        );
        // Different models: a mismatch (reported apart), not a comparison that failed.
        assert_eq!(pair_model(&p, &said("m"), &d, &said("n")), Ok(None));
        let silent = Answered {
            model_unknown: Some("GET u answered 401".into()),
            ..Answered::default()
        };
        let e = pair_model(&p, &said("m"), &d, &silent).unwrap_err();
        assert!(matches!(&e, CheckError::ModelUnknown { engine, .. } if engine == "decode-0"));
        assert_eq!(
            e.to_string(),
            "cannot compare the models of the pair: decode-0 did not say which model it serves (GET u answered 401)"
        );
    }

    #[test]
    fn an_engine_running_other_sizes_than_planned_is_named_with_both() {
        let d = engine("decode-0");
        let same = Answered {
            block_size: Some(16),
            max_model_len: Some(4096),
            kv_cache_dtype: Some("auto".into()),
            ..Answered::default()
        };
        assert!(against_plan(&d, &same).is_empty());
        assert!(
            against_plan(&d, &Answered::default()).is_empty(),
            "nothing said"
        );
        let other = Answered {
            block_size: Some(32),
            kv_cache_dtype: Some("fp8".into()),
            ..same.clone()
        };
        assert_eq!(
            against_plan(&d, &other),
            [
                "decode-0 runs with KV block size 32, the plan says 16",
                "decode-0 runs with KV cache dtype fp8, the plan says auto"
            ]
        );
        assert_eq!(
            EngineSizes::of(&d, &other).to_string(),
            "decode-0 TP 1 (planned), KV block 32, context 4096, KV dtype fp8"
        );
        // Without --block-size the platform picks it (vLLM's CPU build: 128): not compared.
        let mut unset = engine("decode-0");
        unset.planned.block_size_set = false;
        let cpu = Answered {
            block_size: Some(128),
            ..same.clone()
        };
        assert!(
            against_plan(&unset, &cpu).is_empty(),
            "{:?}",
            against_plan(&unset, &cpu)
        );
    }

    #[test]
    fn probe_prompts_differ_from_the_first_words() {
        let (a, b) = (probe_prompt(50, 1), probe_prompt(50, 2));
        assert_ne!(a.split(' ').nth(2), b.split(' ').nth(2));
        assert_eq!(a.split(' ').count(), 50);
    }
}
