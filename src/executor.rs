//! The streamed MoE executor: runs one MoE layer's routed experts out of the
//! slot pool, wave by wave, and composes `Σ_k w_k · expert_k(x) + shared(x)`.
//!
//! For each wave of a [`BatchPlan`] the executor:
//!
//! 1. asks the [`ResidencyManager`] for a lease on the wave's experts. Hits are
//!    reported at once and their SwiGLU is built and submitted
//!    ([`mlx::async_eval`]) while the misses load on the I/O threads; each miss
//!    is built and submitted as it arrives. The caller's shared-expert output
//!    is submitted with the first batch of hits (before any miss is waited on),
//!    so it overlaps the first wave's reads.
//! 2. evaluates the wave's expert outputs together with the wave's
//!    contribution to the per-row accumulator, then calls
//!    [`Lease::release_fenced`](crate::experts::Lease::release_fenced): slots
//!    are given back only after every computation reading them has finished.
//!
//! On any error MLX is synchronized, the lease released (or its slots
//! quarantined when that fails) and the error returned with any cleanup error
//! attached ([`ExecutorError::Cleanup`]).
//!
//! # Kernels
//!
//! Each projection is computed straight from zero-copy views of its slot
//! ([`SlabStore::view`]); see [`ProjectionKernel`] for how a stored format is
//! mapped onto MLX:
//!
//! * **int4** bytes are MLX's affine 4-bit layout (viewed as `uint32 [O, I/8]`)
//!   with `biases = −8 · scales`. Per-row scales are repeated into groups of 64
//!   (or 32) columns; grouped scales with gs 32/64/128 are used as stored;
//!   other multiples of 32 (96, 192, 256) are repeated into groups of 32. All
//!   of these are value-preserving.
//! * **int8** (per row, the MTP layer) uses MLX's 8-bit affine kernel: a signed
//!   byte `q` with scale `s` equals the unsigned byte `q ^ 0x80` with scale `s`
//!   and bias `−128·s`. The xor is applied *in the MLX graph* (one byte-wide
//!   pass over the weight per use) rather than on the slot after load, so slot
//!   bytes stay identical to the file (any other reader of the slot, and the
//!   byte-exact loader tests, stay valid) and no upload step has to know the
//!   format. It is still a quarter of the memory traffic of an f32
//!   dequantization, and keeps the quantized matmul kernel.
//! * Anything else (widths that do not pack into `uint32`, group sizes such as
//!   16 or 48, a partial last group) is dequantized to the compute dtype with
//!   MLX ops and multiplied with a plain matmul ([`ProjectionKernel::Dense`]).
//!
//! # Compose
//!
//! Every expert's output rows are multiplied by their routing weights. After a
//! wave's outputs are built, its contribution is gathered per row (`take` over
//! the concatenated outputs plus one zero row, padded to the most experts any
//! row uses in the wave), summed in rank order and added to the accumulator.
//! The gather indices are built on the host from the plan and checked against
//! their bound before MLX sees them. Everything stays in MLX; nothing is read
//! back to the host.
//!
//! # Fused decode path
//!
//! With [`ExecutorOptions::kernel_family`] `Auto` (the default), `Fused` or
//! `FusedSimt`, a wave of a call with at most
//! [`ExecutorOptions::fused_max_rows`] rows is computed by the fused Q4/Q8
//! kernels ([`crate::kernels::FusedExperts`]) straight from the slot bytes
//! instead (each slot read inside its arena at its offset, so no per-expert
//! view is built): each batch of experts that becomes resident together (all hits at once, then each miss as it lands) is one
//! fused call over every row of `x`, with routing weights `[rows, experts]`
//! that are zero where a row does not use an expert; the call's `[rows,
//! hidden]` output already is the routing-weighted sum, so the wave's
//! contribution is the sum of its calls. Decode (one row, eight experts, all
//! resident) is thus one fused call per layer. The fence is unchanged: the
//! wave's outputs are evaluated before the lease is released.
//!
//! `Auto` resolves to the stock path on a CPU device or a build without a
//! fused backend, for formats the fused kernels do not handle and for larger
//! batches; `Fused` / `FusedSimt` are checked when the executor is built
//! (an error names what is missing) and then used for every wave of at most
//! `fused_max_rows` rows. Larger (prefill) batches always take the stock
//! path. [`ExecutorTelemetry::fused_waves`] counts the waves that ran fused.
//!
//! All MLX work happens on the calling thread (the one driving MLX).

use crate::experts::layout::{Projection, ProjectionFormat, ProjectionLayout};
use crate::experts::{
    ExpertError, FileExpertSource, LeaseEntry, ResidencyManager, SlabStore, SlotLayout,
};
use crate::kernels::{ExpertSlot, FusedExperts, KernelError, KernelFamily, Path};
use crate::mlx::{self, Array, Dtype, MlxError};
use crate::moe::{BatchPlan, ExpertJob, MoeError, Routes};
use std::collections::{BTreeMap, HashMap};

