//! Small Colibri containers written into temp dirs for the resident-weights
//! tests and bench: a `glm_moe_dsa` config whose dimensions set the logical
//! shapes, and tensors in any quantized format with random bytes and scales.
//!
//! Self-contained (no other test module), so the bench can include it with
//! `#[path]`.
#![allow(dead_code)]

use std::path::Path;

use glm_stream::convert::writer::{TensorSpec, write_shard};
use glm_stream::quant::QuantFormat;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use serde_json::json;

/// Config dimensions that decide the logical shapes (§3 table):
/// embedding/lm_head `[vocab, hidden]`, dense `gate_proj` `[inter, hidden]`,
/// `down_proj` `[hidden, inter]`, routed experts `[moe_inter, hidden]`, router
/// `[experts, hidden]`, MTP `eh_proj` `[hidden, 2·hidden]`. Layers 0 (dense) and
/// 1 (MoE) are decoder layers; layer 2 is the MTP layer.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub inter: usize,
    pub vocab: usize,
    pub moe_inter: usize,
    pub experts: usize,
}

impl Default for Dims {
    fn default() -> Self {
        Self {
            hidden: 128,
            inter: 96,
            vocab: 64,
            moe_inter: 64,
            experts: 4,
        }
    }
}

pub const MTP_LAYER: usize = 2;

pub fn config(d: &Dims) -> serde_json::Value {
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.inter,
        "moe_intermediate_size": d.moe_inter, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": d.experts,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 8,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
        "attention_bias": false, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
        "num_nextn_predict_layers": 1, "eos_token_id": [1], "tie_word_embeddings": false
    })
}

/// What was written for one quantized weight (for host references).
#[derive(Debug, Clone)]
pub struct QuantData {
    pub format: QuantFormat,
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// A float tensor's values (as f32) and shape.
#[derive(Debug, Clone)]
pub struct FloatData {
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
}

/// Tensors of one shard, with their host copies.
pub struct ShardBuilder {
    rng: ChaCha8Rng,
    tensors: Vec<(TensorSpec, Vec<u8>)>,
}

impl ShardBuilder {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            tensors: Vec::new(),
        }
    }

    /// A quantized weight with random bytes and scales in `[0.5, 1.5)·scale`.
    pub fn quant(&mut self, name: &str, format: QuantFormat, scale: f32) -> QuantData {
        let mut bytes = vec![0u8; format.weight_bytes()];
        self.rng.fill(&mut bytes[..]);
        let scales: Vec<f32> = (0..format.scale_count())
            .map(|_| self.rng.random_range(0.5f32..1.5) * scale)
            .collect();
        self.tensors.push((
            TensorSpec::new(name, Dtype::U8, vec![bytes.len()]),
            bytes.clone(),
        ));
        self.tensors.push((
            TensorSpec::new(format!("{name}.qs"), Dtype::F32, vec![scales.len()]),
            scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        QuantData {
            format,
            bytes,
            scales,
        }
    }

    /// A float tensor (F32, BF16 or F16) with values in `[-1, 1)` (rounded to
    /// the dtype; the returned values are the stored ones).
    pub fn float(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> FloatData {
        let n: usize = shape.iter().product();
        let raw: Vec<f32> = (0..n).map(|_| self.rng.random_range(-1f32..1.0)).collect();
        let (values, bytes): (Vec<f32>, Vec<u8>) = match dtype {
            Dtype::BF16 => {
                let h: Vec<half::bf16> = raw.iter().map(|&v| half::bf16::from_f32(v)).collect();
                (
                    h.iter().map(|v| v.to_f32()).collect(),
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            }
            Dtype::F16 => {
                let h: Vec<half::f16> = raw.iter().map(|&v| half::f16::from_f32(v)).collect();
                (
                    h.iter().map(|v| v.to_f32()).collect(),
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            }
            _ => (
                raw.clone(),
                raw.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        };
        self.tensors
            .push((TensorSpec::new(name, dtype, shape.to_vec()), bytes));
        FloatData {
            values,
            shape: shape.to_vec(),
        }
    }

    pub fn write(self, path: &Path) {
        write_shard(path, self.tensors).expect("write shard");
    }
}

/// Writes `config.json` for `dims` into `dir`.
pub fn write_config(dir: &Path, dims: &Dims) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config(dims)).expect("config json"),
    )
    .expect("write config");
}

/// `x · Wᵀ` in f64 for row-major `x [t, i]` and `w [o, i]`.
pub fn matmul_t_f64(x: &[f32], w: &[f32], t: usize, o: usize, i: usize) -> Vec<f64> {
    let mut out = vec![0f64; t * o];
    for r in 0..t {
        for c in 0..o {
            out[r * o + c] = (0..i)
                .map(|k| x[r * i + k] as f64 * w[c * i + k] as f64)
                .sum();
        }
    }
    out
}

/// Per-row scale of column `k` of row `row`.
pub fn scale_at(q: &QuantData, row: usize, k: usize) -> f32 {
    let groups = q.format.groups_per_row();
    let span = q.format.scale_span();
    q.scales[row * groups + k / span]
}
