//! Writes a tiny random `glm_moe_dsa` checkpoint in the Hugging Face layout.
//!
//! `cargo run --release --example make_tiny -- --output DIR --seed N [--dtype bf16|f16|f32|fp8] [--edge-rows]`

use std::path::PathBuf;
use std::process::ExitCode;

use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};

fn usage() -> ExitCode {
    eprintln!("usage: make_tiny --output DIR --seed N [--dtype bf16|f16|f32|fp8] [--edge-rows]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut output: Option<PathBuf> = None;
    let mut seed = 0u64;
    let mut dtype = SourceDtype::Bf16;
    let mut spec = TinyModelSpec::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--output" => output = args.next().map(PathBuf::from),
            "--seed" => match args.next().and_then(|s| s.parse().ok()) {
                Some(s) => seed = s,
                None => return usage(),
            },
            "--dtype" => {
                dtype = match args.next().as_deref() {
                    Some("bf16") => SourceDtype::Bf16,
                    Some("f32") => SourceDtype::F32,
                    Some("f16") => SourceDtype::F16,
                    Some("fp8") => SourceDtype::Fp8,
                    _ => return usage(),
                }
            }
            "--edge-rows" => spec.edge_rows = true,
            _ => return usage(),
        }
    }
    let Some(output) = output else {
        return usage();
    };
    match generate_hf_checkpoint(&output, &spec, seed, dtype) {
        Ok(ck) => {
            println!(
                "wrote {} tensors in {} shards to {}",
                ck.tensors,
                ck.shards.len(),
                output.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("make_tiny: {e}");
            ExitCode::FAILURE
        }
    }
}