/// An error from the streamed executor. Every variant names the layer, and
/// the expert or wave where one is involved.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The input rows, plan or shared output do not fit together.
    #[error("layer {layer}: {message}")]
    Input { layer: u32, message: String },
    /// No slot layout was registered for an expert the plan routes to.
    #[error("layer {layer} expert {expert}: no slot layout registered")]
    MissingLayout { layer: u32, expert: u32 },
    /// A slot layout that does not describe a SwiGLU expert of this width.
    #[error("layer {layer} expert {expert}: {message}")]
    Layout {
        layer: u32,
        expert: u32,
        message: String,
    },
    /// The routes could not be planned.
    #[error("layer {layer}: planning the batch failed: {source}")]
    Plan { layer: u32, source: MoeError },
    /// The residency manager failed (a load, the pool, a fence).
    #[error("layer {layer}: {source}")]
    Residency { layer: u32, source: ExpertError },
    /// A slot could not be viewed (e.g. a stale handle).
    #[error("layer {layer} expert {expert}: slot view failed: {source}")]
    Slot {
        layer: u32,
        expert: u32,
        source: ExpertError,
    },
    /// Building an expert's computation failed.
    #[error("layer {layer} expert {expert}: {source}")]
    Compute {
        layer: u32,
        expert: u32,
        source: MlxError,
    },
    /// Evaluating or composing a wave failed.
    #[error("layer {layer} wave {wave}: {source}")]
    Wave {
        layer: u32,
        wave: usize,
        source: MlxError,
    },
    /// The requested kernel family cannot run this executor's experts (e.g.
    /// `Fused` on a CPU device, in a build without a fused backend, or for a
    /// format the fused kernels do not handle).
    #[error("layer {layer}: kernel family {family:?}: {source}")]
    KernelSetup {
        layer: u32,
        family: KernelFamily,
        source: KernelError,
    },
    /// A fused expert computation failed.
    #[error("layer {layer} wave {wave}: fused experts: {source}")]
    Kernel {
        layer: u32,
        wave: usize,
        source: KernelError,
    },
    /// An operation failed and releasing its lease failed too; the lease's
    /// slots are quarantined (never reused) rather than risked.
    #[error("{error}; cleanup also failed: {cleanup}")]
    Cleanup {
        error: Box<ExecutorError>,
        cleanup: Box<ExpertError>,
    },
}

/// Result alias for this module.
pub type Result<T, E = ExecutorError> = std::result::Result<T, E>;

/// How one projection is multiplied from its slot bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionKernel {
    /// MLX affine `quantized_matmul` with `bits` and MLX group size
    /// `group_size`; each stored scale is repeated `repeat` times along the
    /// row to reach that group size (1: used as stored).
    Affine {
        /// 4 or 8.
        bits: i32,
        /// 32, 64 or 128.
        group_size: i32,
        /// Copies of each stored scale.
        repeat: i32,
    },
    /// Dequantize to the compute dtype with MLX ops, then a float matmul.
    Dense,
}

impl ProjectionKernel {
    /// The kernel for a stored format (see the module docs for the rules).
    pub fn for_format(f: &ProjectionFormat) -> Self {
        let cols = f.cols;
        let packs = match f.bits {
            4 => cols % 8 == 0,
            8 => cols % 4 == 0,
            _ => false,
        };
        if !packs || cols == 0 || f.rows == 0 || cols > i32::MAX as usize {
            return Self::Dense;
        }
        let bits = i32::from(f.bits);
        let affine = |group_size: usize, repeat: usize| Self::Affine {
            bits,
            group_size: group_size as i32,
            repeat: repeat as i32,
        };
        // Per-row scales repeat into the widest group that divides the row.
        // For int8 that includes 128: MLX 0.32.4's CUDA backend has no 8-bit
        // float32 kernel for group 64 at one row ("No implementation for
        // problem shape 1x2048x6144x1", H200), while the resident view's
        // group-128 int8 projections of the same shape run there.
        let per_row_groups: &[usize] = if f.bits == 8 {
            &[128, 64, 32]
        } else {
            &[64, 32]
        };
        match f.group_size.map(|g| g as usize) {
            None => per_row_groups
                .iter()
                .copied()
                .find(|g| cols % g == 0)
                .map_or(Self::Dense, |g| affine(g, cols / g)),
            Some(gs) if f.bits == 4 && gs > 0 && cols % gs == 0 => {
                if [32, 64, 128].contains(&gs) {
                    affine(gs, 1)
                } else if gs % 32 == 0 {
                    affine(32, gs / 32)
                } else {
                    Self::Dense
                }
            }
            Some(_) => Self::Dense,
        }
    }
}

/// One expert's slot layout with the kernels chosen for it.
#[derive(Debug, Clone)]
struct ExpertSpec {
    projections: [ProjectionLayout; 3],
    kernels: [ProjectionKernel; 3],
    data_bytes: u64,
}

/// How a [`StreamedExecutor`] computes its experts (see the module docs,
/// "Fused decode path").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// Stock MLX matmuls, the fused kernels, or the fused kernels where they
    /// can run (`Auto`, the default).
    pub kernel_family: KernelFamily,
    /// Calls with more rows than this always take the stock path.
    pub fused_max_rows: usize,
}

