//! The resident weights view on small containers: every fast linear path
//! against the f32 reference path and an f64 host product, gathered
//! embeddings against the host decoder, the resident set and lazy shard
//! opening, and every error class.
//!
//! Tolerances (f32, ε = 2⁻²³): a sum of `n` products computed in f32 in any
//! order is within `γ·Σ|terms|` of the exact sum, `γ = n·ε/(1 − n·ε)`; we use
//! `(n + 8)·ε` to cover the few extra roundings (scale multiply, bias add).
//! MLX's affine kernel does not sum `(n − 8)·s·x`: it sums `(s·u + b)·x` with
//! `u` the stored unsigned code and `b = −8·s` (int4) or `−128·s` (int8), whose
//! terms are up to `23·s·|x|` (int4) or `383·s·|x|` (int8), so the bound for
//! fast vs reference is `(n + 8)·ε·C·Σ_k s·|x_k|` with C = 24 or 384. A layout
//! bug (wrong nibble order, wrong scale group, unflipped sign bit) gives errors
//! of order `Σ_k s·|x_k|` itself, hundreds of times the bound.

#[path = "common/reference_decode.rs"]
mod reference_decode;

#[path = "common/fixture.rs"]
mod fixture;

use std::path::Path;

use fixture::{Dims, FloatData, QuantData, ShardBuilder, matmul_t_f64, scale_at, write_config};
use glm_stream::mlx::{Array, Dtype};
use glm_stream::quant::QuantFormat;
use glm_stream::resident::{
    Glm52WeightSource, LinearKernel, LinearPath, ResidentError, ResidentOptions, ResidentWeights,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use reference_decode::reference;

const EPS: f64 = f32::EPSILON as f64;
const GATE: &str = "model.layers.0.mlp.gate_proj.weight";
const HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";

fn opts(tile: usize) -> ResidentOptions {
    ResidentOptions {
        head_tile_rows: tile,
        ..ResidentOptions::default()
    }
}

/// What a single-tensor container holds.
enum Stored {
    Quant(QuantData),
    Float(FloatData),
}

impl Stored {
    fn shape(&self) -> [usize; 2] {
        match self {
            Stored::Quant(q) => [q.format.rows, q.format.cols],
            Stored::Float(f) => [f.shape[0], f.shape[1]],
        }
    }

    /// The weight decoded by the independent scalar reference decoder.
    fn values(&self) -> Vec<f32> {
        match self {
            Stored::Quant(q) => reference(
                q.format.bits,
                q.format.group_size.map(|g| g as usize),
                q.format.rows,
                q.format.cols,
                &q.bytes,
                &q.scales,
            ),
            Stored::Float(f) => f.values.clone(),
        }
    }
}

enum Kind {
    Quant(QuantFormat),
    Float(safetensors::Dtype, [usize; 2]),
}

/// A container whose only tensor is `name` (`gate_proj`, `lm_head` or the
/// embedding) in `kind`; the config dimensions are set to match its shape.
fn single(dir: &Path, name: &str, kind: &Kind, seed: u64) -> Stored {
    let [rows, cols] = match kind {
        Kind::Quant(f) => [f.rows, f.cols],
        Kind::Float(_, s) => *s,
    };
    let mut dims = Dims {
        hidden: cols,
        ..Dims::default()
    };
    if name == GATE {
        dims.inter = rows;
    } else {
        dims.vocab = rows;
    }
    write_config(dir, &dims);
    let mut b = ShardBuilder::new(seed);
    let stored = match kind {
        Kind::Quant(f) => Stored::Quant(b.quant(name, *f, 0.01)),
        Kind::Float(dtype, shape) => Stored::Float(b.float(name, *dtype, shape)),
    };
    b.write(&dir.join("out-00000.safetensors"));
    stored
}

fn random_x(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1f32..1.0)).collect()
}

