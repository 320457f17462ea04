//! Errors of the resident weights view.

use std::path::PathBuf;

use crate::container::ContainerError;
use crate::mlx::MlxError;
use crate::quant::DecodeError;

/// Why a resident weight could not be returned.
///
/// Every variant names the tensor it was asked for; file errors also name the
/// shard file.
#[derive(Debug, thiserror::Error)]
pub enum ResidentError {
    /// A routed expert was asked for. The resident view never loads routed
    /// experts, not even when their shard is open for other tensors.
    #[error(
        "tensor {name}: routed experts require the streamed expert backend \
         (layer {layer}, expert {expert}); the resident weights view never loads them"
    )]
    RoutedExpert {
        /// Tensor name.
        name: String,
        /// Layer of the expert.
        layer: usize,
        /// Expert id.
        expert: usize,
    },
    /// A name that is not in the resident set: unknown to the container, or an
    /// MTP tensor while `include_mtp` is off.
    #[error("tensor {name} is outside the resident GLM weight set: {reason}")]
    NotResident {
        /// Tensor name.
        name: String,
        /// Why (`not in the container`, `MTP tensors are excluded ...`).
        reason: &'static str,
    },
    /// The caller's `[rows, cols]` differ from the tensor's descriptor.
    #[error(
        "tensor {name}: asked for [{rows}, {cols}] but the {format} tensor is \
         [{actual_rows}, {actual_cols}]"
    )]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// Rows of the descriptor.
        actual_rows: usize,
        /// Columns of the descriptor.
        actual_cols: usize,
        /// Format label (`int4-g64`, `int8-row`, `F32`, ...).
        format: String,
    },
    /// A float tensor of rank > 2 asked for as a matrix.
    #[error("tensor {name}: stored shape {shape:?} is not a matrix")]
    NotAMatrix {
        /// Tensor name.
        name: String,
        /// Stored shape.
        shape: Vec<u64>,
    },
    /// The input of a linear does not end in `cols`, or is not a float array.
    #[error("linear {name}: input {shape:?} ({dtype}) does not fit {cols} input columns: {reason}")]
    BadInput {
        /// Tensor name.
        name: String,
        /// Shape of the input.
        shape: Vec<i32>,
        /// Dtype of the input, as text.
        dtype: String,
        /// Input columns of the weight.
        cols: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A token id at or past the vocabulary size (checked before any gather:
    /// MLX gathers do not bounds-check).
    #[error("embedding {name}: token id {id} at position {position} is out of range 0..{vocab}")]
    TokenOutOfRange {
        /// Tensor name.
        name: String,
        /// The bad id.
        id: u32,
        /// Its position in the id list.
        position: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A dimension too large for MLX's `i32` shapes.
    #[error("tensor {name}: dimension {value} exceeds MLX's i32 shapes")]
    TooLarge {
        /// Tensor name.
        name: String,
        /// The dimension.
        value: usize,
    },
    /// The shard file could not be opened (deleted or moved after open, no
    /// permission, ...).
    #[error("tensor {name}: cannot open shard {path}: {source}")]
    ShardOpen {
        /// Tensor name.
        name: String,
        /// Shard file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The shard file is not the one the container was opened on.
    #[error("tensor {name}: shard {path} changed since the container was opened: {reason}")]
    ShardChanged {
        /// Tensor name.
        name: String,
        /// Shard file.
        path: PathBuf,
        /// What changed.
        reason: String,
    },
    /// A positioned read failed.
    #[error("tensor {name}: reading {len} bytes at offset {offset} of {path} failed: {source}")]
    Read {
        /// Tensor name.
        name: String,
        /// Shard file.
        path: PathBuf,
        /// Absolute offset.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// The bytes could not be decoded (lengths inconsistent with the format).
    #[error("tensor {name}: {source}")]
    Decode {
        /// Tensor name.
        name: String,
        /// The decoder's error.
        source: DecodeError,
    },
    /// An MLX operation failed.
    #[error("tensor {name}: {context}: {source}")]
    Mlx {
        /// Tensor name.
        name: String,
        /// What was being done.
        context: &'static str,
        /// MLX's error.
        source: MlxError,
    },
    /// Opening the container failed.
    #[error(transparent)]
    Container(#[from] ContainerError),
    /// A [`ResidentOptions`](super::ResidentOptions) value out of range.
    #[error("invalid resident option: {0}")]
    InvalidOption(String),
    /// An internal invariant of the view did not hold (a bug, reported
    /// instead of panicking).
    #[error("internal error in the resident weights view: {0}")]
    Internal(String),
}

/// Result alias of the resident view.
pub type Result<T, E = ResidentError> = std::result::Result<T, E>;

/// Adds the tensor name and a context to MLX errors.
pub(crate) trait MlxContext<T> {
    fn ctx(self, name: &str, context: &'static str) -> Result<T>;
}

impl<T> MlxContext<T> for std::result::Result<T, MlxError> {
    fn ctx(self, name: &str, context: &'static str) -> Result<T> {
        self.map_err(|source| ResidentError::Mlx {
            name: name.to_owned(),
            context,
            source,
        })
    }
}
