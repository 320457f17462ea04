//! Canonical slot layout of one routed expert: where its gate/up/down weights
//! and scales sit in a slot, and the file reads that put them there.
//!
//! The three weights are normally adjacent in one shard: then one read of
//! the 4096-aligned span covering them (O_DIRECT-able) lands each weight at
//! `its file offset − the span's aligned start`. That keeps a weight 16-byte
//! aligned (what the kernels need) exactly when its file offset is, which
//! holds for GLM shapes. Adjacent weights off that alignment (a safetensors
//! header is padded to 8 bytes only) still come in one O_DIRECT-able read,
//! into an aligned scratch buffer whose three pieces are copied to aligned
//! slot positions; weights that are not adjacent get one read each.
//!
//! The three scale tensors (`.qs`) are normally adjacent too (the converter's
//! safetensors writer puts every F32 tensor first, sorted by name, so an
//! expert's `down`/`gate`/`up` scales sit back to back in the F32 region).
//! Then they also come in one O_DIRECT-able read of their 4096-aligned span
//! ([`ScalePath`]): straight into the slot's scale area when their file
//! offsets are 16-byte aligned, otherwise into an aligned scratch buffer
//! whose pieces are copied to 64-byte aligned slot positions
//! ([`StagedRead`]). Scales that are not adjacent get one buffered read each.

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

/// One piece of a [`StagedRead`]: `len` bytes at `read_offset` of the read
/// go to `slot_offset` of the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPiece {
    /// Byte offset in the read's buffer.
    pub read_offset: usize,
    /// Slot byte offset the piece is copied to.
    pub slot_offset: usize,
    /// Bytes copied.
    pub len: usize,
}

/// One 4096-aligned file read into a scratch buffer, whose pieces are then
/// copied into the slot (adjacent tensors whose file offsets would land
/// off the kernels' alignment if read in place).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedRead {
    /// Shard file index.
    pub file: usize,
    /// Absolute, 4096-aligned file offset of the first byte read.
    pub offset: u64,
    /// Bytes to read, a multiple of 4096 (may run past the end of file).
    pub len: u64,
    /// Bytes that must be read; fewer is a short read.
    pub min_len: u64,
    /// What goes where in the slot.
    pub pieces: Vec<StagedPiece>,
}

/// How an expert's three scale tensors get into the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScalePath {
    /// Adjacent and 16-byte aligned in the file: one O_DIRECT-able read of
    /// their 4096-aligned span straight into the slot.
    SpanInSlot,
    /// Adjacent but not 16-byte aligned: one O_DIRECT-able read of the span
    /// into scratch, then three copies to aligned slot positions.
    SpanStaged,
    /// Not adjacent (other files or gaps): one buffered read per tensor.
    PerTensor,
}

