//! The MTP (multi-token prediction, "nextn") head of GLM-5.x, layer
//! `N = num_hidden_layers`, and the speculative [`MtpDrafter`] built on it.
//!
//! For a position `j` whose main-model hidden state `h_j` is known and whose
//! next token `t_{j+1}` is chosen, the head runs
//!
//! ```text
//! x   = eh_proj([enorm(embed(t_{j+1})) ; hnorm(h_j)])      (that column order)
//! y   = DecoderLayer_N(x)   at RoPE position j, with its own MLA cache
//! g   = shared_head.norm(y)
//! out = lm_head(g)          (a guess at t_{j+2})
//! ```
//!
//! with the main model's `embed_tokens` and `lm_head`. Layer `N` is a full
//! decoder layer: its own attention and cache, its own DSA indexer when the
//! container carries one (the converter writes it; Colibri containers do
//! not, and then the head attends densely over its cache), the shared expert
//! and the 256 routed experts through the model's streamed executor (int8 in
//! Colibri containers, loaded with [`ModelOptions::include_mtp`]).
//!
//! # Which hidden state feeds `hnorm`
//!
//! `h_j` is the last main layer's output **after** the final `model.norm`,
//! the same vector the main `lm_head` reads
//! ([`Glm52Model::last_hidden`]):
//!
//! * vLLM `vllm/model_executor/models/deepseek_mtp.py`
//!   (`DeepSeekMultiTokenPredictorLayer.forward` applies `hnorm` to
//!   `previous_hidden_states`, the target model's output) with
//!   `deepseek_v2.py`, whose `DeepseekV2Model.forward` returns
//!   `self.norm(hidden_states, residual)`: post-norm;
//! * SGLang `python/sglang/srt/models/deepseek_nextn.py`
//!   (`hnorm(forward_batch.spec_info.hidden_states)`), where the hidden
//!   states are captured by the `LogitsProcessor` from its input, the
//!   post-norm state the LM head reads (SGLang captures the pre-norm state
//!   only for models that ask for it, such as DeepSeek-V4 and MiMo-V2, not
//!   for DeepSeek-V3/GLM).
//!
//! Chaining drafts (`k > 1`), the next step takes the head's own `g` (after
//! `shared_head.norm`) as its hidden state, as SGLang does (vLLM passes the
//! state before `shared_head.norm`); only the first draft of a round, which
//! conditions on a true main hidden state, is unaffected by that choice.
//!
//! # Cache bookkeeping
//!
//! MTP cache entry `j` holds the pair `(h_j, t_{j+1})` of committed
//! positions only. [`MtpDrafter::observe`] queues the pairs a main pass made
//! known; [`MtpDrafter::draft`] runs them (one multi-row pass, which is the
//! head's prefill after the prompt), takes the first draft from the last row,
//! chains further drafts on its own hidden state, and then truncates its
//! cache back to the committed entries.
//!
//! [`ModelOptions::include_mtp`]: super::ModelOptions::include_mtp

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::container::Glm52Config;
use crate::generate::error::BoxError;
use crate::generate::sampling::{SamplingParams, argmax, candidate_distribution};
use crate::generate::speculative::{DraftToken, Drafter};
use crate::mlx::fast::rms_norm;
use crate::mlx::{self, Array, Dtype, MlxError};
use crate::resident::{Glm52WeightSource, ResidentWeights};

use super::attention::{Sparsity, Step};
use super::cache::ModelCache;
use super::error::{MlxAt, WeightsAt};
use super::indexer::{Indexer, indexer_weight_names};
use super::layer::DecoderLayer;
use super::{EMBED, Glm52Model, ModelError, Site, causal_mask};

/// The MTP layer's weights.
pub struct MtpHead {
    index: usize,
    layer: DecoderLayer,
    enorm: Array,
    hnorm: Array,
    head_norm: Array,
    eh_proj: String,
    eps: f32,
    has_indexer: bool,
}

