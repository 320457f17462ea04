//! MLX's fused `fast` ops used by the model layers.

use super::ops::{array_op, cstring};
use super::sys;
use super::{Array, Result};

fn opt(a: Option<&Array>) -> *const sys::mlxs_array {
    a.map_or(std::ptr::null(), Array::as_ptr)
}

/// RMS normalization over the last axis: `x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    array_op!("rms_norm", |out| sys::mlxs_rms_norm(
        &mut out,
        x.as_ptr(),
        opt(weight),
        eps
    ))
}

/// Layer normalization over the last axis.
pub fn layer_norm(
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    array_op!("layer_norm", |out| sys::mlxs_layer_norm(
        &mut out,
        x.as_ptr(),
        opt(weight),
        opt(bias),
        eps
    ))
}

/// Where RoPE takes its frequencies from.
#[derive(Debug, Clone, Copy)]
pub enum RopeFreqs<'a> {
    /// `base^(−2i/dims)` from a base (θ).
    Base(f32),
    /// Explicit per-pair wavelengths (`dims / 2` of them): pair `i` rotates by
    /// `position / freqs[i]`, so the plain case is `base^(2i/dims)`. Scaled
    /// RoPE variants (YaRN and friends) pass adjusted wavelengths here.
    Explicit(&'a Array),
}

/// Rotary position embedding over the first `dims` features of the last axis
/// of `x` (shape `[..., seq, features]`), positions starting at `offset`.
/// `traditional` rotates adjacent pairs (interleaved) instead of halves.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    freqs: RopeFreqs<'_>,
    scale: f32,
    offset: i32,
) -> Result<Array> {
    let (base, f) = match freqs {
        RopeFreqs::Base(b) => (b, std::ptr::null()),
        RopeFreqs::Explicit(a) => (0.0, a.as_ptr()),
    };
    array_op!("rope", |out| sys::mlxs_rope(
        &mut out,
        x.as_ptr(),
        dims,
        traditional as i32,
        base,
        scale,
        offset,
        f
    ))
}

/// The mask of [`scaled_dot_product_attention`].
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Attend everywhere.
    None,
    /// Causal (query `i` sees keys `≤ i + (kv_len − q_len)`).
    Causal,
    /// Boolean (true = keep) or additive float mask broadcastable to the scores.
    Array(&'a Array),
}

/// `softmax(q·kᵀ·scale + mask)·v` with `q: [B, Hq, L, D]`, `k, v: [B, Hkv, S, D]`.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    let (mode, m) = match mask {
        AttentionMask::None => ("", std::ptr::null()),
        AttentionMask::Causal => ("causal", std::ptr::null()),
        AttentionMask::Array(a) => ("array", a.as_ptr()),
    };
    let mode = cstring("scaled_dot_product_attention", mode)?;
    array_op!("scaled_dot_product_attention", |out| sys::mlxs_sdpa(
        &mut out,
        q.as_ptr(),
        k.as_ptr(),
        v.as_ptr(),
        scale,
        mode.as_ptr(),
        m
    ))
}
