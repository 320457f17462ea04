//! The GLM-5.x (`glm_moe_dsa`) model graph over the resident weights and the
//! streamed routed experts, matching mlx-lm 0.32.2's `glm_moe_dsa`.
//!
//! * [`attention`]: MLA with `kv_b_proj` absorbed for single-token steps;
//! * [`indexer`]: the DSA indexer and its key cache, GLM-5.2 IndexShare;
//! * [`mlp`]: the dense SwiGLU and the shared expert;
//! * [`moe`]: the router and the routed experts through the
//!   [`StreamedExecutor`];
//! * [`layer`]: the decoder layer; [`cache`]: the per-sequence caches;
//! * [`mtp`]: the MTP (nextn) head and its speculative drafter.
//!
//! All activations are float32.
//!
//! ```no_run
//! use glm_stream::model::{Glm52Model, ModelOptions};
//!
//! let mut model = Glm52Model::open("/models/glm-5.2-colibri", &ModelOptions::default())?;
//! let mut cache = model.new_cache();
//! let logits = model.forward(&[1, 2, 3], &mut cache, false)?;
//! assert_eq!(logits.len(), model.config().vocab_size);
//! assert_eq!(cache.len(), 3);
//! # Ok::<(), glm_stream::model::ModelError>(())
//! ```

pub mod attention;
pub mod cache;
mod error;
pub mod indexer;
pub mod layer;
pub mod mlp;
pub mod moe;
pub mod mtp;
pub mod rope;

use std::path::Path;
use std::sync::Arc;

pub use cache::{LayerCache, ModelCache};
pub use error::{ModelError, Site};

use crate::container::{ColibriContainer, Glm52Config};
use crate::executor::{ExecutorOptions, StreamedExecutor, layouts_from_source};
use crate::experts::{
    DirectUpload, FileExpertSource, PolicyConfig, ResidencyManager, RoutingTrace, SlabConfig,
};
use crate::kernels::KernelFamily;
use crate::mlx::fast::rms_norm;
use crate::mlx::{self, Array, Dtype, MlxError};
use crate::resident::{Glm52WeightSource, ResidentOptions, ResidentWeights};

use attention::{Sparsity, Step};
use error::{MlxAt, WeightsAt};
use indexer::{Indexer, TopK, indexer_weight_names};
use layer::DecoderLayer;

/// The only architecture this module runs.
pub const MODEL_TYPE: &str = "glm_moe_dsa";

/// With no RAM budget, the expert pool holds this many layers' worth of
/// routed experts (`num_experts_per_tok` slots each).
pub const DEFAULT_POOL_LAYERS: usize = 4;

/// Tokens per pass of a long [`Glm52Model::forward`] call (see
/// [`Glm52Model::set_prefill_chunk`]).
pub const DEFAULT_PREFILL_CHUNK: usize = 1024;

const EMBED: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";
const FINAL_NORM: &str = "model.norm.weight";

/// Options of [`Glm52Model::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// Bytes for the routed-expert slot pool: `budget / largest slot` slots,
    /// but never fewer than `num_experts_per_tok` (one token's experts always
    /// fit in one wave) nor more than there are routed experts. `None`:
    /// [`DEFAULT_POOL_LAYERS`] layers' worth (`4 · num_experts_per_tok`).
    pub ram_budget_bytes: Option<u64>,
    /// Threads loading experts.
    pub io_threads: usize,
    /// Read experts with `O_DIRECT` where the file system allows it.
    pub direct_io: bool,
    /// Load the MTP layer (resident weights, routed experts through the
    /// executor) for speculative decoding (see [`mtp`]).
    pub include_mtp: bool,
    /// How routed experts are computed: `Auto` (the fused kernels on a GPU
    /// build for decode-sized waves, MLX's `quantized_matmul` otherwise),
    /// or one family pinned (`Fused` / `FusedSimt` fail at open when this
    /// build or device cannot run them).
    pub kernel_family: KernelFamily,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            ram_budget_bytes: None,
            io_threads: 4,
            direct_io: true,
            include_mtp: false,
            kernel_family: KernelFamily::Auto,
        }
    }
}

