//! Fused Q4/Q8 SwiGLU expert kernels over slot bytes, with the stock MLX
//! path beside them.
//!
//! [`FusedExperts::forward`] computes, for input rows `x` (`[M, H]`) and `E`
//! experts that live in slot memory,
//!
//! ```text
//! y[m] = Σ_e w[m, e] · down_e( silu(gate_e · x[m]) ⊙ (up_e · x[m]) )
//! ```
//!
//! returning `[M, H]` in `x`'s dtype. Each expert is given as its slot's
//! bytes (a 1-D `uint8` array, e.g. `SlabStore::view(handle, 0,
//! &[slot_bytes], Dtype::Uint8)`) and the slot layout's three
//! [`ProjectionLayout`]s; the routing weights are an `[M, E]` array (zero
//! where a row does not use an expert). A single expert's SwiGLU is the same
//! call with `E = 1` and `w = 1`.
//!
//! # Paths
//!
//! * **Stock** ([`Path::Stock`]): per expert and projection, MLX
//!   `quantized_matmul` on zero-copy views of the slot bytes (int4 as
//!   `uint32 [O, I/8]` with biases `−8·scales`, int8 via `xor 0x80` and 8-bit
//!   affine, exactly as the streamed executor does), then the weighted sum.
//! * **Fused** ([`Path::Fused`]): two custom kernels per call. K1 runs
//!   gate and up of all experts in one launch (one expert per `blockIdx.y`)
//!   and writes `h = silu(g)·u` (f32 `[E, M, I]`); K2 runs one expert per
//!   `blockIdx.y`, stages that expert's `h` and writes its routing-weighted
//!   down projection (`[E, M, H]`), summed over experts in expert order (by
//!   the tensor-core K2's last block per row range, or by MLX after the
//!   CUDA-core K2): no atomics, so results do not depend on scheduling.
//!   Weights stream in 16-byte
//!   chunks (`ld.global.nc`, not kept in L1) and each weight is decoded once
//!   for all M rows. Two designs ([`FusedKernel`]):
//!   - **tensor cores** (CUDA, int4; `swiglu_mma_*.cu`): `mma.sync`
//!     m16n8k16 with the nibbles turned into exact bf16 `n − 8` (two per
//!     `lop3` + `fma.bf16x2`), the activations split into bf16 `hi + lo`
//!     (16 significant bits, exact for bf16 inputs) and f32 accumulation;
//!     each lane applies its own 32 columns' group scale to the MMA result.
//!     K1 gives each warp 8 intermediate rows (MMA rows 0–7 gate, 8–15 up),
//!     K2 16 output rows.
//!   - **CUDA cores** (`swiglu_gate_up.cu`, `swiglu_down.cu`; int4 and
//!     int8): nibbles / bytes decoded to f32 and FMA'd per lane, `x` staged
//!     as float4s; rows per warp and chunks per step from [`FusedTuning`].
//!     Int8 (MTP) experts always take this design.
//!
//!   Accumulation is f32; int4 is `(n − 8)·scale` (group scales per 32- or
//!   128-column piece, per-row scales at the end), int8 `q·scale` per row.
//!   The CUDA sources are compiled by MLX (NVRTC) on first use, or, opted
//!   into with `GLM_STREAM_NVRTC`, by the crate itself ([`nvrtc`]), and
//!   cached per (design, stage, M, format, dims, launch shape); the expert
//!   count is read from the grid and the slot inputs padded to a power of
//!   two (≥ 8), so wave sizes share kernels. The Metal twin (`*.metal`) follows the
//!   CUDA-core design (K2 summing all experts per threadgroup, no tuning)
//!   and is **untested** (no Mac).
//!
//! [`KernelFamily`] pins a path: `Stock`, `Fused` / `FusedSimt` (an error
//! when this build or device cannot run it, never a silent fallback) or
//! `Auto` (fused on a
//! GPU build with a GPU default device and at most [`select::AUTO_MAX_ROWS`]
//! rows, stock otherwise). See [`select`] for the rules.
//!
//! Requirements of the fused path (checked; `Auto` falls back to stock):
//! gate and up share one format; 4-bit or 8-bit weights; columns a multiple
//! of 32 (int4) or 16 (int8); group sizes multiples of 32 / 16 dividing the
//! columns; weight offsets 16-byte and scale offsets 4-byte aligned in the
//! slot; all experts of a call share one format. The slot byte arrays must
//! start 16-byte aligned (slot views do: slots are 4 KiB aligned).
//!
//! All MLX work happens on the calling thread; like [`Array`],
//! [`FusedExperts`] is neither `Send` nor `Sync`.

