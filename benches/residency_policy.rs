//! Hit rate of the residency policy against Belady's optimum and plain LRU.
//!
//! A synthetic GLM-shaped routing trace: 20 MoE layers × 256 experts, top-8,
//! 3,000 tokens. Each layer has its own Zipf(1.0) popularity over a random
//! permutation of its experts; with probability 0.5 a routed slot repeats an
//! expert the same layer used for the previous token (temporal locality),
//! otherwise it is drawn from the Zipf law (no duplicates within a row).
//!
//! The trace is a [`RoutingTrace`] with one record per (token, layer): one
//! request of 8 experts that must all be resident together (one wave), in
//! decode order: token-major, then layer. Three policies serve the same trace
//! with the same slot counts, through [`glm_stream::experts::replay`]:
//!
//! * `policy`: [`replay_policy`], [`glm_stream::experts::ResidencyPolicy`]
//!   exactly as the executor drives it (`record_routes`, `acquire`,
//!   `complete`, `release`), default configuration (three quarters of the
//!   budget beyond one token's working set for frequency pins, all but one
//!   request when the budget is below it; repinned every 64 rows);
//! * `lru`: evict the least recently used expert not in the current request;
//! * `belady`: evict the resident expert (not in the current request) whose
//!   next use is farthest in the future — the optimum for demand loading.
//!
//! Run: `cargo bench --bench residency_policy`. No timing: it prints a table.

use glm_stream::experts::replay::{belady, lru, replay_policy};
use glm_stream::experts::{PolicyConfig, RoutingTrace};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;

const LAYERS: u32 = 20;
const EXPERTS: u32 = 256;
const TOP_K: usize = 8;
const TOKENS: usize = 3000;
const ZIPF_S: f64 = 1.0;
const REUSE: f64 = 0.5;

/// One record per (token, layer), token-major.
fn trace(seed: u64) -> Result<RoutingTrace, Box<dyn std::error::Error>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cdf: Vec<f64> = {
        let w: Vec<f64> = (1..=EXPERTS)
            .map(|r| 1.0 / f64::from(r).powf(ZIPF_S))
            .collect();
        let total: f64 = w.iter().sum();
        w.iter()
            .scan(0.0, |acc, v| {
                *acc += v / total;
                Some(*acc)
            })
            .collect()
    };
    let perms: Vec<Vec<u32>> = (0..LAYERS)
        .map(|_| {
            let mut p: Vec<u32> = (0..EXPERTS).collect();
            p.shuffle(&mut rng);
            p
        })
        .collect();
    let mut prev: Vec<Vec<u32>> = vec![Vec::new(); LAYERS as usize];
    let mut out = RoutingTrace::new(EXPERTS, TOP_K)?;
    for token in 0..TOKENS {
        for layer in 0..LAYERS {
            let l = layer as usize;
            let mut row: Vec<u32> = Vec::with_capacity(TOP_K);
            while row.len() < TOP_K {
                let e = if !prev[l].is_empty() && rng.random_bool(REUSE) {
                    prev[l][rng.random_range(0..prev[l].len())]
                } else {
                    let u: f64 = rng.random();
                    let rank = cdf.partition_point(|&c| c < u).min(EXPERTS as usize - 1);
                    perms[l][rank]
                };
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            prev[l] = row.clone();
            out.push(token as u64, layer, row)?;
        }
    }
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let trace = trace(2026)?;
    let distinct: HashSet<(u32, u32)> = trace
        .records()
        .iter()
        .flat_map(|r| r.ids.iter().map(move |&e| (r.layer, e)))
        .collect();
    println!(
        "trace: {LAYERS} layers × {EXPERTS} experts, top-{TOP_K}, {TOKENS} tokens, \
         Zipf s={ZIPF_S}, reuse p={REUSE}: {} requests, {} distinct experts",
        trace.len(),
        distinct.len()
    );
    println!(
        "{:>6} {:>7} {:>8} {:>8} {:>8} {:>13} {:>10}",
        "slots", "% pool", "policy", "lru", "belady", "policy/belady", "lru/belady"
    );
    for slots in [80, 160, 320, 640, 1280, 2560] {
        let cfg = PolicyConfig::new(LAYERS, EXPERTS, slots);
        let rate = |r: glm_stream::experts::ReplayResult| r.hit_rate().unwrap_or(0.0);
        let (p, l, b) = (
            rate(replay_policy(&trace, slots, &cfg)?),
            rate(lru(&trace, slots)?),
            rate(belady(&trace, slots)?),
        );
        println!(
            "{slots:>6} {:>6.1}% {:>7.2}% {:>7.2}% {:>7.2}% {:>13.3} {:>10.3}",
            100.0 * slots as f64 / f64::from(LAYERS * EXPERTS),
            100.0 * p,
            100.0 * l,
            100.0 * b,
            p / b,
            l / b
        );
    }
    Ok(())
}
