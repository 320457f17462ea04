//! Errors of the model graph.

use std::fmt;
use std::path::PathBuf;

use crate::container::ContainerError;
use crate::executor::ExecutorError;
use crate::experts::ExpertError;
use crate::mlx::MlxError;
use crate::moe::MoeError;
use crate::resident::ResidentError;

/// Where in the model an error happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// Opening the model (config, expert pool).
    Setup,
    /// The token embedding.
    Embedding,
    /// Decoder layer `n`.
    Layer(usize),
    /// The final norm and the LM head.
    Head,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Setup => f.write_str("setup"),
            Self::Embedding => f.write_str("embedding"),
            Self::Layer(l) => write!(f, "layer {l}"),
            Self::Head => f.write_str("head"),
        }
    }
}

/// An error of [`Glm52Model`](super::Glm52Model). Errors from the weights,
/// MLX, the router and the expert executor name the site (layer) they come
/// from.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` names another architecture.
    #[error("{dir}: model_type {found:?} is not \"glm_moe_dsa\"")]
    UnsupportedModelType {
        /// The model directory.
        dir: PathBuf,
        /// The `model_type` found.
        found: String,
    },
    /// A configuration this implementation does not run (e.g. YaRN RoPE).
    #[error("unsupported configuration: {0}")]
    UnsupportedConfig(String),
    /// Opening the container failed.
    #[error("opening the container: {0}")]
    Container(Box<ContainerError>),
    /// A resident weight could not be read or applied.
    #[error("{site}: {source}")]
    Weights {
        /// Where.
        site: Site,
        /// The weights error.
        source: Box<ResidentError>,
    },
    /// A weight is present but unusable (shape, non-finite values).
    #[error("{site}: tensor {name}: {reason}")]
    BadWeight {
        /// Where.
        site: Site,
        /// Tensor name.
        name: String,
        /// Why.
        reason: String,
    },
    /// An MLX operation failed.
    #[error("{site}: {what}: {source}")]
    Mlx {
        /// Where.
        site: Site,
        /// The step that failed.
        what: &'static str,
        /// The MLX error.
        source: Box<MlxError>,
    },
    /// Routing failed (non-finite scores, bad configuration).
    #[error("layer {layer}: routing: {source}")]
    Routing {
        /// MoE layer.
        layer: usize,
        /// The router error.
        source: Box<MoeError>,
    },
    /// The streamed expert executor failed.
    #[error("layer {layer}: routed experts: {source}")]
    Experts {
        /// MoE layer.
        layer: usize,
        /// The executor error.
        source: Box<ExecutorError>,
    },
    /// The expert pool could not be set up.
    #[error("setting up the expert pool: {0}")]
    ExpertPool(Box<ExpertError>),
    /// The expert executor could not be set up.
    #[error("setting up the expert executor: {0}")]
    ExpertExecutor(Box<ExecutorError>),
    /// `forward` was called without ids.
    #[error("no token ids to run")]
    EmptyInput,
    /// A token id outside the vocabulary.
    #[error("token id {id} at input index {index} is out of range 0..{vocab}")]
    TokenOutOfRange {
        /// Index in the ids passed.
        index: usize,
        /// The id.
        id: u32,
        /// `vocab_size`.
        vocab: usize,
    },
    /// The positions would exceed `max_position_embeddings`.
    #[error("positions {start}..{end} exceed max_position_embeddings {max}")]
    ContextOverflow {
        /// First position of the call.
        start: usize,
        /// One past the last position of the call.
        end: usize,
        /// `max_position_embeddings`.
        max: usize,
    },
    /// The cache was made for a model of another shape.
    #[error("the cache does not belong to this model: {0}")]
    CacheMismatch(String),
    /// The model was opened without an MTP head, or the container has none.
    #[error("no MTP head: {0}")]
    NoMtp(String),
    /// Recording the routing trace failed.
    #[error("layer {layer}: routing trace: {source}")]
    RoutingTrace {
        /// MoE layer.
        layer: usize,
        /// The trace error.
        source: Box<crate::experts::TraceError>,
    },
}

/// Attaches a [`Site`] to MLX errors.
pub(crate) trait MlxAt<T> {
    fn at(self, site: Site, what: &'static str) -> Result<T, ModelError>;
}

impl<T> MlxAt<T> for Result<T, MlxError> {
    fn at(self, site: Site, what: &'static str) -> Result<T, ModelError> {
        self.map_err(|source| ModelError::Mlx {
            site,
            what,
            source: Box::new(source),
        })
    }
}

/// Attaches a [`Site`] to resident-weights errors.
pub(crate) trait WeightsAt<T> {
    fn at(self, site: Site) -> Result<T, ModelError>;
}

impl<T> WeightsAt<T> for Result<T, ResidentError> {
    fn at(self, site: Site) -> Result<T, ModelError> {
        self.map_err(|source| ModelError::Weights {
            site,
            source: Box::new(source),
        })
    }
}

impl From<ContainerError> for ModelError {
    fn from(e: ContainerError) -> Self {
        Self::Container(Box::new(e))
    }
}

impl From<ExpertError> for ModelError {
    fn from(e: ExpertError) -> Self {
        Self::ExpertPool(Box::new(e))
    }
}

impl From<ExecutorError> for ModelError {
    fn from(e: ExecutorError) -> Self {
        Self::ExpertExecutor(Box::new(e))
    }
}
