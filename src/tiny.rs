//! A generator of tiny random `glm_moe_dsa` checkpoints in the Hugging Face layout,
//! for tests: every tensor mlx-lm's `glm_moe_dsa` model loads, plus the MTP (nextn)
//! layer with `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, its own attention,
//! indexer and MoE; `config.json`, a byte-level BPE `tokenizer.json`,
//! `tokenizer_config.json` (GLM-style chat template) and `generation_config.json`.
//!
//! Values are deterministic per seed (ChaCha8): linear weights `N(0,1)/sqrt(fan_in)`,
//! norm weights `1 + 0.1·N(0,1)`, biases `0.02·N(0,1)`. The main layers are split over
//! two shards and the MTP layer gets its own third shard.

use std::fs;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use serde_json::{Value, json};
use thiserror::Error;

use crate::convert::fp8::{e4m3_to_f32, f32_to_e4m3};
use crate::convert::writer::{TensorSpec, WriteError, write_shard};

/// Dimensions of a tiny model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Model width.
    pub hidden_size: usize,
    /// Main decoder layers (the MTP layers follow them).
    pub num_hidden_layers: usize,
    /// Layers `< first_k_dense_replace` use a dense MLP.
    pub first_k_dense_replace: usize,
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Shared experts per MoE layer.
    pub n_shared_experts: usize,
    /// Routed/shared expert width.
    pub moe_intermediate_size: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// MLA q low rank.
    pub q_lora_rank: usize,
    /// MLA kv low rank.
    pub kv_lora_rank: usize,
    /// Non-rotary q/k head dim.
    pub qk_nope_head_dim: usize,
    /// Rotary q/k head dim.
    pub qk_rope_head_dim: usize,
    /// Value head dim.
    pub v_head_dim: usize,
    /// DSA indexer heads.
    pub index_n_heads: usize,
    /// DSA indexer head dim.
    pub index_head_dim: usize,
    /// DSA indexer top-k (small, so short prompts exercise the sparse path).
    pub index_topk: usize,
    /// Vocabulary size (≥ the tokenizer's tokens).
    pub vocab_size: usize,
    /// MTP layers (1 for GLM-5.x).
    pub num_nextn_predict_layers: usize,
    /// Maximum context.
    pub max_position_embeddings: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Routed-weight multiplier.
    pub routed_scaling_factor: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Overwrite the first rows of every 2-D linear weight with quantizer edge cases
    /// (an int4 tie row, a zero row, a sub-floor row, an int8 tie row) for codec tests.
    pub edge_rows: bool,
}

impl Default for TinyModelSpec {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            num_hidden_layers: 4,
            first_k_dense_replace: 1,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_shared_experts: 1,
            moe_intermediate_size: 32,
            // > 128 so FP8 weights span two row/column blocks and get trimmed.
            intermediate_size: 160,
            num_attention_heads: 4,
            q_lora_rank: 32,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            index_n_heads: 8,
            index_head_dim: 16,
            index_topk: 8,
            vocab_size: 320,
            num_nextn_predict_layers: 1,
            max_position_embeddings: 2048,
            rope_theta: 1_000_000.0,
            routed_scaling_factor: 2.5,
            rms_norm_eps: 1e-5,
            edge_rows: false,
        }
    }
}

/// Storage dtype of a generated checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceDtype {
    /// Everything BF16 except the router bias (F32), like the BF16 releases.
    Bf16,
    /// Everything F32.
    F32,
    /// Everything F16 except the router bias (F32).
    F16,
    /// 2-D linear weights (not embed, lm_head, router) as FP8 e4m3 with F32
    /// `weight_scale_inv` per 128×128 block; norms BF16, router bias F32.
    Fp8,
}

/// Errors of the generator.
#[derive(Debug, Error)]
pub enum TinyError {
    /// The spec is inconsistent.
    #[error("invalid tiny model spec: {0}")]
    InvalidSpec(String),
    /// An I/O error on `path`.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Writing a shard failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// What [`generate_hf_checkpoint`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyCheckpoint {
    /// Shard paths in order.
    pub shards: Vec<PathBuf>,
    /// Number of logical tensors (excluding `weight_scale_inv`).
    pub tensors: usize,
}

