//! The KV cache size of an engine that shares its GPU, so that the engines sharing one can
//! start together.
//!
//! vLLM sizes its KV cache by profiling at start-up: whatever its share of the GPU
//! (`--gpu-memory-utilization`) leaves after the weights and the activations it measured.
//! Two engines profiling at once on one GPU each count the other's allocations as their
//! own, so without a fixed size they must start one after the other. Where vLLM takes
//! `--kv-cache-memory-bytes` (0.10.2 on), pdctl computes that size itself: the engine's
//! share of the GPU's free memory, less the model's weights (per GPU of the instance) and
//! a reserve for activations, CUDA's context and graphs. Pure: the GPU's memory and the
//! model's size are read at the edge and given as data.

use crate::gpu::Gpu;
use crate::model_files::ModelSize;
use crate::topology::Problem;
use crate::vocab::{Version, VersionRange};

/// vLLM that takes `--kv-cache-memory-bytes`: the flag came with 0.10.2 (its
/// `CacheConfig.kv_cache_memory_bytes`; 0.10.1.1 has neither).
pub(super) const KV_CACHE_MEMORY_BYTES: VersionRange = VersionRange::from((0, 10, 2));

/// What an engine needs besides weights and KV cache: activations at its largest batch,
/// CUDA's context and cuBLAS workspace, CUDA graphs. vLLM's own profiling measures them;
/// 2 GiB covers what a dense model needs at vLLM's default batch sizes.
pub(super) const RESERVE_BYTES: u64 = 2 << 30;

/// KV cache sizes are rounded down to this, so small changes of the free memory do not
/// change the command line.
const ALIGN: u64 = 64 << 20;

/// What sizing one engine's KV cache needs to know.
pub(super) struct Ask<'a> {
    /// The engine's name and the names of the others on its GPUs.
    pub name: &'a str,
    pub neighbours: &'a [String],
    /// Its GPUs, as the inventory describes them (one per tensor-parallel rank).
    pub gpus: &'a [&'a Gpu],
    /// Its share of each GPU (`--gpu-memory-utilization`).
    pub share: f64,
    /// The vLLM version it runs.
    pub version: &'a Version,
    /// The model's size, or why it is unknown.
    pub model: Result<&'a ModelSize, &'a str>,
    /// Bytes per weight and per KV element from `--dtype` / `--kv-cache-dtype`, when given.
    pub dtype_bytes: Option<u64>,
    pub kv_dtype_bytes: Option<u64>,
    /// The context length it serves (`--max-model-len`, `[model] max_model_len`), when set.
    pub max_model_len: Option<u64>,
}

/// How an engine sharing a GPU is sized.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Sized {
    /// A fixed KV cache of this many bytes: it starts together with its neighbours.
    Fixed { bytes: u64, why: String },
    /// vLLM profiles it: it starts after its neighbour, for this reason.
    Profiled { why: String },
}