/// Routed-expert pool counters since the model was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertStats {
    /// Requested experts that were resident.
    pub hits: u64,
    /// Requested experts loaded from storage.
    pub misses: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// `hits / (hits + misses)`, `None` before any request.
    pub hit_rate: Option<f64>,
    /// Slots in the pool (0 for a model without routed experts).
    pub slots: usize,
}

/// The smallest top-k cut gaps of the last forward: how far the last kept
/// candidate scored above the first dropped one. A tiny gap means the
/// selection could flip under rounding.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CutGaps {
    /// Router: `k`-th minus `(k+1)`-th best `sigmoid + bias` over all rows of
    /// all MoE layers (`None`: no MoE layer ran, or `top_k == n_experts`).
    pub router: Option<f32>,
    /// Indexer: `k`-th minus `(k+1)`-th best index score over the queries that
    /// had more than `index_topk` candidates. `None` unless tracking is on
    /// ([`Glm52Model::set_cut_gap_tracking`]) and a selection was made;
    /// `+inf` when a selection was made but no query had a cut.
    pub indexer: Option<f32>,
}

impl CutGaps {
    fn merge(self, other: Self) -> Self {
        let min = |a: Option<f32>, b: Option<f32>| match (a, b) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        Self {
            router: min(self.router, other.router),
            indexer: min(self.indexer, other.indexer),
        }
    }
}

/// A GLM-5.x model: resident weights, the streamed expert executor and the
/// decoder layers.
pub struct Glm52Model {
    weights: ResidentWeights,
    config: Glm52Config,
    layers: Vec<DecoderLayer>,
    executor: Option<StreamedExecutor>,
    slots: usize,
    final_norm: Array,
    head: &'static str,
    eos: Vec<u32>,
    track_indexer_gaps: bool,
    prefill_chunk: usize,
    gaps: CutGaps,
    mtp: Option<mtp::MtpHead>,
    keep_hidden: bool,
    last_hidden: Vec<f32>,
    /// The routing trace (`None` without routed experts), whether it records,
    /// and the index of the next recorded forward call.
    trace: Option<RoutingTrace>,
    tracing_routes: bool,
    trace_call: u64,
}

impl std::fmt::Debug for Glm52Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Glm52Model")
            .field("dir", &self.weights.container().dir())
            .field("layers", &self.layers.len())
            .field("expert_slots", &self.slots)
            .finish()
    }
}

impl Glm52Model {
    /// Opens the Colibri container in `dir`: checks the architecture, loads
    /// the small per-layer tensors (norms, routers, `kv_b_proj` as f32) and
    /// sets up the expert pool. Other weights load on first use.
    pub fn open(dir: impl AsRef<Path>, opts: &ModelOptions) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let container = ColibriContainer::open(dir)?;
        let config = container.config().clone();
        if config.model_type != MODEL_TYPE {
            return Err(ModelError::UnsupportedModelType {
                dir: dir.to_owned(),
                found: config.model_type,
            });
        }
        check_config(&config)?;
        let eos = container.eos_token_ids();
        let weights = ResidentWeights::from_container(
            container,
            &ResidentOptions {
                include_mtp: opts.include_mtp,
                ..ResidentOptions::default()
            },
        )
        .at(Site::Setup)?;

