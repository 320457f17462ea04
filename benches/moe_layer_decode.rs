//! One GLM-5.2-shaped MoE layer decoding tokens with its routed experts
//! streamed from disk, against the floor `bytes missed / read bandwidth`.
//!
//! The container is written directly with the container writer
//! (`convert::writer`), not through an HF checkpoint (that route would not
//! fit in memory): a `config.json` with GLM-5.2's MoE dimensions (hidden
//! 6144, moe_intermediate 2048, 256 routed experts, top-8; a small
//! vocabulary) and one safetensors shard holding the routed experts of two
//! MoE layers in int4 g64 (21,233,664 B per expert, 512 experts,
//! 10.87 GB): random packed bytes, random positive scales in `[0.002, 0.02)`,
//! laid out as the colibri converter does (every F32 `.qs` first, then the U8
//! weights, each sorted by name). The router is not stored: routes are drawn
//! in the bench (per layer a Zipf(1) popularity over a random permutation of
//! the experts, 8 distinct per token, random positive weights summing to 1).
//!
//! The directory is `GLM_BENCH_DIR` (default `/tmp/glm-stream-moe-bench`).
//! An existing container with the expected shard size is reused; nothing is
//! deleted.
//!
//! Decode: `GLM_BENCH_TOKENS` tokens (default 12, after 2 warm-up tokens
//! that are not counted), each running layer 0 then layer 1 through
//! [`StreamedExecutor::forward_routes`] on one f32 row, with
//! `GLM_BENCH_SLOTS` slots (default 48 ≈ 1.0 GB, a tenth of the expert bytes)
//! and `GLM_BENCH_IO_THREADS` I/O threads (default 4), O_DIRECT reads.
//! Reported per token: wall time, hit rate, bytes missed, and the floor =
//! bytes missed / the O_DIRECT sequential read bandwidth of the same file
//! measured in the same run (one thread, 21 MB requests, `GLM_BENCH_SEQ_MB`
//! MB, default 2048, measured before and after the decode). Then the same
//! routes are run again with every expert resident, which gives the compute
//! time per token without any read.
//!
//! Run: `cargo bench --bench moe_layer_decode` (or the built binary with
//! `--bench`).

mod common;

use common::{BoxResult, EXPERT_BYTES, env_or, sequential_bandwidth};
use glm_stream::container::ColibriContainer;
use glm_stream::convert::writer::{ShardLayout, ShardWriter, TensorSpec};
use glm_stream::executor::{StreamedExecutor, layouts_from_source};
use glm_stream::experts::{
    DirectUpload, FileExpertSource, PolicyConfig, ResidencyManager, SlabConfig,
};
use glm_stream::mlx::{self, Array};
use glm_stream::moe::Routes;
use glm_stream::tiny::{SourceDtype, TinyModelSpec};
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HIDDEN: usize = 6144;
const INTER: usize = 2048;
const EXPERTS: u32 = 256;
const TOP_K: usize = 8;
const LAYERS: [u32; 2] = [0, 1];
const GROUP: usize = 64;
const SHARD: &str = "out-00000.safetensors";

fn spec() -> TinyModelSpec {
    TinyModelSpec {
        hidden_size: HIDDEN,
        num_hidden_layers: LAYERS.len(),
        first_k_dense_replace: 0,
        n_routed_experts: EXPERTS as usize,
        num_experts_per_tok: TOP_K,
        n_shared_experts: 1,
        moe_intermediate_size: INTER,
        vocab_size: 1024,
        ..TinyModelSpec::default()
    }
}

/// `(name, rows, cols)` of every routed expert weight of both layers.
fn weights() -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for layer in LAYERS {
        for e in 0..EXPERTS {
            for (proj, rows, cols) in [
                ("gate_proj", INTER, HIDDEN),
                ("up_proj", INTER, HIDDEN),
                ("down_proj", HIDDEN, INTER),
            ] {
                out.push((
                    format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight"),
                    rows,
                    cols,
                ));
            }
        }
    }
    out
}

fn shard_layout() -> BoxResult<ShardLayout> {
    let mut specs = Vec::new();
    for (name, rows, cols) in weights() {
        specs.push(TensorSpec::new(
            format!("{name}.qs"),
            Dtype::F32,
            vec![rows * cols / GROUP],
        ));
        specs.push(TensorSpec::new(name, Dtype::U8, vec![rows * cols / 2]));
    }
    Ok(ShardLayout::new(specs)?)
}

