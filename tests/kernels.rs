//! The expert kernels (`glm_stream::kernels`): selection and fallback rules,
//! the stock path against an f64 reference (CPU and GPU), and on a CUDA build
//! with a GPU default device the fused kernels against the stock path and
//! the reference with real GLM-5.2 shapes.
//!
//! GPU run (H200): build with `cargo test --release --features cuda --no-run`
//! and run the `kernels` binary with `--nocapture` to see the error table.

mod common;

use common::rng;
use glm_stream::experts::SlotLayout;
use glm_stream::experts::layout::{ExpertExtents, ProjectionFormat, TensorExtent};
use glm_stream::kernels::{
    Environment, ExpertSlot, FusedExperts, FusedGeometry, FusedKernel, KernelError, KernelFamily,
    Path, select,
};
use glm_stream::mlx::{self, Array, Device, Dtype, KernelBackend};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// A stored format: bits and group size (`None`: per row).
#[derive(Debug, Clone, Copy)]
struct Fmt {
    bits: u8,
    group: Option<u32>,
}

const Q4_G64: Fmt = Fmt {
    bits: 4,
    group: Some(64),
};
const Q4_G32: Fmt = Fmt {
    bits: 4,
    group: Some(32),
};
const Q4_G128: Fmt = Fmt {
    bits: 4,
    group: Some(128),
};
const Q4_ROW: Fmt = Fmt {
    bits: 4,
    group: None,
};
const Q8_ROW: Fmt = Fmt {
    bits: 8,
    group: None,
};

fn format(f: Fmt, rows: usize, cols: usize) -> ProjectionFormat {
    ProjectionFormat {
        bits: f.bits,
        group_size: f.group,
        rows,
        cols,
    }
}

/// One synthetic expert: its slot bytes and layout. `base` is the file
/// offset of its first weight (varies the slot offsets between experts).
struct Expert {
    bytes: Vec<u8>,
    layout: SlotLayout,
}

