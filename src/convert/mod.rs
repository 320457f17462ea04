//! Hugging Face checkpoint → Colibri container converter (`docs/colibri-format.md` §1,
//! §2, §4).
//!
//! [`convert_checkpoint`] reads every `*.safetensors` shard of an HF `glm_moe_dsa`
//! checkpoint (BF16, F16, F32, or FP8 e4m3 with 128×128 `weight_scale_inv` block
//! scales), and writes three passes, each output shard mirroring one source shard that
//! holds wanted tensors (local-mode numbering):
//!
//! | pass | files | contents |
//! |---|---|---|
//! | main | `out-NNNNN.safetensors` | layers `< num_hidden_layers`, embed, lm_head, final norm; no indexer / MTP-only tensors |
//! | MTP | `out-mtp-NNNNN.safetensors` | layers `>= num_hidden_layers` (the nextn layer), all at `--mtp-bits`, **including its own indexer** (colibri omits it) |
//! | indexer | `out-idx-NNNNN.safetensors` | `self_attn.indexer.*` of the main layers at int8 per-row |
//!
//! Router weights, router bias, every `*norm.weight`, every non-`.weight` tensor
//! (e.g. the indexer's `k_norm.bias`) and every non-2-D tensor are copied as F32;
//! `model.embed_tokens.weight` / `lm_head.weight` use the io bits, all other 2-D
//! weights the expert bits. Bookkeeping: `.out[-mtp|-idx]-params.json` and
//! `.out[-mtp|-idx]-progress.json`; a re-run resumes, skipping shards whose recorded
//! output exists with the expected size.

pub mod fp8;
mod source;
pub mod writer;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use thiserror::Error;

use crate::quant::encode::{EncodeError, QuantScheme, encode_rows_parallel};
use source::{SourceSet, SourceShard, SourceTensor};
use writer::{ShardLayout, ShardWriter, TensorSpec, WriteError};

