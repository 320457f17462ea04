//! RoPE and attention-scale settings from `config.json`, as mlx-lm's
//! `initialize_rope` and `DeepseekV32Attention` derive them.

use crate::container::Glm52Config;
use crate::container::config::RopeParameters;
use crate::mlx::fast::{RopeFreqs, rope};
use crate::mlx::{Array, MlxError};

use super::ModelError;

/// Rotary embedding over the first `dims` features of the last axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// Rotated features (`qk_rope_head_dim`).
    pub dims: usize,
    /// Base frequency θ.
    pub theta: f32,
    /// Position multiplier (`1/factor` for `linear` scaling, else 1).
    pub position_scale: f32,
    /// Rotate adjacent pairs (GPT-J, MLX `traditional=True`) instead of halves.
    pub interleaved: bool,
}

impl Rope {
    /// Rotates `x` (`[..., seq, features]`), positions starting at `offset`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array, MlxError> {
        let offset = i32::try_from(offset)
            .map_err(|_| MlxError::invalid("rope", "position exceeds i32".to_owned()))?;
        rope(
            x,
            self.dims as i32,
            self.interleaved,
            RopeFreqs::Base(self.theta),
            self.position_scale,
            offset,
        )
    }
}

/// The scaling block mlx-lm reads (`rope_parameters`, else `rope_scaling`).
fn scaling(config: &Glm52Config) -> Option<&RopeParameters> {
    config
        .rope_parameters
        .as_ref()
        .or(config.rope_scaling.as_ref())
}

/// The RoPE of the model with the given pair layout. Refuses RoPE types
/// mlx-lm implements with scaled frequencies (YaRN, llama3, ...): GLM-5.x
/// uses plain RoPE, and a silently wrong rotation would be worse than an error.
pub fn rope_for(config: &Glm52Config, interleaved: bool) -> Result<Rope, ModelError> {
    let theta = config
        .rope_theta()
        .ok_or_else(|| ModelError::UnsupportedConfig("no rope_theta".into()))?;
    let mut position_scale = 1.0f64;
    if let Some(s) = scaling(config) {
        let kind = s
            .extra
            .get("type")
            .and_then(|v| v.as_str())
            .or(s.rope_type.as_deref())
            .unwrap_or("default");
        match kind {
            "default" => {}
            "linear" => {
                let factor = s.factor.filter(|f| *f > 0.0).ok_or_else(|| {
                    ModelError::UnsupportedConfig("linear RoPE without a positive factor".into())
                })?;
                position_scale = 1.0 / factor;
            }
            other => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "RoPE type {other:?} (only default and linear are implemented)"
                )));
            }
        }
    }
    Ok(Rope {
        dims: config.qk_rope_head_dim,
        theta: theta as f32,
        position_scale: position_scale as f32,
        interleaved,
    })
}

/// The MLA softmax scale: `(qk_nope + qk_rope)^-0.5`, times `mscale²` with
/// `mscale = 0.1·mscale_all_dim·ln(factor) + 1` when the scaling block sets
/// `mscale_all_dim` and `factor > 1` (mlx-lm's rule).
pub fn attention_scale(config: &Glm52Config) -> f32 {
    let mut scale = (config.qk_head_dim() as f64).powf(-0.5);
    if let Some(s) = scaling(config) {
        let mscale_all_dim = s.mscale_all_dim.unwrap_or(0.0);
        if mscale_all_dim != 0.0 {
            if let Some(factor) = s.factor.filter(|f| *f > 1.0) {
                let m = 0.1 * mscale_all_dim * factor.ln() + 1.0;
                scale *= m * m;
            }
        }
    }
    scale as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::{SourceDtype, TinyModelSpec};
    use std::path::Path;

    fn config(rope_parameters: serde_json::Value) -> Glm52Config {
        let mut json = TinyModelSpec::default().config_json(SourceDtype::F32);
        json["rope_parameters"] = rope_parameters;
        Glm52Config::from_json_str(Path::new("config.json"), &json.to_string()).unwrap()
    }

    #[test]
    fn plain_rope_and_scale() {
        let c = config(serde_json::json!({"rope_theta": 8e6, "rope_type": "default"}));
        let r = rope_for(&c, true).unwrap();
        assert_eq!((r.theta, r.position_scale, r.dims), (8e6, 1.0, 8));
        assert_eq!(attention_scale(&c), (24f64).powf(-0.5) as f32);
    }

    #[test]
    fn linear_scaling_with_mscale_all_dim() {
        let c = config(serde_json::json!({
            "rope_theta": 1e4, "rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0
        }));
        assert_eq!(rope_for(&c, false).unwrap().position_scale, 0.25);
        let m = 0.1 * 4f64.ln() + 1.0;
        let want = (24f64).powf(-0.5) * m * m;
        assert!((f64::from(attention_scale(&c)) - want).abs() < 1e-7);
    }

    #[test]
    fn scaled_frequency_variants_are_refused() {
        let c = config(serde_json::json!({"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}));
        assert!(matches!(
            rope_for(&c, true),
            Err(ModelError::UnsupportedConfig(_))
        ));
    }
}
