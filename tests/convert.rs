//! End-to-end tests of the HF → Colibri converter and the tiny-model generator.
//!
//! Needs `python3` with numpy, safetensors, mlx, mlx-lm, tokenizers and transformers
//! (the oracle scripts live in `tests/oracle/`).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use glm_stream::convert::writer::{TensorSpec, write_shard};
use glm_stream::convert::{Bits, ConvertError, ConvertOptions, Pass, convert_checkpoint};
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};
use safetensors::Dtype;

fn oracle_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle")
}

fn python(script: &str, args: &[&str]) {
    let out = Command::new("python3")
        .arg(oracle_dir().join(script))
        .args(args)
        .output()
        .expect("python3 must be installed for these tests");
    assert!(
        out.status.success(),
        "{script} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn opts() -> ConvertOptions {
    ConvertOptions {
        progress: false,
        ..ConvertOptions::default()
    }
}

fn shard_files(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect()
}

/// Converts `src` with the Rust converter and the Python oracle and compares every
/// output shard byte for byte.
fn assert_matches_oracle(src: &Path, work: &Path, opts: &ConvertOptions) {
    let tag = format!(
        "g{}-io{}-e{}-m{}",
        opts.group_size,
        opts.io_bits.get(),
        opts.ebits.get(),
        opts.mtp_bits.get()
    );
    let ours = work.join(format!("rust-{tag}"));
    let theirs = work.join(format!("oracle-{tag}"));
    let report = convert_checkpoint(src, &ours, opts).unwrap();
    python(
        "colibri_convert_oracle.py",
        &[
            "--input",
            src.to_str().unwrap(),
            "--output",
            theirs.to_str().unwrap(),
            "--group-size",
            &opts.group_size.to_string(),
            "--io-bits",
            &opts.io_bits.get().to_string(),
            "--ebits",
            &opts.ebits.get().to_string(),
            "--mtp-bits",
            &opts.mtp_bits.get().to_string(),
        ],
    );
    let files = shard_files(&ours);
    assert_eq!(files, shard_files(&theirs), "{tag}: different shard sets");
    // Main pass: 2 source shards; MTP: its own shard; indexer: the 2 main shards.
    let expected: BTreeSet<String> = [
        "out-00000.safetensors",
        "out-00001.safetensors",
        "out-mtp-00000.safetensors",
        "out-idx-00000.safetensors",
        "out-idx-00001.safetensors",
    ]
    .map(String::from)
    .into();
    assert_eq!(files, expected);
    for f in &files {
        let a = fs::read(ours.join(f)).unwrap();
        let b = fs::read(theirs.join(f)).unwrap();
        assert!(a == b, "{tag}: {f} differs from the oracle");
    }
    let written: usize = report.passes.iter().map(|p| p.written.len()).sum();
    assert_eq!(written, files.len());
}

fn edge_spec() -> TinyModelSpec {
    TinyModelSpec {
        edge_rows: true,
        ..TinyModelSpec::default()
    }
}

#[test]
fn oracle_identical_f32_odd_width() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    // hidden 67: odd rows widths (I = 67) and a partial second g64 group everywhere.
    let spec = TinyModelSpec {
        hidden_size: 67,
        ..edge_spec()
    };
    generate_hf_checkpoint(&src, &spec, 1, SourceDtype::F32).unwrap();
    assert_matches_oracle(&src, dir.path(), &opts());
}

#[test]
fn oracle_identical_bf16_option_matrix() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    generate_hf_checkpoint(&src, &edge_spec(), 2, SourceDtype::Bf16).unwrap();
    assert_matches_oracle(&src, dir.path(), &opts());
    let per_row = ConvertOptions {
        group_size: 0,
        io_bits: Bits::Four,
        mtp_bits: Bits::Four,
        ..opts()
    };
    assert_matches_oracle(&src, dir.path(), &per_row);
    let odd_groups = ConvertOptions {
        group_size: 24,
        ebits: Bits::Four,
        mtp_bits: Bits::Four,
        io_bits: Bits::Eight,
        progress: false,
    };
    assert_matches_oracle(&src, dir.path(), &odd_groups);
    let all_int8 = ConvertOptions {
        ebits: Bits::Eight,
        ..opts()
    };
    assert_matches_oracle(&src, dir.path(), &all_int8);
}

