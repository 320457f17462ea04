//! MLX binding ops against independent f64 scalar references on random data.
//!
//! Tolerances: float32 results are compared with f64 references. An f32 dot
//! product of n terms errs by at most about n·ε·Σ|terms| (ε = 6e-8); for the
//! sizes here (n ≤ 512) that is < 3.1e-5 of Σ|terms|, so dot-product results
//! use `4e-5 · Σ|terms|`. Element-wise transcendental ops are accurate to a few
//! ulps: 1e-6 relative. The tests run on the default device, so the same
//! binary exercises the CUDA backend on the GPU machine.

mod common;

use common::*;
use glm_stream::mlx::{
    self, Array, Device, Dtype, MlxError, fast, fast::AttentionMask, fast::RopeFreqs,
};

fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).expect("array")
}

fn f32s(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().expect("to_vec")
}

/// Row-major f64 matmul reference with per-element error bounds.
fn matmul_ref(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    matmul_ref_rel(a, b, m, k, n, 4e-5)
}

/// Bound for float32 GEMM on the default device. MLX's CUDA backend runs f32
/// `matmul` through cuBLAS in TF32 (inputs rounded to 10-bit mantissas,
/// relative error 2⁻¹¹ per product), so on the GPU the bound is 1e-3·Σ|terms|
/// (measured 1.4e-3 absolute on a 0.70 result with Σ|terms| ≈ 25). Quantized
/// matmul uses MLX's own kernels and keeps the f32 bound everywhere.
fn gemm_rel() -> f64 {
    if mlx::default_device() == Device::Gpu {
        1e-3
    } else {
        4e-5
    }
}

fn matmul_ref_rel(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    rel: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut tol = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = a[i * k + p] as f64 * b[p * n + j] as f64;
                s += t;
                abs += t.abs();
            }
            out[i * n + j] = s;
            tol[i * n + j] = rel * abs + 1e-30;
        }
    }
    (out, tol)
}

