//! The MoE block: the `noaux_tc` router ([`crate::moe::Router`]), the routed
//! experts through the [`StreamedExecutor`], and the shared expert, whose
//! output the executor adds (and overlaps with the first wave's loads).

use crate::container::Glm52Config;
use crate::executor::StreamedExecutor;
use crate::mlx::{Array, Dtype};
use crate::moe::router::select;
use crate::moe::{Router, RouterConfig};
use crate::resident::Glm52WeightSource;

use super::error::{MlxAt, WeightsAt};
use super::mlp::SwiGlu;
use super::{ModelError, Site};

/// One MoE layer.
pub struct MoeBlock {
    layer: usize,
    router: Router,
    shared: Option<SwiGlu>,
    hidden: usize,
}

/// The router parameters of `config`.
pub fn router_config(config: &Glm52Config) -> RouterConfig {
    RouterConfig {
        n_experts: config.n_routed_experts.unwrap_or(0),
        top_k: config.num_experts_per_tok,
        n_group: config.n_group,
        topk_group: config.topk_group,
        norm_topk_prob: config.norm_topk_prob,
        routed_scaling_factor: config.routed_scaling_factor as f32,
    }
}

impl MoeBlock {
    /// Loads the router (f32 weight and selection bias) and names the shared
    /// expert of layer `layer`.
    pub fn load(
        w: &dyn Glm52WeightSource,
        config: &Glm52Config,
        layer: usize,
    ) -> Result<Self, ModelError> {
        let site = Site::Layer(layer);
        if config.topk_method != "noaux_tc" || config.scoring_func != "sigmoid" {
            return Err(ModelError::UnsupportedConfig(format!(
                "router {} / {} (only noaux_tc with sigmoid scores is implemented)",
                config.topk_method, config.scoring_func
            )));
        }
        let rc = router_config(config);
        let p = format!("model.layers.{layer}.mlp");
        let weight = w
            .dequantized(
                &format!("{p}.gate.weight"),
                rc.n_experts,
                config.hidden_size,
            )
            .at(site)?;
        let bias_name = format!("{p}.gate.e_score_correction_bias");
        let bias = w
            .tensor(&bias_name)
            .at(site)?
            .astype(Dtype::Float32)
            .and_then(|b| b.to_vec::<f32>())
            .at(site, "reading the router bias")?;
        let router = Router::new(rc, &weight, bias).map_err(|source| ModelError::Routing {
            layer,
            source: Box::new(source),
        })?;
        let shared = config.n_shared_experts.filter(|&n| n > 0).map(|n| {
            SwiGlu::new(
                site,
                &format!("{p}.shared_experts"),
                config.hidden_size,
                config.moe_intermediate_size * n,
            )
        });
        Ok(Self {
            layer,
            router,
            shared,
            hidden: config.hidden_size,
        })
    }

    /// `x` is `[1, L, hidden]`; returns `[1, L, hidden]`, the smallest router
    /// cut gap over the rows (`None` when `top_k == n_experts`) and, when
    /// `keep_routes`, the routed expert ids (`top_k` per row, row-major).
    pub fn forward(
        &self,
        w: &dyn Glm52WeightSource,
        executor: &mut StreamedExecutor,
        x: &Array,
        keep_routes: bool,
    ) -> Result<MoeOutcome, ModelError> {
        let (layer, site) = (self.layer, Site::Layer(self.layer));
        let shape = x.shape();
        let rows = x.reshape(&[-1, self.hidden as i32]).at(site, "MoE input")?;
        let routing = |source| ModelError::Routing {
            layer,
            source: Box::new(source),
        };
        let scores = self.router.scores(&rows).map_err(routing)?;
        let config = self.router.config();
        let routes = select(config, &scores, self.router.bias()).map_err(routing)?;
        let gap = router_cut_gap(config, &scores, self.router.bias());
        let routed = keep_routes.then(|| routes.all_ids().to_vec());
        let shared = match &self.shared {
            Some(s) => Some(s.forward(w, &rows)?),
            None => None,
        };
        let out = executor
            .forward_routes(
                layer as u32,
                &rows,
                routes,
                config.n_experts as u32,
                shared.as_ref(),
            )
            .map_err(|source| ModelError::Experts {
                layer,
                source: Box::new(source),
            })?;
        let hidden = out.reshape(&shape).at(site, "MoE output")?;
        Ok(MoeOutcome {
            hidden,
            router_gap: gap,
            routed,
        })
    }
}

/// What [`MoeBlock::forward`] produced.
pub struct MoeOutcome {
    /// The block output `[1, L, hidden]`.
    pub hidden: Array,
    /// The smallest router cut gap over the rows.
    pub router_gap: Option<f32>,
    /// The routed expert ids, `top_k` per row (when asked for).
    pub routed: Option<Vec<u32>>,
}

/// The smallest difference between the `k`-th and `(k+1)`-th best selection
/// score (`sigmoid + bias`) over the rows of `scores`.
fn router_cut_gap(config: &RouterConfig, scores: &[f32], bias: &[f32]) -> Option<f32> {
    let (n, k) = (config.n_experts, config.top_k);
    if k >= n {
        return None;
    }
    scores
        .chunks(n)
        .map(|row| {
            let mut choice: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
            choice.sort_by(|a, b| b.total_cmp(a));
            choice[k - 1] - choice[k]
        })
        .reduce(f32::min)
}
