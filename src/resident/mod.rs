//! The resident weights view: every non-routed GLM-5.x weight, read through one
//! trait, [`Glm52WeightSource`].
//!
//! The model graph reads dense, attention, indexer, shared-expert, router, norm,
//! embedding and lm_head tensors (and, with [`ResidentOptions::include_mtp`],
//! the MTP layer's) through this trait. Routed experts are refused by name
//! ([`ResidentError::RoutedExpert`]): they belong to the streamed expert
//! backend, and the resident view can never load them silently, even when
//! their shard also holds resident tensors.
//!
//! [`ResidentWeights`] opens the container's catalog at once but opens a shard
//! file only on the first read of a tensor it owns, and uploads each tensor to
//! MLX once, on first use, in the form its path needs (see [`LinearKernel`]):
//!
//! * int4 through MLX's 4-bit affine `quantized_matmul` (Colibri's nibbles read
//!   as little-endian `uint32` are MLX's layout, `bias = −8·scale`);
//! * int8 per-row through MLX's 8-bit affine kernel after `byte ^ 0x80`
//!   (`bias = −128·scale`); the lm_head in bounded row tiles, each evaluated
//!   before the next, so the f32 head (≈3.8 GiB for GLM-5.2) never exists;
//! * other layouts, and [`LinearPath::Reference`], dequantize to f32 with the
//!   crate's bit-exact host decoder and multiply in f32;
//! * embeddings gather the requested rows first and dequantize only those.
//!
//! ```no_run
//! use glm_stream::mlx::Array;
//! use glm_stream::resident::{Glm52WeightSource, ResidentOptions, ResidentWeights};
//!
//! let weights = ResidentWeights::open("/models/glm-5.2-colibri", &ResidentOptions::default())?;
//! let hidden = weights.container().config().hidden_size;
//! let vocab = weights.container().config().vocab_size;
//! println!(
//!     "{} resident bytes, {} shards opened so far",
//!     weights.weights_bytes(),
//!     weights.mapped_shard_count()
//! );
//! let h = weights.embedding(&[1, 2, 3], "model.embed_tokens.weight", vocab, hidden)?;
//! let logits = weights.linear(&h, "lm_head.weight", vocab, hidden)?;
//! assert_eq!(logits.shape(), vec![3, vocab as i32]);
//! // Routed experts are the streamed backend's: asking for one is an error.
//! assert!(weights.tensor("model.layers.3.mlp.experts.0.gate_proj.weight").is_err());
//! # Ok::<(), glm_stream::resident::ResidentError>(())
//! ```

mod error;
mod linear;
mod shards;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

pub use error::{ResidentError, Result};
pub use linear::{LinearKernel, LinearPath, kernel_for};

use crate::container::{
    ColibriContainer, SCALES_SUFFIX, TensorFamily, WeightFormat, WeightInfo, routed_expert_coords,
};
use crate::mlx::{self, Array, Dtype, WritableBuffer};
use crate::quant::{QuantFormat, decode_rows, scales_from_le_bytes};

use error::MlxContext;
use linear::{Affine, QuantRows};
use shards::ShardFiles;

/// The read interface of the GLM-5.x model graph for every non-routed weight.
///
/// `rows`/`cols` are the logical `[O, I]` the caller expects (`[vocab, hidden]`
/// for embeddings); an implementation checks them against the tensor's
/// descriptor and refuses a mismatch instead of reinterpreting bytes.
pub trait Glm52WeightSource {
    /// True when `name` is in this source's weight set.
    fn has(&self, name: &str) -> bool;

    /// The stored tensor as an MLX array: a quantized weight as its flat
    /// `uint8` bytes, a float tensor in its stored dtype and shape.
    fn tensor(&self, name: &str) -> Result<Array>;

    /// The whole weight as `f32 [rows, cols]` (materialized: `4·rows·cols`
    /// bytes; use [`linear`](Self::linear) and [`embedding`](Self::embedding)
    /// on the hot path).
    fn dequantized(&self, name: &str, rows: usize, cols: usize) -> Result<Array>;