/// Per-output bound `(n + 8)·ε·C·Σ_k w_k·|x_k|` with `w_k` the scale (quantized,
/// C = 24 or 384) or `|W_ok|` (float, C = 1).
fn bounds(stored: &Stored, x: &[f32], t: usize) -> Vec<f64> {
    let [o, i] = stored.shape();
    let gamma = (i + 8) as f64 * EPS;
    let w = stored.values();
    let mut out = vec![0f64; t * o];
    for r in 0..t {
        for c in 0..o {
            let a: f64 = (0..i)
                .map(|k| {
                    let m = match stored {
                        Stored::Quant(q) => {
                            let c_fmt = if q.format.bits == 8 { 384.0 } else { 24.0 };
                            c_fmt * scale_at(q, c, k) as f64
                        }
                        Stored::Float(_) => w[c * i + k].abs() as f64,
                    };
                    m * (x[r * i + k] as f64).abs()
                })
                .sum();
            // 2x: fast and reference each carry their own rounding.
            out[r * o + c] = 2.0 * gamma * a + 1e-30;
        }
    }
    out
}

fn assert_within(got: &[f32], want: &[f64], tol: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for k in 0..got.len() {
        let d = (got[k] as f64 - want[k]).abs();
        assert!(
            d <= tol[k],
            "{what}: element {k}: got {} want {} (|Δ| {d:e} > tol {:e})",
            got[k],
            want[k],
            tol[k]
        );
    }
}

/// Fast path == reference path == f64 host product, for 1, 3 and 5 tokens and
/// a 3-D input, and the expected kernel.
fn check_linear(name: &str, kind: Kind, tile: usize, expect: LinearKernel, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let stored = single(dir.path(), name, &kind, seed);
    let [o, i] = stored.shape();
    let w = ResidentWeights::open(dir.path(), &opts(tile)).unwrap();
    assert_eq!(w.linear_kernel(name).unwrap(), expect, "{name} {o}x{i}");
    let weights = stored.values();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    for (shape, t) in [
        (vec![1, i], 1),
        (vec![3, i], 3),
        (vec![5, i], 5),
        (vec![1, 3, i], 3),
    ] {
        let xv = random_x(&mut rng, t * i);
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let x = Array::from_slice(&xv, &dims).unwrap();
        let fast = w.linear(&x, name, o, i).unwrap();
        let mut out_shape = dims.clone();
        *out_shape.last_mut().unwrap() = o as i32;
        assert_eq!(fast.shape(), out_shape);
        assert_eq!(fast.dtype(), Dtype::Float32);
        let refp = w
            .linear_with(&x, name, o, i, LinearPath::Reference)
            .unwrap();
        let fast = fast.to_vec::<f32>().unwrap();
        let refv = refp.to_vec::<f32>().unwrap();
        let exact = matmul_t_f64(&xv, &weights, t, o, i);
        let tol = bounds(&stored, &xv, t);
        let what = format!("{name} {expect:?} [{o}x{i}] x{shape:?}");
        let refd: Vec<f64> = refv.iter().map(|&v| v as f64).collect();
        assert_within(&fast, &refd, &tol, &format!("{what}: fast vs reference"));
        // The reference path is a plain f32 matmul of exactly decoded weights.
        let tol_ref: Vec<f64> = {
            let gamma = (i + 2) as f64 * EPS;
            (0..t * o)
                .map(|k| {
                    let (r, c) = (k / o, k % o);
                    gamma
                        * (0..i)
                            .map(|j| (xv[r * i + j] as f64 * weights[c * i + j] as f64).abs())
                            .sum::<f64>()
                        + 1e-30
                })
                .collect()
        };
        assert_within(
            &refv,
            &exact,
            &tol_ref,
            &format!("{what}: reference vs f64"),
        );
    }
}

#[test]
fn int4_per_row_linear() {
    use QuantFormat as Q;
    let q4 = |group_size, scale_repeat| LinearKernel::Q4 {
        group_size,
        scale_repeat,
    };
    check_linear(GATE, Kind::Quant(Q::int4_row(96, 128)), 2048, q4(64, 2), 1);
    check_linear(GATE, Kind::Quant(Q::int4_row(64, 96)), 2048, q4(32, 3), 2);
    // Widths MLX's kernels cannot take go through the f32 path.
    let deq = LinearKernel::Dequantized;
    check_linear(GATE, Kind::Quant(Q::int4_row(40, 80)), 2048, deq, 3);
    check_linear(GATE, Kind::Quant(Q::int4_row(24, 67)), 2048, deq, 4);
}

