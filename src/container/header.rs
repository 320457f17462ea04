//! Safetensors shard headers, parsed defensively.
//!
//! The header is read with two positioned reads (the 8-byte length, then the JSON)
//! instead of mapping the file: a shard can be hundreds of GiB, and the reader only
//! needs the header at open. Parsing is our own rather than
//! `safetensors::SafeTensors::read_metadata` because the Colibri rules differ from
//! the library's: `U8` shapes are meaningless (§2, only the byte count counts),
//! gaps between tensors are tolerated, and every failure has to name the file and
//! the tensor. The `safetensors` crate still supplies the [`Dtype`] vocabulary.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::Deserialize;
use serde::de::{MapAccess, Visitor};

use super::error::{ContainerError, Result};

/// Largest header accepted, as in the engine (`c/st.h`): 512 MiB.
pub const MAX_HEADER_LEN: u64 = 512 << 20;

/// Largest number of `colibri.fmt` entries accepted per shard (engine limit).
pub const MAX_FMT_STAMPS: usize = 4096;

/// One tensor as listed in a shard header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    /// Tensor name.
    pub name: String,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape (meaningless for quantized `U8` blobs).
    pub shape: Vec<u64>,
    /// Start relative to the data section (`data_offsets[0]`).
    pub begin: u64,
    /// End relative to the data section (`data_offsets[1]`).
    pub end: u64,
}

/// A parsed and validated shard header.
#[derive(Debug, Clone, Default)]
pub struct ShardHeader {
    /// `N`, the JSON length; data starts at `8 + N`.
    pub header_len: u64,
    /// Bytes after the header.
    pub data_len: u64,
    /// Tensors sorted by `begin`.
    pub tensors: Vec<HeaderTensor>,
    /// `__metadata__` key/values other than the stamp map.
    pub metadata: HashMap<String, String>,
    /// The `colibri.fmt` map (tensor name → format name), empty when absent.
    pub fmt_stamps: HashMap<String, String>,
}

impl ShardHeader {
    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }
}

