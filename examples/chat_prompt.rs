//! Renders a prompt with a model directory's chat template and prints its token ids.
//!
//! `cargo run --release --example chat_prompt -- [--model DIR] [--raw] PROMPT`
//!
//! Without `--model` it uses the cached tiny model (`generate::default_model_dir`,
//! built on first use under `$GLM_STREAM_CACHE` or `~/.cache/glm-stream`).

use std::path::PathBuf;
use std::process::ExitCode;

use glm_stream::generate::{GenerateError, Tokenizer, default_model_dir};

const USAGE: &str = "usage: chat_prompt [--model DIR] [--raw] PROMPT";

fn run(model: Option<PathBuf>, raw: bool, prompt: &str) -> Result<(), GenerateError> {
    let dir = match model {
        Some(dir) => dir,
        None => default_model_dir()?,
    };
    let tokenizer = Tokenizer::from_model_dir(&dir)?;
    let ids = tokenizer.encode_prompt(prompt, raw)?;
    println!("model: {}", dir.display());
    println!("text: {:?}", tokenizer.decode(&ids, false)?);
    println!("ids ({}): {ids:?}", ids.len());
    Ok(())
}

fn main() -> ExitCode {
    let mut model = None;
    let mut raw = false;
    let mut prompt = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--model" => match args.next() {
                Some(dir) => model = Some(PathBuf::from(dir)),
                None => {
                    eprintln!("{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "--raw" => raw = true,
            _ if prompt.is_none() && !arg.starts_with("--") => prompt = Some(arg),
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(prompt) = prompt else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match run(model, raw, &prompt) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chat_prompt: {e}");
            ExitCode::FAILURE
        }
    }
}
