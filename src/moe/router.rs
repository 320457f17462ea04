//! The GLM-5.x (`noaux_tc`) router.
//!
//! Per row: `s = sigmoid(x · Wᵀ)` in f32 (on MLX), then on the host
//! `choice = s + e_score_correction_bias` (the bias only selects), optional
//! group limiting (`n_group > 1`: a group's score is the sum of its two best
//! choices; the `n_group − topk_group` weakest groups get choice `0.0`, as
//! mlx-lm and HF do), the `top_k` best choices, weights `w = s[idx]`,
//! normalized when `norm_topk_prob && top_k > 1` (`w / (Σw + 1e-20)`, the HF
//! form; mlx-lm omits the epsilon, which only matters when every score
//! underflows to 0) and multiplied by `routed_scaling_factor`.
//!
//! Ties: mlx-lm selects with `argpartition`, whose order among equal scores is
//! unspecified (and differs between backends). This router defines it: among
//! equal choices the lower expert index wins, and among equal group scores the
//! lower group index is kept. Within a row the experts are listed best first.
//!
//! Selection runs on the host because the batch plan needs the ids there
//! anyway (a decode step moves `rows × 256` floats), which also makes every id
//! checked before any MLX gather sees it.

use super::MoeError;
use crate::mlx::{Array, Dtype};