impl Default for ExecutorOptions {
    fn default() -> Self {
        Self {
            kernel_family: KernelFamily::Auto,
            fused_max_rows: crate::kernels::select::AUTO_MAX_ROWS,
        }
    }
}

/// Counters of the executor (cumulative since creation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecutorTelemetry {
    /// Successful [`StreamedExecutor::forward`] calls.
    pub calls: u64,
    /// Waves run to completion.
    pub waves: u64,
    /// Expert computations (one per expert per wave).
    pub experts_computed: u64,
    /// Σ over computed experts of the rows routed to them.
    pub expert_rows: u64,
    /// Experts that were already resident when their wave was leased.
    pub hits: u64,
    /// Experts loaded from storage for their wave.
    pub misses: u64,
    /// Bytes the loads of this executor's calls read from storage.
    pub bytes_read: u64,
    /// Expert tensor bytes the computations read from slots.
    pub weight_bytes: u64,
    /// Waves computed by the fused kernels (the rest took the stock path).
    pub fused_waves: u64,
}

/// Runs MoE layers with routed experts streamed through a [`ResidencyManager`].
pub struct StreamedExecutor {
    manager: ResidencyManager,
    hidden: usize,
    specs: HashMap<(u32, u32), ExpertSpec>,
    telemetry: ExecutorTelemetry,
    options: ExecutorOptions,
    kernels: FusedExperts,
}

/// The slot layouts of `experts` experts of each of `layers` in `source`
/// (for [`StreamedExecutor::new`]). Fails naming the first missing one.
pub fn layouts_from_source(
    source: &FileExpertSource,
    layers: &[u32],
    experts: u32,
) -> Result<Vec<((u32, u32), SlotLayout)>> {
    let mut out = Vec::with_capacity(layers.len() * experts as usize);
    for &layer in layers {
        for expert in 0..experts {
            let l = source
                .layout(layer, expert)
                .ok_or(ExecutorError::MissingLayout { layer, expert })?;
            out.push(((layer, expert), l.clone()));
        }
    }
    Ok(out)
}

impl StreamedExecutor {
    /// An executor over `manager` for experts of model width `hidden`, with
    /// the slot layout of every expert it may run. Each layout is checked to
    /// be a SwiGLU expert (`gate`/`up` `[inter, hidden]`, `down`
    /// `[hidden, inter]`) that fits the manager's slots. Uses the default
    /// [`ExecutorOptions`] (kernel family `Auto`).
    pub fn new(
        manager: ResidencyManager,
        hidden: usize,
        layouts: impl IntoIterator<Item = ((u32, u32), SlotLayout)>,
    ) -> Result<Self> {
        Self::with_options(manager, hidden, layouts, ExecutorOptions::default())
    }

    /// [`StreamedExecutor::new`] with explicit options. With kernel family
    /// `Fused` this fails ([`ExecutorError::KernelSetup`]) unless the fused
    /// kernels can run every registered layer's experts here.
    pub fn with_options(
        manager: ResidencyManager,
        hidden: usize,
        layouts: impl IntoIterator<Item = ((u32, u32), SlotLayout)>,
        options: ExecutorOptions,
    ) -> Result<Self> {
        let slot_bytes = manager.store().slot_bytes();
        let mut specs = HashMap::new();
        for ((layer, expert), layout) in layouts {
            let bad = |message: String| ExecutorError::Layout {
                layer,
                expert,
                message,
            };
            let [g, u, d] = layout.projections.map(|p| p.format);
            let inter = g.rows;
            if g.cols != hidden || u.cols != hidden || u.rows != inter {
                return Err(bad(format!(
                    "gate [{}, {}] / up [{}, {}] do not match hidden {hidden}",
                    g.rows, g.cols, u.rows, u.cols
                )));
            }
            if d.rows != hidden || d.cols != inter || inter == 0 {
                return Err(bad(format!(
                    "down [{}, {}] does not match [{hidden}, {inter}]",
                    d.rows, d.cols
                )));
            }
            if hidden > i32::MAX as usize || inter > i32::MAX as usize {
                return Err(bad("dimensions exceed i32".into()));
            }
            if layout.slot_bytes > slot_bytes {
                return Err(bad(format!(
                    "needs {} slot bytes, slots hold {slot_bytes}",
                    layout.slot_bytes
                )));
            }
            for p in &layout.projections {
                if p.scale_offset % 4 != 0 || p.weight_offset % 4 != 0 {
                    return Err(bad(format!(
                        "weight offset {} / scale offset {} are not 4-byte aligned",
                        p.weight_offset, p.scale_offset
                    )));
                }
            }
            specs.insert(
                (layer, expert),
                ExpertSpec {
                    projections: layout.projections,
                    kernels: layout
                        .projections
                        .map(|p| ProjectionKernel::for_format(&p.format)),
                    data_bytes: layout.data_bytes,
                },
            );
        }
        let kernels = kernels_for(&specs, options)?;
        Ok(Self {
            manager,
            hidden,
            specs,
            telemetry: ExecutorTelemetry::default(),
            options,
            kernels,
        })
    }

