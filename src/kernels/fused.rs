//! The fused path: builds, caches and launches the two kernels.
//!
//! K1 (gate/up + SwiGLU) takes `x` `[m, H]`, the per-expert slot offsets
//! `[E, 6]` and the `E` slot byte arrays, and writes `h` `[E, m, I]`.
//!
//! K2 (down + weighted sum) differs per backend. CUDA: one block row per
//! expert (`blockIdx.y`), each staging only its expert's `h`, the experts'
//! weighted outputs meeting in the zero-filled `y` `[m, H]` through atomic
//! adds (any number of experts per launch). Metal: every expert in each
//! threadgroup, `h` of up to `E'` experts staged (as many as fit), groups
//! beyond that summed with MLX adds.
//!
//! Rows beyond [`FusedGeometry::rows_per_launch`] are split into launches.
//! The CUDA kernels' rows per warp and chunks per step come from a
//! [`FusedTuning`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::mlx::{
    self, Array, Dtype, Kernel, KernelBackend, KernelSpec, LaunchConfig, OutputSpec, TemplateArg,
};

use super::select::{FusedGeometry, staged_floats};
use super::{ExpertSlot, KernelError, Result};

/// Threads per block / threadgroup: 8 warps (simdgroups) of 32.
const THREADS: i32 = 256;
const WARPS: i32 = THREADS / 32;
/// Intermediate rows per warp in the Metal K1 (gate and up each).
const METAL_GATE_UP_ROWS: u32 = 4;
/// Output rows per warp in the Metal K2.
const METAL_DOWN_ROWS: u32 = 2;

/// Launch shape of the CUDA kernels: rows per warp and 16-byte chunks per
/// lane and step (loads in flight per lane: `2 · rows · unroll` in K1,
/// `rows · unroll` in K2). Each value is 1, 2 or 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedTuning {
    /// K1: intermediate rows per warp (gate and up each).
    pub gate_up_rows: u32,
    /// K1: chunks per lane and step.
    pub gate_up_unroll: u32,
    /// K2: output rows per warp.
    pub down_rows: u32,
    /// K2: chunks per lane and step.
    pub down_unroll: u32,
}

impl FusedTuning {
    /// The default for `rows` input rows, from the H200 sweep of
    /// benches/RESULTS.md (16 layers of 8 GLM-5.2 experts per eval): one row
    /// per warp in K1 at M = 1 (the most blocks), four from M = 3 on (each
    /// decoded weight serves more products); four rows per warp in K2 up to
    /// M = 4, two beyond (registers). Two chunks per step never helped by
    /// more than the noise.
    pub fn for_rows(rows: usize) -> Self {
        let (gate_up_rows, down_rows) = match rows {
            0 | 1 => (1, 4),
            2 => (2, 2),
            3 | 4 => (4, 4),
            _ => (4, 2),
        };
        Self {
            gate_up_rows,
            gate_up_unroll: 1,
            down_rows,
            down_unroll: 1,
        }
    }

    /// Checks every value is 1, 2 or 4.
    pub fn check(&self) -> Result<()> {
        let ok = |v: u32| matches!(v, 1 | 2 | 4);
        if [
            self.gate_up_rows,
            self.gate_up_unroll,
            self.down_rows,
            self.down_unroll,
        ]
        .into_iter()
        .all(ok)
        {
            Ok(())
        } else {
            Err(KernelError::Input(format!(
                "fused tuning {self:?}: every value must be 1, 2 or 4"
            )))
        }
    }
}

/// The kernel texts of one backend.
pub(super) struct KernelSources {
    /// Helpers placed before the kernels.
    pub header: &'static str,
    /// K1's body.
    pub gate_up: &'static str,
    /// K2's body.
    pub down: &'static str,
    /// Declares `slots[EXPERTS]` from the inputs `e0 … e{n-1}`.
    pub slot_prologue: fn(usize) -> String,
}

fn sources(backend: KernelBackend) -> &'static KernelSources {
    match backend {
        KernelBackend::Cuda => &super::cuda::SOURCES,
        KernelBackend::Metal => &super::metal::SOURCES,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Stage {
    GateUp,
    Down,
}

/// Identifies one compiled kernel: the source depends on the stage and the
/// expert count, the dynamic shared memory on the staged sizes; the other
/// parameters are template arguments (part of MLX's own cache key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct KernelKey {
    /// True for Metal, false for CUDA (`KernelBackend` is not `Hash`).
    metal: bool,
    stage: Stage,
    experts: usize,
    shared_bytes: usize,
}

type Cache = RefCell<HashMap<KernelKey, Rc<Kernel>>>;