/// The gate hyper-parameters, as named in `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// `n_routed_experts` (256 for GLM-5.2).
    pub n_experts: usize,
    /// `num_experts_per_tok` (8).
    pub top_k: usize,
    /// `n_group` (1: no group limiting).
    pub n_group: usize,
    /// `topk_group` (1).
    pub topk_group: usize,
    /// `norm_topk_prob` (true).
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor` (2.5).
    pub routed_scaling_factor: f32,
}

impl RouterConfig {
    /// The published GLM-5.2 gate: 256 experts, top-8, no groups, normalized, ×2.5.
    pub fn glm52() -> Self {
        Self {
            n_experts: 256,
            top_k: 8,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }
    }

    /// Checks the parameters describe a gate the selection can run.
    pub fn validate(&self) -> Result<(), MoeError> {
        let bad = |m: String| Err(MoeError::Config(m));
        if self.n_experts == 0 || self.n_experts > u32::MAX as usize {
            return bad(format!("n_experts {} is out of range", self.n_experts));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return bad(format!(
                "top_k {} must be in 1..={}",
                self.top_k, self.n_experts
            ));
        }
        if self.n_group == 0 || self.n_experts % self.n_group != 0 {
            return bad(format!(
                "n_group {} must divide n_experts {}",
                self.n_group, self.n_experts
            ));
        }
        if self.n_group > 1 {
            if self.n_experts / self.n_group < 2 {
                return bad("group limiting needs at least 2 experts per group".into());
            }
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return bad(format!(
                    "topk_group {} must be in 1..={}",
                    self.topk_group, self.n_group
                ));
            }
        }
        if !self.routed_scaling_factor.is_finite() {
            return bad("routed_scaling_factor is not finite".into());
        }
        Ok(())
    }
}

/// Per row, the chosen experts (best first) and their execution weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    top_k: usize,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

impl Routes {
    /// Routes from host data: `ids` and `weights` are `rows × top_k`, row-major.
    /// Ids are checked against `n_experts` and for duplicates within a row;
    /// weights must be finite.
    pub fn new(
        top_k: usize,
        n_experts: u32,
        ids: Vec<u32>,
        weights: Vec<f32>,
    ) -> Result<Self, MoeError> {
        if top_k == 0 || ids.len() != weights.len() || ids.len() % top_k != 0 {
            return Err(MoeError::Shape {
                what: "routes",
                expected: format!("ids and weights of equal length, a multiple of top_k {top_k}"),
                actual: format!("{} ids, {} weights", ids.len(), weights.len()),
            });
        }
        for (row, (row_ids, row_w)) in ids.chunks(top_k).zip(weights.chunks(top_k)).enumerate() {
            for (rank, (&expert, &w)) in row_ids.iter().zip(row_w).enumerate() {
                if expert >= n_experts {
                    return Err(MoeError::ExpertOutOfRange {
                        row,
                        rank,
                        expert,
                        n_experts,
                    });
                }
                if row_ids[..rank].contains(&expert) {
                    return Err(MoeError::DuplicateExpert { row, expert });
                }
                if !w.is_finite() {
                    return Err(MoeError::NonFinite {
                        what: "routing weight",
                        row,
                        expert: expert as usize,
                        value: w,
                    });
                }
            }
        }
        Ok(Self {
            top_k,
            ids,
            weights,
        })
    }

    /// Number of rows (tokens).
    pub fn rows(&self) -> usize {
        self.ids.len() / self.top_k
    }

    /// Experts per row.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Row `row`'s expert ids, best first.
    pub fn ids(&self, row: usize) -> &[u32] {
        &self.ids[row * self.top_k..(row + 1) * self.top_k]
    }

    /// Row `row`'s execution weights, aligned with [`Routes::ids`].
    pub fn weights(&self, row: usize) -> &[f32] {
        &self.weights[row * self.top_k..(row + 1) * self.top_k]
    }

    /// All ids, row-major.
    pub fn all_ids(&self) -> &[u32] {
        &self.ids
    }
}

/// The gate of one MoE layer: F32 weight `[n_experts, hidden]` on MLX and the
/// selection bias on the host.
pub struct Router {
    config: RouterConfig,
    weight_t: Array,
    bias: Vec<f32>,
    hidden: usize,
}

impl Router {
    /// A router from `mlp.gate.weight` (`[n_experts, hidden]`, cast to f32)
    /// and `mlp.gate.e_score_correction_bias` (`n_experts` finite values).
    pub fn new(config: RouterConfig, weight: &Array, bias: Vec<f32>) -> Result<Self, MoeError> {
        config.validate()?;
        let shape = weight.shape();
        if shape.len() != 2 || shape[0] as usize != config.n_experts || shape[1] <= 0 {
            return Err(MoeError::Shape {
                what: "router weight",
                expected: format!("[{}, hidden]", config.n_experts),
                actual: format!("{shape:?}"),
            });
        }
        if bias.len() != config.n_experts {
            return Err(MoeError::Shape {
                what: "router bias",
                expected: format!("[{}]", config.n_experts),
                actual: format!("[{}]", bias.len()),
            });
        }
        if let Some((expert, &value)) = bias.iter().enumerate().find(|(_, b)| !b.is_finite()) {
            return Err(MoeError::NonFinite {
                what: "router bias",
                row: 0,
                expert,
                value,
            });
        }
        let weight_t = weight.astype(Dtype::Float32)?.t()?;
        weight_t.eval()?;
        Ok(Self {
            config,
            weight_t,
            bias,
            hidden: shape[1] as usize,
        })
    }

    /// The gate parameters.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The selection bias (`e_score_correction_bias`).
    pub fn bias(&self) -> &[f32] {
        &self.bias
    }

    /// Routes `x` (`[..., hidden]`, any float dtype; computed in f32).
    pub fn route(&self, x: &Array) -> Result<Routes, MoeError> {
        select(&self.config, &self.scores(x)?, &self.bias)
    }

    /// The sigmoid scores `sigmoid(x · Wᵀ)` of `x` (`[..., hidden]`) as
    /// `rows × n_experts` host values, row-major: the input of [`select`].
    pub fn scores(&self, x: &Array) -> Result<Vec<f32>, MoeError> {
        let shape = x.shape();
        if shape.last().map(|&d| d as usize) != Some(self.hidden) {
            return Err(MoeError::Shape {
                what: "router input",
                expected: format!("[..., {}]", self.hidden),
                actual: format!("{shape:?}"),
            });
        }
        let rows = x.size() / self.hidden;
        let flat = x.reshape(&[rows as i32, self.hidden as i32])?;
        let scores = flat
            .astype(Dtype::Float32)?
            .matmul(&self.weight_t)?
            .sigmoid()?;
        Ok(scores.to_vec::<f32>()?)
    }
}

/// Host-side selection from sigmoid scores (`rows × n_experts`, row-major)
/// and the selection bias. This is the part of [`Router::route`] after MLX.
pub fn select(config: &RouterConfig, scores: &[f32], bias: &[f32]) -> Result<Routes, MoeError> {
    config.validate()?;
    let n = config.n_experts;
    if bias.len() != n || scores.len() % n != 0 {
        return Err(MoeError::Shape {
            what: "router scores",
            expected: format!("rows × {n} scores and {n} biases"),
            actual: format!("{} scores, {} biases", scores.len(), bias.len()),
        });
    }
    let rows = scores.len() / n;
    let k = config.top_k;
    let mut ids = Vec::with_capacity(rows * k);
    let mut weights = Vec::with_capacity(rows * k);
    let mut choice = vec![0f32; n];
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for (row, s) in scores.chunks(n).enumerate() {
        for (expert, (&v, &b)) in s.iter().zip(bias).enumerate() {
            if !v.is_finite() {
                return Err(MoeError::NonFinite {
                    what: "router score",
                    row,
                    expert,
                    value: v,
                });
            }
            if !b.is_finite() {
                return Err(MoeError::NonFinite {
                    what: "router bias",
                    row,
                    expert,
                    value: b,
                });
            }
            choice[expert] = v + b;
        }
        if config.n_group > 1 {
            limit_groups(config, &mut choice);
        }
        order.clear();
        order.extend(0..n);
        // Best first; equal choices keep the lower index (a stable total order).
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let mut w: Vec<f32> = chosen.iter().map(|&e| s[e]).collect();
        if k > 1 && config.norm_topk_prob {
            let denom = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= denom);
        }
        for (&e, &x) in chosen.iter().zip(&w) {
            ids.push(e as u32);
            weights.push(x * config.routed_scaling_factor);
        }
    }
    Routes::new(k, n as u32, ids, weights)
}

/// Zeroes the choices of the `n_group − topk_group` weakest groups.
fn limit_groups(config: &RouterConfig, choice: &mut [f32]) {
    let size = config.n_experts / config.n_group;
    let group_score = |g: usize| {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &v in &choice[g * size..(g + 1) * size] {
            if v > a {
                b = a;
                a = v;
            } else if v > b {
                b = v;
            }
        }
        a + b
    };
    let scores: Vec<f32> = (0..config.n_group).map(group_score).collect();
    let mut groups: Vec<usize> = (0..config.n_group).collect();
    groups.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    for &g in &groups[config.topk_group..] {
        choice[g * size..(g + 1) * size].fill(0.0);
    }
}