    /// The options in force.
    pub fn options(&self) -> ExecutorOptions {
        self.options
    }

    /// Replaces the options (e.g. to pin a kernel family in a bench). Checked
    /// as in [`StreamedExecutor::with_options`]; on error nothing changes.
    pub fn set_options(&mut self, options: ExecutorOptions) -> Result<()> {
        self.kernels = kernels_for(&self.specs, options)?;
        self.options = options;
        Ok(())
    }

    /// The path a wave of `layer` over `experts` would take for a call with
    /// `rows` rows: [`Path::Stock`] or [`Path::Fused`], or why `Fused` cannot
    /// run it.
    pub fn wave_path(&self, layer: u32, experts: &[u32], rows: usize) -> Result<Path> {
        if rows > self.options.fused_max_rows || experts.is_empty() {
            return Ok(Path::Stock);
        }
        let mut layouts = Vec::with_capacity(experts.len());
        for &expert in experts {
            let spec = self
                .specs
                .get(&(layer, expert))
                .ok_or(ExecutorError::MissingLayout { layer, expert })?;
            layouts.push(spec.projections);
        }
        self.kernels
            .path_for_layouts(rows, &layouts)
            .map_err(|source| ExecutorError::KernelSetup {
                layer,
                family: self.options.kernel_family,
                source,
            })
    }

    /// The residency manager (telemetry, budget, usage history).
    pub fn manager(&self) -> &ResidencyManager {
        &self.manager
    }

    /// The model width.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The kernels chosen for `(layer, expert)` (gate, up, down).
    pub fn kernels(&self, layer: u32, expert: u32) -> Option<[ProjectionKernel; 3]> {
        self.specs.get(&(layer, expert)).map(|s| s.kernels)
    }

    /// Experts one wave may hold: the pool's current budget in slots.
    pub fn wave_capacity(&self) -> Result<usize, ExpertError> {
        self.manager.with_policy(|p| Ok(p.budget()))
    }

    /// Counters so far.
    pub fn telemetry(&self) -> &ExecutorTelemetry {
        &self.telemetry
    }

    /// Plans `routes` into waves of [`StreamedExecutor::wave_capacity`] and runs
    /// [`StreamedExecutor::forward`].
    pub fn forward_routes(
        &mut self,
        layer: u32,
        x: &Array,
        routes: Routes,
        n_experts: u32,
        shared: Option<&Array>,
    ) -> Result<Array> {
        let capacity = self
            .wave_capacity()
            .map_err(|source| ExecutorError::Residency { layer, source })?;
        let plan = BatchPlan::new(routes, n_experts, capacity)
            .map_err(|source| ExecutorError::Plan { layer, source })?;
        self.forward(layer, x, &plan, shared)
    }

    /// Computes `out[r] = Σ_k w[r,k] · down(silu(gate·x[r]) ⊙ up·x[r]) + shared[r]`
    /// for the routed experts of `plan` of `layer`. `x` is `[rows, hidden]`
    /// (a float dtype; the computation runs in it), `shared` the caller's
    /// shared-expert output of the same shape. Returns the evaluated
    /// `[rows, hidden]` output.
    pub fn forward(
        &mut self,
        layer: u32,
        x: &Array,
        plan: &BatchPlan,
        shared: Option<&Array>,
    ) -> Result<Array> {
        let rows = self.check_inputs(layer, x, plan, shared)?;
        let routes = plan.routes();
        for row in 0..rows {
            self.manager
                .record_routes(layer, routes.ids(row))
                .map_err(|source| ExecutorError::Residency { layer, source })?;
        }
        let bytes_before = self.bytes_read(layer)?;
        let dtype = x.dtype();
        let mut shared_pending = shared;
        let mut acc: Option<Array> = None;
        let mut stats = ExecutorTelemetry::default();
        for (wave_index, wave) in plan.waves().enumerate() {
            let a = self.run_wave(
                layer,
                wave_index,
                wave,
                x,
                routes,
                &mut shared_pending,
                acc.as_ref(),
                &mut stats,
            )?;
            acc = Some(a);
        }
        let wave_err = |source| ExecutorError::Wave {
            layer,
            wave: plan.wave_count(),
            source,
        };
        let out = match (acc, shared) {
            (Some(a), Some(s)) => a.add(s).map_err(wave_err)?,
            (Some(a), None) => a,
            (None, Some(s)) => s.copy().map_err(wave_err)?,
            (None, None) => {
                mlx::zeros(&[rows as i32, self.hidden as i32], dtype).map_err(wave_err)?
            }
        };
        out.eval().map_err(wave_err)?;
        stats.bytes_read = self.bytes_read(layer)?.saturating_sub(bytes_before);
        let t = &mut self.telemetry;
        t.calls += 1;
        t.waves += stats.waves;
        t.experts_computed += stats.experts_computed;
        t.expert_rows += stats.expert_rows;
        t.hits += stats.hits;
        t.misses += stats.misses;
        t.bytes_read += stats.bytes_read;
        t.weight_bytes += stats.weight_bytes;
        t.fused_waves += stats.fused_waves;
        Ok(out)
    }