/// Writes the container into `dir` unless a complete one is already there.
fn ensure_container(dir: &Path) -> BoxResult<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let layout = shard_layout()?;
    let shard = dir.join(SHARD);
    let config = dir.join("config.json");
    let size = std::fs::metadata(&shard).map(|m| m.len()).ok();
    if size == Some(layout.file_size()) && config.is_file() {
        eprintln!(
            "reusing {} ({:.2} GB)",
            shard.display(),
            layout.file_size() as f64 / 1e9
        );
        return Ok(shard);
    }
    eprintln!(
        "writing {} ({:.2} GB of routed experts) …",
        shard.display(),
        layout.file_size() as f64 / 1e9
    );
    let start = Instant::now();
    let config_json = serde_json::to_string_pretty(&spec().config_json(SourceDtype::Bf16))?;
    std::fs::write(&config, config_json)?;
    let mut rng = ChaCha8Rng::seed_from_u64(52);
    let mut w = ShardWriter::create(&shard, layout.clone())?;
    let mut buf = Vec::new();
    for e in layout.entries() {
        let n = e.end - e.begin;
        buf.resize(n, 0);
        if e.spec.dtype == Dtype::F32 {
            for c in buf.chunks_exact_mut(4) {
                let s: f32 = rng.random_range(0.002..0.02);
                c.copy_from_slice(&s.to_le_bytes());
            }
        } else {
            rng.fill_bytes(&mut buf);
        }
        w.write(&e.spec.name, &buf)?;
    }
    w.finish()?;
    eprintln!("written in {:.1} s", start.elapsed().as_secs_f64());
    Ok(shard)
}

/// Per layer, a Zipf(1) popularity over a random permutation of the experts.
struct Router {
    cdf: Vec<f64>,
    perms: Vec<Vec<u32>>,
    rng: ChaCha8Rng,
}

impl Router {
    fn new(seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let w: Vec<f64> = (1..=EXPERTS).map(|r| 1.0 / f64::from(r)).collect();
        let total: f64 = w.iter().sum();
        let cdf = w
            .iter()
            .scan(0.0, |a, v| {
                *a += v / total;
                Some(*a)
            })
            .collect();
        let perms = LAYERS
            .iter()
            .map(|_| {
                let mut p: Vec<u32> = (0..EXPERTS).collect();
                p.shuffle(&mut rng);
                p
            })
            .collect();
        Self { cdf, perms, rng }
    }

    fn route(&mut self, layer: usize) -> BoxResult<Routes> {
        let mut ids = Vec::with_capacity(TOP_K);
        while ids.len() < TOP_K {
            let u: f64 = self.rng.random();
            let rank = self
                .cdf
                .partition_point(|&c| c < u)
                .min(EXPERTS as usize - 1);
            let e = self.perms[layer][rank];
            if !ids.contains(&e) {
                ids.push(e);
            }
        }
        let w: Vec<f32> = (0..TOP_K)
            .map(|_| self.rng.random_range(0.1..1.0))
            .collect();
        let sum: f32 = w.iter().sum();
        let w = w.iter().map(|v| v / sum).collect();
        Ok(Routes::new(TOP_K, EXPERTS, ids, w)?)
    }
}

#[derive(Default, Clone, Copy)]
struct Sample {
    time: Duration,
    hits: u64,
    misses: u64,
    bytes: u64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> BoxResult<()> {
    let dir = std::env::var_os("GLM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/glm-stream-moe-bench"));
    let tokens: usize = env_or("GLM_BENCH_TOKENS", 12);
    let warmup: usize = env_or("GLM_BENCH_WARMUP", 2);
    let slots: usize = env_or("GLM_BENCH_SLOTS", 48);
    let io_threads: usize = env_or("GLM_BENCH_IO_THREADS", 4);
    let seq_mb: u64 = env_or("GLM_BENCH_SEQ_MB", 2048);
    println!("mlx {} on {:?}", mlx::version(), mlx::default_device());