#[test]
fn int4_grouped_linear() {
    use QuantFormat as Q;
    let q4 = |group_size, scale_repeat| LinearKernel::Q4 {
        group_size,
        scale_repeat,
    };
    // Group sizes MLX accepts, used as stored.
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(48, 128, 32)),
        2048,
        q4(32, 1),
        5,
    );
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(48, 128, 64)),
        2048,
        q4(64, 1),
        6,
    );
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(40, 256, 128)),
        2048,
        q4(128, 1),
        7,
    );
    // Other multiples of 32 repeat into groups of 32, including a partial
    // last group (g64 on I = 160).
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(40, 192, 96)),
        2048,
        q4(32, 3),
        8,
    );
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(32, 384, 192)),
        2048,
        q4(32, 6),
        9,
    );
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(32, 160, 64)),
        2048,
        q4(32, 2),
        10,
    );
    // Group sizes MLX cannot express take the f32 path.
    let deq = LinearKernel::Dequantized;
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(32, 96, 48)),
        2048,
        deq,
        11,
    );
    check_linear(
        GATE,
        Kind::Quant(Q::int4_grouped(32, 128, 16)),
        2048,
        deq,
        12,
    );
}

#[test]
fn int8_and_float_linear() {
    use QuantFormat as Q;
    let a = |group_size| LinearKernel::Int8Affine { group_size };
    check_linear(GATE, Kind::Quant(Q::int8_row(48, 128)), 2048, a(128), 13);
    check_linear(GATE, Kind::Quant(Q::int8_row(40, 96)), 2048, a(32), 14);
    check_linear(
        GATE,
        Kind::Quant(Q::int8_row(24, 67)),
        2048,
        LinearKernel::Dequantized,
        15,
    );
    use safetensors::Dtype as D;
    check_linear(
        GATE,
        Kind::Float(D::F32, [24, 128]),
        2048,
        LinearKernel::Float,
        16,
    );
    check_linear(
        GATE,
        Kind::Float(D::BF16, [24, 64]),
        2048,
        LinearKernel::Float,
        17,
    );
    check_linear(
        GATE,
        Kind::Float(D::F16, [16, 40]),
        2048,
        LinearKernel::Float,
        18,
    );
}

#[test]
fn lm_head_tiles() {
    use QuantFormat as Q;
    // 1000 rows in tiles of 256: three full tiles and a partial one.
    let tiled = |tile_rows, group_size| LinearKernel::Int8Tiled {
        tile_rows,
        group_size,
    };
    check_linear(
        HEAD,
        Kind::Quant(Q::int8_row(1000, 128)),
        256,
        tiled(256, Some(128)),
        20,
    );
    // A width the affine kernel cannot take: f32-expanded tiles.
    check_linear(
        HEAD,
        Kind::Quant(Q::int8_row(333, 67)),
        100,
        tiled(100, None),
        21,
    );
    // One tile holding everything.
    check_linear(
        HEAD,
        Kind::Quant(Q::int8_row(40, 64)),
        2048,
        tiled(2048, Some(64)),
        22,
    );
    // An int4 head uses the Q4 kernel.
    let q4 = LinearKernel::Q4 {
        group_size: 64,
        scale_repeat: 2,
    };
    check_linear(HEAD, Kind::Quant(Q::int4_row(200, 128)), 64, q4, 23);
}

