//! Cross-language check: an independent numpy decoder of the container
//! (`tests/oracle/colibri_decode.py`, written from the spec) and the Rust
//! reader agree bit for bit on every weight of converted tiny models; the
//! mlx-lm reference harness built on that decoder runs.

use std::path::Path;
use std::process::Command;

use glm_stream::container::ColibriContainer;
use glm_stream::convert::{ConvertOptions, convert_checkpoint};
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};
use safetensors::{Dtype, SafeTensors};

fn check(group_size: usize, dtype: SourceDtype, seed: u64) {
    let work = tempfile::tempdir().unwrap();
    let (hf, out) = (work.path().join("hf"), work.path().join("colibri"));
    let spec = TinyModelSpec {
        hidden_size: 192,
        moe_intermediate_size: 128,
        q_lora_rank: 96,
        kv_lora_rank: 64,
        ..TinyModelSpec::default()
    };
    generate_hf_checkpoint(&hf, &spec, seed, dtype).unwrap();
    convert_checkpoint(
        &hf,
        &out,
        &ConvertOptions {
            group_size,
            progress: false,
            ..ConvertOptions::default()
        },
    )
    .unwrap();
    let dump = work.path().join("decoded.safetensors");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/colibri_decode.py");
    let run = Command::new("python3")
        .arg(script)
        .arg(&out)
        .arg(&dump)
        .output()
        .expect("python3 is required");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );

    let bytes = std::fs::read(&dump).unwrap();
    let theirs = SafeTensors::deserialize(&bytes).unwrap();
    let container = ColibriContainer::open(&out).unwrap();
    assert_eq!(theirs.len(), container.weight_count());
    for info in container.weights() {
        let view = theirs
            .tensor(&info.name)
            .unwrap_or_else(|_| panic!("{} missing from the numpy dump", info.name));
        assert_eq!(view.dtype(), Dtype::F32);
        let (ours, _) = container.dequantize(&info.name).unwrap();
        let numpy: Vec<u32> = view
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(numpy.len(), ours.len(), "{}", info.name);
        if let Some(i) = ours.iter().zip(&numpy).position(|(a, b)| a.to_bits() != *b) {
            panic!(
                "{} element {i}: rust {} numpy {}",
                info.name,
                ours[i],
                f32::from_bits(numpy[i])
            );
        }
    }
}

#[test]
fn numpy_decoder_agrees_on_int4_g64_int8_io_and_mtp() {
    check(64, SourceDtype::Bf16, 21);
}

#[test]
fn numpy_decoder_agrees_on_int4_per_row_from_fp8() {
    check(0, SourceDtype::Fp8, 22);
}

/// The mlx-lm reference harness (used by the model tests) runs on a converted
/// container, takes the sparse indexer path (prompt longer than index_topk),
/// and its cached decode agrees with an uncached pass (checked in the script).
#[test]
fn mlx_lm_reference_harness_runs() {
    let work = tempfile::tempdir().unwrap();
    let (hf, out) = (work.path().join("hf"), work.path().join("colibri"));
    let spec = TinyModelSpec::default();
    generate_hf_checkpoint(&hf, &spec, 5, SourceDtype::F32).unwrap();
    convert_checkpoint(
        &hf,
        &out,
        &ConvertOptions {
            progress: false,
            ..ConvertOptions::default()
        },
    )
    .unwrap();
    let prompt: Vec<String> = (0..spec.index_topk + 4)
        .map(|i| ((i * 37 + 3) % spec.vocab_size).to_string())
        .collect();
    let npy = work.path().join("logits.npy");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/mlx_lm_logits.py");
    let run = Command::new("python3")
        .arg(script)
        .arg(&out)
        .args(["--ids", &prompt.join(","), "--steps", "3", "--out"])
        .arg(&npy)
        .output()
        .expect("python3 is required");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let tokens = report["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 3);
    assert!(
        tokens
            .iter()
            .all(|t| (t.as_u64().unwrap() as usize) < spec.vocab_size)
    );
    let rows = prompt.len() + 3 - 1;
    let size = std::fs::metadata(&npy).unwrap().len() as usize;
    assert!(
        size > rows * spec.vocab_size * 4 && size <= rows * spec.vocab_size * 4 + 256,
        "npy of {size} bytes"
    );
}