    fn bytes_read(&self, layer: u32) -> Result<u64> {
        self.manager
            .telemetry()
            .map(|t| t.bytes_read)
            .map_err(|source| ExecutorError::Residency { layer, source })
    }

    /// Validates shapes, dtypes and that every routed expert has a layout.
    /// Returns the row count.
    fn check_inputs(
        &self,
        layer: u32,
        x: &Array,
        plan: &BatchPlan,
        shared: Option<&Array>,
    ) -> Result<usize> {
        let bad = |message: String| ExecutorError::Input { layer, message };
        let shape = x.shape();
        if shape.len() != 2 || shape[1] as usize != self.hidden {
            return Err(bad(format!(
                "x has shape {shape:?}, expected [rows, {}]",
                self.hidden
            )));
        }
        if !x.dtype().is_float() {
            return Err(bad(format!(
                "x has dtype {:?}, expected a float",
                x.dtype()
            )));
        }
        let rows = shape[0] as usize;
        if plan.routes().rows() != rows {
            return Err(bad(format!(
                "the plan routes {} rows, x has {rows}",
                plan.routes().rows()
            )));
        }
        if let Some(s) = shared {
            if s.shape() != shape || s.dtype() != x.dtype() {
                return Err(bad(format!(
                    "shared output is {:?} {:?}, expected {shape:?} {:?}",
                    s.shape(),
                    s.dtype(),
                    x.dtype()
                )));
            }
        }
        for job in plan.jobs() {
            if !self.specs.contains_key(&(layer, job.expert)) {
                return Err(ExecutorError::MissingLayout {
                    layer,
                    expert: job.expert,
                });
            }
            if job.rows.len() != job.ranks.len()
                || job.rows.iter().any(|&r| r as usize >= rows)
                || job
                    .ranks
                    .iter()
                    .any(|&k| k as usize >= plan.routes().top_k())
            {
                return Err(bad(format!(
                    "expert {}: job rows/ranks out of range for {rows} rows × top-{}",
                    job.expert,
                    plan.routes().top_k()
                )));
            }
        }
        Ok(rows)
    }

