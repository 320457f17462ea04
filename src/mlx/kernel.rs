//! Custom GPU kernels through MLX (`fast::metal_kernel`, `fast::cuda_kernel`).
//!
//! Which backends exist is decided twice: at compile time by the crate's
//! `cuda` / `metal` features, and at run time by the libmlx that is loaded
//! (the CPU wheel throws on any custom kernel). Either missing gives
//! [`MlxError::BackendUnavailable`], never a link failure.

use std::ffi::CString;

use super::array::{ffi, handle_list};
use super::ops::cstring;
use super::sys;
use super::{Array, Dtype, MlxError, Result};

/// Which custom-kernel compiler a kernel is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelBackend {
    /// Metal Shading Language (macOS).
    Metal,
    /// CUDA C++ compiled with NVRTC (Linux GPUs).
    Cuda,
}

impl KernelBackend {
    fn name(self) -> &'static str {
        match self {
            KernelBackend::Metal => "metal",
            KernelBackend::Cuda => "cuda",
        }
    }

    /// Whether this build compiled the backend in (the `metal` / `cuda` feature).
    pub fn compiled_in(self) -> bool {
        match self {
            KernelBackend::Metal => cfg!(feature = "metal"),
            KernelBackend::Cuda => cfg!(feature = "cuda"),
        }
    }
}

/// A template argument of a custom kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// One output of a kernel call.
#[derive(Debug, Clone)]
pub struct OutputSpec {
    pub shape: Vec<i32>,
    pub dtype: Dtype,
}

/// Launch geometry and template arguments of one call.
#[derive(Debug, Clone, Default)]
pub struct LaunchConfig {
    /// Total threads per axis (MLX semantics: a grid of threads, not blocks).
    pub grid: [i32; 3],
    pub threadgroup: [i32; 3],
    pub template: Vec<(String, TemplateArg)>,
    /// Value to fill outputs with before the kernel runs.
    pub init_value: Option<f32>,
}

/// The source and signature of a custom kernel.
#[derive(Debug, Clone)]
pub struct KernelSpec<'a> {
    pub name: &'a str,
    pub input_names: &'a [&'a str],
    pub output_names: &'a [&'a str],
    /// The kernel body (MLX generates the signature from the names).
    pub source: &'a str,
    /// Helpers placed before the kernel.
    pub header: &'a str,
    pub ensure_row_contiguous: bool,
    /// Dynamic shared memory in bytes (CUDA only).
    pub shared_memory: u32,
}

/// Outputs as the shim takes them: all shapes concatenated, each rank, each
/// dtype code.
fn flat_outputs(outputs: &[OutputSpec]) -> (Vec<i32>, Vec<usize>, Vec<i32>) {
    let shapes = outputs
        .iter()
        .flat_map(|o| o.shape.iter().copied())
        .collect();
    let ndims = outputs.iter().map(|o| o.shape.len()).collect();
    let dtypes = outputs.iter().map(|o| o.dtype.code()).collect();
    (shapes, ndims, dtypes)
}

/// A compiled-on-first-use custom kernel.
pub struct Kernel {
    raw: std::ptr::NonNull<sys::mlxs_kernel>,
    backend: KernelBackend,
    n_inputs: usize,
    n_outputs: usize,
}

impl Kernel {
    /// Declares a kernel for `backend`.
    pub fn new(backend: KernelBackend, spec: &KernelSpec<'_>) -> Result<Self> {
        let KernelSpec {
            name,
            input_names,
            output_names,
            source,
            header,
            ensure_row_contiguous,
            shared_memory,
        } = *spec;
        if !backend.compiled_in() {
            return Err(MlxError::BackendUnavailable {
                backend: backend.name(),
                reason: format!(
                    "glm-stream was built without the `{}` feature",
                    backend.name()
                ),
            });
        }
        let to_c = |v: &[&str]| {
            v.iter()
                .map(|s| cstring("kernel", s))
                .collect::<Result<Vec<CString>>>()
        };
        let ins = to_c(input_names)?;
        let outs = to_c(output_names)?;
        let in_ptrs: Vec<_> = ins.iter().map(|s| s.as_ptr()).collect();
        let out_ptrs: Vec<_> = outs.iter().map(|s| s.as_ptr()).collect();
        let (name, source, header) = (
            cstring("kernel", name)?,
            cstring("kernel", source)?,
            cstring("kernel", header)?,
        );
        let extra = match backend {
            KernelBackend::Metal => 0,
            KernelBackend::Cuda => i32::try_from(shared_memory)
                .map_err(|_| MlxError::invalid("kernel", "shared memory size exceeds i32"))?,
        };
        let mut raw = std::ptr::null_mut();
        ffi!(
            "kernel",
            sys::mlxs_kernel_new(
                &mut raw,
                if backend == KernelBackend::Metal {
                    0
                } else {
                    1
                },
                name.as_ptr(),
                in_ptrs.as_ptr(),
                in_ptrs.len(),
                out_ptrs.as_ptr(),
                out_ptrs.len(),
                source.as_ptr(),
                header.as_ptr(),
                ensure_row_contiguous as i32,
                extra
            )
        )?;
        let raw = std::ptr::NonNull::new(raw)
            .ok_or_else(|| MlxError::invalid("kernel", "null kernel"))?;
        Ok(Self {
            raw,
            backend,
            n_inputs: input_names.len(),
            n_outputs: output_names.len(),
        })
    }

