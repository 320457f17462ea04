//! Exercises the MLX binding end to end: a Q4 (group 64) matrix in Colibri's
//! byte layout, multiplied through MLX `quantized_matmul`, checked against a
//! float32 dequantize-then-matmul on the same data.
//!
//!     cargo run --release --example q4_matmul -- [ROWS COLS TOKENS]

use glm_stream::mlx::{self, Array, Dtype};
use rand::{Rng, SeedableRng};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let (rows, cols, tokens) = match args[..] {
        [] => (2048, 6144, 4),
        [r, c, t] if c % 64 == 0 && r > 0 && t > 0 => (r, c, t),
        _ => return Err("usage: q4_matmul [ROWS COLS TOKENS] with COLS a multiple of 64".into()),
    };
    let gs = 64;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    // Colibri int4: offset-binary nibbles, low nibble = even column.
    let bytes: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
    let scales: Vec<f32> = (0..rows * cols / gs)
        .map(|_| rng.random_range(0.001f32..0.02))
        .collect();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();

    let w = Array::from_bytes(&bytes, &[rows as i32, (cols / 8) as i32], Dtype::Uint32)?;
    let s = Array::from_slice(&scales, &[rows as i32, (cols / gs) as i32])?;
    let b = s.multiply_scalar(-8.0)?;
    let xa = Array::from_slice(&x, &[tokens as i32, cols as i32])?;

    let start = std::time::Instant::now();
    let y = mlx::quantized_matmul(&xa, &w, &s, Some(&b), true, gs as i32, 4)?;
    y.eval()?;
    let q_time = start.elapsed();
    let dense = mlx::dequantize(&w, &s, Some(&b), gs as i32, 4, Some(Dtype::Float32))?;
    let reference = xa.matmul(&dense.t()?)?;
    let (got, want) = (y.to_vec::<f32>()?, reference.to_vec::<f32>()?);
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_err = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "mlx {} on {:?}: Q4 g{gs} [{rows}x{cols}] x {tokens} tokens in {:.2} ms; max |Δ| vs f32 path {:.3e} (relative {:.3e})",
        mlx::version(),
        mlx::default_device(),
        q_time.as_secs_f64() * 1e3,
        max_err,
        max_err / max_ref.max(f32::MIN_POSITIVE)
    );
    println!("y[0][..4] = {:?}", &got[..4.min(got.len())]);
    Ok(())
}
