//! Quantized-weight descriptors and the §3.3 format resolution.
//!
//! A Colibri quantized weight carries no format tag, so the reader must infer it
//! from `nb` (weight bytes), `ns` (`.qs` bytes) and the logical `[O, I]` taken from
//! `config.json`. [`resolve_format`] is that inference as a pure function: no file,
//! no config, so every rule of the spec (candidate order, the `o_proj` collision,
//! the params tie-breaker, the refusals) is testable on plain numbers.
//!
//! Only the three formats the GLM container uses are decodable: int8 per-row,
//! int4 per-row and int4 grouped. Every other format the engine knows is recognised
//! by its byte arithmetic and refused by name ([`UnsupportedFormat`]) so that a
//! container built with other options fails loudly instead of decoding garbage.

use std::fmt;

/// Group sizes tried, in this order, for an int4 weight whose scale count exceeds
/// one per row (§3.3 step 3). A candidate larger than the row width is skipped.
pub const GROUP_SIZE_CANDIDATES: [u32; 8] = [16, 32, 48, 64, 96, 128, 192, 256];

/// Shape and encoding of one decodable quantized weight.
///
/// * int8 per-row: `bits == 8`, `group_size == None`.
/// * int4 per-row: `bits == 4`, `group_size == None`.
/// * int4 grouped: `bits == 4`, `group_size == Some(gs)`.
///
/// The size helpers saturate instead of overflowing, so an absurd shape can never
/// match a real byte count and never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    /// Bits per stored value: 8 or 4.
    pub bits: u8,
    /// Columns per scale for int4 grouped; `None` means one scale per row.
    pub group_size: Option<u32>,
    /// Logical output rows `O`.
    pub rows: usize,
    /// Logical input columns `I`.
    pub cols: usize,
}

impl QuantFormat {
    /// int8 per-row (`int8-row`, engine fmt 1).
    pub fn int8_row(rows: usize, cols: usize) -> Self {
        Self {
            bits: 8,
            group_size: None,
            rows,
            cols,
        }
    }

    /// int4 per-row (`int4-row`, engine fmt 2).
    pub fn int4_row(rows: usize, cols: usize) -> Self {
        Self {
            bits: 4,
            group_size: None,
            rows,
            cols,
        }
    }

    /// int4 grouped with `group_size` columns per scale (`int4-grouped`, fmt 4).
    pub fn int4_grouped(rows: usize, cols: usize, group_size: u32) -> Self {
        Self {
            bits: 4,
            group_size: Some(group_size),
            rows,
            cols,
        }
    }

    /// The registry name of the format (`int8-row`, `int4-row`, `int4-grouped`).
    pub fn name(&self) -> &'static str {
        match (self.bits, self.group_size) {
            (8, _) => "int8-row",
            (4, None) => "int4-row",
            (4, Some(_)) => "int4-grouped",
            _ => "invalid",
        }
    }

    /// Checks that the descriptor is one of the three decodable formats: bits 8
    /// without a group size, or bits 4 with no group size or a non-zero one.
    pub fn validate(&self) -> Result<(), FormatError> {
        let ok = match (self.bits, self.group_size) {
            (8, None) | (4, None) => true,
            (4, Some(gs)) => gs > 0,
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(FormatError::InvalidDescriptor { format: *self })
        }
    }

    /// Bytes per stored row: `I` for int8, `ceil(I/2)` for int4.
    pub fn row_stride_bytes(&self) -> usize {
        if self.bits == 8 {
            self.cols
        } else {
            self.cols.div_ceil(2)
        }
    }

    /// Total weight bytes `O · row_stride` (saturating).
    pub fn weight_bytes(&self) -> usize {
        self.rows.saturating_mul(self.row_stride_bytes())
    }

    /// Scales per row: 1 for per-row formats, `ceil(I/gs)` for grouped.
    pub fn groups_per_row(&self) -> usize {
        match self.group_size {
            Some(gs) if gs > 0 => self.cols.div_ceil(gs as usize),
            _ => 1,
        }
    }

    /// Columns covered by one scale: the group size, or the whole row.
    pub fn scale_span(&self) -> usize {
        match self.group_size {
            Some(gs) if gs > 0 => gs as usize,
            _ => self.cols.max(1),
        }
    }

    /// Total `.qs` entries `O · groups_per_row` (saturating).
    pub fn scale_count(&self) -> usize {
        self.rows.saturating_mul(self.groups_per_row())
    }

    /// Total `.qs` bytes (4 per F32 scale, saturating).
    pub fn scale_bytes(&self) -> usize {
        self.scale_count().saturating_mul(4)
    }

    /// Logical element count `O · I` (saturating).
    pub fn numel(&self) -> usize {
        self.rows.saturating_mul(self.cols)
    }
}

