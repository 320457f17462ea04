//! Array operations. Names follow MLX (and mlx-rs) so the code reads like the
//! Python reference. Every op is lazy; nothing runs until an eval or a read.

use std::ffi::CString;

use super::array::{ffi, handle_list};
use super::sys;
use super::{Array, Dtype, MlxError, Result};

/// Builds one output array from a shim call that writes it through `$out`.
macro_rules! array_op {
    ($op:expr, |$out:ident| $call:expr) => {{
        let mut $out: *mut $crate::mlx::sys::mlxs_array = std::ptr::null_mut();
        $crate::mlx::array::ffi!($op, $call).and_then(|()| $crate::mlx::Array::from_raw($op, $out))
    }};
}
pub(crate) use array_op;

#[derive(Clone, Copy)]
#[repr(i32)]
enum Unary {
    Negative = 0,
    Exp = 1,
    Log = 2,
    Sqrt = 3,
    Rsqrt = 4,
    Sigmoid = 5,
    Abs = 6,
    Square = 7,
    Tanh = 8,
    Sin = 9,
    Cos = 10,
    Floor = 11,
    Copy = 12,
    LogicalNot = 13,
    Reciprocal = 14,
    Erf = 15,
    Contiguous = 16,
}

#[derive(Clone, Copy)]
#[repr(i32)]
enum Binary {
    Add = 0,
    Subtract = 1,
    Multiply = 2,
    Divide = 3,
    Maximum = 4,
    Minimum = 5,
    Power = 6,
    Equal = 7,
    NotEqual = 8,
    Less = 9,
    LessEqual = 10,
    Greater = 11,
    GreaterEqual = 12,
    LogicalAnd = 13,
    LogicalOr = 14,
    Matmul = 15,
    BitwiseXor = 16,
    BitwiseAnd = 17,
    RightShift = 18,
    LeftShift = 19,
    Remainder = 20,
}

#[derive(Clone, Copy)]
#[repr(i32)]
enum Reduce {
    Sum = 0,
    Max = 1,
    Min = 2,
    Mean = 3,
    LogSumExp = 4,
    Softmax = 5,
    Prod = 6,
}

fn unary(op_name: &'static str, op: Unary, a: &Array) -> Result<Array> {
    array_op!(op_name, |out| sys::mlxs_unary(
        &mut out,
        op as i32,
        a.as_ptr()
    ))
}

fn binary(op_name: &'static str, op: Binary, a: &Array, b: &Array) -> Result<Array> {
    array_op!(op_name, |out| sys::mlxs_binary(
        &mut out,
        op as i32,
        a.as_ptr(),
        b.as_ptr()
    ))
}

fn reduce(
    op_name: &'static str,
    op: Reduce,
    a: &Array,
    axes: &[i32],
    keepdims: bool,
) -> Result<Array> {
    array_op!(op_name, |out| sys::mlxs_reduce(
        &mut out,
        op as i32,
        a.as_ptr(),
        axes.as_ptr(),
        axes.len(),
        keepdims as i32
    ))
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Result<Array> { unary(stringify!($name), Unary::$op, self) }
    )*};
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(&self, other: &Array) -> Result<Array> {
            binary(stringify!($name), Binary::$op, self, other)
        }
    )*};
}

impl Array {
    unary_methods! {
        /// `-x`.
        negative => Negative,
        /// `e^x`.
        exp => Exp,
        /// Natural log.
        log => Log,
        /// Square root.
        sqrt => Sqrt,
        /// `1/sqrt(x)`.
        rsqrt => Rsqrt,
        /// `1 / (1 + e^-x)`.
        sigmoid => Sigmoid,
        /// `|x|`.
        abs => Abs,
        /// `x²`.
        square => Square,
        /// Hyperbolic tangent.
        tanh => Tanh,
        /// Sine.
        sin => Sin,
        /// Cosine.
        cos => Cos,
        /// Round towards −∞.
        floor => Floor,
        /// A copy (a new graph node over the same values).
        copy => Copy,
        /// Logical not.
        logical_not => LogicalNot,
        /// `1/x`.
        reciprocal => Reciprocal,
        /// Error function.
        erf => Erf,
        /// The same values with row-contiguous memory.
        contiguous => Contiguous,
    }

