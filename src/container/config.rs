//! `config.json` / `generation_config.json` of a `glm_moe_dsa` model.
//!
//! The Colibri container stores quantized weights as flat byte blobs, so the
//! logical `[O, I]` of every matrix — and therefore its format (§3.3) — comes from
//! this config. The field set is what mlx-lm 0.32.2's `glm_moe_dsa` /
//! `deepseek_v32` `ModelArgs` read, plus GLM-5.2's IndexShare and MTP fields.
//! `quantization_config` describes the FP8 source checkpoint, not the container,
//! and is ignored along with every other unknown field.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::error::{ContainerError, Result};

/// Fields that must be present (and not null) in `config.json`: those mlx-lm's
/// `glm_moe_dsa` `ModelArgs` declares without a default.
pub const REQUIRED_FIELDS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "index_head_dim",
    "index_n_heads",
    "index_topk",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "topk_method",
    "scoring_func",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "moe_layer_freq",
    "first_k_dense_replace",
    "max_position_embeddings",
    "rms_norm_eps",
    "attention_bias",
];

/// `eos_token_id`: a single id or a list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_parameters` (or legacy `rope_scaling`). GLM-5.x uses plain RoPE, so only
/// the theta matters; scaling keys are kept for completeness.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RopeParameters {
    /// Base frequency.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// `default`, `yarn`, ...
    #[serde(default)]
    pub rope_type: Option<String>,
    /// Scaling factor (YaRN and friends).
    #[serde(default)]
    pub factor: Option<f64>,
    /// DeepSeek YaRN `mscale_all_dim`.
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    /// Any other keys.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// The model configuration of a `glm_moe_dsa` checkpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Glm52Config {
    /// `glm_moe_dsa`.
    pub model_type: String,
    /// Vocabulary rows of the embedding and head.
    pub vocab_size: usize,
    /// Model width `D`.
    pub hidden_size: usize,
    /// Dense MLP width (layers below `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Routed / shared expert width.
    pub moe_intermediate_size: usize,
    /// Decoder layers, excluding MTP layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Nominal only for MLA.
    pub num_key_value_heads: usize,
    /// Shared experts per MoE layer (null = none).
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    /// Routed experts per MoE layer (null = dense model).
    #[serde(default)]
    pub n_routed_experts: Option<usize>,
    /// Routed-expert output multiplier.
    pub routed_scaling_factor: f64,
    /// MLA latent width.
    pub kv_lora_rank: usize,
    /// MLA query low-rank width.
    pub q_lora_rank: usize,
    /// RoPE part of each q/k head.
    pub qk_rope_head_dim: usize,
    /// Non-RoPE part of each q/k head.
    pub qk_nope_head_dim: usize,
    /// Value head width.
    pub v_head_dim: usize,
    /// `noaux_tc`.
    pub topk_method: String,
    /// `sigmoid`.
    pub scoring_func: String,
    /// Renormalise the top-k weights.
    pub norm_topk_prob: bool,
    /// Expert groups (1 for GLM).
    pub n_group: usize,
    /// Groups kept (1 for GLM).
    pub topk_group: usize,
    /// Routed experts per token.
    pub num_experts_per_tok: usize,
    /// Every `moe_layer_freq`-th layer at or above `first_k_dense_replace` is MoE.
    pub moe_layer_freq: usize,
    /// Layers below this use the dense MLP.
    pub first_k_dense_replace: usize,
    /// Context length.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Bias on the attention projections.
    pub attention_bias: bool,
    /// RoPE parameters (`rope_theta` lives here for GLM-5.x).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy RoPE scaling block.
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// Legacy top-level theta.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// DSA indexer heads.
    pub index_n_heads: usize,
    /// DSA indexer head width.
    pub index_head_dim: usize,
    /// Positions kept by the indexer.
    pub index_topk: usize,
    /// Interleaved RoPE in the indexer (mlx-lm default for GLM: true).
    #[serde(default = "default_true")]
    pub indexer_rope_interleave: bool,
    /// GLM-5.2 IndexShare: `"full"` or `"shared"` per layer.
    #[serde(default)]
    pub indexer_types: Option<Vec<String>>,
    /// IndexShare fallback schedule: period.
    #[serde(default)]
    pub index_topk_freq: Option<usize>,
    /// IndexShare fallback schedule: offset.
    #[serde(default)]
    pub index_skip_topk_offset: Option<usize>,
    /// IndexShare explicit pattern (`F`/`S` per layer).
    #[serde(default)]
    pub index_topk_pattern: Option<String>,
    /// The MTP pass reuses the main model's top-k instead of its own indexer.
    #[serde(default)]
    pub index_share_for_mtp_iteration: Option<bool>,
    /// MTP layers after the decoder stack (1 for GLM-5.x).
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    /// Stop ids.
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Beginning-of-sequence id.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// Padding id.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Tied embedding / head (false for GLM).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Activation (silu).
    #[serde(default)]
    pub hidden_act: Option<String>,
}

