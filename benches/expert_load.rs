//! Expert load throughput: the streamed-experts loader against a plain
//! sequential O_DIRECT read of the same number of bytes, from the same file,
//! in the same run.
//!
//! The file is a safetensors shard written by the container writer
//! (`convert::writer`) with the real colibri layout: 64 routed experts of
//! layer 0 at the GLM-5.2 int4-g64 size (21,233,664 B each: gate/up
//! `[2048, 6144]`, down `[6144, 2048]`), every F32 `.qs` first (sorted by
//! name, so an expert's down/gate/up scales are adjacent), then every U8
//! weight (sorted by name, adjacent per expert; expert ids sort as strings).
//! 1.36 GB in a temporary directory under `/tmp`, deleted at the end.
//!
//! * `manager`: [`FileExpertSource`] (one O_DIRECT span read for the three
//!   weights, one for the three scales) through [`ResidencyManager::acquire`]
//!   on 4 I/O threads (or `GLM_BENCH_IO_THREADS`) into an 8-slot pool,
//!   8 experts per wave, every expert a miss.
//! * `sequential`: one thread, one O_DIRECT `pread` per expert-sized chunk
//!   into a 4096-aligned buffer, front to back over the data region, for the
//!   same total bytes (64 × 21,233,664).
//!
//! Before every pass the file's page cache is dropped (`POSIX_FADV_DONTNEED`)
//! so that no buffered read could be served from memory.
//!
//! Run: `cargo bench --bench expert_load`. Criterion prints each method's
//! throughput; the last lines give the median GB/s of both and their ratio.

use criterion::{Criterion, Throughput};
use glm_stream::convert::writer::{ShardLayout, ShardWriter, TensorSpec};
use glm_stream::experts::layout::{ExpertExtents, ProjectionFormat, SlotLayout, TensorExtent};
use glm_stream::experts::reader::{open_uncached, read_full_at};
use glm_stream::experts::{
    DirectUpload, FileExpertSource, PolicyConfig, ResidencyManager, SlabConfig,
};
use safetensors::Dtype;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const EXPERTS: u32 = 64;
const WAVE: usize = 8;
/// I/O threads of the manager (`GLM_BENCH_IO_THREADS` overrides).
const IO_THREADS: usize = 4;
const EXPERT_BYTES: u64 = 21_233_664;

fn formats() -> [ProjectionFormat; 3] {
    let f = |rows, cols| ProjectionFormat {
        bits: 4,
        group_size: Some(64),
        rows,
        cols,
    };
    [f(2048, 6144), f(2048, 6144), f(6144, 2048)]
}

fn tensor_name(e: u32, p: usize) -> String {
    let proj = ["gate_proj", "up_proj", "down_proj"][p];
    format!("model.layers.0.mlp.experts.{e}.{proj}.weight")
}

/// Writes the shard with the container writer and returns every expert's
/// extents (absolute file offsets) and the data region's start.
fn write_file(path: &Path) -> Result<(Vec<ExpertExtents>, u64), Box<dyn std::error::Error>> {
    let formats = formats();
    let mut specs = Vec::new();
    for e in 0..EXPERTS {
        for (p, f) in formats.iter().enumerate() {
            let wb = f.weight_bytes().ok_or("weight size")?;
            let sb = f.scale_bytes().ok_or("scale size")?;
            specs.push(TensorSpec::new(tensor_name(e, p), Dtype::U8, vec![wb]));
            specs.push(TensorSpec::new(
                format!("{}.qs", tensor_name(e, p)),
                Dtype::F32,
                vec![sb / 4],
            ));
        }
    }
    let layout = ShardLayout::new(specs)?;
    let header = layout.header_bytes().len() as u64;
    let at: HashMap<String, (u64, u64)> = layout
        .entries()
        .iter()
        .map(|e| {
            let range = (header + e.begin as u64, (e.end - e.begin) as u64);
            (e.spec.name.clone(), range)
        })
        .collect();
    let mut w = ShardWriter::create(path, layout.clone())?;
    let mut chunk = Vec::new();
    for (i, e) in layout.entries().iter().enumerate() {
        chunk.clear();
        chunk.extend((0..e.end - e.begin).map(|j| {
            (j as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(i as u32) as u8
        }));
        w.write(&e.spec.name, &chunk)?;
    }
    w.finish()?;
    let ext = |name: &str| -> Result<TensorExtent, String> {
        let &(offset, len) = at.get(name).ok_or_else(|| format!("no tensor {name}"))?;
        Ok(TensorExtent {
            file: 0,
            offset,
            len,
        })
    };
    let mut all = Vec::new();
    for e in 0..EXPERTS {
        let mut weights = [ext(&tensor_name(e, 0))?; 3];
        let mut scales = weights;
        for p in 0..3 {
            weights[p] = ext(&tensor_name(e, p))?;
            scales[p] = ext(&format!("{}.qs", tensor_name(e, p)))?;
        }
        all.push(ExpertExtents {
            weights,
            scales,
            formats,
        });
    }
    Ok((all, header))
}

fn drop_cache(path: &Path) {
    if let Ok(f) = File::open(path) {
        // SAFETY: a plain advisory syscall on a descriptor we own.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            eprintln!("posix_fadvise failed: {rc}");
        }
    }
}