impl fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.group_size {
            Some(gs) => write!(f, "{}(gs={gs}) [{}, {}]", self.name(), self.rows, self.cols),
            None => write!(f, "{} [{}, {}]", self.name(), self.rows, self.cols),
        }
    }
}

/// A format the engine knows but this crate refuses to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnsupportedFormat {
    /// E8 / IQ3 lattice (fmt 6): `ns == 4` and 98 bytes per 256 weights.
    E8Lattice,
    /// int2 per-row (fmt 3): `ceil(I/4)` bytes per row.
    Int2Row,
    /// int3 with 64-column groups (fmt 5): 24 bytes per group.
    Int3G64,
    /// fp8 e4m3 with F32 128×128 block scales (fmt 8).
    Fp8B128,
    /// fp8 e4m3 with one-byte UE8M0 block scales (refused by the engine too).
    Fp8Ue8m0,
    /// MXFP4 (fmt 7, Kimi only); only reachable through a stamp.
    Mxfp4,
    /// rANS entropy-coded int4 (`int4-rans256-g0`); only reachable through a stamp.
    Int4Rans256,
}

impl UnsupportedFormat {
    /// The registry name used in `colibri.fmt` stamps and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Self::E8Lattice => "e8-iq3-lattice",
            Self::Int2Row => "int2-row",
            Self::Int3G64 => "int3-g64",
            Self::Fp8B128 => "fp8-e4m3-b128",
            Self::Fp8Ue8m0 => "fp8-e4m3-b128 (UE8M0 block scales)",
            Self::Mxfp4 => "mxfp4",
            Self::Int4Rans256 => "int4-rans256-g0",
        }
    }
}

