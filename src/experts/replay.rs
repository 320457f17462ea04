//! Replays a [`RoutingTrace`] through slot pools of a given capacity:
//! the crate's [`ResidencyPolicy`], plain LRU and Belady's optimum. Pure
//! bookkeeping, no MLX and no I/O.
//!
//! All three serve the same requests ([`RoutingTrace::requests`]): per
//! record, the batch union of its experts cut into waves of at most
//! `capacity`; every expert of a wave must be resident at once, and a miss is
//! loaded on demand (no bypass, no prefetch).
//!
//! * [`replay_policy`]: [`ResidencyPolicy`] driven as the streamed executor
//!   drives it: `record_routes` for every row of a record, then per wave
//!   `acquire`, `complete` for each miss, `release`.
//! * [`lru`]: evict the least recently used expert not in the current wave.
//! * [`belady`]: evict the resident expert, not in the current wave, whose
//!   next use is farthest in the future (never used again counts as
//!   farthest). With whole waves as the unit of residency this is the fewest
//!   misses any demand-loading pool of that capacity can have on the trace,
//!   so it bounds the other two from above in hits.
//!
//! ```
//! use glm_stream::experts::replay::{belady, lru};
//! use glm_stream::experts::RoutingTrace;
//!
//! // One layer, one expert per token: a, b, c, a, b, c with two slots.
//! let mut t = RoutingTrace::new(3, 1)?;
//! for (call, e) in [0, 1, 2, 0, 1, 2].into_iter().enumerate() {
//!     t.push(call as u64, 0, vec![e])?;
//! }
//! assert_eq!(lru(&t, 2)?.hits, 0);
//! assert_eq!(belady(&t, 2)?.hits, 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use super::residency::{PolicyConfig, ResidencyPolicy};
use super::trace::{Request, RoutingTrace};
use super::{ExpertError, Result};
use std::collections::{BTreeSet, HashMap, HashSet};

/// Counters of one replay.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayResult {
    /// Pool slots.
    pub capacity: usize,
    /// Waves served.
    pub requests: u64,
    /// Requested experts that were resident.
    pub hits: u64,
    /// Requested experts that had to be loaded.
    pub misses: u64,
    /// `(hits, misses)` of each trace record, in record order.
    pub per_record: Vec<(u64, u64)>,
}

impl ReplayResult {
    fn new(capacity: usize, records: usize) -> Self {
        Self {
            capacity,
            per_record: vec![(0, 0); records],
            ..Self::default()
        }
    }

    fn count(&mut self, record: usize, hit: bool) {
        let c = &mut self.per_record[record];
        if hit {
            self.hits += 1;
            c.0 += 1;
        } else {
            self.misses += 1;
            c.1 += 1;
        }
    }

    /// `hits / (hits + misses)`; `None` for an empty trace.
    pub fn hit_rate(&self) -> Option<f64> {
        rate(self.hits, self.misses)
    }

    /// `(hits, misses)` summed over the records from `first` on (for
    /// example the decode steps after a prefill whose records came first).
    pub fn counts_from(&self, first: usize) -> (u64, u64) {
        self.per_record
            .iter()
            .skip(first)
            .fold((0, 0), |(h, m), &(a, b)| (h + a, m + b))
    }

    /// The hit rate over the records from `first` on; `None` when they
    /// requested nothing.
    pub fn hit_rate_from(&self, first: usize) -> Option<f64> {
        let (h, m) = self.counts_from(first);
        rate(h, m)
    }
}

fn rate(h: u64, m: u64) -> Option<f64> {
    (h + m > 0).then(|| h as f64 / (h + m) as f64)
}

type Key = (u32, u32);

fn check_capacity(capacity: usize) -> Result<()> {
    if capacity == 0 {
        return Err(ExpertError::Config(
            "a replay needs at least one slot".into(),
        ));
    }
    Ok(())
}

/// Replays `trace` through a [`ResidencyPolicy`] of `capacity` slots. Only
/// the tuning of `config` is used (`pin_fraction`, `repin_interval`): its
/// `layers`, `experts` and `slots` are taken from the trace and `capacity`.
pub fn replay_policy(
    trace: &RoutingTrace,
    capacity: usize,
    config: &PolicyConfig,
) -> Result<ReplayResult> {
    check_capacity(capacity)?;
    let mut out = ReplayResult::new(capacity, trace.len());
    if trace.is_empty() {
        return Ok(out);
    }
    let cfg = PolicyConfig {
        layers: trace.layer_count(),
        experts: trace.experts(),
        slots: capacity,
        ..config.clone()
    };
    let mut p = ResidencyPolicy::new(cfg)?;
    let requests = trace.requests(capacity);
    let mut next = 0usize;
    for (index, record) in trace.records().iter().enumerate() {
        for row in record.ids.chunks_exact(trace.top_k()) {
            p.record_routes(record.layer, row)?;
        }
        while let Some(r) = requests.get(next).filter(|r| r.record == index) {
            let lease = p.acquire(r.layer, &r.experts)?;
            for e in &lease.entries {
                out.count(index, e.hit);
                if !e.hit {
                    p.complete(lease.id, e.slot, true)?;
                }
            }
            p.release(lease.id)?;
            out.requests += 1;
            next += 1;
        }
    }
    Ok(out)
}

