//! The linear and embedding paths: which kernel a descriptor gets, and the MLX
//! graphs that compute with the prepared (cached) arrays.
//!
//! Kernel choice on the fast path ([`LinearKernel`], from [`kernel_for`]):
//!
//! | stored format | condition | kernel |
//! | --- | --- | --- |
//! | int4 per-row | `I % 64 == 0` | MLX 4-bit affine, the row scale repeated into groups of 64 |
//! | int4 per-row | `I % 32 == 0` | the same with groups of 32 |
//! | int4 `gs` ∈ {32, 64, 128} | `I % gs == 0` | MLX 4-bit affine, scales as stored |
//! | int4 `gs % 32 == 0` otherwise | `I % 32 == 0` | each scale repeated into `gs/32` groups of 32 (last group truncated) |
//! | int8 per-row, `lm_head` or taller than `head_tile_rows` | | row tiles, each evaluated before the next: 8-bit affine tiles when `I % 32 == 0`, else f32-expanded tiles |
//! | int8 per-row | `I % 32 == 0` | MLX 8-bit affine after `byte ^ 0x80`, bias `−128·s`, the row scale repeated into groups of 128/64/32 |
//! | F32 / BF16 / F16 | | f32 matmul |
//! | anything else (int4 `gs` 16/48, widths not a multiple of 32) | | dequantize to f32 once (cached), then matmul |
//!
//! All repetitions are value-preserving: a repeated scale multiplies exactly the
//! columns it multiplied before. MLX affine values are `scale·u + bias`, so int4
//! `(n − 8)·s` becomes `s·n + (−8·s)` and int8 `q·s` becomes `s·(q ^ 0x80) + (−128·s)`
//! (docs/mlx-platform.md).

use crate::container::{TensorFamily, WeightFormat, WeightInfo};
use crate::mlx::{self, Array, Dtype, MLX_GROUP_SIZES};
use crate::quant::QuantFormat;

use super::error::{MlxContext, ResidentError, Result};

/// Which computation [`linear`](super::Glm52WeightSource::linear) uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinearPath {
    /// The MLX quantized kernels where the layout allows them (see
    /// [`LinearKernel`]), the f32 path otherwise.
    #[default]
    Fast,
    /// Dequantize the whole weight to f32 with the crate's bit-exact host
    /// decoder (cached), then `x · Wᵀ` in f32. For tests and comparisons: it
    /// materializes `4·O·I` bytes per tensor, lm_head included.
    Reference,
}

/// The fast-path kernel chosen for one tensor descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearKernel {
    /// MLX 4-bit affine `quantized_matmul` with MLX group size `group_size`;
    /// every stored scale covers `scale_repeat` MLX groups.
    Q4 {
        /// MLX group size (32, 64 or 128).
        group_size: u32,
        /// MLX groups per stored scale.
        scale_repeat: u32,
    },
    /// MLX 8-bit affine `quantized_matmul` on the xor-0x80 bytes.
    Int8Affine {
        /// MLX group size the row scale is repeated into.
        group_size: u32,
    },
    /// int8 per-row in bounded row tiles, each evaluated before the next one
    /// is built; `group_size` is `Some` when the tiles use the 8-bit affine
    /// kernel, `None` when each tile is expanded to f32 (widths not a
    /// multiple of 32).
    Int8Tiled {
        /// Rows per tile.
        tile_rows: usize,
        /// MLX group size of the 8-bit affine tiles, if used.
        group_size: Option<u32>,
    },
    /// A float weight (cast to f32 once), `x · Wᵀ`.
    Float,
    /// Dequantized to f32 once (cached), then `x · Wᵀ`.
    Dequantized,
}

