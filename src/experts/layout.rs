//! Canonical slot layout of one routed expert: where its gate/up/down weights
//! and scales sit in a slot, and the file reads that put them there.
//!
//! The three weights are normally adjacent in one shard: then one read of
//! the 4096-aligned span covering them (O_DIRECT-able) lands each weight at
//! `its file offset − the span's aligned start`. That keeps a weight 16-byte
//! aligned (what the kernels need) exactly when its file offset is, which
//! holds for GLM shapes; otherwise each weight gets its own read at an
//! aligned slot position. The small scale tensors follow, each 64-byte
//! aligned, with one buffered read each (as colibri does).

use super::{ExpertError, Result};

/// O_DIRECT granularity for file offsets, lengths and buffer addresses.
pub const DIRECT_ALIGN: u64 = 4096;
/// Alignment the kernels need for every projection's weight and scales.
pub const KERNEL_ALIGN: usize = 16;
const SCALE_ALIGN: usize = 64;

/// The three projections of a SwiGLU expert, in canonical order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Projection {
    /// `gate_proj`, `[moe_inter, hidden]`.
    Gate,
    /// `up_proj`, `[moe_inter, hidden]`.
    Up,
    /// `down_proj`, `[hidden, moe_inter]`.
    Down,
}

impl Projection {
    /// Gate, up, down.
    pub const ALL: [Projection; 3] = [Projection::Gate, Projection::Up, Projection::Down];

    /// The tensor name part (`gate_proj`, …).
    pub fn name(self) -> &'static str {
        match self {
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }
}

/// A quantized matrix's storage format (Colibri int4 per-row / grouped, int8 per-row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProjectionFormat {
    /// 4 or 8.
    pub bits: u8,
    /// Columns per scale (int4 grouped); `None` for one scale per row.
    pub group_size: Option<u32>,
    /// Output rows `O`.
    pub rows: usize,
    /// Input columns `I`.
    pub cols: usize,
}

impl ProjectionFormat {
    /// Bytes of the packed weight (`O · ceil(I·bits/8)`), `None` on overflow.
    pub fn weight_bytes(&self) -> Option<usize> {
        let row = match self.bits {
            4 => self.cols.div_ceil(2),
            8 => self.cols,
            _ => return None,
        };
        row.checked_mul(self.rows)
    }

    /// Bytes of the F32 scales.
    pub fn scale_bytes(&self) -> Option<usize> {
        let per_row = match self.group_size {
            Some(0) => return None,
            Some(g) => self.cols.div_ceil(g as usize),
            None => 1,
        };
        per_row.checked_mul(self.rows)?.checked_mul(4)
    }
}

/// Where a tensor's bytes are: file index (into the source's file list),
/// absolute byte offset and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorExtent {
    /// Index of the shard file.
    pub file: usize,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The six tensors of one expert on disk, with their formats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertExtents {
    /// Gate, up, down weights.
    pub weights: [TensorExtent; 3],
    /// Gate, up, down scales (`.qs`).
    pub scales: [TensorExtent; 3],
    /// Gate, up, down formats.
    pub formats: [ProjectionFormat; 3],
}

/// One projection's place in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectionLayout {
    /// Storage format.
    pub format: ProjectionFormat,
    /// Byte offset of the packed weight in the slot.
    pub weight_offset: usize,
    /// Byte offset of the F32 scales in the slot.
    pub scale_offset: usize,
}

/// One file read into the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRead {
    /// Shard file index.
    pub file: usize,
    /// Absolute file offset of the first byte read.
    pub offset: u64,
    /// Bytes to read (may run past the end of file when 4096-rounded).
    pub len: u64,
    /// Bytes that must be read; fewer is a short read.
    pub min_len: u64,
    /// Slot byte offset the read starts at.
    pub slot_offset: usize,
    /// True when offset, length and slot offset are 4096-aligned, so the read
    /// may go through an O_DIRECT descriptor.
    pub direct_ok: bool,
}

/// The canonical slot layout of one expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLayout {
    /// Gate, up, down.
    pub projections: [ProjectionLayout; 3],
    /// The reads that fill the slot, weights first.
    pub reads: Vec<SlotRead>,
    /// Bytes of slot the layout uses.
    pub slot_bytes: usize,
    /// Bytes of tensor data (what a plain read of the six tensors moves).
    pub data_bytes: u64,
    /// True when the three weights come from one contiguous read.
    pub contiguous: bool,
}