        let n = config.num_hidden_layers;
        let any_indexer = (0..n).any(|l| weights.has(&indexer_weight_names(l)[0]));
        if !any_indexer {
            tracing::warn!(
                "{}: the container has no DSA indexer weights; every layer runs dense \
                 attention over the whole context",
                dir.display()
            );
        }
        let mut layers = Vec::with_capacity(n);
        for l in 0..n {
            let sparsity = if !any_indexer {
                Sparsity::Dense
            } else if config.layer_has_indexer(l) {
                Sparsity::Own(Indexer::load(&weights, &config, l)?)
            } else {
                Sparsity::Shared
            };
            layers.push(DecoderLayer::load(&weights, &config, l, sparsity)?);
        }
        let final_norm = weights
            .tensor(FINAL_NORM)
            .at(Site::Head)?
            .astype(Dtype::Float32)
            .at(Site::Head, "casting the final norm")?;
        let head = if !weights.has(LM_HEAD) && config.tie_word_embeddings {
            EMBED
        } else {
            LM_HEAD
        };
        let (executor, slots) = match expert_executor(&weights, &config, opts)? {
            Some((e, s)) => (Some(e), s),
            None => (None, 0),
        };
        let mtp = if opts.include_mtp {
            mtp::MtpHead::load(&weights, &config)?
        } else {
            None
        };
        let trace = executor.as_ref().and_then(|_| {
            let experts = u32::try_from(config.n_routed_experts.unwrap_or(0)).ok()?;
            RoutingTrace::new(experts, config.num_experts_per_tok).ok()
        });
        Ok(Self {
            weights,
            config,
            layers,
            executor,
            slots,
            final_norm,
            head,
            eos,
            track_indexer_gaps: false,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            gaps: CutGaps::default(),
            mtp,
            keep_hidden: false,
            last_hidden: Vec::new(),
            trace,
            tracing_routes: false,
            trace_call: 0,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &Glm52Config {
        &self.config
    }

    /// The resident weights.
    pub fn weights(&self) -> &ResidentWeights {
        &self.weights
    }

    /// Stop ids: `config.json` plus `generation_config.json`, sorted, unique.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// Empty caches for one sequence.
    pub fn new_cache(&self) -> ModelCache {
        let index_widths: Vec<Option<usize>> = self
            .layers
            .iter()
            .map(|l| match l.attention().sparsity() {
                Sparsity::Own(_) => Some(self.config.index_head_dim),
                Sparsity::Shared | Sparsity::Dense => None,
            })
            .collect();
        ModelCache::new(
            self.config.kv_lora_rank,
            self.config.qk_rope_head_dim,
            &index_widths,
        )
    }

    /// Per layer: where its DSA selection comes from.
    pub fn layer_sparsity(&self, layer: usize) -> Option<&Sparsity> {
        self.layers.get(layer).map(|l| l.attention().sparsity())
    }

    /// Turns tracking of the indexer cut gap on or off (off by default: it
    /// costs a second top-k over the index scores of every indexer layer).
    pub fn set_cut_gap_tracking(&mut self, on: bool) {
        self.track_indexer_gaps = on;
    }

    /// Turns recording of the routing trace on or off (off by default).
    /// While on, every MoE layer of every [`forward`](Self::forward) pass
    /// appends its routed expert ids (`top_k` per row) to
    /// [`routing_trace`](Self::routing_trace), tagged with the index of the
    /// forward call (counted over the calls made while recording). A call
    /// that fails leaves no records. Turning it off keeps what was recorded.
    pub fn set_routing_trace(&mut self, on: bool) {
        self.tracing_routes = on;
    }

    /// The routing recorded so far; `None` for a model without routed
    /// experts.
    pub fn routing_trace(&self) -> Option<&RoutingTrace> {
        self.trace.as_ref()
    }

    /// Takes the routing recorded so far, leaving an empty trace (the call
    /// count restarts at 0); `None` for a model without routed experts.
    pub fn take_routing_trace(&mut self) -> Option<RoutingTrace> {
        let trace = self.trace.as_mut()?;
        let empty = RoutingTrace::new(trace.experts(), trace.top_k()).ok()?;
        self.trace_call = 0;
        Some(std::mem::replace(trace, empty))
    }

    /// Sets the most tokens one pass of [`forward`](Self::forward) runs
    /// (at least 1; default [`DEFAULT_PREFILL_CHUNK`]). A longer call runs in
    /// consecutive passes over the cache, which bounds the `[L, S]` score
    /// matrices of attention and indexer; the result is the same up to
    /// rounding.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Runs `ids` at positions `cache.len()..` and appends them to the cache.
    /// Returns float32 logits: all rows (`[ids.len() × vocab]`, row-major)
    /// when `all_rows`, else only the last row (`[vocab]`).
    ///
    /// Ids are checked against the vocabulary and the positions against
    /// `max_position_embeddings` before any work. On error the cache is
    /// rolled back to its length before the call. Calls longer than the
    /// prefill chunk run in several passes; [`last_forward_min_gaps`]
    /// covers all of them.
    ///
    /// [`last_forward_min_gaps`]: Self::last_forward_min_gaps
    pub fn forward(
        &mut self,
        ids: &[u32],
        cache: &mut ModelCache,
        all_rows: bool,
    ) -> Result<Vec<f32>, ModelError> {
        if ids.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let vocab = self.config.vocab_size;
        if let Some((index, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            return Err(ModelError::TokenOutOfRange { index, id, vocab });
        }
        let start = cache.len();
        let end = start.saturating_add(ids.len());
        let max = self.config.max_position_embeddings;
        if end > max || end > i32::MAX as usize {
            return Err(ModelError::ContextOverflow { start, end, max });
        }
        if cache.layer_count() != self.layers.len() {
            return Err(ModelError::CacheMismatch(format!(
                "{} layer caches for {} layers",
                cache.layer_count(),
                self.layers.len()
            )));
        }
        let mut gaps = CutGaps::default();
        let mut logits = Vec::new();
        self.last_hidden.clear();
        let trace_len = self.trace.as_ref().map_or(0, RoutingTrace::len);
        let chunks = ids.chunks(self.prefill_chunk);
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.enumerate() {
            let rows = match (all_rows, i == last) {
                (true, _) => HeadRows::All,
                (false, true) => HeadRows::Last,
                (false, false) => HeadRows::None,
            };
            match self.run(chunk, cache, rows) {
                Ok((rows, hidden)) => {
                    cache.set_len(cache.len() + chunk.len());
                    gaps = gaps.merge(self.gaps);
                    logits.extend(rows);
                    self.last_hidden.extend(hidden);
                }
                Err(e) => {
                    cache.truncate(start);
                    self.gaps = CutGaps::default();
                    self.last_hidden.clear();
                    if let Some(t) = &mut self.trace {
                        t.truncate(trace_len);
                    }
                    return Err(e);
                }
            }
        }
        self.gaps = gaps;
        if self.recording() {
            self.trace_call += 1;
        }
        Ok(logits)
    }

    /// One pass over `ids` (sets `self.gaps`; the caller sets the cache
    /// length). Returns the logits rows and, while hidden rows are kept
    /// ([`set_keep_hidden`](Self::set_keep_hidden)), every row of the final
    /// normalized hidden state (else an empty vector).
    fn run(
        &mut self,
        ids: &[u32],
        cache: &mut ModelCache,
        rows: HeadRows,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (vocab, hidden) = (self.config.vocab_size, self.config.hidden_size);
        let len = ids.len() as i32;
        let offset = cache.len();
        let h = self
            .weights
            .embedding(ids, EMBED, vocab, hidden)
            .at(Site::Embedding)?;
        let mut h = h
            .reshape(&[1, len, hidden as i32])
            .at(Site::Embedding, "embedding rows")?;
        let causal = if len > 1 {
            Some(causal_mask(offset, len as usize).at(Site::Setup, "causal mask")?)
        } else {
            None
        };
        let mut shared: Option<TopK> = None;
        let mut router_gap: Option<f32> = None;
        let mut index_gaps: Vec<Array> = Vec::new();
        let keep_routes = self.recording();
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers_mut()) {
            let step = Step {
                offset,
                causal: causal.as_ref(),
                shared: shared.as_ref(),
                track_gap: self.track_indexer_gaps,
                keep_routes,
            };
            let out =
                layer.forward(&self.weights, self.executor.as_mut(), &h, layer_cache, step)?;
            h = out.hidden;
            if let (Some(ids), Some(trace)) = (out.routed, self.trace.as_mut()) {
                let index = layer.index();
                trace
                    .push(self.trace_call, index as u32, ids)
                    .map_err(|e| ModelError::RoutingTrace {
                        layer: index,
                        source: Box::new(e),
                    })?;
            }
            if let Some(selection) = out.selection {
                shared = selection.top_k;
                index_gaps.extend(selection.min_gap);
            }
            if let Some(g) = out.router_gap {
                router_gap = Some(router_gap.map_or(g, |r| r.min(g)));
            }
        }
        let site = Site::Head;
        let normed = if rows != HeadRows::None || self.keep_hidden {
            Some(
                rms_norm(&h, Some(&self.final_norm), self.config.rms_norm_eps as f32)
                    .at(site, "final norm")?,
            )
        } else {
            None
        };
        let logits = match (rows, &normed) {
            (HeadRows::None, _) | (_, None) => None,
            (HeadRows::Last | HeadRows::All, Some(normed)) => {
                let mut h = normed.clone();
                if rows == HeadRows::Last && len > 1 {
                    h = h.slice_axis(1, len - 1, len).at(site, "last row")?;
                }
                Some(self.weights.linear(&h, self.head, vocab, hidden).at(site)?)
            }
        };
        let kept = normed.as_ref().filter(|_| self.keep_hidden);
        let mut outputs: Vec<&Array> = logits.iter().chain(kept).collect();
        if outputs.is_empty() {
            outputs.push(&h);
        }
        outputs.extend(cache.arrays());
        outputs.extend(index_gaps.iter());
        mlx::eval(&outputs).at(site, "evaluating the step")?;
        let mut indexer_gap: Option<f32> = None;
        for g in &index_gaps {
            let g = g.item::<f32>().at(site, "reading a cut gap")?;
            indexer_gap = Some(indexer_gap.map_or(g, |m| m.min(g)));
        }
        self.gaps = CutGaps {
            router: router_gap,
            indexer: indexer_gap,
        };
        let hidden_rows = match kept {
            Some(h) => h.to_vec::<f32>().at(site, "reading the hidden rows")?,
            None => Vec::new(),
        };
        let logits = match logits {
            Some(l) => l.to_vec::<f32>().at(site, "reading the logits")?,
            None => Vec::new(),
        };
        Ok((logits, hidden_rows))
    }

    /// Keeps (or stops keeping) the final normalized hidden rows of every
    /// [`forward`](Self::forward) call, for [`last_hidden`](Self::last_hidden).
    /// Off by default; the MTP drafter turns it on.
    pub fn set_keep_hidden(&mut self, on: bool) {
        self.keep_hidden = on;
        if !on {
            self.last_hidden = Vec::new();
        }
    }

    /// The hidden rows of the last [`forward`](Self::forward) while
    /// [`set_keep_hidden`](Self::set_keep_hidden) is on: one row of
    /// `hidden_size` values per id of the call (every row, whatever
    /// `all_rows`), after `model.norm`: the state the MTP head's `hnorm`
    /// takes (see [`mtp`]). Empty otherwise or after a failed call.
    pub fn last_hidden(&self) -> &[f32] {
        &self.last_hidden
    }

    fn recording(&self) -> bool {
        self.tracing_routes && self.trace.is_some()
    }

    /// Routed-expert pool counters since the model was opened.
    pub fn expert_stats(&self) -> ExpertStats {
        let Some(e) = &self.executor else {
            return ExpertStats::default();
        };
        let t = e.telemetry();
        let total = t.hits + t.misses;
        ExpertStats {
            hits: t.hits,
            misses: t.misses,
            bytes_read: t.bytes_read,
            hit_rate: (total > 0).then(|| t.hits as f64 / total as f64),
            slots: self.slots,
        }
    }

    /// The smallest router and indexer top-k cut gaps of the last forward.
    pub fn last_forward_min_gaps(&self) -> CutGaps {
        self.gaps
    }
}

/// Which logits rows a pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadRows {
    /// None (a prefill pass that is not the last).
    None,
    /// The last row.
    Last,
    /// Every row.
    All,
}

/// `[L, S]` boolean: query `offset + i` sees keys `0..=offset + i`.
fn causal_mask(offset: usize, len: usize) -> Result<Array, MlxError> {
    let end = (offset + len) as f64;
    let rows = mlx::arange(offset as f64, end, 1.0, Dtype::Int32)?.reshape(&[len as i32, 1])?;
    let cols = mlx::arange(0.0, end, 1.0, Dtype::Int32)?.reshape(&[1, (offset + len) as i32])?;
    rows.greater_equal(&cols)
}

/// Refuses configurations the graph cannot run.
fn check_config(c: &Glm52Config) -> Result<(), ModelError> {
    let positive = [
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("q_lora_rank", c.q_lora_rank),
        ("kv_lora_rank", c.kv_lora_rank),
        ("qk_nope_head_dim", c.qk_nope_head_dim),
        ("qk_rope_head_dim", c.qk_rope_head_dim),
        ("v_head_dim", c.v_head_dim),
        ("vocab_size", c.vocab_size),
        ("max_position_embeddings", c.max_position_embeddings),
    ];
    if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(ModelError::UnsupportedConfig(format!(
            "{name} must be positive"
        )));
    }
    if c.qk_rope_head_dim % 2 != 0 {
        return Err(ModelError::UnsupportedConfig(
            "qk_rope_head_dim must be even".into(),
        ));
    }
    let too_big = [
        c.hidden_size,
        c.vocab_size,
        c.num_attention_heads * (c.qk_head_dim() + c.v_head_dim),
    ]
    .iter()
    .any(|&v| v > i32::MAX as usize);
    if too_big {
        return Err(ModelError::UnsupportedConfig(
            "dimensions exceed i32".into(),
        ));
    }
    Ok(())
}