#[test]
fn elementwise_arithmetic_with_broadcasting() {
    let mut r = rng(1);
    let a = uniform(&mut r, 12);
    let b = uniform(&mut r, 4);
    let (x, y) = (arr(&a, &[3, 4]), arr(&b, &[4]));
    type Case = (&'static str, Array, fn(f64, f64) -> f64);
    let cases: [Case; 6] = [
        ("add", x.add(&y).unwrap(), |p, q| p + q),
        ("subtract", x.subtract(&y).unwrap(), |p, q| p - q),
        ("multiply", x.multiply(&y).unwrap(), |p, q| p * q),
        ("divide", x.divide(&y).unwrap(), |p, q| p / q),
        ("maximum", x.maximum(&y).unwrap(), f64::max),
        ("minimum", x.minimum(&y).unwrap(), f64::min),
    ];
    for (name, got, f) in cases {
        let want: Vec<f64> = (0..12).map(|i| f(a[i] as f64, b[i % 4] as f64)).collect();
        // One f32 rounding of an exact result: 1 ulp relative.
        let tol: Vec<f64> = want.iter().map(|w| w.abs() * 1.2e-7 + 1e-30).collect();
        assert_within(&f32s(&got), &want, &tol, name);
    }
    let s = x.multiply_scalar(2.5).unwrap().add_scalar(-1.0).unwrap();
    let want: Vec<f64> = a.iter().map(|&v| v as f64 * 2.5 - 1.0).collect();
    assert_close(&f32s(&s), &want, 1e-6, "scalar ops");
}

#[test]
fn unary_activations_and_softmax() {
    let mut r = rng(2);
    let a: Vec<f32> = uniform(&mut r, 40).iter().map(|v| v * 6.0).collect();
    let x = arr(&a, &[5, 8]);
    let sig: Vec<f64> = a
        .iter()
        .map(|&v| 1.0 / (1.0 + (-(v as f64)).exp()))
        .collect();
    assert_close(&f32s(&x.sigmoid().unwrap()), &sig, 1e-6, "sigmoid");
    let silu: Vec<f64> = a.iter().zip(&sig).map(|(&v, s)| v as f64 * s).collect();
    assert_close(&f32s(&x.silu().unwrap()), &silu, 1e-6, "silu");
    let exp: Vec<f64> = a.iter().map(|&v| (v as f64).exp()).collect();
    assert_close(&f32s(&x.exp().unwrap()), &exp, 1e-6, "exp");
    let mut sm = vec![0.0; 40];
    for row in 0..5 {
        let m = a[row * 8..row * 8 + 8]
            .iter()
            .fold(f64::MIN, |m, &v| m.max(v as f64));
        let z: f64 = a[row * 8..row * 8 + 8]
            .iter()
            .map(|&v| (v as f64 - m).exp())
            .sum();
        for c in 0..8 {
            sm[row * 8 + c] = (a[row * 8 + c] as f64 - m).exp() / z;
        }
    }
    assert_close(&f32s(&x.softmax(&[-1]).unwrap()), &sm, 1e-6, "softmax");
}

#[test]
fn reductions_where_and_astype() {
    let mut r = rng(3);
    let a = uniform(&mut r, 24);
    let x = arr(&a, &[2, 3, 4]);
    let sum = f32s(&x.sum(&[2], false).unwrap());
    let max = f32s(&x.max(&[1], true).unwrap());
    assert_eq!(x.max(&[1], true).unwrap().shape(), vec![2, 1, 4]);
    for i in 0..2 {
        for j in 0..3 {
            let want: f64 = (0..4).map(|k| a[i * 12 + j * 4 + k] as f64).sum();
            assert!((sum[i * 3 + j] as f64 - want).abs() < 1e-6, "sum");
        }
        for k in 0..4 {
            let want = (0..3)
                .map(|j| a[i * 12 + j * 4 + k])
                .fold(f32::MIN, f32::max);
            assert_eq!(max[i * 4 + k], want, "max is exact");
        }
    }
    let total = x.sum(&[], false).unwrap().item::<f32>().unwrap();
    assert!((total as f64 - a.iter().map(|&v| v as f64).sum::<f64>()).abs() < 1e-5);
    let zero = Array::scalar(0.0, Dtype::Float32).unwrap();
    let w = mlx::r#where(&x.greater(&zero).unwrap(), &x, &zero).unwrap();
    let want: Vec<f64> = a
        .iter()
        .map(|&v| if v > 0.0 { v as f64 } else { 0.0 })
        .collect();
    assert_close(&f32s(&w), &want, 0.0, "where");
    let as_int = arr(&[1.7, -2.2, 3.0], &[3]).astype(Dtype::Int32).unwrap();
    assert_eq!(as_int.to_vec::<i32>().unwrap(), vec![1, -2, 3]);
    let bf = arr(&[1.0, 0.5, -3.25], &[3])
        .astype(Dtype::Bfloat16)
        .unwrap();
    assert_eq!(
        bf.to_vec::<half::bf16>().unwrap(),
        vec![
            half::bf16::from_f32(1.0),
            half::bf16::from_f32(0.5),
            half::bf16::from_f32(-3.25)
        ]
    );
}

#[test]
fn matmul_matches_reference() {
    let mut r = rng(4);
    let (m, k, n) = (5, 96, 7);
    let a = uniform(&mut r, m * k);
    let b = uniform(&mut r, k * n);
    let got = arr(&a, &[m as i32, k as i32])
        .matmul(&arr(&b, &[k as i32, n as i32]))
        .unwrap();
    let (want, tol) = matmul_ref_rel(&a, &b, m, k, n, gemm_rel());
    assert_within(&f32s(&got), &want, &tol, "matmul");
}

#[test]
fn shape_ops() {
    let a: Vec<f32> = (0..24).map(|v| v as f32).collect();
    let x = arr(&a, &[2, 3, 4]);
    let t = x.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.shape(), vec![4, 2, 3]);
    let tv = f32s(&t);
    for i in 0..2 {
        for j in 0..3 {
            for k in 0..4 {
                assert_eq!(tv[k * 6 + i * 3 + j], a[i * 12 + j * 4 + k]);
            }
        }
    }
    let s = x.slice(&[0, 1, 1], &[2, 3, 4], &[1, 1, 2]).unwrap();
    assert_eq!(s.shape(), vec![2, 2, 2]);
    assert_eq!(f32s(&s), vec![5.0, 7.0, 9.0, 11.0, 17.0, 19.0, 21.0, 23.0]);
    assert_eq!(
        f32s(&x.reshape(&[6, -1]).unwrap().slice_axis(0, 5, 6).unwrap()),
        vec![20.0, 21.0, 22.0, 23.0]
    );
    let parts = x.split(&[1, 3], 2).unwrap();
    assert_eq!(parts.len(), 3);
    assert_eq!(parts[1].shape(), vec![2, 3, 2]);
    let back = mlx::concatenate(&[&parts[0], &parts[1], &parts[2]], 2).unwrap();
    assert_eq!(f32s(&back), a);
    let st = mlx::stack(&[&parts[0], &parts[0]], 0).unwrap();
    assert_eq!(st.shape(), vec![2, 2, 3, 1]);
    assert_eq!(x.expand_dims(1).unwrap().shape(), vec![2, 1, 3, 4]);
    assert_eq!(parts[0].squeeze(2).unwrap().shape(), vec![2, 3]);
    assert_eq!(
        arr(&[1.0, 2.0], &[2])
            .repeat(2, 0)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0, 1.0, 2.0, 2.0]
    );
    let upd = x
        .slice_update(&arr(&[-1.0; 4], &[1, 1, 4]), &[1, 2, 0], &[2, 3, 4])
        .unwrap();
    assert_eq!(&f32s(&upd)[20..24], &[-1.0; 4]);
    assert_eq!(
        mlx::arange(0.0, 5.0, 2.0, Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        vec![0, 2, 4]
    );
    assert_eq!(
        mlx::full(&[2], 3.5, Dtype::Float32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![3.5, 3.5]
    );
}

#[test]
fn gathers_partition_and_topk() {
    let mut r = rng(5);
    let a = uniform(&mut r, 50);
    let x = arr(&a, &[5, 10]);
    let idx = mlx::checked_indices(&[4, 0, 4, 2], 5, "row").unwrap();
    let rows = f32s(&x.take(&idx, 0).unwrap());
    for (p, &row) in [4usize, 0, 4, 2].iter().enumerate() {
        assert_eq!(&rows[p * 10..p * 10 + 10], &a[row * 10..row * 10 + 10]);
    }
    let along: Vec<i32> = (0..5).map(|i: i32| i * 3 % 10).collect();
    let along_arr = Array::from_slice(&along, &[5, 1]).unwrap();
    let picked = f32s(&x.take_along_axis(&along_arr, 1).unwrap());
    for i in 0..5 {
        assert_eq!(picked[i], a[i * 10 + along[i] as usize]);
    }
    let kth = 3;
    let part = x.argpartition(kth, 1).unwrap().to_vec::<u32>().unwrap();
    let tk = f32s(&x.topk(4, 1).unwrap());
    for i in 0..5 {
        let row = &a[i * 10..i * 10 + 10];
        let mut sorted = row.to_vec();
        sorted.sort_by(f32::total_cmp);
        let pivot = row[part[i * 10 + kth as usize] as usize];
        assert_eq!(pivot, sorted[kth as usize], "argpartition pivot");
        for p in 0..10 {
            let v = row[part[i * 10 + p] as usize];
            if p < kth as usize {
                assert!(v <= pivot);
            } else {
                assert!(v >= pivot);
            }
        }
        let mut top = tk[i * 4..i * 4 + 4].to_vec();
        top.sort_by(f32::total_cmp);
        assert_eq!(top, sorted[6..].to_vec(), "topk");
    }
    assert!(
        mlx::checked_indices(&[5], 5, "row").is_err(),
        "out-of-range id is refused before MLX"
    );
}

fn rms_norm_ref(x: &[f32], w: &[f32], d: usize, eps: f64) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(&v, &g)| v as f64 * inv * g as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn norms_match_reference() {
    let mut r = rng(6);
    let d = 48;
    let x = uniform(&mut r, 3 * d);
    let w = uniform(&mut r, d);
    let b = uniform(&mut r, d);
    let got = fast::rms_norm(&arr(&x, &[3, d as i32]), Some(&arr(&w, &[d as i32])), 1e-5).unwrap();
    assert_close(
        &f32s(&got),
        &rms_norm_ref(&x, &w, d, 1e-5),
        2e-6,
        "rms_norm",
    );
    let ln = fast::layer_norm(
        &arr(&x, &[3, d as i32]),
        Some(&arr(&w, &[d as i32])),
        Some(&arr(&b, &[d as i32])),
        1e-5,
    )
    .unwrap();
    let (w, b) = (&w, &b);
    let want: Vec<f64> = x
        .chunks(d)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            row.iter()
                .enumerate()
                .map(move |(i, &v)| (v as f64 - mean) * inv * w[i] as f64 + b[i] as f64)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_close(&f32s(&ln), &want, 2e-6, "layer_norm");
}

/// RoPE reference: rotate pairs (2i, 2i+1) when traditional, else (i, i+dims/2).
fn rope_ref(
    x: &[f32],
    seq: usize,
    d: usize,
    dims: usize,
    traditional: bool,
    base: f64,
    offset: usize,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..seq {
        let pos = (offset + t) as f64;
        for i in 0..dims / 2 {
            let theta = pos * base.powf(-2.0 * i as f64 / dims as f64);
            let (a, b) = if traditional {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + dims / 2)
            };
            let (x1, x2) = (x[t * d + a] as f64, x[t * d + b] as f64);
            out[t * d + a] = x1 * theta.cos() - x2 * theta.sin();
            out[t * d + b] = x1 * theta.sin() + x2 * theta.cos();
        }
    }
    out
}