mod cuda;
mod fused;
mod metal;
pub mod nvrtc;
pub mod select;
pub(crate) mod stock;

use crate::experts::SlotLayout;
use crate::experts::layout::ProjectionLayout;
use crate::mlx::{Array, Dtype, KernelBackend, MlxError};

pub use fused::{FusedKernel, FusedTuning, compile_cuda_kernels};
pub use select::{Environment, FusedGeometry, Path};

/// An error from the expert kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// `Fused` was requested but this build or device cannot run it.
    #[error("fused expert kernels unavailable: {reason}")]
    FusedUnavailable {
        /// What is missing.
        reason: String,
    },
    /// `Fused` was requested for a problem the kernels do not handle.
    #[error("the fused expert kernels cannot run this call: {reason}")]
    Unsupported {
        /// Which requirement failed.
        reason: String,
    },
    /// The inputs do not fit together.
    #[error("expert kernels: {0}")]
    Input(String),
    /// MLX failed (graph construction or kernel compilation).
    #[error(transparent)]
    Mlx(#[from] MlxError),
    /// Compiling a CUDA kernel with NVRTC failed.
    #[error(transparent)]
    Nvrtc(#[from] nvrtc::NvrtcError),
}

/// Result alias for this module.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// Which implementation [`FusedExperts`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KernelFamily {
    /// MLX `quantized_matmul` per expert and projection (always available).
    Stock,
    /// The fused kernels (on CUDA the tensor-core ones for int4 experts);
    /// calls fail when they cannot run.
    Fused,
    /// The fused kernels without tensor cores (the CUDA-core design the
    /// Metal twin follows; the same as `Fused` on Metal and for int8): for
    /// benches and comparisons.
    FusedSimt,
    /// Fused where available and suitable (GPU, few rows), else stock.
    #[default]
    Auto,
}

impl std::str::FromStr for KernelFamily {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "stock" => Ok(Self::Stock),
            "fused" => Ok(Self::Fused),
            "fused-simt" => Ok(Self::FusedSimt),
            "auto" => Ok(Self::Auto),
            other => Err(KernelError::Input(format!(
                "unknown kernel family `{other}` (stock, fused, fused-simt, auto)"
            ))),
        }
    }
}

/// One expert of a call: the bytes holding its slot and where its
/// projections sit.
#[derive(Debug, Clone, Copy)]
pub struct ExpertSlot<'a> {
    /// A 1-D `uint8` array holding the slot: the slot's own view, or the
    /// whole arena it lives in (no view per expert to build; experts of one
    /// arena share one kernel input).
    pub bytes: &'a Array,
    /// Byte offset of the slot in `bytes` (16-byte aligned; 0 for a slot
    /// view).
    pub offset: usize,
    /// Gate, up, down (a [`SlotLayout`]'s `projections`), relative to the
    /// slot.
    pub projections: &'a [ProjectionLayout; 3],
}

impl<'a> ExpertSlot<'a> {
    /// The expert in `bytes` (its slot's view) laid out as `layout`.
    pub fn new(bytes: &'a Array, layout: &'a SlotLayout) -> Self {
        Self::in_arena(bytes, 0, layout)
    }

    /// The expert whose slot starts `offset` bytes into `arena` (e.g.
    /// [`SlabStore::arena`](crate::experts::SlabStore::arena) and
    /// [`SlabStore::location`](crate::experts::SlabStore::location)).
    pub fn in_arena(arena: &'a Array, offset: usize, layout: &'a SlotLayout) -> Self {
        Self {
            bytes: arena,
            offset,
            projections: &layout.projections,
        }
    }
}

/// Runs routed SwiGLU experts straight from slot bytes, on the stock or the
/// fused path (see the module docs). Compiled kernels are cached inside.
pub struct FusedExperts {
    family: KernelFamily,
    environment: Environment,
    kernels: fused::Compiler,
    tuning: Option<FusedTuning>,
}

