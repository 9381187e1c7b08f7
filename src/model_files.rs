//! How large a model is, as planning needs it: the bytes and parameters of its weights, read
//! from its safetensors headers (or estimated from its config.json), the KV cache one token
//! takes and its own context length.
//!
//! Engines sharing a GPU get a fixed KV cache size (`--kv-cache-memory-bytes`) so they can
//! start together; that size is what their share of the GPU leaves after the weights.
//! Reading the files is I/O, so it happens here, at the edge (`plan::resolve` asks once),
//! and the pure planner gets a [`ModelSize`] as data. Only headers are read: a safetensors
//! file starts with an 8-byte length and a JSON table of its tensors.

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// A model's size as the planner uses it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSize {
    /// Parameters over every tensor.
    pub parameters: u64,
    /// Bytes the weights take as stored (their dtype as written in the files).
    pub stored_bytes: u64,
    /// Where the figures come from, said in `pdctl plan`: "safetensors headers of 2 files",
    /// "estimated from config.json".
    pub source: String,
    /// Elements of KV cache one token takes over all layers (2 x layers x KV heads x head
    /// size), when config.json says (None for attention it does not describe, e.g. MLA).
    pub kv_elements_per_token: Option<u64>,
    /// The model's own context length (`max_position_embeddings`), when config.json says.
    pub max_position_embeddings: Option<u64>,
    /// KV heads of its attention (`num_key_value_heads`), when config.json says (None for
    /// MLA): a connector that cannot read replicated heads limits a side's TP to them.
    pub kv_heads: Option<u64>,
}

/// The size of `model` (a local directory, or a Hugging Face id found in the local hub
/// cache), or why it is unknown. `env` is the engines' environment from the topology
/// (`HF_HUB_CACHE` / `HF_HOME` there win over pdctl's own).
pub fn read(model: &str, env: &BTreeMap<String, String>) -> Result<ModelSize, String> {
    let dir = model_dir(model, env)?;
    let config = read_config(&dir);
    let files = safetensors_files(&dir)?;
    let (parameters, stored_bytes, source) = if files.is_empty() {
        let c = config.as_ref().map_err(|e| {
            format!(
                "{} has no *.safetensors files and its config.json cannot be read: {e}",
                dir.display()
            )
        })?;
        let (params, bytes) = estimate_weights(c).ok_or_else(|| {
            format!(
                "{} has no *.safetensors files and its config.json does not give the sizes to estimate the weights from",
                dir.display()
            )
        })?;
        (params, bytes, "estimated from config.json".to_string())
    } else {
        let mut params = 0u64;
        let mut bytes = 0u64;
        for f in &files {
            let (p, b) = safetensors_header(f)?;
            params += p;
            bytes += b;
        }
        let n = files.len();
        let source = format!(
            "safetensors headers of {n} file{}",
            if n == 1 { "" } else { "s" }
        );
        (params, bytes, source)
    };
    let config = config.ok();
    Ok(ModelSize {
        parameters,
        stored_bytes,
        source,
        kv_elements_per_token: config.as_ref().and_then(kv_elements_per_token),
        kv_heads: config.as_ref().and_then(kv_heads),
        max_position_embeddings: config.as_ref().and_then(|c| {
            first_u64(
                c,
                &["max_position_embeddings", "n_positions", "max_seq_len"],
            )
        }),
    })
}

/// Whether `model` names a Hugging Face repository (`org/name`) rather than a local
/// directory: only such a model can be fetched.
pub fn is_hub_id(model: &str) -> bool {
    !Path::new(model).is_dir()
        && !model.starts_with('/')
        && !model.starts_with('.')
        && !model.starts_with('~')
        && model.matches('/').count() == 1
}

/// The snapshot directory of a hub model that the cache holds whole (config.json and its
/// weights: every file its index names, else at least one safetensors or .bin file), or
/// why it does not: what decides whether `up` must fetch it first.
pub fn cached(model: &str, env: &BTreeMap<String, String>) -> Result<PathBuf, String> {
    let dir = model_dir(model, env)?;
    if !dir.join("config.json").is_file() {
        return Err(format!("{} has no config.json", dir.display()));
    }
    for index in [
        "model.safetensors.index.json",
        "pytorch_model.bin.index.json",
    ] {
        let path = dir.join(index);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
            let names: std::collections::BTreeSet<&str> = v["weight_map"]
                .as_object()
                .map(|m| m.values().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if let Some(gone) = names.iter().find(|n| !dir.join(n).is_file()) {
                return Err(format!("{} lacks {gone}", dir.display()));
            }
            return Ok(dir);
        }
    }
    let weights = std::fs::read_dir(&dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .any(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|x| x == "safetensors" || x == "bin")
        });
    if !weights {
        return Err(format!("{} has no weights", dir.display()));
    }
    Ok(dir)
}