    binary_methods! {
        /// Element-wise `a + b` (broadcasting).
        add => Add,
        /// Element-wise `a - b`.
        subtract => Subtract,
        /// Element-wise `a * b`.
        multiply => Multiply,
        /// Element-wise `a / b`.
        divide => Divide,
        /// Element-wise maximum.
        maximum => Maximum,
        /// Element-wise minimum.
        minimum => Minimum,
        /// Element-wise `a^b`.
        power => Power,
        /// Element-wise `a == b`.
        equal => Equal,
        /// Element-wise `a != b`.
        not_equal => NotEqual,
        /// Element-wise `a < b`.
        less => Less,
        /// Element-wise `a <= b`.
        less_equal => LessEqual,
        /// Element-wise `a > b`.
        greater => Greater,
        /// Element-wise `a >= b`.
        greater_equal => GreaterEqual,
        /// Logical and.
        logical_and => LogicalAnd,
        /// Logical or.
        logical_or => LogicalOr,
        /// Matrix product with NumPy broadcasting of batch dimensions.
        matmul => Matmul,
        /// Bitwise xor (integer dtypes).
        bitwise_xor => BitwiseXor,
        /// Bitwise and (integer dtypes).
        bitwise_and => BitwiseAnd,
        /// Logical right shift (integer dtypes).
        right_shift => RightShift,
        /// Left shift (integer dtypes).
        left_shift => LeftShift,
        /// Remainder with the sign of the divisor.
        remainder => Remainder,
    }