/// The KV cache of one engine sharing its GPUs; `Err` when its share leaves no room for
/// one (a located refusal naming the numbers).
pub(super) fn size(a: &Ask) -> Result<Sized, Problem> {
    if !KV_CACHE_MEMORY_BYTES.contains(a.version) {
        return Ok(Sized::Profiled {
            why: format!(
                "vLLM {} has no --kv-cache-memory-bytes ({KV_CACHE_MEMORY_BYTES} have it)",
                a.version
            ),
        });
    }
    let mut free = Vec::new();
    for g in a.gpus {
        match g.free_mib() {
            Some(f) => free.push((g.index, f << 20)),
            None => {
                return Ok(Sized::Profiled {
                    why: format!(
                        "GPU {}'s memory is unknown (declared without a size: --gpus {}:80GiB gives it)",
                        g.index, g.index
                    ),
                });
            }
        }
    }
    let model = match a.model {
        Ok(m) => m,
        Err(why) => {
            return Ok(Sized::Profiled {
                why: format!("the model's size is unknown: {why}"),
            });
        }
    };
    let Some(&(gpu, free_bytes)) = free.iter().min_by_key(|(_, f)| *f) else {
        return Ok(Sized::Profiled {
            why: "it has no GPU".into(),
        });
    };
    let ranks = a.gpus.len().max(1) as u64;
    let budget = (free_bytes as f64 * a.share) as u64;
    let weights = weight_bytes(model, a.dtype_bytes).div_ceil(ranks);
    let left = budget.saturating_sub(weights + RESERVE_BYTES) / ALIGN * ALIGN;
    let per_token = model.kv_elements_per_token.map(|e| {
        e * a
            .kv_dtype_bytes
            .or(a.dtype_bytes)
            .unwrap_or(stored_width(model))
            / ranks
    });
    let context = a.max_model_len.or(model.max_position_embeddings);
    let needed = match (per_token, context) {
        (Some(t), Some(c)) => t * c,
        _ => 1,
    };
    let sums = format!(
        "{} of GPU {gpu}'s {} free is {}, less the weights {} ({}) and {} kept for activations and CUDA",
        a.share,
        gib(free_bytes),
        gib(budget),
        gib(weights),
        model.source,
        gib(RESERVE_BYTES),
    );
    if left < needed {
        return Err(no_room(a, &sums, left, needed, context));
    }
    Ok(Sized::Fixed {
        bytes: left,
        why: format!("KV cache {}: {sums}", gib(left)),
    })
}

/// The refusal of an engine whose share of its GPU leaves `left` bytes for a KV cache
/// that needs `needed` (one sequence of `context` tokens; 1: any room at all), with the
/// sums that led there.
fn no_room(a: &Ask, sums: &str, left: u64, needed: u64, context: Option<u64>) -> Problem {
    let room = if needed > 1 {
        format!(
            "leaves {} for the KV cache, and one {}-token sequence needs {}",
            gib(left),
            context.unwrap_or_default(),
            gib(needed)
        )
    } else {
        "leaves no room for the KV cache".to_string()
    };
    let with = if a.neighbours.is_empty() {
        String::new()
    } else {
        format!(" (shared with {})", a.neighbours.join(", "))
    };
    Problem::new(
        "engine.instances_per_gpu",
        format!("{}{with}: {sums} {room}", a.name),
    )
    .also("engine.gpu_memory_utilization")
    .hint("give each engine a GPU of its own (lower engine.instances_per_gpu), raise engine.gpu_memory_utilization, free the GPU, or serve a smaller model or a shorter max_model_len")
}

/// Bytes of the weights as the engine loads them: in the dtype `--dtype` asks for, for a
/// model stored in 16 or 32 bits; as stored otherwise (quantized weights, or no --dtype:
/// vLLM keeps the files' dtype, or narrows float32, which this over-counts).
fn weight_bytes(m: &ModelSize, dtype_bytes: Option<u64>) -> u64 {
    match dtype_bytes {
        Some(b) if m.stored_bytes >= 2 * m.parameters => m.parameters * b,
        _ => m.stored_bytes,
    }
}

/// Bytes per parameter as stored, 2 or 4 (what a KV element takes when nothing says).
fn stored_width(m: &ModelSize) -> u64 {
    if m.stored_bytes >= 4 * m.parameters {
        4
    } else {
        2
    }
}

/// Bytes per element of a vLLM `--dtype` / `--kv-cache-dtype` value; None for `auto`.
pub(super) fn dtype_width(name: &str) -> Option<u64> {
    match name {
        "float32" | "float" => Some(4),
        "bfloat16" | "float16" | "half" => Some(2),
        n if n.starts_with("fp8") => Some(1),
        _ => None,
    }
}

