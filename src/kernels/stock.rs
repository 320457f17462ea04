//! The stock path: MLX `quantized_matmul` per projection on zero-copy views
//! of the slot bytes (the streamed executor's mapping, see
//! [`ProjectionKernel`]), SwiGLU per expert, then the routing-weighted sum.

use crate::executor::ProjectionKernel;
use crate::experts::layout::{ProjectionFormat, ProjectionLayout};
use crate::mlx::{self, Array, Dtype};

use super::{ExpertSlot, KernelError, Result};

/// `shape` elements of `dtype` at byte `offset` of `bytes` (shares memory).
fn sub_view(bytes: &Array, offset: usize, shape: &[i32], dtype: Dtype) -> Result<Array> {
    let count: usize = shape.iter().map(|&d| d.max(0) as usize).product();
    let end = count
        .checked_mul(dtype.size())
        .and_then(|n| n.checked_add(offset))
        .filter(|&e| e <= i32::MAX as usize)
        .ok_or_else(|| KernelError::Input(format!("view at {offset} overflows")))?;
    if offset % dtype.size() != 0 {
        return Err(KernelError::Input(format!(
            "offset {offset} is not a multiple of the {dtype:?} size"
        )));
    }
    let b = bytes.slice(&[offset as i32], &[end as i32], &[1])?;
    let typed = if dtype == Dtype::Uint8 {
        b
    } else {
        b.view(dtype)?
    };
    Ok(typed.reshape(shape)?)
}

/// `input @ Wᵀ` for one projection stored in `bytes`.
fn projection(bytes: &Array, p: &ProjectionLayout, input: &Array, dtype: Dtype) -> Result<Array> {
    let f = p.format;
    let (o, i) = (f.rows as i32, f.cols as i32);
    let groups = f
        .group_size
        .map_or(1, |g| f.cols.div_ceil(g as usize).max(1)) as i32;
    let scales = sub_view(bytes, p.scale_offset, &[o, groups], Dtype::Float32)?;
    let scales = if dtype == Dtype::Float32 {
        scales
    } else {
        scales.astype(dtype)?
    };
    match ProjectionKernel::for_format(&f) {
        ProjectionKernel::Affine {
            bits,
            group_size,
            repeat,
        } => {
            let w = if bits == 4 {
                sub_view(bytes, p.weight_offset, &[o, i / 8], Dtype::Uint32)?
            } else {
                sub_view(bytes, p.weight_offset, &[o, i], Dtype::Uint8)?
                    .bitwise_xor(&Array::scalar_int(0x80, Dtype::Uint8)?)?
                    .view(Dtype::Uint32)?
            };
            let s = if repeat > 1 {
                // Materialized: MLX's CUDA qmv refused the lazily repeated
                // scales of a per-row format at M = 1 on the H200.
                scales.repeat(repeat, 1)?.contiguous()?
            } else {
                scales
            };
            let zero_point = if bits == 4 { -8.0 } else { -128.0 };
            let b = s.multiply_scalar(zero_point)?;
            Ok(mlx::quantized_matmul(
                input,
                &w,
                &s,
                Some(&b),
                true,
                group_size,
                bits,
            )?)
        }
        ProjectionKernel::Dense => {
            let w = dense_weight(bytes, p, &scales, dtype)?;
            Ok(input.matmul(&w.t()?)?)
        }
    }
}

/// The dequantized `[O, I]` weight, for formats MLX's affine kernels lack.
fn dense_weight(
    bytes: &Array,
    p: &ProjectionLayout,
    scales: &Array,
    dtype: Dtype,
) -> Result<Array> {
    let f = &p.format;
    let (o, i) = (f.rows as i32, f.cols as i32);
    let packed = match f.bits {
        4 => sub_view(
            bytes,
            p.weight_offset,
            &[o, f.cols.div_ceil(2) as i32],
            Dtype::Uint8,
        )?,
        8 => sub_view(bytes, p.weight_offset, &[o, i], Dtype::Int8)?,
        b => {
            return Err(KernelError::Input(format!(
                "{b}-bit weights are not supported"
            )));
        }
    };
    Ok(dequantize_packed(&packed, f, scales, dtype)?)
}

