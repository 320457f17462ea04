// The narrow C ABI between glm-stream and MLX's C++ API.
//
// Every function catches every C++ exception and turns it into a status code
// plus a thread-local message (read with `mlxs_last_error`), so no bad shape,
// dtype or axis can abort the Rust process. Arrays cross the boundary as
// heap-allocated `mlx::core::array` handles owned by Rust (`mlxs_array_free`).
// Nothing here is clever on purpose: the safe wrapper lives in src/mlx/.

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

using Arr = mx::array;

struct mlxs_kernel {
  mx::fast::CustomKernelFunction fn;
};

// A caller-compiled CUDA kernel: its entry point and PTX / cubin, kept so
// calls pass them by reference instead of copying them each time.
struct mlxs_cuda_binary {
  std::string name;
  std::string code;
};

struct mlxs_safetensors {
  std::vector<std::string> names;
  std::vector<Arr> arrays;
  std::vector<std::string> meta_keys;
  std::vector<std::string> meta_values;
};

namespace {

thread_local std::string g_last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return 1;
  } catch (...) {
    g_last_error = "unknown C++ exception";
    return 1;
  }
}

// Dtype codes shared with src/mlx/dtype.rs (keep in sync).
mx::Dtype to_dtype(int code) {
  switch (code) {
    case 0: return mx::bool_;
    case 1: return mx::uint8;
    case 2: return mx::uint16;
    case 3: return mx::uint32;
    case 4: return mx::uint64;
    case 5: return mx::int8;
    case 6: return mx::int16;
    case 7: return mx::int32;
    case 8: return mx::int64;
    case 9: return mx::float16;
    case 10: return mx::float32;
    case 11: return mx::float64;
    case 12: return mx::bfloat16;
    case 13: return mx::complex64;
    default: throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  }
}

int from_dtype(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return 0;
    case mx::Dtype::Val::uint8: return 1;
    case mx::Dtype::Val::uint16: return 2;
    case mx::Dtype::Val::uint32: return 3;
    case mx::Dtype::Val::uint64: return 4;
    case mx::Dtype::Val::int8: return 5;
    case mx::Dtype::Val::int16: return 6;
    case mx::Dtype::Val::int32: return 7;
    case mx::Dtype::Val::int64: return 8;
    case mx::Dtype::Val::float16: return 9;
    case mx::Dtype::Val::float32: return 10;
    case mx::Dtype::Val::float64: return 11;
    case mx::Dtype::Val::bfloat16: return 12;
    case mx::Dtype::Val::complex64: return 13;
  }
  return -1;
}

mx::Shape to_shape(const int32_t* dims, size_t ndim) {
  return mx::Shape(dims, dims + ndim);
}

std::vector<int> to_ints(const int32_t* v, size_t n) {
  return std::vector<int>(v, v + n);
}

std::vector<Arr> to_vec(const Arr* const* arrays, size_t n) {
  std::vector<Arr> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(*arrays[i]);
  }
  return out;
}

std::optional<Arr> opt(const Arr* a) {
  if (a == nullptr) {
    return std::nullopt;
  }
  return *a;
}

std::optional<int> opt_int(int32_t v) {
  if (v <= 0) {
    return std::nullopt;
  }
  return v;
}

Arr* boxed(Arr a) { return new Arr(std::move(a)); }

template <typename T>
Arr from_typed(const void* data, const mx::Shape& shape, mx::Dtype dtype) {
  const T* p = static_cast<const T*>(data);
  return Arr(p, shape, dtype);
}