/// Kind of a generated tensor (decides its init and storage dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A linear weight `[out, in]`.
    Linear,
    /// Embedding or LM head.
    Io,
    /// MoE router weight.
    Router,
    /// Router correction bias.
    RouterBias,
    /// Norm weight.
    Norm,
    /// Norm bias.
    NormBias,
}

struct Entry {
    name: String,
    shape: Vec<usize>,
    kind: Kind,
}

impl TinyModelSpec {
    fn validate(&self) -> Result<(), TinyError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("index_n_heads", self.index_n_heads),
            ("index_head_dim", self.index_head_dim),
            ("index_topk", self.index_topk),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TinyError::InvalidSpec(format!("{name} must be positive")));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(TinyError::InvalidSpec(
                "num_experts_per_tok exceeds n_routed_experts".into(),
            ));
        }
        if self.qk_rope_head_dim > self.index_head_dim || self.qk_rope_head_dim % 2 != 0 {
            return Err(TinyError::InvalidSpec(
                "qk_rope_head_dim must be even and at most index_head_dim".into(),
            ));
        }
        if self.vocab_size < tokenizer_vocab_len() {
            return Err(TinyError::InvalidSpec(format!(
                "vocab_size must be at least {} (the tokenizer's size)",
                tokenizer_vocab_len()
            )));
        }
        Ok(())
    }

    fn is_moe(&self, layer: usize) -> bool {
        self.n_routed_experts > 0 && layer >= self.first_k_dense_replace
    }

    /// Tensors of decoder layer `l` (including the MTP extras when `l` is an MTP layer).
    fn layer_entries(&self, l: usize, out: &mut Vec<Entry>) {
        let h = self.hidden_size;
        let p = format!("model.layers.{l}.");
        let mut push = |name: &str, shape: Vec<usize>, kind: Kind| {
            out.push(Entry {
                name: format!("{p}{name}"),
                shape,
                kind,
            })
        };
        let heads = self.num_attention_heads;
        let qk = self.qk_nope_head_dim + self.qk_rope_head_dim;
        push("input_layernorm.weight", vec![h], Kind::Norm);
        push("post_attention_layernorm.weight", vec![h], Kind::Norm);
        push(
            "self_attn.q_a_proj.weight",
            vec![self.q_lora_rank, h],
            Kind::Linear,
        );
        push(
            "self_attn.q_a_layernorm.weight",
            vec![self.q_lora_rank],
            Kind::Norm,
        );
        push(
            "self_attn.q_b_proj.weight",
            vec![heads * qk, self.q_lora_rank],
            Kind::Linear,
        );
        push(
            "self_attn.kv_a_proj_with_mqa.weight",
            vec![self.kv_lora_rank + self.qk_rope_head_dim, h],
            Kind::Linear,
        );
        push(
            "self_attn.kv_a_layernorm.weight",
            vec![self.kv_lora_rank],
            Kind::Norm,
        );
        push(
            "self_attn.kv_b_proj.weight",
            vec![
                heads * (self.qk_nope_head_dim + self.v_head_dim),
                self.kv_lora_rank,
            ],
            Kind::Linear,
        );
        push(
            "self_attn.o_proj.weight",
            vec![h, heads * self.v_head_dim],
            Kind::Linear,
        );
        let (ih, id) = (self.index_n_heads, self.index_head_dim);
        push(
            "self_attn.indexer.wq_b.weight",
            vec![ih * id, self.q_lora_rank],
            Kind::Linear,
        );
        push("self_attn.indexer.wk.weight", vec![id, h], Kind::Linear);
        push(
            "self_attn.indexer.weights_proj.weight",
            vec![ih, h],
            Kind::Linear,
        );
        push("self_attn.indexer.k_norm.weight", vec![id], Kind::Norm);
        push("self_attn.indexer.k_norm.bias", vec![id], Kind::NormBias);
        if self.is_moe(l) {
            let (e, m) = (self.n_routed_experts, self.moe_intermediate_size);
            push("mlp.gate.weight", vec![e, h], Kind::Router);
            push(
                "mlp.gate.e_score_correction_bias",
                vec![e],
                Kind::RouterBias,
            );
            for x in 0..e {
                push(
                    &format!("mlp.experts.{x}.gate_proj.weight"),
                    vec![m, h],
                    Kind::Linear,
                );
                push(
                    &format!("mlp.experts.{x}.up_proj.weight"),
                    vec![m, h],
                    Kind::Linear,
                );
                push(
                    &format!("mlp.experts.{x}.down_proj.weight"),
                    vec![h, m],
                    Kind::Linear,
                );
            }
            if self.n_shared_experts > 0 {
                let s = m * self.n_shared_experts;
                push(
                    "mlp.shared_experts.gate_proj.weight",
                    vec![s, h],
                    Kind::Linear,
                );
                push(
                    "mlp.shared_experts.up_proj.weight",
                    vec![s, h],
                    Kind::Linear,
                );
                push(
                    "mlp.shared_experts.down_proj.weight",
                    vec![h, s],
                    Kind::Linear,
                );
            }
        } else {
            let i = self.intermediate_size;
            push("mlp.gate_proj.weight", vec![i, h], Kind::Linear);
            push("mlp.up_proj.weight", vec![i, h], Kind::Linear);
            push("mlp.down_proj.weight", vec![h, i], Kind::Linear);
        }
        if l >= self.num_hidden_layers {
            push("enorm.weight", vec![h], Kind::Norm);
            push("hnorm.weight", vec![h], Kind::Norm);
            push("eh_proj.weight", vec![h, 2 * h], Kind::Linear);
            push("shared_head.norm.weight", vec![h], Kind::Norm);
        }
    }

    /// Tensors per shard: `[embed + first half of layers, rest + norm + lm_head, MTP]`.
    fn shard_entries(&self) -> Vec<Vec<Entry>> {
        let h = self.hidden_size;
        let n = self.num_hidden_layers;
        let split = n.div_ceil(2);
        let mut first = vec![Entry {
            name: "model.embed_tokens.weight".into(),
            shape: vec![self.vocab_size, h],
            kind: Kind::Io,
        }];
        (0..split).for_each(|l| self.layer_entries(l, &mut first));
        let mut second = Vec::new();
        (split..n).for_each(|l| self.layer_entries(l, &mut second));
        second.push(Entry {
            name: "model.norm.weight".into(),
            shape: vec![h],
            kind: Kind::Norm,
        });
        second.push(Entry {
            name: "lm_head.weight".into(),
            shape: vec![self.vocab_size, h],
            kind: Kind::Io,
        });
        let mut shards = vec![first, second];
        if self.num_nextn_predict_layers > 0 {
            let mut mtp = Vec::new();
            (n..n + self.num_nextn_predict_layers).for_each(|l| self.layer_entries(l, &mut mtp));
            shards.push(mtp);
        }
        shards
    }

    /// The `config.json` of this model (`glm_moe_dsa`, no `quantization_config`).
    pub fn config_json(&self, dtype: SourceDtype) -> Value {
        let ids = special_ids();
        let mut config = json!({
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": true,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
        });
        let attention = json!({
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_head_dim": self.qk_nope_head_dim + self.qk_rope_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": false,
            "initializer_range": 0.02,
            "use_cache": true,
            "dtype": match dtype {
                SourceDtype::F32 => "float32",
                SourceDtype::F16 => "float16",
                _ => "bfloat16",
            },
            "eos_token_id": [ids.endoftext, ids.user, ids.observation],
            "pad_token_id": ids.endoftext,
        });
        if let (Some(c), Value::Object(a)) = (config.as_object_mut(), attention) {
            c.extend(a);
        }
        config
    }
}

