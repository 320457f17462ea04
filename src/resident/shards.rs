//! Shard files opened lazily, on the first read of a tensor they own.
//!
//! The container keeps its own handles for header scanning; the resident view
//! reads tensor bytes through these handles instead, opened by path on first
//! use, so that only the shards that own resident tensors are ever opened for
//! data and a shard deleted or replaced after `open` is reported by name.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::fs::File;
use std::os::unix::fs::FileExt;

use super::error::{ResidentError, Result};
use crate::container::{ColibriContainer, TensorEntry};

/// Per-shard handles, opened on first read.
#[derive(Debug, Default)]
pub(crate) struct ShardFiles {
    open: RefCell<BTreeMap<usize, File>>,
}

impl ShardFiles {
    /// Shards opened so far.
    pub(crate) fn count(&self) -> usize {
        self.open.borrow().len()
    }

    /// Sum of the sizes (at container open) of the shards opened so far.
    pub(crate) fn bytes(&self, container: &ColibriContainer) -> u64 {
        let shards = &container.catalog().shards;
        self.open
            .borrow()
            .keys()
            .filter_map(|&i| shards.get(i))
            .map(|s| s.file_size)
            .sum()
    }

    /// Reads `dst.len()` bytes starting `start` bytes into `entry` (a tensor of
    /// the resident weight `name`), opening its shard if this is its first read.
    pub(crate) fn read_into(
        &self,
        container: &ColibriContainer,
        name: &str,
        entry: &TensorEntry,
        start: u64,
        dst: &mut [u8],
    ) -> Result<()> {
        let shard =
            container
                .catalog()
                .shard_of(entry)
                .ok_or_else(|| ResidentError::ShardChanged {
                    name: name.to_owned(),
                    path: Default::default(),
                    reason: format!("shard index {} is not in the catalog", entry.shard),
                })?;
        let len = dst.len() as u64;
        if start.checked_add(len).is_none_or(|end| end > entry.len) {
            return Err(ResidentError::Read {
                name: name.to_owned(),
                path: shard.path.clone(),
                offset: entry.offset.saturating_add(start),
                len,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("range outside tensor {}", entry.name),
                ),
            });
        }
        let mut open = self.open.borrow_mut();
        let file = match open.entry(entry.shard) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                let open_err = |source| ResidentError::ShardOpen {
                    name: name.to_owned(),
                    path: shard.path.clone(),
                    source,
                };
                let file = File::open(&shard.path).map_err(open_err)?;
                let size = file.metadata().map_err(open_err)?.len();
                if size != shard.file_size {
                    return Err(ResidentError::ShardChanged {
                        name: name.to_owned(),
                        path: shard.path.clone(),
                        reason: format!(
                            "{size} bytes now, {} bytes when the container was opened",
                            shard.file_size
                        ),
                    });
                }
                v.insert(file)
            }
        };
        let offset = entry.offset.saturating_add(start);
        file.read_exact_at(dst, offset)
            .map_err(|source| ResidentError::Read {
                name: name.to_owned(),
                path: shard.path.clone(),
                offset,
                len,
                source,
            })
    }

    /// Reads the whole of `entry`.
    pub(crate) fn read_all(
        &self,
        container: &ColibriContainer,
        name: &str,
        entry: &TensorEntry,
    ) -> Result<Vec<u8>> {
        let len = usize::try_from(entry.len).map_err(|_| ResidentError::TooLarge {
            name: name.to_owned(),
            value: usize::MAX,
        })?;
        let mut buf = vec![0u8; len];
        self.read_into(container, name, entry, 0, &mut buf)?;
        Ok(buf)
    }
}