/// Errors of the converter. Every variant names the file and, where relevant, the
/// tensor.
#[derive(Debug, Error)]
pub enum ConvertError {
    /// An I/O error on `path`.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The input directory has no `config.json`.
    #[error("missing config.json: {path}")]
    MissingConfig {
        /// The expected path.
        path: PathBuf,
    },
    /// `config.json` is not valid JSON or lacks a needed field.
    #[error("bad config {path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The input directory has no `*.safetensors` file.
    #[error("no *.safetensors shards in {dir}")]
    NoShards {
        /// The input directory.
        dir: PathBuf,
    },
    /// A source shard could not be parsed.
    #[error("bad safetensors file {path}: {message}")]
    Source {
        /// The shard.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The same tensor name appears in two source shards.
    #[error("tensor {tensor} appears in both {first} and {second}")]
    DuplicateTensor {
        /// Tensor name.
        tensor: String,
        /// First shard.
        first: PathBuf,
        /// Second shard.
        second: PathBuf,
    },
    /// A source tensor has a dtype the converter does not read.
    #[error("tensor {tensor} in {path}: unsupported source dtype {dtype}")]
    UnsupportedDtype {
        /// Tensor name.
        tensor: String,
        /// Its shard.
        path: PathBuf,
        /// The dtype.
        dtype: String,
    },
    /// An FP8 weight has no `<name>_scale_inv` companion in any shard.
    #[error("FP8 tensor {tensor} in {path} has no {tensor}_scale_inv")]
    MissingScaleInv {
        /// Tensor name.
        tensor: String,
        /// Its shard.
        path: PathBuf,
    },
    /// A tensor has a shape the converter cannot handle.
    #[error("tensor {tensor} in {path}: {message}")]
    BadShape {
        /// Tensor name.
        tensor: String,
        /// Its shard.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A source tensor holds NaN or infinity.
    #[error("tensor {tensor} in {path} holds a NaN or infinite value")]
    NonFinite {
        /// Tensor name.
        tensor: String,
        /// Its shard.
        path: PathBuf,
    },
    /// A quantizer rejected a tensor.
    #[error("tensor {tensor} in {path}: {source}")]
    Encode {
        /// Tensor name.
        tensor: String,
        /// Its shard.
        path: PathBuf,
        /// The quantizer error.
        source: EncodeError,
    },
    /// A progress or params file could not be parsed.
    #[error("bad bookkeeping file {path}: {message}")]
    Progress {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The output directory was started with other conversion parameters.
    #[error("{path} records parameters {recorded}, this run uses {requested}")]
    ParamsMismatch {
        /// The bookkeeping file.
        path: PathBuf,
        /// The parameters found there.
        recorded: String,
        /// This run's parameters.
        requested: String,
    },
    /// An option value is out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// Writing an output shard failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}

impl ConvertError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ConvertError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Quantization width of a tensor class: 4 (int4) or 8 (int8 per-row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// int4, per-row or grouped depending on the group size.
    Four,
    /// int8 per-row.
    Eight,
}

impl Bits {
    /// The number of bits.
    pub fn get(self) -> u8 {
        match self {
            Bits::Four => 4,
            Bits::Eight => 8,
        }
    }
}

impl TryFrom<u8> for Bits {
    type Error = ConvertError;
    fn try_from(v: u8) -> Result<Self, ConvertError> {
        match v {
            4 => Ok(Bits::Four),
            8 => Ok(Bits::Eight),
            other => Err(ConvertError::InvalidOption(format!(
                "bits must be 4 or 8, got {other}"
            ))),
        }
    }
}

/// Converter options (the defaults are colibri's: int4 g64 experts, int8 io, int8 MTP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertOptions {
    /// int4 group size; 0 = per-row int4. Default 64.
    pub group_size: usize,
    /// Bits of `model.embed_tokens.weight` and `lm_head.weight`. Default 8.
    pub io_bits: Bits,
    /// Bits of every other quantized weight of the main pass. Default 4.
    pub ebits: Bits,
    /// Bits of every quantized weight of the MTP layer. Default 8.
    pub mtp_bits: Bits,
    /// Draw a progress bar on stderr (only when it is a terminal).
    pub progress: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self {
            group_size: 64,
            io_bits: Bits::Eight,
            ebits: Bits::Four,
            mtp_bits: Bits::Eight,
            progress: true,
        }
    }
}

/// One of the converter's three passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Main layers, embed, lm_head, final norm → `out-NNNNN.safetensors`.
    Main,
    /// The nextn (MTP) layer → `out-mtp-NNNNN.safetensors`.
    Mtp,
    /// The main layers' DSA indexers → `out-idx-NNNNN.safetensors`.
    Indexer,
}

impl Pass {
    /// All passes in the order they run.
    pub const ALL: [Pass; 3] = [Pass::Main, Pass::Mtp, Pass::Indexer];

    fn tag(self) -> &'static str {
        match self {
            Pass::Main => "",
            Pass::Mtp => "mtp-",
            Pass::Indexer => "idx-",
        }
    }

    /// Output shard name for index `k`.
    pub fn shard_name(self, k: usize) -> String {
        format!("out-{}{k:05}.safetensors", self.tag())
    }

    /// Name of this pass's progress file.
    pub fn progress_file(self) -> String {
        format!(".out-{}progress.json", self.tag())
    }

    /// Name of this pass's params file.
    pub fn params_file(self) -> String {
        format!(".out-{}params.json", self.tag())
    }
}

/// What happened in one pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassReport {
    /// The pass.
    pub pass: Pass,
    /// Output shards written by this run.
    pub written: Vec<String>,
    /// Output shards found complete from an earlier run and left alone.
    pub skipped: Vec<String>,
    /// Source tensors converted or found converted (excluding `_scale_inv`).
    pub tensors: usize,
    /// Bytes of the shards written by this run.
    pub bytes_written: u64,
}

/// What [`convert_checkpoint`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertReport {
    /// One entry per pass, in [`Pass::ALL`] order.
    pub passes: Vec<PassReport>,
}

impl ConvertReport {
    /// The report of `pass`.
    pub fn pass(&self, pass: Pass) -> Option<&PassReport> {
        self.passes.iter().find(|p| p.pass == pass)
    }
}

/// Layer index of `model.layers.<L>.…` names.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Substrings that keep a tensor out of the main pass (§4).
const MAIN_SKIP: [&str; 5] = ["indexer", "eh_proj", "enorm", "hnorm", "shared_head"];