/// Replays `trace` through a plain LRU pool of `capacity` slots.
pub fn lru(trace: &RoutingTrace, capacity: usize) -> Result<ReplayResult> {
    check_capacity(capacity)?;
    Ok(lru_requests(
        &trace.requests(capacity),
        capacity,
        trace.len(),
    ))
}

/// Replays `trace` through a pool of `capacity` slots evicting by Belady's
/// rule (farthest next use first).
pub fn belady(trace: &RoutingTrace, capacity: usize) -> Result<ReplayResult> {
    check_capacity(capacity)?;
    Ok(belady_requests(
        &trace.requests(capacity),
        capacity,
        trace.len(),
    ))
}

fn keys(r: &Request) -> impl Iterator<Item = Key> + '_ {
    r.experts.iter().map(move |&e| (r.layer, e))
}

/// LRU over prepared requests (each no larger than `capacity`).
fn lru_requests(requests: &[Request], capacity: usize, records: usize) -> ReplayResult {
    let mut last: HashMap<Key, u64> = HashMap::new();
    let mut order: BTreeSet<(u64, Key)> = BTreeSet::new();
    let mut out = ReplayResult::new(capacity, records);
    for (t, r) in requests.iter().enumerate() {
        let now = t as u64 + 1;
        let want: HashSet<Key> = keys(r).collect();
        for k in keys(r) {
            if let Some(old) = last.get(&k) {
                out.count(r.record, true);
                order.remove(&(*old, k));
            } else {
                out.count(r.record, false);
                if last.len() >= capacity {
                    let victim = order.iter().find(|(_, v)| !want.contains(v)).copied();
                    if let Some((u, v)) = victim {
                        order.remove(&(u, v));
                        last.remove(&v);
                    }
                }
            }
            last.insert(k, now);
            order.insert((now, k));
        }
        out.requests += 1;
    }
    out
}