/// The canonical slot layout of one expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLayout {
    /// Gate, up, down.
    pub projections: [ProjectionLayout; 3],
    /// The reads that fill the slot directly, weights first.
    pub reads: Vec<SlotRead>,
    /// Reads through a scratch buffer: the weight span when the weights are
    /// adjacent but off the kernels' alignment, the scale span when the
    /// scales are ([`ScalePath::SpanStaged`]).
    pub staged: Vec<StagedRead>,
    /// How the scales are read.
    pub scale_path: ScalePath,
    /// Bytes of slot the layout uses.
    pub slot_bytes: usize,
    /// Bytes of tensor data (what a plain read of the six tensors moves).
    pub data_bytes: u64,
    /// True when the three weights come from one contiguous read straight
    /// into the slot (adjacent and 16-byte aligned in the file).
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
        let adjacent = order.windows(2).all(|p| {
            let (a, b) = (&w[p[0]], &w[p[1]]);
            a.file == b.file && a.offset + a.len == b.offset
        });
        let contiguous = adjacent && w.iter().all(|t| t.offset % KERNEL_ALIGN as u64 == 0);

        let mut reads = Vec::with_capacity(6);
        let mut staged = Vec::new();
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
        } else if adjacent {
            // One aligned read of the span into scratch; each weight is copied
            // to a 4096-aligned slot position.
            let first = &w[order[0]];
            let last = &w[order[2]];
            let start = first.offset / DIRECT_ALIGN * DIRECT_ALIGN;
            let data_end = last.offset + last.len;
            let end = data_end
                .div_ceil(DIRECT_ALIGN)
                .checked_mul(DIRECT_ALIGN)
                .ok_or_else(overflow)?;
            cursor = 0;
            let mut pieces = Vec::with_capacity(3);
            for i in 0..3 {
                let len = usize::try_from(w[i].len).map_err(|_| overflow())?;
                weight_offset[i] = cursor;
                pieces.push(StagedPiece {
                    read_offset: usize::try_from(w[i].offset - start).map_err(|_| overflow())?,
                    slot_offset: cursor,
                    len,
                });
                cursor = cursor
                    .checked_add(len)
                    .and_then(|c| align(c, DIRECT_ALIGN as usize))
                    .ok_or_else(overflow)?;
            }
            staged.push(StagedRead {
                file: first.file,
                offset: start,
                len: end - start,
                min_len: data_end - start,
                pieces,
            });
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
        let sc = &ext.scales;
        let mut sorder = [0usize, 1, 2];
        sorder.sort_by_key(|&i| sc[i].offset);
        let scales_adjacent = sorder.windows(2).all(|p| {
            let (a, b) = (&sc[p[0]], &sc[p[1]]);
            a.file == b.file && a.offset + a.len == b.offset
        });
        let scale_path = if !scales_adjacent {
            ScalePath::PerTensor
        } else if sc.iter().all(|t| t.offset % KERNEL_ALIGN as u64 == 0) {
            ScalePath::SpanInSlot
        } else {
            ScalePath::SpanStaged
        };
        let (span_start, span_data_end) = {
            let first = &sc[sorder[0]];
            let last = &sc[sorder[2]];
            (
                first.offset / DIRECT_ALIGN * DIRECT_ALIGN,
                last.offset + last.len,
            )
        };
        let span_end = span_data_end
            .div_ceil(DIRECT_ALIGN)
            .checked_mul(DIRECT_ALIGN)
            .ok_or_else(overflow)?;
        match scale_path {
            ScalePath::SpanInSlot => {
                cursor = align(cursor, DIRECT_ALIGN as usize).ok_or_else(overflow)?;
                reads.push(SlotRead {
                    file: sc[sorder[0]].file,
                    offset: span_start,
                    len: span_end - span_start,
                    min_len: span_data_end - span_start,
                    slot_offset: cursor,
                    direct_ok: true,
                });
                for (t, so) in sc.iter().zip(&mut scale_offset) {
                    *so =
                        cursor + usize::try_from(t.offset - span_start).map_err(|_| overflow())?;
                }
                cursor = cursor
                    .checked_add(usize::try_from(span_end - span_start).map_err(|_| overflow())?)
                    .ok_or_else(overflow)?;
            }
            ScalePath::SpanStaged => {
                let mut pieces = Vec::with_capacity(3);
                for (t, so) in sc.iter().zip(&mut scale_offset) {
                    cursor = align(cursor, SCALE_ALIGN).ok_or_else(overflow)?;
                    *so = cursor;
                    let len = usize::try_from(t.len).map_err(|_| overflow())?;
                    pieces.push(StagedPiece {
                        read_offset: usize::try_from(t.offset - span_start)
                            .map_err(|_| overflow())?,
                        slot_offset: cursor,
                        len,
                    });
                    cursor = cursor.checked_add(len).ok_or_else(overflow)?;
                }
                staged.push(StagedRead {
                    file: sc[sorder[0]].file,
                    offset: span_start,
                    len: span_end - span_start,
                    min_len: span_data_end - span_start,
                    pieces,
                });
            }
            ScalePath::PerTensor => {
                for (t, so) in sc.iter().zip(&mut scale_offset) {
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
            }
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
            staged,
            scale_path,
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
            // One weight span and one scale span, both O_DIRECT-able.
            assert_eq!(l.reads.len(), 2);
            assert!(l.reads.iter().all(|r| r.direct_ok));
            assert_eq!(l.scale_path, ScalePath::SpanInSlot);
            assert!(l.slot_bytes as u64 >= bytes);
            for p in &l.projections {
                assert_eq!(p.weight_offset % KERNEL_ALIGN, 0);
                assert_eq!(p.scale_offset % KERNEL_ALIGN, 0);
            }
        }
    }

    #[test]
    fn unaligned_adjacent_spans_are_staged() {
        // Adjacent but 6 mod 16: both spans staged through scratch.
        let l = SlotLayout::plan(3, 7, &glm_extents(g64, 4096 + 6)).unwrap();
        assert!(!l.contiguous);
        assert!(l.reads.is_empty());
        assert_eq!(l.scale_path, ScalePath::SpanStaged);
        assert_eq!(l.staged.len(), 2);
        for st in &l.staged {
            assert_eq!(st.offset % DIRECT_ALIGN, 0);
            assert_eq!(st.len % DIRECT_ALIGN, 0);
            assert!(
                st.pieces
                    .iter()
                    .all(|p| p.slot_offset + p.len <= l.slot_bytes)
            );
        }
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

    /// The converter's safetensors order: every F32 `.qs` first, sorted by
    /// name (down, gate, up), then the U8 weights in the same order.
    fn colibri_extents(f32_base: u64, u8_base: u64) -> ExpertExtents {
        let formats = [g64(2048, 6144), g64(2048, 6144), g64(6144, 2048)];
        let by_name = [2usize, 0, 1]; // down, gate, up
        let mut weights = [TensorExtent {
            file: 0,
            offset: 0,
            len: 0,
        }; 3];
        let mut scales = weights;
        let (mut fo, mut uo) = (f32_base, u8_base);
        for &i in &by_name {
            let sl = formats[i].scale_bytes().unwrap() as u64;
            scales[i] = TensorExtent {
                file: 0,
                offset: fo,
                len: sl,
            };
            fo += sl;
            let wl = formats[i].weight_bytes().unwrap() as u64;
            weights[i] = TensorExtent {
                file: 0,
                offset: uo,
                len: wl,
            };
            uo += wl;
        }
        ExpertExtents {
            weights,
            scales,
            formats,
        }
    }

    #[test]
    fn colibri_order_reads_scales_in_one_span() {
        // 16-aligned offsets: both spans land in the slot directly.
        let l = SlotLayout::plan(1, 2, &colibri_extents(4096 + 32, 1 << 30)).unwrap();
        assert!(l.contiguous);
        assert_eq!(l.scale_path, ScalePath::SpanInSlot);
        assert_eq!(l.reads.len(), 2);
        assert!(l.staged.is_empty());
        let s = &l.reads[1];
        assert!(s.direct_ok && s.offset % DIRECT_ALIGN == 0 && s.len % DIRECT_ALIGN == 0);
        assert_eq!(s.slot_offset % DIRECT_ALIGN as usize, 0);
        assert!(s.slot_offset + s.len as usize <= l.slot_bytes);
        // Down's scales come first in the file, then gate's, then up's.
        let [g, u, d] = l.projections.map(|p| p.scale_offset);
        assert_eq!(g - d, 786_432);
        assert_eq!(u - g, 786_432);
        assert_eq!(d, s.slot_offset + 32);
        // 8 mod 16 (a header padded to 8 only): one staged span read.
        let l = SlotLayout::plan(1, 2, &colibri_extents(4096 + 8, (1 << 30) + 8)).unwrap();
        assert_eq!(l.scale_path, ScalePath::SpanStaged);
        assert!(!l.contiguous && l.reads.is_empty());
        assert_eq!(l.staged.len(), 2, "weight span and scale span");
        let st = &l.staged[1];
        assert_eq!((st.offset, st.len), (4096, 3 * 786_432 + 4096));
        assert_eq!(st.min_len, 3 * 786_432 + 8);
        let mut pieces = st.pieces.clone();
        pieces.sort_by_key(|p| p.read_offset);
        assert_eq!(
            pieces.iter().map(|p| p.read_offset).collect::<Vec<_>>(),
            [8, 8 + 786_432, 8 + 2 * 786_432]
        );
        for p in &l.projections {
            assert_eq!(p.scale_offset % 64, 0);
        }
        assert!(l.slot_bytes >= l.projections.map(|p| p.scale_offset + 786_432)[2]);
    }

    #[test]
    fn non_adjacent_scales_fall_back_to_per_tensor_reads() {
        let mut e = colibri_extents(4096, 1 << 30);
        e.scales[1].offset += 4; // a gap between gate's and up's scales
        let l = SlotLayout::plan(1, 2, &e).unwrap();
        assert_eq!(l.scale_path, ScalePath::PerTensor);
        assert!(l.staged.is_empty());
        assert_eq!(l.reads.len(), 4);
        assert!(l.reads[1..].iter().all(|r| !r.direct_ok));
        let mut e = colibri_extents(4096, 1 << 30);
        e.scales[2].file = 1; // another shard
        let l = SlotLayout::plan(1, 2, &e).unwrap();
        assert_eq!(l.scale_path, ScalePath::PerTensor);
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