impl fmt::Display for UnsupportedFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a weight's format could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The byte counts identify a format this crate does not decode.
    #[error("unsupported format {format} for tensor {tensor}")]
    Unsupported {
        /// Tensor name.
        tensor: String,
        /// The recognised format.
        format: UnsupportedFormat,
    },
    /// The weight byte count fits none of the known formats for `[O, I]`.
    #[error(
        "tensor {tensor}: {weight_bytes} weight bytes and {scale_bytes} scale bytes match no \
         known format for logical shape [{rows}, {cols}]"
    )]
    NoMatch {
        /// Tensor name.
        tensor: String,
        /// `nb`.
        weight_bytes: u64,
        /// `ns`.
        scale_bytes: u64,
        /// `O`.
        rows: usize,
        /// `I`.
        cols: usize,
    },
    /// The weight bytes identify a format but the `.qs` size is wrong for it.
    #[error(
        "tensor {tensor}: .qs has {scale_bytes} bytes but {format} needs {expected_bytes} \
         ({weight_bytes} weight bytes)"
    )]
    ScaleCount {
        /// Tensor name.
        tensor: String,
        /// Name of the format the weight bytes point to.
        format: &'static str,
        /// `nb`.
        weight_bytes: u64,
        /// `ns`.
        scale_bytes: u64,
        /// `.qs` bytes that format requires.
        expected_bytes: u64,
    },
    /// A `colibri.fmt` stamp names a format this crate has never heard of.
    #[error("tensor {tensor}: unknown colibri.fmt stamp {stamp:?}")]
    UnknownStamp {
        /// Tensor name.
        tensor: String,
        /// The stamp text.
        stamp: String,
    },
    /// A stamp names a decodable format whose byte arithmetic does not hold.
    #[error(
        "tensor {tensor}: colibri.fmt stamp {stamp:?} does not fit {weight_bytes} weight bytes \
         and {scale_bytes} scale bytes for [{rows}, {cols}]"
    )]
    StampMismatch {
        /// Tensor name.
        tensor: String,
        /// The stamp text.
        stamp: String,
        /// `nb`.
        weight_bytes: u64,
        /// `ns`.
        scale_bytes: u64,
        /// `O`.
        rows: usize,
        /// `I`.
        cols: usize,
    },
    /// The logical shape has a zero dimension.
    #[error("tensor {tensor}: logical shape [{rows}, {cols}] has a zero dimension")]
    EmptyShape {
        /// Tensor name.
        tensor: String,
        /// `O`.
        rows: usize,
        /// `I`.
        cols: usize,
    },
    /// A hand-built descriptor is not one of the decodable formats.
    #[error("invalid quantization descriptor {format:?}")]
    InvalidDescriptor {
        /// The offending descriptor.
        format: QuantFormat,
    },
}

/// Everything §3.3 needs to resolve one weight's format.
#[derive(Debug, Clone, Copy)]
pub struct FormatQuery<'a> {
    /// Tensor name, used only in error messages.
    pub tensor: &'a str,
    /// `nb`: bytes of the `U8` weight blob.
    pub weight_bytes: u64,
    /// `ns`: bytes of the `F32` `.qs` companion.
    pub scale_bytes: u64,
    /// Logical `O` from the config.
    pub rows: usize,
    /// Logical `I` from the config.
    pub cols: usize,
    /// `group_size` from the converter's params file, if any (0 means per-row and
    /// should be passed as `None`).
    pub group_size_hint: Option<u32>,
    /// The tensor's `colibri.fmt` stamp, if any shard carries one.
    pub stamp: Option<&'a str>,
}

/// What decided the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatSource {
    /// Byte arithmetic alone (the normal case).
    ByteCounts,
    /// Several group sizes fit; the params `group_size` picked one.
    ParamsGroupSize,
    /// A `colibri.fmt` stamp named the format (the byte counts were verified).
    Stamp,
}

/// A resolved, decodable format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedFormat {
    /// The descriptor to decode with.
    pub format: QuantFormat,
    /// What decided it.
    pub source: FormatSource,
}