#[test]
fn rope_traditional_and_not() {
    let mut r = rng(7);
    let (seq, d, dims) = (6, 24, 16);
    let x = uniform(&mut r, seq * d);
    let xa = arr(&x, &[1, 1, seq as i32, d as i32]);
    for traditional in [true, false] {
        let got = fast::rope(
            &xa,
            dims as i32,
            traditional,
            RopeFreqs::Base(10000.0),
            1.0,
            3,
        )
        .unwrap();
        let want = rope_ref(&x, seq, d, dims, traditional, 10000.0, 3);
        // Angles up to 8 rad are formed in f32: |Δθ| ≲ 8·ε, so 2e-6 absolute.
        assert_close(
            &f32s(&got),
            &want,
            2e-6,
            if traditional {
                "rope traditional"
            } else {
                "rope"
            },
        );
    }
    // Explicit freqs are wavelengths: MLX rotates by position / freqs[i].
    let wavelengths: Vec<f32> = (0..dims / 2)
        .map(|i| 10000f32.powf(2.0 * i as f32 / dims as f32))
        .collect();
    let freqs = arr(&wavelengths, &[(dims / 2) as i32]);
    let with_freqs =
        fast::rope(&xa, dims as i32, true, RopeFreqs::Explicit(&freqs), 1.0, 3).unwrap();
    assert_close(
        &f32s(&with_freqs),
        &rope_ref(&x, seq, d, dims, true, 10000.0, 3),
        2e-6,
        "rope freqs",
    );
}

