//! Shared helpers for integration tests: deterministic random data and
//! tolerance checks against f64 scalar references.
#![allow(dead_code)]

mod reference_decode;
pub mod reference_model;
pub mod tiny_model;
#[allow(unused_imports)]
pub use reference_decode::reference;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform values in [-1, 1).
pub fn uniform(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub fn bytes(rng: &mut ChaCha8Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

/// Asserts `|got − want| ≤ tol[i]` element-wise, naming the first failure.
pub fn assert_within(got: &[f32], want: &[f64], tol: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() {
        let d = (got[i] as f64 - want[i]).abs();
        assert!(
            d <= tol[i],
            "{what}: element {i}: got {} want {} (|Δ| {d:e} > tol {:e})",
            got[i],
            want[i],
            tol[i]
        );
    }
}

/// Relative bound for one float32 result: `rel · scale + 1e-30`.
pub fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let tol = vec![rel * scale; want.len()];
    assert_within(got, want, &tol, what);
}
