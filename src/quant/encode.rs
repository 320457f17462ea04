//! Quantizers that produce the Colibri container's weight encodings
//! (`docs/colibri-format.md` §3.2 and §4).
//!
//! All arithmetic is `f32`, exactly as the reference converter does it with numpy:
//!
//! * scale `s = max(amax / 7, 1e-8)` (int4) or `max(amax / 127, 1e-8)` (int8), a true
//!   `f32` division, where `amax` is the largest `|w|` of the row (per-row formats) or of
//!   the group (grouped int4; the row is conceptually zero-padded to `ng·gs` for this
//!   only, which never changes a maximum of absolute values);
//! * `q = round_ties_even(w / s)` (a true `f32` division), clipped to `[-8, 7]` or
//!   `[-128, 127]`;
//! * int4 stores the nibble `n = q + 8`, the even column in the low nibble; an odd row
//!   width leaves the final byte's high nibble at `0x0`; int8 stores `q` as a
//!   two's-complement byte.
//!
//! Rows are independent, so a tensor can be encoded in row chunks: [`encode_rows`]
//! appends the bytes and scales of whole rows to caller-owned buffers, and encoding a
//! tensor chunk by chunk gives exactly the bytes of encoding it in one call.

use thiserror::Error;

/// The smallest scale the quantizers emit (`1e-8` as `f32`, bits `0x322BCC77`).
pub const SCALE_FLOOR: f32 = 1e-8;

/// A quantized weight encoding of the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// int8, one scale per row (engine fmt 1).
    Int8Row,
    /// int4 offset-binary, one scale per row (engine fmt 2).
    Int4Row,
    /// int4 offset-binary, one scale per `group_size` columns of a row (engine fmt 4).
    Int4Grouped {
        /// Columns per scale group (any positive integer; the container default is 64).
        group_size: usize,
    },
}

/// Errors of the quantizers (caller bugs or degenerate shapes, never panics).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EncodeError {
    /// A row width of zero cannot be quantized (there is no amax).
    #[error("cannot quantize rows of width 0")]
    ZeroWidth,
    /// A grouped scheme needs a positive group size.
    #[error("group size must be positive")]
    ZeroGroupSize,
    /// The input is not a whole number of rows.
    #[error("input of {len} values is not a whole number of rows of width {cols}")]
    PartialRow {
        /// Number of input values.
        len: usize,
        /// Row width.
        cols: usize,
    },
}

impl QuantScheme {
    /// The scheme the converter picks for `bits` and `group_size` (§4): `bits ≥ 5` →
    /// int8 per-row (the group size is ignored); otherwise int4, grouped when
    /// `group_size > 0`, per-row when it is 0.
    pub fn for_bits(bits: u8, group_size: usize) -> Self {
        if bits >= 5 {
            QuantScheme::Int8Row
        } else if group_size > 0 {
            QuantScheme::Int4Grouped { group_size }
        } else {
            QuantScheme::Int4Row
        }
    }

    fn check(self, cols: usize) -> Result<(), EncodeError> {
        if cols == 0 {
            return Err(EncodeError::ZeroWidth);
        }
        if let QuantScheme::Int4Grouped { group_size: 0 } = self {
            return Err(EncodeError::ZeroGroupSize);
        }
        Ok(())
    }

    /// Bytes of one encoded row of width `cols`.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            QuantScheme::Int8Row => cols,
            QuantScheme::Int4Row | QuantScheme::Int4Grouped { .. } => cols.div_ceil(2),
        }
    }

    /// Scales of one encoded row of width `cols`.
    pub fn scales_per_row(self, cols: usize) -> usize {
        match self {
            QuantScheme::Int8Row | QuantScheme::Int4Row => 1,
            QuantScheme::Int4Grouped { group_size } => cols.div_ceil(group_size.max(1)),
        }
    }

    /// Weight bytes of a `[rows, cols]` tensor.
    pub fn weight_bytes(self, rows: usize, cols: usize) -> usize {
        rows * self.row_bytes(cols)
    }

    /// Number of `f32` scales of a `[rows, cols]` tensor.
    pub fn scale_count(self, rows: usize, cols: usize) -> usize {
        rows * self.scales_per_row(cols)
    }
}

/// Scale for a block whose largest absolute value is `amax` and whose largest code is
/// `qmax` (7 or 127).
fn scale_of(amax: f32, qmax: f32) -> f32 {
    let s = amax / qmax;
    // `f32::max` returns the other operand for NaN; inputs are checked finite upstream.
    if s > SCALE_FLOOR { s } else { SCALE_FLOOR }
}

fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn code(w: f32, s: f32, lo: f32, hi: f32) -> i32 {
    // The clip bounds are small integers, so the cast is exact.
    (w / s).round_ties_even().clamp(lo, hi) as i32
}

/// Encodes whole rows of width `cols` from `w` (row-major), appending the weight bytes
/// to `weights` and the scales to `scales`.
pub fn encode_rows(
    scheme: QuantScheme,
    w: &[f32],
    cols: usize,
    weights: &mut Vec<u8>,
    scales: &mut Vec<f32>,
) -> Result<(), EncodeError> {
    scheme.check(cols)?;
    if w.len() % cols != 0 {
        return Err(EncodeError::PartialRow { len: w.len(), cols });
    }
    let rows = w.len() / cols;
    weights.reserve(scheme.weight_bytes(rows, cols));
    scales.reserve(scheme.scale_count(rows, cols));
    for row in w.chunks_exact(cols) {
        match scheme {
            QuantScheme::Int8Row => {
                let s = scale_of(amax(row), 127.0);
                scales.push(s);
                weights.extend(
                    row.iter()
                        .map(|&v| code(v, s, -128.0, 127.0) as i8 as u8),
                );
            }
            QuantScheme::Int4Row => {
                let s = scale_of(amax(row), 7.0);
                scales.push(s);
                pack_int4(row, |_| s, weights);
            }
            QuantScheme::Int4Grouped { group_size } => {
                let first = scales.len();
                scales.extend(
                    row.chunks(group_size)
                        .map(|group| scale_of(amax(group), 7.0)),
                );
                let row_scales = &scales[first..];
                pack_int4(row, |i| row_scales[i / group_size], weights);
            }
        }
    }
    Ok(())
}

/// Packs one row as int4 nibbles with the scale of column `i` given by `scale_at(i)`.
fn pack_int4(row: &[f32], scale_at: impl Fn(usize) -> f32, out: &mut Vec<u8>) {
    let nibble = |i: usize| (code(row[i], scale_at(i), -8.0, 7.0) + 8) as u8;
    let mut i = 0;
    while i + 1 < row.len() {
        out.push(nibble(i) | (nibble(i + 1) << 4));
        i += 2;
    }
    if i < row.len() {
        // Odd width: the final high nibble is left at 0x0 (padding).
        out.push(nibble(i));
    }
}

/// Quantizes a whole `[rows, cols]` tensor; returns `(weight bytes, scales)`.
pub fn quantize(
    scheme: QuantScheme,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(Vec<u8>, Vec<f32>), EncodeError> {
    scheme.check(cols)?;
    if w.len() != rows * cols {
        return Err(EncodeError::PartialRow { len: w.len(), cols });
    }
    let mut weights = Vec::new();
    let mut scales = Vec::new();
    encode_rows(scheme, w, cols, &mut weights, &mut scales)?;
    Ok((weights, scales))
}
