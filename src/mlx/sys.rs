//! Raw declarations of the C++ shim (`csrc/mlx_shim.cpp`). Every function that
//! can fail returns 0 on success and 1 on failure, with the message available
//! from `mlxs_last_error` on the same thread. Only `crate::mlx` uses these.

use std::ffi::c_char;
use std::os::raw::{c_int, c_void};

#[repr(C)]
pub struct mlxs_array {
    _private: [u8; 0],
}
#[repr(C)]
pub struct mlxs_kernel {
    _private: [u8; 0],
}
#[repr(C)]
pub struct mlxs_cuda_binary {
    _private: [u8; 0],
}
#[repr(C)]
pub struct mlxs_safetensors {
    _private: [u8; 0],
}

pub type A = mlxs_array;

unsafe extern "C" {
    pub fn mlxs_last_error() -> *const c_char;
    pub fn mlxs_version() -> *const c_char;

    pub fn mlxs_array_free(a: *mut A);
    pub fn mlxs_array_clone(out: *mut *mut A, a: *const A) -> c_int;
    pub fn mlxs_array_from_data(
        out: *mut *mut A,
        data: *const c_void,
        shape: *const i32,
        ndim: usize,
        dtype: c_int,
    ) -> c_int;
    pub fn mlxs_array_scalar_f32(out: *mut *mut A, v: f32, dtype: c_int) -> c_int;
    pub fn mlxs_array_scalar_i32(out: *mut *mut A, v: i32, dtype: c_int) -> c_int;
    pub fn mlxs_array_dtype(a: *const A) -> c_int;
    pub fn mlxs_array_ndim(a: *const A) -> usize;
    pub fn mlxs_array_shape(a: *const A, dims: *mut i32);
    pub fn mlxs_array_size(a: *const A) -> usize;
    pub fn mlxs_array_nbytes(a: *const A) -> usize;
    pub fn mlxs_eval(arrays: *const *const A, n: usize) -> c_int;
    pub fn mlxs_async_eval(arrays: *const *const A, n: usize) -> c_int;
    pub fn mlxs_array_read(a: *const A, dst: *mut c_void, nbytes: usize) -> c_int;
    pub fn mlxs_writable_buffer(out: *mut *mut A, ptr: *mut *mut u8, nbytes: usize) -> c_int;
    pub fn mlxs_array_is_exclusive(a: *const A) -> c_int;

    pub fn mlxs_set_default_device(kind: c_int) -> c_int;
    pub fn mlxs_default_device() -> c_int;
    pub fn mlxs_device_available(kind: c_int) -> c_int;
    pub fn mlxs_new_stream(kind: c_int, index: *mut i32) -> c_int;
    pub fn mlxs_synchronize() -> c_int;

    pub fn mlxs_active_memory() -> usize;
    pub fn mlxs_peak_memory() -> usize;
    pub fn mlxs_reset_peak_memory();
    pub fn mlxs_cache_memory() -> usize;
    pub fn mlxs_clear_cache();
    pub fn mlxs_set_memory_limit(limit: usize) -> usize;
    pub fn mlxs_set_cache_limit(limit: usize) -> usize;

    pub fn mlxs_unary(out: *mut *mut A, op: c_int, a: *const A) -> c_int;
    pub fn mlxs_binary(out: *mut *mut A, op: c_int, a: *const A, b: *const A) -> c_int;
    pub fn mlxs_where(out: *mut *mut A, cond: *const A, a: *const A, b: *const A) -> c_int;
    pub fn mlxs_astype(out: *mut *mut A, a: *const A, dtype: c_int) -> c_int;
    pub fn mlxs_view(out: *mut *mut A, a: *const A, dtype: c_int) -> c_int;

    pub fn mlxs_reduce(
        out: *mut *mut A,
        op: c_int,
        a: *const A,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
    ) -> c_int;
    pub fn mlxs_argmax(out: *mut *mut A, a: *const A, axis: c_int, keepdims: c_int) -> c_int;
    pub fn mlxs_cumsum(out: *mut *mut A, a: *const A, axis: c_int) -> c_int;

    pub fn mlxs_reshape(out: *mut *mut A, a: *const A, shape: *const i32, ndim: usize) -> c_int;
    pub fn mlxs_transpose(out: *mut *mut A, a: *const A, axes: *const i32, naxes: usize) -> c_int;
    pub fn mlxs_slice(
        out: *mut *mut A,
        a: *const A,
        start: *const i32,
        stop: *const i32,
        strides: *const i32,
        ndim: usize,
    ) -> c_int;
    pub fn mlxs_slice_update(
        out: *mut *mut A,
        src: *const A,
        update: *const A,
        start: *const i32,
        stop: *const i32,
        ndim: usize,
    ) -> c_int;
    pub fn mlxs_concatenate(
        out: *mut *mut A,
        arrays: *const *const A,
        n: usize,
        axis: c_int,
    ) -> c_int;
    pub fn mlxs_stack(out: *mut *mut A, arrays: *const *const A, n: usize, axis: c_int) -> c_int;
    pub fn mlxs_split(
        outs: *mut *mut A,
        cap: usize,
        count: *mut usize,
        a: *const A,
        indices: *const i32,
        nidx: usize,
        axis: c_int,
    ) -> c_int;
    pub fn mlxs_expand_dims(out: *mut *mut A, a: *const A, axis: c_int) -> c_int;
    pub fn mlxs_squeeze(out: *mut *mut A, a: *const A, axis: c_int) -> c_int;
    pub fn mlxs_broadcast_to(
        out: *mut *mut A,
        a: *const A,
        shape: *const i32,
        ndim: usize,
    ) -> c_int;
    pub fn mlxs_repeat(out: *mut *mut A, a: *const A, repeats: c_int, axis: c_int) -> c_int;
    pub fn mlxs_take(out: *mut *mut A, a: *const A, indices: *const A, axis: c_int) -> c_int;
    pub fn mlxs_take_along_axis(
        out: *mut *mut A,
        a: *const A,
        indices: *const A,
        axis: c_int,
    ) -> c_int;
    pub fn mlxs_put_along_axis(
        out: *mut *mut A,
        a: *const A,
        indices: *const A,
        values: *const A,
        axis: c_int,
    ) -> c_int;
    pub fn mlxs_argpartition(out: *mut *mut A, a: *const A, kth: c_int, axis: c_int) -> c_int;
    pub fn mlxs_argsort(out: *mut *mut A, a: *const A, axis: c_int) -> c_int;
    pub fn mlxs_sort(out: *mut *mut A, a: *const A, axis: c_int) -> c_int;
    pub fn mlxs_topk(out: *mut *mut A, a: *const A, k: c_int, axis: c_int) -> c_int;
    pub fn mlxs_tril(out: *mut *mut A, a: *const A, k: c_int) -> c_int;
    pub fn mlxs_arange(out: *mut *mut A, start: f64, stop: f64, step: f64, dtype: c_int) -> c_int;
    pub fn mlxs_zeros(out: *mut *mut A, shape: *const i32, ndim: usize, dtype: c_int) -> c_int;
    pub fn mlxs_full(
        out: *mut *mut A,
        shape: *const i32,
        ndim: usize,
        value: *const A,
        dtype: c_int,
    ) -> c_int;

    pub fn mlxs_quantized_matmul(
        out: *mut *mut A,
        x: *const A,
        w: *const A,
        scales: *const A,
        biases: *const A,
        transpose: c_int,
        group_size: c_int,
        bits: c_int,
    ) -> c_int;
    pub fn mlxs_dequantize(
        out: *mut *mut A,
        w: *const A,
        scales: *const A,
        biases: *const A,
        group_size: c_int,
        bits: c_int,
        dtype: c_int,
    ) -> c_int;
    pub fn mlxs_quantize(outs: *mut *mut A, w: *const A, group_size: c_int, bits: c_int) -> c_int;
    pub fn mlxs_gather_qmm(
        out: *mut *mut A,
        x: *const A,
        w: *const A,
        scales: *const A,
        biases: *const A,
        lhs: *const A,
        rhs: *const A,
        transpose: c_int,
        group_size: c_int,
        bits: c_int,
        sorted: c_int,
    ) -> c_int;
    pub fn mlxs_gather_mm(
        out: *mut *mut A,
        a: *const A,
        b: *const A,
        lhs: *const A,
        rhs: *const A,
        sorted: c_int,
    ) -> c_int;

    pub fn mlxs_rms_norm(out: *mut *mut A, x: *const A, weight: *const A, eps: f32) -> c_int;
    pub fn mlxs_layer_norm(
        out: *mut *mut A,
        x: *const A,
        weight: *const A,
        bias: *const A,
        eps: f32,
    ) -> c_int;
    pub fn mlxs_rope(
        out: *mut *mut A,
        x: *const A,
        dims: c_int,
        traditional: c_int,
        base: f32,
        scale: f32,
        offset: c_int,
        freqs: *const A,
    ) -> c_int;
    pub fn mlxs_sdpa(
        out: *mut *mut A,
        q: *const A,
        k: *const A,
        v: *const A,
        scale: f32,
        mask_mode: *const c_char,
        mask: *const A,
    ) -> c_int;

    pub fn mlxs_kernel_free(k: *mut mlxs_kernel);
    pub fn mlxs_kernel_new(
        out: *mut *mut mlxs_kernel,
        backend: c_int,
        name: *const c_char,
        input_names: *const *const c_char,
        n_in: usize,
        output_names: *const *const c_char,
        n_out: usize,
        source: *const c_char,
        header: *const c_char,
        ensure_row_contiguous: c_int,
        extra: c_int,
    ) -> c_int;
    pub fn mlxs_kernel_call(
        k: *const mlxs_kernel,
        inputs: *const *const A,
        n_in: usize,
        out_shapes_flat: *const i32,
        out_ndims: *const usize,
        out_dtypes: *const c_int,
        n_out: usize,
        grid: *const i32,
        threadgroup: *const i32,
        tmpl_names: *const *const c_char,
        tmpl_kinds: *const c_int,
        tmpl_values: *const i32,
        n_tmpl: usize,
        has_init: c_int,
        init_value: f32,
        outs: *mut *mut A,
    ) -> c_int;

    pub fn mlxs_cuda_binary_new(
        out: *mut *mut mlxs_cuda_binary,
        name: *const c_char,
        code: *const c_char,
        code_len: usize,
    ) -> c_int;
    pub fn mlxs_cuda_binary_free(b: *mut mlxs_cuda_binary);
    pub fn mlxs_cuda_binary_call(
        b: *const mlxs_cuda_binary,
        inputs: *const *const A,
        n_in: usize,
        out_shapes_flat: *const i32,
        out_ndims: *const usize,
        out_dtypes: *const c_int,
        n_out: usize,
        grid: *const i32,
        threadgroup: *const i32,
        shared_memory: c_int,
        has_init: c_int,
        init_value: f32,
        ensure_row_contiguous: c_int,
        outs: *mut *mut A,
    ) -> c_int;

    pub fn mlxs_load_safetensors(out: *mut *mut mlxs_safetensors, path: *const c_char) -> c_int;
    pub fn mlxs_safetensors_free(st: *mut mlxs_safetensors);
    pub fn mlxs_safetensors_len(st: *const mlxs_safetensors) -> usize;
    pub fn mlxs_safetensors_name(st: *const mlxs_safetensors, i: usize) -> *const c_char;
    pub fn mlxs_safetensors_array(st: *const mlxs_safetensors, i: usize) -> *mut A;
    pub fn mlxs_safetensors_meta_len(st: *const mlxs_safetensors) -> usize;
    pub fn mlxs_safetensors_meta_key(st: *const mlxs_safetensors, i: usize) -> *const c_char;
    pub fn mlxs_safetensors_meta_value(st: *const mlxs_safetensors, i: usize) -> *const c_char;
}
