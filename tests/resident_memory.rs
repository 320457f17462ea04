//! MLX peak memory of the tiled int8 lm_head: the f32 table is never expanded.
//!
//! One test per binary process: MLX's peak counter is process-wide, so nothing
//! else may allocate while it is measured (the two layouts run one after the
//! other inside the single test).
//!
//! Vocabulary 16384 rows; with 256 columns the f32 expansion of the table is
//! 16 MiB, with 200 columns 12.5 MiB. Tiles are 1024 rows. The bound asserted
//! is a quarter of the f32 expansion for a call on an uploaded head, and the
//! stored int8 bytes plus that quarter for the first call (which uploads).

#[path = "common/fixture.rs"]
mod fixture;

use fixture::{Dims, ShardBuilder, write_config};
use glm_stream::mlx::{self, Array, memory};
use glm_stream::quant::QuantFormat;
use glm_stream::resident::{
    Glm52WeightSource, LinearKernel, LinearPath, ResidentOptions, ResidentWeights,
};

const HEAD: &str = "lm_head.weight";
const VOCAB: usize = 16384;
const TILE: usize = 1024;
const TOKENS: usize = 3;

/// Returns the MLX peak growth (bytes) of the first and of a warm fast call, the
/// stored bytes, and the growth of the first reference-path call; checks the
/// logits against the reference path.
fn measure(hidden: usize, expect: LinearKernel) -> (usize, usize, usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let dims = Dims {
        hidden,
        vocab: VOCAB,
        ..Dims::default()
    };
    write_config(dir.path(), &dims);
    let mut b = ShardBuilder::new(hidden as u64);
    let q = b.quant(HEAD, QuantFormat::int8_row(VOCAB, hidden), 0.01);
    b.write(&dir.path().join("out-00000.safetensors"));
    let stored = q.bytes.len() + 4 * q.scales.len();

    let w = ResidentWeights::open(
        dir.path(),
        &ResidentOptions {
            head_tile_rows: TILE,
            ..ResidentOptions::default()
        },
    )
    .unwrap();
    assert_eq!(w.linear_kernel(HEAD).unwrap(), expect);
    let xv: Vec<f32> = (0..TOKENS * hidden)
        .map(|k| ((k * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let x = Array::from_slice(&xv, &[TOKENS as i32, hidden as i32]).unwrap();
    x.eval().unwrap();

    let growth = |f: &dyn Fn() -> Array| {
        memory::clear_cache();
        let base = memory::active();
        memory::reset_peak();
        let out = f();
        out.eval().unwrap();
        let g = memory::peak().saturating_sub(base);
        (out, g)
    };
    let (_, first) = growth(&|| w.linear(&x, HEAD, VOCAB, hidden).unwrap());
    let (fast, warm) = growth(&|| w.linear(&x, HEAD, VOCAB, hidden).unwrap());
    assert_eq!(fast.shape(), vec![TOKENS as i32, VOCAB as i32]);

    // Equal to the reference (computed after measuring: it expands the table).
    // Bound as in tests/resident.rs: 2·(n + 8)·ε·384·Σ s·|x|, with the row
    // scale below 0.015 and Σ|x| <= hidden.
    // Its growth also shows the meter sees a full expansion when one happens.
    let (refp, reference) = growth(&|| {
        w.linear_with(&x, HEAD, VOCAB, hidden, LinearPath::Reference)
            .unwrap()
    });
    let refv = refp.to_vec::<f32>().unwrap();
    let fast = fast.to_vec::<f32>().unwrap();
    let tol = 2.0 * (hidden + 8) as f32 * f32::EPSILON * 384.0 * 0.015 * hidden as f32;
    for (k, (a, b)) in fast.iter().zip(&refv).enumerate() {
        assert!((a - b).abs() <= tol, "logit {k}: {a} vs {b} (tol {tol:e})");
    }
    mlx::synchronize().unwrap();
    (first, warm, stored, reference)
}

#[test]
fn tiled_head_never_expands_the_table() {
    // 8-bit affine tiles (I % 32 == 0) and f32-expanded tiles (I = 200).
    for (hidden, kernel) in [
        (
            256,
            LinearKernel::Int8Tiled {
                tile_rows: TILE,
                group_size: Some(128),
            },
        ),
        (
            200,
            LinearKernel::Int8Tiled {
                tile_rows: TILE,
                group_size: None,
            },
        ),
    ] {
        let full_f32 = VOCAB * hidden * 4;
        let one_tile_f32 = TILE * hidden * 4;
        let (first, warm, stored, reference) = measure(hidden, kernel);
        eprintln!(
            "hidden {hidden}: f32 table {full_f32} B, one f32 tile {one_tile_f32} B, \
             stored {stored} B; peak growth first call {first} B, warm call {warm} B, \
             reference path {reference} B"
        );
        assert!(
            reference >= full_f32,
            "the meter must see the reference path's full expansion ({reference} B)"
        );
        assert!(
            warm < full_f32 / 4,
            "hidden {hidden}: warm call grew MLX memory by {warm} B, bound {} B",
            full_f32 / 4
        );
        assert!(
            first < stored + full_f32 / 4,
            "hidden {hidden}: first call grew MLX memory by {first} B, bound {} B",
            stored + full_f32 / 4
        );
    }
}