impl std::fmt::Debug for MtpHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpHead")
            .field("layer", &self.index)
            .field("has_indexer", &self.has_indexer)
            .finish_non_exhaustive()
    }
}

impl MtpHead {
    /// Loads layer `num_hidden_layers` as an MTP head; `None` when the config
    /// has no MTP layer or the container lacks its `eh_proj`.
    pub fn load(w: &ResidentWeights, config: &Glm52Config) -> Result<Option<Self>, ModelError> {
        let Some(index) = config.mtp_layer_index() else {
            return Ok(None);
        };
        let p = format!("model.layers.{index}");
        let eh_proj = format!("{p}.eh_proj.weight");
        if !w.has(&eh_proj) {
            tracing::warn!("the container has no MTP layer ({eh_proj} is missing)");
            return Ok(None);
        }
        let site = Site::Layer(index);
        let has_indexer = w.has(&indexer_weight_names(index)[0]);
        let sparsity = if has_indexer {
            Sparsity::Own(Indexer::load(w, config, index)?)
        } else {
            Sparsity::Dense
        };
        let layer = DecoderLayer::load(w, config, index, sparsity)?;
        let norm = |name: String| -> Result<Array, ModelError> {
            let a = w.tensor(&name).at(site)?;
            if a.shape() != [config.hidden_size as i32] {
                return Err(ModelError::BadWeight {
                    site,
                    reason: format!("shape {:?}, expected [{}]", a.shape(), config.hidden_size),
                    name,
                });
            }
            a.astype(Dtype::Float32).at(site, "casting an MTP norm")
        };
        Ok(Some(Self {
            index,
            layer,
            enorm: norm(format!("{p}.enorm.weight"))?,
            hnorm: norm(format!("{p}.hnorm.weight"))?,
            head_norm: norm(format!("{p}.shared_head.norm.weight"))?,
            eh_proj,
            eps: config.rms_norm_eps as f32,
            has_indexer,
        }))
    }

    /// The layer index (`num_hidden_layers`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether the head runs its own DSA indexer (else dense attention).
    pub fn has_indexer(&self) -> bool {
        self.has_indexer
    }
}

/// What one MTP pass produced for its last row.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpOutput {
    /// Logits of the last row (`vocab_size`).
    pub logits: Vec<f32>,
    /// The last row's state after `shared_head.norm` (`hidden_size`), the
    /// hidden state of a chained next draft.
    pub hidden: Vec<f32>,
}

impl Glm52Model {
    /// The MTP head, when the model was opened with
    /// [`include_mtp`](super::ModelOptions::include_mtp) and the container
    /// has one.
    pub fn mtp_head(&self) -> Option<&MtpHead> {
        self.mtp.as_ref()
    }