impl SlotLayout {
    /// Computes the layout of expert `(layer, expert)` from its extents,
    /// checking every tensor's size against its format.
    pub fn plan(layer: u32, expert: u32, ext: &ExpertExtents) -> Result<Self> {
        let mismatch = |what: String, expected: u64, actual: u64| ExpertError::SizeMismatch {
            layer,
            expert,
            what,
            expected,
            actual,
        };
        let overflow = || ExpertError::Layout {
            layer,
            expert,
            message: "tensor sizes overflow".into(),
        };
        for (i, p) in Projection::ALL.iter().enumerate() {
            let f = &ext.formats[i];
            let wb = f.weight_bytes().ok_or_else(overflow)? as u64;
            let sb = f.scale_bytes().ok_or_else(overflow)? as u64;
            if ext.weights[i].len != wb {
                return Err(mismatch(
                    format!("{} weight", p.name()),
                    wb,
                    ext.weights[i].len,
                ));
            }
            if ext.scales[i].len != sb {
                return Err(mismatch(
                    format!("{} scales", p.name()),
                    sb,
                    ext.scales[i].len,
                ));
            }
            ext.weights[i]
                .offset
                .checked_add(wb)
                .and_then(|_| ext.scales[i].offset.checked_add(sb))
                .ok_or_else(overflow)?;
        }
        let mut order = [0usize, 1, 2];
        order.sort_by_key(|&i| ext.weights[i].offset);
        let w = &ext.weights;
        let contiguous = order.windows(2).all(|p| {
            let (a, b) = (&w[p[0]], &w[p[1]]);
            a.file == b.file && a.offset + a.len == b.offset
        }) && w.iter().all(|t| t.offset % KERNEL_ALIGN as u64 == 0);

        let mut reads = Vec::with_capacity(6);
        let mut weight_offset = [0usize; 3];
        let mut cursor: usize;
        if contiguous {
            let first = &w[order[0]];
            let last = &w[order[2]];
            let start = first.offset / DIRECT_ALIGN * DIRECT_ALIGN;
            let data_end = last.offset + last.len;
            let end = data_end.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            reads.push(SlotRead {
                file: first.file,
                offset: start,
                len: end - start,
                min_len: data_end - start,
                slot_offset: 0,
                direct_ok: true,
            });
            for i in 0..3 {
                weight_offset[i] = usize::try_from(w[i].offset - start).map_err(|_| overflow())?;
            }
            cursor = usize::try_from(end - start).map_err(|_| overflow())?;
        } else {
            cursor = 0;
            for i in 0..3 {
                let t = &w[i];
                let len = usize::try_from(t.len).map_err(|_| overflow())?;
                if t.offset % KERNEL_ALIGN as u64 == 0 {
                    let start = t.offset / DIRECT_ALIGN * DIRECT_ALIGN;
                    let end = (t.offset + t.len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                    reads.push(SlotRead {
                        file: t.file,
                        offset: start,
                        len: end - start,
                        min_len: t.offset + t.len - start,
                        slot_offset: cursor,
                        direct_ok: true,
                    });
                    weight_offset[i] = cursor + (t.offset - start) as usize;
                    cursor += (end - start) as usize;
                } else {
                    reads.push(SlotRead {
                        file: t.file,
                        offset: t.offset,
                        len: t.len,
                        min_len: t.len,
                        slot_offset: cursor,
                        direct_ok: false,
                    });
                    weight_offset[i] = cursor;
                    cursor = align(cursor + len, DIRECT_ALIGN as usize).ok_or_else(overflow)?;
                }
            }
        }
        let mut scale_offset = [0usize; 3];
        for (t, so) in ext.scales.iter().zip(&mut scale_offset) {
            cursor = align(cursor, SCALE_ALIGN).ok_or_else(overflow)?;
            *so = cursor;
            reads.push(SlotRead {
                file: t.file,
                offset: t.offset,
                len: t.len,
                min_len: t.len,
                slot_offset: cursor,
                direct_ok: false,
            });
            cursor = cursor
                .checked_add(usize::try_from(t.len).map_err(|_| overflow())?)
                .ok_or_else(overflow)?;
        }
        let projections = [0, 1, 2].map(|i| ProjectionLayout {
            format: ext.formats[i],
            weight_offset: weight_offset[i],
            scale_offset: scale_offset[i],
        });
        let data_bytes = w.iter().chain(&ext.scales).map(|t| t.len).sum();
        Ok(Self {
            projections,
            reads,
            slot_bytes: cursor,
            data_bytes,
            contiguous,
        })
    }

    /// The layout of projection `p`.
    pub fn projection(&self, p: Projection) -> &ProjectionLayout {
        &self.projections[p as usize]
    }
}

fn align(v: usize, a: usize) -> Option<usize> {
    Some(v.checked_add(a - 1)? / a * a)
}

/// The extents of routed expert `(layer, expert)` from an opened container
/// (file indices are the catalog's shard indices).
pub fn extents_from_container(
    container: &crate::container::ColibriContainer,
    layer: u32,
    expert: u32,
) -> Result<ExpertExtents> {
    let err = |message: String| ExpertError::Layout {
        layer,
        expert,
        message,
    };
    let infos = container
        .expert(layer as usize, expert as usize)
        .map_err(|e| err(e.to_string()))?;
    let mut weights = [TensorExtent {
        file: 0,
        offset: 0,
        len: 0,
    }; 3];
    let mut scales = weights;
    let mut formats = [ProjectionFormat {
        bits: 0,
        group_size: None,
        rows: 0,
        cols: 0,
    }; 3];
    for (i, info) in infos.iter().enumerate() {
        let q = info
            .quant_format()
            .ok_or_else(|| err(format!("{} is not quantized", info.name)))?;
        let s = info
            .scales
            .as_ref()
            .ok_or_else(|| err(format!("{} has no scales", info.name)))?;
        weights[i] = TensorExtent {
            file: info.entry.shard,
            offset: info.entry.offset,
            len: info.entry.len,
        };
        scales[i] = TensorExtent {
            file: s.shard,
            offset: s.offset,
            len: s.len,
        };
        formats[i] = ProjectionFormat {
            bits: q.bits,
            group_size: q.group_size,
            rows: q.rows,
            cols: q.cols,
        };
    }
    Ok(ExpertExtents {
        weights,
        scales,
        formats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glm_extents(format: impl Fn(usize, usize) -> ProjectionFormat, base: u64) -> ExpertExtents {
        let formats = [format(2048, 6144), format(2048, 6144), format(6144, 2048)];
        let mut off = base;
        let weights = formats.map(|f| {
            let len = f.weight_bytes().unwrap() as u64;
            let t = TensorExtent {
                file: 0,
                offset: off,
                len,
            };
            off += len;
            t
        });
        let scales = formats.map(|f| {
            let len = f.scale_bytes().unwrap() as u64;
            let t = TensorExtent {
                file: 0,
                offset: off,
                len,
            };
            off += len;
            t
        });
        ExpertExtents {
            weights,
            scales,
            formats,
        }
    }

    fn g64(rows: usize, cols: usize) -> ProjectionFormat {
        ProjectionFormat {
            bits: 4,
            group_size: Some(64),
            rows,
            cols,
        }
    }
    fn i4row(rows: usize, cols: usize) -> ProjectionFormat {
        ProjectionFormat {
            bits: 4,
            group_size: None,
            rows,
            cols,
        }
    }
    fn i8row(rows: usize, cols: usize) -> ProjectionFormat {
        ProjectionFormat {
            bits: 8,
            group_size: None,
            rows,
            cols,
        }
    }

    #[test]
    fn glm52_expert_sizes_match_the_spec() {
        for (f, bytes) in [
            (g64 as fn(usize, usize) -> ProjectionFormat, 21_233_664u64),
            (i4row, 18_915_328),
            (i8row, 37_789_696),
        ] {
            let l = SlotLayout::plan(3, 7, &glm_extents(f, 80 + 4096 * 3)).unwrap();
            assert_eq!(l.data_bytes, bytes);
            assert!(l.contiguous);
            assert_eq!(l.reads.len(), 4);
            assert!(l.slot_bytes as u64 >= bytes);
            for p in &l.projections {
                assert_eq!(p.weight_offset % KERNEL_ALIGN, 0);
                assert_eq!(p.scale_offset % KERNEL_ALIGN, 0);
            }
        }
    }

    #[test]
    fn unaligned_span_reads_per_projection() {
        let l = SlotLayout::plan(3, 7, &glm_extents(g64, 4096 + 6)).unwrap();
        assert!(!l.contiguous);
        assert_eq!(l.reads.len(), 6);
        for p in &l.projections {
            assert_eq!(p.weight_offset % KERNEL_ALIGN, 0);
        }
        // An aligned but non-adjacent expert: three direct-capable reads.
        let mut e = glm_extents(g64, 4096);
        e.weights[1].offset += 4096 * 100;
        let l = SlotLayout::plan(3, 7, &e).unwrap();
        assert!(!l.contiguous);
        assert!(
            l.reads[..3]
                .iter()
                .all(|r| r.direct_ok && r.slot_offset % 4096 == 0)
        );
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let mut e = glm_extents(g64, 4096);
        e.scales[2].len -= 4;
        assert!(matches!(
            SlotLayout::plan(4, 9, &e),
            Err(ExpertError::SizeMismatch {
                layer: 4,
                expert: 9,
                ..
            })
        ));
        let mut e = glm_extents(g64, 4096);
        e.weights[0].offset = u64::MAX - 3;
        assert!(SlotLayout::plan(4, 9, &e).is_err());
    }
}