/// Embedding rows equal the independent host decode bit for bit (both compute
/// `float(q)·s` with one rounding), for every layout, duplicate and odd ids.
#[test]
fn embedding_gathers_exact_rows() {
    use QuantFormat as Q;
    use safetensors::Dtype as D;
    let kinds = [
        Kind::Quant(Q::int8_row(50, 128)),
        Kind::Quant(Q::int8_row(37, 67)),
        Kind::Quant(Q::int4_row(50, 128)),
        Kind::Quant(Q::int4_row(41, 67)),
        Kind::Quant(Q::int4_grouped(50, 128, 64)),
        Kind::Quant(Q::int4_grouped(30, 96, 48)),
        Kind::Quant(Q::int4_grouped(30, 160, 64)),
        Kind::Float(D::F32, [20, 24]),
        Kind::Float(D::BF16, [20, 32]),
    ];
    for (seed, kind) in kinds.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let stored = single(dir.path(), EMBED, kind, 100 + seed as u64);
        let [v, h] = stored.shape();
        let all = stored.values();
        let w = ResidentWeights::open(dir.path(), &ResidentOptions::default()).unwrap();
        let ids: Vec<u32> = vec![0, v as u32 - 1, 7, 7, 3];
        let got = w.embedding(&ids, EMBED, v, h).unwrap();
        assert_eq!(got.shape(), vec![ids.len() as i32, h as i32]);
        let got = got.to_vec::<f32>().unwrap();
        for (p, &id) in ids.iter().enumerate() {
            let want = &all[id as usize * h..(id as usize + 1) * h];
            let row = &got[p * h..(p + 1) * h];
            assert!(
                row.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{v}x{h} row {id} at {p} differs"
            );
        }
        // A single odd id and no ids at all.
        assert_eq!(
            w.embedding(&[5], EMBED, v, h).unwrap().shape(),
            vec![1, h as i32]
        );
        assert_eq!(
            w.embedding(&[], EMBED, v, h).unwrap().shape(),
            vec![0, h as i32]
        );
        // dequantized() of the whole table is the same decode.
        let full = w.dequantized(EMBED, v, h).unwrap().to_vec::<f32>().unwrap();
        assert!(
            full.iter()
                .zip(&all)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}

/// A three-shard container: shard 0 the resident tensors, shard 1 only routed
/// experts, the MTP shard the MTP layer (with its own routed experts).
struct Model {
    dir: tempfile::TempDir,
    dims: Dims,
    gate: QuantData,
    eh_proj: QuantData,
    norm: FloatData,
}

const ROUTED: &str = "model.layers.1.mlp.experts.0.gate_proj.weight";
const MTP_ROUTED: &str = "model.layers.2.mlp.experts.1.up_proj.weight";
const EH_PROJ: &str = "model.layers.2.eh_proj.weight";
const NORM: &str = "model.norm.weight";
const ROUTER: &str = "model.layers.1.mlp.gate.weight";
const SHARED: &str = "model.layers.1.mlp.shared_experts.gate_proj.weight";

fn model() -> Model {
    let dir = tempfile::tempdir().unwrap();
    let d = Dims::default();
    write_config(dir.path(), &d);
    let f = safetensors::Dtype::F32;
    let mut s0 = ShardBuilder::new(1);
    s0.quant(EMBED, QuantFormat::int8_row(d.vocab, d.hidden), 0.01);
    s0.quant(HEAD, QuantFormat::int8_row(d.vocab, d.hidden), 0.01);
    let norm = s0.float(NORM, f, &[d.hidden]);
    let gate = s0.quant(GATE, QuantFormat::int4_grouped(d.inter, d.hidden, 64), 0.01);
    s0.quant(SHARED, QuantFormat::int4_row(d.moe_inter, d.hidden), 0.01);
    s0.float(ROUTER, f, &[d.experts, d.hidden]);
    s0.float(
        "model.layers.1.mlp.gate.e_score_correction_bias",
        f,
        &[d.experts],
    );
    s0.write(&dir.path().join("out-00000.safetensors"));
    let mut s1 = ShardBuilder::new(2);
    for e in 0..d.experts {
        for p in ["gate_proj", "up_proj"] {
            let n = format!("model.layers.1.mlp.experts.{e}.{p}.weight");
            s1.quant(
                &n,
                QuantFormat::int4_grouped(d.moe_inter, d.hidden, 64),
                0.01,
            );
        }
        let n = format!("model.layers.1.mlp.experts.{e}.down_proj.weight");
        s1.quant(
            &n,
            QuantFormat::int4_grouped(d.hidden, d.moe_inter, 64),
            0.01,
        );
    }
    s1.write(&dir.path().join("out-00001.safetensors"));
    let mut m = ShardBuilder::new(3);
    let eh_proj = m.quant(EH_PROJ, QuantFormat::int8_row(d.hidden, 2 * d.hidden), 0.01);
    m.float("model.layers.2.enorm.weight", f, &[d.hidden]);
    for e in 0..2 {
        for p in ["gate_proj", "up_proj"] {
            let n = format!("model.layers.2.mlp.experts.{e}.{p}.weight");
            m.quant(&n, QuantFormat::int8_row(d.moe_inter, d.hidden), 0.01);
        }
    }
    m.write(&dir.path().join("out-mtp-00000.safetensors"));
    Model {
        dir,
        dims: d,
        gate,
        eh_proj,
        norm,
    }
}

fn file_size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn resident_set_and_lazy_shards() {
    let m = model();
    let d = m.dims;
    let shard0 = m.dir.path().join("out-00000.safetensors");
    let mtp = m.dir.path().join("out-mtp-00000.safetensors");
    let no_mtp = ResidentOptions {
        include_mtp: false,
        ..ResidentOptions::default()
    };
    let w = ResidentWeights::open(m.dir.path(), &no_mtp).unwrap();
    // Resident: embedding, head, norm, gate_proj, shared expert, router + bias.
    assert_eq!(w.names().count(), 7);
    assert!(w.has(GATE) && w.has(NORM) && w.has(ROUTER) && w.has(SHARED));
    assert!(!w.has(ROUTED) && !w.has(EH_PROJ) && !w.has(MTP_ROUTED));
    assert!(!w.has(&format!("{GATE}.qs")));
    let expected_bytes: u64 = w
        .names()
        .map(|n| w.container().weight(n).unwrap().stored_bytes())
        .sum();
    assert_eq!(w.weights_bytes(), expected_bytes);
    assert!(w.weights_bytes() > 0);
    assert_eq!(w.owning_shard_count(), 1);
    // Nothing is opened at open.
    assert_eq!((w.mapped_shard_count(), w.mapped_shard_bytes()), (0, 0));

    let x = Array::from_slice(&vec![0.5f32; d.hidden], &[1, d.hidden as i32]).unwrap();
    w.linear(&x, GATE, d.inter, d.hidden)
        .unwrap()
        .eval()
        .unwrap();
    assert_eq!(w.mapped_shard_count(), 1);
    assert_eq!(w.mapped_shard_bytes(), file_size(&shard0));
    // A refused routed expert opens nothing.
    assert!(w.tensor(ROUTED).is_err());
    w.tensor(NORM).unwrap().eval().unwrap();
    assert_eq!(w.mapped_shard_count(), 1);
    assert!(w.cached_bytes() > 0);

    // With the MTP layer: its shard owns eh_proj and is opened on first use.
    let w = ResidentWeights::open(m.dir.path(), &ResidentOptions::default()).unwrap();
    assert_eq!(w.names().count(), 9);
    assert!(w.has(EH_PROJ) && !w.has(MTP_ROUTED));
    assert_eq!(w.owning_shard_count(), 2);
    let x2 = Array::from_slice(&vec![0.25f32; 2 * d.hidden], &[1, 2 * d.hidden as i32]).unwrap();
    let out = w.linear(&x2, EH_PROJ, d.hidden, 2 * d.hidden).unwrap();
    assert_eq!(w.mapped_shard_count(), 1);
    assert_eq!(w.mapped_shard_bytes(), file_size(&mtp));
    assert_eq!(
        w.linear_kernel(EH_PROJ).unwrap(),
        LinearKernel::Int8Affine { group_size: 128 }
    );
    let want = matmul_t_f64(
        &vec![0.25f32; 2 * d.hidden],
        &reference(
            8,
            None,
            d.hidden,
            2 * d.hidden,
            &m.eh_proj.bytes,
            &m.eh_proj.scales,
        ),
        1,
        d.hidden,
        2 * d.hidden,
    );
    let got = out.to_vec::<f32>().unwrap();
    for (g, e) in got.iter().zip(&want) {
        assert!(
            (*g as f64 - e).abs() <= 1e-3 * e.abs().max(1.0),
            "{g} vs {e}"
        );
    }

    // tensor(): quantized weights as their stored bytes, floats as stored.
    let raw = w.tensor(GATE).unwrap();
    assert_eq!(raw.dtype(), Dtype::Uint8);
    assert_eq!(raw.to_vec::<u8>().unwrap(), m.gate.bytes);
    let norm = w.tensor(NORM).unwrap();
    assert_eq!(norm.shape(), vec![d.hidden as i32]);
    assert_eq!(norm.to_vec::<f32>().unwrap(), m.norm.values);
    assert_eq!(w.mapped_shard_count(), 2);
    w.clear_cache();
    assert_eq!(w.cached_bytes(), 0);
}

fn err_text(e: ResidentError) -> String {
    e.to_string()
}

#[test]
fn errors_are_typed_and_named() {
    let m = model();
    let d = m.dims;
    let no_mtp = ResidentOptions {
        include_mtp: false,
        ..ResidentOptions::default()
    };
    let w = ResidentWeights::open(m.dir.path(), &no_mtp).unwrap();
    let x = Array::from_slice(&vec![0.5f32; d.hidden], &[1, d.hidden as i32]).unwrap();

    // Routed experts, regular and MTP, through every entry point.
    for name in [ROUTED, MTP_ROUTED] {
        let checks = [
            w.tensor(name).map(|_| ()),
            w.dequantized(name, d.moe_inter, d.hidden).map(|_| ()),
            w.linear(&x, name, d.moe_inter, d.hidden).map(|_| ()),
            w.embedding(&[0], name, d.moe_inter, d.hidden).map(|_| ()),
        ];
        for r in checks {
            let e = r.unwrap_err();
            assert!(matches!(e, ResidentError::RoutedExpert { .. }), "{e:?}");
            let t = err_text(e);
            assert!(
                t.contains(name)
                    && t.contains("routed experts require the streamed expert backend"),
                "{t}"
            );
        }
    }
    assert_eq!(w.mapped_shard_count(), 0);

    // Unknown, MTP-excluded and scale-companion names.
    for (name, reason) in [
        (
            "model.layers.0.mlp.nonexistent.weight",
            "not in the container",
        ),
        (EH_PROJ, "MTP tensors are excluded"),
        ("model.layers.0.mlp.gate_proj.weight.qs", "scale companion"),
    ] {
        let e = w.tensor(name).unwrap_err();
        assert!(matches!(e, ResidentError::NotResident { .. }), "{e:?}");
        let t = err_text(e);
        assert!(
            t.contains(name) && t.contains("outside the resident") && t.contains(reason),
            "{t}"
        );
    }

    // Wrong [rows, cols] for the descriptor, on every shaped entry point.
    let e = w.linear(&x, GATE, d.inter + 1, d.hidden).unwrap_err();
    assert!(matches!(e, ResidentError::ShapeMismatch { .. }), "{e:?}");
    let t = err_text(e);
    assert!(
        t.contains(GATE) && t.contains("int4-g64") && t.contains("[96, 128]"),
        "{t}"
    );
    let e = w.dequantized(GATE, d.hidden, d.inter).unwrap_err();
    assert!(matches!(e, ResidentError::ShapeMismatch { .. }), "{e:?}");
    let e = w.embedding(&[0], EMBED, d.vocab, d.hidden + 2).unwrap_err();
    assert!(matches!(e, ResidentError::ShapeMismatch { .. }), "{e:?}");
    let e = w.linear(&x, ROUTER, d.experts, d.hidden * 2).unwrap_err();
    assert!(matches!(e, ResidentError::ShapeMismatch { .. }), "{e:?}");
    // A 1-D float tensor is a [1, n] matrix; asked as anything else it fails.
    let e = w.dequantized(NORM, d.hidden, 1).unwrap_err();
    assert!(matches!(e, ResidentError::ShapeMismatch { .. }), "{e:?}");

    // x whose last dimension is not cols, or not a float array.
    let x_bad = Array::from_slice(&vec![0.5f32; 3 * 64], &[3, 64]).unwrap();
    let e = w.linear(&x_bad, GATE, d.inter, d.hidden).unwrap_err();
    assert!(matches!(e, ResidentError::BadInput { .. }), "{e:?}");
    assert!(err_text(e).contains("[3, 64]"));
    let x_int = Array::from_slice(&vec![1i32; d.hidden], &[1, d.hidden as i32]).unwrap();
    let e = w.linear(&x_int, GATE, d.inter, d.hidden).unwrap_err();
    assert!(matches!(e, ResidentError::BadInput { .. }), "{e:?}");

    // Token ids checked on the host before any gather.
    let e = w
        .embedding(&[1, 2, 64, 3], EMBED, d.vocab, d.hidden)
        .unwrap_err();
    match &e {
        ResidentError::TokenOutOfRange {
            id,
            position,
            vocab,
            ..
        } => assert_eq!((*id, *position, *vocab), (64, 2, 64)),
        other => panic!("{other:?}"),
    }
    assert!(err_text(e).contains("token id 64 at position 2"));
    let e = w
        .embedding(&[u32::MAX], EMBED, d.vocab, d.hidden)
        .unwrap_err();
    assert!(matches!(e, ResidentError::TokenOutOfRange { .. }), "{e:?}");

    // Bad options.
    let e = ResidentWeights::open(
        m.dir.path(),
        &ResidentOptions {
            head_tile_rows: 0,
            ..ResidentOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, ResidentError::InvalidOption(_)), "{e:?}");
    // Not a container.
    let empty = tempfile::tempdir().unwrap();
    let e = ResidentWeights::open(empty.path(), &ResidentOptions::default()).unwrap_err();
    assert!(matches!(e, ResidentError::Container(_)), "{e:?}");
}

#[test]
fn shard_deleted_or_replaced_after_open() {
    let m = model();
    let d = m.dims;
    let shard0 = m.dir.path().join("out-00000.safetensors");
    let x = Array::from_slice(&vec![0.5f32; d.hidden], &[1, d.hidden as i32]).unwrap();

    // A tensor already uploaded keeps working; a new one from the deleted
    // shard fails naming the file.
    let w = ResidentWeights::open(m.dir.path(), &ResidentOptions::default()).unwrap();
    let before = w
        .linear(&x, GATE, d.inter, d.hidden)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let w2 = ResidentWeights::open(m.dir.path(), &ResidentOptions::default()).unwrap();
    std::fs::remove_file(&shard0).unwrap();
    let again = w
        .linear(&x, GATE, d.inter, d.hidden)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(before, again);
    for r in [
        w2.linear(&x, GATE, d.inter, d.hidden).map(|_| ()),
        w2.embedding(&[1], EMBED, d.vocab, d.hidden).map(|_| ()),
        w2.tensor(NORM).map(|_| ()),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, ResidentError::ShardOpen { .. }), "{e:?}");
        let t = err_text(e);
        assert!(
            t.contains("out-00000.safetensors") && t.contains("cannot open shard"),
            "{t}"
        );
    }
    assert_eq!(w2.mapped_shard_count(), 0);

    // A shard replaced by a file of another size is refused too.
    std::fs::write(&shard0, b"not the shard the catalog was read from").unwrap();
    let e = w2.tensor(NORM).unwrap_err();
    assert!(matches!(e, ResidentError::ShardChanged { .. }), "{e:?}");
    assert!(err_text(e).contains("changed since the container was opened"));
    // The MTP shard is still readable.
    w2.tensor(EH_PROJ).unwrap().eval().unwrap();
}

