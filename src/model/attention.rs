//! MLA (multi-head latent attention) with DSA sparse selection.
//!
//! Per token: `qr = RMSNorm(q_a_proj(x))`, `q = q_b_proj(qr)` split per head
//! into `[qk_nope | qk_rope]`; `kv_a_proj_with_mqa(x)` gives the latent
//! (normalized by `kv_a_layernorm`) and one rotated key `k_pe` shared by all
//! heads. The cache keeps only latent and `k_pe`. `kv_b_proj` (per head
//! `qk_nope` key rows then `v_head_dim` value rows over the latent) is held as
//! two f32 per-head matrices:
//!
//! * a multi-token step (prefill) expands the cached latent into per-head
//!   keys and values and attends in the head space;
//! * a single-token step (decode) absorbs `kv_b_proj`: the query's nope part
//!   is mapped into the latent space by the key rows, attention runs over the
//!   latent directly, and the value rows map the result back out.
//!
//! The rotary part enters as an additive score `q_pe·k_pe·scale`, which also
//! carries the masks (causal, DSA selection) as `f32::MIN`, as in mlx-lm.
//! With a DSA selection a decode step gathers only the selected positions; a
//! prefill step masks the others.

use crate::container::Glm52Config;
use crate::mlx::fast::{AttentionMask, rms_norm, scaled_dot_product_attention};
use crate::mlx::{self, Array, Dtype, MlxError};
use crate::resident::Glm52WeightSource;

use super::cache::LayerCache;
use super::error::{MlxAt, WeightsAt};
use super::indexer::{Indexer, Selection, TopK};
use super::rope::{Rope, attention_scale, rope_for};
use super::{ModelError, Site};

/// `eps` of `q_a_layernorm` and `kv_a_layernorm` (mlx-lm and HF use 1e-6).
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// Where a layer's DSA selection comes from.
pub enum Sparsity {
    /// The layer runs its own indexer.
    Own(Indexer),
    /// GLM-5.2 IndexShare: the layer reuses the selection of the most recent
    /// layer with its own indexer.
    Shared,
    /// No indexer weights in the container: always dense attention.
    Dense,
}

/// The position context of one forward step, shared by every layer.
#[derive(Clone, Copy)]
pub struct Step<'a> {
    /// Position of the step's first token (the cache length before it).
    pub offset: usize,
    /// The `[L, S]` boolean causal mask of a multi-token step (`None` for one
    /// token).
    pub causal: Option<&'a Array>,
    /// The selection of the most recent layer with its own indexer (used by
    /// [`Sparsity::Shared`] layers).
    pub shared: Option<&'a TopK>,
    /// Compute the indexer's cut gap.
    pub track_gap: bool,
    /// Return the routed expert ids of MoE layers (for the routing trace).
    pub keep_routes: bool,
}

/// The attention of one decoder layer.
pub struct MlaAttention {
    site: Site,
    names: ProjectionNames,
    q_a_norm: Array,
    kv_a_norm: Array,
    /// `[H, qk_nope, kv_lora]`: the key rows of `kv_b_proj` per head.
    key_up: Array,
    /// `[H, v_head, kv_lora]`: the value rows of `kv_b_proj` per head.
    value_up: Array,
    sparsity: Sparsity,
    dims: Dims,
    scale: f32,
    rope: Rope,
}

struct ProjectionNames {
    q_a: String,
    q_b: String,
    kv_a: String,
    o: String,
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    hidden: usize,
    heads: usize,
    q_lora: usize,
    kv_lora: usize,
    nope: usize,
    rope: usize,
    v: usize,
}

