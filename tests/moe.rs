//! Router against an f64 scalar reference (ties, bias, groups) and the batch plan.

use glm_stream::mlx::Array;
use glm_stream::moe::{BatchPlan, MoeError, Router, RouterConfig, Routes, router};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f64 reference of the GLM gate with the documented tie rule (lower index
/// wins; lower group index kept).
fn reference(
    cfg: &RouterConfig,
    x: &[f32],
    w: &[f32],
    bias: &[f32],
    hidden: usize,
) -> Vec<(Vec<u32>, Vec<f64>)> {
    let n = cfg.n_experts;
    x.chunks(hidden)
        .map(|row| {
            let s: Vec<f64> = (0..n)
                .map(|e| {
                    let dot: f64 = (0..hidden)
                        .map(|i| row[i] as f64 * w[e * hidden + i] as f64)
                        .sum();
                    1.0 / (1.0 + (-dot).exp())
                })
                .collect();
            let mut choice: Vec<f64> = s.iter().zip(bias).map(|(a, &b)| a + b as f64).collect();
            if cfg.n_group > 1 {
                let size = n / cfg.n_group;
                let mut gs: Vec<(f64, usize)> = (0..cfg.n_group)
                    .map(|g| {
                        let mut v = choice[g * size..(g + 1) * size].to_vec();
                        v.sort_by(|a, b| b.total_cmp(a));
                        (v[0] + v[1], g)
                    })
                    .collect();
                gs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                for &(_, g) in &gs[cfg.topk_group..] {
                    for c in &mut choice[g * size..(g + 1) * size] {
                        *c = 0.0;
                    }
                }
            }
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = order[..cfg.top_k].iter().map(|&e| e as u32).collect();
            let mut ws: Vec<f64> = order[..cfg.top_k].iter().map(|&e| s[e]).collect();
            if cfg.top_k > 1 && cfg.norm_topk_prob {
                let d: f64 = ws.iter().sum();
                ws.iter_mut().for_each(|v| *v /= d);
            }
            ws.iter_mut()
                .for_each(|v| *v *= cfg.routed_scaling_factor as f64);
            (ids, ws)
        })
        .collect()
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn run(cfg: &RouterConfig, x: &[f32], w: &[f32], bias: &[f32], hidden: usize) -> Routes {
    let n = cfg.n_experts;
    let wa = Array::from_slice(w, &[n as i32, hidden as i32]).unwrap();
    let router = Router::new(cfg.clone(), &wa, bias.to_vec()).unwrap();
    let rows = x.len() / hidden;
    let xa = Array::from_slice(x, &[1, rows as i32, hidden as i32]).unwrap();
    router.route(&xa).unwrap()
}

fn check(cfg: &RouterConfig, x: &[f32], w: &[f32], bias: &[f32], hidden: usize) {
    let got = run(cfg, x, w, bias, hidden);
    let want = reference(cfg, x, w, bias, hidden);
    assert_eq!(got.rows(), want.len());
    for (row, (ids, ws)) in want.iter().enumerate() {
        assert_eq!(got.ids(row), &ids[..], "row {row} ids");
        for (g, r) in got.weights(row).iter().zip(ws) {
            assert!(
                (*g as f64 - r).abs() <= 1e-5 * r.abs().max(1.0),
                "row {row}: {g} vs {r}"
            );
        }
    }
}

fn cfg(n: usize, k: usize, groups: (usize, usize)) -> RouterConfig {
    RouterConfig {
        n_experts: n,
        top_k: k,
        n_group: groups.0,
        topk_group: groups.1,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
    }
}

#[test]
fn router_matches_scalar_reference_single_and_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, hidden) = (64, 32);
    let w = random(&mut rng, n * hidden, 0.5);
    let bias = random(&mut rng, n, 0.05);
    for rows in [1, 5] {
        let x = random(&mut rng, rows * hidden, 1.0);
        check(&cfg(n, 8, (1, 1)), &x, &w, &bias, hidden);
    }
    // Unnormalized and top-1 variants.
    let x = random(&mut rng, 3 * hidden, 1.0);
    let mut c = cfg(n, 4, (1, 1));
    c.norm_topk_prob = false;
    check(&c, &x, &w, &bias, hidden);
    check(&cfg(n, 1, (1, 1)), &x, &w, &bias, hidden);
}

