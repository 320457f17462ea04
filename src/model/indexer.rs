//! The DSA (DeepSeek sparse attention) indexer: picks the `index_topk`
//! context positions each query attends to.
//!
//! As mlx-lm 0.32.2 computes it:
//! `qI = wq_b(qr)` (`index_n_heads × index_head_dim`), `kI = LayerNorm(wk(x))`
//! (weight and bias, eps 1e-5), RoPE on the first `qk_rope_head_dim`
//! features of both (pairs interleaved when `indexer_rope_interleave`),
//! `score[t] = Σ_h weights_proj(x)[h] · n_heads^-½ · head_dim^-½ · relu(qI_h · kI_t)`,
//! the causal mask, and the `index_topk` best positions. While the context
//! (cache included) holds at most `index_topk` positions no selection is made
//! and attention is dense.

use crate::container::Glm52Config;
use crate::mlx::{self, Array, Dtype, MlxError, fast};
use crate::resident::Glm52WeightSource;

use super::attention::Step;
use super::cache::SequenceBuffer;
use super::error::{MlxAt, WeightsAt};
use super::rope::{Rope, rope_for};
use super::{ModelError, Site};

/// `eps` of the indexer's key LayerNorm (`mlx.nn.LayerNorm`'s default).
pub const INDEXER_NORM_EPS: f32 = 1e-5;

/// The positions selected by an indexer for every query of a step.
#[derive(Clone)]
pub struct TopK {
    /// `[1, 1, queries, index_topk]` position indices into the context.
    pub indices: Array,
}

/// What [`Indexer::select`] produced.
pub struct Selection {
    /// The selected positions, or `None` while the context fits in
    /// `index_topk` (dense attention).
    pub top_k: Option<TopK>,
    /// With gap tracking on and a selection made: a 0-d array holding the
    /// smallest gap between the `k`-th and `(k+1)`-th best score over the
    /// queries that had more than `k` candidates (`+inf` when none had).
    pub min_gap: Option<Array>,
}

/// Weight names of the indexer of layer `layer`.
pub fn indexer_weight_names(layer: usize) -> [String; 5] {
    let p = format!("model.layers.{layer}.self_attn.indexer");
    [
        format!("{p}.wq_b.weight"),
        format!("{p}.wk.weight"),
        format!("{p}.weights_proj.weight"),
        format!("{p}.k_norm.weight"),
        format!("{p}.k_norm.bias"),
    ]
}

/// One layer's DSA indexer.
pub struct Indexer {
    site: Site,
    wq_b: String,
    wk: String,
    weights_proj: String,
    k_norm_weight: Array,
    k_norm_bias: Array,
    heads: usize,
    head_dim: usize,
    top_k: usize,
    hidden: usize,
    q_lora_rank: usize,
    head_weight_scale: f32,
    rope: Rope,
}

impl Indexer {
    /// Loads the indexer of `layer` (its small LayerNorm tensors now, the
    /// projections on first use).
    pub fn load(
        w: &dyn Glm52WeightSource,
        config: &Glm52Config,
        layer: usize,
    ) -> Result<Self, ModelError> {
        let site = Site::Layer(layer);
        let [wq_b, wk, weights_proj, norm_w, norm_b] = indexer_weight_names(layer);
        let vector = |name: &str| -> Result<Array, ModelError> {
            let a = w.tensor(name).at(site)?;
            if a.shape() != [config.index_head_dim as i32] {
                return Err(ModelError::BadWeight {
                    site,
                    name: name.to_owned(),
                    reason: format!(
                        "shape {:?}, expected [{}]",
                        a.shape(),
                        config.index_head_dim
                    ),
                });
            }
            a.astype(Dtype::Float32).at(site, "casting a norm")
        };
        if config.index_topk == 0 || config.index_n_heads == 0 {
            return Err(ModelError::UnsupportedConfig(
                "index_topk and index_n_heads must be positive".into(),
            ));
        }
        if config.qk_rope_head_dim > config.index_head_dim {
            return Err(ModelError::UnsupportedConfig(
                "qk_rope_head_dim exceeds index_head_dim".into(),
            ));
        }
        let scale =
            (config.index_n_heads as f64).powf(-0.5) * (config.index_head_dim as f64).powf(-0.5);
        Ok(Self {
            site,
            k_norm_weight: vector(&norm_w)?,
            k_norm_bias: vector(&norm_b)?,
            wq_b,
            wk,
            weights_proj,
            heads: config.index_n_heads,
            head_dim: config.index_head_dim,
            top_k: config.index_topk,
            hidden: config.hidden_size,
            q_lora_rank: config.q_lora_rank,
            head_weight_scale: scale as f32,
            rope: rope_for(config, config.indexer_rope_interleave)?,
        })
    }

