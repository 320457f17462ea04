//! An independent f64 host reference of the GLM-5.x forward pass, written
//! from `docs/glm52-architecture.md`, over the container's own f32 decoder
//! (`ColibriContainer::dequantize`): every position of a sequence in one
//! causal pass, expanded (non-absorbed) MLA, the DSA indexer with GLM-5.2
//! IndexShare taken from an explicit per-layer list, the `noaux_tc` router
//! and routed + shared experts.

use std::cell::RefCell;
use std::collections::HashMap;

use glm_stream::container::{ColibriContainer, Glm52Config};

/// What layer `l` does for its DSA selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexKind {
    /// Own indexer.
    Full,
    /// Reuses the most recent full layer's selection.
    Shared,
    /// Attends to every causal position (for contrast in tests).
    Dense,
}

pub struct ReferenceModel {
    c: ColibriContainer,
    cfg: Glm52Config,
    kinds: Vec<IndexKind>,
    cache: RefCell<HashMap<String, std::rc::Rc<Vec<f64>>>>,
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `W x` for `W [rows, cols]`.
fn matvec(w: &[f64], cols: usize, x: &[f64]) -> Vec<f64> {
    assert_eq!(x.len(), cols);
    w.chunks(cols).map(|row| dot(row, x)).collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

fn layer_norm(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let r = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(w.iter().zip(b))
        .map(|(v, (g, c))| (v - mean) * r * g + c)
        .collect()
}

/// RoPE on the first `dims` features of `x` at `pos`: interleaved pairs
/// `(2i, 2i+1)` or halves `(i, i + dims/2)`.
fn rope(x: &mut [f64], dims: usize, pos: usize, theta: f64, interleaved: bool) {
    for i in 0..dims / 2 {
        let freq = theta.powf(-2.0 * i as f64 / dims as f64);
        let (s, c) = (pos as f64 * freq).sin_cos();
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + dims / 2)
        };
        let (xa, xb) = (x[a], x[b]);
        x[a] = xa * c - xb * s;
        x[b] = xa * s + xb * c;
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

impl ReferenceModel {
    pub fn new(c: ColibriContainer, kinds: Vec<IndexKind>) -> Self {
        let cfg = c.config().clone();
        assert_eq!(kinds.len(), cfg.num_hidden_layers);
        Self {
            c,
            cfg,
            kinds,
            cache: RefCell::new(HashMap::new()),
        }
    }

    fn w(&self, name: &str) -> std::rc::Rc<Vec<f64>> {
        if let Some(v) = self.cache.borrow().get(name) {
            return v.clone();
        }
        let values: Vec<f64> = match self.c.dequantize(name) {
            Ok((v, _)) => v.into_iter().map(f64::from).collect(),
            Err(e) => panic!("{name}: {e}"),
        };
        let v = std::rc::Rc::new(values);
        self.cache.borrow_mut().insert(name.to_owned(), v.clone());
        v
    }

    fn swiglu(&self, prefix: &str, x: &[f64]) -> Vec<f64> {
        let d = x.len();
        let g = matvec(&self.w(&format!("{prefix}.gate_proj.weight")), d, x);
        let u = matvec(&self.w(&format!("{prefix}.up_proj.weight")), d, x);
        let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        matvec(&self.w(&format!("{prefix}.down_proj.weight")), a.len(), &a)
    }

    fn moe(&self, l: usize, x: &[f64]) -> Vec<f64> {
        let cfg = &self.cfg;
        let p = format!("model.layers.{l}.mlp");
        let n = cfg.n_routed_experts.unwrap();
        let logits = matvec(&self.w(&format!("{p}.gate.weight")), x.len(), x);
        let bias = self.w(&format!("{p}.gate.e_score_correction_bias"));
        let s: Vec<f64> = logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| (s[b] + bias[b]).total_cmp(&(s[a] + bias[a])));
        let chosen = &order[..cfg.num_experts_per_tok];
        let sum: f64 = chosen.iter().map(|&e| s[e]).sum();
        let mut y = vec![0.0; x.len()];
        for &e in chosen {
            let w = s[e] / sum * cfg.routed_scaling_factor;
            let o = self.swiglu(&format!("{p}.experts.{e}"), x);
            y.iter_mut().zip(&o).for_each(|(y, o)| *y += w * o);
        }
        if cfg.n_shared_experts.unwrap_or(0) > 0 {
            let o = self.swiglu(&format!("{p}.shared_experts"), x);
            y.iter_mut().zip(&o).for_each(|(y, o)| *y += o);
        }
        y
    }

    /// Per query `t`: the selected positions (all of `0..=t` while `t + 1 ≤ index_topk`).
    fn index(&self, l: usize, x: &[Vec<f64>], qr: &[Vec<f64>]) -> Vec<Vec<usize>> {
        let cfg = &self.cfg;
        let p = format!("model.layers.{l}.self_attn.indexer");
        let (hi, di, k) = (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk);
        let theta = cfg.rope_theta().unwrap();
        let (wq, wk, wp) = (
            self.w(&format!("{p}.wq_b.weight")),
            self.w(&format!("{p}.wk.weight")),
            self.w(&format!("{p}.weights_proj.weight")),
        );
        let (nw, nb) = (
            self.w(&format!("{p}.k_norm.weight")),
            self.w(&format!("{p}.k_norm.bias")),
        );
        let interleave = cfg.indexer_rope_interleave;
        let keys: Vec<Vec<f64>> = x
            .iter()
            .enumerate()
            .map(|(t, xt)| {
                let mut k = layer_norm(&matvec(&wk, xt.len(), xt), &nw, &nb, 1e-5);
                rope(&mut k, cfg.qk_rope_head_dim, t, theta, interleave);
                k
            })
            .collect();
        let scale = (hi as f64).powf(-0.5) * (di as f64).powf(-0.5);
        (0..x.len())
            .map(|t| {
                if t < k {
                    return (0..=t).collect();
                }
                let q = matvec(&wq, qr[t].len(), &qr[t]);
                let hw = matvec(&wp, x[t].len(), &x[t]);
                let heads: Vec<Vec<f64>> = (0..hi)
                    .map(|h| {
                        let mut qh = q[h * di..(h + 1) * di].to_vec();
                        rope(&mut qh, cfg.qk_rope_head_dim, t, theta, interleave);
                        qh
                    })
                    .collect();
                let score = |s: usize| -> f64 {
                    (0..hi)
                        .map(|h| hw[h] * scale * dot(&heads[h], &keys[s]).max(0.0))
                        .sum()
                };
                let mut order: Vec<(usize, f64)> = (0..=t).map(|s| (s, score(s))).collect();
                order.sort_by(|a, b| b.1.total_cmp(&a.1));
                order[..k].iter().map(|(s, _)| *s).collect()
            })
            .collect()
    }

    fn attention(
        &self,
        l: usize,
        x: &[Vec<f64>],
        shared: &mut Option<Vec<Vec<usize>>>,
    ) -> Vec<Vec<f64>> {
        let cfg = &self.cfg;
        let p = format!("model.layers.{l}.self_attn");
        let (heads, nope, rd, vd, kvr) = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        );
        let theta = cfg.rope_theta().unwrap();
        let d = cfg.hidden_size;
        let (wqa, wqb, wkva, wkvb, wo) = (
            self.w(&format!("{p}.q_a_proj.weight")),
            self.w(&format!("{p}.q_b_proj.weight")),
            self.w(&format!("{p}.kv_a_proj_with_mqa.weight")),
            self.w(&format!("{p}.kv_b_proj.weight")),
            self.w(&format!("{p}.o_proj.weight")),
        );
        let (qan, kvan) = (
            self.w(&format!("{p}.q_a_layernorm.weight")),
            self.w(&format!("{p}.kv_a_layernorm.weight")),
        );
        let qr: Vec<Vec<f64>> = x
            .iter()
            .map(|xt| rms_norm(&matvec(&wqa, d, xt), &qan, 1e-6))
            .collect();
        let mut q_nope = Vec::new();
        let mut q_pe = Vec::new();
        let mut k_nope = Vec::new();
        let mut k_pe = Vec::new();
        let mut vals = Vec::new();
        for (t, xt) in x.iter().enumerate() {
            let q = matvec(&wqb, qr[t].len(), &qr[t]);
            let (mut qn, mut qp) = (Vec::new(), Vec::new());
            for h in 0..heads {
                let qh = &q[h * (nope + rd)..(h + 1) * (nope + rd)];
                qn.push(qh[..nope].to_vec());
                let mut pe = qh[nope..].to_vec();
                rope(&mut pe, rd, t, theta, true);
                qp.push(pe);
            }
            q_nope.push(qn);
            q_pe.push(qp);
            let kv = matvec(&wkva, d, xt);
            let latent = rms_norm(&kv[..kvr], &kvan, 1e-6);
            let mut kp = kv[kvr..].to_vec();
            rope(&mut kp, rd, t, theta, true);
            k_pe.push(kp);
            let up = matvec(&wkvb, kvr, &latent);
            let (mut kn, mut vv) = (Vec::new(), Vec::new());
            for h in 0..heads {
                let row = &up[h * (nope + vd)..(h + 1) * (nope + vd)];
                kn.push(row[..nope].to_vec());
                vv.push(row[nope..].to_vec());
            }
            k_nope.push(kn);
            vals.push(vv);
        }
        let selection = match self.kinds[l] {
            IndexKind::Full => {
                let s = self.index(l, x, &qr);
                *shared = Some(s.clone());
                s
            }
            IndexKind::Shared => shared
                .clone()
                .unwrap_or_else(|| (0..x.len()).map(|t| (0..=t).collect()).collect()),
            IndexKind::Dense => (0..x.len()).map(|t| (0..=t).collect()).collect(),
        };
        let scale = ((nope + rd) as f64).powf(-0.5);
        (0..x.len())
            .map(|t| {
                let mut o = Vec::with_capacity(heads * vd);
                for h in 0..heads {
                    let sel = &selection[t];
                    let logits: Vec<f64> = sel
                        .iter()
                        .map(|&s| {
                            (dot(&q_nope[t][h], &k_nope[s][h]) + dot(&q_pe[t][h], &k_pe[s])) * scale
                        })
                        .collect();
                    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = logits.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let mut acc = vec![0.0; vd];
                    for (p, &s) in e.iter().zip(sel) {
                        acc.iter_mut()
                            .zip(&vals[s][h])
                            .for_each(|(a, v)| *a += p / z * v);
                    }
                    o.extend(acc);
                }
                matvec(&wo, heads * vd, &o)
            })
            .collect()
    }

