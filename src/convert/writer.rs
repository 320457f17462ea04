//! A streaming safetensors writer whose output is byte-identical to
//! `safetensors.numpy.save_file(tensors)` without metadata (safetensors 0.8):
//!
//! * the data region is sorted by dtype **descending** (the `safetensors` `Dtype` order,
//!   so F32 before BF16/F16 before F8 before U8), then by name byte-wise ascending;
//! * the header is compact JSON listing the tensors in data-offset order, with no
//!   `__metadata__` key, padded with spaces to a multiple of 8 bytes.
//!
//! (Checked empirically against the Python library; `tests/convert.rs` keeps checking.)
//!
//! The layout is computed from names, dtypes and shapes alone ([`ShardLayout`]), the
//! header is written first, then each tensor's bytes are written (in any order, in as
//! many parts as convenient) at their final offsets, so at most one tensor's worth of
//! data is in memory. The file is written as `NAME.tmp` and renamed on
//! [`ShardWriter::finish`].

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use thiserror::Error;

/// Errors of the shard writer.
#[derive(Debug, Error)]
pub enum WriteError {
    /// An I/O error on `path`.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Two tensors share a name.
    #[error("duplicate tensor name {0:?}")]
    DuplicateName(String),
    /// A dtype whose elements are not whole bytes.
    #[error("tensor {name:?}: dtype {dtype:?} is not byte-sized")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: Dtype,
    },
    /// Data written for a name that is not in the layout.
    #[error("tensor {0:?} is not in this shard's layout")]
    UnknownTensor(String),
    /// More bytes written for a tensor than its shape holds.
    #[error("tensor {name:?}: {written} bytes written, layout holds {expected}")]
    Overflow {
        /// Tensor name.
        name: String,
        /// Bytes written so far (including the rejected part).
        written: usize,
        /// Bytes the layout holds.
        expected: usize,
    },
    /// `finish` was called before every tensor was complete.
    #[error("tensor {name:?}: only {written} of {expected} bytes written")]
    Incomplete {
        /// Tensor name.
        name: String,
        /// Bytes written.
        written: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// Byte-size arithmetic overflowed `usize`.
    #[error("tensor {0:?} is too large")]
    TooLarge(String),
}

/// Name, dtype and shape of one tensor to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A tensor spec.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    fn byte_len(&self) -> Result<usize, WriteError> {
        if self.dtype.bitsize() % 8 != 0 {
            return Err(WriteError::UnsupportedDtype {
                name: self.name.clone(),
                dtype: self.dtype,
            });
        }
        self.shape
            .iter()
            .try_fold(self.dtype.bitsize() / 8, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| WriteError::TooLarge(self.name.clone()))
    }
}

/// One tensor's place in a shard.
#[derive(Debug, Clone)]
pub struct LayoutEntry {
    /// The tensor.
    pub spec: TensorSpec,
    /// Data offsets `[begin, end)` relative to the start of the data region.
    pub begin: usize,
    /// End of the data (exclusive).
    pub end: usize,
}

/// The complete byte layout of one shard: header and tensor offsets.
#[derive(Debug, Clone)]
pub struct ShardLayout {
    entries: Vec<LayoutEntry>,
    header: Vec<u8>,
}

impl ShardLayout {
    /// Lays out `tensors` the way `safetensors.numpy.save_file` does.
    pub fn new(mut tensors: Vec<TensorSpec>) -> Result<Self, WriteError> {
        tensors.sort_by(|a, b| {
            b.dtype
                .cmp(&a.dtype)
                .then_with(|| a.name.as_bytes().cmp(b.name.as_bytes()))
        });
        for pair in tensors.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(WriteError::DuplicateName(pair[0].name.clone()));
            }
        }
        // Names sort within a dtype, so a duplicate across dtypes needs a set.
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(WriteError::DuplicateName(t.name.clone()));
            }
        }
        let mut entries = Vec::with_capacity(tensors.len());
        let mut offset = 0usize;
        for spec in tensors {
            let len = spec.byte_len()?;
            let end = offset
                .checked_add(len)
                .ok_or_else(|| WriteError::TooLarge(spec.name.clone()))?;
            entries.push(LayoutEntry {
                spec,
                begin: offset,
                end,
            });
            offset = end;
        }
        let header = build_header(&entries);
        Ok(Self { entries, header })
    }

    /// The tensors in data-offset order.
    pub fn entries(&self) -> &[LayoutEntry] {
        &self.entries
    }

    /// The 8-byte length prefix plus the padded JSON header.
    pub fn header_bytes(&self) -> &[u8] {
        &self.header
    }

    /// Size of the data region.
    pub fn data_len(&self) -> usize {
        self.entries.last().map_or(0, |e| e.end)
    }

    /// Total file size in bytes.
    pub fn file_size(&self) -> u64 {
        self.header.len() as u64 + self.data_len() as u64
    }
}

