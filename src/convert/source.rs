//! Read access to the source checkpoint's safetensors shards (headers and row ranges
//! decoded to `f32`).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use super::ConvertError;
use super::fp8::e4m3_table;

/// FP8 block size of `weight_scale_inv` (128×128).
pub(crate) const FP8_BLOCK: usize = 128;

/// One mapped source shard.
pub(crate) struct SourceShard {
    pub path: PathBuf,
    pub basename: String,
    map: Mmap,
    data_start: usize,
    metadata: Metadata,
}

impl SourceShard {
    fn open(path: PathBuf) -> Result<Self, ConvertError> {
        let file = File::open(&path).map_err(|e| ConvertError::io(&path, e))?;
        // SAFETY: the map is read-only and the converter never writes to its input
        // files; the checkpoint must not be modified while a conversion runs (the same
        // contract as any reader of the checkpoint).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, e))?;
        let (n, metadata) = SafeTensors::read_metadata(&map).map_err(|e| ConvertError::Source {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let basename = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            path,
            basename,
            map,
            data_start: 8 + n,
            metadata,
        })
    }

    /// Tensor names in this shard, sorted byte-wise.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        // Offsets were validated against the buffer length by `read_metadata`.
        let (b, e) = info.data_offsets;
        self.map
            .get(self.data_start + b..self.data_start + e)
            .unwrap_or(&[])
    }
}

/// All source shards of a checkpoint directory and a name → shard index.
pub(crate) struct SourceSet {
    pub shards: Vec<SourceShard>,
    by_name: HashMap<String, usize>,
}

impl SourceSet {
    /// Opens every file of `dir` whose last extension is `.safetensors`, sorted by name.
    pub fn open(dir: &Path) -> Result<Self, ConvertError> {
        let entries = std::fs::read_dir(dir).map_err(|e| ConvertError::io(dir, e))?;
        let mut paths = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| ConvertError::io(dir, e))?.path();
            if path.extension().is_some_and(|x| x == "safetensors") && path.is_file() {
                paths.push(path);
            }
        }
        paths.sort();
        if paths.is_empty() {
            return Err(ConvertError::NoShards {
                dir: dir.to_path_buf(),
            });
        }
        let mut shards = Vec::with_capacity(paths.len());
        let mut by_name = HashMap::new();
        for path in paths {
            let shard = SourceShard::open(path)?;
            let i = shards.len();
            for name in shard.names() {
                if let Some(&prev) = by_name.get(&name) {
                    let first: &SourceShard = &shards[prev];
                    return Err(ConvertError::DuplicateTensor {
                        tensor: name,
                        first: first.path.clone(),
                        second: shard.path.clone(),
                    });
                }
                by_name.insert(name, i);
            }
            shards.push(shard);
        }
        Ok(Self { shards, by_name })
    }

    /// The shard holding `name` and its info.
    pub fn find(&self, name: &str) -> Option<(&SourceShard, &TensorInfo)> {
        let shard = self.shards.get(*self.by_name.get(name)?)?;
        Some((shard, shard.info(name)?))
    }
}

/// A source tensor resolved for decoding: its bytes, dtype, `[rows, cols]` view and,
/// for FP8, the decoded block scales.
pub(crate) struct SourceTensor<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    bytes: &'a [u8],
    dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
    fp8: Option<Fp8Scales>,
}

struct Fp8Scales {
    lut: [f32; 256],
    scale_inv: Vec<f32>,
    block_cols: usize,
}

/// Decodes a float tensor's bytes to `f32` (F32, BF16, F16 only).
fn decode_float(bytes: &[u8], dtype: Dtype, out: &mut Vec<f32>) -> bool {
    match dtype {
        Dtype::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        Dtype::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        Dtype::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        _ => return false,
    }
    true
}

