//! Slot memory: a fixed number of equal slots carved out of a few MLX-owned
//! arenas ([`WritableBuffer`]s), each slot addressed by (arena, byte offset).
//!
//! Every slot has a generation counter. A [`SlotHandle`] names a slot at one
//! generation; reassigning the slot (a new expert is loaded into it) bumps the
//! generation, after which every view or write through the old handle fails
//! with [`ExpertError::StaleHandle`].
//!
//! The store keeps the arena arrays alive for its whole life (MLX may
//! otherwise recycle their memory), and lives on the thread that drives MLX.

use super::{ExpertError, Result};
use crate::mlx::{Array, Dtype, WritableBuffer};

/// Smallest slot alignment (what O_DIRECT needs).
pub const MIN_ALIGNMENT: usize = 4096;
/// Default slot alignment (16 KiB: Apple page size, and a multiple of 4 KiB).
pub const DEFAULT_ALIGNMENT: usize = 16384;
/// Largest arena MLX can allocate through [`WritableBuffer`] (2³¹−1 bytes).
const MAX_ARENA: usize = i32::MAX as usize;

/// Slot pool geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlabConfig {
    /// Bytes every slot must hold (the widest expert layout).
    pub slot_bytes: usize,
    /// Number of slots.
    pub slots: usize,
    /// Slot base alignment: a power of two ≥ [`MIN_ALIGNMENT`].
    pub alignment: usize,
    /// Upper bound on one arena's size (slots are never split across arenas).
    pub max_arena_bytes: usize,
}

impl SlabConfig {
    /// `slots` slots of `slot_bytes`, 16 KiB aligned, arenas up to 2 GiB.
    pub fn new(slot_bytes: usize, slots: usize) -> Self {
        Self {
            slot_bytes,
            slots,
            alignment: DEFAULT_ALIGNMENT,
            max_arena_bytes: MAX_ARENA,
        }
    }

    /// The distance between slot bases: `slot_bytes` rounded up to the alignment.
    pub fn stride(&self) -> Result<usize> {
        self.validate()?;
        round_up(self.slot_bytes, self.alignment)
            .ok_or_else(|| ExpertError::Config("slot size overflows".into()))
    }

    fn validate(&self) -> Result<()> {
        if !self.alignment.is_power_of_two() || self.alignment < MIN_ALIGNMENT {
            return Err(ExpertError::Config(format!(
                "slot alignment {} must be a power of two ≥ {MIN_ALIGNMENT}",
                self.alignment
            )));
        }
        if self.slot_bytes == 0 || self.slots == 0 || self.slots > u32::MAX as usize {
            return Err(ExpertError::Config(format!(
                "{} slots of {} bytes",
                self.slots, self.slot_bytes
            )));
        }
        Ok(())
    }
}

/// Rounds `v` up to a multiple of the power of two `align`.
pub(crate) fn round_up(v: usize, align: usize) -> Option<usize> {
    Some(v.checked_add(align - 1)? & !(align - 1))
}

/// A slot at one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotHandle {
    /// Slot index in the pool.
    pub slot: u32,
    /// The generation the handle was issued at.
    pub generation: u64,
}

struct Arena {
    buffer: WritableBuffer,
    /// Bytes skipped at the start so that slot 0 is aligned.
    lead: usize,
    /// Host address of the buffer's first byte.
    addr: usize,
}

/// The slot pool's memory and generations.
pub struct SlabStore {
    arenas: Vec<Arena>,
    generations: Vec<u64>,
    stride: usize,
    slot_bytes: usize,
    per_arena: usize,
    alignment: usize,
}

impl SlabStore {
    /// Allocates the arenas (zero-filled MLX memory).
    pub fn new(config: &SlabConfig) -> Result<Self> {
        let stride = config.stride()?;
        let usable = config
            .max_arena_bytes
            .min(MAX_ARENA)
            .saturating_sub(config.alignment);
        let per_arena = (usable / stride).min(config.slots);
        if per_arena == 0 {
            return Err(ExpertError::Config(format!(
                "a slot stride of {stride} bytes does not fit an arena of {} bytes",
                config.max_arena_bytes
            )));
        }
        let mut arenas = Vec::new();
        let mut left = config.slots;
        while left > 0 {
            let n = left.min(per_arena);
            let buffer = WritableBuffer::new(n * stride + config.alignment)?;
            // SAFETY: only the address is read here; nothing is written.
            let (ptr, _) = unsafe { buffer.raw_parts() };
            let addr = ptr as usize;
            let lead = round_up(addr, config.alignment)
                .map(|a| a - addr)
                .ok_or_else(|| ExpertError::Config("arena address overflows".into()))?;
            arenas.push(Arena { buffer, lead, addr });
            left -= n;
        }
        Ok(Self {
            arenas,
            generations: vec![0; config.slots],
            stride,
            slot_bytes: config.slot_bytes,
            per_arena,
            alignment: config.alignment,
        })
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.generations.len()
    }