    /// The backend this kernel targets.
    pub fn backend(&self) -> KernelBackend {
        self.backend
    }

    /// Adds the kernel to the graph; returns its outputs (lazy, like any op).
    /// A libmlx without this backend fails here with MLX's message.
    pub fn call(
        &self,
        inputs: &[&Array],
        outputs: &[OutputSpec],
        launch: &LaunchConfig,
    ) -> Result<Vec<Array>> {
        if inputs.len() != self.n_inputs || outputs.len() != self.n_outputs {
            return Err(MlxError::invalid(
                "kernel call",
                format!(
                    "kernel takes {} inputs and {} outputs, got {} and {}",
                    self.n_inputs,
                    self.n_outputs,
                    inputs.len(),
                    outputs.len()
                ),
            ));
        }
        let h = handle_list(inputs);
        let (shapes, ndims, dtypes) = flat_outputs(outputs);
        let names = launch
            .template
            .iter()
            .map(|(n, _)| cstring("kernel call", n))
            .collect::<Result<Vec<_>>>()?;
        let name_ptrs: Vec<_> = names.iter().map(|s| s.as_ptr()).collect();
        let (kinds, values): (Vec<i32>, Vec<i32>) = launch
            .template
            .iter()
            .map(|(_, a)| match *a {
                TemplateArg::Int(v) => (0, v),
                TemplateArg::Bool(b) => (1, b as i32),
                TemplateArg::Dtype(d) => (2, d.code()),
            })
            .unzip();
        let mut outs = vec![std::ptr::null_mut(); outputs.len()];
        ffi!(
            "kernel call",
            sys::mlxs_kernel_call(
                self.raw.as_ptr(),
                h.as_ptr(),
                h.len(),
                shapes.as_ptr(),
                ndims.as_ptr(),
                dtypes.as_ptr(),
                outputs.len(),
                launch.grid.as_ptr(),
                launch.threadgroup.as_ptr(),
                name_ptrs.as_ptr(),
                kinds.as_ptr(),
                values.as_ptr(),
                kinds.len(),
                launch.init_value.is_some() as i32,
                launch.init_value.unwrap_or(0.0),
                outs.as_mut_ptr()
            )
        )?;
        outs.into_iter()
            .map(|p| Array::from_raw("kernel call", p))
            .collect()
    }
}

/// A CUDA kernel compiled by the caller (PTX or cubin), launched through
/// MLX's `precompiled_cuda_kernel`: entry point `name`, arguments the inputs
/// then the outputs. MLX loads the module once per name, so a name must
/// always come with the same code. The code is kept here and passed by
/// reference on each call.
pub struct PrecompiledKernel {
    raw: std::ptr::NonNull<sys::mlxs_cuda_binary>,
    name: String,
}

impl PrecompiledKernel {
    /// Wraps `code` (PTX text with its NUL, or a cubin) with entry `name`.
    pub fn new(name: &str, code: &[u8]) -> Result<Self> {
        if !KernelBackend::Cuda.compiled_in() {
            return Err(MlxError::BackendUnavailable {
                backend: "cuda",
                reason: "glm-stream was built without the `cuda` feature".into(),
            });
        }
        let name_c = cstring("precompiled kernel", name)?;
        let mut raw = std::ptr::null_mut();
        ffi!(
            "precompiled kernel",
            sys::mlxs_cuda_binary_new(&mut raw, name_c.as_ptr(), code.as_ptr().cast(), code.len())
        )?;
        let raw = std::ptr::NonNull::new(raw)
            .ok_or_else(|| MlxError::invalid("precompiled kernel", "null handle"))?;
        Ok(Self {
            raw,
            name: name.to_string(),
        })
    }

    /// The entry point.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds a launch to the graph on `launch.grid` threads (MLX semantics)
    /// with `shared_memory` bytes of dynamic shared memory (template
    /// arguments do not apply: the code is already specialized). A libmlx
    /// without CUDA fails here with MLX's message.
    pub fn call(
        &self,
        inputs: &[&Array],
        outputs: &[OutputSpec],
        launch: &LaunchConfig,
        shared_memory: u32,
    ) -> Result<Vec<Array>> {
        let h = handle_list(inputs);
        let (shapes, ndims, dtypes) = flat_outputs(outputs);
        let smem = i32::try_from(shared_memory).map_err(|_| {
            MlxError::invalid("precompiled kernel", "shared memory size exceeds i32")
        })?;
        let mut outs = vec![std::ptr::null_mut(); outputs.len()];
        ffi!(
            "precompiled kernel",
            sys::mlxs_cuda_binary_call(
                self.raw.as_ptr(),
                h.as_ptr(),
                h.len(),
                shapes.as_ptr(),
                ndims.as_ptr(),
                dtypes.as_ptr(),
                outputs.len(),
                launch.grid.as_ptr(),
                launch.threadgroup.as_ptr(),
                smem,
                launch.init_value.is_some() as i32,
                launch.init_value.unwrap_or(0.0),
                1,
                outs.as_mut_ptr()
            )
        )?;
        outs.into_iter()
            .map(|p| Array::from_raw("precompiled kernel", p))
            .collect()
    }
}

impl Drop for PrecompiledKernel {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim and is freed exactly once.
        unsafe { sys::mlxs_cuda_binary_free(self.raw.as_ptr()) }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: the kernel came from the shim and is freed exactly once.
        unsafe { sys::mlxs_kernel_free(self.raw.as_ptr()) }
    }
}
