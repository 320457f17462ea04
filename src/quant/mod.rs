//! Colibri quantization formats: descriptors, byte-arithmetic format resolution,
//! bit-exact decoders and the converter's encoders.
//!
//! The Colibri container stores no per-tensor format field; a quantized weight is a
//! flat `U8` blob plus an `F32` `.qs` scale array, and the format is inferred from the
//! two byte counts and the config-derived logical `[O, I]` shape
//! (`docs/colibri-format.md` §3.2, §3.3). [`mod@format`] holds that inference as pure
//! functions so it can be tested against the spec tables without any file, and
//! [`decode`] turns the bytes back into `f32` exactly as the spec defines.

#![forbid(unsafe_code)]

pub mod decode;
pub mod encode;
pub mod format;

pub use decode::{DecodeError, decode_row, decode_rows, scales_from_le_bytes};
pub use format::{
    FormatError, FormatQuery, FormatSource, GROUP_SIZE_CANDIDATES, QuantFormat, ResolvedFormat,
    UnsupportedFormat, resolve_format,
};