fn default_true() -> bool {
    true
}

/// `generation_config.json`: only the stop ids matter to the reader.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    /// Extra stop ids.
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Beginning-of-sequence id.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// Padding id.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

impl GenerationConfig {
    /// Loads `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        serde_json::from_str(&text).map_err(|source| ContainerError::InvalidJson {
            path: path.to_owned(),
            source,
        })
    }
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ContainerError::MissingFile {
                path: path.to_owned(),
            }
        } else {
            ContainerError::Io {
                path: path.to_owned(),
                source,
            }
        }
    })
}

/// Projection of a routed or shared expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertProj {
    /// `gate_proj`, `[moe_inter, D]`.
    Gate,
    /// `up_proj`, `[moe_inter, D]`.
    Up,
    /// `down_proj`, `[D, moe_inter]`.
    Down,
}

impl ExpertProj {
    /// All three, in the engine's order gate, up, down.
    pub const ALL: [ExpertProj; 3] = [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down];

    /// `gate_proj` / `up_proj` / `down_proj`.
    pub fn module_name(self) -> &'static str {
        match self {
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    fn from_module(s: &str) -> Option<Self> {
        match s {
            "gate_proj" => Some(Self::Gate),
            "up_proj" => Some(Self::Up),
            "down_proj" => Some(Self::Down),
            _ => None,
        }
    }
}

/// Splits `model.layers.<L>.<rest>` into `(L, rest)`.
pub fn split_layer(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((layer.parse().ok()?, rest))
}

/// `(layer, expert, projection)` of a routed-expert weight
/// `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, in any layer
/// including the MTP layer.
pub fn routed_expert_coords(name: &str) -> Option<(usize, usize, ExpertProj)> {
    let (layer, rest) = split_layer(name)?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    let (expert, rest) = rest.split_once('.')?;
    if expert.is_empty() || !expert.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let proj = ExpertProj::from_module(rest.strip_suffix(".weight")?)?;
    Some((layer, expert.parse().ok()?, proj))
}

impl Glm52Config {
    /// Loads and checks `config.json`: every field of [`REQUIRED_FIELDS`] must be
    /// present and non-null, and a RoPE theta must be available.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        Self::from_json_str(path, &text)
    }

    /// Parses config text; `path` is only used in errors.
    pub fn from_json_str(path: &Path, text: &str) -> Result<Self> {
        let invalid_json = |source| ContainerError::InvalidJson {
            path: path.to_owned(),
            source,
        };
        let value: serde_json::Value = serde_json::from_str(text).map_err(invalid_json)?;
        let Some(object) = value.as_object() else {
            return Err(ContainerError::InvalidConfig {
                path: path.to_owned(),
                reason: "top level is not a JSON object".into(),
            });
        };
        for field in REQUIRED_FIELDS {
            if object.get(*field).is_none_or(serde_json::Value::is_null) {
                return Err(ContainerError::MissingConfigField {
                    path: path.to_owned(),
                    field: (*field).to_owned(),
                });
            }
        }
        let config: Self = serde_json::from_value(value).map_err(invalid_json)?;
        if config.rope_theta().is_none() {
            return Err(ContainerError::MissingConfigField {
                path: path.to_owned(),
                field: "rope_parameters.rope_theta".into(),
            });
        }
        if config.hidden_size == 0 || config.num_attention_heads == 0 || config.vocab_size == 0 {
            return Err(ContainerError::InvalidConfig {
                path: path.to_owned(),
                reason: "hidden_size, num_attention_heads and vocab_size must be positive".into(),
            });
        }
        Ok(config)
    }

    /// RoPE base: `rope_parameters.rope_theta`, else `rope_scaling.rope_theta`,
    /// else the legacy top-level `rope_theta`.
    pub fn rope_theta(&self) -> Option<f64> {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or_else(|| self.rope_scaling.as_ref().and_then(|r| r.rope_theta))
            .or(self.rope_theta)
    }