    /// `x * sigmoid(x)`, as `mlx.nn.silu` computes it.
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }

    /// Multiplies by a scalar (kept in this array's dtype).
    pub fn multiply_scalar(&self, value: f32) -> Result<Array> {
        self.multiply(&Array::scalar(value, self.dtype())?)
    }

    /// Adds a scalar (kept in this array's dtype).
    pub fn add_scalar(&self, value: f32) -> Result<Array> {
        self.add(&Array::scalar(value, self.dtype())?)
    }

    /// Casts to another dtype.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        array_op!("astype", |out| sys::mlxs_astype(
            &mut out,
            self.as_ptr(),
            dtype.code()
        ))
    }

    /// Reinterprets the bytes as another dtype (the last axis scales by the
    /// ratio of the element sizes). Shares memory when the array is contiguous.
    pub fn view(&self, dtype: Dtype) -> Result<Array> {
        array_op!("view", |out| sys::mlxs_view(
            &mut out,
            self.as_ptr(),
            dtype.code()
        ))
    }

    /// Sum over `axes` (all axes when empty).
    pub fn sum(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("sum", Reduce::Sum, self, axes, keepdims)
    }

    /// Maximum over `axes` (all axes when empty).
    pub fn max(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("max", Reduce::Max, self, axes, keepdims)
    }

    /// Minimum over `axes` (all axes when empty).
    pub fn min(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("min", Reduce::Min, self, axes, keepdims)
    }

    /// Mean over `axes` (all axes when empty).
    pub fn mean(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("mean", Reduce::Mean, self, axes, keepdims)
    }

    /// Product over `axes` (all axes when empty).
    pub fn prod(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("prod", Reduce::Prod, self, axes, keepdims)
    }

    /// `log(sum(exp(x)))` over `axes`, computed stably.
    pub fn logsumexp(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        reduce("logsumexp", Reduce::LogSumExp, self, axes, keepdims)
    }

    /// Softmax over `axes`, accumulated in float32 for low-precision inputs.
    pub fn softmax(&self, axes: &[i32]) -> Result<Array> {
        reduce("softmax", Reduce::Softmax, self, axes, false)
    }

    /// Index of the maximum along `axis`.
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        array_op!("argmax", |out| sys::mlxs_argmax(
            &mut out,
            self.as_ptr(),
            axis,
            keepdims as i32
        ))
    }

    /// Inclusive cumulative sum along `axis`.
    pub fn cumsum(&self, axis: i32) -> Result<Array> {
        array_op!("cumsum", |out| sys::mlxs_cumsum(
            &mut out,
            self.as_ptr(),
            axis
        ))
    }

    /// Same data, new shape (one dimension may be -1).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        array_op!("reshape", |out| sys::mlxs_reshape(
            &mut out,
            self.as_ptr(),
            shape.as_ptr(),
            shape.len()
        ))
    }

    /// Permutes the axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        array_op!("transpose", |out| sys::mlxs_transpose(
            &mut out,
            self.as_ptr(),
            axes.as_ptr(),
            axes.len()
        ))
    }

    /// Swaps the last two axes.
    pub fn t(&self) -> Result<Array> {
        let nd = self.ndim() as i32;
        if nd < 2 {
            return Err(MlxError::invalid(
                "t",
                format!("needs at least 2 dims, got {nd}"),
            ));
        }
        let mut axes: Vec<i32> = (0..nd).collect();
        axes.swap(nd as usize - 1, nd as usize - 2);
        self.transpose(&axes)
    }

    /// `a[start:stop:strides]` with one bound per axis.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        if start.len() != stop.len() || start.len() != strides.len() {
            return Err(MlxError::invalid(
                "slice",
                "start, stop and strides differ in length",
            ));
        }
        array_op!("slice", |out| sys::mlxs_slice(
            &mut out,
            self.as_ptr(),
            start.as_ptr(),
            stop.as_ptr(),
            strides.as_ptr(),
            start.len()
        ))
    }

    /// `a[..., start:stop, ...]` on one axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let nd = shape.len() as i32;
        let ax = if axis < 0 { axis + nd } else { axis };
        if !(0..nd).contains(&ax) {
            return Err(MlxError::invalid(
                "slice_axis",
                format!("axis {axis} out of range for {nd}-d array"),
            ));
        }
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        lo[ax as usize] = start;
        hi[ax as usize] = stop;
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// A copy of `self` with `update` written over `[start, stop)`.
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        if start.len() != stop.len() {
            return Err(MlxError::invalid(
                "slice_update",
                "start and stop differ in length",
            ));
        }
        array_op!("slice_update", |out| sys::mlxs_slice_update(
            &mut out,
            self.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            stop.as_ptr(),
            start.len()
        ))
    }

    /// Splits at `indices` along `axis` into `indices.len() + 1` parts.
    pub fn split(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        let cap = indices.len() + 1;
        let mut outs: Vec<*mut sys::mlxs_array> = vec![std::ptr::null_mut(); cap];
        let mut count = 0usize;
        ffi!(
            "split",
            sys::mlxs_split(
                outs.as_mut_ptr(),
                cap,
                &mut count,
                self.as_ptr(),
                indices.as_ptr(),
                indices.len(),
                axis
            )
        )?;
        outs.into_iter()
            .take(count)
            .map(|p| Array::from_raw("split", p))
            .collect()
    }

    /// Inserts a length-1 axis.
    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        array_op!("expand_dims", |out| sys::mlxs_expand_dims(
            &mut out,
            self.as_ptr(),
            axis
        ))
    }

    /// Removes a length-1 axis.
    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        array_op!("squeeze", |out| sys::mlxs_squeeze(
            &mut out,
            self.as_ptr(),
            axis
        ))
    }

    /// Broadcasts to `shape`.
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        array_op!("broadcast_to", |out| sys::mlxs_broadcast_to(
            &mut out,
            self.as_ptr(),
            shape.as_ptr(),
            shape.len()
        ))
    }

    /// Repeats each element `repeats` times along `axis`.
    pub fn repeat(&self, repeats: i32, axis: i32) -> Result<Array> {
        array_op!("repeat", |out| sys::mlxs_repeat(
            &mut out,
            self.as_ptr(),
            repeats,
            axis
        ))
    }

    /// Gathers along `axis`. MLX does not bounds-check `indices`: callers
    /// validate them (see [`crate::mlx::checked_indices`]).
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        array_op!("take", |out| sys::mlxs_take(
            &mut out,
            self.as_ptr(),
            indices.as_ptr(),
            axis
        ))
    }

    /// Gathers with per-position indices along `axis` (not bounds-checked).
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        array_op!("take_along_axis", |out| sys::mlxs_take_along_axis(
            &mut out,
            self.as_ptr(),
            indices.as_ptr(),
            axis
        ))
    }

    /// Scatters `values` at per-position `indices` along `axis`.
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        array_op!("put_along_axis", |out| sys::mlxs_put_along_axis(
            &mut out,
            self.as_ptr(),
            indices.as_ptr(),
            values.as_ptr(),
            axis
        ))
    }

    /// Indices that partition along `axis` around the `kth` element.
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        array_op!("argpartition", |out| sys::mlxs_argpartition(
            &mut out,
            self.as_ptr(),
            kth,
            axis
        ))
    }

    /// Indices that sort along `axis`.
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        array_op!("argsort", |out| sys::mlxs_argsort(
            &mut out,
            self.as_ptr(),
            axis
        ))
    }

    /// Sorted values along `axis`.
    pub fn sort(&self, axis: i32) -> Result<Array> {
        array_op!("sort", |out| sys::mlxs_sort(&mut out, self.as_ptr(), axis))
    }

    /// The `k` largest values along `axis` (unordered, as MLX returns them).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        array_op!("topk", |out| sys::mlxs_topk(
            &mut out,
            self.as_ptr(),
            k,
            axis
        ))
    }

    /// Lower triangle (zero above diagonal `k`).
    pub fn tril(&self, k: i32) -> Result<Array> {
        array_op!("tril", |out| sys::mlxs_tril(&mut out, self.as_ptr(), k))
    }
}