fn expert(rng: &mut ChaCha8Rng, f: Fmt, hidden: usize, inter: usize, base: u64) -> Expert {
    let formats = [
        format(f, inter, hidden),
        format(f, inter, hidden),
        format(f, hidden, inter),
    ];
    let mut off = base;
    let mut extent = |len: usize| {
        let t = TensorExtent {
            file: 0,
            offset: off,
            len: len as u64,
        };
        off += len as u64;
        t
    };
    let weights = formats.map(|p| extent(p.weight_bytes().unwrap()));
    let scales = formats.map(|p| extent(p.scale_bytes().unwrap()));
    let layout = SlotLayout::plan(
        0,
        0,
        &ExpertExtents {
            weights,
            scales,
            formats,
        },
    )
    .unwrap();
    let mut bytes = vec![0u8; layout.slot_bytes];
    for p in &layout.projections {
        let wb = p.format.weight_bytes().unwrap();
        rng.fill(&mut bytes[p.weight_offset..p.weight_offset + wb]);
        // Scales sized so that every stage stays O(1): 1/(8·sqrt(cols)).
        let amp = 1.0 / (8.0 * (p.format.cols as f32).sqrt());
        let amp = if p.format.bits == 8 { amp / 16.0 } else { amp };
        let n = p.format.scale_bytes().unwrap() / 4;
        for i in 0..n {
            let s: f32 = amp * rng.random_range(0.5f32..1.5);
            let at = p.scale_offset + 4 * i;
            bytes[at..at + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
    Expert { bytes, layout }
}

/// The dequantized `[rows, cols]` weight of projection `p` (f64).
fn dequant(e: &Expert, p: usize) -> Vec<f64> {
    let l = &e.layout.projections[p];
    let f = l.format;
    let scale = |r: usize, c: usize| {
        let i = match f.group_size {
            Some(g) => r * f.cols.div_ceil(g as usize) + c / g as usize,
            None => r,
        };
        let at = l.scale_offset + 4 * i;
        f32::from_le_bytes(e.bytes[at..at + 4].try_into().unwrap()) as f64
    };
    let mut w = vec![0.0; f.rows * f.cols];
    for r in 0..f.rows {
        for c in 0..f.cols {
            let q = if f.bits == 4 {
                let b = e.bytes[l.weight_offset + r * f.cols.div_ceil(2) + c / 2];
                (if c % 2 == 0 { b & 0xF } else { b >> 4 }) as f64 - 8.0
            } else {
                e.bytes[l.weight_offset + r * f.cols + c] as i8 as f64
            };
            w[r * f.cols + c] = q * scale(r, c);
        }
    }
    w
}

/// `y = Σ_e w[m,e] · down(silu(gate x) ⊙ up x)` in f64.
fn reference(experts: &[Expert], x: &[f32], w: &[f32], rows: usize, hidden: usize) -> Vec<f64> {
    let n = experts.len();
    let mut y = vec![0.0; rows * hidden];
    for (ei, e) in experts.iter().enumerate() {
        let inter = e.layout.projections[0].format.rows;
        let (g, u, d) = (dequant(e, 0), dequant(e, 1), dequant(e, 2));
        for m in 0..rows {
            let xm = &x[m * hidden..(m + 1) * hidden];
            let h: Vec<f64> = (0..inter)
                .map(|i| {
                    let dot = |wt: &[f64]| -> f64 {
                        wt[i * hidden..(i + 1) * hidden]
                            .iter()
                            .zip(xm)
                            .map(|(a, b)| a * *b as f64)
                            .sum()
                    };
                    let (gv, uv) = (dot(&g), dot(&u));
                    gv / (1.0 + (-gv).exp()) * uv
                })
                .collect();
            let wt = w[m * n + ei] as f64;
            for o in 0..hidden {
                let s: f64 = d[o * inter..(o + 1) * inter]
                    .iter()
                    .zip(&h)
                    .map(|(a, b)| a * b)
                    .sum();
                y[m * hidden + o] += wt * s;
            }
        }
    }
    y
}

/// `max |got − want| / max |want|`.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |a, (g, w)| a.max((*g as f64 - w).abs()));
    err / scale.max(1e-30)
}

struct Problem {
    experts: Vec<Expert>,
    arrays: Vec<Array>,
    x: Vec<f32>,
    w: Vec<f32>,
    rows: usize,
    hidden: usize,
}

impl Problem {
    fn new(seed: u64, f: Fmt, n: usize, rows: usize, hidden: usize, inter: usize) -> Self {
        let mut r = rng(seed);
        // Different 16-byte-aligned bases give every expert its own offsets.
        let experts: Vec<Expert> = (0..n)
            .map(|e| expert(&mut r, f, hidden, inter, 4096 + 80 + 16 * e as u64))
            .collect();
        let arrays = experts
            .iter()
            .map(|e| Array::from_bytes(&e.bytes, &[e.bytes.len() as i32], Dtype::Uint8).unwrap())
            .collect();
        let x = common::uniform(&mut r, rows * hidden);
        let w = (0..rows * n).map(|_| r.random_range(0.0f32..1.0)).collect();
        Self {
            experts,
            arrays,
            x,
            w,
            rows,
            hidden,
        }
    }

    fn slots(&self) -> Vec<ExpertSlot<'_>> {
        self.experts
            .iter()
            .zip(&self.arrays)
            .map(|(e, a)| ExpertSlot::new(a, &e.layout))
            .collect()
    }

    /// Every expert's slot bytes copied into one arena at 4 KiB-aligned
    /// offsets (in reverse order, so slot i is not at offset i · stride).
    fn arena(&self) -> (Array, Vec<usize>) {
        let stride = self
            .experts
            .iter()
            .map(|e| e.bytes.len().div_ceil(4096) * 4096)
            .max()
            .unwrap_or(4096);
        let n = self.experts.len();
        let mut bytes = vec![0u8; stride * n + 4096];
        let mut offsets = Vec::with_capacity(n);
        for (i, e) in self.experts.iter().enumerate() {
            let at = 4096 + (n - 1 - i) * stride;
            bytes[at..at + e.bytes.len()].copy_from_slice(&e.bytes);
            offsets.push(at);
        }
        let a = Array::from_bytes(&bytes, &[bytes.len() as i32], Dtype::Uint8).unwrap();
        (a, offsets)
    }

    fn run(&self, runner: &FusedExperts, dtype: Dtype) -> Result<Vec<f32>, KernelError> {
        self.run_slots(runner, dtype, &self.slots())
    }

    /// `run` with the experts read from one arena (slot + offset inputs).
    fn run_in_arena(&self, runner: &FusedExperts, dtype: Dtype) -> Result<Vec<f32>, KernelError> {
        let (arena, offsets) = self.arena();
        let slots: Vec<ExpertSlot<'_>> = self
            .experts
            .iter()
            .zip(&offsets)
            .map(|(e, &o)| ExpertSlot::in_arena(&arena, o, &e.layout))
            .collect();
        self.run_slots(runner, dtype, &slots)
    }

    fn run_slots(
        &self,
        runner: &FusedExperts,
        dtype: Dtype,
        slots: &[ExpertSlot<'_>],
    ) -> Result<Vec<f32>, KernelError> {
        let x =
            Array::from_slice(&self.x, &[self.rows as i32, self.hidden as i32])?.astype(dtype)?;
        let w = Array::from_slice(&self.w, &[self.rows as i32, self.experts.len() as i32])?;
        let y = runner.forward(&x, slots, &w)?;
        assert_eq!(y.shape(), vec![self.rows as i32, self.hidden as i32]);
        assert_eq!(y.dtype(), dtype);
        Ok(y.astype(Dtype::Float32)?.to_vec::<f32>()?)
    }

    fn reference(&self) -> Vec<f64> {
        reference(&self.experts, &self.x, &self.w, self.rows, self.hidden)
    }
}

fn env(backend: Option<KernelBackend>, gpu: bool) -> Environment {
    Environment {
        fused_backend: backend,
        gpu_default: gpu,
    }
}

fn gpu_fused_available() -> bool {
    let e = Environment::current();
    e.fused_backend.is_some() && e.gpu_default
}

#[test]
fn selection_rules() {
    let p = Problem::new(1, Q4_G64, 2, 1, 128, 64);
    let layouts: Vec<_> = p.experts.iter().map(|e| e.layout.projections).collect();
    let ok = FusedGeometry::plan(&layouts, select::CUDA_SHARED_BYTES);
    assert!(ok.is_ok(), "{ok:?}");
    let cuda = Some(KernelBackend::Cuda);
    use KernelFamily::*;
    // Stock is always stock.
    for e in [env(None, false), env(cuda, true)] {
        assert_eq!(select::select(Stock, &e, 1, &ok).unwrap(), Path::Stock);
    }
    // Auto: fused only with a backend, a GPU default, few rows and a fit.
    let fused = Path::Fused(KernelBackend::Cuda);
    assert_eq!(
        select::select(Auto, &env(cuda, true), 1, &ok).unwrap(),
        fused
    );
    assert_eq!(
        select::select(Auto, &env(cuda, true), select::AUTO_MAX_ROWS, &ok).unwrap(),
        fused
    );
    assert_eq!(
        select::select(Auto, &env(cuda, true), select::AUTO_MAX_ROWS + 1, &ok).unwrap(),
        Path::Stock
    );
    assert_eq!(
        select::select(Auto, &env(cuda, false), 1, &ok).unwrap(),
        Path::Stock
    );
    assert_eq!(
        select::select(Auto, &env(None, true), 1, &ok).unwrap(),
        Path::Stock
    );
    let unfit: Result<FusedGeometry, String> = Err("no".into());
    assert_eq!(
        select::select(Auto, &env(cuda, true), 1, &unfit).unwrap(),
        Path::Stock
    );
    // Fused: fused or a clear error, any row count.
    assert_eq!(
        select::select(Fused, &env(cuda, true), 40, &ok).unwrap(),
        fused
    );
    assert!(matches!(
        select::select(Fused, &env(None, true), 1, &ok),
        Err(KernelError::FusedUnavailable { .. })
    ));
    assert!(matches!(
        select::select(Fused, &env(cuda, false), 1, &ok),
        Err(KernelError::FusedUnavailable { .. })
    ));
    assert!(matches!(
        select::select(Fused, &env(cuda, true), 1, &unfit),
        Err(KernelError::Unsupported { .. })
    ));
    // FusedSimt selects like Fused.
    assert_eq!(
        select::select(FusedSimt, &env(cuda, true), 3, &ok).unwrap(),
        fused
    );
    assert!(matches!(
        select::select(FusedSimt, &env(cuda, true), 1, &unfit),
        Err(KernelError::Unsupported { .. })
    ));
    assert_eq!("auto".parse::<KernelFamily>().unwrap(), Auto);
    assert_eq!("fused-simt".parse::<KernelFamily>().unwrap(), FusedSimt);
    assert!("fast".parse::<KernelFamily>().is_err());
}

#[test]
fn geometry_limits() {
    // GLM-5.2: 8 rows of x fit K1's staging; K2 groups experts to fit h.
    let p = Problem::new(2, Q4_G64, 1, 1, 64, 32);
    let mut l = p.experts[0].layout.projections;
    l[0].format = format(Q4_G64, 2048, 6144);
    l[1].format = l[0].format;
    l[2].format = format(Q4_G64, 6144, 2048);
    let g = FusedGeometry::plan(&[l], select::CUDA_SHARED_BYTES).unwrap();
    assert_eq!(g.rows_per_launch, 8);
    assert_eq!(g.experts_per_down(1), 24);
    assert_eq!(g.experts_per_down(8), 3);
    // Metal's 32 KiB: one row of x, three experts' h per down launch.
    let m = FusedGeometry::plan(&[l], select::METAL_SHARED_BYTES).unwrap();
    assert_eq!(m.rows_per_launch, 1);
    assert_eq!(m.experts_per_down(1), 3);
    // Unsupported: group 48, odd widths, gate ≠ up, misaligned offsets,
    // mixed formats.
    let mut bad = l;
    for p in &mut bad[..2] {
        p.format.group_size = Some(48);
    }
    assert!(FusedGeometry::plan(&[bad], select::CUDA_SHARED_BYTES).is_err());
    let mut bad = l;
    bad[1].format.group_size = None;
    assert!(FusedGeometry::plan(&[bad], select::CUDA_SHARED_BYTES).is_err());
    let mut bad = l;
    bad[2].weight_offset += 4;
    assert!(FusedGeometry::plan(&[bad], select::CUDA_SHARED_BYTES).is_err());
    let mut other = l;
    for p in &mut other {
        p.format.group_size = None;
    }
    assert!(FusedGeometry::plan(&[l, other], select::CUDA_SHARED_BYTES).is_err());
    assert!(FusedGeometry::plan(&[], select::CUDA_SHARED_BYTES).is_err());
}

#[test]
fn tensor_cores_for_int4_on_cuda_unless_pinned_off() {
    let cuda = Some(KernelBackend::Cuda);
    let q4 = Problem::new(3, Q4_G64, 2, 1, 256, 128);
    let q8 = Problem::new(4, Q8_ROW, 2, 1, 256, 128);
    let plan = |p: &Problem| {
        let layouts: Vec<_> = p.experts.iter().map(|e| e.layout.projections).collect();
        FusedGeometry::plan(&layouts, select::CUDA_SHARED_BYTES).unwrap()
    };
    let (g4, g8) = (plan(&q4), plan(&q8));
    assert!(g4.tensor_cores);
    assert!(!g8.tensor_cores);
    let fused = FusedExperts::with_environment(KernelFamily::Fused, env(cuda, true)).unwrap();
    let simt = FusedExperts::with_environment(KernelFamily::FusedSimt, env(cuda, true)).unwrap();
    let auto = FusedExperts::with_environment(KernelFamily::Auto, env(cuda, true)).unwrap();
    assert_eq!(
        fused.fused_kernel(KernelBackend::Cuda, &g4),
        FusedKernel::TensorCore
    );
    assert_eq!(
        auto.fused_kernel(KernelBackend::Cuda, &g4),
        FusedKernel::TensorCore
    );
    assert_eq!(
        simt.fused_kernel(KernelBackend::Cuda, &g4),
        FusedKernel::CudaCore
    );
    assert_eq!(
        fused.fused_kernel(KernelBackend::Cuda, &g8),
        FusedKernel::CudaCore
    );
    assert_eq!(
        fused.fused_kernel(KernelBackend::Metal, &g4),
        FusedKernel::CudaCore
    );
    // The tensor-core staging (whole 128-column chunks: 6272 floats per row
    // here, against 6208 for the CUDA-core kernels) bounds the rows per launch.
    let mut l = q4.experts[0].layout.projections;
    l[0].format = format(Q4_G32, 2048, 6144 + 32);
    l[1].format = l[0].format;
    l[2].format = format(Q4_G32, 6144 + 32, 2048);
    let g = FusedGeometry::plan(&[l], 4 * 6272 * 3 - 4).unwrap();
    assert_eq!(g.rows_per_launch, 2);
}

#[test]
fn explicit_fused_without_a_backend_is_an_error() {
    let e = FusedExperts::with_environment(KernelFamily::Fused, env(None, true));
    assert!(matches!(e, Err(KernelError::FusedUnavailable { .. })));
    if Environment::compiled_backend().is_none() {
        let e = FusedExperts::new(KernelFamily::Fused).unwrap_err();
        assert!(e.to_string().contains("feature"), "{e}");
    }
    // A backend but a CPU device: the call fails clearly (no fallback).
    let runner =
        FusedExperts::with_environment(KernelFamily::Fused, env(Some(KernelBackend::Cuda), false))
            .unwrap();
    let p = Problem::new(3, Q4_G64, 2, 1, 64, 32);
    assert!(matches!(
        p.run(&runner, Dtype::Float32),
        Err(KernelError::FusedUnavailable { .. })
    ));
}

#[test]
fn auto_without_gpu_falls_back_to_stock() {
    let p = Problem::new(4, Q4_G64, 3, 2, 128, 64);
    let runner = FusedExperts::new(KernelFamily::Auto).unwrap();
    if !gpu_fused_available() {
        assert_eq!(runner.path(2, &p.slots()).unwrap(), Path::Stock);
    }
    let got = p.run(&runner, Dtype::Float32).unwrap();
    let err = rel_err(&got, &p.reference());
    assert!(err < 1e-4, "auto vs reference: {err:e}");
}

#[test]
fn stock_matches_reference_on_small_glm_like_shapes() {
    // MLX's CUDA qmv has no kernel for these small shapes ("No implementation
    // for problem shape: 1x128x256"), so on a GPU machine this runs on the
    // CPU device (run the GPU test binary with --test-threads=1).
    let on_gpu = mlx::default_device() == Device::Gpu;
    if on_gpu {
        mlx::set_default_device(Device::Cpu).unwrap();
    }
    let runner = FusedExperts::with_environment(KernelFamily::Stock, env(None, false)).unwrap();
    for (seed, f) in [(10, Q4_G64), (11, Q4_ROW), (12, Q8_ROW)] {
        for rows in [1, 3] {
            let p = Problem::new(seed, f, 4, rows, 256, 128);
            let got = p.run(&runner, Dtype::Float32).unwrap();
            let err = rel_err(&got, &p.reference());
            assert!(err < 1e-4, "{f:?} rows {rows}: {err:e}");
        }
    }
    // A format without an MLX affine kernel (group 16) goes through the
    // dense dequantization.
    let p = Problem::new(
        13,
        Fmt {
            bits: 4,
            group: Some(16),
        },
        2,
        2,
        64,
        32,
    );
    let err = rel_err(&p.run(&runner, Dtype::Float32).unwrap(), &p.reference());
    if on_gpu {
        mlx::set_default_device(Device::Gpu).unwrap();
    }
    assert!(err < 1e-4, "group 16: {err:e}");
}

/// Slots given as (arena, offset) compute exactly what their own views do
/// (same ops on the same bytes), and a misaligned or out-of-range offset is
/// refused before any MLX work.
#[test]
fn slots_inside_an_arena_match_slot_views() {
    let runner = FusedExperts::with_environment(KernelFamily::Stock, env(None, false)).unwrap();
    let p = Problem::new(7, Q4_G64, 3, 2, 256, 128);
    let a = p.run(&runner, Dtype::Float32).unwrap();
    let b = p.run_in_arena(&runner, Dtype::Float32).unwrap();
    assert_eq!(a, b);
    assert!(rel_err(&a, &p.reference()) < 1e-4);
    let (arena, offsets) = p.arena();
    let x = Array::from_slice(&p.x, &[2, 256]).unwrap();
    let w = Array::from_slice(&p.w, &[2, 3]).unwrap();
    for bad in [offsets[0] + 8, arena.dim(0).unwrap() as usize + 4096] {
        let slots: Vec<ExpertSlot<'_>> = p
            .experts
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (e, &o))| {
                ExpertSlot::in_arena(&arena, if i == 0 { bad } else { o }, &e.layout)
            })
            .collect();
        assert!(matches!(
            runner.forward(&x, &slots, &w),
            Err(KernelError::Input(_))
        ));
    }
}

