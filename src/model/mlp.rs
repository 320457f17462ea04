//! The SwiGLU feed-forward block: the dense MLP of the first layers and the
//! shared expert of MoE layers, `down(silu(gate(x)) ⊙ up(x))`.

use crate::mlx::Array;
use crate::resident::Glm52WeightSource;

use super::error::{MlxAt, WeightsAt};
use super::{ModelError, Site};

/// A SwiGLU block read through [`Glm52WeightSource::linear`].
#[derive(Debug, Clone)]
pub struct SwiGlu {
    site: Site,
    gate: String,
    up: String,
    down: String,
    hidden: usize,
    width: usize,
}

impl SwiGlu {
    /// The block under `prefix` (e.g. `model.layers.0.mlp` or
    /// `model.layers.3.mlp.shared_experts`) of width `width`.
    pub fn new(site: Site, prefix: &str, hidden: usize, width: usize) -> Self {
        Self {
            site,
            gate: format!("{prefix}.gate_proj.weight"),
            up: format!("{prefix}.up_proj.weight"),
            down: format!("{prefix}.down_proj.weight"),
            hidden,
            width,
        }
    }

    /// Weight names (gate, up, down).
    pub fn weight_names(&self) -> [&str; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// `x` is `[..., hidden]`; returns `[..., hidden]`.
    pub fn forward(&self, w: &dyn Glm52WeightSource, x: &Array) -> Result<Array, ModelError> {
        let (site, h, i) = (self.site, self.hidden, self.width);
        let gate = w.linear(x, &self.gate, i, h).at(site)?;
        let up = w.linear(x, &self.up, i, h).at(site)?;
        let act = gate
            .silu()
            .and_then(|g| g.multiply(&up))
            .at(site, "swiglu")?;
        w.linear(&act, &self.down, h, i).at(site)
    }
}