    /// Runs one wave and returns the accumulator with its contribution added.
    #[allow(clippy::too_many_arguments)]
    fn run_wave(
        &mut self,
        layer: u32,
        wave_index: usize,
        wave: &[ExpertJob],
        x: &Array,
        routes: &Routes,
        shared_pending: &mut Option<&Array>,
        acc: Option<&Array>,
        stats: &mut ExecutorTelemetry,
    ) -> Result<Array> {
        let ids: Vec<u32> = wave.iter().map(|j| j.expert).collect();
        let rows = routes.rows();
        let fused = match self.wave_path(layer, &ids, rows) {
            Ok(Path::Fused(_)) => true,
            Ok(Path::Stock) => false,
            Err(ExecutorError::KernelSetup { source, .. }) => {
                return Err(ExecutorError::Kernel {
                    layer,
                    wave: wave_index,
                    source,
                });
            }
            Err(e) => return Err(e),
        };
        // Stock: one output per job (its rows, weighted). Fused: one `[rows,
        // hidden]` weighted sum per batch of experts that became resident
        // together.
        let mut outputs: Vec<Option<Array>> = vec![None; wave.len()];
        let mut groups: Vec<Array> = Vec::new();
        let mut computed = vec![false; wave.len()];
        let mut failure: Option<ExecutorError> = None;
        let specs = &self.specs;
        let kernels = &self.kernels;
        let acquired = self.manager.acquire(layer, &ids, |store, ready| {
            let submitted = (|| {
                let mut built = Vec::with_capacity(ready.len() + 1);
                let mut batch = Vec::with_capacity(ready.len());
                for entry in ready {
                    let i = ids.iter().position(|&e| e == entry.expert).ok_or(
                        ExecutorError::Input {
                            layer,
                            message: format!("expert {} was not requested", entry.expert),
                        },
                    )?;
                    let spec =
                        specs
                            .get(&(layer, entry.expert))
                            .ok_or(ExecutorError::MissingLayout {
                                layer,
                                expert: entry.expert,
                            })?;
                    if fused {
                        batch.push((i, entry, spec));
                    } else {
                        let y =
                            expert_output(store, layer, entry, spec, &wave[i], x, routes, rows)?;
                        outputs[i] = Some(y);
                        built.push(i);
                    }
                    computed[i] = true;
                }
                if !batch.is_empty() {
                    let y =
                        fused_group(kernels, store, layer, wave_index, &batch, wave, x, routes)?;
                    groups.push(y);
                }
                let mut submit: Vec<&Array> =
                    built.iter().filter_map(|&i| outputs[i].as_ref()).collect();
                if !batch.is_empty() {
                    submit.extend(groups.last());
                }
                if let Some(s) = shared_pending.take() {
                    submit.push(s);
                }
                if !submit.is_empty() {
                    mlx::async_eval(&submit).map_err(|source| ExecutorError::Wave {
                        layer,
                        wave: wave_index,
                        source,
                    })?;
                }
                Ok::<(), ExecutorError>(())
            })();
            submitted.map_err(|e| {
                let placeholder = MlxError::InvalidArgument {
                    op: "streamed executor",
                    message: e.to_string(),
                };
                failure = Some(e);
                placeholder
            })
        });
        let lease = match acquired {
            Ok(lease) => lease,
            Err(e) => return Err(acquire_error(layer, failure, e)),
        };
        let entries: Vec<LeaseEntry> = lease.entries().to_vec();
        let finished = (|| {
            let wave_err = |source| ExecutorError::Wave {
                layer,
                wave: wave_index,
                source,
            };
            if let Some((job, _)) = wave.iter().zip(&computed).find(|(_, done)| !**done) {
                return Err(ExecutorError::Input {
                    layer,
                    message: format!(
                        "wave {wave_index}: expert {} never became resident",
                        job.expert
                    ),
                });
            }
            let (part, mut fence) = if fused {
                let mut sum: Option<Array> = None;
                for g in &groups {
                    sum = Some(match sum {
                        Some(s) => s.add(g).map_err(wave_err)?,
                        None => g.clone(),
                    });
                }
                let part = match sum {
                    Some(s) => s,
                    None => mlx::zeros(&[rows as i32, self.hidden as i32], x.dtype())
                        .map_err(wave_err)?,
                };
                (part, groups.iter().collect::<Vec<_>>())
            } else {
                let outs: Vec<&Array> = outputs.iter().flatten().collect();
                let part =
                    compose_wave(wave, &outs, rows, self.hidden, x.dtype()).map_err(wave_err)?;
                (part, outs)
            };
            let next = match acc {
                Some(a) => a.add(&part).map_err(wave_err)?,
                None => part,
            };
            fence.push(&next);
            mlx::eval(&fence).map_err(wave_err)?;
            Ok(next)
        })();
        let released = lease.release_fenced();
        match (finished, released) {
            (Ok(next), Ok(())) => {
                stats.waves += 1;
                stats.fused_waves += u64::from(fused);
                stats.experts_computed += wave.len() as u64;
                stats.expert_rows += wave.iter().map(|j| j.rows.len() as u64).sum::<u64>();
                stats.hits += entries.iter().filter(|e| e.hit).count() as u64;
                stats.misses += entries.iter().filter(|e| !e.hit).count() as u64;
                stats.weight_bytes += ids
                    .iter()
                    .filter_map(|e| self.specs.get(&(layer, *e)))
                    .map(|s| s.data_bytes)
                    .sum::<u64>();
                Ok(next)
            }
            (Ok(_), Err(cleanup)) => Err(ExecutorError::Residency {
                layer,
                source: cleanup,
            }),
            (Err(error), Ok(())) => Err(error),
            (Err(error), Err(cleanup)) => Err(ExecutorError::Cleanup {
                error: Box::new(error),
                cleanup: Box::new(cleanup),
            }),
        }
    }
}

impl std::fmt::Debug for StreamedExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedExecutor")
            .field("hidden", &self.hidden)
            .field("experts", &self.specs.len())
            .field("telemetry", &self.telemetry)
            .field("options", &self.options)
            .finish()
    }
}

/// Maps a failed acquire to the executor's error: the error stashed by the
/// `on_resident` callback wins over the placeholder the manager reports.
fn acquire_error(layer: u32, stashed: Option<ExecutorError>, e: ExpertError) -> ExecutorError {
    match (stashed, e) {
        (Some(error), ExpertError::Cleanup { cleanup, .. }) => ExecutorError::Cleanup {
            error: Box::new(error),
            cleanup,
        },
        (Some(error), _) => error,
        (None, ExpertError::Cleanup { error, cleanup }) => ExecutorError::Cleanup {
            error: Box::new(ExecutorError::Residency {
                layer,
                source: *error,
            }),
            cleanup,
        },
        (None, source) => ExecutorError::Residency { layer, source },
    }
}

/// The [`FusedExperts`] runner for `options`, checked against every layer's
/// experts when the family is `Fused` or `FusedSimt`.
fn kernels_for(
    specs: &HashMap<(u32, u32), ExpertSpec>,
    options: ExecutorOptions,
) -> Result<FusedExperts> {
    let family = options.kernel_family;
    let setup = |layer, source| ExecutorError::KernelSetup {
        layer,
        family,
        source,
    };
    let first_layer = specs.keys().map(|&(l, _)| l).min().unwrap_or(0);
    let kernels = FusedExperts::new(family).map_err(|e| setup(first_layer, e))?;
    if matches!(family, KernelFamily::Fused | KernelFamily::FusedSimt) && options.fused_max_rows > 0
    {
        let mut by_layer: BTreeMap<u32, Vec<[ProjectionLayout; 3]>> = BTreeMap::new();
        for (&(layer, _), spec) in specs {
            by_layer.entry(layer).or_default().push(spec.projections);
        }
        for (layer, layouts) in by_layer {
            kernels
                .path_for_layouts(1, &layouts)
                .map_err(|e| setup(layer, e))?;
        }
    }
    Ok(kernels)
}