/// A model's size from the hub's file list, before it is fetched: the bytes of its weight
/// files (a safetensors file is its tensors and a header of a few KiB), the rest from its
/// config.json when the hub gave it. `weights` are (file name, size).
pub fn from_hub_list(weights: &[(String, u64)], config: Option<&Value>) -> ModelSize {
    let stored_bytes: u64 = weights.iter().map(|(_, s)| *s).sum();
    let config = config.map(|c| {
        let mut c = c.clone();
        if let Some(text_config) = c.get("text_config").and_then(Value::as_object).cloned()
            && let Some(top) = c.as_object_mut()
        {
            top.extend(text_config);
        }
        c
    });
    let width = match config
        .as_ref()
        .and_then(|c| c.get("torch_dtype").or_else(|| c.get("dtype")))
        .and_then(Value::as_str)
    {
        Some("float32") => 4,
        _ => 2,
    };
    let n = weights.len();
    ModelSize {
        parameters: stored_bytes / width,
        stored_bytes,
        source: format!(
            "the hub's file list: {n} weight file{}, not fetched yet",
            if n == 1 { "" } else { "s" }
        ),
        kv_elements_per_token: config.as_ref().and_then(kv_elements_per_token),
        kv_heads: config.as_ref().and_then(kv_heads),
        max_position_embeddings: config.as_ref().and_then(|c| {
            first_u64(
                c,
                &["max_position_embeddings", "n_positions", "max_seq_len"],
            )
        }),
    }
}

