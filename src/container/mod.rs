//! Reader for the Colibri GLM-5.x container (`out-*.safetensors`).
//!
//! [`ColibriContainer::open`] reads `config.json` (required),
//! `generation_config.json` and the converter params (optional), scans every
//! `*.safetensors` shard header with positioned reads (no mmap, nothing but headers
//! is read at open) and builds the name → byte-range [`Catalog`].
//!
//! **Formats are resolved eagerly at open**: every logical weight gets its
//! [`WeightInfo`] (entry, `.qs` entry, resolved [`QuantFormat`] or float dtype)
//! before `open` returns. Resolution is pure arithmetic on header data, a few
//! hundred nanoseconds per tensor, and doing it up front means a bad or
//! unsupported container fails at open with the tensor and file named, instead of
//! in the middle of a generation when an expert is first streamed in.
//!
//! Tensor bytes are read on demand with `pread` ([`FileExt::read_exact_at`]);
//! [`ColibriContainer`] is `Sync`, so several threads may read concurrently.

#![forbid(unsafe_code)]

pub mod catalog;
pub mod config;
pub mod error;
pub mod header;
pub mod params;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

pub use catalog::{Catalog, SCALES_SUFFIX, Shard, TensorEntry, TensorFamily};
pub use config::{ExpertProj, GenerationConfig, Glm52Config, routed_expert_coords};
pub use error::{ContainerError, Result};
pub use params::{ColibriParams, Pass, PassParams};

use crate::quant::{
    FormatQuery, QuantFormat, ResolvedFormat, decode_row, decode_rows, resolve_format,
    scales_from_le_bytes,
};

/// How a logical weight is stored.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightFormat {
    /// A `U8`/`I8` blob with an F32 `.qs` companion, in a resolved format.
    Quantized(ResolvedFormat),
    /// An unquantized F32 / BF16 / F16 tensor in its stored shape.
    Float {
        /// Stored dtype.
        dtype: Dtype,
        /// Stored shape.
        shape: Vec<u64>,
    },
}

/// One logical weight: its bytes, its scales and its format.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightInfo {
    /// Tensor name.
    pub name: String,
    /// Family by name.
    pub family: TensorFamily,
    /// The weight tensor.
    pub entry: TensorEntry,
    /// The `.qs` companion of a quantized weight.
    pub scales: Option<TensorEntry>,
    /// Resolved format.
    pub format: WeightFormat,
}

impl WeightInfo {
    /// The quantization descriptor, for quantized weights.
    pub fn quant_format(&self) -> Option<&QuantFormat> {
        match &self.format {
            WeightFormat::Quantized(r) => Some(&r.format),
            WeightFormat::Float { .. } => None,
        }
    }

    /// Weight plus scale bytes on disk.
    pub fn stored_bytes(&self) -> u64 {
        self.entry.len + self.scales.as_ref().map_or(0, |s| s.len)
    }

    /// A short format label: `int8-row`, `int4-row`, `int4-g64`, `F32`, ...
    pub fn format_label(&self) -> String {
        match &self.format {
            WeightFormat::Quantized(r) => match r.format.group_size {
                Some(gs) => format!("int4-g{gs}"),
                None => r.format.name().to_owned(),
            },
            WeightFormat::Float { dtype, .. } => format!("{dtype:?}"),
        }
    }

    /// `[rows, cols]` as returned by [`ColibriContainer::dequantize`]: the logical
    /// `[O, I]` of a quantized weight; for floats the stored 2-D shape, `[1, n]` for
    /// 1-D and `[1, 1]` for scalars. `None` for floats of rank > 2.
    pub fn matrix_shape(&self) -> Option<[usize; 2]> {
        match &self.format {
            WeightFormat::Quantized(r) => Some([r.format.rows, r.format.cols]),
            WeightFormat::Float { shape, .. } => {
                let dim = |i: usize| shape.get(i).and_then(|&d| usize::try_from(d).ok());
                match shape.len() {
                    0 => Some([1, 1]),
                    1 => Some([1, dim(0)?]),
                    2 => Some([dim(0)?, dim(1)?]),
                    _ => None,
                }
            }
        }
    }
}