mx::Device to_device(int kind) {
  if (kind == 0) {
    return mx::Device(mx::Device::cpu);
  }
  if (kind == 1) {
    return mx::Device(mx::Device::gpu);
  }
  throw std::invalid_argument("unknown device kind " + std::to_string(kind));
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------- errors ---

const char* mlxs_last_error(void) { return g_last_error.c_str(); }

const char* mlxs_version(void) {
  static std::string v = mx::version();
  return v.c_str();
}

// ------------------------------------------------------- array lifecycle ---

void mlxs_array_free(Arr* a) { delete a; }

int mlxs_array_clone(Arr** out, const Arr* a) {
  return guarded([&] { *out = boxed(*a); });
}

int mlxs_array_from_data(
    Arr** out, const void* data, const int32_t* shape, size_t ndim, int dtype) {
  return guarded([&] {
    mx::Shape sh = to_shape(shape, ndim);
    mx::Dtype dt = to_dtype(dtype);
    switch (dtype) {
      case 0: *out = boxed(from_typed<bool>(data, sh, dt)); break;
      case 1: *out = boxed(from_typed<uint8_t>(data, sh, dt)); break;
      case 2: *out = boxed(from_typed<uint16_t>(data, sh, dt)); break;
      case 3: *out = boxed(from_typed<uint32_t>(data, sh, dt)); break;
      case 4: *out = boxed(from_typed<uint64_t>(data, sh, dt)); break;
      case 5: *out = boxed(from_typed<int8_t>(data, sh, dt)); break;
      case 6: *out = boxed(from_typed<int16_t>(data, sh, dt)); break;
      case 7: *out = boxed(from_typed<int32_t>(data, sh, dt)); break;
      case 8: *out = boxed(from_typed<int64_t>(data, sh, dt)); break;
      case 9: *out = boxed(from_typed<mx::float16_t>(data, sh, dt)); break;
      case 10: *out = boxed(from_typed<float>(data, sh, dt)); break;
      case 11: *out = boxed(from_typed<double>(data, sh, dt)); break;
      case 12: *out = boxed(from_typed<mx::bfloat16_t>(data, sh, dt)); break;
      default: throw std::invalid_argument("cannot build an array of dtype code " + std::to_string(dtype));
    }
  });
}

int mlxs_array_scalar_f32(Arr** out, float v, int dtype) {
  return guarded([&] { *out = boxed(Arr(v, to_dtype(dtype))); });
}

int mlxs_array_scalar_i32(Arr** out, int32_t v, int dtype) {
  return guarded([&] { *out = boxed(Arr(v, to_dtype(dtype))); });
}

int mlxs_array_dtype(const Arr* a) { return from_dtype(a->dtype()); }

size_t mlxs_array_ndim(const Arr* a) { return a->ndim(); }

void mlxs_array_shape(const Arr* a, int32_t* dims) {
  for (size_t i = 0; i < a->ndim(); ++i) {
    dims[i] = a->shape(static_cast<int>(i));
  }
}

size_t mlxs_array_size(const Arr* a) { return a->size(); }

size_t mlxs_array_nbytes(const Arr* a) { return a->nbytes(); }

int mlxs_eval(const Arr* const* arrays, size_t n) {
  return guarded([&] { mx::eval(to_vec(arrays, n)); });
}

int mlxs_async_eval(const Arr* const* arrays, size_t n) {
  return guarded([&] { mx::async_eval(to_vec(arrays, n)); });
}

// Copy the (evaluated, made row-contiguous) contents into `dst`, which must be
// exactly `nbytes` long.
int mlxs_array_read(const Arr* a, void* dst, size_t nbytes) {
  return guarded([&] {
    Arr c = mx::contiguous(*a);
    c.eval();
    if (c.nbytes() != nbytes) {
      throw std::invalid_argument(
          "destination holds " + std::to_string(nbytes) + " bytes, array has " +
          std::to_string(c.nbytes()));
    }
    if (nbytes > 0) {
      std::memcpy(dst, c.data<uint8_t>(), nbytes);
    }
  });
}

// A row-contiguous, evaluated, MLX-owned buffer of `nbytes` bytes and a host
// pointer to it. Used for expert slots: Rust writes bytes in place and later
// computations read them.
int mlxs_writable_buffer(Arr** out, uint8_t** ptr, size_t nbytes) {
  return guarded([&] {
    if (nbytes == 0 || nbytes > static_cast<size_t>(INT32_MAX)) {
      throw std::invalid_argument(
          "writable buffer size must be in 1..=2^31-1 bytes, got " + std::to_string(nbytes));
    }
    Arr a = mx::copy(mx::zeros({static_cast<int>(nbytes)}, mx::uint8));
    a.eval();
    if (!a.flags().row_contiguous || a.data_size() != nbytes) {
      throw std::runtime_error("MLX did not materialize a contiguous buffer");
    }
    *ptr = a.data<uint8_t>();
    *out = boxed(std::move(a));
  });
}

// True when this handle is the only reference to the array and to its data:
// no view, no pending graph node and no in-flight evaluation can read it.
int mlxs_array_is_exclusive(const Arr* a) { return a->is_donatable() ? 1 : 0; }

// ----------------------------------------------------- devices & streams ---

int mlxs_set_default_device(int kind) {
  return guarded([&] { mx::set_default_device(to_device(kind)); });
}

int mlxs_default_device(void) {
  return mx::default_device().type == mx::Device::gpu ? 1 : 0;
}

int mlxs_device_available(int kind) {
  int ok = 0;
  guarded([&] { ok = mx::is_available(to_device(kind)) ? 1 : 0; });
  return ok;
}

int mlxs_new_stream(int kind, int32_t* index) {
  return guarded([&] { *index = mx::new_stream(to_device(kind)).index; });
}

int mlxs_synchronize(void) {
  return guarded([&] { mx::synchronize(); });
}

// ---------------------------------------------------------------- memory ---

size_t mlxs_active_memory(void) { return mx::get_active_memory(); }
size_t mlxs_peak_memory(void) { return mx::get_peak_memory(); }
void mlxs_reset_peak_memory(void) { mx::reset_peak_memory(); }
size_t mlxs_cache_memory(void) { return mx::get_cache_memory(); }
void mlxs_clear_cache(void) { mx::clear_cache(); }
size_t mlxs_set_memory_limit(size_t limit) { return mx::set_memory_limit(limit); }
size_t mlxs_set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }

// ------------------------------------------------------------ element-wise ---

// Unary op codes (src/mlx/ops.rs `Unary`).
int mlxs_unary(Arr** out, int op, const Arr* a) {
  return guarded([&] {
    switch (op) {
      case 0: *out = boxed(mx::negative(*a)); break;
      case 1: *out = boxed(mx::exp(*a)); break;
      case 2: *out = boxed(mx::log(*a)); break;
      case 3: *out = boxed(mx::sqrt(*a)); break;
      case 4: *out = boxed(mx::rsqrt(*a)); break;
      case 5: *out = boxed(mx::sigmoid(*a)); break;
      case 6: *out = boxed(mx::abs(*a)); break;
      case 7: *out = boxed(mx::square(*a)); break;
      case 8: *out = boxed(mx::tanh(*a)); break;
      case 9: *out = boxed(mx::sin(*a)); break;
      case 10: *out = boxed(mx::cos(*a)); break;
      case 11: *out = boxed(mx::floor(*a)); break;
      case 12: *out = boxed(mx::copy(*a)); break;
      case 13: *out = boxed(mx::logical_not(*a)); break;
      case 14: *out = boxed(mx::reciprocal(*a)); break;
      case 15: *out = boxed(mx::erf(*a)); break;
      case 16: *out = boxed(mx::contiguous(*a)); break;
      default: throw std::invalid_argument("unknown unary op " + std::to_string(op));
    }
  });
}