impl MlaAttention {
    /// Loads layer `layer`'s attention: norms and `kv_b_proj` now (as f32),
    /// the other projections on first use.
    pub fn load(
        w: &dyn Glm52WeightSource,
        config: &Glm52Config,
        layer: usize,
        sparsity: Sparsity,
    ) -> Result<Self, ModelError> {
        let site = Site::Layer(layer);
        if config.attention_bias {
            return Err(ModelError::UnsupportedConfig(
                "attention_bias = true (GLM-5.x has no attention biases)".into(),
            ));
        }
        let dims = Dims {
            hidden: config.hidden_size,
            heads: config.num_attention_heads,
            q_lora: config.q_lora_rank,
            kv_lora: config.kv_lora_rank,
            nope: config.qk_nope_head_dim,
            rope: config.qk_rope_head_dim,
            v: config.v_head_dim,
        };
        let p = format!("model.layers.{layer}.self_attn");
        let norm = |name: String, width: usize| -> Result<Array, ModelError> {
            let a = w.tensor(&name).at(site)?;
            if a.shape() != [width as i32] {
                return Err(ModelError::BadWeight {
                    site,
                    reason: format!("shape {:?}, expected [{width}]", a.shape()),
                    name,
                });
            }
            a.astype(Dtype::Float32).at(site, "casting a norm")
        };
        let kv_b = w
            .dequantized(
                &format!("{p}.kv_b_proj.weight"),
                dims.heads * (dims.nope + dims.v),
                dims.kv_lora,
            )
            .at(site)?;
        let split = || -> Result<(Array, Array), MlxError> {
            let per_head = kv_b.reshape(&[
                dims.heads as i32,
                (dims.nope + dims.v) as i32,
                dims.kv_lora as i32,
            ])?;
            let key_up = per_head.slice_axis(1, 0, dims.nope as i32)?.contiguous()?;
            let value_up = per_head
                .slice_axis(1, dims.nope as i32, (dims.nope + dims.v) as i32)?
                .contiguous()?;
            mlx::eval(&[&key_up, &value_up])?;
            Ok((key_up, value_up))
        };
        let (key_up, value_up) = split().at(site, "splitting kv_b_proj")?;
        Ok(Self {
            site,
            q_a_norm: norm(format!("{p}.q_a_layernorm.weight"), dims.q_lora)?,
            kv_a_norm: norm(format!("{p}.kv_a_layernorm.weight"), dims.kv_lora)?,
            names: ProjectionNames {
                q_a: format!("{p}.q_a_proj.weight"),
                q_b: format!("{p}.q_b_proj.weight"),
                kv_a: format!("{p}.kv_a_proj_with_mqa.weight"),
                o: format!("{p}.o_proj.weight"),
            },
            key_up,
            value_up,
            sparsity,
            dims,
            scale: attention_scale(config),
            rope: rope_for(config, true)?,
        })
    }

    /// Where this layer's selection comes from.
    pub fn sparsity(&self) -> &Sparsity {
        &self.sparsity
    }