/// The executor over every MoE layer's routed experts (and the MTP layer's
/// with `include_mtp`), and its slot count; `None` without routed experts.
fn expert_executor(
    weights: &ResidentWeights,
    config: &Glm52Config,
    opts: &ModelOptions,
) -> Result<Option<(StreamedExecutor, usize)>, ModelError> {
    let experts = config.n_routed_experts.unwrap_or(0);
    let mut layers: Vec<u32> = (0..config.num_hidden_layers)
        .filter(|&l| config.is_moe_layer(l))
        .map(|l| l as u32)
        .collect();
    if opts.include_mtp {
        if let Some(mtp) = config.mtp_layer_index().filter(|&l| config.is_moe_layer(l)) {
            layers.push(mtp as u32);
        }
    }
    if experts == 0 || layers.is_empty() {
        return Ok(None);
    }
    let top_k = config.num_experts_per_tok.max(1);
    let source = FileExpertSource::from_container(weights.container(), &layers, opts.direct_io)?;
    let layouts = layouts_from_source(&source, &layers, experts as u32)?;
    let slot_bytes = source.max_slot_bytes().max(1);
    let wanted = match opts.ram_budget_bytes {
        Some(budget) => {
            let fit = usize::try_from(budget / slot_bytes as u64).unwrap_or(usize::MAX);
            if fit < top_k {
                tracing::warn!(
                    "expert RAM budget {budget} B holds {fit} slots of {slot_bytes} B; \
                     using {top_k} (one token's experts)"
                );
            }
            fit
        }
        None => DEFAULT_POOL_LAYERS * top_k,
    };
    let slots = wanted.max(top_k).min(layers.len() * experts).max(1);
    let max_layer = layers.iter().copied().max().unwrap_or(0);
    let manager = ResidencyManager::new(
        &SlabConfig::new(slot_bytes, slots),
        PolicyConfig::new(max_layer + 1, experts as u32, slots),
        Arc::new(source),
        Arc::new(DirectUpload),
        opts.io_threads.max(1),
    )?;
    let executor = StreamedExecutor::with_options(
        manager,
        config.hidden_size,
        layouts,
        ExecutorOptions {
            kernel_family: opts.kernel_family,
            ..ExecutorOptions::default()
        },
    )?;
    Ok(Some((executor, slots)))
}

impl crate::generate::LanguageModel for Glm52Model {
    type Cache = ModelCache;
    type Error = ModelError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        Glm52Model::eos_token_ids(self)
    }

    fn new_cache(&self) -> ModelCache {
        Glm52Model::new_cache(self)
    }

    fn cache_len(cache: &ModelCache) -> usize {
        cache.len()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        cache: &mut ModelCache,
        all_rows: bool,
    ) -> Result<Vec<f32>, ModelError> {
        Glm52Model::forward(self, ids, cache, all_rows)
    }

    fn truncate_cache(cache: &mut ModelCache, len: usize) -> bool {
        cache.truncate(len);
        true
    }

    fn io_bytes_read(&self) -> Option<u64> {
        self.executor
            .as_ref()
            .map(|_| self.expert_stats().bytes_read)
    }
}