/// Box–Muller standard normal from two uniforms.
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn init_values(e: &Entry, rng: &mut ChaCha8Rng, edge_rows: bool) -> Vec<f32> {
    let numel: usize = e.shape.iter().product();
    let fan_in = *e.shape.last().unwrap_or(&1) as f32;
    let mut v: Vec<f32> = match e.kind {
        Kind::Linear | Kind::Router | Kind::Io => {
            let k = 1.0 / fan_in.sqrt();
            (0..numel).map(|_| normal(rng) * k).collect()
        }
        Kind::Norm => (0..numel).map(|_| 1.0 + 0.1 * normal(rng)).collect(),
        Kind::NormBias | Kind::RouterBias => (0..numel).map(|_| 0.02 * normal(rng)).collect(),
    };
    if edge_rows && matches!(e.kind, Kind::Linear | Kind::Io) && e.shape.len() == 2 {
        write_edge_rows(&mut v, e.shape[0], e.shape[1]);
    }
    v
}

/// Quantizer edge cases (colibri-format §8b): row 0 = int4 ties at scale 1, row 1 =
/// zeros, row 2 = values below the scale floor, row 3 = int8 ties at scale 1.
fn write_edge_rows(v: &mut [f32], rows: usize, cols: usize) {
    let int4_ties = [
        0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, -3.5, 4.5, -4.5, 5.5, -5.5, 6.5, -6.5, 7.0, -7.0,
    ];
    let int8_ties = [127.0, 0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5];
    let mut set_row = |r: usize, f: &dyn Fn(usize) -> f32| {
        if r < rows {
            for c in 0..cols {
                v[r * cols + c] = f(c);
            }
        }
    };
    set_row(0, &|c| int4_ties.get(c).copied().unwrap_or(0.0));
    set_row(1, &|_| 0.0);
    set_row(2, &|c| ((c % 7) as f32 - 3.0) * 1e-8);
    set_row(3, &|c| int8_ties.get(c).copied().unwrap_or(0.0));
}