/// An opened Colibri container.
#[derive(Debug)]
pub struct ColibriContainer {
    dir: PathBuf,
    config: Glm52Config,
    generation_config: Option<GenerationConfig>,
    params: ColibriParams,
    catalog: Catalog,
    weights: BTreeMap<String, WeightInfo>,
}

impl ColibriContainer {
    /// Opens the container in `dir`: config, params, every shard header, and the
    /// format of every weight (see the module docs).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        let config = Glm52Config::load(&dir.join("config.json"))?;
        let gen_path = dir.join("generation_config.json");
        let generation_config = if gen_path.is_file() {
            Some(GenerationConfig::load(&gen_path)?)
        } else {
            None
        };
        let params = ColibriParams::load(&dir)?;
        let catalog = Catalog::scan(&dir)?;
        let weights = resolve_weights(&catalog, &config, &params)?;
        Ok(Self {
            dir,
            config,
            generation_config,
            params,
            catalog,
            weights,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`.
    pub fn config(&self) -> &Glm52Config {
        &self.config
    }

    /// `generation_config.json`, if present.
    pub fn generation_config(&self) -> Option<&GenerationConfig> {
        self.generation_config.as_ref()
    }

    /// Converter params, if any were found.
    pub fn params(&self) -> &ColibriParams {
        &self.params
    }

    /// The stop set: `config.json` ids plus `generation_config.json` ids, sorted
    /// and deduplicated.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.config.eos_token_ids();
        if let Some(g) = self
            .generation_config
            .as_ref()
            .and_then(|g| g.eos_token_id.as_ref())
        {
            ids.extend(g.to_vec());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Shards and raw tensor entries (including `.qs`).
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// Every logical weight (no `.qs` companions), by name.
    pub fn weights(&self) -> impl Iterator<Item = &WeightInfo> {
        self.weights.values()
    }

    /// Number of logical weights.
    pub fn weight_count(&self) -> usize {
        self.weights.len()
    }

    /// The logical weight `name`.
    pub fn weight(&self, name: &str) -> Result<&WeightInfo> {
        self.weights
            .get(name)
            .ok_or_else(|| ContainerError::MissingTensor {
                tensor: name.to_owned(),
            })
    }

    /// The raw stored tensor `name` (weights, `.qs` and floats alike).
    pub fn tensor(&self, name: &str) -> Result<&TensorEntry> {
        self.catalog
            .tensors
            .get(name)
            .ok_or_else(|| ContainerError::MissingTensor {
                tensor: name.to_owned(),
            })
    }

    /// The three weights of routed expert `(layer, expert)`, in the order gate,
    /// up, down. Works for MTP layers too.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<[&WeightInfo; 3]> {
        let get = |p: ExpertProj| {
            self.weight(&format!(
                "model.layers.{layer}.mlp.experts.{expert}.{}.weight",
                p.module_name()
            ))
        };
        Ok([
            get(ExpertProj::Gate)?,
            get(ExpertProj::Up)?,
            get(ExpertProj::Down)?,
        ])
    }

    /// Reads all bytes of the stored tensor `name`.
    pub fn read_tensor_bytes(&self, name: &str) -> Result<Vec<u8>> {
        self.read_entry(self.tensor(name)?)
    }

    /// Reads all bytes of `entry`.
    pub fn read_entry(&self, entry: &TensorEntry) -> Result<Vec<u8>> {
        self.read_entry_range(entry, 0, entry.len)
    }

    /// Reads `len` bytes starting `start` bytes into `entry`.
    pub fn read_entry_range(&self, entry: &TensorEntry, start: u64, len: u64) -> Result<Vec<u8>> {
        let shard = self
            .catalog
            .shard_of(entry)
            .ok_or_else(|| ContainerError::MissingTensor {
                tensor: entry.name.clone(),
            })?;
        let offset = entry.offset.saturating_add(start);
        let range_err = |kind, msg: &str| ContainerError::ReadRange {
            path: shard.path.clone(),
            offset,
            len,
            source: std::io::Error::new(kind, format!("{msg} (tensor {})", entry.name)),
        };
        if start.checked_add(len).is_none_or(|end| end > entry.len) {
            return Err(range_err(
                std::io::ErrorKind::InvalidInput,
                "range outside the tensor",
            ));
        }
        let size = usize::try_from(len)
            .map_err(|_| range_err(std::io::ErrorKind::OutOfMemory, "too large"))?;
        let mut buf = vec![0u8; size];
        shard
            .file
            .read_exact_at(&mut buf, offset)
            .map_err(|source| ContainerError::ReadRange {
                path: shard.path.clone(),
                offset,
                len,
                source,
            })?;
        Ok(buf)
    }

    /// Dequantizes (or converts) the whole logical weight `name` to `f32`,
    /// row-major, with its `[rows, cols]` (see [`WeightInfo::matrix_shape`]).
    pub fn dequantize(&self, name: &str) -> Result<(Vec<f32>, [usize; 2])> {
        let info = self.weight(name)?;
        let shape = matrix_shape(info)?;
        let bytes = self.read_entry(&info.entry)?;
        match &info.format {
            WeightFormat::Quantized(r) => {
                let scales = self.read_scales(info)?;
                let mut out = vec![0f32; r.format.numel()];
                decode_rows(&r.format, &bytes, &scales, 0, r.format.rows, &mut out).map_err(
                    |source| ContainerError::Decode {
                        tensor: name.to_owned(),
                        source,
                    },
                )?;
                Ok((out, shape))
            }
            WeightFormat::Float { dtype, .. } => Ok((floats_to_f32(*dtype, &bytes), shape)),
        }
    }

    /// Gathers rows of the logical weight `name` (e.g. embedding lookups), reading
    /// only those rows' bytes and scales. Returns `rows.len() · cols` values and
    /// `[rows.len(), cols]`.
    pub fn dequantize_rows(&self, name: &str, rows: &[usize]) -> Result<(Vec<f32>, [usize; 2])> {
        let info = self.weight(name)?;
        let [n_rows, cols] = matrix_shape(info)?;
        let mut out = vec![0f32; rows.len().saturating_mul(cols)];
        if cols == 0 {
            return Ok((out, [rows.len(), cols]));
        }
        for (&row, dst) in rows.iter().zip(out.chunks_exact_mut(cols)) {
            if row >= n_rows {
                return Err(ContainerError::RowOutOfRange {
                    tensor: name.to_owned(),
                    row,
                    rows: n_rows,
                });
            }
            match &info.format {
                WeightFormat::Quantized(r) => {
                    let f = &r.format;
                    let stride = f.row_stride_bytes() as u64;
                    let groups = f.groups_per_row() as u64;
                    let bytes = self.read_entry_range(&info.entry, row as u64 * stride, stride)?;
                    let scales_entry =
                        info.scales
                            .as_ref()
                            .ok_or_else(|| ContainerError::MissingTensor {
                                tensor: format!("{name}{SCALES_SUFFIX}"),
                            })?;
                    let raw =
                        self.read_entry_range(scales_entry, row as u64 * groups * 4, groups * 4)?;
                    let scales =
                        scales_from_le_bytes(&raw).map_err(|source| ContainerError::Decode {
                            tensor: name.to_owned(),
                            source,
                        })?;
                    decode_row(f, &bytes, &scales, dst).map_err(|source| {
                        ContainerError::Decode {
                            tensor: name.to_owned(),
                            source,
                        }
                    })?;
                }
                WeightFormat::Float { dtype, .. } => {
                    let width = (dtype.bitsize() / 8) as u64;
                    let row_bytes = cols as u64 * width;
                    let bytes =
                        self.read_entry_range(&info.entry, row as u64 * row_bytes, row_bytes)?;
                    for (d, v) in dst.iter_mut().zip(floats_to_f32(*dtype, &bytes)) {
                        *d = v;
                    }
                }
            }
        }
        Ok((out, [rows.len(), cols]))
    }

    /// Reads the F32 scales of a quantized weight (empty for floats).
    pub fn read_scales(&self, info: &WeightInfo) -> Result<Vec<f32>> {
        let Some(entry) = &info.scales else {
            return Ok(Vec::new());
        };
        let raw = self.read_entry(entry)?;
        scales_from_le_bytes(&raw).map_err(|source| ContainerError::Decode {
            tensor: info.name.clone(),
            source,
        })
    }
}

fn matrix_shape(info: &WeightInfo) -> Result<[usize; 2]> {
    info.matrix_shape()
        .ok_or_else(|| ContainerError::NotAMatrix {
            tensor: info.name.clone(),
            shape: info.entry.shape.clone(),
        })
}

/// Converts little-endian F32 / F16 / BF16 bytes to `f32`. Other dtypes never
/// reach this point (rejected at open).
fn floats_to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// Builds [`WeightInfo`] for every logical tensor of `catalog` (§8 steps 2–3).
fn resolve_weights(
    catalog: &Catalog,
    config: &Glm52Config,
    params: &ColibriParams,
) -> Result<BTreeMap<String, WeightInfo>> {
    let mut out = BTreeMap::new();
    for (name, entry) in &catalog.tensors {
        let path = || catalog.path_of(entry);
        if let Some(weight_name) = name.strip_suffix(SCALES_SUFFIX) {
            if !catalog.tensors.contains_key(weight_name) {
                return Err(ContainerError::OrphanScales {
                    path: path(),
                    tensor: weight_name.to_owned(),
                });
            }
            if entry.dtype != Dtype::F32 {
                return Err(ContainerError::ScalesDtype {
                    path: path(),
                    tensor: weight_name.to_owned(),
                    dtype: entry.dtype,
                });
            }
            continue;
        }
        let family = TensorFamily::classify(name, config);
        let scales = catalog.tensors.get(&format!("{name}{SCALES_SUFFIX}"));
        let format = match scales {
            Some(scales) => {
                if !matches!(entry.dtype, Dtype::U8 | Dtype::I8) {
                    return Err(ContainerError::UnsupportedDtype {
                        path: path(),
                        tensor: name.clone(),
                        dtype: entry.dtype,
                        note: " (only U8/I8 weights carry .qs scales)",
                    });
                }
                if scales.dtype != Dtype::F32 {
                    return Err(ContainerError::ScalesDtype {
                        path: catalog.path_of(scales),
                        tensor: name.clone(),
                        dtype: scales.dtype,
                    });
                }
                let [rows, cols] =
                    config
                        .logical_shape(name)
                        .ok_or_else(|| ContainerError::UnknownShape {
                            path: path(),
                            tensor: name.clone(),
                        })?;
                let query = FormatQuery {
                    tensor: name,
                    weight_bytes: entry.len,
                    scale_bytes: scales.len,
                    rows,
                    cols,
                    group_size_hint: params.group_size_hint(name, config.num_hidden_layers),
                    stamp: catalog.fmt_stamps.get(name).map(String::as_str),
                };
                let resolved = resolve_format(&query).map_err(|source| ContainerError::Format {
                    path: path(),
                    source,
                })?;
                WeightFormat::Quantized(resolved)
            }
            None if is_float(entry.dtype) => {
                check_float_size(entry, path())?;
                WeightFormat::Float {
                    dtype: entry.dtype,
                    shape: entry.shape.clone(),
                }
            }
            None if matches!(entry.dtype, Dtype::U8 | Dtype::I8) => {
                return Err(ContainerError::MissingScales {
                    path: path(),
                    tensor: name.clone(),
                    dtype: entry.dtype,
                });
            }
            None => {
                return Err(ContainerError::UnsupportedDtype {
                    path: path(),
                    tensor: name.clone(),
                    dtype: entry.dtype,
                    note: "",
                });
            }
        };
        let info = WeightInfo {
            name: name.clone(),
            family,
            entry: entry.clone(),
            scales: scales.cloned(),
            format,
        };
        out.insert(name.clone(), info);
    }
    Ok(out)
}

fn check_float_size(entry: &TensorEntry, path: PathBuf) -> Result<()> {
    let width = (entry.dtype.bitsize() / 8) as u64;
    let expected = entry
        .shape
        .iter()
        .try_fold(width, |acc, &d| acc.checked_mul(d));
    if expected == Some(entry.len) {
        return Ok(());
    }
    Err(ContainerError::SizeMismatch {
        path,
        tensor: entry.name.clone(),
        dtype: entry.dtype,
        shape: entry.shape.clone(),
        len: entry.len,
        expected: expected.unwrap_or(u64::MAX),
    })
}
