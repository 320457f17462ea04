//! GPU performance suite of the expert kernels (run on the H200):
//!
//! 1. `hbm`: MLX's device bandwidth, an element-wise pass (`a + 1`) over a
//!    2 GiB f32 array (4 GiB moved).
//! 2. `layer`: one MoE layer's 8 routed experts for M token rows (GLM-5.2
//!    shapes, Q4 g64, bf16 activations), stock vs fused, each iteration
//!    picking 8 distinct experts out of 128 slots (2.7 GB, far beyond the
//!    60 MB L2) and timing graph build + evaluation. Effective bandwidth =
//!    expert bytes / time.
//!    `E` experts per fused call (32: four layers' experts in one launch
//!    pair, the kernels' throughput with less launch overhead) and, with
//!    `--sweep`, the tensor-core kernels' chunks per step ([`FusedTuning`]
//!    unrolls) at M = 1 and 4. Fused runs both designs: `tensor`
//!    (`KernelFamily::Fused`) and `simt` (`KernelFamily::FusedSimt`).
//! 3. `executor`: [`StreamedExecutor::forward_routes`] for one layer of 128
//!    resident GLM-5.2 experts (random top-8 per call, bf16 row), kernel
//!    family pinned to `Stock`, `FusedSimt` or `Fused`: the decode path's per-layer time
//!    including routing weights, the lease and the fenced evaluation.
//! 4. `upload` (skipped with `--no-upload`): getting a missed expert (21 MB)
//!    from host memory into a usable slot: host writes into the MLX managed
//!    slot (one memcpy, 2 MiB chunks, 8 threads) then the first GPU touch,
//!    vs `cudaMemcpy` through the CUDA runtime (pinned and pageable host →
//!    device, and pinned host → the managed slot itself), loaded with
//!    `dlopen` from the image.
//!
//! `--smoke`: only the one-row layer figures (1 and 16 layers per eval).
//!
//! `cargo bench --bench fused_experts --features cuda` (on a CPU build only
//! the stock figures and the managed-write figures are produced).

use std::sync::Arc;
use std::time::Instant;

use glm_stream::executor::{ExecutorOptions, StreamedExecutor};
use glm_stream::experts::layout::{ExpertExtents, ProjectionFormat, TensorExtent};
use glm_stream::experts::{
    DirectUpload, ExpertError, ExpertSource, PolicyConfig, ResidencyManager, SlabConfig, SlotLayout,
};
use glm_stream::kernels::{Environment, ExpertSlot, FusedExperts, FusedTuning, KernelFamily};
use glm_stream::mlx::{self, Array, Device, Dtype, WritableBuffer};
use glm_stream::moe::Routes;

const HIDDEN: usize = 6144;
const INTER: usize = 2048;
const SLOTS_PER_ARENA: usize = 64;
const TOP_K: usize = 8;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A tiny deterministic generator (xorshift64*), enough for test bytes.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

fn glm_layout() -> BenchResult<SlotLayout> {
    let g64 = |rows, cols| ProjectionFormat {
        bits: 4,
        group_size: Some(64),
        rows,
        cols,
    };
    let formats = [g64(INTER, HIDDEN), g64(INTER, HIDDEN), g64(HIDDEN, INTER)];
    let mut off = 3 * 4096 + 80;
    let mut extent = |len: usize| {
        let t = TensorExtent {
            file: 0,
            offset: off,
            len: len as u64,
        };
        off += len as u64;
        t
    };
    let weights = formats.map(|f| extent(f.weight_bytes().unwrap_or(0)));
    let scales = formats.map(|f| extent(f.scale_bytes().unwrap_or(0)));
    Ok(SlotLayout::plan(
        0,
        0,
        &ExpertExtents {
            weights,
            scales,
            formats,
        },
    )?)
}