#[test]
fn bad_inputs_are_errors() {
    let runner = FusedExperts::new(KernelFamily::Auto).unwrap();
    let p = Problem::new(5, Q4_G64, 2, 1, 64, 32);
    let x = Array::from_slice(&p.x, &[1, 64]).unwrap();
    let w = Array::from_slice(&[1.0f32], &[1, 1]).unwrap();
    assert!(matches!(
        runner.forward(&x, &p.slots(), &w),
        Err(KernelError::Input(_))
    ));
    let short = Array::from_bytes(&p.experts[0].bytes[..100], &[100], Dtype::Uint8).unwrap();
    let slots = [ExpertSlot::new(&short, &p.experts[0].layout)];
    assert!(matches!(
        runner.forward(&x, &slots, &w),
        Err(KernelError::Input(_))
    ));
    let wide = Array::from_slice(&vec![0.0f32; 128], &[1, 128]).unwrap();
    let slots = p.slots();
    let w2 = Array::from_slice(&[1.0f32, 1.0], &[1, 2]).unwrap();
    assert!(matches!(
        runner.forward(&wide, &slots, &w2),
        Err(KernelError::Input(_))
    ));
    // No experts: zeros.
    let y = runner
        .forward(&x, &[], &Array::from_slice::<f32>(&[], &[1, 0]).unwrap())
        .unwrap();
    assert!(y.to_vec::<f32>().unwrap().iter().all(|v| *v == 0.0));
}

