//! Mixture-of-experts routing: the GLM router ([`router`]) and the batch plan
//! that groups a batch's routes into expert jobs and waves ([`plan`]).

pub mod plan;
pub mod router;

pub use plan::{BatchPlan, ExpertJob};
pub use router::{Router, RouterConfig, Routes};

use crate::mlx::MlxError;

/// An error from routing or planning.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// The router configuration cannot describe a GLM/DeepSeek gate.
    #[error("invalid router configuration: {0}")]
    Config(String),
    /// An input array or host buffer has the wrong shape.
    #[error("{what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: String,
        actual: String,
    },
    /// A score, bias or weight is NaN or infinite.
    #[error("{what} at row {row}, expert {expert} is not finite ({value})")]
    NonFinite {
        what: &'static str,
        row: usize,
        expert: usize,
        value: f32,
    },
    /// An expert id outside `0..n_experts`.
    #[error("row {row} rank {rank}: expert id {expert} is out of range 0..{n_experts}")]
    ExpertOutOfRange {
        row: usize,
        rank: usize,
        expert: u32,
        n_experts: u32,
    },
    /// The same expert appears twice in one row.
    #[error("row {row}: expert {expert} is routed twice")]
    DuplicateExpert { row: usize, expert: u32 },
    /// A wave must hold at least one expert.
    #[error("the wave capacity must be at least 1 expert")]
    EmptyWave,
    /// MLX failed while computing the router scores.
    #[error(transparent)]
    Mlx(#[from] MlxError),
}