/// MLX 4-bit layout for `f`: `(mlx_group_size, scale_repeat)`, or `None` when
/// MLX's kernels cannot take it.
pub(crate) fn q4_layout(f: &QuantFormat) -> Option<(u32, u32)> {
    let cols = u32::try_from(f.cols).ok()?;
    if f.bits != 4 || cols == 0 || cols % 32 != 0 {
        return None;
    }
    match f.group_size {
        None => {
            let gs = if cols % 64 == 0 { 64 } else { 32 };
            Some((gs, cols / gs))
        }
        Some(gs) if MLX_GROUP_SIZES.contains(&(gs as i32)) && cols % gs == 0 => Some((gs, 1)),
        Some(gs) if gs % 32 == 0 => Some((32, gs / 32)),
        Some(_) => None,
    }
}

/// MLX group size for an int8 per-row tensor of `cols` columns (the largest of
/// 128/64/32 dividing it: fewest repeated scales).
pub(crate) fn int8_group_size(cols: usize) -> Option<u32> {
    [128u32, 64, 32]
        .into_iter()
        .find(|&g| cols > 0 && cols % g as usize == 0)
}

/// The fast-path kernel for `info`.
pub fn kernel_for(info: &WeightInfo, head_tile_rows: usize) -> LinearKernel {
    match &info.format {
        WeightFormat::Float { .. } => LinearKernel::Float,
        WeightFormat::Quantized(r) => {
            let f = &r.format;
            if f.bits == 4 {
                return match q4_layout(f) {
                    Some((group_size, scale_repeat)) => LinearKernel::Q4 {
                        group_size,
                        scale_repeat,
                    },
                    None => LinearKernel::Dequantized,
                };
            }
            let group_size = int8_group_size(f.cols);
            if info.family == TensorFamily::LmHead || f.rows > head_tile_rows {
                return LinearKernel::Int8Tiled {
                    tile_rows: head_tile_rows,
                    group_size,
                };
            }
            match group_size {
                Some(group_size) => LinearKernel::Int8Affine { group_size },
                None => LinearKernel::Dequantized,
            }
        }
    }
}

/// A weight prepared for MLX's affine kernels.
#[derive(Clone)]
pub(crate) struct Affine {
    /// `uint32 [O, I·bits/32]`.
    pub w: Array,
    /// `f32 [O, I/group_size]`.
    pub scales: Array,
    /// `f32 [O, I/group_size]`.
    pub biases: Array,
    pub group_size: i32,
    pub bits: i32,
}

/// Quantized bytes kept row-addressable: `uint8 [O, row_stride]` and the
/// stored scales `f32 [O, groups_per_row]`.
#[derive(Clone)]
pub(crate) struct QuantRows {
    pub bytes: Array,
    pub scales: Array,
    pub format: QuantFormat,
}

/// Casts the affine scales/biases to a half-precision input's dtype; f32
/// inputs use them as they are.
fn scales_for(name: &str, a: &Affine, x: &Array) -> Result<(Array, Array)> {
    match x.dtype() {
        Dtype::Float32 => Ok((a.scales.clone(), a.biases.clone())),
        d @ (Dtype::Float16 | Dtype::Bfloat16) => Ok((
            a.scales.astype(d).ctx(name, "casting scales")?,
            a.biases.astype(d).ctx(name, "casting biases")?,
        )),
        _ => Err(bad_input(name, x, 0, "input must be a float array")),
    }
}

pub(crate) fn bad_input(name: &str, x: &Array, cols: usize, reason: &'static str) -> ResidentError {
    ResidentError::BadInput {
        name: name.to_owned(),
        shape: x.shape(),
        dtype: format!("{:?}", x.dtype()),
        cols,
        reason,
    }
}

/// `x · dequantize(a)ᵀ` through MLX's affine kernel.
pub(crate) fn affine_matmul(name: &str, x: &Array, a: &Affine) -> Result<Array> {
    let (scales, biases) = scales_for(name, a, x)?;
    mlx::quantized_matmul(x, &a.w, &scales, Some(&biases), true, a.group_size, a.bits)
        .ctx(name, "quantized_matmul")
}

/// `x · Wᵀ` in f32 for a dense f32 `[O, I]` weight.
pub(crate) fn dense_matmul(name: &str, x: &Array, w: &Array) -> Result<Array> {
    let x32 = to_f32(name, x)?;
    let wt = w.t().ctx(name, "transposing the weight")?;
    x32.matmul(&wt).ctx(name, "matmul")
}