#[test]
fn oracle_identical_f16() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    generate_hf_checkpoint(&src, &edge_spec(), 7, SourceDtype::F16).unwrap();
    assert_matches_oracle(&src, dir.path(), &opts());
}

#[test]
fn oracle_identical_fp8() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    generate_hf_checkpoint(&src, &edge_spec(), 3, SourceDtype::Fp8).unwrap();
    assert_matches_oracle(&src, dir.path(), &opts());
    let spec = TinyModelSpec {
        hidden_size: 67,
        intermediate_size: 300,
        ..edge_spec()
    };
    let src2 = dir.path().join("hf2");
    generate_hf_checkpoint(&src2, &spec, 4, SourceDtype::Fp8).unwrap();
    let work2 = dir.path().join("w2");
    assert_matches_oracle(&src2, &work2, &opts());
}

#[test]
fn converted_layout_follows_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    let out = dir.path().join("out");
    let spec = edge_spec();
    generate_hf_checkpoint(&src, &spec, 5, SourceDtype::F32).unwrap();
    convert_checkpoint(&src, &out, &opts()).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(
            fs::read(src.join(f)).unwrap(),
            fs::read(out.join(f)).unwrap()
        );
    }
    let bytes = fs::read(out.join("out-00000.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // int4 g64 q_a_proj [32, 64]: row 0 is the §8b tie row, row 1 zeros.
    let q = st
        .tensor("model.layers.0.self_attn.q_a_proj.weight")
        .unwrap();
    assert_eq!(q.dtype(), Dtype::U8);
    assert_eq!(q.shape(), [32 * 32]);
    assert_eq!(
        &q.data()[..8],
        [0x88, 0x6A, 0x6A, 0x4C, 0x4C, 0x2E, 0x2E, 0x1F]
    );
    assert!(q.data()[32..64].iter().all(|&b| b == 0x88));
    let qs = st
        .tensor("model.layers.0.self_attn.q_a_proj.weight.qs")
        .unwrap();
    assert_eq!((qs.dtype(), qs.shape()), (Dtype::F32, &[32][..]));
    assert_eq!(qs.data()[..4], 1.0f32.to_le_bytes());
    assert_eq!(qs.data()[4..8], 0x322B_CC77u32.to_le_bytes());
    // int8 per-row embedding: row 3 is the int8 tie row.
    let e = st.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(e.shape(), [spec.vocab_size * 64]);
    assert_eq!(
        &e.data()[3 * 64..3 * 64 + 8],
        [0x7F, 0x00, 0x02, 0xFE, 0x02, 0xFE, 0x7E, 0x82]
    );
    // F32 copies keep their shape; no indexer / MTP tensors in the main pass.
    let router = st.tensor("model.layers.1.mlp.gate.weight").unwrap();
    assert_eq!((router.dtype(), router.shape()), (Dtype::F32, &[8, 64][..]));
    assert!(st.names().iter().all(|n| !n.contains("indexer")));
    // The MTP shard holds the nextn layer, its indexer included, at int8 per-row.
    let bytes = fs::read(out.join("out-mtp-00000.safetensors")).unwrap();
    let mtp = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let wq = mtp
        .tensor("model.layers.4.self_attn.indexer.wq_b.weight")
        .unwrap();
    assert_eq!(wq.shape(), [8 * 16 * 32]);
    let kb = mtp
        .tensor("model.layers.4.self_attn.indexer.k_norm.bias")
        .unwrap();
    assert_eq!((kb.dtype(), kb.shape()), (Dtype::F32, &[16][..]));
    assert!(mtp.tensor("model.layers.4.eh_proj.weight.qs").is_ok());
    assert!(mtp.names().iter().all(|n| n.starts_with("model.layers.4.")));
    // Bookkeeping.
    let progress: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join(".out-mtp-progress.json")).unwrap()).unwrap();
    assert_eq!(progress["params"]["ebits"], 8);
    assert_eq!(progress["params"]["arch"], "glm");
    assert_eq!(
        progress["shards"]["model-00003-of-00003.safetensors"],
        "out-mtp-00000.safetensors"
    );
    assert_eq!(progress["shards"]["model-00001-of-00003.safetensors"], "");
    let params: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join(".out-params.json")).unwrap()).unwrap();
    assert_eq!(params["group_size"], 64);
    assert_eq!(params["n_layers"], 4);
    assert_eq!(params["bits_map"]["io"], 8);
    assert_eq!(params["bits_map"]["x"], 4);
}

