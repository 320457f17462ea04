//! Bit-exact decoders from Colibri quantized bytes to `f32` (§3.2).
//!
//! Every value is `float(q) · scale` computed in `f32`: `q` is exact in `f32`, so
//! the only rounding is the single multiply, which is what the spec and the
//! engine's kernels produce. The int4 path first expands a row to unscaled
//! `n − 8` values through a 256-entry table of nibble pairs (exact), then scales
//! each group in place; the result is identical bit for bit to a per-element
//! reference and much faster.
//!
//! All entry points validate their slice lengths and return [`DecodeError`]
//! instead of panicking, because the lengths ultimately come from files.

use super::format::{FormatError, QuantFormat};

/// Why a decode call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The descriptor is not a decodable format.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The weight slice has the wrong length.
    #[error("{format}: weight slice has {got} bytes, expected {expected}")]
    WeightLength {
        /// The format being decoded.
        format: QuantFormat,
        /// Bytes required.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The scale slice has the wrong length.
    #[error("{format}: scale slice has {got} entries, expected {expected}")]
    ScaleLength {
        /// The format being decoded.
        format: QuantFormat,
        /// Scales required.
        expected: usize,
        /// Scales given.
        got: usize,
    },
    /// The output slice has the wrong length.
    #[error("{format}: output slice has {got} elements, expected {expected}")]
    OutputLength {
        /// The format being decoded.
        format: QuantFormat,
        /// Elements required.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// The requested rows run past the tensor.
    #[error("{format}: rows {first}..{first}+{count} are out of range")]
    RowRange {
        /// The format being decoded.
        format: QuantFormat,
        /// First requested row.
        first: usize,
        /// Number of requested rows.
        count: usize,
    },
    /// Raw `.qs` bytes are not a whole number of F32 values.
    #[error("scale bytes: length {len} is not a multiple of 4")]
    ScaleBytes {
        /// The byte length given.
        len: usize,
    },
}

/// `(low − 8, high − 8)` as `f32` for every byte value: column `2j` is the low
/// nibble, column `2j + 1` the high nibble.
const NIBBLE_PAIRS: [[f32; 2]; 256] = {
    let mut table = [[0.0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = [((b & 0x0F) as i32 - 8) as f32, ((b >> 4) as i32 - 8) as f32];
        b += 1;
    }
    table
};

/// Converts raw little-endian F32 bytes (a `.qs` tensor) to scales.
pub fn scales_from_le_bytes(bytes: &[u8]) -> Result<Vec<f32>, DecodeError> {
    if bytes.len() % 4 != 0 {
        return Err(DecodeError::ScaleBytes { len: bytes.len() });
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Decodes rows `first_row .. first_row + n_rows` of a whole quantized tensor.
///
/// `weight` and `scales` must be the complete tensor (`format.weight_bytes()`
/// bytes and `format.scale_count()` scales); `out` must hold exactly
/// `n_rows · cols` values and receives them row-major.
pub fn decode_rows(
    format: &QuantFormat,
    weight: &[u8],
    scales: &[f32],
    first_row: usize,
    n_rows: usize,
    out: &mut [f32],
) -> Result<(), DecodeError> {
    format.validate()?;
    let stride = format.row_stride_bytes();
    let groups = format.groups_per_row();
    check_len(format, weight.len(), format.weight_bytes(), Kind::Weight)?;
    check_len(format, scales.len(), format.scale_count(), Kind::Scale)?;
    let end = first_row
        .checked_add(n_rows)
        .filter(|&e| e <= format.rows)
        .ok_or(DecodeError::RowRange {
            format: *format,
            first: first_row,
            count: n_rows,
        })?;
    let expected_out = n_rows
        .checked_mul(format.cols)
        .ok_or(DecodeError::RowRange {
            format: *format,
            first: first_row,
            count: n_rows,
        })?;
    check_len(format, out.len(), expected_out, Kind::Output)?;
    if format.cols == 0 || n_rows == 0 {
        return Ok(());
    }
    // Lengths are validated above, so these slices are exactly the selected rows.
    let w_rows = weight
        .get(first_row * stride..end * stride)
        .unwrap_or_default();
    let s_rows = scales
        .get(first_row * groups..end * groups)
        .unwrap_or_default();
    for ((row_out, row_w), row_s) in out
        .chunks_exact_mut(format.cols)
        .zip(w_rows.chunks_exact(stride))
        .zip(s_rows.chunks_exact(groups))
    {
        decode_row_unchecked(format, row_w, row_s, row_out);
    }
    Ok(())
}

/// Decodes one row given only that row's bytes (`row_stride_bytes()` of them) and
/// its scales (`groups_per_row()` of them) into `out` (`cols` values). This is the
/// gather path for embedding lookups, where only the wanted rows are read.
pub fn decode_row(
    format: &QuantFormat,
    row_bytes: &[u8],
    row_scales: &[f32],
    out: &mut [f32],
) -> Result<(), DecodeError> {
    format.validate()?;
    check_len(
        format,
        row_bytes.len(),
        format.row_stride_bytes(),
        Kind::Weight,
    )?;
    check_len(
        format,
        row_scales.len(),
        format.groups_per_row(),
        Kind::Scale,
    )?;
    check_len(format, out.len(), format.cols, Kind::Output)?;
    decode_row_unchecked(format, row_bytes, row_scales, out);
    Ok(())
}

enum Kind {
    Weight,
    Scale,
    Output,
}

fn check_len(
    format: &QuantFormat,
    got: usize,
    expected: usize,
    kind: Kind,
) -> Result<(), DecodeError> {
    if got == expected {
        return Ok(());
    }
    let format = *format;
    Err(match kind {
        Kind::Weight => DecodeError::WeightLength {
            format,
            expected,
            got,
        },
        Kind::Scale => DecodeError::ScaleLength {
            format,
            expected,
            got,
        },
        Kind::Output => DecodeError::OutputLength {
            format,
            expected,
            got,
        },
    })
}

/// Decodes one row; the caller guarantees the three lengths. Never indexes out of
/// bounds even if they were wrong (zips stop at the shortest slice).
fn decode_row_unchecked(format: &QuantFormat, row: &[u8], scales: &[f32], out: &mut [f32]) {
    if format.bits == 8 {
        let s = scales.first().copied().unwrap_or(0.0);
        for (o, &b) in out.iter_mut().zip(row) {
            *o = f32::from(b as i8) * s;
        }
        return;
    }
    // int4: expand nibble pairs (exact), then one multiply per value by its
    // group's scale. Odd widths: the final high nibble is padding and skipped.
    let mut pairs = out.chunks_exact_mut(2);
    for (pair, &b) in (&mut pairs).zip(row) {
        let [lo, hi] = NIBBLE_PAIRS[usize::from(b)];
        pair[0] = lo;
        pair[1] = hi;
    }
    if let ([last], Some(&b)) = (pairs.into_remainder(), row.get(format.cols / 2)) {
        *last = NIBBLE_PAIRS[usize::from(b)][0];
    }
    for (group, &s) in out.chunks_mut(format.scale_span()).zip(scales) {
        for v in group {
            *v *= s;
        }
    }
}