fn wanted(pass: Pass, name: &str, n_layers: usize) -> bool {
    if name.ends_with("_scale_inv") {
        return false;
    }
    let layer = layer_of(name);
    match pass {
        Pass::Main => {
            layer.is_none_or(|l| l < n_layers) && !MAIN_SKIP.iter().any(|s| name.contains(s))
        }
        Pass::Mtp => layer.is_some_and(|l| l >= n_layers),
        Pass::Indexer => {
            layer.is_some_and(|l| l < n_layers) && name.contains(".self_attn.indexer.")
        }
    }
}

/// How one source tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Treatment {
    F32,
    Quant(QuantScheme),
}

fn is_f32_kind(name: &str) -> bool {
    name.contains("e_score_correction_bias")
        || name.ends_with("mlp.gate.weight")
        || name.ends_with("norm.weight")
        || !name.ends_with(".weight")
}

fn is_io(name: &str) -> bool {
    name == "model.embed_tokens.weight" || name == "lm_head.weight"
}

fn bits_for(pass: Pass, name: &str, opts: &ConvertOptions) -> Bits {
    match pass {
        Pass::Main if is_io(name) => opts.io_bits,
        Pass::Main => opts.ebits,
        Pass::Mtp => opts.mtp_bits,
        Pass::Indexer => Bits::Eight,
    }
}

fn classify(pass: Pass, name: &str, shape: &[usize], opts: &ConvertOptions) -> Treatment {
    if is_f32_kind(name) || shape.len() != 2 {
        return Treatment::F32;
    }
    Treatment::Quant(QuantScheme::for_bits(
        bits_for(pass, name, opts).get(),
        opts.group_size,
    ))
}

/// The params object recorded for `pass` (`.out*-params.json`, `params` of progress).
fn pass_params(pass: Pass, opts: &ConvertOptions, n_layers: usize) -> Value {
    let (e, io) = match pass {
        Pass::Main => (opts.ebits.get(), opts.io_bits.get()),
        Pass::Mtp => (opts.mtp_bits.get(), opts.mtp_bits.get()),
        Pass::Indexer => (8, 8),
    };
    json!({
        "ebits": e,
        "io_bits": io,
        "xbits": e,
        "group_size": opts.group_size,
        "n_layers": n_layers,
        "bits_map": {
            "io": io, "x": e, "sh": e, "o": e, "kvb": e, "attn": e, "dmlp": e, "q": e
        },
        "proj_bits": {"gate": e, "up": e, "down": e},
        "arch": "glm",
    })
}

/// The `.out*-progress.json` document.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Progress {
    shards: BTreeMap<String, String>,
    #[serde(default)]
    params: Value,
}

/// One source tensor in an output shard plan.
struct PlannedTensor {
    name: String,
    treatment: Treatment,
}

/// One output shard to produce (or to find already produced).
struct ShardPlan {
    source: usize,
    output: String,
    tensors: Vec<PlannedTensor>,
    layout: ShardLayout,
}

struct PassPlan {
    pass: Pass,
    params: Value,
    /// Source basename → output name or "" (for the progress file).
    entries: Vec<(String, String)>,
    shards: Vec<ShardPlan>,
}

