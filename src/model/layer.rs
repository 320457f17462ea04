//! One decoder layer: `h = x + Attn(RMSNorm(x))`, `out = h + FFN(RMSNorm(h))`,
//! with a dense SwiGLU or an MoE block as the FFN.

use crate::container::Glm52Config;
use crate::executor::StreamedExecutor;
use crate::mlx::fast::rms_norm;
use crate::mlx::{Array, Dtype};
use crate::resident::Glm52WeightSource;

use super::attention::{MlaAttention, Sparsity, Step};
use super::cache::LayerCache;
use super::error::{MlxAt, WeightsAt};
use super::indexer::Selection;
use super::mlp::SwiGlu;
use super::moe::MoeBlock;
use super::{ModelError, Site};

/// The feed-forward half of a layer.
pub enum FeedForward {
    /// Dense SwiGLU (layers below `first_k_dense_replace`).
    Dense(SwiGlu),
    /// Routed experts plus the shared expert.
    Moe(MoeBlock),
}

/// One decoder layer.
pub struct DecoderLayer {
    index: usize,
    input_norm: Array,
    post_attention_norm: Array,
    eps: f32,
    attention: MlaAttention,
    ffn: FeedForward,
}

/// What a layer produced besides its output.
pub struct LayerOutcome {
    /// The layer's output `[1, L, hidden]`.
    pub hidden: Array,
    /// Its own indexer's selection (layers with [`Sparsity::Own`]).
    pub selection: Option<Selection>,
    /// The router's smallest cut gap (MoE layers).
    pub router_gap: Option<f32>,
    /// The routed expert ids, `top_k` per row (MoE layers, when
    /// [`Step::keep_routes`] is set).
    pub routed: Option<Vec<u32>>,
}

impl DecoderLayer {
    /// Loads layer `index` with the given selection source.
    pub fn load(
        w: &dyn Glm52WeightSource,
        config: &Glm52Config,
        index: usize,
        sparsity: Sparsity,
    ) -> Result<Self, ModelError> {
        let site = Site::Layer(index);
        let p = format!("model.layers.{index}");
        let norm = |name: String| -> Result<Array, ModelError> {
            let a = w.tensor(&name).at(site)?;
            if a.shape() != [config.hidden_size as i32] {
                return Err(ModelError::BadWeight {
                    site,
                    reason: format!("shape {:?}, expected [{}]", a.shape(), config.hidden_size),
                    name,
                });
            }
            a.astype(Dtype::Float32).at(site, "casting a norm")
        };
        let ffn = if config.is_moe_layer(index) {
            FeedForward::Moe(MoeBlock::load(w, config, index)?)
        } else {
            FeedForward::Dense(SwiGlu::new(
                site,
                &format!("{p}.mlp"),
                config.hidden_size,
                config.intermediate_size,
            ))
        };
        Ok(Self {
            index,
            input_norm: norm(format!("{p}.input_layernorm.weight"))?,
            post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
            eps: config.rms_norm_eps as f32,
            attention: MlaAttention::load(w, config, index, sparsity)?,
            ffn,
        })
    }

    /// The layer index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The attention block.
    pub fn attention(&self) -> &MlaAttention {
        &self.attention
    }

    /// Runs the layer on `x` (`[1, L, hidden]`) at positions `step.offset..`.
    pub fn forward(
        &self,
        w: &dyn Glm52WeightSource,
        executor: Option<&mut StreamedExecutor>,
        x: &Array,
        cache: &mut LayerCache,
        step: Step<'_>,
    ) -> Result<LayerOutcome, ModelError> {
        let site = Site::Layer(self.index);
        let normed = rms_norm(x, Some(&self.input_norm), self.eps).at(site, "input norm")?;
        let (attn, selection) = self.attention.forward(w, &normed, cache, step)?;
        let h = x.add(&attn).at(site, "attention residual")?;
        let normed = rms_norm(&h, Some(&self.post_attention_norm), self.eps)
            .at(site, "post-attention norm")?;
        let (ffn, router_gap, routed) = match &self.ffn {
            FeedForward::Dense(mlp) => (mlp.forward(w, &normed)?, None, None),
            FeedForward::Moe(moe) => {
                let executor = executor.ok_or_else(|| {
                    ModelError::UnsupportedConfig(format!("{site}: MoE layer without experts"))
                })?;
                let out = moe.forward(w, executor, &normed, step.keep_routes)?;
                (out.hidden, out.router_gap, out.routed)
            }
        };
        let hidden = h.add(&ffn).at(site, "MLP residual")?;
        Ok(LayerOutcome {
            hidden,
            selection,
            router_gap,
            routed,
        })
    }
}
