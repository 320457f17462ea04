//! The decode example end to end: `--dump-logits` rows against mlx-lm on the
//! same container and ids (greedy, prefill + 8 decode steps, KV cache in use),
//! the summary line, and input errors that exit non-zero before any MLX work.
//!
//! The example binary is built by `cargo test` (examples are compiled with the
//! test targets); this test fails, not skips, when it is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::tiny_model::{build, oracle, prompt, read_npy_f32, row_rel_error};
use glm_stream::convert::ConvertOptions;
use glm_stream::tiny::TinyModelSpec;

fn decode_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/examples/decode
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|p| {
            p.join("examples")
                .join(format!("decode{}", std::env::consts::EXE_SUFFIX))
        })
        .expect("target layout");
    assert!(
        bin.is_file(),
        "{} is missing: run through `cargo test`, which builds the examples",
        bin.display()
    );
    bin
}

fn run(args: &[&str]) -> Output {
    Command::new(decode_binary())
        .args(args)
        .output()
        .expect("run the decode example")
}

#[test]
fn dumped_logits_match_mlx_lm() {
    let spec = TinyModelSpec::default();
    let f = build(
        &spec,
        101,
        &ConvertOptions {
            group_size: 0,
            ..ConvertOptions::default()
        },
        |_| {},
    );
    let ids = prompt(spec.index_topk + 4, spec.vocab_size, 3);
    let steps = 9;
    let reference = oracle(&f.model, &ids, steps);
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    let id_list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let model = f.model.to_string_lossy().into_owned();
    let out = run(&[
        "--model",
        &model,
        "--prompt-ids",
        &id_list.join(","),
        "--max-tokens",
        &steps.to_string(),
        "--dump-logits",
        npy.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let summary = stderr
        .lines()
        .find(|l| l.starts_with("summary "))
        .expect("summary line");
    for key in [
        "prompt_tokens=",
        "prefill_tok_s=",
        "decode_tok_s=",
        "hit_rate=",
        "disk_gb_per_token=",
        "peak_rss_gb=",
    ] {
        assert!(summary.contains(key), "{summary}");
    }
    assert!(summary.contains(&format!("prompt_tokens={}", ids.len())));

    let (shape, data) = read_npy_f32(&npy);
    let generated = reference
        .tokens
        .iter()
        .position(|t| f_is_stop(&f.model, *t))
        .map_or(steps, |p| p + 1);
    assert_eq!(shape, vec![ids.len() + generated - 1, spec.vocab_size]);
    for (i, want) in reference.rows.iter().take(shape[0]).enumerate() {
        let got = &data[i * spec.vocab_size..(i + 1) * spec.vocab_size];
        let rel = row_rel_error(got, want);
        assert!(rel <= 1e-4, "row {i}: max|Δ|/max|ref| = {rel:e}");
    }
}

/// Whether `id` is one of the model's stop ids (config + generation_config).
fn f_is_stop(model: &Path, id: u32) -> bool {
    glm_stream::container::ColibriContainer::open(model)
        .unwrap()
        .eos_token_ids()
        .contains(&id)
}

#[test]
fn bad_input_exits_with_a_message() {
    let spec = TinyModelSpec::default();
    let f = build(&spec, 7, &ConvertOptions::default(), |_| {});
    let model = f.model.to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 4] = [
        (&["--prompt-ids", "1,99999"], "outside the vocabulary"),
        (&["--prompt", "", "--raw"], "empty"),
        (
            &["--prompt-ids", "1,2", "--max-tokens", "100000"],
            "max_position_embeddings",
        ),
        (&["--temperature", "-1"], "temperature"),
    ];
    for (args, needle) in cases {
        let mut all = vec!["--model", model.as_str()];
        all.extend_from_slice(args);
        let out = run(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn mtp_flag_keeps_the_greedy_output_and_reports_acceptance() {
    let spec = TinyModelSpec::default();
    let f = build(&spec, 101, &ConvertOptions::default(), |_| {});
    let ids = prompt(spec.index_topk + 4, spec.vocab_size, 5);
    let id_list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let model = f.model.to_string_lossy().into_owned();
    let base = [
        "--model",
        &model,
        "--prompt-ids",
        &id_list,
        "--max-tokens",
        "12",
    ];
    let plain = run(&base);
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    for extra in [&["--mtp"][..], &["--mtp=3", "--mtp-fixed"][..]] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(out.stdout, plain.stdout, "{extra:?} changed the output");
        let summary = stderr
            .lines()
            .find(|l| l.starts_with("summary "))
            .expect("summary line");
        for key in ["acceptance_rate=", "tokens_per_forward=", "drafted="] {
            assert!(summary.contains(key), "{summary}");
        }
    }
    let bad = run(&["--mtp=0"]);
    assert!(!bad.status.success());
    let bad = run(&["--mtp-fixed"]);
    assert!(!bad.status.success());
}
