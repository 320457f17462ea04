//! Which path a call takes: the stock MLX `quantized_matmul` SwiGLU or the
//! fused kernels, decided from the requested [`KernelFamily`], what this
//! build and libmlx offer ([`Environment`]) and whether the fused kernels
//! can run the problem ([`FusedGeometry::plan`]).
//!
//! Everything here is pure (no MLX calls except [`Environment::current`]),
//! so the rules are tested on CPU with made-up environments.

use crate::experts::layout::{ProjectionFormat, ProjectionLayout};
use crate::mlx::{self, Device, KernelBackend};

use super::{KernelError, KernelFamily};

/// `Auto` uses the fused kernels for at most this many input rows (decode
/// and MTP verification batches); larger batches go to MLX's matmuls. On the
/// H200, since each weight is decoded once for all rows, the tensor-core
/// layer is 5.3× stock at 1 row per single-layer eval and 5.8×, 4.4×, 2.4×
/// at 2, 4, 8 rows with 16 layers per eval (benches/RESULTS.md,
/// `fused_experts`, 2026-11-30 kernels3).
pub const AUTO_MAX_ROWS: usize = 8;
/// Most input rows one fused launch takes (the kernels keep `rows × 8`
/// accumulators per lane in registers); more rows are split into launches.
pub const MAX_ROWS_PER_LAUNCH: usize = 8;
/// Dynamic shared memory the CUDA kernels may use per block (the H100/H200
/// limit is 227 KiB; a margin is kept).
pub const CUDA_SHARED_BYTES: usize = 200 * 1024;
/// Threadgroup memory of a Metal kernel (32 KiB on Apple GPUs).
pub const METAL_SHARED_BYTES: usize = 32 * 1024;

/// What this process can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Environment {
    /// The fused-kernel backend compiled into this build, if any.
    pub fused_backend: Option<KernelBackend>,
    /// Whether MLX's default device is the GPU (a CPU libmlx cannot run
    /// custom kernels).
    pub gpu_default: bool,
}

impl Environment {
    /// The fused backend this build targets: Metal on macOS with the `metal`
    /// feature, CUDA with the `cuda` feature elsewhere, else none.
    pub fn compiled_backend() -> Option<KernelBackend> {
        if cfg!(target_os = "macos") && KernelBackend::Metal.compiled_in() {
            Some(KernelBackend::Metal)
        } else if !cfg!(target_os = "macos") && KernelBackend::Cuda.compiled_in() {
            Some(KernelBackend::Cuda)
        } else {
            None
        }
    }

    /// This build and the loaded libmlx, now.
    pub fn current() -> Self {
        Self {
            fused_backend: Self::compiled_backend(),
            gpu_default: mlx::default_device() == Device::Gpu,
        }
    }
}

/// The path a call runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// MLX `quantized_matmul` per projection and expert, then a weighted sum.
    Stock,
    /// The fused gate/up and down kernels on this backend.
    Fused(KernelBackend),
}

/// The shapes the fused kernels run with, once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedGeometry {
    /// Model width `H` (gate/up columns, down rows).
    pub hidden: usize,
    /// Expert width `I` (gate/up rows, down columns).
    pub inter: usize,
    /// Format of gate and up (identical).
    pub gate_up: ProjectionFormat,
    /// Format of down.
    pub down: ProjectionFormat,
    /// Rows per gate/up launch (≤ [`MAX_ROWS_PER_LAUNCH`], shared-memory bound).
    pub rows_per_launch: usize,
    /// Shared-memory budget of the backend, bytes.
    pub shared_bytes: usize,
    /// Whether the CUDA tensor-core kernels can run these experts (int4
    /// gate, up and down).
    pub tensor_cores: bool,
}

/// Columns one 16-byte chunk holds.
fn chunk_cols(bits: u8) -> usize {
    128 / usize::from(bits)
}

/// Shared-memory floats one input row needs when staged for a matrix with
/// `cols` columns (chunk-transposed, one pad float per chunk column).
pub fn staged_floats(cols: usize, bits: u8) -> usize {
    let cpc = chunk_cols(bits);
    cpc * (cols / cpc + 1)
}

/// Floats the tensor-core kernels stage per input row of `cols` columns
/// (bf16 hi + lo of every column, padded to whole 128-column chunks).
pub fn mma_staged_floats(cols: usize) -> usize {
    cols.div_ceil(128) * 128
}

fn check_format(name: &str, f: &ProjectionFormat) -> Result<(), String> {
    let cpc = match f.bits {
        4 | 8 => chunk_cols(f.bits),
        b => return Err(format!("{name}: {b}-bit weights (only 4 and 8)")),
    };
    if f.cols == 0 || f.rows == 0 || f.cols % cpc != 0 {
        return Err(format!(
            "{name}: {} columns is not a positive multiple of {cpc} ({}-bit chunks)",
            f.cols, f.bits
        ));
    }
    if let Some(g) = f.group_size {
        let g = g as usize;
        if g == 0 || g % cpc != 0 || f.cols % g != 0 {
            return Err(format!(
                "{name}: group size {g} must divide {} columns and be a multiple of {cpc}",
                f.cols
            ));
        }
    }
    Ok(())
}