impl<'a> SourceTensor<'a> {
    /// Resolves tensor `name` of `shard`, looking up `<name>_scale_inv` in `set` for FP8.
    pub fn resolve(
        set: &'a SourceSet,
        shard: &'a SourceShard,
        name: &'a str,
    ) -> Result<Self, ConvertError> {
        let info = shard.info(name).ok_or_else(|| ConvertError::Source {
            path: shard.path.clone(),
            message: format!("tensor {name} vanished from the header"),
        })?;
        let shape = &info.shape;
        let numel: usize = shape.iter().product();
        let cols = match shape.last() {
            Some(&c) => c,
            None => 1,
        };
        let rows = numel.checked_div(cols).unwrap_or(0);
        let mut t = SourceTensor {
            name,
            path: &shard.path,
            bytes: shard.bytes(info),
            dtype: info.dtype,
            rows,
            cols,
            fp8: None,
        };
        match info.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => {}
            Dtype::F8_E4M3 => {
                if shape.len() != 2 {
                    return Err(ConvertError::BadShape {
                        tensor: name.to_string(),
                        path: shard.path.clone(),
                        message: format!("FP8 weight must be 2-D, has shape {shape:?}"),
                    });
                }
                let scale_name = format!("{name}_scale_inv");
                let (sshard, sinfo) =
                    set.find(&scale_name)
                        .ok_or_else(|| ConvertError::MissingScaleInv {
                            tensor: name.to_string(),
                            path: shard.path.clone(),
                        })?;
                let want = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
                if sinfo.shape != want {
                    return Err(ConvertError::BadShape {
                        tensor: scale_name,
                        path: sshard.path.clone(),
                        message: format!(
                            "expected shape {want:?} for a [{rows}, {cols}] FP8 weight, found {:?}",
                            sinfo.shape
                        ),
                    });
                }
                let mut scale_inv = Vec::with_capacity(want[0] * want[1]);
                if !decode_float(sshard.bytes(sinfo), sinfo.dtype, &mut scale_inv) {
                    return Err(ConvertError::UnsupportedDtype {
                        tensor: scale_name,
                        path: sshard.path.clone(),
                        dtype: format!("{:?}", sinfo.dtype),
                    });
                }
                t.fp8 = Some(Fp8Scales {
                    lut: e4m3_table(),
                    scale_inv,
                    block_cols: want[1],
                });
            }
            other => {
                return Err(ConvertError::UnsupportedDtype {
                    tensor: name.to_string(),
                    path: shard.path.clone(),
                    dtype: format!("{other:?}"),
                });
            }
        }
        Ok(t)
    }

    /// Decodes rows `[r0, r1)` to `f32`, replacing `out`'s contents. Fails on NaN/inf.
    pub fn decode_rows(
        &self,
        r0: usize,
        r1: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ConvertError> {
        out.clear();
        let (e0, e1) = (r0 * self.cols, r1 * self.cols);
        match &self.fp8 {
            None => {
                let size = self.dtype.bitsize() / 8;
                let bytes = self.bytes.get(e0 * size..e1 * size).unwrap_or(&[]);
                decode_float(bytes, self.dtype, out);
            }
            Some(s) => {
                let bytes = self.bytes.get(e0..e1).unwrap_or(&[]);
                for (r, row) in (r0..r1).zip(bytes.chunks_exact(self.cols.max(1))) {
                    let srow = &s.scale_inv[(r / FP8_BLOCK) * s.block_cols..];
                    out.extend(
                        row.iter()
                            .enumerate()
                            .map(|(c, &b)| s.lut[b as usize] * srow[c / FP8_BLOCK]),
                    );
                }
            }
        }
        if out.len() != e1 - e0 {
            return Err(ConvertError::Source {
                path: self.path.to_path_buf(),
                message: format!("tensor {} is shorter than its shape", self.name),
            });
        }
        if out.iter().any(|v| !v.is_finite()) {
            return Err(ConvertError::NonFinite {
                tensor: self.name.to_string(),
                path: self.path.to_path_buf(),
            });
        }
        Ok(())
    }
}
