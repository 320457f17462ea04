//! Feeds arbitrary bytes through the shard header parser, the catalog-level
//! checks and the §3.3 format resolution, then decodes with whatever format
//! resolves. Any panic is a bug: everything here comes from files.
#![no_main]

use std::path::Path;

use glm_stream::container::header::parse_shard_bytes;
use glm_stream::quant::{FormatQuery, decode_rows, resolve_format};
use libfuzzer_sys::fuzz_target;

// Logical shapes to try each `.qs` pair against: GLM-5.2 shapes and tiny/odd ones.
const SHAPES: [[usize; 2]; 8] = [
    [2048, 6144],
    [6144, 16384],
    [28672, 512],
    [1, 1],
    [3, 67],
    [10, 80],
    [4, 130],
    [2, 3],
];

fuzz_target!(|data: &[u8]| {
    // 1. Arbitrary numbers straight into format resolution (first 34 bytes).
    if data.len() >= 34 {
        let u = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap_or_default());
        let hint = u32::from(data[32]);
        let q = FormatQuery {
            tensor: "fuzz",
            weight_bytes: u(0),
            scale_bytes: u(8),
            rows: (u(16) % 4096) as usize,
            cols: (u(24) % 4096) as usize,
            group_size_hint: (hint != 0).then_some(hint),
            stamp: match data[33] % 4 {
                0 => None,
                1 => Some("int4-grouped"),
                2 => Some("int8-row"),
                _ => Some("int4-row"),
            },
        };
        if let Ok(r) = resolve_format(&q) {
            let f = r.format;
            // Keep allocations small.
            if f.weight_bytes() <= 1 << 16 && f.numel() <= 1 << 16 {
                let w = vec![0x9Fu8; f.weight_bytes()];
                let s = vec![0.5f32; f.scale_count()];
                let mut out = vec![0f32; f.numel()];
                decode_rows(&f, &w, &s, 0, f.rows, &mut out).expect("resolved format must decode");
            }
        }
    }
    // 2. The bytes as a whole shard.
    let Ok(header) = parse_shard_bytes(Path::new("fuzz.safetensors"), data) else {
        return;
    };
    let len = data.len() as u64;
    for t in &header.tensors {
        assert!(
            t.begin <= t.end && header.data_start() + t.end <= len,
            "validated range escaped"
        );
        let Some(qs) = header
            .tensors
            .iter()
            .find(|s| s.name == format!("{}.qs", t.name))
        else {
            continue;
        };
        for [rows, cols] in SHAPES {
            let q = FormatQuery {
                tensor: &t.name,
                weight_bytes: t.end - t.begin,
                scale_bytes: qs.end - qs.begin,
                rows,
                cols,
                group_size_hint: None,
                stamp: header.fmt_stamps.get(&t.name).map(String::as_str),
            };
            let Ok(r) = resolve_format(&q) else { continue };
            let f = r.format;
            let (ws, we) = (
                (header.data_start() + t.begin) as usize,
                (header.data_start() + t.end) as usize,
            );
            let (ss, se) = (
                (header.data_start() + qs.begin) as usize,
                (header.data_start() + qs.end) as usize,
            );
            let (Some(w), Some(sb)) = (data.get(ws..we), data.get(ss..se)) else {
                panic!("validated range not readable");
            };
            let Ok(scales) = glm_stream::quant::scales_from_le_bytes(sb) else {
                continue;
            };
            if f.numel() <= 1 << 20 {
                let mut out = vec![0f32; f.numel()];
                decode_rows(&f, w, &scales, 0, f.rows, &mut out)
                    .expect("resolved format must decode");
            }
        }
    }
});
