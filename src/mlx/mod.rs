//! A safe Rust layer over MLX's C++ API.
//!
//! MLX is bound through a narrow C++20 shim (`csrc/mlx_shim.cpp`) rather than
//! mlx-rs, whose build is macOS-only. Every C++ exception becomes an
//! [`MlxError`] carrying MLX's message, so bad shapes, dtypes or axes return
//! `Err` instead of aborting.
//!
//! Threading: MLX graphs are built and evaluated from one thread, so [`Array`]
//! is neither `Send` nor `Sync`. I/O threads may only write the bytes of a
//! [`WritableBuffer`] under the slot protocol described there.
//!
//! ```
//! use glm_stream::mlx::{Array, Dtype};
//! let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let b = a.matmul(&a)?;
//! assert_eq!(b.to_vec::<f32>()?, vec![7.0, 10.0, 15.0, 22.0]);
//! assert_eq!(b.dtype(), Dtype::Float32);
//! # Ok::<(), glm_stream::mlx::MlxError>(())
//! ```

pub(crate) mod array;
mod buffer;
mod device;
mod dtype;
mod error;
pub mod fast;
mod io;
mod kernel;
mod ops;
mod quantized;
pub(crate) mod sys;

pub use array::{Array, async_eval, eval};
pub use buffer::WritableBuffer;
pub use device::{
    Device, default_device, memory, new_stream, set_default_device, synchronize, version,
};
pub use dtype::{Dtype, Element};
pub use error::{MlxError, Result};
pub use io::{SafetensorsFile, load_safetensors};
pub use kernel::{
    Kernel, KernelBackend, KernelSpec, LaunchConfig, OutputSpec, PrecompiledKernel, TemplateArg,
};
pub use ops::{arange, checked_indices, concatenate, full, stack, r#where, zeros};
pub use quantized::{
    MLX_GROUP_SIZES, dequantize, gather_mm, gather_qmm, quantize, quantized_matmul,
};