#[test]
fn reference_option_is_the_default_path() {
    let m = model();
    let d = m.dims;
    let w = ResidentWeights::open(
        m.dir.path(),
        &ResidentOptions {
            linear_path: LinearPath::Reference,
            ..ResidentOptions::default()
        },
    )
    .unwrap();
    let xv: Vec<f32> = (0..d.hidden).map(|k| (k as f32 * 0.37).sin()).collect();
    let x = Array::from_slice(&xv, &[1, d.hidden as i32]).unwrap();
    let a = w
        .linear(&x, GATE, d.inter, d.hidden)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let b = w
        .linear_with(&x, GATE, d.inter, d.hidden, LinearPath::Reference)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(a, b);
    // A bf16 input on the fast path runs the kernel in bf16.
    let xb = x.astype(Dtype::Bfloat16).unwrap();
    let out = w
        .linear_with(&xb, GATE, d.inter, d.hidden, LinearPath::Fast)
        .unwrap();
    assert_eq!(out.dtype(), Dtype::Bfloat16);
    let out = out.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    for (g, e) in out.iter().zip(&b) {
        // bf16 has 8 significant bits; CPU bf16 accumulation is coarse.
        assert!((g - e).abs() <= 0.1 * e.abs().max(0.5), "{g} vs {e}");
    }
}