fn le_bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_bytes_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

fn le_bytes_f16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

/// FP8 e4m3 with 128×128 block scales: returns `(codes, scale_inv)` such that
/// `w ≈ e4m3(code) · scale_inv[block]`.
fn to_fp8_blocks(v: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    const B: usize = 128;
    let (br, bc) = (rows.div_ceil(B), cols.div_ceil(B));
    let mut scale_inv = vec![1.0f32; br * bc];
    for (bi, s) in scale_inv.iter_mut().enumerate() {
        let (r0, c0) = ((bi / bc) * B, (bi % bc) * B);
        let mut amax = 0.0f32;
        for r in r0..(r0 + B).min(rows) {
            for c in c0..(c0 + B).min(cols) {
                amax = amax.max(v[r * cols + c].abs());
            }
        }
        if amax > 0.0 {
            *s = amax / e4m3_to_f32(0x7E);
        }
    }
    let codes = (0..rows * cols)
        .map(|i| {
            let s = scale_inv[(i / cols / B) * bc + (i % cols) / B];
            f32_to_e4m3(v[i] / s)
        })
        .collect();
    (codes, scale_inv)
}

/// Generates a random HF-layout checkpoint for `spec` in `dir` (created if needed).
pub fn generate_hf_checkpoint(
    dir: &Path,
    spec: &TinyModelSpec,
    seed: u64,
    dtype: SourceDtype,
) -> Result<TinyCheckpoint, TinyError> {
    spec.validate()?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TinyError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let shards = spec.shard_entries();
    let n = shards.len();
    let mut paths = Vec::with_capacity(n);
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0usize;
    let mut count = 0usize;
    for (si, entries) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", si + 1);
        let mut tensors = Vec::with_capacity(entries.len());
        for e in entries {
            let values = init_values(e, &mut rng, spec.edge_rows);
            let fp8 = dtype == SourceDtype::Fp8 && e.kind == Kind::Linear;
            let stored = match (dtype, e.kind) {
                (_, Kind::RouterBias) | (SourceDtype::F32, _) => {
                    (Dtype::F32, le_bytes_f32(&values))
                }
                _ if fp8 => {
                    let (rows, cols) = (e.shape[0], e.shape[1]);
                    let (codes, scale_inv) = to_fp8_blocks(&values, rows, cols);
                    let sname = format!("{}_scale_inv", e.name);
                    weight_map.insert(sname.clone(), json!(file));
                    total_size += scale_inv.len() * 4;
                    tensors.push((
                        TensorSpec::new(
                            sname,
                            Dtype::F32,
                            vec![rows.div_ceil(128), cols.div_ceil(128)],
                        ),
                        le_bytes_f32(&scale_inv),
                    ));
                    (Dtype::F8_E4M3, codes)
                }
                (SourceDtype::F16, _) => (Dtype::F16, le_bytes_f16(&values)),
                _ => (Dtype::BF16, le_bytes_bf16(&values)),
            };
            weight_map.insert(e.name.clone(), json!(file));
            total_size += stored.1.len();
            count += 1;
            tensors.push((
                TensorSpec::new(e.name.clone(), stored.0, e.shape.clone()),
                stored.1,
            ));
        }
        let path = dir.join(&file);
        write_shard(&path, tensors)?;
        paths.push(path);
    }
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    write_json(&dir.join("config.json"), &spec.config_json(dtype))?;
    write_json(&dir.join("tokenizer.json"), &tokenizer_json())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config_json(spec.max_position_embeddings),
    )?;
    let ids = special_ids();
    write_json(
        &dir.join("generation_config.json"),
        &json!({
            "_from_model_config": true,
            "eos_token_id": [ids.endoftext, ids.user, ids.observation],
            "pad_token_id": ids.endoftext,
            "do_sample": true,
            "temperature": 1.0,
            "top_p": 0.95,
        }),
    )?;
    Ok(TinyCheckpoint {
        shards: paths,
        tensors: count,
    })
}