impl FusedGeometry {
    /// Checks that the fused kernels can run these experts (one entry per
    /// expert) on a backend with `shared_bytes` of shared memory; the error
    /// says why not.
    pub fn plan(experts: &[[ProjectionLayout; 3]], shared_bytes: usize) -> Result<Self, String> {
        let first = experts.first().ok_or("no experts")?;
        let [g, u, d] = first.map(|p| p.format);
        if experts.iter().any(|e| e.map(|p| p.format) != [g, u, d]) {
            return Err("the experts do not share one format".into());
        }
        if g != u {
            return Err(format!("gate {g:?} and up {u:?} differ"));
        }
        check_format("gate/up", &g)?;
        check_format("down", &d)?;
        let (hidden, inter) = (g.cols, g.rows);
        if d.rows != hidden || d.cols != inter {
            return Err(format!(
                "down [{}, {}] does not match [{hidden}, {inter}]",
                d.rows, d.cols
            ));
        }
        if hidden > i32::MAX as usize / 8 || inter > i32::MAX as usize / 8 {
            return Err("dimensions exceed the kernels' 32-bit indexing".into());
        }
        for (e, p) in experts.iter().enumerate() {
            for (i, l) in p.iter().enumerate() {
                if l.weight_offset % 16 != 0 || l.scale_offset % 4 != 0 {
                    return Err(format!(
                        "expert {e} projection {i}: weight offset {} is not 16-byte or scale \
                         offset {} not 4-byte aligned",
                        l.weight_offset, l.scale_offset
                    ));
                }
                if l.weight_offset > i32::MAX as usize || l.scale_offset > i32::MAX as usize {
                    return Err(format!("expert {e}: slot offsets exceed i32"));
                }
            }
        }
        let tensor_cores = g.bits == 4 && d.bits == 4;
        // Staged bytes per input row: the larger of the two designs' needs.
        let per_row = 4 * staged_floats(hidden, g.bits).max(mma_staged_floats(hidden));
        let per_expert_row = 4 * staged_floats(inter, d.bits).max(mma_staged_floats(inter));
        let rows_per_launch = MAX_ROWS_PER_LAUNCH
            .min(shared_bytes / per_row)
            .min(shared_bytes / per_expert_row);
        if rows_per_launch == 0 {
            return Err(format!(
                "one staged row ({} / {} bytes) exceeds {shared_bytes} bytes of shared memory",
                per_row, per_expert_row
            ));
        }
        Ok(Self {
            hidden,
            inter,
            gate_up: g,
            down: d,
            rows_per_launch,
            shared_bytes,
            tensor_cores,
        })
    }

    /// Experts one down launch takes for `rows` rows (their `h` is staged).
    pub fn experts_per_down(&self, rows: usize) -> usize {
        let per = 4 * rows.max(1) * staged_floats(self.inter, self.down.bits);
        (self.shared_bytes / per).max(1)
    }
}

/// Shared memory of `backend`'s kernels.
pub fn shared_bytes(backend: KernelBackend) -> usize {
    match backend {
        KernelBackend::Cuda => CUDA_SHARED_BYTES,
        KernelBackend::Metal => METAL_SHARED_BYTES,
    }
}

/// Decides the path of one call with `rows` input rows. `fused` is the
/// outcome of [`FusedGeometry::plan`] for the call's experts (on the
/// environment's backend). `Stock` always runs stock; `Auto` runs fused when
/// everything allows it and stock otherwise; `Fused` and `FusedSimt` run
/// fused or fail saying why not.
pub fn select(
    family: KernelFamily,
    env: &Environment,
    rows: usize,
    fused: &Result<FusedGeometry, String>,
) -> Result<Path, KernelError> {
    match family {
        KernelFamily::Stock => Ok(Path::Stock),
        KernelFamily::Auto => Ok(match (env.fused_backend, fused) {
            (Some(b), Ok(_)) if env.gpu_default && rows <= AUTO_MAX_ROWS => Path::Fused(b),
            _ => Path::Stock,
        }),
        KernelFamily::Fused | KernelFamily::FusedSimt => {
            let backend = env
                .fused_backend
                .ok_or_else(|| KernelError::FusedUnavailable {
                    reason: unavailable_reason(),
                })?;
            if !env.gpu_default {
                return Err(KernelError::FusedUnavailable {
                    reason: "MLX's default device is the CPU (a CPU libmlx, or the GPU was not \
                             selected); the fused kernels run only on the GPU"
                        .into(),
                });
            }
            match fused {
                Ok(_) => Ok(Path::Fused(backend)),
                Err(reason) => Err(KernelError::Unsupported {
                    reason: reason.clone(),
                }),
            }
        }
    }
}

/// Why this build has no fused backend.
pub fn unavailable_reason() -> String {
    if cfg!(target_os = "macos") {
        "glm-stream was built without the `metal` feature".into()
    } else {
        "glm-stream was built without the `cuda` feature".into()
    }
}
