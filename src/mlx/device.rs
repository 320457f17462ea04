//! Devices, streams and MLX's memory counters.

use super::array::ffi;
use super::sys;
use super::{MlxError, Result};

/// Where MLX runs computations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (always present).
    Cpu,
    /// The GPU backend of this libmlx (Metal on macOS, CUDA on Linux builds).
    Gpu,
}

impl Device {
    fn code(self) -> i32 {
        match self {
            Device::Cpu => 0,
            Device::Gpu => 1,
        }
    }

    /// Whether this libmlx can run on the device here.
    pub fn is_available(self) -> bool {
        // SAFETY: no pointers; the shim catches exceptions and reports 0.
        unsafe { sys::mlxs_device_available(self.code()) != 0 }
    }
}

/// Sets the device that subsequent ops on this thread run on.
pub fn set_default_device(device: Device) -> Result<()> {
    if !device.is_available() {
        return Err(MlxError::invalid(
            "set_default_device",
            format!("{device:?} is not available in this libmlx"),
        ));
    }
    ffi!(
        "set_default_device",
        sys::mlxs_set_default_device(device.code())
    )
}

/// The device ops run on by default (the GPU when libmlx has one).
pub fn default_device() -> Device {
    // SAFETY: no pointers, cannot throw.
    if unsafe { sys::mlxs_default_device() } == 1 {
        Device::Gpu
    } else {
        Device::Cpu
    }
}

/// A new stream on `device`; returns MLX's stream index.
pub fn new_stream(device: Device) -> Result<i32> {
    let mut index = 0;
    ffi!(
        "new_stream",
        sys::mlxs_new_stream(device.code(), &mut index)
    )?;
    Ok(index)
}

/// Waits until every scheduled computation has finished.
pub fn synchronize() -> Result<()> {
    ffi!("synchronize", sys::mlxs_synchronize())
}

/// The libmlx version string.
pub fn version() -> String {
    // SAFETY: the shim returns a pointer to a static std::string.
    unsafe { std::ffi::CStr::from_ptr(sys::mlxs_version()) }
        .to_string_lossy()
        .into_owned()
}

/// MLX's allocator counters, in bytes.
pub mod memory {
    use super::sys;

    /// Bytes held by live arrays.
    pub fn active() -> usize {
        // SAFETY: plain counter read.
        unsafe { sys::mlxs_active_memory() }
    }

    /// Highest `active()` since start or the last [`reset_peak`].
    pub fn peak() -> usize {
        // SAFETY: plain counter read.
        unsafe { sys::mlxs_peak_memory() }
    }

    /// Restarts peak tracking.
    pub fn reset_peak() {
        // SAFETY: plain counter write.
        unsafe { sys::mlxs_reset_peak_memory() }
    }

    /// Bytes held in MLX's buffer cache (freed arrays kept for reuse).
    pub fn cache() -> usize {
        // SAFETY: plain counter read.
        unsafe { sys::mlxs_cache_memory() }
    }

    /// Returns cached buffers to the system.
    pub fn clear_cache() {
        // SAFETY: frees only buffers no array owns.
        unsafe { sys::mlxs_clear_cache() }
    }

    /// Sets the allocation limit; returns the previous one.
    pub fn set_limit(bytes: usize) -> usize {
        // SAFETY: plain setter.
        unsafe { sys::mlxs_set_memory_limit(bytes) }
    }

    /// Sets the buffer cache limit; returns the previous one.
    pub fn set_cache_limit(bytes: usize) -> usize {
        // SAFETY: plain setter.
        unsafe { sys::mlxs_set_cache_limit(bytes) }
    }
}