/// Belady over prepared requests (each no larger than `capacity`).
fn belady_requests(requests: &[Request], capacity: usize, records: usize) -> ReplayResult {
    // next[t][i]: the index of the next request after t that uses the i-th
    // expert of request t (usize::MAX: never).
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); requests.len()];
    let mut seen: HashMap<Key, usize> = HashMap::new();
    for (t, r) in requests.iter().enumerate().rev() {
        next[t] = keys(r)
            .map(|k| seen.get(&k).copied().unwrap_or(usize::MAX))
            .collect();
        for k in keys(r) {
            seen.insert(k, t);
        }
    }
    let mut resident: HashMap<Key, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, Key)> = BTreeSet::new();
    let mut out = ReplayResult::new(capacity, records);
    for (t, r) in requests.iter().enumerate() {
        let want: HashSet<Key> = keys(r).collect();
        for (i, k) in keys(r).enumerate() {
            if let Some(n) = resident.get(&k) {
                out.count(r.record, true);
                by_next.remove(&(*n, k));
            } else {
                out.count(r.record, false);
                if resident.len() >= capacity {
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
            }
            resident.insert(k, next[t][i]);
            by_next.insert((next[t][i], k));
        }
        out.requests += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// One record per step of `(layer, ids)`.
    fn trace(experts: u32, top_k: usize, steps: &[(u32, Vec<u32>)]) -> RoutingTrace {
        let mut t = RoutingTrace::new(experts, top_k).unwrap();
        for (call, (layer, ids)) in steps.iter().enumerate() {
            t.push(call as u64, *layer, ids.clone()).unwrap();
        }
        t
    }

    fn single(seq: &[u32]) -> RoutingTrace {
        let steps: Vec<(u32, Vec<u32>)> = seq.iter().map(|&e| (0, vec![e])).collect();
        trace(8, 1, &steps)
    }

    fn random_trace(
        seed: u64,
        layers: u32,
        experts: u32,
        top_k: usize,
        tokens: usize,
    ) -> RoutingTrace {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut steps = Vec::new();
        for _ in 0..tokens {
            for layer in 0..layers {
                let mut row = Vec::new();
                while row.len() < top_k {
                    // Skewed: low ids are more popular.
                    let u: f64 = rng.random();
                    let e = ((u * u) * f64::from(experts)) as u32;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                steps.push((layer, row));
            }
        }
        trace(experts, top_k, &steps)
    }

    #[test]
    fn cyclic_pattern_exact_counts() {
        // a b c a b c, 2 slots: LRU always evicts the next one used;
        // Belady keeps a (t3) then c (t5).
        let t = single(&[0, 1, 2, 0, 1, 2]);
        let l = lru(&t, 2).unwrap();
        let b = belady(&t, 2).unwrap();
        assert_eq!((l.hits, l.misses, l.requests), (0, 6, 6));
        assert_eq!((b.hits, b.misses, b.requests), (2, 4, 6));
        assert_eq!(b.hit_rate(), Some(2.0 / 6.0));
        assert_eq!(
            b.per_record,
            vec![(0, 1), (0, 1), (0, 1), (1, 0), (0, 1), (1, 0)]
        );
        assert_eq!(b.counts_from(3), (2, 1));
        assert_eq!(b.hit_rate_from(6), None);
        // Three slots: only the compulsory misses.
        for r in [lru(&t, 3).unwrap(), belady(&t, 3).unwrap()] {
            assert_eq!((r.hits, r.misses), (3, 3));
        }
    }

    #[test]
    fn textbook_belady_example() {
        // The classic reference string 7 0 1 2 0 3 0 4 2 3 0 3 2 with 3
        // frames: OPT faults at references 0 1 2 3 5 7 10, LRU also at 8 and 9.
        let seq = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2];
        let t = single(&seq);
        assert_eq!(belady(&t, 3).unwrap().misses, 7);
        assert_eq!(lru(&t, 3).unwrap().misses, 9);
    }

    #[test]
    fn waves_must_be_resident_together() {
        // Two-expert waves with two slots: every new wave evicts the whole
        // pool, whatever the rule.
        let t = trace(4, 2, &[(0, vec![0, 1]), (0, vec![2, 3]), (0, vec![0, 1])]);
        for r in [lru(&t, 2).unwrap(), belady(&t, 2).unwrap()] {
            assert_eq!((r.hits, r.misses), (0, 6));
        }
        // A two-row record with capacity 3: union {0,1,2,3} is two waves.
        let t = trace(4, 2, &[(0, vec![0, 1, 2, 3]), (0, vec![3, 2])]);
        let b = belady(&t, 3).unwrap();
        assert_eq!(b.requests, 3);
        assert_eq!((b.hits, b.misses), (2, 4));
    }

    #[test]
    fn layers_are_distinct_keys() {
        let t = trace(
            2,
            1,
            &[(0, vec![0]), (1, vec![0]), (0, vec![0]), (1, vec![0])],
        );
        let b = belady(&t, 2).unwrap();
        assert_eq!((b.hits, b.misses), (2, 2));
        let b = belady(&t, 1).unwrap();
        assert_eq!((b.hits, b.misses), (0, 4));
    }

    #[test]
    fn policy_without_pins_is_lru_on_single_expert_requests() {
        let t = random_trace(3, 2, 16, 1, 300);
        let cfg = PolicyConfig {
            pin_fraction: 0.0,
            ..PolicyConfig::new(1, 1, 1)
        };
        for cap in [1, 2, 4, 8, 16, 32] {
            let p = replay_policy(&t, cap, &cfg).unwrap();
            let l = lru(&t, cap).unwrap();
            assert_eq!((p.hits, p.misses), (l.hits, l.misses), "capacity {cap}");
        }
    }

    #[test]
    fn belady_bounds_policy_and_lru() {
        for seed in 0..6 {
            let t = random_trace(seed, 3, 32, 4, 120);
            let total = t.rows() as u64 * 4;
            for cap in [4, 6, 12, 24, 48, 96] {
                let b = belady(&t, cap).unwrap();
                let l = lru(&t, cap).unwrap();
                let p = replay_policy(&t, cap, &PolicyConfig::new(1, 1, 1)).unwrap();
                for r in [&b, &l, &p] {
                    assert_eq!(r.hits + r.misses, total, "seed {seed} capacity {cap}");
                    assert_eq!(r.requests, t.len() as u64);
                    assert_eq!(r.counts_from(0), (r.hits, r.misses));
                }
                assert!(
                    b.hits >= l.hits,
                    "seed {seed} cap {cap}: belady {b:?} lru {l:?}"
                );
                assert!(
                    b.hits >= p.hits,
                    "seed {seed} cap {cap}: belady {b:?} policy {p:?}"
                );
            }
            // Room for everything: only compulsory misses.
            let distinct = 3 * 32;
            for r in [
                belady(&t, distinct).unwrap(),
                lru(&t, distinct).unwrap(),
                replay_policy(&t, distinct, &PolicyConfig::new(1, 1, 1)).unwrap(),
            ] {
                let seen: HashSet<Key> = t
                    .records()
                    .iter()
                    .flat_map(|r| r.ids.iter().map(move |&e| (r.layer, e)))
                    .collect();
                assert_eq!(r.misses, seen.len() as u64);
            }
        }
    }

    #[test]
    fn zero_capacity_and_empty_trace() {
        let t = single(&[1]);
        assert!(lru(&t, 0).is_err());
        assert!(belady(&t, 0).is_err());
        assert!(replay_policy(&t, 0, &PolicyConfig::new(1, 1, 1)).is_err());
        let empty = RoutingTrace::new(4, 1).unwrap();
        let r = replay_policy(&empty, 2, &PolicyConfig::new(1, 1, 1)).unwrap();
        assert_eq!(r.hit_rate(), None);
        assert_eq!(belady(&empty, 2).unwrap().requests, 0);
    }
}
