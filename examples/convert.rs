//! Converts a Hugging Face `glm_moe_dsa` checkpoint into a Colibri container.
//!
//! `cargo run --release --example convert -- --input HF_DIR --output OUT_DIR
//!  [--group-size N (0 = per-row int4, default 64)] [--io-bits 4|8 (default 8)]
//!  [--ebits 4|8 (default 4)] [--mtp-bits 4|8 (default 8)]`
//!
//! Logs go to stderr through `tracing` (set `RUST_LOG`-style filtering in your own
//! subscriber; this example prints the final report).

use std::path::PathBuf;
use std::process::ExitCode;

use glm_stream::convert::{Bits, ConvertOptions, convert_checkpoint};

const USAGE: &str = "usage: convert --input HF_DIR --output OUT_DIR [--group-size N] \
                     [--io-bits 4|8] [--ebits 4|8] [--mtp-bits 4|8]";

fn parse() -> Result<(PathBuf, PathBuf, ConvertOptions), String> {
    let mut input = None;
    let mut output = None;
    let mut opts = ConvertOptions::default();
    let mut args = std::env::args().skip(1);
    let bits = |v: Option<String>| -> Result<Bits, String> {
        let n: u8 = v
            .ok_or("missing value")?
            .parse()
            .map_err(|e| format!("{e}"))?;
        Bits::try_from(n).map_err(|e| e.to_string())
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--input" => input = args.next().map(PathBuf::from),
            "--output" => output = args.next().map(PathBuf::from),
            "--group-size" => {
                opts.group_size = args
                    .next()
                    .ok_or("missing value")?
                    .parse()
                    .map_err(|e| format!("--group-size: {e}"))?
            }
            "--io-bits" => opts.io_bits = bits(args.next())?,
            "--ebits" => opts.ebits = bits(args.next())?,
            "--mtp-bits" => opts.mtp_bits = bits(args.next())?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    match (input, output) {
        (Some(i), Some(o)) => Ok((i, o, opts)),
        _ => Err("--input and --output are required".into()),
    }
}

fn main() -> ExitCode {
    let (input, output, opts) = match parse() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("convert: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match convert_checkpoint(&input, &output, &opts) {
        Ok(report) => {
            for p in &report.passes {
                println!(
                    "{:?}: {} tensors, {} shards written, {} skipped, {} bytes",
                    p.pass,
                    p.tensors,
                    p.written.len(),
                    p.skipped.len(),
                    p.bytes_written
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("convert: {e}");
            ExitCode::FAILURE
        }
    }
}