#[test]
fn router_groups_match_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (n, hidden) = (32, 16);
    let w = random(&mut rng, n * hidden, 0.8);
    let x = random(&mut rng, 4 * hidden, 1.0);
    let bias = random(&mut rng, n, 0.1);
    check(&cfg(n, 4, (4, 2)), &x, &w, &bias, hidden);
    // Strongly negative biases: the zeroed (dropped) groups then outrank the
    // kept ones, exactly as mlx-lm's put_along_axis(…, 0.0) behaves.
    let neg: Vec<f32> = (0..n).map(|_| -2.0).collect();
    let got = run(&cfg(n, 4, (4, 1)), &x, &w, &neg, hidden);
    let want = reference(&cfg(n, 4, (4, 1)), &x, &w, &neg, hidden);
    for (row, (ids, _)) in want.iter().enumerate() {
        assert_eq!(got.ids(row), &ids[..]);
    }
}

#[test]
fn router_ties_prefer_lower_index() {
    let (n, hidden) = (16, 8);
    // All scores equal: the first k experts, equal weights.
    let w = vec![0.0f32; n * hidden];
    let x = vec![1.0f32; 2 * hidden];
    let bias = vec![0.0f32; n];
    let r = run(&cfg(n, 4, (1, 1)), &x, &w, &bias, hidden);
    for row in 0..2 {
        assert_eq!(r.ids(row), &[0, 1, 2, 3]);
        for &v in r.weights(row) {
            assert!((v - 2.5 / 4.0).abs() < 1e-6);
        }
    }
    // A tie at the boundary: experts 9 and 5 share identical gate rows; only
    // one slot is left after expert 2, so 5 (the lower index) wins.
    let mut w = vec![0.0f32; n * hidden];
    for i in 0..hidden {
        w[2 * hidden + i] = 1.0;
        w[5 * hidden + i] = 0.5;
        w[9 * hidden + i] = 0.5;
    }
    let r = run(&cfg(n, 2, (1, 1)), &x[..hidden], &w, &bias, hidden);
    assert_eq!(r.ids(0), &[2, 5]);
    check(&cfg(n, 2, (1, 1)), &x[..hidden], &w, &bias, hidden);
}

#[test]
fn bias_selects_but_does_not_weight() {
    let (n, hidden) = (8, 4);
    let mut w = vec![0.0f32; n * hidden];
    for e in 0..n {
        for i in 0..hidden {
            w[e * hidden + i] = e as f32 * 0.1;
        }
    }
    let x = vec![1.0f32; hidden];
    let mut bias = vec![0.0f32; n];
    bias[0] = 10.0; // expert 0 has the lowest score but is selected first
    let c = cfg(n, 2, (1, 1));
    let r = run(&c, &x, &w, &bias, hidden);
    assert_eq!(r.ids(0), &[0, 7]);
    let s0 = 1.0 / (1.0 + (-0.0f64).exp());
    let s7 = 1.0 / (1.0 + (-(0.7f64 * 4.0)).exp());
    let w0 = 2.5 * s0 / (s0 + s7);
    assert!(
        (r.weights(0)[0] as f64 - w0).abs() < 1e-5,
        "{:?}",
        r.weights(0)
    );
    check(&c, &x, &w, &bias, hidden);
}