/// GLM-5.2 shapes on the GPU: both fused designs (tensor cores, CUDA
/// cores) vs stock vs the f64 reference.
/// Tolerances (max |Δ| / max |ref|): f32 fused 1e-4 (the tensor-core kernels
/// carry x and h as bf16 hi + lo, 16 significant bits, and accumulate in
/// f32: about 2e-6 expected) and f32 stock 1e-3 (different f32 summation
/// orders over 6144- and 2048-long dots), bf16 input/output 2e-2 (bf16
/// rounding of x, of y and, on the stock path, of every intermediate).
#[test]
fn fused_matches_stock_and_reference_on_the_gpu() {
    if !gpu_fused_available() {
        eprintln!("no fused backend on a GPU default device: GPU comparison skipped");
        return;
    }
    let tensor = FusedExperts::new(KernelFamily::Fused).unwrap();
    let simt = FusedExperts::new(KernelFamily::FusedSimt).unwrap();
    let stock = FusedExperts::new(KernelFamily::Stock).unwrap();
    let (hidden, inter) = (6144, 2048);
    let mut seed = 100;
    let cases: Vec<(Fmt, usize, usize, Dtype)> = vec![
        (Q4_G64, 8, 1, Dtype::Float32),
        (Q4_G64, 8, 2, Dtype::Float32),
        (Q4_G64, 8, 4, Dtype::Float32),
        (Q4_G64, 8, 8, Dtype::Float32),
        (Q4_G64, 8, 11, Dtype::Float32),
        (Q4_G64, 1, 1, Dtype::Float32),
        (Q4_G64, 3, 2, Dtype::Float32),
        (Q4_G64, 8, 1, Dtype::Bfloat16),
        (Q4_G128, 8, 1, Dtype::Float32),
        (Q4_ROW, 8, 1, Dtype::Float32),
        (Q4_ROW, 8, 4, Dtype::Float32),
        (Q8_ROW, 8, 1, Dtype::Float32),
        (Q8_ROW, 1, 3, Dtype::Float32),
    ];
    println!("format  E  M  dtype     tensor/ref  simt/ref    stock/ref   tensor/stock");
    for (f, n, rows, dtype) in cases {
        seed += 1;
        let p = Problem::new(seed, f, n, rows, hidden, inter);
        for runner in [&tensor, &simt] {
            assert!(matches!(
                runner.path(rows, &p.slots()).unwrap(),
                Path::Fused(_)
            ));
        }
        let yt = p.run(&tensor, dtype).unwrap();
        let yf = p.run(&simt, dtype).unwrap();
        // The same experts read from one arena (slot + offset inputs): the
        // same kernels on the same bytes, so the same bits.
        assert_eq!(p.run_in_arena(&tensor, dtype).unwrap(), yt);
        assert_eq!(p.run_in_arena(&simt, dtype).unwrap(), yf);
        let ys = p.run(&stock, dtype).unwrap();
        let r = p.reference();
        let ys64: Vec<f64> = ys.iter().map(|v| *v as f64).collect();
        let (et, ef, es, ets) = (
            rel_err(&yt, &r),
            rel_err(&yf, &r),
            rel_err(&ys, &r),
            rel_err(&yt, &ys64),
        );
        println!(
            "{:>3}b {:>4}  {n}  {rows:>2} {dtype:?}  {et:10.3e}  {ef:10.3e}  {es:10.3e}  {ets:10.3e}",
            f.bits,
            f.group.map_or("row".to_string(), |g| format!("g{g}"))
        );
        let (tf, ts) = if dtype == Dtype::Float32 {
            (1e-4, 1e-3)
        } else {
            (2e-2, 2e-2)
        };
        assert!(
            et < tf,
            "{f:?} E {n} M {rows} {dtype:?}: tensor-core fused vs reference {et:e}"
        );
        assert!(
            ef < tf,
            "{f:?} E {n} M {rows} {dtype:?}: CUDA-core fused vs reference {ef:e}"
        );
        assert!(
            es < ts,
            "{f:?} E {n} M {rows} {dtype:?}: stock vs reference {es:e}"
        );
    }
}