    /// An empty cache for the MTP head (one layer).
    pub fn new_mtp_cache(&self) -> Result<ModelCache, ModelError> {
        let head = self
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::NoMtp("open the model with include_mtp".into()))?;
        let width = head.has_indexer.then_some(self.config.index_head_dim);
        Ok(ModelCache::new(
            self.config.kv_lora_rank,
            self.config.qk_rope_head_dim,
            &[width],
        ))
    }

    /// Runs the MTP head on the pairs `(hidden row i, tokens[i])` at MTP
    /// positions `cache.len()..` and appends them to `cache` (see the
    /// [module docs](self)). `hidden` is `tokens.len() × hidden_size`
    /// row-major. Returns the last row's logits and normalized state. On
    /// error the cache keeps its length.
    pub fn mtp_forward(
        &mut self,
        tokens: &[u32],
        hidden: &[f32],
        cache: &mut ModelCache,
    ) -> Result<MtpOutput, ModelError> {
        let (vocab, width) = (self.config.vocab_size, self.config.hidden_size);
        let head = self
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::NoMtp("open the model with include_mtp".into()))?;
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        if let Some((index, &id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            return Err(ModelError::TokenOutOfRange { index, id, vocab });
        }
        if hidden.len() != tokens.len() * width {
            return Err(ModelError::UnsupportedConfig(format!(
                "MTP input: {} hidden values for {} tokens of width {width}",
                hidden.len(),
                tokens.len()
            )));
        }
        let offset = cache.len();
        let end = offset.saturating_add(tokens.len());
        let max = self.config.max_position_embeddings;
        if end > max || end > i32::MAX as usize {
            return Err(ModelError::ContextOverflow {
                start: offset,
                end,
                max,
            });
        }
        if cache.layer_count() != 1 {
            return Err(ModelError::CacheMismatch(format!(
                "{} layer caches for the one MTP layer",
                cache.layer_count()
            )));
        }
        let site = Site::Layer(head.index);
        let len = tokens.len() as i32;
        let embedded = self
            .weights
            .embedding(tokens, EMBED, vocab, width)
            .at(Site::Embedding)?;
        let joined = || -> Result<Array, MlxError> {
            let shape = [1, len, width as i32];
            let e = rms_norm(&embedded.reshape(&shape)?, Some(&head.enorm), head.eps)?;
            let h = rms_norm(
                &Array::from_slice(hidden, &shape)?,
                Some(&head.hnorm),
                head.eps,
            )?;
            mlx::concatenate(&[&e, &h], 2)
        };
        let joined = joined().at(site, "MTP input")?;
        let x = self
            .weights
            .linear(&joined, &head.eh_proj, width, 2 * width)
            .at(site)?;
        let causal = if len > 1 {
            Some(causal_mask(offset, tokens.len()).at(site, "causal mask")?)
        } else {
            None
        };
        let step = Step {
            offset,
            causal: causal.as_ref(),
            shared: None,
            track_gap: false,
            // The routing trace records the main model's layers only.
            keep_routes: false,
        };
        let result = (|| {
            let layer_cache = cache
                .layers_mut()
                .first_mut()
                .ok_or_else(|| ModelError::CacheMismatch("empty MTP cache".into()))?;
            let out =
                head.layer
                    .forward(&self.weights, self.executor.as_mut(), &x, layer_cache, step)?;
            let last = out
                .hidden
                .slice_axis(1, len - 1, len)
                .and_then(|h| rms_norm(&h, Some(&head.head_norm), head.eps))
                .at(site, "shared_head.norm")?;
            let logits = self
                .weights
                .linear(&last, self.head, vocab, width)
                .at(Site::Head)?;
            let mut outputs = vec![&logits, &last];
            outputs.extend(cache.arrays());
            mlx::eval(&outputs).at(site, "evaluating the MTP step")?;
            Ok(MtpOutput {
                logits: logits.to_vec::<f32>().at(site, "reading MTP logits")?,
                hidden: last.to_vec::<f32>().at(site, "reading the MTP state")?,
            })
        })();
        match result {
            Ok(out) => {
                cache.set_len(end);
                Ok(out)
            }
            Err(e) => {
                cache.truncate(offset);
                Err(e)
            }
        }
    }
}

/// Pairs queued before the drafter runs them without being asked to draft
/// (bounds the memory of a long stretch with drafting off).
pub const MAX_PENDING_PAIRS: usize = 256;

/// A [`Drafter`] over the model's MTP head: chains `k` MTP passes per round.
///
/// Greedy sessions draft the MTP argmax (`q = None`); sampling sessions draw
/// each draft from the MTP logits under the session's temperature / top-k /
/// top-p with the drafter's own seeded stream and report that distribution
/// as `q`.
#[derive(Debug)]
pub struct MtpDrafter {
    cache: ModelCache,
    pending_tokens: Vec<u32>,
    pending_hidden: Vec<f32>,
    width: usize,
    rng: ChaCha8Rng,
}

