//! Resident Q4 linear (MLX `quantized_matmul`) vs the f32 dequantize-then-matmul
//! reference path, on a GLM-5.2-sized `[2048 × 6144]` int4 g64 projection read
//! through [`ResidentWeights`] from a temporary container, for 1 and 8 tokens.
//!
//! Physical-limit references in the same run: an MLX full reduction over an
//! array of the Q4 weight's size and one of the f32 weight's size (pure reads,
//! so `bytes / time` is the read bandwidth MLX reaches on this device), and a
//! host `memcpy` of the Q4 bytes.
//!
//! ```text
//! cargo bench --bench resident_linear                     # build + run
//! cargo bench --bench resident_linear --no-run            # build only; prints the binary
//! target/release/deps/resident_linear-<hash> --bench      # run the built binary
//! ```
//!
//! The binary uses MLX's default device (the GPU with the CUDA libmlx, e.g. with
//! `LD_LIBRARY_PATH` pointing at it). Before criterion starts it prints the
//! device and a quick median-of-31 summary with the Q4 / f32 ratio.

#[path = "../tests/common/fixture.rs"]
mod fixture;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fixture::{Dims, ShardBuilder, write_config};
use glm_stream::mlx::{self, Array};
use glm_stream::quant::QuantFormat;
use glm_stream::resident::{LinearKernel, LinearPath, ResidentOptions, ResidentWeights};
use rand::{Rng, SeedableRng};

const O: usize = 2048;
const I: usize = 6144;
const GS: u32 = 64;
const NAME: &str = "model.layers.0.mlp.gate_proj.weight";

struct Setup {
    _dir: tempfile::TempDir,
    weights: ResidentWeights,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("temp dir");
    write_config(
        dir.path(),
        &Dims {
            hidden: I,
            inter: O,
            ..Dims::default()
        },
    );
    let mut b = ShardBuilder::new(52);
    b.quant(NAME, QuantFormat::int4_grouped(O, I, GS), 0.01);
    b.write(&dir.path().join("out-00000.safetensors"));
    let weights =
        ResidentWeights::open(dir.path(), &ResidentOptions::default()).expect("open container");
    assert_eq!(
        weights.linear_kernel(NAME).expect("kernel"),
        LinearKernel::Q4 {
            group_size: GS,
            scale_repeat: 1
        }
    );
    Setup { _dir: dir, weights }
}

fn input(tokens: usize) -> Array {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(tokens as u64);
    let x: Vec<f32> = (0..tokens * I)
        .map(|_| rng.random_range(-1f32..1.0))
        .collect();
    let a = Array::from_slice(&x, &[tokens as i32, I as i32]).expect("x");
    a.eval().expect("eval x");
    a
}

fn run(w: &ResidentWeights, x: &Array, path: LinearPath) {
    let y = w.linear_with(x, NAME, O, I, path).expect("linear");
    y.eval().expect("eval");
}

fn median(mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..31)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

/// Bytes the Q4 kernel must read: packed weights plus f32 scales and biases.
fn q4_bytes() -> u64 {
    (O * I / 2 + 2 * 4 * O * (I / GS as usize)) as u64
}

fn f32_bytes() -> u64 {
    (O * I * 4) as u64
}

fn bench(c: &mut Criterion) {
    let s = setup();
    let w = &s.weights;
    let q4_words = Array::from_slice(&vec![1.0f32; O * I / 8], &[O as i32, (I / 8) as i32])
        .expect("q4-sized array");
    let f32_sized =
        Array::from_slice(&vec![1.0f32; O * I], &[O as i32, I as i32]).expect("f32-sized array");
    mlx::eval(&[&q4_words, &f32_sized]).expect("eval");
    let read_all = |a: &Array| {
        let r = a.sum(&[], false).expect("sum");
        r.eval().expect("eval");
    };

    eprintln!(
        "resident_linear: mlx {} on {:?}; Q4 g{GS} [{O}x{I}] ({} B incl. scales+biases) vs f32 [{O}x{I}] ({} B)",
        mlx::version(),
        mlx::default_device(),
        q4_bytes(),
        f32_bytes()
    );
    // The quick summary only in a real run (`--bench`), not in test mode.
    let summary = std::env::args().any(|a| a == "--bench");
    for tokens in [1usize, 8].into_iter().filter(|_| summary) {
        let x = input(tokens);
        let fast = median(|| run(w, &x, LinearPath::Fast));
        let reference = median(|| run(w, &x, LinearPath::Reference));
        eprintln!(
            "  tokens {tokens}: q4 {:.3} ms ({:.1} GB/s), f32 reference {:.3} ms ({:.1} GB/s), f32/q4 = {:.2}x",
            fast.as_secs_f64() * 1e3,
            q4_bytes() as f64 / fast.as_secs_f64() / 1e9,
            reference.as_secs_f64() * 1e3,
            f32_bytes() as f64 / reference.as_secs_f64() / 1e9,
            reference.as_secs_f64() / fast.as_secs_f64()
        );
    }
    if summary {
        let rq = median(|| read_all(&q4_words));
        let rf = median(|| read_all(&f32_sized));
        eprintln!(
            "  mlx read (sum) of {} B: {:.3} ms ({:.1} GB/s); of {} B: {:.3} ms ({:.1} GB/s)",
            q4_words.nbytes(),
            rq.as_secs_f64() * 1e3,
            q4_words.nbytes() as f64 / rq.as_secs_f64() / 1e9,
            f32_sized.nbytes(),
            rf.as_secs_f64() * 1e3,
            f32_sized.nbytes() as f64 / rf.as_secs_f64() / 1e9
        );
    }

    let mut g = c.benchmark_group("resident_linear_2048x6144");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for tokens in [1usize, 8] {
        let x = input(tokens);
        g.throughput(Throughput::Bytes(q4_bytes()));
        g.bench_with_input(BenchmarkId::new("q4_g64_fast", tokens), &x, |b, x| {
            b.iter(|| run(w, x, LinearPath::Fast))
        });
        g.throughput(Throughput::Bytes(f32_bytes()));
        g.bench_with_input(BenchmarkId::new("f32_reference", tokens), &x, |b, x| {
            b.iter(|| run(w, x, LinearPath::Reference))
        });
    }
    g.throughput(Throughput::Bytes(q4_words.nbytes() as u64));
    g.bench_function("mlx_read_q4_sized", |b| b.iter(|| read_all(&q4_words)));
    g.throughput(Throughput::Bytes(f32_sized.nbytes() as u64));
    g.bench_function("mlx_read_f32_sized", |b| b.iter(|| read_all(&f32_sized)));
    let src = vec![0x5au8; O * I / 2];
    let mut dst = vec![0u8; O * I / 2];
    g.throughput(Throughput::Bytes(src.len() as u64));
    g.bench_function("host_memcpy_q4_bytes", |b| {
        b.iter(|| {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