// Binary op codes (src/mlx/ops.rs `Binary`).
int mlxs_binary(Arr** out, int op, const Arr* a, const Arr* b) {
  return guarded([&] {
    switch (op) {
      case 0: *out = boxed(mx::add(*a, *b)); break;
      case 1: *out = boxed(mx::subtract(*a, *b)); break;
      case 2: *out = boxed(mx::multiply(*a, *b)); break;
      case 3: *out = boxed(mx::divide(*a, *b)); break;
      case 4: *out = boxed(mx::maximum(*a, *b)); break;
      case 5: *out = boxed(mx::minimum(*a, *b)); break;
      case 6: *out = boxed(mx::power(*a, *b)); break;
      case 7: *out = boxed(mx::equal(*a, *b)); break;
      case 8: *out = boxed(mx::not_equal(*a, *b)); break;
      case 9: *out = boxed(mx::less(*a, *b)); break;
      case 10: *out = boxed(mx::less_equal(*a, *b)); break;
      case 11: *out = boxed(mx::greater(*a, *b)); break;
      case 12: *out = boxed(mx::greater_equal(*a, *b)); break;
      case 13: *out = boxed(mx::logical_and(*a, *b)); break;
      case 14: *out = boxed(mx::logical_or(*a, *b)); break;
      case 15: *out = boxed(mx::matmul(*a, *b)); break;
      case 16: *out = boxed(mx::bitwise_xor(*a, *b)); break;
      case 17: *out = boxed(mx::bitwise_and(*a, *b)); break;
      case 18: *out = boxed(mx::right_shift(*a, *b)); break;
      case 19: *out = boxed(mx::left_shift(*a, *b)); break;
      case 20: *out = boxed(mx::remainder(*a, *b)); break;
      default: throw std::invalid_argument("unknown binary op " + std::to_string(op));
    }
  });
}

int mlxs_where(Arr** out, const Arr* cond, const Arr* a, const Arr* b) {
  return guarded([&] { *out = boxed(mx::where(*cond, *a, *b)); });
}

int mlxs_astype(Arr** out, const Arr* a, int dtype) {
  return guarded([&] { *out = boxed(mx::astype(*a, to_dtype(dtype))); });
}

// Reinterpret the bytes of a row-contiguous array as another dtype.
int mlxs_view(Arr** out, const Arr* a, int dtype) {
  return guarded([&] { *out = boxed(mx::view(*a, to_dtype(dtype))); });
}

// ------------------------------------------------------------ reductions ---

// Reduction op codes (src/mlx/ops.rs `Reduce`). An empty axis list reduces all.
int mlxs_reduce(Arr** out, int op, const Arr* a, const int32_t* axes, size_t naxes, int keepdims) {
  return guarded([&] {
    std::vector<int> ax = to_ints(axes, naxes);
    if (ax.empty()) {
      for (int i = 0; i < static_cast<int>(a->ndim()); ++i) {
        ax.push_back(i);
      }
    }
    bool kd = keepdims != 0;
    switch (op) {
      case 0: *out = boxed(mx::sum(*a, ax, kd)); break;
      case 1: *out = boxed(mx::max(*a, ax, kd)); break;
      case 2: *out = boxed(mx::min(*a, ax, kd)); break;
      case 3: *out = boxed(mx::mean(*a, ax, kd)); break;
      case 4: *out = boxed(mx::logsumexp(*a, ax, kd)); break;
      case 5: *out = boxed(mx::softmax(*a, ax, /*precise=*/true)); break;
      case 6: *out = boxed(mx::prod(*a, ax, kd)); break;
      default: throw std::invalid_argument("unknown reduction " + std::to_string(op));
    }
  });
}

int mlxs_argmax(Arr** out, const Arr* a, int axis, int keepdims) {
  return guarded([&] { *out = boxed(mx::argmax(*a, axis, keepdims != 0)); });
}

int mlxs_cumsum(Arr** out, const Arr* a, int axis) {
  return guarded([&] { *out = boxed(mx::cumsum(*a, axis)); });
}

// ---------------------------------------------------------- shape & index ---