impl FusedExperts {
    /// A runner for `family` in the current environment. `Fused` fails here
    /// when the build has no fused backend (the `cuda` feature on Linux, the
    /// `metal` feature on macOS); a CPU default device is reported by the
    /// first call, since the device can still change.
    pub fn new(family: KernelFamily) -> Result<Self> {
        Self::with_environment(family, Environment::current())
    }

    /// A runner with an explicit environment (tests; forcing the stock path
    /// off a GPU default device).
    pub fn with_environment(family: KernelFamily, environment: Environment) -> Result<Self> {
        if matches!(family, KernelFamily::Fused | KernelFamily::FusedSimt)
            && environment.fused_backend.is_none()
        {
            return Err(KernelError::FusedUnavailable {
                reason: select::unavailable_reason(),
            });
        }
        Ok(Self {
            family,
            environment,
            kernels: fused::Compiler::new(environment.fused_backend),
            tuning: None,
        })
    }

    /// Pins the CUDA kernels' launch shape (`None`: [`FusedTuning::for_rows`]
    /// per launch). For benches; the Metal kernels ignore it.
    pub fn with_tuning(mut self, tuning: Option<FusedTuning>) -> Result<Self> {
        if let Some(t) = &tuning {
            t.check()?;
        }
        self.tuning = tuning;
        Ok(self)
    }

    /// The pinned launch shape, if any.
    pub fn tuning(&self) -> Option<FusedTuning> {
        self.tuning
    }

    /// How many fused kernels this runner has compiled (one per design,
    /// stage, row count, format and launch shape; not per expert count).
    pub fn compiled_kernels(&self) -> usize {
        self.kernels.len()
    }

    /// Whether this runner compiles its CUDA kernels itself with NVRTC
    /// (opt-in with `GLM_STREAM_NVRTC`; PTX handed to MLX's
    /// `precompiled_cuda_kernel`, see [`nvrtc`]) rather than through MLX's
    /// `cuda_kernel` (the default).
    pub fn compiles_with_nvrtc(&self) -> bool {
        self.kernels.uses_nvrtc()
    }

    /// The requested family.
    pub fn family(&self) -> KernelFamily {
        self.family
    }

    /// The environment decisions are made in.
    pub fn environment(&self) -> Environment {
        self.environment
    }

    /// The path a call with `rows` input rows and these experts would take,
    /// or why `Fused` cannot run it.
    pub fn path(&self, rows: usize, experts: &[ExpertSlot<'_>]) -> Result<Path> {
        let layouts: Vec<[ProjectionLayout; 3]> = experts.iter().map(|e| *e.projections).collect();
        self.path_for_layouts(rows, &layouts)
    }

    /// [`FusedExperts::path`] from the experts' slot layouts alone (gate, up,
    /// down of each), before any slot is viewed.
    pub fn path_for_layouts(&self, rows: usize, layouts: &[[ProjectionLayout; 3]]) -> Result<Path> {
        let geometry = self.geometry(layouts);
        select::select(self.family, &self.environment, rows, &geometry)
    }

    fn geometry(&self, layouts: &[[ProjectionLayout; 3]]) -> Result<FusedGeometry, String> {
        match self.environment.fused_backend {
            Some(b) => FusedGeometry::plan(layouts, select::shared_bytes(b)),
            None => Err(select::unavailable_reason()),
        }
    }

    /// `y[m] = Σ_e weights[m, e] · SwiGLU_e(x[m])`: `x` is `[M, H]` (a float
    /// dtype), `weights` `[M, E]` (a float dtype), one [`ExpertSlot`] per
    /// column of `weights`. Returns the (lazy) `[M, H]` result in `x`'s dtype.
    pub fn forward(&self, x: &Array, experts: &[ExpertSlot<'_>], weights: &Array) -> Result<Array> {
        let (rows, hidden) = check_inputs(x, experts, weights)?;
        if experts.is_empty() || rows == 0 {
            return Ok(crate::mlx::zeros(&[rows as i32, hidden as i32], x.dtype())?);
        }
        let layouts: Vec<[ProjectionLayout; 3]> = experts.iter().map(|e| *e.projections).collect();
        let geometry = self.geometry(&layouts);
        match select::select(self.family, &self.environment, rows, &geometry)? {
            Path::Stock => stock::forward(x, experts, weights),
            Path::Fused(backend) => {
                let geometry = geometry.map_err(|reason| KernelError::Unsupported { reason })?;
                let kind = self.fused_kernel(backend, &geometry);
                fused::forward(
                    &self.kernels,
                    backend,
                    kind,
                    &geometry,
                    self.tuning.as_ref(),
                    x,
                    experts,
                    weights,
                )
            }
        }
    }
}

impl FusedExperts {
    /// The fused design a call on `backend` with `geometry` runs: tensor
    /// cores on CUDA for int4 experts unless `FusedSimt` is pinned.
    pub fn fused_kernel(&self, backend: KernelBackend, geometry: &FusedGeometry) -> FusedKernel {
        if backend == KernelBackend::Cuda
            && geometry.tensor_cores
            && self.family != KernelFamily::FusedSimt
        {
            FusedKernel::TensorCore
        } else {
            FusedKernel::CudaCore
        }
    }
}

impl std::fmt::Debug for FusedExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedExperts")
            .field("family", &self.family)
            .field("environment", &self.environment)
            .field("tuning", &self.tuning)
            .field("cached_kernels", &self.kernels.len())
            .field("nvrtc", &self.kernels.uses_nvrtc())
            .finish()
    }
}