#[test]
fn resume_redoes_only_missing_or_damaged_shards() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    let out = dir.path().join("out");
    generate_hf_checkpoint(&src, &TinyModelSpec::default(), 6, SourceDtype::Bf16).unwrap();
    let first = convert_checkpoint(&src, &out, &opts()).unwrap();
    assert!(first.passes.iter().all(|p| p.skipped.is_empty()));
    let original = fs::read(out.join("out-00001.safetensors")).unwrap();
    let idx0 = fs::read(out.join("out-idx-00000.safetensors")).unwrap();

    // Interrupted run: one output missing and its progress entry damaged; another
    // output truncated while its entry is intact.
    fs::remove_file(out.join("out-00001.safetensors")).unwrap();
    let ppath = out.join(".out-progress.json");
    let mut progress: serde_json::Value =
        serde_json::from_slice(&fs::read(&ppath).unwrap()).unwrap();
    progress["shards"]["model-00002-of-00003.safetensors"] = "".into();
    fs::write(&ppath, serde_json::to_vec(&progress).unwrap()).unwrap();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(out.join("out-idx-00000.safetensors"))
        .unwrap();
    f.set_len(100).unwrap();
    drop(f);

    let second = convert_checkpoint(&src, &out, &opts()).unwrap();
    let main = second.pass(Pass::Main).unwrap();
    assert_eq!(main.written, ["out-00001.safetensors"]);
    assert_eq!(main.skipped, ["out-00000.safetensors"]);
    let mtp = second.pass(Pass::Mtp).unwrap();
    assert!(mtp.written.is_empty());
    assert_eq!(mtp.skipped, ["out-mtp-00000.safetensors"]);
    let idx = second.pass(Pass::Indexer).unwrap();
    assert_eq!(idx.written, ["out-idx-00000.safetensors"]);
    assert_eq!(idx.skipped, ["out-idx-00001.safetensors"]);
    assert_eq!(
        fs::read(out.join("out-00001.safetensors")).unwrap(),
        original
    );
    assert_eq!(
        fs::read(out.join("out-idx-00000.safetensors")).unwrap(),
        idx0
    );
    let progress: serde_json::Value = serde_json::from_slice(&fs::read(&ppath).unwrap()).unwrap();
    assert_eq!(
        progress["shards"]["model-00002-of-00003.safetensors"],
        "out-00001.safetensors"
    );

    // Complete: a third run writes nothing.
    let third = convert_checkpoint(&src, &out, &opts()).unwrap();
    assert!(third.passes.iter().all(|p| p.written.is_empty()));
    assert_eq!(third.pass(Pass::Main).unwrap().tensors, main.tensors);

    // Other parameters over an existing conversion are refused before any write.
    let mtime = fs::metadata(out.join("out-00000.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    for other in [
        ConvertOptions {
            ebits: Bits::Eight,
            ..opts()
        },
        ConvertOptions {
            group_size: 32,
            ..opts()
        },
    ] {
        let err = convert_checkpoint(&src, &out, &other).unwrap_err();
        match err {
            ConvertError::ParamsMismatch { path, .. } => {
                assert!(path.ends_with(".out-progress.json"), "{path:?}")
            }
            e => panic!("expected ParamsMismatch, got {e}"),
        }
    }
    let err = convert_checkpoint(
        &src,
        &out,
        &ConvertOptions {
            mtp_bits: Bits::Four,
            ..opts()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, ConvertError::ParamsMismatch { path, .. } if path.ends_with(".out-mtp-progress.json")),
        "{err}"
    );
    assert_eq!(
        fs::metadata(out.join("out-00000.safetensors"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime
    );
}

/// Writes a one-shard checkpoint with the given tensors and a minimal config.
fn hand_checkpoint(dir: &Path, tensors: Vec<(TensorSpec, Vec<u8>)>, config: bool) {
    fs::create_dir_all(dir).unwrap();
    if config {
        fs::write(dir.join("config.json"), r#"{"num_hidden_layers": 1}"#).unwrap();
    }
    write_shard(&dir.join("model-00001-of-00001.safetensors"), tensors).unwrap();
}

fn t(name: &str, dtype: Dtype, shape: &[usize]) -> (TensorSpec, Vec<u8>) {
    let n: usize = shape.iter().product::<usize>() * dtype.bitsize() / 8;
    (TensorSpec::new(name, dtype, shape.to_vec()), vec![0x38; n])
}

#[test]
fn bad_inputs_give_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let w = "model.layers.0.mlp.gate_proj.weight";

    let src = dir.path().join("no_scale");
    hand_checkpoint(&src, vec![t(w, Dtype::F8_E4M3, &[4, 4])], true);
    match convert_checkpoint(&src, &out, &opts()).unwrap_err() {
        ConvertError::MissingScaleInv { tensor, path } => {
            assert_eq!(tensor, w);
            assert!(path.ends_with("model-00001-of-00001.safetensors"));
        }
        e => panic!("expected MissingScaleInv, got {e}"),
    }
    assert!(!out.join("out-00000.safetensors").exists());

    let src = dir.path().join("bad_scale");
    hand_checkpoint(
        &src,
        vec![
            t(w, Dtype::F8_E4M3, &[130, 4]),
            t(&format!("{w}_scale_inv"), Dtype::F32, &[1, 1]),
        ],
        true,
    );
    let err = convert_checkpoint(&src, &out, &opts()).unwrap_err();
    assert!(
        matches!(&err, ConvertError::BadShape { tensor, .. } if tensor == &format!("{w}_scale_inv")),
        "{err}"
    );

    let src = dir.path().join("int32");
    hand_checkpoint(&src, vec![t(w, Dtype::I32, &[2, 2])], true);
    match convert_checkpoint(&src, &out, &opts()).unwrap_err() {
        ConvertError::UnsupportedDtype { tensor, dtype, .. } => {
            assert_eq!(tensor, w);
            assert_eq!(dtype, "I32");
        }
        e => panic!("expected UnsupportedDtype, got {e}"),
    }

    let src = dir.path().join("no_config");
    hand_checkpoint(&src, vec![t(w, Dtype::F32, &[2, 2])], false);
    match convert_checkpoint(&src, &out, &opts()).unwrap_err() {
        ConvertError::MissingConfig { path } => assert!(path.ends_with("config.json")),
        e => panic!("expected MissingConfig, got {e}"),
    }

    let src = dir.path().join("garbage");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("config.json"), r#"{"num_hidden_layers": 1}"#).unwrap();
    fs::write(src.join("model.safetensors"), b"not a safetensors file").unwrap();
    let err = convert_checkpoint(&src, &out, &opts()).unwrap_err();
    assert!(
        matches!(&err, ConvertError::Source { path, .. } if path.ends_with("model.safetensors")),
        "{err}"
    );

    let src = dir.path().join("bad_config");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("config.json"), r#"{"hidden_size": 1}"#).unwrap();
    let err = convert_checkpoint(&src, &out, &opts()).unwrap_err();
    assert!(matches!(err, ConvertError::Config { .. }), "{err}");

    let src = dir.path().join("nan");
    let mut nan = t(w, Dtype::F32, &[1, 2]);
    nan.1 = [f32::NAN, 1.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    hand_checkpoint(&src, vec![nan], true);
    let err = convert_checkpoint(&src, &out, &opts()).unwrap_err();
    assert!(
        matches!(&err, ConvertError::NonFinite { tensor, .. } if tensor == w),
        "{err}"
    );
    assert!(Bits::try_from(5).is_err());
}

#[test]
fn tiny_checkpoints_load_in_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    for (dtype, name) in [
        (SourceDtype::F32, "f32"),
        (SourceDtype::Bf16, "bf16"),
        (SourceDtype::Fp8, "fp8"),
    ] {
        let path = dir.path().join(name);
        let ck = generate_hf_checkpoint(&path, &TinyModelSpec::default(), 9, dtype).unwrap();
        assert_eq!(ck.shards.len(), 3);
        python("check_tiny_loads.py", &[path.to_str().unwrap()]);
    }
}

#[test]
fn generator_is_deterministic_per_seed() {
    let dir = tempfile::tempdir().unwrap();
    let read_all = |p: &Path| -> Vec<Vec<u8>> {
        shard_files(p)
            .iter()
            .map(|f| fs::read(p.join(f)).unwrap())
            .collect()
    };
    let spec = TinyModelSpec::default();
    for (i, seed) in [1u64, 1, 2].iter().enumerate() {
        generate_hf_checkpoint(
            &dir.path().join(i.to_string()),
            &spec,
            *seed,
            SourceDtype::Fp8,
        )
        .unwrap();
    }
    let a = read_all(&dir.path().join("0"));
    assert_eq!(a, read_all(&dir.path().join("1")));
    assert_ne!(a, read_all(&dir.path().join("2")));
}

#[test]
fn writer_matches_python_save_file() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<(&str, Dtype, Vec<usize>)> = vec![
        ("b.weight.qs", Dtype::F32, vec![3]),
        ("b.weight", Dtype::U8, vec![17]),
        ("B.weight", Dtype::U8, vec![1]),
        ("a", Dtype::F32, vec![2, 3]),
        ("a.qs", Dtype::F32, vec![0]),
        ("experts.10.down_proj", Dtype::U8, vec![5]),
        ("experts.2.down_proj", Dtype::U8, vec![5]),
        ("half", Dtype::F16, vec![3]),
        ("signed", Dtype::I8, vec![7]),
        ("int", Dtype::I32, vec![1, 1]),
        ("wide", Dtype::F64, vec![2]),
        ("z\u{e9}", Dtype::F32, vec![1]),
    ];
    let json: Vec<serde_json::Value> = specs
        .iter()
        .enumerate()
        .map(|(i, (n, d, s))| serde_json::json!([n, format!("{d:?}"), s, i + 1]))
        .collect();
    let reference = dir.path().join("ref.safetensors");
    python(
        "save_file_reference.py",
        &[
            reference.to_str().unwrap(),
            &serde_json::to_string(&json).unwrap(),
        ],
    );
    let ours = dir.path().join("ours.safetensors");
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(i, (n, d, s))| {
            let len = s.iter().product::<usize>() * d.bitsize() / 8;
            (TensorSpec::new(*n, *d, s.clone()), vec![i as u8 + 1; len])
        })
        .collect();
    write_shard(&ours, tensors).unwrap();
    assert_eq!(fs::read(&ours).unwrap(), fs::read(&reference).unwrap());
}