fn kernel(cache: &Cache, backend: KernelBackend, key: KernelKey) -> Result<Rc<Kernel>> {
    if let Some(k) = cache.borrow().get(&key) {
        return Ok(Rc::clone(k));
    }
    let src = sources(backend);
    let (stage_name, body, first_inputs, output) = match key.stage {
        Stage::GateUp => ("gate_up", src.gate_up, ["x", "offs"].as_slice(), "h"),
        Stage::Down => ("down", src.down, ["h", "wts", "offs"].as_slice(), "y"),
    };
    let name = format!(
        "glm_swiglu_{stage_name}_e{}_s{}",
        key.experts, key.shared_bytes
    );
    let slot_names: Vec<String> = (0..key.experts).map(|e| format!("e{e}")).collect();
    let mut inputs: Vec<&str> = first_inputs.to_vec();
    inputs.extend(slot_names.iter().map(String::as_str));
    let source = format!("{}{}", (src.slot_prologue)(key.experts), body);
    let shared = match backend {
        KernelBackend::Cuda => {
            u32::try_from(key.shared_bytes).map_err(|_| KernelError::Unsupported {
                reason: "shared memory size exceeds u32".into(),
            })?
        }
        KernelBackend::Metal => 0,
    };
    let k = Rc::new(Kernel::new(
        backend,
        &KernelSpec {
            name: &name,
            input_names: &inputs,
            output_names: &[output],
            source: &source,
            header: src.header,
            ensure_row_contiguous: true,
            shared_memory: shared,
        },
    )?);
    cache.borrow_mut().insert(key, Rc::clone(&k));
    Ok(k)
}

fn int(name: &str, v: usize) -> Result<(String, TemplateArg)> {
    let v = i32::try_from(v).map_err(|_| KernelError::Unsupported {
        reason: format!("{name} = {v} exceeds i32"),
    })?;
    Ok((name.to_string(), TemplateArg::Int(v)))
}

/// Template arguments shared by both stages (`UNROLL` is read by the CUDA
/// kernels only).
#[allow(clippy::too_many_arguments)]
fn template(
    g: &FusedGeometry,
    experts: usize,
    rows: usize,
    stage: Stage,
    smem_floats: usize,
    rows_per_warp: u32,
    unroll: u32,
) -> Result<Vec<(String, TemplateArg)>> {
    let f = match stage {
        Stage::GateUp => g.gate_up,
        Stage::Down => g.down,
    };
    Ok(vec![
        int("EXPERTS", experts)?,
        int("TOKENS", rows)?,
        int("HIDDEN", g.hidden)?,
        int("INTER", g.inter)?,
        int("BITS", usize::from(f.bits))?,
        int("GROUP", f.group_size.map_or(0, |v| v as usize))?,
        int("ROWS", rows_per_warp as usize)?,
        int("UNROLL", unroll as usize)?,
        int("SMEM_FLOATS", smem_floats)?,
    ])
}

fn blocks(rows: usize, rows_per_block: i32) -> Result<i32> {
    let b = rows.div_ceil(rows_per_block as usize);
    i32::try_from(b)
        .ok()
        .and_then(|b| b.checked_mul(THREADS))
        .ok_or_else(|| KernelError::Unsupported {
            reason: format!("{rows} rows overflow the launch grid"),
        })
}

/// K1: `h [E, m, I]` for the rows of `x` (`[m, H]`, f32).
fn gate_up(
    cache: &Cache,
    backend: KernelBackend,
    g: &FusedGeometry,
    tuning: &FusedTuning,
    x: &Array,
    offs: &Array,
    slots: &[&Array],
) -> Result<Array> {
    let (experts, rows) = (slots.len(), x.dim(0)? as usize);
    let (floats, rows_per_warp, unroll) = match backend {
        KernelBackend::Cuda => (rows * g.hidden, tuning.gate_up_rows, tuning.gate_up_unroll),
        KernelBackend::Metal => (
            rows * staged_floats(g.hidden, g.gate_up.bits),
            METAL_GATE_UP_ROWS,
            1,
        ),
    };
    let k = kernel(
        cache,
        backend,
        KernelKey {
            metal: backend == KernelBackend::Metal,
            stage: Stage::GateUp,
            experts,
            shared_bytes: floats * 4,
        },
    )?;
    let mut inputs: Vec<&Array> = vec![x, offs];
    inputs.extend_from_slice(slots);
    let launch = LaunchConfig {
        grid: [
            blocks(g.inter, WARPS * rows_per_warp as i32)?,
            experts as i32,
            1,
        ],
        threadgroup: [THREADS, 1, 1],
        template: template(
            g,
            experts,
            rows,
            Stage::GateUp,
            floats,
            rows_per_warp,
            unroll,
        )?,
        init_value: None,
    };
    let out = OutputSpec {
        shape: vec![experts as i32, rows as i32, g.inter as i32],
        dtype: Dtype::Float32,
    };
    Ok(k.call(&inputs, &[out], &launch)?.remove(0))
}