int mlxs_reshape(Arr** out, const Arr* a, const int32_t* shape, size_t ndim) {
  return guarded([&] { *out = boxed(mx::reshape(*a, to_shape(shape, ndim))); });
}

int mlxs_transpose(Arr** out, const Arr* a, const int32_t* axes, size_t naxes) {
  return guarded([&] { *out = boxed(mx::transpose(*a, to_ints(axes, naxes))); });
}

int mlxs_slice(
    Arr** out, const Arr* a, const int32_t* start, const int32_t* stop,
    const int32_t* strides, size_t ndim) {
  return guarded([&] {
    if (ndim != a->ndim()) {
      throw std::invalid_argument(
          "slice needs " + std::to_string(a->ndim()) + " bounds, got " + std::to_string(ndim));
    }
    *out = boxed(mx::slice(*a, to_shape(start, ndim), to_shape(stop, ndim), to_shape(strides, ndim)));
  });
}

int mlxs_slice_update(
    Arr** out, const Arr* src, const Arr* update, const int32_t* start,
    const int32_t* stop, size_t ndim) {
  return guarded([&] {
    *out = boxed(mx::slice_update(*src, *update, to_shape(start, ndim), to_shape(stop, ndim)));
  });
}

int mlxs_concatenate(Arr** out, const Arr* const* arrays, size_t n, int axis) {
  return guarded([&] { *out = boxed(mx::concatenate(to_vec(arrays, n), axis)); });
}

int mlxs_stack(Arr** out, const Arr* const* arrays, size_t n, int axis) {
  return guarded([&] { *out = boxed(mx::stack(to_vec(arrays, n), axis)); });
}

// Split at the given indices along `axis`; writes up to `cap` outputs.
int mlxs_split(
    Arr** outs, size_t cap, size_t* count, const Arr* a, const int32_t* indices,
    size_t nidx, int axis) {
  return guarded([&] {
    std::vector<Arr> parts = mx::split(*a, to_shape(indices, nidx), axis);
    if (parts.size() > cap) {
      throw std::invalid_argument("split produced more parts than expected");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      outs[i] = boxed(parts[i]);
    }
    *count = parts.size();
  });
}

int mlxs_expand_dims(Arr** out, const Arr* a, int axis) {
  return guarded([&] { *out = boxed(mx::expand_dims(*a, axis)); });
}

int mlxs_squeeze(Arr** out, const Arr* a, int axis) {
  return guarded([&] { *out = boxed(mx::squeeze(*a, axis)); });
}

int mlxs_broadcast_to(Arr** out, const Arr* a, const int32_t* shape, size_t ndim) {
  return guarded([&] { *out = boxed(mx::broadcast_to(*a, to_shape(shape, ndim))); });
}

int mlxs_repeat(Arr** out, const Arr* a, int repeats, int axis) {
  return guarded([&] { *out = boxed(mx::repeat(*a, repeats, axis)); });
}

int mlxs_take(Arr** out, const Arr* a, const Arr* indices, int axis) {
  return guarded([&] { *out = boxed(mx::take(*a, *indices, axis)); });
}

int mlxs_take_along_axis(Arr** out, const Arr* a, const Arr* indices, int axis) {
  return guarded([&] { *out = boxed(mx::take_along_axis(*a, *indices, axis)); });
}

int mlxs_put_along_axis(Arr** out, const Arr* a, const Arr* indices, const Arr* values, int axis) {
  return guarded([&] { *out = boxed(mx::put_along_axis(*a, *indices, *values, axis)); });
}

int mlxs_argpartition(Arr** out, const Arr* a, int kth, int axis) {
  return guarded([&] { *out = boxed(mx::argpartition(*a, kth, axis)); });
}

int mlxs_argsort(Arr** out, const Arr* a, int axis) {
  return guarded([&] { *out = boxed(mx::argsort(*a, axis)); });
}

