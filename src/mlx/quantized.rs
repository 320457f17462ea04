//! MLX affine quantization: `w ≈ scale · q + bias` per group of `group_size`
//! columns, `q` packed little-endian into `uint32` words (4-bit: 8 values per
//! word, low nibble first). Colibri's int4 bytes are exactly this layout with
//! `bias = −8 · scale` (see docs/mlx-platform.md).

use super::ops::array_op;
use super::sys;
use super::{Array, Dtype, MlxError, Result};

fn opt(a: Option<&Array>) -> *const sys::mlxs_array {
    a.map_or(std::ptr::null(), Array::as_ptr)
}

/// Group sizes MLX 0.32.4's affine kernels accept.
pub const MLX_GROUP_SIZES: [i32; 3] = [32, 64, 128];

fn check_params(op: &'static str, group_size: i32, bits: i32) -> Result<()> {
    if !MLX_GROUP_SIZES.contains(&group_size) {
        return Err(MlxError::invalid(
            op,
            format!("group size {group_size} is not one of {MLX_GROUP_SIZES:?}"),
        ));
    }
    if ![2, 3, 4, 5, 6, 8].contains(&bits) {
        return Err(MlxError::invalid(
            op,
            format!("{bits}-bit affine quantization is not supported"),
        ));
    }
    Ok(())
}

/// `x @ dequantize(w).T` (or without the transpose) without expanding `w`.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    check_params("quantized_matmul", group_size, bits)?;
    array_op!("quantized_matmul", |out| sys::mlxs_quantized_matmul(
        &mut out,
        x.as_ptr(),
        w.as_ptr(),
        scales.as_ptr(),
        opt(biases),
        transpose as i32,
        group_size,
        bits
    ))
}

/// Expands a quantized matrix; `dtype` defaults to the scales' dtype.
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    group_size: i32,
    bits: i32,
    dtype: Option<Dtype>,
) -> Result<Array> {
    check_params("dequantize", group_size, bits)?;
    array_op!("dequantize", |out| sys::mlxs_dequantize(
        &mut out,
        w.as_ptr(),
        scales.as_ptr(),
        opt(biases),
        group_size,
        bits,
        dtype.map_or(-1, Dtype::code)
    ))
}

/// MLX's own affine quantizer: returns `(w_q, scales, biases)`.
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
    check_params("quantize", group_size, bits)?;
    let mut outs = [std::ptr::null_mut(); 3];
    super::array::ffi!(
        "quantize",
        sys::mlxs_quantize(outs.as_mut_ptr(), w.as_ptr(), group_size, bits)
    )?;
    let [a, b, c] = outs;
    Ok((
        Array::from_raw("quantize", a)?,
        Array::from_raw("quantize", b)?,
        Array::from_raw("quantize", c)?,
    ))
}

/// Batched quantized matmul with gathers: output `i` multiplies
/// `x[lhs_indices[i]]` by matrix `w[rhs_indices[i]]`. Indices are not
/// bounds-checked by MLX; build them with [`super::checked_indices`].
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    transpose: bool,
    group_size: i32,
    bits: i32,
    sorted_indices: bool,
) -> Result<Array> {
    check_params("gather_qmm", group_size, bits)?;
    array_op!("gather_qmm", |out| sys::mlxs_gather_qmm(
        &mut out,
        x.as_ptr(),
        w.as_ptr(),
        scales.as_ptr(),
        opt(biases),
        opt(lhs_indices),
        opt(rhs_indices),
        transpose as i32,
        group_size,
        bits,
        sorted_indices as i32
    ))
}

/// Batched float matmul with gathers (same index contract as [`gather_qmm`]).
pub fn gather_mm(
    a: &Array,
    b: &Array,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    sorted_indices: bool,
) -> Result<Array> {
    array_op!("gather_mm", |out| sys::mlxs_gather_mm(
        &mut out,
        a.as_ptr(),
        b.as_ptr(),
        opt(lhs_indices),
        opt(rhs_indices),
        sorted_indices as i32
    ))
}
