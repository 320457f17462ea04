use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_void;
use std::ptr::{self, NonNull};

use super::sys;
use super::{Dtype, Element, MlxError, Result};

/// Reads the shim's thread-local error message after a failed call.
pub(crate) fn last_error(op: &'static str) -> MlxError {
    // SAFETY: the shim returns a pointer to a thread-local std::string that
    // stays valid until the next failing call on this thread; we copy it now.
    let message = unsafe { CStr::from_ptr(sys::mlxs_last_error()) }
        .to_string_lossy()
        .into_owned();
    MlxError::Op { op, message }
}

/// Calls a shim function, mapping a non-zero status to `MlxError::Op`.
///
/// Every FFI call of the binding goes through this macro, so its one `unsafe`
/// block carries the contract for all of them. SAFETY: each pointer argument is
/// either `Array::as_ptr()` of an `Array` borrowed for the whole call (so the
/// handle is alive), null where the shim documents an optional argument, or a
/// pointer into a Rust slice/CString that outlives the call with the length
/// passed beside it; output pointers point at live locals. The shim catches
/// every C++ exception, so no unwinding crosses the boundary.
macro_rules! ffi {
    ($op:expr, $call:expr) => {{
        let rc = unsafe { $call };
        if rc != 0 {
            Err($crate::mlx::array::last_error($op))
        } else {
            Ok(())
        }
    }};
}
pub(crate) use ffi;

/// An owned handle to an MLX array (lazy until evaluated).
///
/// `Drop` frees the handle; `Clone` makes another handle to the same array
/// (cheap, no data copy). Arrays are deliberately neither `Send` nor `Sync`:
/// one thread builds and evaluates MLX graphs.
pub struct Array {
    raw: NonNull<sys::mlxs_array>,
}

impl Array {
    /// Wraps a handle returned by the shim. Returns an error for null.
    pub(crate) fn from_raw(op: &'static str, raw: *mut sys::mlxs_array) -> Result<Self> {
        NonNull::new(raw)
            .map(|raw| Self { raw })
            .ok_or_else(|| MlxError::invalid(op, "shim returned a null array"))
    }

    /// Runs a shim function that writes one output array.
    pub(crate) fn build(
        op: &'static str,
        f: impl FnOnce(*mut *mut sys::mlxs_array) -> std::os::raw::c_int,
    ) -> Result<Self> {
        let mut out = ptr::null_mut();
        let rc = f(&mut out);
        if rc != 0 {
            return Err(last_error(op));
        }
        Self::from_raw(op, out)
    }

    pub(crate) fn as_ptr(&self) -> *const sys::mlxs_array {
        self.raw.as_ptr()
    }