fn plan_pass(
    pass: Pass,
    set: &SourceSet,
    opts: &ConvertOptions,
    n_layers: usize,
) -> Result<PassPlan, ConvertError> {
    let mut entries = Vec::new();
    let mut shards = Vec::new();
    for (si, shard) in set.shards.iter().enumerate() {
        let names: Vec<String> = shard
            .names()
            .into_iter()
            .filter(|n| wanted(pass, n, n_layers))
            .collect();
        if names.is_empty() {
            entries.push((shard.basename.clone(), String::new()));
            continue;
        }
        let output = pass.shard_name(shards.len());
        let mut specs = Vec::new();
        let mut tensors = Vec::new();
        for name in names {
            // Resolving validates dtype, FP8 scales and shapes before anything is written.
            let src = SourceTensor::resolve(set, shard, &name)?;
            let shape = shard
                .info(&name)
                .map(|i| i.shape.clone())
                .unwrap_or_default();
            let treatment = classify(pass, &name, &shape, opts);
            match treatment {
                Treatment::F32 => specs.push(TensorSpec::new(name.clone(), Dtype::F32, shape)),
                Treatment::Quant(scheme) => {
                    if src.cols == 0 {
                        return Err(ConvertError::BadShape {
                            tensor: name,
                            path: shard.path.clone(),
                            message: format!("cannot quantize shape {shape:?}"),
                        });
                    }
                    let (r, c) = (src.rows, src.cols);
                    specs.push(TensorSpec::new(
                        name.clone(),
                        Dtype::U8,
                        vec![scheme.weight_bytes(r, c)],
                    ));
                    specs.push(TensorSpec::new(
                        format!("{name}.qs"),
                        Dtype::F32,
                        vec![scheme.scale_count(r, c)],
                    ));
                }
            }
            tensors.push(PlannedTensor { name, treatment });
        }
        entries.push((shard.basename.clone(), output.clone()));
        shards.push(ShardPlan {
            source: si,
            output,
            tensors,
            layout: ShardLayout::new(specs)?,
        });
    }
    Ok(PassPlan {
        pass,
        params: pass_params(pass, opts, n_layers),
        entries,
        shards,
    })
}

/// Reads `num_hidden_layers` from `config.json`.
fn read_n_layers(config: &Path) -> Result<usize, ConvertError> {
    if !config.is_file() {
        return Err(ConvertError::MissingConfig {
            path: config.to_path_buf(),
        });
    }
    let text = fs::read_to_string(config).map_err(|e| ConvertError::io(config, e))?;
    let bad = |message: String| ConvertError::Config {
        path: config.to_path_buf(),
        message,
    };
    let value: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    value
        .get("num_hidden_layers")
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad("num_hidden_layers missing or not a non-negative integer".into()))
}

/// Files copied verbatim from the source (config.json is required).
const COPIED_FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<(), ConvertError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ConvertError::Progress {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let tmp = writer::tmp_path_for(path);
    fs::write(&tmp, text).map_err(|e| ConvertError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| ConvertError::io(path, e))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, ConvertError> {
    match fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ConvertError::Progress {
                path: path.to_path_buf(),
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ConvertError::io(path, e)),
    }
}

fn check_params(path: &Path, recorded: &Value, requested: &Value) -> Result<(), ConvertError> {
    if recorded != requested {
        return Err(ConvertError::ParamsMismatch {
            path: path.to_path_buf(),
            recorded: recorded.to_string(),
            requested: requested.to_string(),
        });
    }
    Ok(())
}

/// Row-chunk size for decoding and quantizing, in elements (16 MiB of `f32`).
const CHUNK_ELEMS: usize = 1 << 22;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Converts and writes one output shard.
fn write_shard(
    set: &SourceSet,
    shard: &SourceShard,
    plan: &ShardPlan,
    out_dir: &Path,
    bar: &ProgressBar,
) -> Result<u64, ConvertError> {
    let path = out_dir.join(&plan.output);
    let mut w = ShardWriter::create(&path, plan.layout.clone())?;
    let mut buf = Vec::new();
    let mut weights = Vec::new();
    let mut scales = Vec::new();
    for t in &plan.tensors {
        let src = SourceTensor::resolve(set, shard, &t.name)?;
        let rows_per_chunk = (CHUNK_ELEMS / src.cols.max(1)).max(1);
        let qs_name = format!("{}.qs", t.name);
        let mut r0 = 0;
        while r0 < src.rows {
            let r1 = (r0 + rows_per_chunk).min(src.rows);
            src.decode_rows(r0, r1, &mut buf)?;
            match t.treatment {
                Treatment::F32 => w.write(&t.name, &f32_bytes(&buf))?,
                Treatment::Quant(scheme) => {
                    weights.clear();
                    scales.clear();
                    encode_rows_parallel(scheme, &buf, src.cols, &mut weights, &mut scales)
                        .map_err(|source| ConvertError::Encode {
                            tensor: t.name.clone(),
                            path: shard.path.clone(),
                            source,
                        })?;
                    w.write(&t.name, &weights)?;
                    w.write(&qs_name, &f32_bytes(&scales))?;
                }
            }
            r0 = r1;
        }
        bar.inc(1);
    }
    let size = plan.layout.file_size();
    w.finish()?;
    Ok(size)
}

