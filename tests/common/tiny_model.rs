//! Tiny converted models for the model tests, the mlx-lm oracle runner and a
//! small `.npy` reader.

use std::path::{Path, PathBuf};
use std::process::Command;

use glm_stream::convert::{ConvertOptions, convert_checkpoint};
use glm_stream::model::{Glm52Model, ModelCache, ModelOptions};
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};

/// A converted tiny model in a temp dir.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub hf: PathBuf,
    pub model: PathBuf,
    pub spec: TinyModelSpec,
}

/// Generates the HF checkpoint of `spec` with `seed`, lets `edit` change it
/// (config, shards), and converts it with `opts`.
pub fn build(
    spec: &TinyModelSpec,
    seed: u64,
    opts: &ConvertOptions,
    edit: impl FnOnce(&Path),
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let (hf, model) = (dir.path().join("hf"), dir.path().join("colibri"));
    generate_hf_checkpoint(&hf, spec, seed, SourceDtype::F32).unwrap();
    edit(&hf);
    convert_checkpoint(
        &hf,
        &model,
        &ConvertOptions {
            progress: false,
            ..opts.clone()
        },
    )
    .unwrap();
    Fixture {
        dir,
        hf,
        model,
        spec: spec.clone(),
    }
}

/// Options for tests: a small pool so several waves and evictions happen.
pub fn test_options() -> ModelOptions {
    ModelOptions {
        ram_budget_bytes: None,
        io_threads: 2,
        direct_io: false,
        include_mtp: false,
        ..ModelOptions::default()
    }
}

/// mlx-lm's logits rows and greedy tokens.
pub struct Oracle {
    pub rows: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// Runs `tests/oracle/mlx_lm_logits.py` on `model` (prefill `prompt`, then
/// `steps` greedy steps).
pub fn oracle(model: &Path, prompt: &[u32], steps: usize) -> Oracle {
    let out = model.with_file_name(format!("oracle-{}-{steps}.npy", prompt.len()));
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/mlx_lm_logits.py");
    let run = Command::new("python3")
        .arg(script)
        .arg(model)
        .args([
            "--ids",
            &ids.join(","),
            "--steps",
            &steps.to_string(),
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("python3 is required");
    assert!(
        run.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let tokens = report["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let (shape, data) = read_npy_f32(&out);
    assert_eq!(shape.len(), 2);
    let rows = data.chunks(shape[1]).map(<[f32]>::to_vec).collect();
    Oracle { rows, tokens }
}

/// Reads a little-endian float32 C-order `.npy` file: `(shape, values)`.
pub fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not an npy file");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap();
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<f32> = bytes[start + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// The crate's decode: prefill `prompt` (all rows), then one step per token
/// of `feed`. Returns `P + feed.len()` rows and, per forward, the smallest
/// router and indexer cut gaps (`+inf` where none).
pub fn decode(
    model: &mut Glm52Model,
    prompt: &[u32],
    feed: &[u32],
) -> (Vec<Vec<f32>>, f32, f32, ModelCache) {
    let vocab = model.config().vocab_size;
    let mut cache = model.new_cache();
    model.set_cut_gap_tracking(true);
    let (mut router_gap, mut index_gap) = (f32::INFINITY, f32::INFINITY);
    let mut note = |model: &Glm52Model| {
        let g = model.last_forward_min_gaps();
        router_gap = router_gap.min(g.router.unwrap_or(f32::INFINITY));
        index_gap = index_gap.min(g.indexer.unwrap_or(f32::INFINITY));
    };
    let logits = model.forward(prompt, &mut cache, true).unwrap();
    assert_eq!(logits.len(), prompt.len() * vocab);
    note(model);
    let mut rows: Vec<Vec<f32>> = logits.chunks(vocab).map(<[f32]>::to_vec).collect();
    for &t in feed {
        let row = model.forward(&[t], &mut cache, false).unwrap();
        assert_eq!(row.len(), vocab);
        note(model);
        rows.push(row);
    }
    assert_eq!(cache.len(), prompt.len() + feed.len());
    (rows, router_gap, index_gap, cache)
}

/// max |got − want| / max |want| of one row.
pub fn row_rel_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    let err = got.iter().zip(want).fold(0f64, |m, (a, b)| {
        m.max((f64::from(*a) - f64::from(*b)).abs())
    });
    err / scale.max(1e-30)
}

/// Index of the largest value (first on ties) and the top-1 minus top-2 gap.
pub fn argmax_gap(row: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    let second = row
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best.0)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    (best.0 as u32, best.1 - second)
}

/// A deterministic prompt of `len` ids below `vocab`.
pub fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 37 + salt * 11 + 3) % vocab) as u32)
        .collect()
}