/// One fused call over every row of `x` for the experts in `batch` (index
/// in `wave`, lease entry, spec): `Σ_j w[:, j] · SwiGLU_j(x)`, with `w[r, j]`
/// the routing weight of row `r` for the expert, zero where the row does not
/// use it.
#[allow(clippy::too_many_arguments)]
fn fused_group(
    kernels: &FusedExperts,
    store: &SlabStore,
    layer: u32,
    wave_index: usize,
    batch: &[(usize, &LeaseEntry, &ExpertSpec)],
    wave: &[ExpertJob],
    x: &Array,
    routes: &Routes,
) -> Result<Array> {
    let rows = routes.rows();
    let n = batch.len();
    let mut w = vec![0f32; rows * n];
    let mut places = Vec::with_capacity(n);
    for (j, &(i, entry, _)) in batch.iter().enumerate() {
        let expert = entry.expert;
        let job = &wave[i];
        for (&r, &k) in job.rows.iter().zip(&job.ranks) {
            let weight = routes
                .weights(r as usize)
                .get(k as usize)
                .copied()
                .ok_or_else(|| ExecutorError::Input {
                    layer,
                    message: format!("expert {expert}: row {r} has no rank {k}"),
                })?;
            let cell = w
                .get_mut(r as usize * n + j)
                .ok_or_else(|| ExecutorError::Input {
                    layer,
                    message: format!("expert {expert}: row {r} out of range"),
                })?;
            *cell = weight;
        }
        // The kernels read the slot inside its arena: no view per expert.
        let slot_err = |source| ExecutorError::Slot {
            layer,
            expert,
            source,
        };
        store.check(entry.handle).map_err(slot_err)?;
        let (arena, offset) = store.location(entry.handle.slot).map_err(slot_err)?;
        let bytes = store.arena(arena).ok_or_else(|| ExecutorError::Layout {
            layer,
            expert,
            message: format!(
                "slot {} names arena {arena}, which does not exist",
                entry.handle.slot
            ),
        })?;
        places.push((bytes, offset));
    }
    let slots: Vec<ExpertSlot<'_>> = places
        .iter()
        .zip(batch)
        .map(|(&(bytes, offset), (_, _, spec))| ExpertSlot {
            bytes,
            offset,
            projections: &spec.projections,
        })
        .collect();
    let kernel_err = |source| ExecutorError::Kernel {
        layer,
        wave: wave_index,
        source,
    };
    let weights = Array::from_slice(&w, &[rows as i32, n as i32])
        .map_err(|e| kernel_err(KernelError::Mlx(e)))?;
    kernels.forward(x, &slots, &weights).map_err(kernel_err)
}

/// `w ⊙ down(silu(gate·x_e) ⊙ up·x_e)` for the rows of `job`, from the slot.
#[allow(clippy::too_many_arguments)]
fn expert_output(
    store: &SlabStore,
    layer: u32,
    entry: &LeaseEntry,
    spec: &ExpertSpec,
    job: &ExpertJob,
    x: &Array,
    routes: &Routes,
    rows: usize,
) -> Result<Array> {
    let expert = entry.expert;
    let mlx_err = |source| ExecutorError::Compute {
        layer,
        expert,
        source,
    };
    let dtype = x.dtype();
    let index = mlx::checked_indices(&job.rows, rows, "row").map_err(mlx_err)?;
    let xe = x.take(&index, 0).map_err(mlx_err)?;
    let proj = |p: Projection, input: &Array| {
        let i = p as usize;
        projection(
            store,
            layer,
            entry,
            &spec.projections[i],
            spec.kernels[i],
            input,
            dtype,
        )
    };
    let gate = proj(Projection::Gate, &xe)?;
    let up = proj(Projection::Up, &xe)?;
    let h = gate.silu().and_then(|g| g.multiply(&up)).map_err(mlx_err)?;
    let y = proj(Projection::Down, &h)?;
    let mut w = Vec::with_capacity(job.rows.len());
    for (&r, &k) in job.rows.iter().zip(&job.ranks) {
        let weight = routes
            .weights(r as usize)
            .get(k as usize)
            .copied()
            .ok_or_else(|| ExecutorError::Input {
                layer,
                message: format!("expert {expert}: row {r} has no rank {k}"),
            })?;
        w.push(weight);
    }
    Array::from_slice(&w, &[w.len() as i32, 1])
        .and_then(|w| w.astype(dtype))
        .and_then(|w| y.multiply(&w))
        .map_err(mlx_err)
}