    /// Runs the attention of a step of `L` tokens at positions
    /// `step.offset..step.offset + L` and appends them to `cache`.
    ///
    /// `x` is the normalized input `[1, L, hidden]`. Returns the output
    /// `[1, L, hidden]` and this layer's own indexer selection (for the
    /// layers that share it).
    pub fn forward(
        &self,
        w: &dyn Glm52WeightSource,
        x: &Array,
        cache: &mut LayerCache,
        step: Step<'_>,
    ) -> Result<(Array, Option<Selection>), ModelError> {
        let (site, d) = (self.site, self.dims);
        let Step {
            offset,
            causal,
            shared,
            ..
        } = step;
        let len = x.dim(1).at(site, "attention input")?;
        let (heads, qk) = (d.heads as i32, (d.nope + d.rope) as i32);

        let q_latent = w.linear(x, &self.names.q_a, d.q_lora, d.hidden).at(site)?;
        let qr = rms_norm(&q_latent, Some(&self.q_a_norm), LATENT_NORM_EPS).at(site, "q_a norm")?;
        let q = w
            .linear(&qr, &self.names.q_b, d.heads * (d.nope + d.rope), d.q_lora)
            .at(site)?;
        let kv = w
            .linear(x, &self.names.kv_a, d.kv_lora + d.rope, d.hidden)
            .at(site)?;

        let mut prepare = || -> Result<(Array, Array, Array, Array), MlxError> {
            let q = q.reshape(&[1, len, heads, qk])?.transpose(&[0, 2, 1, 3])?;
            let q_nope = q.slice_axis(-1, 0, d.nope as i32)?;
            let q_pe = self
                .rope
                .apply(&q.slice_axis(-1, d.nope as i32, qk)?, offset)?;
            let latent = kv.slice_axis(-1, 0, d.kv_lora as i32)?;
            let latent =
                rms_norm(&latent, Some(&self.kv_a_norm), LATENT_NORM_EPS)?.expand_dims(1)?;
            let k_pe = kv
                .slice_axis(-1, d.kv_lora as i32, (d.kv_lora + d.rope) as i32)?
                .reshape(&[1, 1, len, d.rope as i32])?;
            let k_pe = self.rope.apply(&k_pe, offset)?;
            let latent = cache.latent.append(&latent)?;
            let k_pe = cache.rope_keys.append(&k_pe)?;
            Ok((q_nope, q_pe, latent, k_pe))
        };
        let (q_nope, q_pe, latent, k_pe) = prepare().at(site, "attention inputs")?;

        let own = match &self.sparsity {
            Sparsity::Own(indexer) => {
                let keys = cache.index_keys.as_mut().ok_or_else(|| {
                    ModelError::CacheMismatch(format!("{site} has no indexer key cache"))
                })?;
                Some(indexer.select(w, x, &qr, keys, step)?)
            }
            Sparsity::Shared | Sparsity::Dense => None,
        };
        let top_k = match &self.sparsity {
            Sparsity::Own(_) => own.as_ref().and_then(|s| s.top_k.as_ref()),
            Sparsity::Shared => shared,
            Sparsity::Dense => None,
        };

        let attend = || -> Result<Array, MlxError> {
            let (mut latent, mut k_pe) = (latent.clone(), k_pe.clone());
            let mut mask = causal.cloned();
            if let Some(top_k) = top_k {
                if len == 1 {
                    let idx = top_k.indices.reshape(&[1, 1, -1, 1])?;
                    let picked = idx.dim(2)?;
                    let gather = |a: &Array, width: usize| {
                        a.take_along_axis(&idx.broadcast_to(&[1, 1, picked, width as i32])?, 2)
                    };
                    latent = gather(&latent, d.kv_lora)?;
                    k_pe = gather(&k_pe, d.rope)?;
                } else {
                    let mut shape = top_k.indices.shape();
                    let last = shape.len() - 1;
                    shape[last] = latent.dim(2)?;
                    let selected = mlx::zeros(&shape, Dtype::Bool)?.put_along_axis(
                        &top_k.indices,
                        &Array::scalar_int(1, Dtype::Bool)?,
                        -1,
                    )?;
                    mask = Some(match &mask {
                        Some(m) => selected.logical_and(m)?,
                        None => selected,
                    });
                }
            }
            let mut pe_scores = q_pe.multiply_scalar(self.scale)?.matmul(&k_pe.t()?)?;
            if let Some(m) = &mask {
                let floor = Array::scalar(f32::MIN, Dtype::Float32)?;
                pe_scores = mlx::r#where(m, &pe_scores, &floor)?;
            }
            let scores_mask = AttentionMask::Array(&pe_scores);
            let out = if len == 1 {
                let q_latent = q_nope.matmul(&self.key_up)?;
                let o = scaled_dot_product_attention(
                    &q_latent,
                    &latent,
                    &latent,
                    self.scale,
                    scores_mask,
                )?;
                o.matmul(&self.value_up.t()?)?
            } else {
                let keys = latent.matmul(&self.key_up.t()?)?;
                let values = latent.matmul(&self.value_up.t()?)?;
                scaled_dot_product_attention(&q_nope, &keys, &values, self.scale, scores_mask)?
            };
            out.transpose(&[0, 2, 1, 3])?
                .reshape(&[1, len, (d.heads * d.v) as i32])
        };
        let out = attend().at(site, "attention")?;
        let out = w
            .linear(&out, &self.names.o, d.hidden, d.heads * d.v)
            .at(site)?;
        Ok((out, own))
    }
}