    let shard = ensure_container(&dir)?;
    let container = ColibriContainer::open(&dir)?;
    let source = FileExpertSource::from_container(&container, &LAYERS, true)?;
    if !source.is_direct() {
        eprintln!("warning: O_DIRECT unavailable on this file system; buffered reads");
    }
    let l0 = source
        .layout(0, 0)
        .ok_or("no layout for layer 0 expert 0")?;
    if l0.data_bytes != EXPERT_BYTES {
        return Err(format!("expert bytes {} ≠ {EXPERT_BYTES}", l0.data_bytes).into());
    }
    println!(
        "experts: {} layers × {EXPERTS} × {EXPERT_BYTES} B = {:.2} GB; pool {slots} slots = {:.2} GB; \
         {io_threads} I/O threads; O_DIRECT {}; weights {}, scales {:?}",
        LAYERS.len(),
        (LAYERS.len() as u64 * u64::from(EXPERTS) * EXPERT_BYTES) as f64 / 1e9,
        (slots * source.max_slot_bytes()) as f64 / 1e9,
        source.is_direct(),
        if l0.contiguous {
            "one span read"
        } else {
            "staged"
        },
        l0.scale_path
    );
    let layouts = layouts_from_source(&source, &LAYERS, EXPERTS)?;
    let manager = ResidencyManager::new(
        &SlabConfig::new(source.max_slot_bytes(), slots),
        PolicyConfig::new(LAYERS.len() as u32, EXPERTS, slots),
        Arc::new(source),
        Arc::new(DirectUpload),
        io_threads,
    )?;
    let mut exec = StreamedExecutor::new(manager, HIDDEN, layouts)?;

    let bw_before = sequential_bandwidth(&shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (before): {:.3} GB/s",
        bw_before / 1e9
    );

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let xs: Vec<f32> = (0..HIDDEN).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x = Array::from_slice(&xs, &[1, HIDDEN as i32])?;
    let mut router = Router::new(2026);
    let mut samples = Vec::new();
    let mut last_routes = Vec::new();
    for t in 0..warmup + tokens {
        let routes: Vec<Routes> = (0..LAYERS.len())
            .map(|l| router.route(l))
            .collect::<BoxResult<_>>()?;
        let before = exec.telemetry().clone();
        let start = Instant::now();
        for (l, r) in LAYERS.iter().zip(&routes) {
            exec.forward_routes(*l, &x, r.clone(), EXPERTS, None)?;
        }
        let time = start.elapsed();
        let after = exec.telemetry();
        let s = Sample {
            time,
            hits: after.hits - before.hits,
            misses: after.misses - before.misses,
            bytes: after.bytes_read - before.bytes_read,
        };
        println!(
            "token {t:>3}{}: {:>8.1} ms, {:>2} hits / {:>2} misses, {:>7.1} MB read",
            if t < warmup { " (warm-up)" } else { "" },
            s.time.as_secs_f64() * 1e3,
            s.hits,
            s.misses,
            s.bytes as f64 / 1e6
        );
        if t >= warmup {
            samples.push(s);
        }
        last_routes = routes;
    }
    let bw_after = sequential_bandwidth(&shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (after): {:.3} GB/s",
        bw_after / 1e9
    );
    let bw = 0.5 * (bw_before + bw_after);

    // The last token's routes again: every expert resident, no read.
    let mut compute = Vec::new();
    for _ in 0..3 {
        let before = exec.telemetry().misses;
        let start = Instant::now();
        for (l, r) in LAYERS.iter().zip(&last_routes) {
            exec.forward_routes(*l, &x, r.clone(), EXPERTS, None)?;
        }
        let d = start.elapsed().as_secs_f64();
        if exec.telemetry().misses == before {
            compute.push(d);
        }
    }

    let n = samples.len().max(1) as f64;
    let total_time: f64 = samples.iter().map(|s| s.time.as_secs_f64()).sum();
    let hits: u64 = samples.iter().map(|s| s.hits).sum();
    let misses: u64 = samples.iter().map(|s| s.misses).sum();
    let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
    let mean_time = total_time / n;
    let bytes_per_token = bytes as f64 / n;
    let floor = bytes_per_token / bw;
    let mut times: Vec<f64> = samples.iter().map(|s| s.time.as_secs_f64()).collect();
    let compute_ms = if compute.is_empty() {
        f64::NAN
    } else {
        median(&mut compute) * 1e3
    };
    println!(
        "summary over {} tokens ({} MoE layers each, top-{TOP_K}, {slots} slots): \
         per-token {:.1} ms mean / {:.1} ms median; hit rate {:.1}%; \
         {:.1} MB missed per token; read bandwidth {:.3} GB/s (sequential O_DIRECT, same run); \
         floor {:.1} ms; time/floor {:.2}; all-resident compute {:.1} ms per token",
        samples.len(),
        LAYERS.len(),
        mean_time * 1e3,
        median(&mut times) * 1e3,
        100.0 * hits as f64 / (hits + misses).max(1) as f64,
        bytes_per_token / 1e6,
        bw / 1e9,
        floor * 1e3,
        mean_time / floor,
        compute_ms
    );
    Ok(())
}