impl MtpDrafter {
    /// A drafter for `model` (which must have an MTP head; it starts keeping
    /// its hidden rows). `seed` seeds the stream of sampled drafts.
    pub fn new(model: &mut Glm52Model, seed: u64) -> Result<Self, ModelError> {
        let cache = model.new_mtp_cache()?;
        model.set_keep_hidden(true);
        Ok(Self {
            cache,
            pending_tokens: Vec::new(),
            pending_hidden: Vec::new(),
            width: model.config().hidden_size,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    /// The MTP cache (committed entries only between rounds).
    pub fn cache(&self) -> &ModelCache {
        &self.cache
    }

    /// Pairs known but not yet run through the head.
    pub fn pending(&self) -> usize {
        self.pending_tokens.len()
    }

    /// Runs the queued pairs (in prefill-sized chunks); the last chunk's
    /// output, `None` when nothing was queued.
    fn flush(&mut self, model: &mut Glm52Model) -> Result<Option<MtpOutput>, ModelError> {
        let chunk = model.prefill_chunk.max(1);
        let tokens = std::mem::take(&mut self.pending_tokens);
        let hidden = std::mem::take(&mut self.pending_hidden);
        let mut last = None;
        for (t, h) in tokens.chunks(chunk).zip(hidden.chunks(chunk * self.width)) {
            last = Some(model.mtp_forward(t, h, &mut self.cache)?);
        }
        Ok(last)
    }

    fn choose(&mut self, logits: &[f32], params: &SamplingParams) -> Result<DraftToken, BoxError> {
        if params.is_greedy() {
            let id = argmax(logits).ok_or("empty MTP logits")?;
            return Ok(DraftToken::certain(id));
        }
        let dist = candidate_distribution(logits, params)?;
        let u: f64 = self.rng.random();
        let mut cum = 0.0;
        let mut id = dist.last().map(|&(i, _)| i).ok_or("no MTP candidate")?;
        for &(i, p) in &dist {
            cum += p;
            if u < cum {
                id = i;
                break;
            }
        }
        Ok(DraftToken { id, q: Some(dist) })
    }
}

impl Drafter<Glm52Model> for MtpDrafter {
    fn observe(
        &mut self,
        model: &mut Glm52Model,
        fed: &[u32],
        kept: usize,
        next: u32,
    ) -> Result<(), BoxError> {
        let kept = kept.min(fed.len());
        let rows = model.last_hidden();
        if rows.len() < kept * self.width {
            return Err(Box::new(ModelError::CacheMismatch(format!(
                "the model kept {} hidden values, {kept} rows of {} needed \
                 (set_keep_hidden was turned off?)",
                rows.len(),
                self.width
            ))));
        }
        self.pending_hidden
            .extend_from_slice(&rows[..kept * self.width]);
        self.pending_tokens.extend(
            fed.iter()
                .take(kept)
                .skip(1)
                .copied()
                .chain(std::iter::once(next)),
        );
        if self.pending_tokens.len() > MAX_PENDING_PAIRS {
            self.flush(model)?;
        }
        Ok(())
    }

    fn draft(
        &mut self,
        model: &mut Glm52Model,
        _context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> Result<Vec<DraftToken>, BoxError> {
        if k == 0 {
            return Ok(Vec::new());
        }
        let Some(mut out) = self.flush(model)? else {
            return Ok(Vec::new());
        };
        let committed = self.cache.len();
        let mut drafts = Vec::with_capacity(k);
        let chained = (|| -> Result<(), BoxError> {
            loop {
                let draft = self.choose(&out.logits, sampling)?;
                let id = draft.id;
                drafts.push(draft);
                if drafts.len() == k {
                    return Ok(());
                }
                out = model.mtp_forward(&[id], &out.hidden, &mut self.cache)?;
            }
        })();
        self.cache.truncate(committed);
        chained?;
        Ok(drafts)
    }
}