/// K2: `y [m, H]` from `h` (`[E, m, I]`) and weights (`[m, E]`, f32).
#[allow(clippy::too_many_arguments)]
fn down(
    cache: &Cache,
    backend: KernelBackend,
    g: &FusedGeometry,
    tuning: &FusedTuning,
    h: &Array,
    weights: &Array,
    offs: &Array,
    slots: &[&Array],
) -> Result<Array> {
    let (experts, rows) = (slots.len(), weights.dim(0)? as usize);
    let cuda = backend == KernelBackend::Cuda;
    let (floats, rows_per_warp, unroll) = if cuda {
        (rows * g.inter, tuning.down_rows, tuning.down_unroll)
    } else {
        (
            experts * rows * staged_floats(g.inter, g.down.bits),
            METAL_DOWN_ROWS,
            1,
        )
    };
    let k = kernel(
        cache,
        backend,
        KernelKey {
            metal: backend == KernelBackend::Metal,
            stage: Stage::Down,
            experts,
            shared_bytes: floats * 4,
        },
    )?;
    let mut inputs: Vec<&Array> = vec![h, weights, offs];
    inputs.extend_from_slice(slots);
    let launch = LaunchConfig {
        grid: [
            blocks(g.hidden, WARPS * rows_per_warp as i32)?,
            if cuda { experts as i32 } else { 1 },
            1,
        ],
        threadgroup: [THREADS, 1, 1],
        template: template(g, experts, rows, Stage::Down, floats, rows_per_warp, unroll)?,
        // CUDA: the experts add into a zero-filled output.
        init_value: cuda.then_some(0.0),
    };
    let out = OutputSpec {
        shape: vec![rows as i32, g.hidden as i32],
        dtype: Dtype::Float32,
    };
    Ok(k.call(&inputs, &[out], &launch)?.remove(0))
}

/// The fused forward (inputs already checked, geometry planned).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    cache: &Cache,
    backend: KernelBackend,
    g: &FusedGeometry,
    tuning: Option<&FusedTuning>,
    x: &Array,
    experts: &[ExpertSlot<'_>],
    weights: &Array,
) -> Result<Array> {
    let to_f32 = |a: &Array| -> Result<Array> {
        Ok(if a.dtype() == Dtype::Float32 {
            a.clone()
        } else {
            a.astype(Dtype::Float32)?
        })
    };
    let (x32, w32) = (to_f32(x)?, to_f32(weights)?);
    let mut offsets = Vec::with_capacity(experts.len() * 6);
    for e in experts {
        for p in e.projections {
            for v in [p.weight_offset, p.scale_offset] {
                offsets.push(i32::try_from(v).map_err(|_| KernelError::Unsupported {
                    reason: format!("slot offset {v} exceeds i32"),
                })?);
            }
        }
    }
    let n = experts.len() as i32;
    let offs = Array::from_slice(&offsets, &[n, 6])?;
    let slots: Vec<&Array> = experts.iter().map(|e| e.bytes).collect();
    let rows = x.dim(0)? as usize;
    let hidden = g.hidden as i32;
    let mut parts = Vec::new();
    for start in (0..rows).step_by(g.rows_per_launch) {
        let m = g.rows_per_launch.min(rows - start);
        let (r0, r1) = (start as i32, (start + m) as i32);
        let (xc, wc) = if m == rows {
            (x32.clone(), w32.clone())
        } else {
            (
                x32.slice(&[r0, 0], &[r1, hidden], &[1, 1])?,
                w32.slice(&[r0, 0], &[r1, n], &[1, 1])?,
            )
        };
        let t = tuning.copied().unwrap_or_else(|| FusedTuning::for_rows(m));
        let h = gate_up(cache, backend, g, &t, &xc, &offs, &slots)?;
        let per = match backend {
            KernelBackend::Cuda => experts.len(),
            KernelBackend::Metal => g.experts_per_down(m),
        };
        let mut y: Option<Array> = None;
        for e0 in (0..experts.len()).step_by(per) {
            let e1 = (e0 + per).min(experts.len());
            let part = if e0 == 0 && e1 == experts.len() {
                down(cache, backend, g, &t, &h, &wc, &offs, &slots)?
            } else {
                let (a, b) = (e0 as i32, e1 as i32);
                let hg = h.slice(&[a, 0, 0], &[b, m as i32, g.inter as i32], &[1, 1, 1])?;
                let wg = wc.slice(&[0, a], &[m as i32, b], &[1, 1])?;
                let og = offs.slice(&[a, 0], &[b, 6], &[1, 1])?;
                down(cache, backend, g, &t, &hg, &wg, &og, &slots[e0..e1])?
            };
            y = Some(match y {
                Some(acc) => acc.add(&part)?,
                None => part,
            });
        }
        if let Some(y) = y {
            parts.push(y);
        }
    }
    let y = match parts.len() {
        1 => parts.remove(0),
        _ => {
            let refs: Vec<&Array> = parts.iter().collect();
            mlx::concatenate(&refs, 0)?
        }
    };
    Ok(if x.dtype() == Dtype::Float32 {
        y
    } else {
        y.astype(x.dtype())?
    })
}