#[test]
fn attention_with_masks() {
    let mut r = rng(8);
    let (hq, hkv, l, s, dh) = (4usize, 2usize, 3usize, 5usize, 16usize);
    let q = uniform(&mut r, hq * l * dh);
    let k = uniform(&mut r, hkv * s * dh);
    let v = uniform(&mut r, hkv * s * dh);
    let mask_vals: Vec<bool> = (0..l * s).map(|i| (i * 7) % 3 != 0 || i % s == 0).collect();
    let scale = 1.0 / (dh as f32).sqrt();
    let qa = arr(&q, &[1, hq as i32, l as i32, dh as i32]);
    let ka = arr(&k, &[1, hkv as i32, s as i32, dh as i32]);
    let va = arr(&v, &[1, hkv as i32, s as i32, dh as i32]);
    let reference = |keep: &dyn Fn(usize, usize) -> bool| -> Vec<f64> {
        let mut out = vec![0.0; hq * l * dh];
        for h in 0..hq {
            let g = h / (hq / hkv);
            for i in 0..l {
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        if !keep(i, j) {
                            return f64::NEG_INFINITY;
                        }
                        (0..dh)
                            .map(|c| {
                                q[(h * l + i) * dh + c] as f64 * k[(g * s + j) * dh + c] as f64
                            })
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                for c in 0..dh {
                    out[(h * l + i) * dh + c] = (0..s)
                        .map(|j| (scores[j] - m).exp() / z * v[(g * s + j) * dh + c] as f64)
                        .sum();
                }
            }
        }
        out
    };
    let none =
        fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::None).unwrap();
    assert_close(&f32s(&none), &reference(&|_, _| true), 1e-5, "sdpa no mask");
    let causal =
        fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::Causal).unwrap();
    assert_close(
        &f32s(&causal),
        &reference(&|i, j| j <= i + (s - l)),
        1e-5,
        "sdpa causal",
    );
    let m_u8: Vec<u8> = mask_vals.iter().map(|&b| b as u8).collect();
    let m = Array::from_slice(&m_u8, &[l as i32, s as i32])
        .unwrap()
        .astype(Dtype::Bool)
        .unwrap();
    let masked =
        fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::Array(&m)).unwrap();
    assert_close(
        &f32s(&masked),
        &reference(&|i, j| mask_vals[i * s + j]),
        1e-5,
        "sdpa bool mask",
    );
}