/// Reads and validates the header of the shard at `path` (two `pread`s).
pub fn read_shard_header(path: &Path) -> Result<(File, u64, ShardHeader)> {
    let io = |source| ContainerError::Io {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_size = file.metadata().map_err(io)?.len();
    if file_size < 8 {
        return Err(ContainerError::TruncatedFile {
            path: path.to_owned(),
            file_size,
        });
    }
    let mut prefix = [0u8; 8];
    read_at(&file, path, 0, &mut prefix)?;
    let header_len = u64::from_le_bytes(prefix);
    check_header_len(path, header_len, file_size)?;
    let mut json = vec![0u8; usize::try_from(header_len).unwrap_or(0)];
    read_at(&file, path, 8, &mut json)?;
    let header = parse_header_json(path, &json, header_len, file_size - 8 - header_len)?;
    Ok((file, file_size, header))
}

/// Parses a whole shard held in memory (used by tests and the fuzz target).
pub fn parse_shard_bytes(path: &Path, bytes: &[u8]) -> Result<ShardHeader> {
    let file_size = bytes.len() as u64;
    let Some(prefix) = bytes.get(..8) else {
        return Err(ContainerError::TruncatedFile {
            path: path.to_owned(),
            file_size,
        });
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(prefix);
    let header_len = u64::from_le_bytes(len);
    check_header_len(path, header_len, file_size)?;
    // check_header_len guarantees 8 + header_len <= bytes.len().
    let json = bytes.get(8..8 + header_len as usize).unwrap_or_default();
    parse_header_json(path, json, header_len, file_size - 8 - header_len)
}

fn check_header_len(path: &Path, header_len: u64, file_size: u64) -> Result<()> {
    if header_len > MAX_HEADER_LEN || header_len > file_size - 8 {
        return Err(ContainerError::HeaderTooLarge {
            path: path.to_owned(),
            header_len,
            file_size,
            limit: MAX_HEADER_LEN.min(file_size - 8),
        });
    }
    Ok(())
}

pub(crate) fn read_at(file: &File, path: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
    file.read_exact_at(buf, offset)
        .map_err(|source| ContainerError::ReadRange {
            path: path.to_owned(),
            offset,
            len: buf.len() as u64,
            source,
        })
}

/// The header's top-level object with duplicate keys preserved, so they can be
/// rejected (a plain map would silently keep the last one).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    out.push(entry);
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: Dtype,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses and validates header JSON. `data_len` is the byte count after it.
pub fn parse_header_json(
    path: &Path,
    json: &[u8],
    header_len: u64,
    data_len: u64,
) -> Result<ShardHeader> {
    let invalid = |reason: String| ContainerError::InvalidHeader {
        path: path.to_owned(),
        reason,
    };
    let text = std::str::from_utf8(json).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
    // Writers pad the JSON with trailing spaces; serde_json accepts trailing
    // whitespace, and leading whitespace too.
    let Entries(entries) = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
    let mut seen = HashSet::with_capacity(entries.len());
    let mut header = ShardHeader {
        header_len,
        data_len,
        ..ShardHeader::default()
    };
    for (name, value) in entries {
        if !seen.insert(name.clone()) {
            return Err(invalid(format!("key {name} appears twice")));
        }
        if name == "__metadata__" {
            parse_metadata(path, value, &mut header)?;
            continue;
        }
        let raw: RawInfo =
            serde_json::from_value(value).map_err(|e| invalid(format!("tensor {name}: {e}")))?;
        let (begin, end) = raw.data_offsets;
        if begin > end {
            return Err(invalid(format!(
                "tensor {name}: data_offsets [{begin}, {end}] are reversed"
            )));
        }
        if end > data_len {
            return Err(ContainerError::OutOfBounds {
                path: path.to_owned(),
                tensor: name,
                begin,
                end,
                data_len,
            });
        }
        header.tensors.push(HeaderTensor {
            name,
            dtype: raw.dtype,
            shape: raw.shape,
            begin,
            end,
        });
    }
    header.tensors.sort_by_key(|t| (t.begin, t.end));
    // Empty tensors occupy no bytes and cannot overlap anything.
    let mut prev: Option<&HeaderTensor> = None;
    for t in header.tensors.iter().filter(|t| t.end > t.begin) {
        if let Some(p) = prev {
            if t.begin < p.end {
                return Err(ContainerError::Overlap {
                    path: path.to_owned(),
                    first: p.name.clone(),
                    first_begin: p.begin,
                    first_end: p.end,
                    second: t.name.clone(),
                    second_begin: t.begin,
                    second_end: t.end,
                });
            }
        }
        prev = Some(t);
    }
    Ok(header)
}

fn parse_metadata(path: &Path, value: serde_json::Value, header: &mut ShardHeader) -> Result<()> {
    let invalid = |reason: String| ContainerError::InvalidHeader {
        path: path.to_owned(),
        reason,
    };
    let map: HashMap<String, String> = serde_json::from_value(value)
        .map_err(|e| invalid(format!("__metadata__ must map strings to strings: {e}")))?;
    for (key, value) in map {
        if key == "colibri.fmt" {
            let stamps: HashMap<String, String> = serde_json::from_str(&value)
                .map_err(|e| invalid(format!("colibri.fmt is not a name → format map: {e}")))?;
            if stamps.len() > MAX_FMT_STAMPS {
                return Err(invalid(format!(
                    "colibri.fmt has {} entries (limit {MAX_FMT_STAMPS})",
                    stamps.len()
                )));
            }
            header.fmt_stamps = stamps;
        } else {
            header.metadata.insert(key, value);
        }
    }
    Ok(())
}

/// The files of `dir` that are shards: regular files whose last extension is
/// `.safetensors`, sorted by path. `x.safetensors.tmp` and friends are skipped.
pub fn scan_shards(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |source| ContainerError::Io {
        path: dir.to_owned(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        let is_shard = path.extension().is_some_and(|e| e == "safetensors");
        if is_shard && path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}