    /// `x · Wᵀ` for `x [..., cols]` and the weight `W [rows, cols]`; returns
    /// `[..., rows]`.
    fn linear(&self, x: &Array, name: &str, rows: usize, cols: usize) -> Result<Array>;

    /// Rows `ids` of the `[vocab, hidden]` table as `f32 [ids.len(), hidden]`.
    /// Ids are checked against `vocab` before any gather.
    fn embedding(&self, ids: &[u32], name: &str, vocab: usize, hidden: usize) -> Result<Array>;
}

/// Options of [`ResidentWeights::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentOptions {
    /// Include the MTP layer's non-routed tensors (default `true`). Its routed
    /// experts are refused either way.
    pub include_mtp: bool,
    /// The default path of [`Glm52WeightSource::linear`] (default
    /// [`LinearPath::Fast`]); [`ResidentWeights::linear_with`] picks per call.
    pub linear_path: LinearPath,
    /// Rows per tile of the tiled int8 lm_head (default 2048: a GLM-5.2 tile is
    /// 12 MiB of int8, 48 MiB if a tile has to be expanded to f32). Any int8
    /// matrix taller than this is tiled too.
    pub head_tile_rows: usize,
}

impl Default for ResidentOptions {
    fn default() -> Self {
        Self {
            include_mtp: true,
            linear_path: LinearPath::Fast,
            head_tile_rows: 2048,
        }
    }
}

/// Cached forms of one tensor, by what they serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Form {
    /// [`Glm52WeightSource::tensor`].
    Raw,
    /// MLX affine kernels.
    Affine,
    /// Row-addressable quantized bytes (embedding gathers, expanded int8 tiles).
    Rows,
    /// Dequantized f32 `[O, I]`.
    Dense,
}

#[derive(Clone)]
enum Prepared {
    Array(Array),
    Affine(Affine),
    Rows(QuantRows),
}

/// The resident (non-routed) GLM-5.x weights of a Colibri container.
///
/// Not `Send`/`Sync`: it holds MLX arrays, which one thread builds and
/// evaluates (see [`crate::mlx`]).
pub struct ResidentWeights {
    container: ColibriContainer,
    options: ResidentOptions,
    resident: BTreeSet<String>,
    owning_shards: BTreeSet<usize>,
    weights_bytes: u64,
    files: ShardFiles,
    cache: RefCell<HashMap<(String, Form), Prepared>>,
}

impl std::fmt::Debug for ResidentWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentWeights")
            .field("dir", &self.container.dir())
            .field("tensors", &self.resident.len())
            .field("weights_bytes", &self.weights_bytes)
            .field("mapped_shards", &self.files.count())
            .field("cached", &self.cache.borrow().len())
            .finish()
    }
}

impl ResidentWeights {
    /// Opens the container in `model_dir` and selects the resident set. Reads
    /// headers and configs only; no tensor byte is read and no shard is
    /// opened for data until a tensor is first used.
    pub fn open(model_dir: impl AsRef<Path>, options: &ResidentOptions) -> Result<Self> {
        Self::from_container(ColibriContainer::open(model_dir)?, options)
    }

    /// The resident view of an already opened container.
    pub fn from_container(container: ColibriContainer, options: &ResidentOptions) -> Result<Self> {
        if options.head_tile_rows == 0 || options.head_tile_rows > i32::MAX as usize {
            return Err(ResidentError::InvalidOption(format!(
                "head_tile_rows must be in 1..=2^31-1, got {}",
                options.head_tile_rows
            )));
        }
        let mut resident = BTreeSet::new();
        let mut owning_shards = BTreeSet::new();
        let mut weights_bytes = 0u64;
        for w in container.weights() {
            if routed_expert_coords(&w.name).is_some()
                || (w.family == TensorFamily::Mtp && !options.include_mtp)
            {
                continue;
            }
            resident.insert(w.name.clone());
            weights_bytes = weights_bytes.saturating_add(w.stored_bytes());
            owning_shards.insert(w.entry.shard);
            if let Some(s) = &w.scales {
                owning_shards.insert(s.shard);
            }
        }
        Ok(Self {
            container,
            options: options.clone(),
            resident,
            owning_shards,
            weights_bytes,
            files: ShardFiles::default(),
            cache: RefCell::new(HashMap::new()),
        })
    }