/// Packs signed int4 values (−8..=7) two per byte, low nibble = even column,
/// as offset-binary nibbles (q + 8): Colibri's int4 layout.
fn pack_q4(q: &[i8]) -> Vec<u8> {
    q.chunks(2)
        .map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4))
        .collect()
}

/// Random Q4 matrix [rows, cols] with group scales: returns (packed bytes,
/// scales [rows, cols/gs], dequantized f64 reference).
fn random_q4(
    r: &mut rand_chacha::ChaCha8Rng,
    rows: usize,
    cols: usize,
    gs: usize,
) -> (Vec<u8>, Vec<f32>, Vec<f64>) {
    use rand::Rng;
    let q: Vec<i8> = (0..rows * cols).map(|_| r.random_range(-8i8..=7)).collect();
    let scales: Vec<f32> = (0..rows * cols / gs)
        .map(|_| r.random_range(0.01f32..0.2))
        .collect();
    let deq = (0..rows * cols)
        .map(|i| q[i] as f64 * scales[(i / cols) * (cols / gs) + (i % cols) / gs] as f64)
        .collect();
    (pack_q4(&q), scales, deq)
}

fn q4_arrays(
    bytes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    gs: usize,
) -> (Array, Array, Array) {
    let w = Array::from_bytes(bytes, &[rows as i32, (cols / 8) as i32], Dtype::Uint32).unwrap();
    let s = arr(scales, &[rows as i32, (cols / gs) as i32]);
    let b = s.multiply_scalar(-8.0).unwrap();
    (w, s, b)
}

#[test]
fn quantized_matmul_q4_groups_32_64_128() {
    let mut r = rng(9);
    let (m, n, k) = (3usize, 12usize, 256usize);
    for gs in [32usize, 64, 128] {
        let (bytes, scales, deq) = random_q4(&mut r, n, k, gs);
        let x = uniform(&mut r, m * k);
        let (w, s, b) = q4_arrays(&bytes, &scales, n, k, gs);
        let got = mlx::quantized_matmul(
            &arr(&x, &[m as i32, k as i32]),
            &w,
            &s,
            Some(&b),
            true,
            gs as i32,
            4,
        )
        .unwrap();
        let deq_t: Vec<f32> = (0..k * n)
            .map(|i| deq[(i % n) * k + i / n] as f32)
            .collect();
        let (want, tol) = matmul_ref(&x, &deq_t, m, k, n);
        assert_within(
            &f32s(&got),
            &want,
            &tol,
            &format!("quantized_matmul gs{gs}"),
        );
        let d = mlx::dequantize(&w, &s, Some(&b), gs as i32, 4, Some(Dtype::Float32)).unwrap();
        // (q − 8 + 8)·s − 8s computed as s·n + (−8s): two f32 roundings of values ≤ 1.6.
        assert_close(&f32s(&d), &deq, 2.5e-7, &format!("dequantize gs{gs}"));
    }
}

#[test]
fn int8_rows_as_8bit_affine_with_sign_flip() {
    use rand::Rng;
    let mut r = rng(10);
    let (m, n, k) = (2usize, 5usize, 64usize);
    let q: Vec<i8> = (0..n * k)
        .map(|i| if i == 0 { -128 } else { r.random() })
        .collect();
    let row_scale: Vec<f32> = (0..n).map(|_| r.random_range(0.001f32..0.01)).collect();
    let u: Vec<u8> = q.iter().map(|&v| (v as u8) ^ 0x80).collect();
    let scales: Vec<f32> = (0..n)
        .flat_map(|o| std::iter::repeat_n(row_scale[o], k / 64))
        .collect();
    let w = Array::from_bytes(&u, &[n as i32, (k / 4) as i32], Dtype::Uint32).unwrap();
    let s = arr(&scales, &[n as i32, (k / 64) as i32]);
    let b = s.multiply_scalar(-128.0).unwrap();
    let x = uniform(&mut r, m * k);
    let got = mlx::quantized_matmul(
        &arr(&x, &[m as i32, k as i32]),
        &w,
        &s,
        Some(&b),
        true,
        64,
        8,
    )
    .unwrap();
    let wt: Vec<f32> = (0..k * n)
        .map(|i| q[(i % n) * k + i / n] as f32 * row_scale[i % n])
        .collect();
    let (want, tol) = matmul_ref(&x, &wt, m, k, n);
    assert_within(&f32s(&got), &want, &tol, "int8 rows via 8-bit affine");
}