    /// Stop ids from `config.json`.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// q/k head width: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// True when layer `l` uses the MoE block (mlx-lm's rule: routed experts
    /// configured, `l >= first_k_dense_replace` and `l % moe_layer_freq == 0`).
    /// MTP layers (`l >= num_hidden_layers`) follow the same rule.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts.is_some_and(|n| n > 0)
            && layer >= self.first_k_dense_replace
            && layer % self.moe_layer_freq.max(1) == 0
    }

    /// Index of the (first) MTP layer, `num_hidden_layers`, when the model has one.
    pub fn mtp_layer_index(&self) -> Option<usize> {
        (self.num_nextn_predict_layers > 0).then_some(self.num_hidden_layers)
    }

    /// True when `layer` is an MTP layer (at or above `num_hidden_layers`).
    pub fn is_mtp_layer(&self, layer: usize) -> bool {
        layer >= self.num_hidden_layers
    }

    /// True when decoder layer `layer` carries its own DSA indexer weights.
    ///
    /// GLM-5.2 IndexShare: `indexer_types[l] == "full"`; else the `index_topk_pattern`
    /// (`S` = shared); else the schedule vLLM uses,
    /// `max(l − offset + 1, 0) % freq == 0` (freq defaults to 1: every layer,
    /// which is GLM-5/5.1). For GLM-5.2 (freq 4, offset 3) that is layers
    /// 0, 1, 2, 6, 10, …, 74. MTP layers have an indexer unless
    /// `index_share_for_mtp_iteration` is set (Colibri containers never carry one).
    pub fn layer_has_indexer(&self, layer: usize) -> bool {
        if self.is_mtp_layer(layer) {
            return !self.index_share_for_mtp_iteration.unwrap_or(false);
        }
        if let Some(kind) = self.indexer_types.as_ref().and_then(|t| t.get(layer)) {
            return kind == "full";
        }
        if let Some(c) = self
            .index_topk_pattern
            .as_ref()
            .and_then(|p| p.chars().nth(layer))
        {
            return c != 'S';
        }
        let freq = self.index_topk_freq.unwrap_or(1).max(1);
        let offset = self.index_skip_topk_offset.unwrap_or(0);
        (layer + 1).saturating_sub(offset) % freq == 0
    }

    /// Logical `[O, I]` (`[out_features, in_features]`) of a 2-D weight, from its
    /// name (§3 table). `None` for names that are not known matrices (norms,
    /// biases, unknown tensors) or when the arithmetic would overflow.
    pub fn logical_shape(&self, name: &str) -> Option<[usize; 2]> {
        let d = self.hidden_size;
        match name {
            "model.embed_tokens.weight" | "lm_head.weight" => return Some([self.vocab_size, d]),
            _ => {}
        }
        let (_, rest) = split_layer(name)?;
        let rest = rest.strip_suffix(".weight")?;
        let heads = self.num_attention_heads;
        let mul = usize::checked_mul;
        let moe = self.moe_intermediate_size;
        let shared = mul(moe, self.n_shared_experts.unwrap_or(1).max(1))?;
        let shape = match rest {
            "self_attn.q_a_proj" => [self.q_lora_rank, d],
            "self_attn.q_b_proj" => [mul(heads, self.qk_head_dim())?, self.q_lora_rank],
            "self_attn.kv_a_proj_with_mqa" => {
                [self.kv_lora_rank.checked_add(self.qk_rope_head_dim)?, d]
            }
            "self_attn.kv_b_proj" => [
                mul(heads, self.qk_nope_head_dim.checked_add(self.v_head_dim)?)?,
                self.kv_lora_rank,
            ],
            "self_attn.o_proj" => [d, mul(heads, self.v_head_dim)?],
            "self_attn.indexer.wq_b" => [
                mul(self.index_n_heads, self.index_head_dim)?,
                self.q_lora_rank,
            ],
            "self_attn.indexer.wk" => [self.index_head_dim, d],
            "self_attn.indexer.weights_proj" => [self.index_n_heads, d],
            "mlp.gate_proj" | "mlp.up_proj" => [self.intermediate_size, d],
            "mlp.down_proj" => [d, self.intermediate_size],
            "mlp.gate" => [self.n_routed_experts?, d],
            "mlp.shared_experts.gate_proj" | "mlp.shared_experts.up_proj" => [shared, d],
            "mlp.shared_experts.down_proj" => [d, shared],
            "eh_proj" => [d, mul(d, 2)?],
            _ => {
                let (_, _, proj) = routed_expert_coords(name)?;
                match proj {
                    ExpertProj::Gate | ExpertProj::Up => [moe, d],
                    ExpertProj::Down => [d, moe],
                }
            }
        };
        // Every matrix must also have a representable element count.
        mul(shape[0], shape[1])?;
        Some(shape)
    }
}
