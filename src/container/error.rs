//! Errors of the container reader. Every variant names the file, the tensor or the
//! byte range involved, so a bad download can be located without a debugger.

use std::path::PathBuf;

use crate::quant::{DecodeError, FormatError};

/// Anything that can go wrong while opening or reading a Colibri container.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// An I/O call on `path` failed.
    #[error("{path}: {source}")]
    Io {
        /// File or directory involved.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A positioned read came back short or failed.
    #[error("{path}: reading bytes {offset}..{end} failed: {source}", end = offset.saturating_add(*len))]
    ReadRange {
        /// Shard file.
        path: PathBuf,
        /// Absolute start offset.
        offset: u64,
        /// Bytes requested.
        len: u64,
        /// Underlying error (`UnexpectedEof` for a truncated file).
        #[source]
        source: std::io::Error,
    },
    /// A required file is absent.
    #[error("{path}: required file is missing")]
    MissingFile {
        /// The missing file.
        path: PathBuf,
    },
    /// The directory holds no `*.safetensors` file.
    #[error("{dir}: no *.safetensors shards found")]
    NoShards {
        /// The model directory.
        dir: PathBuf,
    },
    /// More shards than the engine's limit of 512.
    #[error("{dir}: {count} shards exceed the limit of {max}")]
    TooManyShards {
        /// The model directory.
        dir: PathBuf,
        /// Shards found.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The file is shorter than the 8-byte header length prefix.
    #[error("{path}: truncated file: {file_size} bytes, a shard needs at least 8")]
    TruncatedFile {
        /// Shard file.
        path: PathBuf,
        /// Actual size.
        file_size: u64,
    },
    /// The declared header length does not fit the file (or exceeds 512 MiB).
    #[error(
        "{path}: header length {header_len} does not fit a file of {file_size} bytes (limit {limit})"
    )]
    HeaderTooLarge {
        /// Shard file.
        path: PathBuf,
        /// Declared header length `N`.
        header_len: u64,
        /// Actual file size.
        file_size: u64,
        /// Maximum header length accepted.
        limit: u64,
    },
    /// The header is not valid UTF-8 JSON of the safetensors shape.
    #[error("{path}: invalid safetensors header: {reason}")]
    InvalidHeader {
        /// Shard file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's data range runs past the end of the file.
    #[error(
        "{path}: tensor {tensor} data bytes {begin}..{end} are out of bounds (data section is {data_len} bytes)"
    )]
    OutOfBounds {
        /// Shard file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// Relative start (`data_offsets[0]`).
        begin: u64,
        /// Relative end (`data_offsets[1]`).
        end: u64,
        /// Bytes available after the header.
        data_len: u64,
    },
    /// Two tensors of one shard share bytes.
    #[error(
        "{path}: tensors {first} (bytes {first_begin}..{first_end}) and {second} (bytes {second_begin}..{second_end}) overlap"
    )]
    Overlap {
        /// Shard file.
        path: PathBuf,
        /// Earlier tensor.
        first: String,
        /// Its relative start.
        first_begin: u64,
        /// Its relative end.
        first_end: u64,
        /// Later tensor.
        second: String,
        /// Its relative start.
        second_begin: u64,
        /// Its relative end.
        second_end: u64,
    },
    /// A float tensor's byte length disagrees with its dtype and shape.
    #[error("{path}: tensor {tensor} ({dtype:?} {shape:?}) has {len} bytes, expected {expected}")]
    SizeMismatch {
        /// Shard file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// Stored dtype.
        dtype: safetensors::Dtype,
        /// Stored shape.
        shape: Vec<u64>,
        /// Actual byte length.
        len: u64,
        /// Length implied by dtype × shape.
        expected: u64,
    },
    /// The same tensor name appears in two shards.
    #[error("tensor {tensor} appears in both {first} and {second}")]
    DuplicateTensor {
        /// Tensor name.
        tensor: String,
        /// First shard holding it.
        first: PathBuf,
        /// Second shard holding it.
        second: PathBuf,
    },
    /// Two shards stamp different formats for one tensor.
    #[error(
        "tensor {tensor}: conflicting colibri.fmt stamps {first:?} and {second:?} (second in {path})"
    )]
    StampConflict {
        /// Tensor name.
        tensor: String,
        /// First stamp seen.
        first: String,
        /// Conflicting stamp.
        second: String,
        /// Shard carrying the second stamp.
        path: PathBuf,
    },
    /// A `.qs` companion is not F32.
    #[error("{path}: scales {tensor}.qs have dtype {dtype:?}, expected F32")]
    ScalesDtype {
        /// Shard file.
        path: PathBuf,
        /// The weight name (without `.qs`).
        tensor: String,
        /// Stored dtype.
        dtype: safetensors::Dtype,
    },
    /// A `.qs` companion with no weight.
    #[error("{path}: scales {tensor}.qs have no weight tensor {tensor}")]
    OrphanScales {
        /// Shard file.
        path: PathBuf,
        /// The missing weight name.
        tensor: String,
    },
    /// A byte (`U8`/`I8`) weight without a `.qs` companion.
    #[error("{path}: tensor {tensor} is {dtype:?} but has no {tensor}.qs scales")]
    MissingScales {
        /// Shard file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// Stored dtype.
        dtype: safetensors::Dtype,
    },
    /// A tensor of a dtype this reader does not handle (or a float with `.qs`).
    #[error("{path}: tensor {tensor} has unsupported dtype {dtype:?}{note}")]
    UnsupportedDtype {
        /// Shard file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// Stored dtype.
        dtype: safetensors::Dtype,
        /// Extra context.
        note: &'static str,
    },
    /// A quantized tensor whose logical `[O, I]` the config cannot provide.
    #[error("{path}: quantized tensor {tensor} has no logical shape derivable from config.json")]
    UnknownShape {
        /// Shard file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
    },
    /// Format resolution failed for a weight.
    #[error("{path}: {source}")]
    Format {
        /// Shard holding the weight.
        path: PathBuf,
        /// The resolution error (names the tensor).
        #[source]
        source: FormatError,
    },
    /// Decoding failed (a length invariant was violated).
    #[error("tensor {tensor}: {source}")]
    Decode {
        /// Tensor name.
        tensor: String,
        /// The decoder's error.
        #[source]
        source: DecodeError,
    },
    /// A required `config.json` field is absent or null.
    #[error("{path}: missing required field {field}")]
    MissingConfigField {
        /// The config file.
        path: PathBuf,
        /// Field name (dotted for nested fields).
        field: String,
    },
    /// A JSON side file could not be parsed.
    #[error("{path}: invalid JSON: {source}")]
    InvalidJson {
        /// The file.
        path: PathBuf,
        /// Parser error.
        #[source]
        source: serde_json::Error,
    },
    /// A config value is present but unusable.
    #[error("{path}: invalid config: {reason}")]
    InvalidConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The named tensor is not in the container.
    #[error("tensor {tensor} is not in the container")]
    MissingTensor {
        /// Tensor name.
        tensor: String,
    },
    /// A requested row index is past the tensor.
    #[error("tensor {tensor}: row {row} is out of range ({rows} rows)")]
    RowOutOfRange {
        /// Tensor name.
        tensor: String,
        /// The requested row.
        row: usize,
        /// Rows available.
        rows: usize,
    },
    /// A float tensor that cannot be viewed as a 2-D matrix.
    #[error("tensor {tensor} with shape {shape:?} cannot be returned as a matrix")]
    NotAMatrix {
        /// Tensor name.
        tensor: String,
        /// Stored shape.
        shape: Vec<u64>,
    },
}

/// Result alias for the container module.
pub type Result<T, E = ContainerError> = std::result::Result<T, E>;