    /// The underlying container (config, catalog).
    pub fn container(&self) -> &ColibriContainer {
        &self.container
    }

    /// The options this view was opened with.
    pub fn options(&self) -> &ResidentOptions {
        &self.options
    }

    /// Names of the resident tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.resident.iter().map(String::as_str)
    }

    /// Stored bytes (weights plus `.qs` scales) of the resident set.
    pub fn weights_bytes(&self) -> u64 {
        self.weights_bytes
    }

    /// Shards that own at least one resident tensor (the most that will ever
    /// be opened).
    pub fn owning_shard_count(&self) -> usize {
        self.owning_shards.len()
    }

    /// Shards opened for data so far (by positioned reads; nothing is
    /// memory-mapped). Zero right after [`open`](Self::open).
    pub fn mapped_shard_count(&self) -> usize {
        self.files.count()
    }

    /// File sizes of the shards opened so far.
    pub fn mapped_shard_bytes(&self) -> u64 {
        self.files.bytes(&self.container)
    }

    /// MLX bytes held by the cached prepared arrays.
    pub fn cached_bytes(&self) -> usize {
        let cache = self.cache.borrow();
        cache
            .values()
            .map(|p| match p {
                Prepared::Array(a) => a.nbytes(),
                Prepared::Affine(a) => a.w.nbytes() + a.scales.nbytes() + a.biases.nbytes(),
                Prepared::Rows(r) => r.bytes.nbytes() + r.scales.nbytes(),
            })
            .sum()
    }

    /// Drops every cached array (tensors are read again on next use).
    pub fn clear_cache(&self) {
        self.cache.borrow_mut().clear();
    }

    /// The descriptor of the resident weight `name`, or the error saying why
    /// it is not one (routed expert, MTP excluded, unknown).
    pub fn info(&self, name: &str) -> Result<&WeightInfo> {
        if let Some((layer, expert, _)) = routed_expert_coords(name) {
            return Err(ResidentError::RoutedExpert {
                name: name.to_owned(),
                layer,
                expert,
            });
        }
        if self.resident.contains(name) {
            return Ok(self.container.weight(name)?);
        }
        let reason = match self.container.weight(name) {
            Ok(w) if w.family == TensorFamily::Mtp => {
                "MTP tensors are excluded (ResidentOptions::include_mtp is false)"
            }
            Ok(_) => "not selected",
            Err(_) if name.ends_with(SCALES_SUFFIX) && self.container.tensor(name).is_ok() => {
                "a .qs scale companion is read with its weight"
            }
            Err(_) => "not in the container",
        };
        Err(ResidentError::NotResident {
            name: name.to_owned(),
            reason,
        })
    }

    /// The fast-path kernel `name` uses (see [`LinearKernel`]).
    pub fn linear_kernel(&self, name: &str) -> Result<LinearKernel> {
        Ok(kernel_for(self.info(name)?, self.options.head_tile_rows))
    }

    /// [`Glm52WeightSource::linear`] on an explicit path.
    pub fn linear_with(
        &self,
        x: &Array,
        name: &str,
        rows: usize,
        cols: usize,
        path: LinearPath,
    ) -> Result<Array> {
        let info = self.info(name)?;
        check_shape(info, rows, cols)?;
        if x.ndim() == 0 || x.dim(-1).ok().map(|d| d as usize) != Some(cols) {
            return Err(linear::bad_input(
                name,
                x,
                cols,
                "the last dimension must equal the weight's input columns",
            ));
        }
        if !x.dtype().is_float() {
            return Err(linear::bad_input(
                name,
                x,
                cols,
                "input must be a float array",
            ));
        }
        if path == LinearPath::Reference {
            return linear::dense_matmul(name, x, &self.dense(info)?);
        }
        match kernel_for(info, self.options.head_tile_rows) {
            LinearKernel::Q4 { .. } | LinearKernel::Int8Affine { .. } => {
                linear::affine_matmul(name, x, &self.affine(info)?)
            }
            LinearKernel::Int8Tiled {
                tile_rows,
                group_size: Some(_),
            } => linear::tiled_affine(name, x, &self.affine(info)?, tile_rows),
            LinearKernel::Int8Tiled {
                tile_rows,
                group_size: None,
            } => linear::tiled_expand(name, x, &self.rows(info)?, tile_rows),
            LinearKernel::Float | LinearKernel::Dequantized => {
                linear::dense_matmul(name, x, &self.dense(info)?)
            }
        }
    }

    // ---- cache ----------------------------------------------------------

    fn cached(
        &self,
        name: &str,
        form: Form,
        build: impl FnOnce() -> Result<Prepared>,
    ) -> Result<Prepared> {
        let key = (name.to_owned(), form);
        if let Some(p) = self.cache.borrow().get(&key) {
            return Ok(p.clone());
        }
        let p = build()?;
        self.cache.borrow_mut().insert(key, p.clone());
        Ok(p)
    }

    fn raw(&self, info: &WeightInfo) -> Result<Array> {
        let p = self.cached(&info.name, Form::Raw, || {
            let a = match &info.format {
                WeightFormat::Quantized(_) => {
                    let len = i32_dim(&info.name, info.entry.len)?;
                    self.upload(info, &[len], Dtype::Uint8, false)?
                }
                WeightFormat::Float { dtype, shape } => {
                    let dims = shape
                        .iter()
                        .map(|&d| i32_dim(&info.name, d))
                        .collect::<Result<Vec<_>>>()?;
                    self.upload(info, &dims, float_dtype(*dtype), false)?
                }
            };
            Ok(Prepared::Array(a))
        })?;
        match p {
            Prepared::Array(a) => Ok(a),
            _ => Err(internal(&info.name)),
        }
    }

    fn dense(&self, info: &WeightInfo) -> Result<Array> {
        let p = self.cached(&info.name, Form::Dense, || {
            let name = &info.name;
            let a = match &info.format {
                WeightFormat::Quantized(r) => {
                    let f = &r.format;
                    let bytes = self.files.read_all(&self.container, name, &info.entry)?;
                    let scales = self.scales(info)?;
                    let mut out = vec![0f32; f.numel()];
                    decode_rows(f, &bytes, &scales, 0, f.rows, &mut out).map_err(|source| {
                        ResidentError::Decode {
                            name: name.clone(),
                            source,
                        }
                    })?;
                    let shape = [i32_dim(name, f.rows as u64)?, i32_dim(name, f.cols as u64)?];
                    Array::from_slice(&out, &shape).ctx(name, "uploading the f32 weight")?
                }
                WeightFormat::Float { dtype, .. } => {
                    let [r, c] = float_matrix(info)?;
                    let a = self.upload(info, &[r, c], float_dtype(*dtype), false)?;
                    a.astype(Dtype::Float32).ctx(name, "casting to f32")?
                }
            };
            a.eval().ctx(name, "evaluating the f32 weight")?;
            Ok(Prepared::Array(a))
        })?;
        match p {
            Prepared::Array(a) => Ok(a),
            _ => Err(internal(&info.name)),
        }
    }

    fn affine(&self, info: &WeightInfo) -> Result<Affine> {
        let p = self.cached(&info.name, Form::Affine, || {
            let name = &info.name;
            let f = quant_format(info)?;
            // Each row's bytes are whole uint32 words (I % 32 == 0 on every
            // affine path), so the flat blob reshapes to [O, I·bits/32].
            let words = f.row_stride_bytes() / 4;
            let shape = [i32_dim(name, f.rows as u64)?, i32_dim(name, words as u64)?];
            let w = self.upload(info, &shape, Dtype::Uint32, f.bits == 8)?;
            let scales = self.scales_array(info, f)?;
            Ok(Prepared::Affine(linear::affine_from(name, f, w, &scales)?))
        })?;
        match p {
            Prepared::Affine(a) => Ok(a),
            _ => Err(internal(&info.name)),
        }
    }

    fn rows(&self, info: &WeightInfo) -> Result<QuantRows> {
        let p = self.cached(&info.name, Form::Rows, || {
            let name = &info.name;
            let f = quant_format(info)?;
            let shape = [
                i32_dim(name, f.rows as u64)?,
                i32_dim(name, f.row_stride_bytes() as u64)?,
            ];
            let bytes = self.upload(info, &shape, Dtype::Uint8, false)?;
            let scales = self.scales_array(info, f)?;
            mlx::eval(&[&bytes, &scales]).ctx(name, "uploading the weight")?;
            Ok(Prepared::Rows(QuantRows {
                bytes,
                scales,
                format: *f,
            }))
        })?;
        match p {
            Prepared::Rows(r) => Ok(r),
            _ => Err(internal(&info.name)),
        }
    }

    // ---- I/O ------------------------------------------------------------

    /// Reads the weight bytes of `info` straight into MLX-owned memory
    /// (optionally flipping each byte's sign bit) and views them as `dtype`
    /// `shape`. No intermediate host copy of the tensor is made.
    fn upload(&self, info: &WeightInfo, shape: &[i32], dtype: Dtype, xor80: bool) -> Result<Array> {
        let name = &info.name;
        let len = usize::try_from(info.entry.len).map_err(|_| ResidentError::TooLarge {
            name: name.clone(),
            value: usize::MAX,
        })?;
        if len == 0 {
            return Array::from_bytes(&[], shape, dtype).ctx(name, "uploading an empty tensor");
        }
        let mut buf = WritableBuffer::new(len).ctx(name, "allocating MLX memory")?;
        let dst = buf.bytes_mut().ctx(name, "allocating MLX memory")?;
        self.files
            .read_into(&self.container, name, &info.entry, 0, dst)?;
        if xor80 {
            dst.iter_mut().for_each(|b| *b ^= 0x80);
        }
        let a = buf.view(0, shape, dtype).ctx(name, "viewing the weight")?;
        a.eval().ctx(name, "uploading the weight")?;
        Ok(a)
    }

    /// The stored `.qs` scales of a quantized weight.
    fn scales(&self, info: &WeightInfo) -> Result<Vec<f32>> {
        let entry = info
            .scales
            .as_ref()
            .ok_or_else(|| ResidentError::NotResident {
                name: format!("{}{SCALES_SUFFIX}", info.name),
                reason: "not in the container",
            })?;
        let raw = self.files.read_all(&self.container, &info.name, entry)?;
        scales_from_le_bytes(&raw).map_err(|source| ResidentError::Decode {
            name: info.name.clone(),
            source,
        })
    }

    /// The stored scales as `f32 [O, groups_per_row]`.
    fn scales_array(&self, info: &WeightInfo, f: &QuantFormat) -> Result<Array> {
        let name = &info.name;
        let scales = self.scales(info)?;
        let shape = [
            i32_dim(name, f.rows as u64)?,
            i32_dim(name, f.groups_per_row() as u64)?,
        ];
        Array::from_slice(&scales, &shape).ctx(name, "uploading scales")
    }
}