fn run_pass(
    plan: &PassPlan,
    set: &SourceSet,
    out_dir: &Path,
    bar: &ProgressBar,
) -> Result<PassReport, ConvertError> {
    let progress_path = out_dir.join(plan.pass.progress_file());
    let params_path = out_dir.join(plan.pass.params_file());
    // Params were checked against both files by `convert_checkpoint`.
    let mut progress: Progress = read_json(&progress_path)?.unwrap_or_default();
    write_json_atomic(&params_path, &plan.params)?;
    progress.params = plan.params.clone();
    for (source, output) in &plan.entries {
        if output.is_empty() {
            progress.shards.insert(source.clone(), String::new());
        }
    }

    let mut report = PassReport {
        pass: plan.pass,
        written: Vec::new(),
        skipped: Vec::new(),
        tensors: 0,
        bytes_written: 0,
    };
    for sp in &plan.shards {
        let shard = &set.shards[sp.source];
        report.tensors += sp.tensors.len();
        let out_path = out_dir.join(&sp.output);
        let done = progress.shards.get(&shard.basename) == Some(&sp.output)
            && fs::metadata(&out_path).is_ok_and(|m| m.len() == sp.layout.file_size());
        if done {
            tracing::info!(output = %sp.output, source = %shard.basename, "already converted, skipping");
            bar.inc(sp.tensors.len() as u64);
            report.skipped.push(sp.output.clone());
            continue;
        }
        tracing::info!(output = %sp.output, source = %shard.basename, tensors = sp.tensors.len(), "converting");
        bar.set_message(sp.output.clone());
        report.bytes_written += write_shard(set, shard, sp, out_dir, bar)?;
        report.written.push(sp.output.clone());
        progress
            .shards
            .insert(shard.basename.clone(), sp.output.clone());
        write_json_atomic(&progress_path, &progress)?;
    }
    // Record the pass even when no shard had to be (re)written.
    write_json_atomic(&progress_path, &progress)?;
    Ok(report)
}

/// Converts the HF checkpoint in `input` into a Colibri container in `output`.
///
/// Everything is validated (config, dtypes, FP8 scales, shapes, bookkeeping params)
/// before the first shard is written. Re-running over a partly converted `output` with
/// the same options skips the shards that are complete; different options are an error.
pub fn convert_checkpoint(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
) -> Result<ConvertReport, ConvertError> {
    let n_layers = read_n_layers(&input.join("config.json"))?;
    let set = SourceSet::open(input)?;
    let plans = Pass::ALL
        .iter()
        .map(|&pass| plan_pass(pass, &set, opts, n_layers))
        .collect::<Result<Vec<_>, _>>()?;
    fs::create_dir_all(output).map_err(|e| ConvertError::io(output, e))?;
    for plan in &plans {
        // Fail on a params mismatch (or unreadable bookkeeping) before touching anything.
        let progress_path = output.join(plan.pass.progress_file());
        if let Some(p) = read_json::<Progress>(&progress_path)? {
            check_params(&progress_path, &p.params, &plan.params)?;
        }
        let params_path = output.join(plan.pass.params_file());
        if let Some(recorded) = read_json::<Value>(&params_path)? {
            check_params(&params_path, &recorded, &plan.params)?;
        }
    }
    for name in COPIED_FILES {
        let from = input.join(name);
        if from.is_file() {
            let to = output.join(name);
            fs::copy(&from, &to).map_err(|e| ConvertError::io(&to, e))?;
        }
    }

    let total: usize = plans
        .iter()
        .flat_map(|p| &p.shards)
        .map(|s| s.tensors.len())
        .sum();
    let bar = if opts.progress {
        ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {pos}/{len} tensors {elapsed_precise} {msg}")
    {
        bar.set_style(style);
    }
    tracing::info!(input = %input.display(), output = %output.display(), n_layers, "converting checkpoint");
    let mut passes = Vec::with_capacity(plans.len());
    for plan in &plans {
        passes.push(run_pass(plan, &set, output, &bar)?);
    }
    bar.finish_and_clear();
    Ok(ConvertReport { passes })
}