    /// Positions kept per query.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Appends the step's keys to `keys` and selects the positions of each
    /// query. `x` is the layer's normalized input `[1, L, hidden]`, `qr` the
    /// normalized query latent `[1, L, q_lora_rank]`.
    pub fn select(
        &self,
        w: &dyn Glm52WeightSource,
        x: &Array,
        qr: &Array,
        keys: &mut SequenceBuffer,
        step: Step<'_>,
    ) -> Result<Selection, ModelError> {
        let site = self.site;
        let Step {
            offset,
            causal,
            track_gap,
            ..
        } = step;
        let len = x.dim(1).at(site, "indexer input")?;
        let (heads, dim) = (self.heads as i32, self.head_dim as i32);
        let q = w
            .linear(qr, &self.wq_b, self.heads * self.head_dim, self.q_lora_rank)
            .at(site)?;
        let k = w.linear(x, &self.wk, self.head_dim, self.hidden).at(site)?;
        let head_weights = w
            .linear(x, &self.weights_proj, self.heads, self.hidden)
            .at(site)?;
        let mut select = || -> Result<Selection, MlxError> {
            let q = q.reshape(&[1, len, heads, dim])?.transpose(&[0, 2, 1, 3])?;
            let k = fast::layer_norm(
                &k,
                Some(&self.k_norm_weight),
                Some(&self.k_norm_bias),
                INDEXER_NORM_EPS,
            )?
            .reshape(&[1, 1, len, dim])?;
            let q = self.rope.apply(&q, offset)?;
            let k = self.rope.apply(&k, offset)?;
            let keys = keys.append(&k)?;
            let context = keys.dim(2)? as usize;
            if context <= self.top_k {
                return Ok(Selection {
                    top_k: None,
                    min_gap: None,
                });
            }
            // [1, H, L, S] → relu → weighted sum over heads → [1, 1, L, S].
            let scores = q.matmul(&keys.t()?)?;
            let scores = scores.maximum(&Array::scalar(0.0, Dtype::Float32)?)?;
            let hw = head_weights
                .multiply_scalar(self.head_weight_scale)?
                .transpose(&[0, 2, 1])?
                .expand_dims(-1)?;
            let mut scores = scores.multiply(&hw)?.sum(&[1], true)?;
            if let Some(mask) = causal {
                let ninf = Array::scalar(f32::NEG_INFINITY, Dtype::Float32)?;
                scores = mlx::r#where(mask, &scores, &ninf)?;
            }
            let kth = (context - self.top_k) as i32;
            let indices = scores
                .argpartition(kth, -1)?
                .slice_axis(-1, kth, context as i32)?;
            let min_gap = if track_gap {
                Some(cut_gap(&scores, self.top_k)?)
            } else {
                None
            };
            Ok(Selection {
                top_k: Some(TopK { indices }),
                min_gap,
            })
        };
        select().at(site, "indexer")
    }
}

/// The smallest `k`-th minus `(k+1)`-th best score over the rows of `scores`
/// (`[..., S]`, masked entries `-inf`) that have more than `k` candidates;
/// `+inf` when none has.
fn cut_gap(scores: &Array, k: usize) -> Result<Array, MlxError> {
    let best = scores.topk(k as i32 + 1, -1)?.sort(-1)?;
    let below = best.slice_axis(-1, 0, 1)?;
    let at = best.slice_axis(-1, 1, 2)?;
    let ninf = Array::scalar(f32::NEG_INFINITY, Dtype::Float32)?;
    let inf = Array::scalar(f32::INFINITY, Dtype::Float32)?;
    let gap = mlx::r#where(&below.greater(&ninf)?, &at.subtract(&below)?, &inf)?;
    let axes: Vec<i32> = (0..gap.ndim() as i32).collect();
    gap.min(&axes, false)
}