fn write_json(path: &Path, value: &Value) -> Result<(), TinyError> {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    fs::write(path, text + "\n").map_err(|source| TinyError::Io {
        path: path.to_path_buf(),
        source,
    })
}

// ---------------------------------------------------------------------------------
// Tokenizer: byte-level BPE over the 256 byte symbols, a few merges, GLM specials.

/// A few merges (pairs of byte-level symbols; `Ġ` is the space byte).
const MERGES: [(&str, &str); 14] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("r", "e"),
    ("o", "n"),
    ("Ġ", "a"),
    ("e", "n"),
    ("a", "t"),
    ("o", "r"),
    ("Ġ", "s"),
    ("Ġ", "w"),
    ("Ġt", "he"),
];

/// GLM-style special tokens, in id order after the BPE vocabulary.
const SPECIALS: [&str; 12] = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
];

struct SpecialIds {
    endoftext: usize,
    user: usize,
    observation: usize,
}

fn special_id(token: &str) -> usize {
    let base = 256 + MERGES.len();
    base + SPECIALS.iter().position(|s| *s == token).unwrap_or(0)
}

fn special_ids() -> SpecialIds {
    SpecialIds {
        endoftext: special_id("<|endoftext|>"),
        user: special_id("<|user|>"),
        observation: special_id("<|observation|>"),
    }
}

/// Number of token ids the tokenizer uses.
pub fn tokenizer_vocab_len() -> usize {
    256 + MERGES.len() + SPECIALS.len()
}

/// The byte-level alphabet: printable Latin-1 bytes map to themselves, the others to
/// consecutive code points from U+0100, in byte order (the GPT-2 convention that HF's
/// `ByteLevel` pre-tokenizer uses).
fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 0x100u32;
    (0u32..256)
        .map(|b| {
            let cp = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(cp).unwrap_or('?')
        })
        .collect()
}

fn tokenizer_json() -> Value {
    let mut vocab = serde_json::Map::new();
    for (id, ch) in byte_symbols().into_iter().enumerate() {
        vocab.insert(ch.to_string(), json!(id));
    }
    for (k, (a, b)) in MERGES.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + k));
    }
    let merges: Vec<String> = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let added: Vec<Value> = SPECIALS
        .iter()
        .map(|s| {
            json!({"id": special_id(s), "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    })
}

/// GLM-style chat template: `[gMASK]<sop>` then `<|role|>\ncontent` per message.
const CHAT_TEMPLATE: &str = "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

fn tokenizer_config_json(max_len: usize) -> Value {
    let decoder: serde_json::Map<String, Value> = SPECIALS
        .iter()
        .map(|s| {
            (
                special_id(s).to_string(),
                json!({"content": s, "lstrip": false, "normalized": false, "rstrip": false,
                       "single_word": false, "special": true}),
            )
        })
        .collect();
    json!({
        "added_tokens_decoder": decoder,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_len,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}