/// Checks shapes and dtypes; returns `(M, H)`.
fn check_inputs(x: &Array, experts: &[ExpertSlot<'_>], weights: &Array) -> Result<(usize, usize)> {
    let bad = |m: String| Err(KernelError::Input(m));
    let xs = x.shape();
    if xs.len() != 2 || !x.dtype().is_float() {
        return bad(format!(
            "x must be a 2-D float array, got {xs:?} {:?}",
            x.dtype()
        ));
    }
    let (rows, hidden) = (xs[0] as usize, xs[1] as usize);
    let ws = weights.shape();
    if ws != [xs[0], experts.len() as i32] || !weights.dtype().is_float() {
        return bad(format!(
            "weights must be a float [{rows}, {}] array, got {ws:?} {:?}",
            experts.len(),
            weights.dtype()
        ));
    }
    for (e, slot) in experts.iter().enumerate() {
        let bs = slot.bytes.shape();
        if bs.len() != 1 || slot.bytes.dtype() != Dtype::Uint8 {
            return bad(format!(
                "expert {e}: slot bytes must be a 1-D uint8 array, got {bs:?} {:?}",
                slot.bytes.dtype()
            ));
        }
        let len = bs[0] as usize;
        if slot.offset % 16 != 0 || slot.offset >= len.max(1) {
            return bad(format!(
                "expert {e}: slot offset {} is not 16-byte aligned inside the {len} bytes",
                slot.offset
            ));
        }
        let [g, u, d] = slot.projections.map(|p| p.format);
        if g.cols != hidden || u.cols != hidden || u.rows != g.rows {
            return bad(format!(
                "expert {e}: gate [{}, {}] / up [{}, {}] do not match hidden {hidden}",
                g.rows, g.cols, u.rows, u.cols
            ));
        }
        if d.rows != hidden || d.cols != g.rows || g.rows == 0 {
            return bad(format!(
                "expert {e}: down [{}, {}] does not match [{hidden}, {}]",
                d.rows, d.cols, g.rows
            ));
        }
        for p in slot.projections {
            let f = &p.format;
            let ends = f
                .weight_bytes()
                .and_then(|w| p.weight_offset.checked_add(w)?.checked_add(slot.offset))
                .zip(
                    f.scale_bytes()
                        .and_then(|s| p.scale_offset.checked_add(s)?.checked_add(slot.offset)),
                );
            match ends {
                Some((we, se)) if we <= len && se <= len => {}
                _ => {
                    return bad(format!(
                        "expert {e}: a projection at weight offset {} / scale offset {} of the \
                         slot at {} runs past the {len} bytes",
                        p.weight_offset, p.scale_offset, slot.offset
                    ));
                }
            }
        }
    }
    Ok((rows, hidden))
}