int mlxs_sort(Arr** out, const Arr* a, int axis) {
  return guarded([&] { *out = boxed(mx::sort(*a, axis)); });
}

int mlxs_topk(Arr** out, const Arr* a, int k, int axis) {
  return guarded([&] { *out = boxed(mx::topk(*a, k, axis)); });
}

int mlxs_tril(Arr** out, const Arr* a, int k) {
  return guarded([&] { *out = boxed(mx::tril(*a, k)); });
}

int mlxs_arange(Arr** out, double start, double stop, double step, int dtype) {
  return guarded([&] { *out = boxed(mx::arange(start, stop, step, to_dtype(dtype))); });
}

int mlxs_zeros(Arr** out, const int32_t* shape, size_t ndim, int dtype) {
  return guarded([&] { *out = boxed(mx::zeros(to_shape(shape, ndim), to_dtype(dtype))); });
}

int mlxs_full(Arr** out, const int32_t* shape, size_t ndim, const Arr* value, int dtype) {
  return guarded([&] { *out = boxed(mx::full(to_shape(shape, ndim), *value, to_dtype(dtype))); });
}

// ------------------------------------------------------- linear algebra ---

int mlxs_quantized_matmul(
    Arr** out, const Arr* x, const Arr* w, const Arr* scales, const Arr* biases,
    int transpose, int group_size, int bits) {
  return guarded([&] {
    *out = boxed(mx::quantized_matmul(
        *x, *w, *scales, opt(biases), transpose != 0, opt_int(group_size), opt_int(bits), "affine"));
  });
}

int mlxs_dequantize(
    Arr** out, const Arr* w, const Arr* scales, const Arr* biases, int group_size,
    int bits, int dtype) {
  return guarded([&] {
    std::optional<mx::Dtype> dt;
    if (dtype >= 0) {
      dt = to_dtype(dtype);
    }
    *out = boxed(mx::dequantize(
        *w, *scales, opt(biases), opt_int(group_size), opt_int(bits), "affine", std::nullopt, dt));
  });
}

// Writes [w_q, scales, biases].
int mlxs_quantize(Arr** outs, const Arr* w, int group_size, int bits) {
  return guarded([&] {
    std::vector<Arr> r = mx::quantize(*w, opt_int(group_size), opt_int(bits), "affine");
    if (r.size() != 3) {
      throw std::runtime_error("affine quantize returned " + std::to_string(r.size()) + " arrays");
    }
    for (size_t i = 0; i < 3; ++i) {
      outs[i] = boxed(r[i]);
    }
  });
}

int mlxs_gather_qmm(
    Arr** out, const Arr* x, const Arr* w, const Arr* scales, const Arr* biases,
    const Arr* lhs_indices, const Arr* rhs_indices, int transpose, int group_size,
    int bits, int sorted_indices) {
  return guarded([&] {
    *out = boxed(mx::gather_qmm(
        *x, *w, *scales, opt(biases), opt(lhs_indices), opt(rhs_indices), transpose != 0,
        opt_int(group_size), opt_int(bits), "affine", std::nullopt, sorted_indices != 0));
  });
}

int mlxs_gather_mm(
    Arr** out, const Arr* a, const Arr* b, const Arr* lhs_indices, const Arr* rhs_indices,
    int sorted_indices) {
  return guarded([&] {
    *out = boxed(mx::gather_mm(*a, *b, opt(lhs_indices), opt(rhs_indices), sorted_indices != 0));
  });
}

// ------------------------------------------------------------------ fast ---

int mlxs_rms_norm(Arr** out, const Arr* x, const Arr* weight, float eps) {
  return guarded([&] { *out = boxed(mx::fast::rms_norm(*x, opt(weight), eps)); });
}

int mlxs_layer_norm(Arr** out, const Arr* x, const Arr* weight, const Arr* bias, float eps) {
  return guarded([&] { *out = boxed(mx::fast::layer_norm(*x, opt(weight), opt(bias), eps)); });
}

