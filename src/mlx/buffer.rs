//! MLX-owned memory that Rust writes in place: the basis of expert slots.
//!
//! MLX copies host memory when it wraps it on the CPU and CUDA backends, so a
//! slot is instead allocated by MLX once and filled through a host pointer.
//! The rule that makes this sound: **bytes may be written only while no MLX
//! array or computation can read them.** [`WritableBuffer::bytes_mut`] checks
//! this at run time (the buffer's handle must be the only reference to the
//! array and to its memory: no live view, no pending graph node, no in-flight
//! evaluation holds it), so the safe API cannot race with a computation.
//!
//! On the CUDA backend MLX keeps references to a computation's arrays until
//! the GPU reports completion, a few microseconds after `eval` returns
//! (measured on the H200). So a buffer that looks shared is re-checked after
//! [`synchronize`](super::synchronize) before it is called busy.

use super::array::ffi;
use super::ops::array_op;
use super::sys;
use super::{Array, Dtype, MlxError, Result};

/// How long completion handlers get to release a synchronized computation's
/// references (they take microseconds; this bounds a real reader's cost).
const EXCLUSIVE_GRACE: std::time::Duration = std::time::Duration::from_millis(20);

/// A fixed-size, row-contiguous `uint8` MLX array with a stable host pointer.
pub struct WritableBuffer {
    array: Array,
    ptr: *mut u8,
    len: usize,
}

impl WritableBuffer {
    /// Allocates and zero-fills `len` bytes (1 ..= 2³¹−1) in MLX memory.
    pub fn new(len: usize) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        let mut ptr = std::ptr::null_mut();
        ffi!(
            "writable_buffer",
            sys::mlxs_writable_buffer(&mut raw, &mut ptr, len)
        )?;
        let array = Array::from_raw("writable_buffer", raw)?;
        if ptr.is_null() {
            return Err(MlxError::invalid(
                "writable_buffer",
                "MLX returned a null data pointer",
            ));
        }
        Ok(Self { array, ptr, len })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when nothing but this buffer references its memory.
    pub fn is_exclusive(&self) -> bool {
        // SAFETY: the handle is alive for the borrow of `self`.
        unsafe { sys::mlxs_array_is_exclusive(self.array.as_ptr()) != 0 }
    }

    /// The bytes, for writing. Fails with [`MlxError::BufferBusy`] while any
    /// view or computation still references the buffer: drop views and
    /// evaluate (or synchronize) first.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.wait_exclusive()?;
        // SAFETY: `ptr` points at `len` bytes owned by `self.array`, which lives
        // as long as `self`. The exclusivity check proves no other MLX array or
        // scheduled computation refers to this memory, and `&mut self` prevents
        // new views from being made while the slice is borrowed.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Waits for completed GPU work to drop its references; a reference that
    /// survives a synchronize and a short grace period is a real reader.
    fn wait_exclusive(&self) -> Result<()> {
        if self.is_exclusive() {
            return Ok(());
        }
        super::synchronize()?;
        let deadline = std::time::Instant::now() + EXCLUSIVE_GRACE;
        while !self.is_exclusive() {
            if std::time::Instant::now() >= deadline {
                return Err(MlxError::BufferBusy { bytes: self.len });
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// The host address and length, for the slot store's I/O threads.
    ///
    /// # Safety
    /// The caller must guarantee that writes through the pointer happen only
    /// while no MLX computation reads the written range (the slot lease/fence
    /// protocol), and that `self` outlives every use of the pointer.
    pub unsafe fn raw_parts(&self) -> (*mut u8, usize) {
        (self.ptr, self.len)
    }

    /// A typed view of `len_elems` elements of `dtype` starting at byte
    /// `offset`, reshaped to `shape`. `offset` must be a multiple of the
    /// element size. Shares memory with the buffer (no copy).
    pub fn view(&self, offset: usize, shape: &[i32], dtype: Dtype) -> Result<Array> {
        let numel: usize = shape.iter().map(|&d| d.max(0) as usize).product();
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| MlxError::invalid("buffer view", "size overflows"))?;
        let end = offset
            .checked_add(bytes)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                MlxError::invalid(
                    "buffer view",
                    format!(
                        "bytes {offset}..{} exceed the buffer of {} bytes",
                        offset.saturating_add(bytes),
                        self.len
                    ),
                )
            })?;
        if offset % dtype.size() != 0 {
            return Err(MlxError::invalid(
                "buffer view",
                format!("offset {offset} is not a multiple of the {dtype:?} element size"),
            ));
        }
        let start = [offset as i32];
        let stop = [end as i32];
        let stride = [1i32];
        let bytes_view = array_op!("buffer view", |out| sys::mlxs_slice(
            &mut out,
            self.array.as_ptr(),
            start.as_ptr(),
            stop.as_ptr(),
            stride.as_ptr(),
            1
        ))?;
        let typed = if dtype == Dtype::Uint8 {
            bytes_view
        } else {
            bytes_view.view(dtype)?
        };
        typed.reshape(shape)
    }

    /// The whole buffer as a `uint8` array (shares memory).
    pub fn as_array(&self) -> &Array {
        &self.array
    }
}

impl std::fmt::Debug for WritableBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritableBuffer")
            .field("len", &self.len)
            .finish()
    }
}
