//! Hit rate of the residency policy against Belady's optimum and plain LRU.
//!
//! A synthetic GLM-shaped routing trace: 20 MoE layers × 256 experts, top-8,
//! 3,000 tokens. Each layer has its own Zipf(1.0) popularity over a random
//! permutation of its experts; with probability 0.5 a routed slot repeats an
//! expert the same layer used for the previous token (temporal locality),
//! otherwise it is drawn from the Zipf law (no duplicates within a row).
//!
//! Every (token, layer) is one request of 8 experts that must all be resident
//! together (one wave), in decode order: token-major, then layer. Three
//! policies serve the same trace with the same slot counts:
//!
//! * `policy`: [`ResidencyPolicy`] exactly as the executor drives it
//!   (`record_routes`, `acquire`, `complete`, `release`), default
//!   configuration (three quarters of the budget beyond one token's working
//!   set for frequency pins, all but one request when the budget is below
//!   it; repinned every 64 rows);
//! * `lru`: evict the least recently used expert not in the current request;
//! * `belady`: evict the resident expert (not in the current request) whose
//!   next use is farthest in the future — the optimum for demand loading.
//!
//! Run: `cargo bench --bench residency_policy`. No timing: it prints a table.

use glm_stream::experts::{ExpertError, PolicyConfig, ResidencyPolicy};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeSet, HashMap, HashSet};

const LAYERS: u32 = 20;
const EXPERTS: u32 = 256;
const TOP_K: usize = 8;
const TOKENS: usize = 3000;
const ZIPF_S: f64 = 1.0;
const REUSE: f64 = 0.5;

type Key = (u32, u32);

/// One request per (token, layer), token-major.
fn trace(seed: u64) -> Vec<(u32, Vec<u32>)> {
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
    let mut out = Vec::with_capacity(TOKENS * LAYERS as usize);
    for _ in 0..TOKENS {
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
            out.push((layer, row));
        }
    }
    out
}

/// One wave as the executor drives the policy: record, lease, load, release.
fn serve(p: &mut ResidencyPolicy, layer: u32, ids: &[u32]) -> Result<(), ExpertError> {
    p.record_routes(layer, ids)?;
    let lease = p.acquire(layer, ids)?;
    for e in lease.entries.iter().filter(|e| !e.hit) {
        p.complete(lease.id, e.slot, true)?;
    }
    p.release(lease.id)
}

fn run_policy(trace: &[(u32, Vec<u32>)], slots: usize) -> f64 {
    let mut p = match ResidencyPolicy::new(PolicyConfig::new(LAYERS, EXPERTS, slots)) {
        Ok(p) => p,
        Err(e) => panic!("policy for {slots} slots: {e}"),
    };
    for (layer, ids) in trace {
        if let Err(e) = serve(&mut p, *layer, ids) {
            panic!("policy with {slots} slots: {e}");
        }
    }
    p.telemetry().hit_rate().unwrap_or(0.0)
}

fn run_lru(trace: &[(u32, Vec<u32>)], slots: usize) -> f64 {
    let mut last: HashMap<Key, u64> = HashMap::new();
    let mut order: BTreeSet<(u64, Key)> = BTreeSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for (t, (layer, ids)) in trace.iter().enumerate() {
        let now = t as u64 + 1;
        let want: HashSet<Key> = ids.iter().map(|&e| (*layer, e)).collect();
        for &k in &want {
            total += 1;
            if let Some(old) = last.get(&k) {
                hits += 1;
                order.remove(&(*old, k));
            } else if last.len() >= slots {
                let victim = order.iter().find(|(_, v)| !want.contains(v)).copied();
                if let Some((u, v)) = victim {
                    order.remove(&(u, v));
                    last.remove(&v);
                }
            }
            last.insert(k, now);
            order.insert((now, k));
        }
    }
    hits as f64 / total as f64
}

fn run_belady(trace: &[(u32, Vec<u32>)], slots: usize) -> f64 {
    // next[t][i]: the next request index after t that uses trace[t].1[i].
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); trace.len()];
    let mut seen: HashMap<Key, usize> = HashMap::new();
    for (t, (layer, ids)) in trace.iter().enumerate().rev() {
        next[t] = ids
            .iter()
            .map(|&e| seen.get(&(*layer, e)).copied().unwrap_or(usize::MAX))
            .collect();
        for &e in ids {
            seen.insert((*layer, e), t);
        }
    }
    let mut resident: HashMap<Key, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, Key)> = BTreeSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for (t, (layer, ids)) in trace.iter().enumerate() {
        let want: HashSet<Key> = ids.iter().map(|&e| (*layer, e)).collect();
        for (i, &e) in ids.iter().enumerate() {
            let k = (*layer, e);
            total += 1;
            if let Some(n) = resident.get(&k) {
                hits += 1;
                by_next.remove(&(*n, k));
            } else if resident.len() >= slots {
                let victim = by_next
                    .iter()
                    .rev()
                    .find(|(_, v)| !want.contains(v))
                    .copied();
                if let Some((n, v)) = victim {
                    by_next.remove(&(n, v));
                    resident.remove(&v);
                }
            }
            resident.insert(k, next[t][i]);
            by_next.insert((next[t][i], k));
        }
    }
    hits as f64 / total as f64
}

fn main() {
    let trace = trace(2026);
    let distinct: HashSet<Key> = trace
        .iter()
        .flat_map(|(l, ids)| ids.iter().map(move |&e| (*l, e)))
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
        let (p, l, b) = (
            run_policy(&trace, slots),
            run_lru(&trace, slots),
            run_belady(&trace, slots),
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
}