fn build_header(entries: &[LayoutEntry]) -> Vec<u8> {
    let mut json = String::from("{");
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        // Serializing a str or a Dtype to JSON cannot fail.
        let name = serde_json::to_string(&e.spec.name).unwrap_or_default();
        let dtype = serde_json::to_string(&e.spec.dtype).unwrap_or_default();
        let shape: Vec<String> = e.spec.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{name}:{{\"dtype\":{dtype},\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            shape.join(","),
            e.begin,
            e.end
        ));
    }
    json.push('}');
    let mut bytes = json.into_bytes();
    let pad = (8 - bytes.len() % 8) % 8;
    bytes.extend(std::iter::repeat_n(b' ', pad));
    let mut out = Vec::with_capacity(8 + bytes.len());
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&bytes);
    out
}

/// Writes one shard: create with a [`ShardLayout`], [`write`](Self::write) every
/// tensor's bytes (in parts, tensors in any order), then [`finish`](Self::finish).
/// Dropping an unfinished writer removes its temporary file.
#[derive(Debug)]
pub struct ShardWriter {
    out: Option<BufWriter<File>>,
    position: u64,
    tmp_path: PathBuf,
    final_path: PathBuf,
    layout: ShardLayout,
    index: HashMap<String, usize>,
    written: Vec<usize>,
}

/// `path` with `.tmp` appended to its file name.
pub fn tmp_path_for(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

impl ShardWriter {
    /// Creates `path.tmp`, sized to the final file, and writes the header.
    pub fn create(path: &Path, layout: ShardLayout) -> Result<Self, WriteError> {
        let tmp_path = tmp_path_for(path);
        let io = |source| WriteError::Io {
            path: tmp_path.clone(),
            source,
        };
        let file = File::create(&tmp_path).map_err(io)?;
        file.set_len(layout.file_size()).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(layout.header_bytes()).map_err(io)?;
        let index = layout
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.spec.name.clone(), i))
            .collect();
        let written = vec![0; layout.entries.len()];
        Ok(Self {
            out: Some(out),
            position: layout.header_bytes().len() as u64,
            tmp_path,
            final_path: path.to_path_buf(),
            layout,
            index,
            written,
        })
    }

    /// The layout being written.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Appends `bytes` to tensor `name`'s data.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<(), WriteError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| WriteError::UnknownTensor(name.to_string()))?;
        let entry = &self.layout.entries[i];
        let expected = entry.end - entry.begin;
        let done = self.written[i];
        if done + bytes.len() > expected {
            return Err(WriteError::Overflow {
                name: name.to_string(),
                written: done + bytes.len(),
                expected,
            });
        }
        let at = self.layout.header.len() as u64 + (entry.begin + done) as u64;
        let tmp_path = &self.tmp_path;
        let io = |source| WriteError::Io {
            path: tmp_path.clone(),
            source,
        };
        let Some(out) = self.out.as_mut() else {
            return Err(io(std::io::Error::other("writer already finished")));
        };
        if at != self.position {
            out.seek(SeekFrom::Start(at)).map_err(io)?;
        }
        out.write_all(bytes).map_err(io)?;
        self.position = at + bytes.len() as u64;
        self.written[i] = done + bytes.len();
        Ok(())
    }

    /// Checks that every tensor is complete, syncs the file and renames it into place.
    pub fn finish(mut self) -> Result<(), WriteError> {
        for (e, &w) in self.layout.entries.iter().zip(&self.written) {
            if w != e.end - e.begin {
                return Err(WriteError::Incomplete {
                    name: e.spec.name.clone(),
                    written: w,
                    expected: e.end - e.begin,
                });
            }
        }
        let io = |path: &Path, source| WriteError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(out) = self.out.take() {
            let file = out
                .into_inner()
                .map_err(|e| io(&self.tmp_path, e.into_error()))?;
            file.sync_all().map_err(|e| io(&self.tmp_path, e))?;
        }
        fs::rename(&self.tmp_path, &self.final_path).map_err(|e| io(&self.final_path, e))?;
        Ok(())
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            // Unfinished: best-effort removal of the partial temporary file.
            let _ = fs::remove_file(&self.tmp_path);
        }
    }
}