// `base` <= 0 means "use freqs"; `freqs` may be null.
int mlxs_rope(
    Arr** out, const Arr* x, int dims, int traditional, float base, float scale,
    int offset, const Arr* freqs) {
  return guarded([&] {
    std::optional<float> b;
    if (base > 0) {
      b = base;
    }
    *out = boxed(mx::fast::rope(*x, dims, traditional != 0, b, scale, offset, opt(freqs)));
  });
}

// mask_mode: "" (none or array mask) or "causal".
int mlxs_sdpa(
    Arr** out, const Arr* q, const Arr* k, const Arr* v, float scale,
    const char* mask_mode, const Arr* mask) {
  return guarded([&] {
    *out = boxed(mx::fast::scaled_dot_product_attention(
        *q, *k, *v, scale, std::string(mask_mode), opt(mask)));
  });
}

// -------------------------------------------------------- custom kernels ---

// Output shapes (concatenated, with each rank) and dtype codes of a kernel
// call as MLX takes them.
static std::pair<std::vector<mx::Shape>, std::vector<mx::Dtype>> output_specs(
    const int32_t* shapes_flat, const size_t* ndims, const int* dtype_codes, size_t n) {
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  size_t pos = 0;
  for (size_t i = 0; i < n; ++i) {
    shapes.push_back(to_shape(shapes_flat + pos, ndims[i]));
    pos += ndims[i];
    dtypes.push_back(to_dtype(dtype_codes[i]));
  }
  return {std::move(shapes), std::move(dtypes)};
}

// Hands a kernel call's `n` outputs to the caller.
static void box_outputs(const std::vector<Arr>& r, size_t n, Arr** outs) {
  if (r.size() != n) {
    throw std::runtime_error("kernel returned an unexpected number of outputs");
  }
  for (size_t i = 0; i < n; ++i) {
    outs[i] = boxed(r[i]);
  }
}

void mlxs_kernel_free(mlxs_kernel* k) { delete k; }

// backend: 0 = Metal, 1 = CUDA. `extra` is atomic_outputs (Metal, as 0/1) or
// the shared memory size in bytes (CUDA).
int mlxs_kernel_new(
    mlxs_kernel** out, int backend, const char* name, const char* const* input_names,
    size_t n_in, const char* const* output_names, size_t n_out, const char* source,
    const char* header, int ensure_row_contiguous, int extra) {
  return guarded([&] {
    std::vector<std::string> ins(input_names, input_names + n_in);
    std::vector<std::string> outs(output_names, output_names + n_out);
    auto k = std::make_unique<mlxs_kernel>();
    if (backend == 0) {
      k->fn = mx::fast::metal_kernel(
          name, ins, outs, source, header, ensure_row_contiguous != 0, extra != 0);
    } else if (backend == 1) {
      k->fn = mx::fast::cuda_kernel(name, ins, outs, source, header, ensure_row_contiguous != 0, extra);
    } else {
      throw std::invalid_argument("unknown kernel backend " + std::to_string(backend));
    }
    *out = k.release();
  });
}