/// Bytes as GiB with two decimals ("35.82 GiB"), under 1 GiB as whole MiB ("942 MiB").
pub(super) fn gib(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(params: u64, stored: u64) -> ModelSize {
        ModelSize {
            parameters: params,
            stored_bytes: stored,
            source: "safetensors headers of 1 file".into(),
            kv_elements_per_token: Some(2 * 24 * 2 * 64),
            max_position_embeddings: Some(32768),
            kv_heads: Some(2),
        }
    }

    fn h100(free_mib: u64) -> Gpu {
        let mut g = Gpu::declared(0);
        g.memory_total_mib = Some(81559);
        g.memory_used_mib = Some(81559 - free_mib);
        g
    }

    fn ask<'a>(gpus: &'a [&'a Gpu], m: &'a ModelSize, v: &'a Version) -> Ask<'a> {
        Ask {
            name: "prefill-0",
            neighbours: &[],
            gpus,
            share: 0.45,
            version: v,
            model: Ok(m),
            dtype_bytes: Some(2),
            kv_dtype_bytes: None,
            max_model_len: Some(4096),
        }
    }

    #[test]
    fn the_share_less_weights_and_reserve_is_the_kv_cache() {
        let g = h100(81000);
        let v = Version::new(0, 26, 0);
        // A 0.5B model stored in bf16: ~0.92 GiB.
        let m = model(494_000_000, 988_000_000);
        let Sized::Fixed { bytes, why } = size(&ask(&[&g], &m, &v)).unwrap() else {
            panic!("not fixed")
        };
        let budget = (81000u64 << 20) as f64 * 0.45;
        let want = (budget as u64 - 988_000_000 - RESERVE_BYTES) / ALIGN * ALIGN;
        assert_eq!(bytes, want);
        assert!(why.starts_with("KV cache 32.62 GiB: 0.45 of GPU 0's 79.10 GiB free is 35.60 GiB, less the weights 942 MiB"), "{why}");
        // Stored in float32 but served in bf16: the weights count at 2 bytes each.
        let f32_model = model(494_000_000, 4 * 494_000_000);
        let bytes_of = |m: &ModelSize| match size(&ask(&[&g], m, &v)).unwrap() {
            Sized::Fixed { bytes, .. } => bytes,
            other => panic!("{other:?}"),
        };
        assert_eq!(bytes_of(&f32_model), bytes_of(&m));
    }

    #[test]
    fn an_old_vllm_an_unknown_gpu_or_model_is_profiled_and_says_why() {
        let m = model(1, 2);
        let g = h100(80000);
        let old = Version::new(0, 10, 1);
        let Sized::Profiled { why } = size(&ask(&[&g], &m, &old)).unwrap() else {
            panic!()
        };
        assert_eq!(
            why,
            "vLLM 0.10.1 has no --kv-cache-memory-bytes (0.10.2 and later have it)"
        );
        let v = Version::new(0, 26, 0);
        let declared = Gpu::declared(3);
        let Sized::Profiled { why } = size(&ask(&[&declared], &m, &v)).unwrap() else {
            panic!()
        };
        assert!(why.contains("--gpus 3:80GiB"), "{why}");
        let gs = [&g];
        let mut unknown = ask(&gs, &m, &v);
        unknown.model = Err("Qwen/X is not a local directory");
        let Sized::Profiled { why } = size(&unknown).unwrap() else {
            panic!()
        };
        assert!(why.contains("Qwen/X is not a local directory"), "{why}");
    }

    #[test]
    fn a_share_without_room_for_the_kv_cache_is_refused_with_the_numbers() {
        let g = h100(20000);
        let v = Version::new(0, 26, 0);
        // 8B parameters in bf16: 16 GB of weights against 0.45 x 19.5 GiB.
        let m = model(8_000_000_000, 16_000_000_000);
        let gs = [&g];
        let mut a = ask(&gs, &m, &v);
        let neighbours = ["decode-0".to_string()];
        a.neighbours = &neighbours;
        let e = size(&a).unwrap_err();
        assert_eq!(e.key, "engine.instances_per_gpu");
        assert!(e.message.starts_with("prefill-0 (shared with decode-0): 0.45 of GPU 0's 19.53 GiB free is 8.79 GiB, less the weights 14.90 GiB"), "{}", e.message);
        assert!(
            e.message.contains(
                "leaves 0 MiB for the KV cache, and one 4096-token sequence needs 48 MiB"
            ),
            "{}",
            e.message
        );
    }
}