    /// Logits `[T][vocab]` of every position of `ids` (one causal pass).
    pub fn logits(&self, ids: &[u32]) -> Vec<Vec<f64>> {
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let embed = self.w("model.embed_tokens.weight");
        let mut x: Vec<Vec<f64>> = ids
            .iter()
            .map(|&i| embed[i as usize * d..(i as usize + 1) * d].to_vec())
            .collect();
        let mut shared = None;
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let nin = self.w(&format!("{p}.input_layernorm.weight"));
            let npost = self.w(&format!("{p}.post_attention_layernorm.weight"));
            let xn: Vec<Vec<f64>> = x.iter().map(|v| rms_norm(v, &nin, eps)).collect();
            let a = self.attention(l, &xn, &mut shared);
            for (xt, at) in x.iter_mut().zip(&a) {
                xt.iter_mut().zip(at).for_each(|(v, a)| *v += a);
            }
            for xt in x.iter_mut() {
                let hn = rms_norm(xt, &npost, eps);
                let y = if cfg.is_moe_layer(l) {
                    self.moe(l, &hn)
                } else {
                    self.swiglu(&format!("{p}.mlp"), &hn)
                };
                xt.iter_mut().zip(&y).for_each(|(v, y)| *v += y);
            }
        }
        let norm = self.w("model.norm.weight");
        let head = self.w("lm_head.weight");
        x.iter()
            .map(|xt| matvec(&head, d, &rms_norm(xt, &norm, eps)))
            .collect()
    }
}