/// `input @ W.T` for one projection of a leased slot.
fn projection(
    store: &SlabStore,
    layer: u32,
    entry: &LeaseEntry,
    p: &ProjectionLayout,
    kernel: ProjectionKernel,
    input: &Array,
    dtype: Dtype,
) -> Result<Array> {
    let expert = entry.expert;
    let f = p.format;
    let (o, i) = (f.rows as i32, f.cols as i32);
    let groups = f
        .group_size
        .map_or(1, |g| f.cols.div_ceil(g as usize).max(1)) as i32;
    let slot_err = |source| ExecutorError::Slot {
        layer,
        expert,
        source,
    };
    let mlx_err = |source| ExecutorError::Compute {
        layer,
        expert,
        source,
    };
    let scales = store
        .view(entry.handle, p.scale_offset, &[o, groups], Dtype::Float32)
        .map_err(slot_err)?;
    let scales = if dtype == Dtype::Float32 {
        scales
    } else {
        scales.astype(dtype).map_err(mlx_err)?
    };
    match kernel {
        ProjectionKernel::Affine {
            bits,
            group_size,
            repeat,
        } => {
            let w = if bits == 4 {
                store
                    .view(entry.handle, p.weight_offset, &[o, i / 8], Dtype::Uint32)
                    .map_err(slot_err)?
            } else {
                let bytes = store
                    .view(entry.handle, p.weight_offset, &[o, i], Dtype::Uint8)
                    .map_err(slot_err)?;
                Array::scalar_int(0x80, Dtype::Uint8)
                    .and_then(|m| bytes.bitwise_xor(&m))
                    .and_then(|u| u.view(Dtype::Uint32))
                    .map_err(mlx_err)?
            };
            let s = if repeat > 1 {
                scales.repeat(repeat, 1).map_err(mlx_err)?
            } else {
                scales
            };
            let zero_point = if bits == 4 { -8.0 } else { -128.0 };
            let b = s.multiply_scalar(zero_point).map_err(mlx_err)?;
            mlx::quantized_matmul(input, &w, &s, Some(&b), true, group_size, bits).map_err(mlx_err)
        }
        ProjectionKernel::Dense => {
            let w = dense_weight(store, entry, p, &scales, dtype).map_err(|e| match e {
                DenseError::Slot(s) => slot_err(s),
                DenseError::Mlx(m) => mlx_err(m),
            })?;
            w.t().and_then(|wt| input.matmul(&wt)).map_err(mlx_err)
        }
    }
}

enum DenseError {
    Slot(ExpertError),
    Mlx(MlxError),
}

impl From<MlxError> for DenseError {
    fn from(e: MlxError) -> Self {
        Self::Mlx(e)
    }
}

/// The dequantized `[O, I]` weight of a projection, built with MLX ops.
fn dense_weight(
    store: &SlabStore,
    entry: &LeaseEntry,
    p: &ProjectionLayout,
    scales: &Array,
    dtype: Dtype,
) -> Result<Array, DenseError> {
    let f = &p.format;
    let (o, i) = (f.rows as i32, f.cols as i32);
    let (shape, packed_dtype) = if f.bits == 4 {
        ([o, f.cols.div_ceil(2) as i32], Dtype::Uint8)
    } else {
        ([o, i], Dtype::Int8)
    };
    let packed = store
        .view(entry.handle, p.weight_offset, &shape, packed_dtype)
        .map_err(DenseError::Slot)?;
    Ok(crate::kernels::stock::dequantize_packed(
        &packed, f, scales, dtype,
    )?)
}

/// One wave's contribution `Σ_k w_k · y_k` per row (zero for rows the wave
/// does not serve), summed in rank order. `outs[j]` holds the weighted rows of
/// `wave[j]`, in the job's row order.
fn compose_wave(
    wave: &[ExpertJob],
    outs: &[&Array],
    rows: usize,
    hidden: usize,
    dtype: Dtype,
) -> mlx::Result<Array> {
    let mut per_row: Vec<Vec<(u32, u32)>> = vec![Vec::new(); rows];
    let mut total = 0u32;
    for job in wave {
        for (&r, &k) in job.rows.iter().zip(&job.ranks) {
            if let Some(list) = per_row.get_mut(r as usize) {
                list.push((k, total));
            }
            total += 1;
        }
    }
    let width = per_row.iter().map(Vec::len).max().unwrap_or(0);
    if width == 0 {
        return mlx::zeros(&[rows as i32, hidden as i32], dtype);
    }
    let zero = mlx::zeros(&[1, hidden as i32], dtype)?;
    let mut parts: Vec<&Array> = outs.to_vec();
    parts.push(&zero);
    let all = mlx::concatenate(&parts, 0)?;
    let mut index = Vec::with_capacity(rows * width);
    for list in &mut per_row {
        list.sort_unstable();
        index.extend((0..width).map(|s| list.get(s).map_or(total, |&(_, i)| i)));
    }
    let index = mlx::checked_indices(&index, total as usize + 1, "expert output row")?;
    all.take(&index, 0)?
        .reshape(&[rows as i32, width as i32, hidden as i32])?
        .sum(&[1], false)
}
