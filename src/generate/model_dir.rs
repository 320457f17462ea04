//! The cached tiny model used by the decode example and tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::{BoxError, GenerateError, Result};
use crate::convert::{ConvertOptions, convert_checkpoint};
use crate::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};

/// Name of the cached tiny model's directory; bump the suffix when its recipe changes.
pub const TINY_MODEL_DIR_NAME: &str = "tiny-model-v1";

/// Seed of the cached tiny model's random weights.
pub const TINY_MODEL_SEED: u64 = 0;

/// The cache root: `$GLM_STREAM_CACHE`, else `$HOME/.cache/glm-stream`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("GLM_STREAM_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("glm-stream")),
        None => Err(GenerateError::InvalidParams(
            "neither GLM_STREAM_CACHE nor HOME is set".into(),
        )),
    }
}

/// A converted tiny random model (default [`TinyModelSpec`], bf16, seed
/// [`TINY_MODEL_SEED`], default [`ConvertOptions`]) with its tokenizer files, built
/// once under [`cache_root`]`/`[`TINY_MODEL_DIR_NAME`] and reused afterwards.
pub fn default_model_dir() -> Result<PathBuf> {
    tiny_model_dir_in(&cache_root()?)
}

/// Like [`default_model_dir`] under `root`.
///
/// The model is built in a private temporary directory next to the target and renamed
/// into place, so a crash never leaves a half-written model and concurrent callers
/// (threads or processes) all end with the same complete directory.
pub fn tiny_model_dir_in(root: &Path) -> Result<PathBuf> {
    let target = root.join(TINY_MODEL_DIR_NAME);
    if target.join("tokenizer.json").is_file() {
        return Ok(target);
    }
    std::fs::create_dir_all(root).map_err(|source| GenerateError::Io {
        path: root.to_owned(),
        source,
    })?;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = root.join(format!(
        ".{TINY_MODEL_DIR_NAME}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let built = build(&tmp);
    let result = built.and_then(|out| match std::fs::rename(&out, &target) {
        Ok(()) => Ok(target.clone()),
        // Someone else finished first: theirs is complete, use it.
        Err(_) if target.join("tokenizer.json").is_file() => Ok(target.clone()),
        Err(source) => Err(GenerateError::Io {
            path: target.clone(),
            source,
        }),
    });
    // Best effort: the temporary directory holds nothing anyone needs.
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn build(tmp: &Path) -> Result<PathBuf> {
    let wrap = |source: BoxError| GenerateError::TinyModel {
        path: tmp.to_owned(),
        source,
    };
    let hf = tmp.join("hf");
    let out = tmp.join("model");
    generate_hf_checkpoint(
        &hf,
        &TinyModelSpec::default(),
        TINY_MODEL_SEED,
        SourceDtype::Bf16,
    )
    .map_err(|e| wrap(Box::new(e)))?;
    let opts = ConvertOptions {
        progress: false,
        ..ConvertOptions::default()
    };
    convert_checkpoint(&hf, &out, &opts).map_err(|e| wrap(Box::new(e)))?;
    Ok(out)
}
