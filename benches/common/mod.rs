//! Helpers shared by the streaming benches (`moe_layer_decode`, `decode_slice`).

use std::path::Path;
use std::time::Instant;

use glm_stream::experts::reader::{open_uncached, read_full_at};

/// The error type of the bench binaries.
pub type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Bytes of one GLM-5.2 int4-g64 routed expert (weights and scales).
pub const EXPERT_BYTES: u64 = 21_233_664;

/// The value of environment variable `name`, or `default` when unset or unparsable.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One thread of sequential O_DIRECT reads of `bytes` from the start of
/// the file, one expert-sized request at a time; returns bytes/s.
pub fn sequential_bandwidth(path: &Path, bytes: u64) -> BoxResult<f64> {
    let f = open_uncached(path)?;
    let len = std::fs::metadata(path)?.len();
    let mut raw = vec![0u8; EXPERT_BYTES as usize + 4096];
    let pad = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[pad..pad + EXPERT_BYTES as usize];
    let chunks = (bytes.min(len) / EXPERT_BYTES).max(1);
    let start = Instant::now();
    let mut total = 0u64;
    for i in 0..chunks {
        let got = read_full_at(&f, i * EXPERT_BYTES, buf, true)?;
        total += got;
        if got < EXPERT_BYTES {
            break;
        }
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}