#[test]
fn gather_qmm_selects_experts() {
    let mut r = rng(11);
    let (experts, n, k, gs, tokens) = (4usize, 8usize, 128usize, 64usize, 5usize);
    let mut all_bytes = Vec::new();
    let mut all_scales = Vec::new();
    let mut deqs = Vec::new();
    for _ in 0..experts {
        let (b, s, d) = random_q4(&mut r, n, k, gs);
        all_bytes.extend(b);
        all_scales.extend(s);
        deqs.push(d);
    }
    let w = Array::from_bytes(
        &all_bytes,
        &[experts as i32, n as i32, (k / 8) as i32],
        Dtype::Uint32,
    )
    .unwrap();
    let s = arr(&all_scales, &[experts as i32, n as i32, (k / gs) as i32]);
    let b = s.multiply_scalar(-8.0).unwrap();
    let x = uniform(&mut r, tokens * k);
    let ids = [3u32, 0, 3, 1, 2];
    let rhs = mlx::checked_indices(&ids, experts, "expert").unwrap();
    let xa = arr(&x, &[tokens as i32, 1, k as i32]);
    let got = mlx::gather_qmm(
        &xa,
        &w,
        &s,
        Some(&b),
        None,
        Some(&rhs),
        true,
        gs as i32,
        4,
        false,
    )
    .unwrap();
    assert_eq!(got.shape(), vec![tokens as i32, 1, n as i32]);
    let got = f32s(&got);
    for (t, &e) in ids.iter().enumerate() {
        let deq_t: Vec<f32> = (0..k * n)
            .map(|i| deqs[e as usize][(i % n) * k + i / n] as f32)
            .collect();
        let (want, tol) = matmul_ref(&x[t * k..(t + 1) * k], &deq_t, 1, k, n);
        assert_within(
            &got[t * n..(t + 1) * n],
            &want,
            &tol,
            &format!("gather_qmm token {t}"),
        );
    }
    // Float gather_mm on the dequantized experts agrees too.
    let wf = mlx::dequantize(&w, &s, Some(&b), gs as i32, 4, Some(Dtype::Float32))
        .unwrap()
        .transpose(&[0, 2, 1])
        .unwrap();
    let gm = f32s(&mlx::gather_mm(&xa, &wf, None, Some(&rhs), false).unwrap());
    let diff = gm
        .iter()
        .zip(&got)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < 1e-4, "gather_mm vs gather_qmm {diff}");
}

#[test]
fn load_safetensors_is_lazy_and_exact() {
    use safetensors::tensor::{Dtype as StDtype, TensorView};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let vals: Vec<f32> = vec![1.5, -2.0, 3.25, 0.0, 7.0, -1.0];
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(StDtype::F32, vec![2, 3], &bytes).unwrap();
    safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
    let file = mlx::load_safetensors(&path).unwrap();
    let w = &file.tensors["w"];
    assert_eq!(w.shape(), vec![2, 3]);
    assert_eq!(w.to_vec::<f32>().unwrap(), vals);
    assert!(mlx::load_safetensors(&dir.path().join("missing.safetensors")).is_err());
}

#[test]
fn devices_streams_and_memory() {
    assert!(Device::Cpu.is_available());
    let dev = mlx::default_device();
    assert!(dev.is_available());
    mlx::new_stream(dev).unwrap();
    mlx::memory::reset_peak();
    let big = mlx::zeros(&[1 << 20], Dtype::Float32)
        .unwrap()
        .add_scalar(1.0)
        .unwrap();
    mlx::async_eval(&[&big]).unwrap();
    mlx::synchronize().unwrap();
    assert!(
        mlx::memory::peak() >= 4 << 20,
        "peak {} counts the 4 MiB array",
        mlx::memory::peak()
    );
    assert!(mlx::memory::active() >= 4 << 20);
    drop(big);
    mlx::memory::clear_cache();
    assert!(mlx::version().starts_with("0.32"));
}