// Template args: kinds 0 = int, 1 = bool, 2 = dtype (value is a dtype code).
int mlxs_kernel_call(
    const mlxs_kernel* k, const Arr* const* inputs, size_t n_in,
    const int32_t* out_shapes_flat, const size_t* out_ndims, const int* out_dtypes,
    size_t n_out, const int32_t* grid, const int32_t* threadgroup,
    const char* const* tmpl_names, const int* tmpl_kinds, const int32_t* tmpl_values,
    size_t n_tmpl, int has_init, float init_value, Arr** outs) {
  return guarded([&] {
    auto [shapes, dtypes] = output_specs(out_shapes_flat, out_ndims, out_dtypes, n_out);
    std::vector<std::pair<std::string, mx::fast::TemplateArg>> tmpl;
    for (size_t i = 0; i < n_tmpl; ++i) {
      switch (tmpl_kinds[i]) {
        case 0: tmpl.emplace_back(tmpl_names[i], static_cast<int>(tmpl_values[i])); break;
        case 1: tmpl.emplace_back(tmpl_names[i], tmpl_values[i] != 0); break;
        case 2: tmpl.emplace_back(tmpl_names[i], to_dtype(tmpl_values[i])); break;
        default: throw std::invalid_argument("unknown template arg kind");
      }
    }
    std::optional<float> init;
    if (has_init != 0) {
      init = init_value;
    }
    std::vector<Arr> r = k->fn(
        to_vec(inputs, n_in), shapes, dtypes, {grid[0], grid[1], grid[2]},
        {threadgroup[0], threadgroup[1], threadgroup[2]}, tmpl, init, false, {});
    box_outputs(r, n_out, outs);
  });
}

int mlxs_cuda_binary_new(
    mlxs_cuda_binary** out, const char* name, const char* code, size_t code_len) {
  return guarded([&] {
    auto b = std::make_unique<mlxs_cuda_binary>();
    b->name = name;
    b->code.assign(code, code_len);
    *out = b.release();
  });
}

void mlxs_cuda_binary_free(mlxs_cuda_binary* b) { delete b; }

// Launches a caller-compiled CUDA kernel (arguments: inputs then outputs).
// MLX loads the module once per entry-point name.
int mlxs_cuda_binary_call(
    const mlxs_cuda_binary* b, const Arr* const* inputs, size_t n_in,
    const int32_t* out_shapes_flat, const size_t* out_ndims, const int* out_dtypes,
    size_t n_out, const int32_t* grid, const int32_t* threadgroup, int shared_memory,
    int has_init, float init_value, int ensure_row_contiguous, Arr** outs) {
  return guarded([&] {
    auto [shapes, dtypes] = output_specs(out_shapes_flat, out_ndims, out_dtypes, n_out);
    std::optional<float> init;
    if (has_init != 0) {
      init = init_value;
    }
    std::vector<Arr> r = mx::fast::precompiled_cuda_kernel(
        b->name, b->code, to_vec(inputs, n_in), shapes,
        dtypes, {}, {grid[0], grid[1], grid[2]}, {threadgroup[0], threadgroup[1], threadgroup[2]},
        shared_memory, init, ensure_row_contiguous != 0, {});
    box_outputs(r, n_out, outs);
  });
}

// ----------------------------------------------------------- safetensors ---

int mlxs_load_safetensors(mlxs_safetensors** out, const char* path) {
  return guarded([&] {
    auto loaded = mx::load_safetensors(std::string(path));
    auto st = std::make_unique<mlxs_safetensors>();
    for (auto& [name, arr] : loaded.first) {
      st->names.push_back(name);
      st->arrays.push_back(arr);
    }
    for (auto& [k, v] : loaded.second) {
      st->meta_keys.push_back(k);
      st->meta_values.push_back(v);
    }
    *out = st.release();
  });
}

void mlxs_safetensors_free(mlxs_safetensors* st) { delete st; }
size_t mlxs_safetensors_len(const mlxs_safetensors* st) { return st->names.size(); }
const char* mlxs_safetensors_name(const mlxs_safetensors* st, size_t i) {
  return st->names[i].c_str();
}
Arr* mlxs_safetensors_array(const mlxs_safetensors* st, size_t i) {
  return new Arr(st->arrays[i]);
}
size_t mlxs_safetensors_meta_len(const mlxs_safetensors* st) { return st->meta_keys.size(); }
const char* mlxs_safetensors_meta_key(const mlxs_safetensors* st, size_t i) {
  return st->meta_keys[i].c_str();
}
const char* mlxs_safetensors_meta_value(const mlxs_safetensors* st, size_t i) {
  return st->meta_values[i].c_str();
}

}  // extern "C"