impl Glm52WeightSource for ResidentWeights {
    fn has(&self, name: &str) -> bool {
        self.resident.contains(name)
    }

    fn tensor(&self, name: &str) -> Result<Array> {
        self.raw(self.info(name)?)
    }

    fn dequantized(&self, name: &str, rows: usize, cols: usize) -> Result<Array> {
        let info = self.info(name)?;
        check_shape(info, rows, cols)?;
        self.dense(info)
    }

    fn linear(&self, x: &Array, name: &str, rows: usize, cols: usize) -> Result<Array> {
        self.linear_with(x, name, rows, cols, self.options.linear_path)
    }

    fn embedding(&self, ids: &[u32], name: &str, vocab: usize, hidden: usize) -> Result<Array> {
        let info = self.info(name)?;
        check_shape(info, vocab, hidden)?;
        if let Some((position, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab)
        {
            return Err(ResidentError::TokenOutOfRange {
                name: name.to_owned(),
                id,
                position,
                vocab,
            });
        }
        let n = i32_dim(name, ids.len() as u64)?;
        let h = i32_dim(name, hidden as u64)?;
        if ids.is_empty() {
            return mlx::zeros(&[0, h], Dtype::Float32).ctx(name, "empty embedding");
        }
        // Every id is < vocab <= i32::MAX (checked by i32_dim on the descriptor).
        let as_i32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&as_i32, &[n]).ctx(name, "uploading ids")?;
        match &info.format {
            WeightFormat::Quantized(_) => {
                let q = self.rows(info)?;
                let bytes = q.bytes.take(&idx, 0).ctx(name, "gathering rows")?;
                let scales = q.scales.take(&idx, 0).ctx(name, "gathering scales")?;
                linear::dequantize_gathered(name, &q.format, &bytes, &scales)
            }
            WeightFormat::Float { .. } => {
                let [r, c] = float_matrix(info)?;
                let table = self
                    .raw(info)?
                    .reshape(&[r, c])
                    .ctx(name, "viewing the table")?;
                table
                    .take(&idx, 0)
                    .and_then(|v| v.astype(Dtype::Float32))
                    .ctx(name, "gathering rows")
            }
        }
    }
}