    /// Usable bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Distance between slot bases (the memory one slot costs).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Slot base alignment.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Number of arenas.
    pub fn arena_count(&self) -> usize {
        self.arenas.len()
    }

    /// The `uint8` array of arena `i` (for kernels that take arena + offset).
    pub fn arena(&self, i: usize) -> Option<&Array> {
        self.arenas.get(i).map(|a| a.buffer.as_array())
    }

    /// Where slot `slot` lives: (arena index, byte offset in that arena).
    pub fn location(&self, slot: u32) -> Result<(usize, usize)> {
        let s = self.index(slot)?;
        let arena = s / self.per_arena;
        Ok((
            arena,
            self.arenas[arena].lead + (s % self.per_arena) * self.stride,
        ))
    }

    /// The slot's current handle.
    pub fn current(&self, slot: u32) -> Result<SlotHandle> {
        let s = self.index(slot)?;
        Ok(SlotHandle {
            slot,
            generation: self.generations[s],
        })
    }

    /// Fails unless `handle` is the slot's current generation.
    pub fn check(&self, handle: SlotHandle) -> Result<()> {
        let current = self.current(handle.slot)?.generation;
        if current != handle.generation {
            return Err(ExpertError::StaleHandle {
                slot: handle.slot,
                generation: handle.generation,
                current,
            });
        }
        Ok(())
    }

    /// Starts a new generation of `slot` (it is being given to another
    /// expert): every older handle becomes stale.
    pub fn reassign(&mut self, slot: u32) -> Result<SlotHandle> {
        let s = self.index(slot)?;
        self.generations[s] += 1;
        Ok(SlotHandle {
            slot,
            generation: self.generations[s],
        })
    }

    /// A typed zero-copy view of `shape` elements of `dtype` at byte `offset`
    /// of the slot, valid only while `handle` is current.
    pub fn view(
        &self,
        handle: SlotHandle,
        offset: usize,
        shape: &[i32],
        dtype: Dtype,
    ) -> Result<Array> {
        self.check(handle)?;
        let bytes = shape.iter().try_fold(dtype.size(), |acc, &d| {
            usize::try_from(d).ok()?.checked_mul(acc)
        });
        let end = bytes.and_then(|b| b.checked_add(offset));
        if end.is_none_or(|e| e > self.slot_bytes) {
            return Err(ExpertError::OutOfSlot {
                slot: handle.slot,
                offset,
                end: end.unwrap_or(usize::MAX),
                slot_bytes: self.slot_bytes,
            });
        }
        let (arena, base) = self.location(handle.slot)?;
        Ok(self.arenas[arena]
            .buffer
            .view(base + offset, shape, dtype)?)
    }

    /// The host address of the slot's first byte at `handle`'s generation.
    pub fn address(&self, handle: SlotHandle) -> Result<usize> {
        self.check(handle)?;
        let (arena, base) = self.location(handle.slot)?;
        Ok(self.arenas[arena].addr + base)
    }

    /// The slot's host address and length at `handle`'s generation, for a
    /// load (writes through it follow the lease protocol, see `reader`).
    pub(crate) fn raw_target(&self, handle: SlotHandle) -> Result<(*mut u8, usize)> {
        self.check(handle)?;
        let (arena, base) = self.location(handle.slot)?;
        // SAFETY: only the base pointer is taken here; writes through it are
        // made by the I/O pool under the lease protocol.
        let (ptr, len) = unsafe { self.arenas[arena].buffer.raw_parts() };
        if base + self.slot_bytes > len {
            return Err(ExpertError::OutOfSlot {
                slot: handle.slot,
                offset: base,
                end: base + self.slot_bytes,
                slot_bytes: len,
            });
        }
        // SAFETY: `base + slot_bytes <= len` (checked above), so the offset
        // pointer stays inside the arena's allocation.
        Ok((unsafe { ptr.add(base) }, self.slot_bytes))
    }

    fn index(&self, slot: u32) -> Result<usize> {
        let s = slot as usize;
        if s >= self.generations.len() {
            return Err(ExpertError::SlotOutOfRange {
                slot,
                slots: self.generations.len(),
            });
        }
        Ok(s)
    }
}

impl std::fmt::Debug for SlabStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlabStore")
            .field("slots", &self.slots())
            .field("slot_bytes", &self.slot_bytes)
            .field("stride", &self.stride)
            .field("arenas", &self.arenas.len())
            .finish()
    }
}
