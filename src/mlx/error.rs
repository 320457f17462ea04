use super::Dtype;

/// An error from MLX or from the checks this binding makes before calling it.
#[derive(Debug, thiserror::Error)]
pub enum MlxError {
    /// MLX threw a C++ exception; `message` is MLX's own text.
    #[error("mlx {op}: {message}")]
    Op { op: &'static str, message: String },
    /// An argument that this binding refuses before MLX sees it.
    #[error("mlx {op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
    /// A typed read asked for the wrong element type.
    #[error("mlx {op}: array has dtype {actual:?}, asked for {expected:?}")]
    DtypeMismatch {
        op: &'static str,
        expected: Dtype,
        actual: Dtype,
    },
    /// A writable buffer is still referenced by a view or a pending computation.
    #[error("writable buffer of {bytes} bytes is still referenced by an MLX array or computation")]
    BufferBusy { bytes: usize },
    /// A kernel backend that this build or this libmlx does not provide.
    #[error("the {backend} kernel backend is not available: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        reason: String,
    },
}

impl MlxError {
    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            op,
            message: message.into(),
        }
    }
}

/// Result alias for the binding.
pub type Result<T, E = MlxError> = std::result::Result<T, E>;
