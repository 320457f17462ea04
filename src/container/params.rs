//! The converter's optional bookkeeping files (§1.4): `.out-params.json` or the
//! `params` object of `.out-progress.json`, one pair per converter pass (main,
//! `-mtp`, `-idx`). They are the only place the quantization group size is written
//! down, so they break the §3.3 ties (e.g. gs 48 vs 64 for `I` in 65–96).

use std::path::{Path, PathBuf};

use super::config::{read_text, split_layer};
use super::error::{ContainerError, Result};

/// Parameters recorded by one converter pass.
#[derive(Debug, Clone, PartialEq)]
pub struct PassParams {
    /// File the parameters came from.
    pub source: PathBuf,
    /// `group_size` (`None` when absent or 0, i.e. per-row).
    pub group_size: Option<u32>,
    /// `ebits` (bits of ordinary weights).
    pub ebits: Option<u64>,
    /// `io_bits` (embedding / head).
    pub io_bits: Option<u64>,
    /// The whole JSON object, for anything else.
    pub raw: serde_json::Value,
}

/// Which converter pass wrote a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Layers `0..num_hidden_layers`, embedding, head, final norm.
    Main,
    /// The MTP layer (`--mtp`).
    Mtp,
    /// The DSA indexer tensors (`--indexer`).
    Indexer,
}

impl Pass {
    fn stem(self) -> &'static str {
        match self {
            Self::Main => ".out",
            Self::Mtp => ".out-mtp",
            Self::Indexer => ".out-idx",
        }
    }

    /// The pass that writes `name`: MTP layers (`>= num_hidden_layers`) come from
    /// `--mtp`, other `self_attn.indexer.` tensors from `--indexer`, the rest from
    /// the main pass.
    pub fn of_tensor(name: &str, num_hidden_layers: usize) -> Self {
        match split_layer(name) {
            Some((layer, _)) if layer >= num_hidden_layers => Self::Mtp,
            Some((_, rest)) if rest.starts_with("self_attn.indexer.") => Self::Indexer,
            _ => Self::Main,
        }
    }
}

/// Parameters of every pass found in the model directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ColibriParams {
    /// Main pass.
    pub main: Option<PassParams>,
    /// `--mtp` pass.
    pub mtp: Option<PassParams>,
    /// `--indexer` pass.
    pub indexer: Option<PassParams>,
}

impl ColibriParams {
    /// Reads `<stem>-params.json`, else the `params` of `<stem>-progress.json`, for
    /// each pass. Absent files are fine; unreadable or malformed ones are errors.
    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Self {
            main: load_pass(dir, Pass::Main)?,
            mtp: load_pass(dir, Pass::Mtp)?,
            indexer: load_pass(dir, Pass::Indexer)?,
        })
    }

    /// The parameters of `pass`, if recorded.
    pub fn pass(&self, pass: Pass) -> Option<&PassParams> {
        match pass {
            Pass::Main => self.main.as_ref(),
            Pass::Mtp => self.mtp.as_ref(),
            Pass::Indexer => self.indexer.as_ref(),
        }
    }

    /// The group-size hint for tensor `name`.
    pub fn group_size_hint(&self, name: &str, num_hidden_layers: usize) -> Option<u32> {
        self.pass(Pass::of_tensor(name, num_hidden_layers))
            .and_then(|p| p.group_size)
    }
}

fn load_pass(dir: &Path, pass: Pass) -> Result<Option<PassParams>> {
    let params_path = dir.join(format!("{}-params.json", pass.stem()));
    if params_path.is_file() {
        let value = read_json(&params_path)?;
        return parse_params(&params_path, value).map(Some);
    }
    let progress_path = dir.join(format!("{}-progress.json", pass.stem()));
    if progress_path.is_file() {
        let value = read_json(&progress_path)?;
        return match value.get("params") {
            Some(p) if !p.is_null() => parse_params(&progress_path, p.clone()).map(Some),
            _ => Ok(None),
        };
    }
    Ok(None)
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|source| ContainerError::InvalidJson {
        path: path.to_owned(),
        source,
    })
}

fn parse_params(path: &Path, raw: serde_json::Value) -> Result<PassParams> {
    if !raw.is_object() {
        return Err(ContainerError::InvalidConfig {
            path: path.to_owned(),
            reason: "converter params are not a JSON object".into(),
        });
    }
    let group_size = match raw.get("group_size") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => {
            let gs = v
                .as_u64()
                .and_then(|g| u32::try_from(g).ok())
                .ok_or_else(|| ContainerError::InvalidConfig {
                    path: path.to_owned(),
                    reason: format!("group_size {v} is not a non-negative integer"),
                })?;
            (gs > 0).then_some(gs)
        }
    };
    Ok(PassParams {
        source: path.to_owned(),
        group_size,
        ebits: raw.get("ebits").and_then(serde_json::Value::as_u64),
        io_bits: raw.get("io_bits").and_then(serde_json::Value::as_u64),
        raw,
    })
}