/// Writes a complete shard from in-memory tensors (used by the tiny-model generator and
/// tests). `tensors` yields `(spec, bytes)` pairs.
pub fn write_shard(path: &Path, tensors: Vec<(TensorSpec, Vec<u8>)>) -> Result<(), WriteError> {
    let layout = ShardLayout::new(tensors.iter().map(|(s, _)| s.clone()).collect())?;
    let mut writer = ShardWriter::create(path, layout)?;
    for (spec, bytes) in &tensors {
        writer.write(&spec.name, bytes)?;
    }
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_shard_header() {
        let layout = ShardLayout::new(Vec::new()).unwrap();
        assert_eq!(layout.header_bytes(), b"\x08\0\0\0\0\0\0\0{}      ");
    }

    #[test]
    fn matches_safetensors_crate_serialization() {
        use safetensors::tensor::TensorView;
        let specs = vec![
            TensorSpec::new("b.qs", Dtype::F32, vec![3]),
            TensorSpec::new("a", Dtype::U8, vec![5]),
            TensorSpec::new("B", Dtype::U8, vec![1]),
            TensorSpec::new("c", Dtype::F32, vec![2, 2]),
            TensorSpec::new("h", Dtype::BF16, vec![2]),
            TensorSpec::new("f8", Dtype::F8_E4M3, vec![2, 3]),
            TensorSpec::new("z", Dtype::F32, vec![0]),
        ];
        let data: Vec<Vec<u8>> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| vec![i as u8 + 1; s.byte_len().unwrap()])
            .collect();
        let views: Vec<(String, TensorView)> = specs
            .iter()
            .zip(&data)
            .map(|(s, d)| {
                (
                    s.name.clone(),
                    TensorView::new(s.dtype, s.shape.clone(), d).unwrap(),
                )
            })
            .collect();
        let expected = safetensors::serialize(views, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write_shard(&path, specs.into_iter().zip(data).collect()).unwrap();
        assert_eq!(fs::read(&path).unwrap(), expected);
        assert!(!tmp_path_for(&path).exists());
    }

    #[test]
    fn rejects_duplicates_overflow_and_incomplete() {
        let dup = ShardLayout::new(vec![
            TensorSpec::new("a", Dtype::U8, vec![1]),
            TensorSpec::new("a", Dtype::F32, vec![1]),
        ]);
        assert!(matches!(dup, Err(WriteError::DuplicateName(_))));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("y.safetensors");
        let layout = ShardLayout::new(vec![TensorSpec::new("a", Dtype::U8, vec![2])]).unwrap();
        let mut w = ShardWriter::create(&path, layout).unwrap();
        assert!(matches!(
            w.write("a", &[1, 2, 3]),
            Err(WriteError::Overflow { .. })
        ));
        assert!(matches!(
            w.write("b", &[1]),
            Err(WriteError::UnknownTensor(_))
        ));
        w.write("a", &[1]).unwrap();
        assert!(matches!(w.finish(), Err(WriteError::Incomplete { .. })));
        assert!(!tmp_path_for(&path).exists());
        assert!(!path.exists());
    }
}