fn check_shape(info: &WeightInfo, rows: usize, cols: usize) -> Result<()> {
    let [actual_rows, actual_cols] =
        info.matrix_shape()
            .ok_or_else(|| ResidentError::NotAMatrix {
                name: info.name.clone(),
                shape: info.entry.shape.clone(),
            })?;
    if [rows, cols] != [actual_rows, actual_cols] {
        return Err(ResidentError::ShapeMismatch {
            name: info.name.clone(),
            rows,
            cols,
            actual_rows,
            actual_cols,
            format: info.format_label(),
        });
    }
    // Every MLX shape below is built from these two numbers.
    i32_dim(&info.name, actual_rows as u64)?;
    i32_dim(&info.name, actual_cols as u64)?;
    Ok(())
}

fn float_matrix(info: &WeightInfo) -> Result<[i32; 2]> {
    let [r, c] = info
        .matrix_shape()
        .ok_or_else(|| ResidentError::NotAMatrix {
            name: info.name.clone(),
            shape: info.entry.shape.clone(),
        })?;
    Ok([
        i32_dim(&info.name, r as u64)?,
        i32_dim(&info.name, c as u64)?,
    ])
}

fn quant_format(info: &WeightInfo) -> Result<&QuantFormat> {
    info.quant_format()
        .ok_or_else(|| ResidentError::Internal(format!("{} is not quantized", info.name)))
}

fn i32_dim(name: &str, v: u64) -> Result<i32> {
    i32::try_from(v).map_err(|_| ResidentError::TooLarge {
        name: name.to_owned(),
        value: usize::try_from(v).unwrap_or(usize::MAX),
    })
}

fn float_dtype(d: safetensors::Dtype) -> Dtype {
    match d {
        safetensors::Dtype::BF16 => Dtype::Bfloat16,
        safetensors::Dtype::F16 => Dtype::Float16,
        // The container admits only F32/BF16/F16 float tensors.
        _ => Dtype::Float32,
    }
}

fn internal(name: &str) -> ResidentError {
    ResidentError::Internal(format!("{name}: cache entry of the wrong form"))
}