#[test]
fn errors_are_results_not_aborts() {
    let a = arr(&[1.0; 6], &[2, 3]);
    let b = arr(&[1.0; 8], &[2, 4]);
    let msg = |e: MlxError| e.to_string();
    let e = msg(a.matmul(&b).unwrap_err());
    assert!(e.contains("matmul"), "{e}");
    assert!(a.reshape(&[4, 2]).is_err());
    assert!(a.transpose(&[0, 2]).is_err());
    assert!(a.sum(&[5], false).is_err());
    assert!(a.add(&b).is_err(), "broadcast mismatch");
    assert!(mlx::concatenate(&[&a, &b], 0).is_err());
    assert!(
        a.take_along_axis(&Array::from_slice(&[0i32; 3], &[3]).unwrap(), 9)
            .is_err()
    );
    assert!(a.softmax(&[3]).is_err());
    assert!(Array::from_slice(&[1.0f32; 5], &[2, 3]).is_err());
    assert!(matches!(
        a.to_vec::<i32>(),
        Err(MlxError::DtypeMismatch { .. })
    ));
    assert!(a.item::<f32>().is_err());
    // uint8 weights are refused by quantized_matmul: they must be viewed as uint32.
    let w8 = Array::from_slice(&[0u8; 64], &[2, 32]).unwrap();
    let s = arr(&[1.0; 2], &[2, 1]);
    let x = arr(&[1.0; 64], &[1, 64]);
    let e = msg(mlx::quantized_matmul(&x, &w8, &s, Some(&s), true, 64, 4).unwrap_err());
    assert!(e.contains("quantized_matmul"), "{e}");
    assert!(matches!(
        mlx::quantized_matmul(&x, &w8, &s, Some(&s), true, 16, 4),
        Err(MlxError::InvalidArgument { .. })
    ));
    assert!(
        fast::rms_norm(&a, Some(&arr(&[1.0; 4], &[4])), 1e-5)
            .and_then(|r| r.eval())
            .is_err()
    );
    assert!(mlx::zeros(&[-1], Dtype::Float32).is_err());
}

#[test]
fn custom_kernel_backends_report_clearly() {
    use mlx::{Kernel, KernelBackend, KernelSpec, LaunchConfig, OutputSpec};
    let spec = |source| KernelSpec {
        name: "double_it",
        input_names: &["inp"],
        output_names: &["out"],
        source,
        header: "",
        ensure_row_contiguous: true,
        shared_memory: 0,
    };
    let metal = Kernel::new(
        KernelBackend::Metal,
        &spec("uint i = thread_position_in_grid.x; out[i] = inp[i] * 2.0f;"),
    );
    if !cfg!(feature = "metal") {
        assert!(matches!(metal, Err(MlxError::BackendUnavailable { .. })));
    }
    let cuda_src = "auto i = cooperative_groups::this_grid().thread_rank(); if (i < inp_shape[0]) out[i] = inp[i] * 2.0f;";
    let kernel = Kernel::new(KernelBackend::Cuda, &spec(cuda_src));
    let cuda_built = KernelBackend::Cuda.compiled_in();
    let cuda_runs = cuda_built && mlx::default_device() == Device::Gpu;
    match kernel {
        Err(e) => {
            assert!(!cuda_built, "a cuda build must declare the kernel: {e}");
            assert!(matches!(e, MlxError::BackendUnavailable { .. }));
        }
        Ok(k) => {
            let x = arr(&[1.0, 2.0, 3.0, 4.0], &[4]);
            let launch = LaunchConfig {
                grid: [4, 1, 1],
                threadgroup: [4, 1, 1],
                ..Default::default()
            };
            let out = k
                .call(
                    &[&x],
                    &[OutputSpec {
                        shape: vec![4],
                        dtype: Dtype::Float32,
                    }],
                    &launch,
                )
                .and_then(|o| o[0].to_vec::<f32>());
            if cuda_runs {
                assert_eq!(out.unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
            } else {
                assert!(out.is_err(), "a CPU libmlx cannot run a CUDA kernel");
            }
        }
    }
}