fn to_f32(name: &str, x: &Array) -> Result<Array> {
    match x.dtype() {
        Dtype::Float32 => Ok(x.clone()),
        d if d.is_float() => x.astype(Dtype::Float32).ctx(name, "casting the input"),
        _ => Err(bad_input(name, x, 0, "input must be a float array")),
    }
}

/// Row ranges of `rows` rows in tiles of `tile` rows.
fn tiles(rows: usize, tile: usize) -> impl Iterator<Item = (usize, usize)> {
    let tile = tile.max(1);
    (0..rows.div_ceil(tile)).map(move |k| (k * tile, ((k + 1) * tile).min(rows)))
}

fn i32_dim(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ResidentError::TooLarge {
        name: name.to_owned(),
        value: v,
    })
}

/// Concatenates evaluated logits tiles along the last axis.
fn join_tiles(name: &str, parts: Vec<Array>) -> Result<Array> {
    if parts.len() == 1 {
        return parts
            .into_iter()
            .next()
            .ok_or_else(|| bad_input_empty(name));
    }
    let refs: Vec<&Array> = parts.iter().collect();
    mlx::concatenate(&refs, -1).ctx(name, "concatenating logits tiles")
}

fn bad_input_empty(name: &str) -> ResidentError {
    ResidentError::Internal(format!("{name}: no rows to tile"))
}

/// int8 head through 8-bit affine tiles: only one tile's graph exists at a
/// time and nothing is ever expanded.
pub(crate) fn tiled_affine(name: &str, x: &Array, a: &Affine, tile_rows: usize) -> Result<Array> {
    let rows = a.w.dim(0).ctx(name, "weight rows")? as usize;
    let (scales, biases) = scales_for(name, a, x)?;
    let mut parts = Vec::with_capacity(rows.div_ceil(tile_rows.max(1)));
    for (start, stop) in tiles(rows, tile_rows) {
        let (s, e) = (i32_dim(name, start)?, i32_dim(name, stop)?);
        let w = a.w.slice_axis(0, s, e).ctx(name, "slicing a tile")?;
        let sc = scales.slice_axis(0, s, e).ctx(name, "slicing a tile")?;
        let bi = biases.slice_axis(0, s, e).ctx(name, "slicing a tile")?;
        let out = mlx::quantized_matmul(x, &w, &sc, Some(&bi), true, a.group_size, a.bits)
            .ctx(name, "quantized_matmul tile")?;
        out.eval().ctx(name, "evaluating a tile")?;
        parts.push(out);
    }
    join_tiles(name, parts)
}

/// int8 head whose width rules out the affine kernel: each tile is expanded to
/// f32, multiplied and evaluated before the next tile is built, so at most one
/// tile's f32 copy exists.
pub(crate) fn tiled_expand(
    name: &str,
    x: &Array,
    q: &QuantRows,
    tile_rows: usize,
) -> Result<Array> {
    let x32 = to_f32(name, x)?;
    let rows = q.format.rows;
    let mut parts = Vec::with_capacity(rows.div_ceil(tile_rows.max(1)));
    for (start, stop) in tiles(rows, tile_rows) {
        let (s, e) = (i32_dim(name, start)?, i32_dim(name, stop)?);
        let bytes = q.bytes.slice_axis(0, s, e).ctx(name, "slicing a tile")?;
        let sc = q.scales.slice_axis(0, s, e).ctx(name, "slicing a tile")?;
        let w = bytes
            .view(Dtype::Int8)
            .and_then(|v| v.astype(Dtype::Float32))
            .and_then(|v| v.multiply(&sc))
            .ctx(name, "expanding a tile")?;
        let out = dense_matmul(name, &x32, &w)?;
        out.eval().ctx(name, "evaluating a tile")?;
        parts.push(out);
    }
    join_tiles(name, parts)
}