/// The directory holding the model's files.
fn model_dir(model: &str, env: &BTreeMap<String, String>) -> Result<PathBuf, String> {
    let local = Path::new(model);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    if model.starts_with('/') || model.starts_with('.') || model.matches('/').count() != 1 {
        return Err(format!("{model} is not a directory"));
    }
    let hub = hub_cache(env);
    let repo = hub.join(format!("models--{}", model.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    let by_ref = std::fs::read_to_string(repo.join("refs/main"))
        .ok()
        .map(|r| snapshots.join(r.trim()))
        .filter(|d| d.is_dir());
    by_ref
        .or_else(|| {
            let mut all: Vec<PathBuf> = std::fs::read_dir(&snapshots)
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .collect();
            all.sort();
            all.pop()
        })
        .ok_or_else(|| {
            format!(
                "{model} is not a local directory and not in the Hugging Face cache ({})",
                hub.display()
            )
        })
}

/// Where Hugging Face keeps downloaded models: HF_HUB_CACHE, else HF_HOME/hub, else
/// ~/.cache/huggingface/hub; the engines' environment first, then this process's.
pub fn hub_cache(env: &BTreeMap<String, String>) -> PathBuf {
    let var = |k: &str| {
        env.get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .filter(|v| !v.is_empty())
    };
    if let Some(c) = var("HF_HUB_CACHE") {
        return PathBuf::from(c);
    }
    if let Some(h) = var("HF_HOME") {
        return PathBuf::from(h).join("hub");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
    PathBuf::from(home).join(".cache/huggingface/hub")
}

/// The weight files: those the index names when there is one, else every `*.safetensors`
/// (without `consolidated*` when others are there: some repositories ship both forms).
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", index.display()))?;
        let names: std::collections::BTreeSet<&str> = v["weight_map"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !names.is_empty() {
            return Ok(names.into_iter().map(|n| dir.join(n)).collect());
        }
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    all.sort();
    let consolidated = |p: &PathBuf| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("consolidated"))
    };
    if all.iter().any(|p| !consolidated(p)) {
        all.retain(|p| !consolidated(p));
    }
    Ok(all)
}

/// (parameters, bytes) of the tensors one safetensors file holds, from its header alone.
fn safetensors_header(path: &Path) -> Result<(u64, u64), String> {
    let bad = |why: String| format!("{} is not a safetensors file: {why}", path.display());
    let mut f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| bad(e.to_string()))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(bad(format!("a header of {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(|e| bad(e.to_string()))?;
    let v: Value = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    let tensors = v
        .as_object()
        .ok_or_else(|| bad("its header is no table".into()))?;
    let (mut params, mut bytes) = (0u64, 0u64);
    for (name, t) in tensors.iter().filter(|(k, _)| *k != "__metadata__") {
        let shape = t["shape"]
            .as_array()
            .ok_or_else(|| bad(format!("tensor {name} has no shape")))?;
        params += shape
            .iter()
            .map(|d| d.as_u64().unwrap_or(0))
            .product::<u64>();
        let offsets = t["data_offsets"].as_array();
        let (Some(a), Some(b)) = (
            offsets.and_then(|o| o.first()).and_then(Value::as_u64),
            offsets.and_then(|o| o.get(1)).and_then(Value::as_u64),
        ) else {
            return Err(bad(format!("tensor {name} has no data_offsets")));
        };
        bytes += b.saturating_sub(a);
    }
    Ok((params, bytes))
}

/// config.json, with a multimodal model's `text_config` merged over it (the language
/// model's sizes are there).
fn read_config(dir: &Path) -> Result<Value, String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut v: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    if let Some(text_config) = v.get("text_config").and_then(Value::as_object).cloned()
        && let Some(top) = v.as_object_mut()
    {
        top.extend(text_config);
    }
    Ok(v)
}

fn first_u64(c: &Value, keys: &[&str]) -> Option<u64> {
    keys.iter().find_map(|k| c.get(*k).and_then(Value::as_u64))
}

/// The KV heads of config.json's attention (None for MLA, which caches one latent).
fn kv_heads(c: &Value) -> Option<u64> {
    if c.get("kv_lora_rank").is_some_and(|v| !v.is_null()) {
        return None;
    }
    first_u64(c, &["num_key_value_heads", "multi_query_group_num"])
        .or_else(|| first_u64(c, &["num_attention_heads", "n_head"]))
}

/// 2 x layers x KV heads x head size, from config.json (None for MLA, which caches a
/// compressed latent instead).
fn kv_elements_per_token(c: &Value) -> Option<u64> {
    if c.get("kv_lora_rank").is_some_and(|v| !v.is_null()) {
        return None;
    }
    let layers = first_u64(c, &["num_hidden_layers", "n_layer", "num_layers"])?;
    let heads = first_u64(c, &["num_attention_heads", "n_head"])?;
    let kv_heads = first_u64(c, &["num_key_value_heads", "multi_query_group_num"]).unwrap_or(heads);
    let head_dim = match first_u64(c, &["head_dim"]) {
        Some(d) => d,
        None => first_u64(c, &["hidden_size", "n_embd", "d_model"])? / heads.max(1),
    };
    Some(2 * layers * kv_heads * head_dim)
}

/// (parameters, bytes) of a dense or mixture-of-experts decoder as config.json describes
/// it: embeddings, attention and MLP weights; norms and biases left out.
fn estimate_weights(c: &Value) -> Option<(u64, u64)> {
    let hidden = first_u64(c, &["hidden_size", "n_embd", "d_model"])?;
    let layers = first_u64(c, &["num_hidden_layers", "n_layer", "num_layers"])?;
    let vocab = first_u64(c, &["vocab_size"])?;
    let heads = first_u64(c, &["num_attention_heads", "n_head"])?;
    let kv_heads = first_u64(c, &["num_key_value_heads"]).unwrap_or(heads);
    let head_dim = first_u64(c, &["head_dim"]).unwrap_or(hidden / heads.max(1));
    let experts = first_u64(c, &["num_local_experts", "num_experts", "n_routed_experts"]);
    let mlp_width = match experts {
        Some(_) => first_u64(c, &["moe_intermediate_size", "intermediate_size"])?,
        None => first_u64(c, &["intermediate_size", "n_inner"]).unwrap_or(4 * hidden),
    };
    let tied = c
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim;
    let mlp = 3 * hidden * mlp_width * experts.unwrap_or(1).max(1);
    let params = vocab * hidden * if tied { 1 } else { 2 } + layers * (attention + mlp);
    let bytes_per = match c
        .get("torch_dtype")
        .or_else(|| c.get("dtype"))
        .and_then(Value::as_str)
    {
        Some("float32") => 4,
        _ => 2,
    };
    Some((params, params * bytes_per))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_safetensors(path: &Path, tensors: &[(&str, &str, &[u64])]) {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut at = 0u64;
        for (name, dtype, shape) in tensors {
            let size = if *dtype == "F32" { 4 } else { 2 };
            let n = shape.iter().product::<u64>() * size;
            header.insert(
                (*name).into(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}),
            );
            at += n;
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h);
        bytes.extend(std::iter::repeat_n(0u8, at as usize));
        std::fs::write(path, bytes).unwrap();
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("pdctl-model-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn weights_are_read_from_every_shard_header() {
        let d = temp_dir("shards");
        write_safetensors(
            &d.join("model-00001-of-00002.safetensors"),
            &[("a", "BF16", &[4, 8])],
        );
        write_safetensors(
            &d.join("model-00002-of-00002.safetensors"),
            &[("b", "BF16", &[16])],
        );
        write_safetensors(
            &d.join("consolidated.safetensors"),
            &[("a", "BF16", &[4, 8]), ("b", "BF16", &[16])],
        );
        std::fs::write(
            d.join("config.json"),
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "hidden_size": 512, "max_position_embeddings": 4096}"#,
        )
        .unwrap();
        let m = read(d.to_str().unwrap(), &BTreeMap::new()).unwrap();
        assert_eq!((m.parameters, m.stored_bytes), (48, 96));
        assert_eq!(m.source, "safetensors headers of 2 files");
        assert_eq!(m.kv_elements_per_token, Some(2 * 2 * 2 * 64));
        assert_eq!(m.max_position_embeddings, Some(4096));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn without_weights_config_json_gives_an_estimate_and_without_either_the_error_says_why() {
        let d = temp_dir("config");
        std::fs::write(
            d.join("config.json"),
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
                "intermediate_size": 1024, "vocab_size": 400, "tie_word_embeddings": true,
                "torch_dtype": "float32"}"#,
        )
        .unwrap();
        let m = read(d.to_str().unwrap(), &BTreeMap::new()).unwrap();
        let per_layer = 4 * 512 * 512 + 3 * 512 * 1024;
        assert_eq!(m.parameters, 400 * 512 + 2 * per_layer);
        assert_eq!(m.stored_bytes, 4 * m.parameters);
        assert_eq!(m.source, "estimated from config.json");
        std::fs::remove_file(d.join("config.json")).unwrap();
        let e = read(d.to_str().unwrap(), &BTreeMap::new()).unwrap_err();
        assert!(e.contains("no *.safetensors files"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_hub_id_is_looked_up_in_the_cache_the_engines_use() {
        let hub = temp_dir("hub");
        let snap = hub.join("models--org--tiny/snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(hub.join("models--org--tiny/refs")).unwrap();
        std::fs::write(hub.join("models--org--tiny/refs/main"), "abc123").unwrap();
        write_safetensors(&snap.join("model.safetensors"), &[("w", "F32", &[10, 10])]);
        let env = BTreeMap::from([("HF_HUB_CACHE".to_string(), hub.display().to_string())]);
        let m = read("org/tiny", &env).unwrap();
        assert_eq!((m.parameters, m.stored_bytes), (100, 400));
        let e = read("org/other", &env).unwrap_err();
        assert!(e.contains("not in the Hugging Face cache"), "{e}");
        std::fs::remove_dir_all(hub).unwrap();
    }

    #[test]
    fn a_cached_model_is_whole_only_with_its_config_and_every_weight_file() {
        let hub = temp_dir("cached");
        let snap = hub.join("models--org--m/snapshots/c1");
        std::fs::create_dir_all(&snap).unwrap();
        let env = BTreeMap::from([("HF_HUB_CACHE".to_string(), hub.display().to_string())]);
        assert!(is_hub_id("org/m") && !is_hub_id("/models/m") && !is_hub_id("m"));
        write_safetensors(
            &snap.join("model-00001-of-00002.safetensors"),
            &[("a", "BF16", &[4])],
        );
        std::fs::write(
            snap.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let e = cached("org/m", &env).unwrap_err();
        assert!(e.ends_with("has no config.json"), "{e}");
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        let e = cached("org/m", &env).unwrap_err();
        assert!(e.ends_with("lacks model-00002-of-00002.safetensors"), "{e}");
        write_safetensors(
            &snap.join("model-00002-of-00002.safetensors"),
            &[("b", "BF16", &[4])],
        );
        assert_eq!(cached("org/m", &env).unwrap(), snap);
        std::fs::remove_dir_all(hub).unwrap();
    }

    #[test]
    fn the_hubs_file_list_sizes_a_model_not_fetched_yet() {
        let config = serde_json::json!({"num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "hidden_size": 512, "max_position_embeddings": 4096});
        let m = from_hub_list(&[("model.safetensors".into(), 1000)], Some(&config));
        assert_eq!((m.stored_bytes, m.parameters), (1000, 500));
        assert_eq!(m.kv_elements_per_token, Some(2 * 2 * 2 * 64));
        assert_eq!(m.max_position_embeddings, Some(4096));
        assert_eq!(
            m.source,
            "the hub's file list: 1 weight file, not fetched yet"
        );
    }
}