/// Fills one slot: random weight bytes, scales ~ 1/(8·sqrt(cols)).
fn fill_slot(rng: &mut Rng, slot: &mut [u8], layout: &SlotLayout) {
    rng.fill(slot);
    for p in &layout.projections {
        let amp = 1.0 / (8.0 * (p.format.cols as f32).sqrt());
        let n = p.format.scale_bytes().unwrap_or(0) / 4;
        for i in 0..n {
            let s = amp * (0.5 + (rng.next() % 1000) as f32 / 1000.0);
            let at = p.scale_offset + 4 * i;
            slot[at..at + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// `a + 1` over a 2 GiB f32 array: bytes moved per second.
fn hbm_bandwidth() -> BenchResult<f64> {
    let n = 512 * 1024 * 1024;
    let a = mlx::full(&[n], 1.0, Dtype::Float32)?;
    a.eval()?;
    let mut times = Vec::new();
    for i in 0..12 {
        let t = Instant::now();
        let b = a.add_scalar(1.0)?;
        b.eval()?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let med = percentile(&mut times, 0.5);
    let bytes = 2.0 * 4.0 * n as f64;
    println!(
        "hbm: a+1 over 2 GiB f32 (4 GiB moved): median {:.3} ms → {:.0} GB/s",
        med * 1e3,
        bytes / med / 1e9
    );
    Ok(bytes / med)
}

struct Pool {
    arenas: Vec<WritableBuffer>,
    count: usize,
    stride: usize,
    layout: SlotLayout,
}

impl Pool {
    fn new(rng: &mut Rng, count: usize) -> BenchResult<Self> {
        let layout = glm_layout()?;
        let stride = layout.slot_bytes.div_ceil(16384) * 16384;
        let mut arenas = Vec::new();
        for _ in 0..count {
            let mut b = WritableBuffer::new(stride * SLOTS_PER_ARENA)?;
            let bytes = b.bytes_mut()?;
            for s in 0..SLOTS_PER_ARENA {
                fill_slot(
                    rng,
                    &mut bytes[s * stride..s * stride + layout.slot_bytes],
                    &layout,
                );
            }
            arenas.push(b);
        }
        Ok(Self {
            arenas,
            count,
            stride,
            layout,
        })
    }

    /// Slot `slot` as the kernels take it: inside its arena, at its offset
    /// (no per-expert view to build).
    fn slot(&self, slot: usize) -> ExpertSlot<'_> {
        let a = self.arenas[slot / SLOTS_PER_ARENA].as_array();
        ExpertSlot::in_arena(a, (slot % SLOTS_PER_ARENA) * self.stride, &self.layout)
    }

    fn slots(&self) -> usize {
        self.count * SLOTS_PER_ARENA
    }
}

/// Median seconds per layer of `runner` for `rows` rows, evaluating `batch`
/// independent layers (distinct random experts) per `eval` (1: one layer's
/// latency including graph build, launch and sync; more: GPU throughput
/// with MLX's per-eval overhead amortized). Returns the median, p10 and p90
/// per layer and the median of the `eval` part alone (graph build, which
/// MLX does on the calling thread before any launch, left out).
#[allow(clippy::too_many_arguments)]
fn layer_time(
    pool: &Pool,
    runner: &FusedExperts,
    rows: usize,
    experts: usize,
    batch: usize,
    layers: usize,
    rng: &mut Rng,
) -> BenchResult<(f64, f64, f64, f64)> {
    let xs: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let x = Array::from_slice(&xs, &[rows as i32, HIDDEN as i32])?.astype(Dtype::Bfloat16)?;
    let w = mlx::full(
        &[rows as i32, experts as i32],
        1.0 / experts as f32,
        Dtype::Float32,
    )?;
    mlx::eval(&[&x, &w])?;
    let mut times = Vec::new();
    let mut evals = Vec::new();
    let iters = (layers / batch).max(10);
    for i in 0..iters {
        let picks: Vec<Vec<usize>> = (0..batch)
            .map(|_| {
                let mut ids: Vec<usize> = Vec::with_capacity(experts);
                while ids.len() < experts {
                    let s = rng.below(pool.slots());
                    if !ids.contains(&s) {
                        ids.push(s);
                    }
                }
                ids
            })
            .collect();
        let t = Instant::now();
        let mut ys = Vec::with_capacity(batch);
        for ids in &picks {
            let slots: Vec<ExpertSlot<'_>> = ids.iter().map(|&s| pool.slot(s)).collect();
            ys.push(runner.forward(&x, &slots, &w)?);
        }
        let refs: Vec<&Array> = ys.iter().collect();
        let built = t.elapsed().as_secs_f64();
        mlx::eval(&refs)?;
        if i >= iters / 10 {
            let total = t.elapsed().as_secs_f64();
            times.push(total / batch as f64);
            evals.push((total - built) / batch as f64);
        }
    }
    Ok((
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.1),
        percentile(&mut times, 0.9),
        percentile(&mut evals, 0.5),
    ))
}

fn layer_bench(pool: &Pool, rng: &mut Rng, hbm: f64, sweep: bool, quick: bool) -> BenchResult<()> {
    let expert_bytes = pool.layout.data_bytes as f64;
    println!(
        "layer: {} slots of {} B (data {} B), bf16 x, wall time of build+eval",
        pool.slots(),
        pool.layout.slot_bytes,
        pool.layout.data_bytes
    );
    let stock = FusedExperts::new(KernelFamily::Stock)?;
    // Both fused designs: tensor cores (`Fused` on CUDA for int4) and CUDA
    // cores (`FusedSimt`).
    let gpu = Environment::current().gpu_default;
    let fused: Vec<(&str, FusedExperts)> = [
        ("tensor", KernelFamily::Fused),
        ("simt", KernelFamily::FusedSimt),
    ]
    .into_iter()
    .filter_map(|(name, family)| match FusedExperts::new(family) {
        Ok(f) if gpu => Some((name, f)),
        _ => None,
    })
    .collect();
    let gb = |e: usize, t: f64| e as f64 * expert_bytes / t / 1e9;
    let pct = |e: usize, t: f64| 100.0 * e as f64 * expert_bytes / t / hbm;
    let runs: [(usize, usize, usize); 11] = [
        (1, TOP_K, 1),
        (2, TOP_K, 1),
        (4, TOP_K, 1),
        (8, TOP_K, 1),
        (1, TOP_K, 16),
        (2, TOP_K, 16),
        (4, TOP_K, 16),
        (8, TOP_K, 16),
        (1, 4 * TOP_K, 1),
        (1, 4 * TOP_K, 4),
        (4, 4 * TOP_K, 4),
    ];
    let quick_runs = [
        (1, TOP_K, 1),
        (1, TOP_K, 16),
        (1, TOP_K, 64),
        (1, 4 * TOP_K, 4),
        (2, TOP_K, 16),
        (4, TOP_K, 16),
        (8, TOP_K, 16),
    ];
    let smoke_runs = [(1, TOP_K, 1), (1, TOP_K, 16)];
    let (runs, layers): (&[(usize, usize, usize)], usize) =
        if std::env::args().any(|a| a == "--smoke") {
            (&smoke_runs, 160)
        } else if quick {
            (&quick_runs, 160)
        } else {
            (&runs, 330)
        };
    for &(rows, experts, batch) in runs {
        println!("  -- M={rows}, E={experts}, {batch} call(s) per eval");
        let (s, s10, s90, se) = layer_time(pool, &stock, rows, experts, batch, layers, rng)?;
        println!(
            "  M={rows} E={experts} x{batch} stock: median {:.1} µs (p10 {:.1}, p90 {:.1}; eval {:.1}) → {:.0} GB/s = {:.0} % of hbm",
            s * 1e6,
            s10 * 1e6,
            s90 * 1e6,
            se * 1e6,
            gb(experts, s),
            pct(experts, s)
        );
        for (name, f) in &fused {
            let (t, t10, t90, te) = layer_time(pool, f, rows, experts, batch, layers, rng)?;
            println!(
                "  M={rows} E={experts} x{batch} {name}: median {:.1} µs (p10 {:.1}, p90 {:.1}; eval {:.1} → {:.0} % of hbm) → {:.0} GB/s = {:.0} % of hbm; {:.2}× stock",
                t * 1e6,
                t10 * 1e6,
                t90 * 1e6,
                te * 1e6,
                pct(experts, te),
                gb(experts, t),
                pct(experts, t),
                s / t
            );
        }
    }
    if !sweep || fused.is_empty() {
        return Ok(());
    }
    println!("sweep: tensor-core chunks per step (K1, K2), 16 layers of 8 experts per eval");
    for rows in [1usize, 4] {
        for (u1, u2) in [(1, 1), (2, 2), (4, 4), (2, 4), (4, 2)] {
            let t = FusedTuning {
                gate_up_unroll: u1,
                down_unroll: u2,
                ..FusedTuning::for_rows(rows)
            };
            let runner = FusedExperts::new(KernelFamily::Fused)?.with_tuning(Some(t))?;
            let (m, _, _, me) = layer_time(pool, &runner, rows, TOP_K, 16, 320, rng)?;
            println!(
                "  sweep M={rows} K1 U{u1} K2 U{u2}: {:.1} µs (eval {:.1}) → {:.0} GB/s = {:.0} % of hbm{}",
                m * 1e6,
                me * 1e6,
                gb(TOP_K, m),
                pct(TOP_K, m),
                if (u1, u2) == (2, 2) { " (default)" } else { "" }
            );
        }
    }
    Ok(())
}

/// Fills expert slots with random bytes (seeded by the expert id) and valid
/// scales: the executor bench's storage, in memory.
struct RandomExperts {
    layout: SlotLayout,
}

impl ExpertSource for RandomExperts {
    fn read_expert(&self, _layer: u32, expert: u32, dst: &mut [u8]) -> Result<u64, ExpertError> {
        let n = self.layout.slot_bytes.min(dst.len());
        let mut rng = Rng(0x5851_F42D_4C95_7F2D ^ (u64::from(expert) + 1).wrapping_mul(0x9E37));
        fill_slot(&mut rng, &mut dst[..n], &self.layout);
        Ok(n as u64)
    }
}

/// The streamed executor's decode step for one layer with every expert
/// resident: `forward_routes` per call (8 random experts, random weights).
fn executor_bench(rng: &mut Rng, hbm: f64, quick: bool) -> BenchResult<()> {
    let experts: u32 = if quick { 64 } else { 128 };
    let layout = glm_layout()?;
    let source = Arc::new(RandomExperts {
        layout: layout.clone(),
    });
    let slots = experts as usize;
    let manager = ResidencyManager::new(
        &SlabConfig::new(layout.slot_bytes, slots),
        PolicyConfig::new(1, experts, slots),
        source,
        Arc::new(DirectUpload),
        4,
    )?;
    let layouts = (0..experts).map(|e| ((0u32, e), layout.clone()));
    let mut ex = StreamedExecutor::new(manager, HIDDEN, layouts)?;
    let expert_bytes = layout.data_bytes as f64;
    let route = |rows: usize, rng: &mut Rng| -> BenchResult<Routes> {
        let mut ids = Vec::with_capacity(rows * TOP_K);
        let mut weights = Vec::with_capacity(rows * TOP_K);
        for _ in 0..rows {
            let mut row: Vec<u32> = Vec::with_capacity(TOP_K);
            while row.len() < TOP_K {
                let e = rng.below(experts as usize) as u32;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            ids.extend(row);
            weights.extend((0..TOP_K).map(|_| 0.05 + (rng.next() % 100) as f32 / 1000.0));
        }
        Ok(Routes::new(TOP_K, experts, ids, weights)?)
    };
    // Load every expert once (16 calls of 8 distinct experts).
    let x1 = Array::from_slice(&vec![0.01f32; HIDDEN], &[1, HIDDEN as i32])?;
    for c in 0..(experts as usize / TOP_K) {
        let ids: Vec<u32> = (0..TOP_K as u32).map(|k| (c * TOP_K) as u32 + k).collect();
        let routes = Routes::new(TOP_K, experts, ids, vec![0.125; TOP_K])?;
        ex.forward_routes(0, &x1, routes, experts, None)?;
    }
    println!(
        "executor: one layer, {experts} resident experts, top-{TOP_K}, bf16 rows, forward_routes wall time"
    );
    let families: &[KernelFamily] =
        if Environment::current().gpu_default && Environment::current().fused_backend.is_some() {
            &[
                KernelFamily::Stock,
                KernelFamily::FusedSimt,
                KernelFamily::Fused,
            ]
        } else {
            &[KernelFamily::Stock]
        };
    for rows in [1usize, 2, 4] {
        let xs: Vec<f32> = (0..rows * HIDDEN)
            .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let x = Array::from_slice(&xs, &[rows as i32, HIDDEN as i32])?.astype(Dtype::Bfloat16)?;
        x.eval()?;
        let mut stock_time = None;
        for &family in families {
            ex.set_options(ExecutorOptions {
                kernel_family: family,
                ..ExecutorOptions::default()
            })?;
            let before = ex.telemetry().clone();
            let mut times = Vec::new();
            let mut distinct = 0usize;
            for i in 0..if quick { 120 } else { 220 } {
                let routes = route(rows, rng)?;
                let mut seen: Vec<u32> = routes.ids(0).to_vec();
                for r in 1..rows {
                    seen.extend(routes.ids(r));
                }
                seen.sort_unstable();
                seen.dedup();
                let t = Instant::now();
                ex.forward_routes(0, &x, routes, experts, None)?;
                if i >= 20 {
                    times.push(t.elapsed().as_secs_f64());
                    distinct += seen.len();
                }
            }
            let after = ex.telemetry();
            let med = percentile(&mut times, 0.5);
            let (p10, p90) = (percentile(&mut times, 0.1), percentile(&mut times, 0.9));
            let per_call = distinct as f64 / times.len() as f64;
            let gbs = per_call * expert_bytes / med / 1e9;
            let ratio =
                stock_time.map_or(String::new(), |s: f64| format!("; {:.2}× stock", s / med));
            println!(
                "  M={rows} {family:?}: median {:.1} µs (p10 {:.1}, p90 {:.1}), {:.1} experts/call → {:.0} GB/s = {:.0} % of hbm; fused waves {}/{}{ratio}",
                med * 1e6,
                p10 * 1e6,
                p90 * 1e6,
                per_call,
                gbs,
                100.0 * gbs * 1e9 / hbm,
                after.fused_waves - before.fused_waves,
                after.waves - before.waves,
            );
            if family == KernelFamily::Stock {
                stock_time = Some(med);
            }
        }
    }
    Ok(())
}

/// The CUDA runtime, opened with dlopen (only in this bench).
mod cudart {
    use std::ffi::{CString, c_void};

    type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> i32;
    type Free = unsafe extern "C" fn(*mut c_void) -> i32;
    type Memcpy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32) -> i32;
    type Sync = unsafe extern "C" fn() -> i32;

    pub const HOST_TO_DEVICE: i32 = 1;
    pub const DEFAULT: i32 = 4;

    pub struct Cudart {
        pub malloc_host: Malloc,
        pub free_host: Free,
        pub malloc: Malloc,
        pub free: Free,
        pub memcpy: Memcpy,
        pub sync: Sync,
    }

    fn open(path: &str) -> Option<*mut c_void> {
        let c = CString::new(path).ok()?;
        // SAFETY: `c` is a valid NUL-terminated path; dlopen has no other
        // preconditions. The handle is never closed (the library stays
        // loaded for the process, as libmlx's own CUDA libraries do).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        (!h.is_null()).then_some(h)
    }

    fn sym(h: *mut c_void, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: `h` is a live handle from dlopen and `c` a valid C string.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// Loads `libcudart.so.13` from the loader path, or from the image's
    /// `nvidia/cu13/lib` next to `$MLX_DIR` (set by `mlx-cuda-env.sh`).
    pub fn load() -> Option<Cudart> {
        let mut candidates = vec!["libcudart.so.13".to_string()];
        if let Ok(dir) = std::env::var("MLX_DIR") {
            candidates.push(format!("{dir}/../nvidia/cu13/lib/libcudart.so.13"));
        }
        let h = candidates.iter().find_map(|c| open(c))?;
        let get = |n: &str| sym(h, n);
        // SAFETY: each symbol is the CUDA runtime function of that name, whose
        // C signature (cudaError_t is an int-sized enum) is the type it is
        // transmuted to.
        unsafe {
            Some(Cudart {
                malloc_host: std::mem::transmute::<*mut c_void, Malloc>(get("cudaMallocHost")?),
                free_host: std::mem::transmute::<*mut c_void, Free>(get("cudaFreeHost")?),
                malloc: std::mem::transmute::<*mut c_void, Malloc>(get("cudaMalloc")?),
                free: std::mem::transmute::<*mut c_void, Free>(get("cudaFree")?),
                memcpy: std::mem::transmute::<*mut c_void, Memcpy>(get("cudaMemcpy")?),
                sync: std::mem::transmute::<*mut c_void, Sync>(get("cudaDeviceSynchronize")?),
            })
        }
    }
}

/// Median of `f` over `n` runs (seconds).
fn median_of(n: usize, mut f: impl FnMut() -> BenchResult<f64>) -> BenchResult<f64> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(f()?);
    }
    Ok(percentile(&mut v, 0.5))
}

/// One way of writing an expert's bytes into the slot from the host.
type HostWrite = Box<dyn Fn(&mut [u8], &[u8])>;

fn upload_bench(rng: &mut Rng) -> BenchResult<()> {
    let layout = glm_layout()?;
    let n = layout.slot_bytes;
    let mut src = vec![0u8; n];
    fill_slot(rng, &mut src, &layout);
    let mut slot = WritableBuffer::new(n)?;
    let gbs = |t: f64| n as f64 / t / 1e9;
    println!("upload: one expert slot, {n} B");
    // First GPU touch: a reduction over every byte of the slot.
    let touch = |b: &WritableBuffer| -> BenchResult<f64> {
        let t = Instant::now();
        let s = b.as_array().sum(&[0], false)?;
        s.eval()?;
        Ok(t.elapsed().as_secs_f64())
    };
    touch(&slot)?;
    mlx::synchronize()?;
    let mut variants: Vec<(&str, HostWrite)> = vec![
        (
            "memcpy",
            Box::new(|d: &mut [u8], s: &[u8]| d.copy_from_slice(s)),
        ),
        (
            "2 MiB chunks",
            Box::new(|d: &mut [u8], s: &[u8]| {
                for (a, b) in d.chunks_mut(2 << 20).zip(s.chunks(2 << 20)) {
                    a.copy_from_slice(b);
                }
            }),
        ),
    ];
    for threads in [4usize, 8] {
        let name: &'static str = if threads == 4 {
            "4 threads"
        } else {
            "8 threads"
        };
        variants.push((
            name,
            Box::new(move |d: &mut [u8], s: &[u8]| {
                let chunk = d.len().div_ceil(threads);
                std::thread::scope(|sc| {
                    for (a, b) in d.chunks_mut(chunk).zip(s.chunks(chunk)) {
                        sc.spawn(move || a.copy_from_slice(b));
                    }
                });
            }),
        ));
    }
    for (name, write) in &variants {
        let mut writes = Vec::new();
        let mut touches = Vec::new();
        for _ in 0..7 {
            // The slot's pages start on the GPU (it was just read there).
            touch(&slot)?;
            mlx::synchronize()?;
            let t = Instant::now();
            write(slot.bytes_mut()?, &src);
            writes.push(t.elapsed().as_secs_f64());
            touches.push(touch(&slot)?);
        }
        let (w, t) = (percentile(&mut writes, 0.5), percentile(&mut touches, 0.5));
        println!(
            "  managed host write ({name}): write {:.2} ms ({:.1} GB/s) + first GPU touch {:.2} ms = {:.2} ms ({:.1} GB/s)",
            w * 1e3,
            gbs(w),
            t * 1e3,
            (w + t) * 1e3,
            gbs(w + t)
        );
    }
    // A resident slot re-read (no migration), for scale.
    let warm = median_of(7, || touch(&slot))?;
    println!("  GPU read of a resident slot: {:.3} ms", warm * 1e3);

    let Some(rt) = cudart::load() else {
        println!("  libcudart.so.13 not found: no pinned-copy figures");
        return Ok(());
    };
    let mut pinned: *mut std::ffi::c_void = std::ptr::null_mut();
    let mut dev: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers and a size; the buffers are freed below.
    let (e1, e2) = unsafe { ((rt.malloc_host)(&mut pinned, n), (rt.malloc)(&mut dev, n)) };
    if e1 != 0 || e2 != 0 || pinned.is_null() || dev.is_null() {
        println!("  cudaMallocHost/cudaMalloc failed ({e1}, {e2})");
        return Ok(());
    }
    // SAFETY: `pinned` holds `n` bytes (cudaMallocHost succeeded) and `src`
    // is `n` bytes long; the regions do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), pinned.cast::<u8>(), n) };
    let copy =
        |dst: *mut std::ffi::c_void, s: *const std::ffi::c_void, kind: i32| -> BenchResult<f64> {
            let t = Instant::now();
            // SAFETY: `dst` and `s` each hold at least `n` bytes (device, pinned,
            // pageable or managed allocations of that size) and nothing else
            // uses them during the synchronous copy.
            let (e, f) = unsafe { ((rt.memcpy)(dst, s, n, kind), (rt.sync)()) };
            if e != 0 || f != 0 {
                return Err(format!("cudaMemcpy failed ({e}, {f})").into());
            }
            Ok(t.elapsed().as_secs_f64())
        };
    let t = median_of(9, || copy(dev, pinned, cudart::HOST_TO_DEVICE))?;
    println!(
        "  cudaMemcpy pinned → device: {:.2} ms ({:.1} GB/s)",
        t * 1e3,
        gbs(t)
    );
    let t = median_of(9, || copy(dev, src.as_ptr().cast(), cudart::HOST_TO_DEVICE))?;
    println!(
        "  cudaMemcpy pageable → device: {:.2} ms ({:.1} GB/s)",
        t * 1e3,
        gbs(t)
    );
    // Pinned host straight into the MLX managed slot, then the first touch.
    // SAFETY: only the address is taken; the copies below run while no MLX
    // computation reads the slot (each touch is evaluated and synchronized).
    let (slot_ptr, _) = unsafe { slot.raw_parts() };
    let mut copies = Vec::new();
    let mut touches = Vec::new();
    for _ in 0..7 {
        touch(&slot)?;
        mlx::synchronize()?;
        copies.push(copy(slot_ptr.cast(), pinned, cudart::DEFAULT)?);
        touches.push(touch(&slot)?);
    }
    let (c, t) = (percentile(&mut copies, 0.5), percentile(&mut touches, 0.5));
    println!(
        "  cudaMemcpy pinned → managed slot: {:.2} ms ({:.1} GB/s) + first GPU touch {:.2} ms = {:.2} ms ({:.1} GB/s)",
        c * 1e3,
        gbs(c),
        t * 1e3,
        (c + t) * 1e3,
        gbs(c + t)
    );
    // Check the bytes arrived intact.
    let ok = slot.bytes_mut()? == src.as_slice();
    println!("  managed slot bytes after cudaMemcpy match: {ok}");
    // SAFETY: both were allocated above and are no longer used.
    unsafe {
        (rt.free_host)(pinned);
        (rt.free)(dev);
    }
    Ok(())
}

fn main() -> BenchResult<()> {
    println!(
        "fused_experts: MLX {} default device {:?}, fused backend {:?}",
        mlx::version(),
        mlx::default_device(),
        Environment::current().fused_backend
    );
    if let Ok(f) = FusedExperts::new(KernelFamily::Fused) {
        println!(
            "fused kernels compiled by {}",
            if f.compiles_with_nvrtc() {
                "our NVRTC call (PTX to MLX's precompiled_cuda_kernel)"
            } else {
                "MLX's cuda_kernel"
            }
        );
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let gpu = mlx::default_device() == Device::Gpu;
    let flag = |f: &str| std::env::args().any(|a| a == f);
    mlx::memory::set_limit(12 << 30);
    let hbm = if gpu { hbm_bandwidth()? } else { 1.0 };
    if gpu || flag("--cpu") {
        let quick = flag("--quick");
        {
            let pool = Pool::new(&mut rng, if quick { 1 } else { 2 })?;
            layer_bench(&pool, &mut rng, hbm, flag("--sweep"), quick)?;
        }
        mlx::memory::clear_cache();
        if !flag("--smoke") {
            executor_bench(&mut rng, hbm, quick)?;
        }
        if gpu {
            hbm_bandwidth()?;
        }
    } else {
        println!("layer, executor: skipped on the CPU (pass --cpu to run them anyway)");
    }
    if !flag("--no-upload") {
        upload_bench(&mut rng)?;
    }
    Ok(())
}