/// Widths that are multiples of 32 but not of 128 (a partial last
/// tensor-core chunk), group sizes 32 and per row, on the GPU, against the
/// f64 reference only (MLX's CUDA `quantized_matmul` lacks kernels for some
/// of these small shapes). Same bounds as above (f32 1e-4, bf16 2e-2).
#[test]
fn fused_handles_partial_chunks_on_the_gpu() {
    if !gpu_fused_available() {
        eprintln!("no fused backend on a GPU default device: GPU comparison skipped");
        return;
    }
    let tensor = FusedExperts::new(KernelFamily::Fused).unwrap();
    let simt = FusedExperts::new(KernelFamily::FusedSimt).unwrap();
    let mut seed = 300;
    for (f, hidden, inter, n, rows) in [
        (Q4_G32, 352, 224, 3, 1),
        (Q4_G32, 96, 160, 2, 5),
        (Q4_ROW, 352, 224, 4, 2),
        (Q4_G64, 192, 320, 8, 1),
    ] {
        seed += 1;
        let p = Problem::new(seed, f, n, rows, hidden, inter);
        let r = p.reference();
        for (name, runner) in [("tensor", &tensor), ("simt", &simt)] {
            let y = p.run(runner, Dtype::Float32).unwrap();
            let e = rel_err(&y, &r);
            println!("{name} {f:?} H {hidden} I {inter} E {n} M {rows}: {e:.3e}");
            assert!(
                e < 1e-4,
                "{name} {f:?} H {hidden} I {inter} E {n} M {rows}: {e:e}"
            );
            // bf16 in and out (x and y rounded to bf16): the 2e-2 bound.
            let y = p.run(runner, Dtype::Bfloat16).unwrap();
            let e = rel_err(&y, &r);
            println!("{name} {f:?} H {hidden} I {inter} E {n} M {rows} bf16: {e:.3e}");
            assert!(
                e < 2e-2,
                "{name} bf16 {f:?} H {hidden} I {inter} E {n} M {rows}: {e:e}"
            );
        }
    }
}

/// One compiled kernel pair per row count, whatever the number of experts
/// per call: a decode whose waves vary in size compiles nothing new after
/// its first wave of each size bucket (slot inputs padded to 8, 16, …).
#[test]
fn fused_kernels_are_shared_across_expert_counts_on_the_gpu() {
    if !gpu_fused_available() {
        eprintln!("no fused backend on a GPU default device: GPU check skipped");
        return;
    }
    let runner = FusedExperts::new(KernelFamily::Fused).unwrap();
    for n in 1..=8 {
        let p = Problem::new(400 + n as u64, Q4_G64, n, 1, 256, 128);
        let y = p.run(&runner, Dtype::Float32).unwrap();
        let e = rel_err(&y, &p.reference());
        assert!(e < 1e-4, "E {n}: {e:e}");
        assert_eq!(runner.compiled_kernels(), 2, "after E = {n}");
    }
    let p = Problem::new(409, Q4_G64, 9, 1, 256, 128);
    p.run(&runner, Dtype::Float32).unwrap();
    assert_eq!(runner.compiled_kernels(), 4, "16 slot inputs from E = 9");
}