#[test]
fn router_rejects_bad_input() {
    let c = cfg(8, 2, (1, 1));
    let w = Array::from_slice(&[0.0f32; 32], &[8, 4]).unwrap();
    assert!(matches!(
        Router::new(c.clone(), &w, vec![0.0; 7]),
        Err(MoeError::Shape { .. })
    ));
    assert!(matches!(
        Router::new(c.clone(), &w, vec![f32::NAN; 8]),
        Err(MoeError::NonFinite { .. })
    ));
    assert!(matches!(
        Router::new(cfg(8, 9, (1, 1)), &w, vec![0.0; 8]),
        Err(MoeError::Config(_))
    ));
    assert!(matches!(
        Router::new(cfg(8, 2, (3, 1)), &w, vec![0.0; 8]),
        Err(MoeError::Config(_))
    ));
    let r = Router::new(c.clone(), &w, vec![0.0; 8]).unwrap();
    let x = Array::from_slice(&[0.0f32; 5], &[1, 5]).unwrap();
    assert!(matches!(r.route(&x), Err(MoeError::Shape { .. })));
    let mut scores = vec![0.5f32; 16];
    scores[11] = f32::NAN;
    assert!(matches!(
        router::select(&c, &scores, &[0.0; 8]),
        Err(MoeError::NonFinite {
            row: 1,
            expert: 3,
            ..
        })
    ));
}

#[test]
fn routes_validate_ids() {
    assert!(matches!(
        Routes::new(2, 8, vec![1, 8], vec![0.5, 0.5]),
        Err(MoeError::ExpertOutOfRange {
            row: 0,
            rank: 1,
            expert: 8,
            ..
        })
    ));
    assert!(matches!(
        Routes::new(2, 8, vec![1, 2, 3, 3], vec![0.5; 4]),
        Err(MoeError::DuplicateExpert { row: 1, expert: 3 })
    ));
    assert!(Routes::new(2, 8, vec![1, 2, 3], vec![0.5; 3]).is_err());
    assert!(Routes::new(1, 8, vec![1], vec![f32::INFINITY]).is_err());
}

#[test]
fn plan_groups_rows_and_cuts_waves() {
    let routes = Routes::new(
        3,
        16,
        vec![5, 1, 9, 1, 5, 2, 7, 9, 1],
        vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    )
    .unwrap();
    let plan = BatchPlan::new(routes, 16, 2).unwrap();
    let experts: Vec<u32> = plan.jobs().iter().map(|j| j.expert).collect();
    assert_eq!(experts, vec![1, 2, 5, 7, 9]);
    let j1 = &plan.jobs()[0];
    assert_eq!(
        (j1.rows.as_slice(), j1.ranks.as_slice()),
        (&[0, 1, 2][..], &[1, 0, 2][..])
    );
    let j9 = &plan.jobs()[4];
    assert_eq!(
        (j9.rows.as_slice(), j9.ranks.as_slice()),
        (&[0, 2][..], &[2, 1][..])
    );
    let waves: Vec<Vec<u32>> = plan
        .waves()
        .map(|w| w.iter().map(|j| j.expert).collect())
        .collect();
    assert_eq!(waves, vec![vec![1, 2], vec![5, 7], vec![9]]);
    // Every (row, rank) appears exactly once across jobs.
    let mut seen = [false; 9];
    for job in plan.jobs() {
        for (&r, &k) in job.rows.iter().zip(&job.ranks) {
            let i = (r * 3 + k) as usize;
            assert!(!seen[i]);
            seen[i] = true;
            assert_eq!(plan.routes().ids(r as usize)[k as usize], job.expert);
        }
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(plan.wave_count(), 3);
}

#[test]
fn plan_rejects_bad_input() {
    let routes = Routes::new(1, 16, vec![12], vec![1.0]).unwrap();
    assert!(matches!(
        BatchPlan::new(routes.clone(), 8, 4),
        Err(MoeError::ExpertOutOfRange {
            expert: 12,
            n_experts: 8,
            ..
        })
    ));
    assert!(matches!(
        BatchPlan::new(routes, 16, 0),
        Err(MoeError::EmptyWave)
    ));
}