    /// Copies `data` into a new array of the given shape. The product of the
    /// shape must equal `data.len()`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Self> {
        let n = checked_numel("from_slice", shape)?;
        if n != data.len() {
            return Err(MlxError::invalid(
                "from_slice",
                format!(
                    "shape {shape:?} holds {n} elements, data has {}",
                    data.len()
                ),
            ));
        }
        let mut out = ptr::null_mut();
        ffi!(
            "from_slice",
            sys::mlxs_array_from_data(
                &mut out,
                data.as_ptr().cast::<c_void>(),
                shape.as_ptr(),
                shape.len(),
                T::DTYPE.code()
            )
        )?;
        Self::from_raw("from_slice", out)
    }

    /// Copies raw little-endian bytes into a new array of `dtype` and `shape`.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Self> {
        let n = checked_numel("from_bytes", shape)?;
        if n.checked_mul(dtype.size()) != Some(bytes.len()) {
            return Err(MlxError::invalid(
                "from_bytes",
                format!(
                    "shape {shape:?} of {dtype:?} needs {} bytes, got {}",
                    n.saturating_mul(dtype.size()),
                    bytes.len()
                ),
            ));
        }
        let flat = Self::from_slice(bytes, &[bytes.len() as i32])?;
        if dtype == Dtype::Uint8 {
            return flat.reshape(shape);
        }
        flat.view(dtype)?.reshape(shape)
    }

    /// A 0-d float32 array (or `dtype` after a cast).
    pub fn scalar(value: f32, dtype: Dtype) -> Result<Self> {
        Self::build("scalar", |out| {
            // SAFETY: `out` is a live local of the `build` helper.
            unsafe { sys::mlxs_array_scalar_f32(out, value, dtype.code()) }
        })
    }

    /// A 0-d integer array (or `dtype` after a cast).
    pub fn scalar_int(value: i32, dtype: Dtype) -> Result<Self> {
        Self::build("scalar_int", |out| {
            // SAFETY: `out` is a live local of the `build` helper.
            unsafe { sys::mlxs_array_scalar_i32(out, value, dtype.code()) }
        })
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        // SAFETY: the handle is alive for the borrow of `self`.
        let code = unsafe { sys::mlxs_array_dtype(self.as_ptr()) };
        Dtype::from_code(code).unwrap_or(Dtype::Uint8)
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        // SAFETY: the handle is alive for the borrow of `self`.
        unsafe { sys::mlxs_array_ndim(self.as_ptr()) }
    }

    /// The shape (MLX uses `i32` dimensions).
    pub fn shape(&self) -> Vec<i32> {
        let mut dims = vec![0i32; self.ndim()];
        // SAFETY: `dims` has exactly `ndim` slots, which is what the shim writes.
        unsafe { sys::mlxs_array_shape(self.as_ptr(), dims.as_mut_ptr()) };
        dims
    }

    /// Size of one axis (negative axes count from the end).
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let nd = shape.len() as i32;
        let a = if axis < 0 { axis + nd } else { axis };
        if !(0..nd).contains(&a) {
            return Err(MlxError::invalid(
                "dim",
                format!("axis {axis} out of range for {nd}-d array"),
            ));
        }
        Ok(shape[a as usize])
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        // SAFETY: the handle is alive for the borrow of `self`.
        unsafe { sys::mlxs_array_size(self.as_ptr()) }
    }

    /// Logical size in bytes.
    pub fn nbytes(&self) -> usize {
        // SAFETY: the handle is alive for the borrow of `self`.
        unsafe { sys::mlxs_array_nbytes(self.as_ptr()) }
    }

    /// Evaluates this array now.
    pub fn eval(&self) -> Result<()> {
        eval(&[self])
    }

    /// Copies the contents out as a row-major `Vec<T>`. Evaluates the array;
    /// `T` must match the dtype exactly (cast first with [`Array::astype`]).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let actual = self.dtype();
        if actual != T::DTYPE {
            return Err(MlxError::DtypeMismatch {
                op: "to_vec",
                expected: T::DTYPE,
                actual,
            });
        }
        let mut out = vec![T::default(); self.size()];
        let nbytes = std::mem::size_of_val(out.as_slice());
        ffi!(
            "to_vec",
            sys::mlxs_array_read(self.as_ptr(), out.as_mut_ptr().cast::<c_void>(), nbytes)
        )?;
        Ok(out)
    }

    /// The value of a one-element array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(MlxError::invalid(
                "item",
                format!("array of shape {:?} has no single item", self.shape()),
            ));
        }
        Ok(self.to_vec::<T>()?[0])
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        let mut out = ptr::null_mut();
        // SAFETY: the handle is alive; copying an mlx::array handle only bumps a
        // shared_ptr and cannot throw except on allocation failure.
        let rc = unsafe { sys::mlxs_array_clone(&mut out, self.as_ptr()) };
        match NonNull::new(out) {
            Some(raw) if rc == 0 => Self { raw },
            _ => panic!("out of memory while cloning an MLX array handle"),
        }
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim, is owned by this value and is
        // freed exactly once here.
        unsafe { sys::mlxs_array_free(self.raw.as_ptr()) }
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array({:?}, {:?})", self.dtype(), self.shape())
    }
}

fn checked_numel(op: &'static str, shape: &[i32]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        if d < 0 {
            return Err(MlxError::invalid(
                op,
                format!("negative dimension in shape {shape:?}"),
            ));
        }
        acc.checked_mul(d as usize)
            .ok_or_else(|| MlxError::invalid(op, format!("shape {shape:?} overflows")))
    })
}

fn handles(arrays: &[&Array]) -> Vec<*const sys::mlxs_array> {
    arrays.iter().map(|a| a.as_ptr()).collect()
}

/// Evaluates several arrays together (one graph walk).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let h = handles(arrays);
    ffi!("eval", sys::mlxs_eval(h.as_ptr(), h.len()))
}

/// Schedules evaluation and returns at once; reading the arrays (or
/// [`synchronize`](super::synchronize)) waits for the result.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let h = handles(arrays);
    ffi!("async_eval", sys::mlxs_async_eval(h.as_ptr(), h.len()))
}

pub(crate) fn handle_list(arrays: &[&Array]) -> Vec<*const sys::mlxs_array> {
    handles(arrays)
}