/// Dequantizes gathered rows (`uint8 [n, row_stride]`, scales `[n, groups]`)
/// to `f32 [n, cols]`. Every value is `float(q)·s` with one rounding, the same
/// arithmetic as the host decoder, so the result is bit-identical to it.
pub(crate) fn dequantize_gathered(
    name: &str,
    format: &QuantFormat,
    rows: &Array,
    scales: &Array,
) -> Result<Array> {
    let ctx = "dequantizing gathered rows";
    let cols = i32_dim(name, format.cols)?;
    let n = rows.dim(0).ctx(name, ctx)?;
    if format.bits == 8 {
        return rows
            .view(Dtype::Int8)
            .and_then(|v| v.astype(Dtype::Float32))
            .and_then(|v| v.multiply(scales))
            .ctx(name, ctx);
    }
    let stride = i32_dim(name, format.row_stride_bytes())?;
    let low = Array::scalar_int(0x0F, Dtype::Uint8).ctx(name, ctx)?;
    let four = Array::scalar_int(4, Dtype::Uint8).ctx(name, ctx)?;
    let lo = rows.bitwise_and(&low).ctx(name, ctx)?;
    let hi = rows.right_shift(&four).ctx(name, ctx)?;
    // Column 2j is the low nibble of byte j, column 2j+1 the high nibble.
    let mut values = mlx::stack(&[&lo, &hi], 2)
        .and_then(|v| v.reshape(&[n, stride * 2]))
        .ctx(name, ctx)?;
    if stride * 2 != cols {
        values = values.slice_axis(1, 0, cols).ctx(name, ctx)?;
    }
    let centered = values
        .astype(Dtype::Float32)
        .and_then(|v| v.add_scalar(-8.0))
        .ctx(name, ctx)?;
    let expanded = match format.group_size {
        None => scales.clone(),
        Some(gs) => {
            let gs = i32_dim(name, gs as usize)?;
            let rep = scales.repeat(gs, 1).ctx(name, ctx)?;
            if rep.dim(1).ctx(name, ctx)? != cols {
                rep.slice_axis(1, 0, cols).ctx(name, ctx)?
            } else {
                rep
            }
        }
    };
    centered.multiply(&expanded).ctx(name, ctx)
}

/// Builds the MLX affine form of `format` from its raw bytes and stored scales:
/// `w` (already uint32, already xor-flipped for int8), `scales [O, groups]`.
pub(crate) fn affine_from(
    name: &str,
    format: &QuantFormat,
    w: Array,
    stored_scales: &Array,
) -> Result<Affine> {
    let ctx = "preparing affine scales";
    let (group_size, repeat, bits, offset) = if format.bits == 4 {
        let (gs, rep) = q4_layout(format).ok_or_else(|| {
            ResidentError::Internal(format!("{name}: {format} has no MLX 4-bit layout"))
        })?;
        (gs, rep, 4, -8.0f32)
    } else {
        let gs = int8_group_size(format.cols).ok_or_else(|| {
            ResidentError::Internal(format!("{name}: {format} has no MLX 8-bit layout"))
        })?;
        (gs, (format.cols / gs as usize) as u32, 8, -128.0f32)
    };
    let groups = i32_dim(name, format.cols / group_size as usize)?;
    let mut scales = if repeat > 1 {
        stored_scales.repeat(repeat as i32, 1).ctx(name, ctx)?
    } else {
        stored_scales.clone()
    };
    if scales.dim(1).ctx(name, ctx)? != groups {
        // A grouped size that does not divide I: the last stored group is
        // partial, so its repeats past I are dropped.
        scales = scales.slice_axis(1, 0, groups).ctx(name, ctx)?;
    }
    let scales = scales.contiguous().ctx(name, ctx)?;
    let biases = scales.multiply_scalar(offset).ctx(name, ctx)?;
    mlx::eval(&[&w, &scales, &biases]).ctx(name, "uploading the weight")?;
    Ok(Affine {
        w,
        scales,
        biases,
        group_size: group_size as i32,
        bits,
    })
}