/// Concatenates along `axis`.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let h = handle_list(arrays);
    array_op!("concatenate", |out| sys::mlxs_concatenate(
        &mut out,
        h.as_ptr(),
        h.len(),
        axis
    ))
}

/// Stacks along a new `axis`.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let h = handle_list(arrays);
    array_op!("stack", |out| sys::mlxs_stack(
        &mut out,
        h.as_ptr(),
        h.len(),
        axis
    ))
}

/// `cond ? a : b` element-wise.
pub fn r#where(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    array_op!("where", |out| sys::mlxs_where(
        &mut out,
        cond.as_ptr(),
        a.as_ptr(),
        b.as_ptr()
    ))
}

/// `[start, stop)` in steps of `step`.
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    array_op!("arange", |out| sys::mlxs_arange(
        &mut out,
        start,
        stop,
        step,
        dtype.code()
    ))
}

/// An array of zeros.
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    array_op!("zeros", |out| sys::mlxs_zeros(
        &mut out,
        shape.as_ptr(),
        shape.len(),
        dtype.code()
    ))
}

/// An array filled with `value`.
pub fn full(shape: &[i32], value: f32, dtype: Dtype) -> Result<Array> {
    let v = Array::scalar(value, Dtype::Float32)?;
    array_op!("full", |out| sys::mlxs_full(
        &mut out,
        shape.as_ptr(),
        shape.len(),
        v.as_ptr(),
        dtype.code()
    ))
}

/// Checks gather indices on the host before MLX sees them (MLX gathers read
/// out of bounds silently) and builds the int32 index array.
pub fn checked_indices(indices: &[u32], bound: usize, what: &'static str) -> Result<Array> {
    if let Some((pos, &bad)) = indices
        .iter()
        .enumerate()
        .find(|&(_, &i)| i as usize >= bound)
    {
        return Err(MlxError::invalid(
            "checked_indices",
            format!("{what} {bad} at position {pos} is out of range 0..{bound}"),
        ));
    }
    if bound > i32::MAX as usize {
        return Err(MlxError::invalid(
            "checked_indices",
            format!("bound {bound} exceeds i32"),
        ));
    }
    let as_i32: Vec<i32> = indices.iter().map(|&i| i as i32).collect();
    Array::from_slice(&as_i32, &[as_i32.len() as i32])
}

pub(crate) fn cstring(op: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| MlxError::invalid(op, format!("string {s:?} contains a NUL byte")))
}