fn median_gbps(samples: &[(u64, Duration)]) -> f64 {
    let mut v: Vec<f64> = samples
        .iter()
        .map(|(b, d)| *b as f64 / d.as_secs_f64() / 1e9)
        .collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::Builder::new()
        .prefix("glm-stream-expert-load")
        .tempdir_in("/tmp")?;
    let path = dir.path().join("experts.bin");
    eprintln!(
        "writing {} experts × {EXPERT_BYTES} B to {}",
        EXPERTS,
        path.display()
    );
    let (extents, data_start) = write_file(&path)?;
    let total = u64::from(EXPERTS) * EXPERT_BYTES;

    let layouts: HashMap<(u32, u32), SlotLayout> = extents
        .iter()
        .enumerate()
        .map(|(e, x)| Ok(((0, e as u32), SlotLayout::plan(0, e as u32, x)?)))
        .collect::<Result<_, glm_stream::experts::ExpertError>>()?;
    let l0 = &layouts[&(0, 0)];
    eprintln!(
        "data region at byte {data_start} ({} mod 16); expert 0: weights {}, scales {:?}, {} direct + {} staged reads",
        data_start % 16,
        if l0.contiguous {
            "one span into the slot"
        } else {
            "staged"
        },
        l0.scale_path,
        l0.reads.len(),
        l0.staged.len()
    );
    let source = FileExpertSource::open(std::slice::from_ref(&path), layouts, true)?;
    if !source.is_direct() {
        eprintln!("warning: O_DIRECT unavailable on this file system; buffered reads");
    }
    let slot = source.max_slot_bytes();
    let io_threads = std::env::var("GLM_BENCH_IO_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(IO_THREADS);
    eprintln!("manager: {io_threads} I/O threads, {WAVE}-slot pool");
    let mut manager = ResidencyManager::new(
        &SlabConfig::new(slot, WAVE),
        PolicyConfig::new(1, EXPERTS, WAVE),
        Arc::new(source),
        Arc::new(DirectUpload),
        io_threads,
    )?;
    let direct = open_uncached(&path)?;
    let mut raw = vec![0u8; EXPERT_BYTES as usize + 4096];
    let pad = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[pad..pad + EXPERT_BYTES as usize];

    let manager_samples = RefCell::new(Vec::new());
    let plain_samples = RefCell::new(Vec::new());
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(20));
    let mut g = c.benchmark_group("expert_load_64x21MB");
    g.throughput(Throughput::Bytes(total));
    g.bench_function("manager", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                drop_cache(&path);
                let start = Instant::now();
                let before = manager.telemetry().map(|t| t.bytes_read).unwrap_or(0);
                for wave in (0..EXPERTS).collect::<Vec<_>>().chunks(WAVE) {
                    let lease = match manager.acquire(0, wave, |_, _| Ok(())) {
                        Ok(l) => l,
                        Err(e) => panic!("load failed: {e}"),
                    };
                    if let Err(e) = lease.release_fenced() {
                        panic!("release failed: {e}");
                    }
                }
                let d = start.elapsed();
                let read = manager.telemetry().map(|t| t.bytes_read).unwrap_or(0) - before;
                assert!(read >= total, "every expert must miss ({read} < {total})");
                manager_samples.borrow_mut().push((total, d));
                spent += d;
            }
            spent
        })
    });
    g.bench_function("sequential_o_direct", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                drop_cache(&path);
                let start = Instant::now();
                let base = data_start / 4096 * 4096;
                for e in 0..u64::from(EXPERTS) {
                    match read_full_at(&direct, base + e * EXPERT_BYTES, buf, true) {
                        Ok(n) if n == EXPERT_BYTES => {}
                        Ok(n) => panic!("short read: {n} bytes"),
                        Err(err) => panic!("read failed: {err}"),
                    }
                }
                let d = start.elapsed();
                plain_samples.borrow_mut().push((total, d));
                spent += d;
            }
            spent
        })
    });
    g.finish();
    c.final_summary();
    let (m, p) = (
        median_gbps(&manager_samples.borrow()),
        median_gbps(&plain_samples.borrow()),
    );
    println!(
        "median over {} / {} passes of {:.2} GB: manager {m:.3} GB/s, sequential O_DIRECT {p:.3} GB/s, ratio {:.1}%",
        manager_samples.borrow().len(),
        plain_samples.borrow().len(),
        total as f64 / 1e9,
        100.0 * m / p
    );
    drop(manager);
    dir.close()?;
    Ok(())
}