/// Expands a projection's packed weight with MLX ops: `packed` is the
/// `uint8 [O, ceil(I/2)]` nibble view of an int4 weight (low nibble = even
/// column, offset-binary) or the `int8 [O, I]` view of an int8 one; `scales`
/// are its F32 scales `[O, groups]` (or `[O, 1]` per row). Shared by the stock
/// kernels and the streamed executor's dense path.
pub(crate) fn dequantize_packed(
    packed: &Array,
    f: &ProjectionFormat,
    scales: &Array,
    dtype: Dtype,
) -> mlx::Result<Array> {
    let (o, i) = (f.rows as i32, f.cols as i32);
    let q = if f.bits == 4 {
        let stride = f.cols.div_ceil(2) as i32;
        let lo = packed.bitwise_and(&Array::scalar_int(0x0F, Dtype::Uint8)?)?;
        let hi = packed.right_shift(&Array::scalar_int(4, Dtype::Uint8)?)?;
        let pairs = mlx::stack(&[&lo, &hi], 2)?.reshape(&[o, 2 * stride])?;
        let vals = if 2 * stride == i {
            pairs
        } else {
            pairs.slice(&[0, 0], &[o, i], &[1, 1])?
        };
        vals.astype(dtype)?.add_scalar(-8.0)?
    } else {
        packed.astype(dtype)?
    };
    let per_col = match f.group_size {
        Some(g) if f.cols.div_ceil(g as usize) > 1 => {
            let groups = f.cols.div_ceil(g as usize);
            let idx: Vec<u32> = (0..f.cols).map(|c| (c / g as usize) as u32).collect();
            scales.take(&mlx::checked_indices(&idx, groups, "scale group")?, 1)?
        }
        _ => scales.clone(),
    };
    q.multiply(&per_col)
}

/// `down(silu(gate·x) ⊙ up·x)` of one expert, in `x`'s dtype.
pub(super) fn swiglu(x: &Array, slot: &ExpertSlot<'_>) -> Result<Array> {
    let dtype = x.dtype();
    // Offsets in `slot.bytes` (the slot may sit inside an arena).
    let shifted = |p: &ProjectionLayout| -> Result<ProjectionLayout> {
        let at = |o: usize| {
            o.checked_add(slot.offset)
                .ok_or_else(|| KernelError::Input(format!("slot offset {} overflows", slot.offset)))
        };
        Ok(ProjectionLayout {
            weight_offset: at(p.weight_offset)?,
            scale_offset: at(p.scale_offset)?,
            ..*p
        })
    };
    let [g, u, d] = slot.projections;
    let (g, u, d) = (shifted(g)?, shifted(u)?, shifted(d)?);
    let gate = projection(slot.bytes, &g, x, dtype)?;
    let up = projection(slot.bytes, &u, x, dtype)?;
    let h = gate.silu()?.multiply(&up)?;
    projection(slot.bytes, &d, &h, dtype)
}

/// `Σ_e weights[:, e] · swiglu_e(x)` (inputs already checked).
pub(super) fn forward(x: &Array, experts: &[ExpertSlot<'_>], weights: &Array) -> Result<Array> {
    let dtype = x.dtype();
    let rows = x.dim(0)?;
    let weights = if weights.dtype() == dtype {
        weights.clone()
    } else {
        weights.astype(dtype)?
    };
    let mut acc: Option<Array> = None;
    for (e, slot) in experts.iter().enumerate() {
        let e = e as i32;
        let w = weights.slice(&[0, e], &[rows, e + 1], &[1, 1])?;
        let y = swiglu(x, slot)?.multiply(&w)?;
        acc = Some(match acc {
            Some(a) => a.add(&y)?,
            None => y,
        });
    }
    match acc {
        Some(a) => Ok(a),
        None => Ok(mlx::zeros(&[rows, x.dim(1)?], dtype)?),
    }
}