// Checked arithmetic on u64; `None` on overflow (which can then match nothing).
fn mul(a: u64, b: u64) -> Option<u64> {
    a.checked_mul(b)
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Per-tensor byte facts shared by the stamped and unstamped paths.
struct Geometry {
    o: u64,
    i: u64,
    nb: u64,
    ns: u64,
}

impl Geometry {
    fn is_int8_bytes(&self) -> bool {
        mul(self.o, self.i) == Some(self.nb)
    }
    fn is_int4_bytes(&self) -> bool {
        mul(self.o, ceil_div(self.i, 2)) == Some(self.nb)
    }
    fn is_int2_bytes(&self) -> bool {
        mul(self.o, ceil_div(self.i, 4)) == Some(self.nb)
    }
    fn is_int3_bytes(&self) -> bool {
        mul(self.o, ceil_div(self.i, 64)).and_then(|x| mul(x, 24)) == Some(self.nb)
    }
    fn is_e8(&self) -> bool {
        self.ns == 4 && mul(self.o, ceil_div(self.i, 256)).and_then(|x| mul(x, 98)) == Some(self.nb)
    }
    fn per_row_scale_bytes(&self) -> Option<u64> {
        mul(self.o, 4)
    }
    fn grouped_scale_bytes(&self, gs: u64) -> Option<u64> {
        mul(self.o, ceil_div(self.i, gs)).and_then(|x| mul(x, 4))
    }
    fn b128_blocks(&self) -> Option<u64> {
        mul(ceil_div(self.o, 128), ceil_div(self.i, 128))
    }

    /// §3.3 step 3: the group size for an int4 weight. The params hint wins when
    /// its scale count fits; otherwise the first fitting candidate (skipping
    /// `gs > I`); `None` when nothing fits.
    fn pick_group_size(&self, hint: Option<u32>) -> (Option<u32>, FormatSource) {
        let fits = |gs: u32| gs > 0 && self.grouped_scale_bytes(u64::from(gs)) == Some(self.ns);
        let first = GROUP_SIZE_CANDIDATES
            .iter()
            .copied()
            .filter(|&gs| u64::from(gs) <= self.i)
            .find(|&gs| fits(gs));
        match hint {
            Some(h) if fits(h) => {
                // The hint only "decides" when byte arithmetic alone would have
                // picked something else (or nothing).
                let source = if first == Some(h) {
                    FormatSource::ByteCounts
                } else {
                    FormatSource::ParamsGroupSize
                };
                (Some(h), source)
            }
            _ => (first, FormatSource::ByteCounts),
        }
    }
}

/// Resolves the format of one quantized weight following §3.3 of the spec.
///
/// Without a stamp: E8 check, then weight-byte match (int8, int4, int2, int3, first
/// hit wins), then the scale count picks per-row / grouped / block formats. The
/// `o_proj` collision (int8 per-row and fp8-b128 scale counts equal) resolves to
/// int8 per-row. With a stamp: the stamp names the format and the byte counts are
/// verified against it.
pub fn resolve_format(q: &FormatQuery<'_>) -> Result<ResolvedFormat, FormatError> {
    if q.rows == 0 || q.cols == 0 {
        return Err(FormatError::EmptyShape {
            tensor: q.tensor.to_owned(),
            rows: q.rows,
            cols: q.cols,
        });
    }
    let g = Geometry {
        o: q.rows as u64,
        i: q.cols as u64,
        nb: q.weight_bytes,
        ns: q.scale_bytes,
    };
    match q.stamp {
        Some(stamp) => resolve_stamped(q, &g, stamp),
        None => resolve_unstamped(q, &g),
    }
}

fn unsupported(q: &FormatQuery<'_>, format: UnsupportedFormat) -> FormatError {
    FormatError::Unsupported {
        tensor: q.tensor.to_owned(),
        format,
    }
}

fn no_match(q: &FormatQuery<'_>) -> FormatError {
    FormatError::NoMatch {
        tensor: q.tensor.to_owned(),
        weight_bytes: q.weight_bytes,
        scale_bytes: q.scale_bytes,
        rows: q.rows,
        cols: q.cols,
    }
}

fn scale_count(q: &FormatQuery<'_>, format: &'static str, expected: Option<u64>) -> FormatError {
    FormatError::ScaleCount {
        tensor: q.tensor.to_owned(),
        format,
        weight_bytes: q.weight_bytes,
        scale_bytes: q.scale_bytes,
        expected_bytes: expected.unwrap_or(u64::MAX),
    }
}

fn resolve_unstamped(q: &FormatQuery<'_>, g: &Geometry) -> Result<ResolvedFormat, FormatError> {
    let per_row = g.per_row_scale_bytes();
    // Step 1: E8. A per-row interpretation that also fits exactly (only possible
    // for tiny shapes such as O = 1) wins, mirroring the engine's collision refusal
    // at I = 98 being irrelevant to GLM.
    if g.is_e8() && !((g.is_int8_bytes() || g.is_int4_bytes()) && per_row == Some(g.ns)) {
        return Err(unsupported(q, UnsupportedFormat::E8Lattice));
    }
    // Step 2: weight-byte match, first hit wins.
    if g.is_int8_bytes() {
        // Step 4: int8 family.
        if per_row == Some(g.ns) {
            return Ok(ResolvedFormat {
                format: QuantFormat::int8_row(q.rows, q.cols),
                source: FormatSource::ByteCounts,
            });
        }
        let blocks = g.b128_blocks();
        if blocks.and_then(|b| mul(b, 4)) == Some(g.ns) {
            return Err(unsupported(q, UnsupportedFormat::Fp8B128));
        }
        if blocks == Some(g.ns) {
            return Err(unsupported(q, UnsupportedFormat::Fp8Ue8m0));
        }
        return Err(scale_count(q, "int8-row", per_row));
    }
    if g.is_int4_bytes() {
        // Step 3: int4 family.
        if per_row.is_some_and(|p| g.ns > p) {
            if let (Some(gs), source) = g.pick_group_size(q.group_size_hint) {
                return Ok(ResolvedFormat {
                    format: QuantFormat::int4_grouped(q.rows, q.cols, gs),
                    source,
                });
            }
        }
        // Step 5: per-row must then match exactly.
        if per_row == Some(g.ns) {
            return Ok(ResolvedFormat {
                format: QuantFormat::int4_row(q.rows, q.cols),
                source: FormatSource::ByteCounts,
            });
        }
        return Err(scale_count(q, "int4-row", per_row));
    }
    if g.is_int2_bytes() {
        return Err(unsupported(q, UnsupportedFormat::Int2Row));
    }
    if g.is_int3_bytes() {
        return Err(unsupported(q, UnsupportedFormat::Int3G64));
    }
    Err(no_match(q))
}

fn resolve_stamped(
    q: &FormatQuery<'_>,
    g: &Geometry,
    stamp: &str,
) -> Result<ResolvedFormat, FormatError> {
    let mismatch = || FormatError::StampMismatch {
        tensor: q.tensor.to_owned(),
        stamp: stamp.to_owned(),
        weight_bytes: q.weight_bytes,
        scale_bytes: q.scale_bytes,
        rows: q.rows,
        cols: q.cols,
    };
    let stamped = |format| {
        Ok(ResolvedFormat {
            format,
            source: FormatSource::Stamp,
        })
    };
    let per_row = g.per_row_scale_bytes() == Some(g.ns);
    match stamp {
        "int8-row" if g.is_int8_bytes() && per_row => {
            stamped(QuantFormat::int8_row(q.rows, q.cols))
        }
        "int4-row" if g.is_int4_bytes() && per_row => {
            stamped(QuantFormat::int4_row(q.rows, q.cols))
        }
        "int4-grouped" if g.is_int4_bytes() => match g.pick_group_size(q.group_size_hint).0 {
            Some(gs) => stamped(QuantFormat::int4_grouped(q.rows, q.cols, gs)),
            None => Err(mismatch()),
        },
        "int8-row" | "int4-row" | "int4-grouped" | "f32" => Err(mismatch()),
        "int2-row" => Err(unsupported(q, UnsupportedFormat::Int2Row)),
        "int3-g64" => Err(unsupported(q, UnsupportedFormat::Int3G64)),
        "e8-iq3-lattice" => Err(unsupported(q, UnsupportedFormat::E8Lattice)),
        "mxfp4" => Err(unsupported(q, UnsupportedFormat::Mxfp4)),
        "fp8-e4m3-b128" => Err(unsupported(q, UnsupportedFormat::Fp8B128)),
        "int4-rans256-g0" => Err(unsupported(q, UnsupportedFormat::Int4Rans256)),
        _ => Err(FormatError::UnknownStamp {
            tensor: q.tensor.to_owned(),
            stamp: stamp.to_owned(),
        }),
    }
}
