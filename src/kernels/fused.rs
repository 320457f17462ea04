//! The fused path: builds, caches and launches the two kernels.
//!
//! K1 (gate/up + SwiGLU) takes `x` `[m, H]`, the per-expert slot offsets
//! `[E, 6]` and the `E` slot byte arrays, and writes `h` `[E, m, I]`.
//!
//! K2 (down + weighted sum) differs per backend. CUDA: one block row per
//! expert (`blockIdx.y`), each staging only its expert's `h` and writing its
//! routing-weighted output `[E, m, H]`, summed over experts by MLX (a fixed
//! order, so results never depend on scheduling). Metal: every expert in
//! each threadgroup, `h` of up to `E'` experts staged (as many as fit),
//! groups beyond that summed with MLX adds.
//!
//! On CUDA, int4 experts run on the tensor-core kernels
//! ([`FusedKernel::TensorCore`], `swiglu_mma_*.cu`) unless the CUDA-core
//! ones are pinned; int8 experts always take the CUDA-core kernels.
//!
//! The slot arrays are kernel inputs `e0 … e{n-1}`; `n` is the expert count
//! rounded up to a power of two, at least 8 (padding repeats the first slot),
//! and the CUDA kernels read the expert count from the grid, so one compiled
//! kernel serves every wave size up to `n`: a decode compiles one variant per
//! row count, not one per (rows, experts) pair.
//!
//! Rows beyond [`FusedGeometry::rows_per_launch`] are split into launches.
//! The CUDA kernels' rows per warp and chunks per step come from a
//! [`FusedTuning`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::mlx::{
    self, Array, Dtype, Kernel, KernelBackend, KernelSpec, LaunchConfig, OutputSpec,
    PrecompiledKernel, TemplateArg,
};

use super::nvrtc::Nvrtc;
use super::select::{FusedGeometry, mma_staged_floats, staged_floats};
use super::{ExpertSlot, KernelError, Result};

/// Threads per block / threadgroup: 8 warps (simdgroups) of 32.
const THREADS: i32 = 256;
const WARPS: i32 = THREADS / 32;
/// Intermediate rows per warp of the tensor-core K1 (MMA rows 0–7 gate,
/// 8–15 up).
const MMA_GATE_UP_ROWS: i32 = 8;
/// Output rows per warp of the tensor-core K2 (the 16 MMA rows).
const MMA_DOWN_ROWS: i32 = 16;
/// Chunks per lane and step of the tensor-core kernels unless pinned.
const MMA_DEFAULT_UNROLL: u32 = 2;
/// Slot inputs of a kernel are padded to at least this many.
const MIN_SLOT_INPUTS: usize = 8;
/// Intermediate rows per warp in the Metal K1 (gate and up each).
const METAL_GATE_UP_ROWS: u32 = 4;
/// Output rows per warp in the Metal K2.
const METAL_DOWN_ROWS: u32 = 2;

/// Launch shape of the CUDA kernels: rows per warp and 16-byte chunks per
/// lane and step (loads in flight per lane: `2 · rows · unroll` in K1,
/// `rows · unroll` in K2). Each value is 1, 2 or 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedTuning {
    /// K1: intermediate rows per warp (gate and up each).
    pub gate_up_rows: u32,
    /// K1: chunks per lane and step.
    pub gate_up_unroll: u32,
    /// K2: output rows per warp.
    pub down_rows: u32,
    /// K2: chunks per lane and step.
    pub down_unroll: u32,
}

impl FusedTuning {
    /// The CUDA-core kernels' default for `rows` input rows, from the H200
    /// sweep of benches/RESULTS.md (16 layers of 8 GLM-5.2 experts per
    /// eval): one row per warp in K1 at M = 1 (the most blocks), four from
    /// M = 3 on (each decoded weight serves more products); four rows per
    /// warp in K2 up to M = 4, two beyond (registers). Two chunks per step
    /// never helped by more than the noise. The tensor-core kernels have
    /// fixed rows per warp (8 + 8 in K1, 16 in K2) and take only the unrolls
    /// from a pinned tuning (default 2 and 2, the best of the H200 sweep).
    pub fn for_rows(rows: usize) -> Self {
        let (gate_up_rows, down_rows) = match rows {
            0 | 1 => (1, 4),
            2 => (2, 2),
            3 | 4 => (4, 4),
            _ => (4, 2),
        };
        Self {
            gate_up_rows,
            gate_up_unroll: 1,
            down_rows,
            down_unroll: 1,
        }
    }

    /// Checks every value is 1, 2 or 4.
    pub fn check(&self) -> Result<()> {
        let ok = |v: u32| matches!(v, 1 | 2 | 4);
        if [
            self.gate_up_rows,
            self.gate_up_unroll,
            self.down_rows,
            self.down_unroll,
        ]
        .into_iter()
        .all(ok)
        {
            Ok(())
        } else {
            Err(KernelError::Input(format!(
                "fused tuning {self:?}: every value must be 1, 2 or 4"
            )))
        }
    }
}

/// The kernel texts of one backend.
pub(super) struct KernelSources {
    /// Helpers placed before the kernels.
    pub header: &'static str,
    /// K1's body.
    pub gate_up: &'static str,
    /// K2's body.
    pub down: &'static str,
    /// Declares `slots[EXPERTS]` from the inputs `e0 … e{n-1}`.
    pub slot_prologue: fn(usize) -> String,
}

/// Which fused kernels run a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedKernel {
    /// CUDA, int4: `mma.sync` m16n8k16 with bf16 weights (`n − 8`, exact)
    /// and activations split into bf16 hi + lo, f32 accumulation.
    TensorCore,
    /// The CUDA-core kernels (int4 and int8; the Metal twin's design).
    CudaCore,
}

fn sources(backend: KernelBackend, kind: FusedKernel) -> &'static KernelSources {
    match (backend, kind) {
        (KernelBackend::Cuda, FusedKernel::TensorCore) => &super::cuda::MMA_SOURCES,
        (KernelBackend::Cuda, FusedKernel::CudaCore) => &super::cuda::SOURCES,
        (KernelBackend::Metal, _) => &super::metal::SOURCES,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Stage {
    GateUp,
    Down,
}

/// Identifies one compiled kernel: the source depends on the backend, the
/// design, the stage and the number of slot inputs, the dynamic shared
/// memory on the staged sizes; the other parameters are template arguments
/// (part of MLX's own cache key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct KernelKey {
    /// True for Metal, false for CUDA (`KernelBackend` is not `Hash`).
    metal: bool,
    kind: FusedKernel,
    stage: Stage,
    slot_inputs: usize,
    shared_bytes: usize,
}

/// One specialization of a kernel: its key, template values and parameter
/// dtype codes (cheap to hash per call, unlike the source text).
type Specialization = (KernelKey, Vec<i32>, Vec<i32>);

/// Compiled kernels of one [`super::FusedExperts`]: MLX-compiled ones by
/// key, and on CUDA, when NVRTC was opted into ([`Nvrtc::load`],
/// `GLM_STREAM_NVRTC`), PTX we compiled ourselves per specialization (run
/// through MLX's `precompiled_cuda_kernel`).
pub(super) struct Compiler {
    kernels: RefCell<HashMap<KernelKey, Rc<Kernel>>>,
    ptx: RefCell<HashMap<Specialization, Rc<PrecompiledKernel>>>,
    nvrtc: Option<Nvrtc>,
}

impl Compiler {
    /// For `backend`: NVRTC is looked up for CUDA only (see [`Nvrtc::load`];
    /// without it, the default, MLX compiles the kernels).
    pub(super) fn new(backend: Option<KernelBackend>) -> Self {
        let nvrtc = match backend {
            Some(KernelBackend::Cuda) => match Nvrtc::load() {
                Ok(n) => {
                    tracing::debug!(?n, "fused kernels: compiling with NVRTC directly");
                    Some(n)
                }
                Err(e) => {
                    tracing::debug!(%e, "fused kernels: MLX compiles them");
                    None
                }
            },
            _ => None,
        };
        Self {
            kernels: RefCell::new(HashMap::new()),
            ptx: RefCell::new(HashMap::new()),
            nvrtc,
        }
    }

    /// Kernels compiled so far (either way).
    pub(super) fn len(&self) -> usize {
        self.kernels.borrow().len() + self.ptx.borrow().len()
    }

    /// Whether CUDA kernels are compiled here (NVRTC) rather than by MLX.
    pub(super) fn uses_nvrtc(&self) -> bool {
        self.nvrtc.is_some()
    }
}

/// Slot inputs of a launch over `arrays` distinct byte arrays (arenas or
/// slot views): a power of two, at least [`MIN_SLOT_INPUTS`], so calls
/// share compiled kernels.
fn slot_inputs(arrays: usize) -> usize {
    arrays.max(MIN_SLOT_INPUTS).next_power_of_two()
}

/// What a kernel is called and takes: base name, body (slot prologue
/// included), header, input and output names.
struct Signature {
    name: String,
    body: String,
    header: &'static str,
    inputs: Vec<String>,
    outputs: &'static [&'static str],
}

fn signature(backend: KernelBackend, key: &KernelKey) -> Signature {
    let src = sources(backend, key.kind);
    let tensor = key.kind == FusedKernel::TensorCore;
    let (stage_name, body, first_inputs, outputs): (_, _, &[&str], &'static [&'static str]) =
        match key.stage {
            Stage::GateUp if tensor => ("gate_up", src.gate_up, &["x", "offs"], &["h", "cnt"]),
            Stage::GateUp => ("gate_up", src.gate_up, &["x", "offs"], &["h"]),
            Stage::Down if tensor => (
                "down",
                src.down,
                &["h", "wts", "offs", "cnt"],
                &["y", "part"],
            ),
            Stage::Down => ("down", src.down, &["h", "wts", "offs"], &["y"]),
        };
    let design = match key.kind {
        FusedKernel::TensorCore => "mma",
        FusedKernel::CudaCore => "simt",
    };
    let mut inputs: Vec<String> = first_inputs.iter().map(|s| s.to_string()).collect();
    inputs.extend((0..key.slot_inputs).map(|e| format!("e{e}")));
    Signature {
        name: format!(
            "glm_swiglu_{design}_{stage_name}_n{}_s{}",
            key.slot_inputs, key.shared_bytes
        ),
        body: format!("{}{}", (src.slot_prologue)(key.slot_inputs), body),
        header: src.header,
        inputs,
        outputs,
    }
}

fn kernel(cache: &Compiler, backend: KernelBackend, key: KernelKey) -> Result<Rc<Kernel>> {
    if let Some(k) = cache.kernels.borrow().get(&key) {
        return Ok(Rc::clone(k));
    }
    let sig = signature(backend, &key);
    let inputs: Vec<&str> = sig.inputs.iter().map(String::as_str).collect();
    let shared = match backend {
        KernelBackend::Cuda => {
            u32::try_from(key.shared_bytes).map_err(|_| KernelError::Unsupported {
                reason: "shared memory size exceeds u32".into(),
            })?
        }
        KernelBackend::Metal => 0,
    };
    let k = Rc::new(Kernel::new(
        backend,
        &KernelSpec {
            name: &sig.name,
            input_names: &inputs,
            output_names: sig.outputs,
            source: &sig.body,
            header: sig.header,
            ensure_row_contiguous: true,
            shared_memory: shared,
        },
    )?);
    cache.kernels.borrow_mut().insert(key, Rc::clone(&k));
    Ok(k)
}

/// The C type a kernel parameter of `dtype` is declared with in the
/// NVRTC-compiled source (bf16 / f16 as their bits: the kernels
/// reinterpret them).
fn c_type(dtype: Dtype) -> Result<&'static str> {
    Ok(match dtype {
        Dtype::Float32 => "float",
        Dtype::Bfloat16 | Dtype::Float16 | Dtype::Uint16 => "uint16_t",
        Dtype::Uint8 => "uint8_t",
        Dtype::Uint32 => "uint32_t",
        Dtype::Int32 => "int32_t",
        Dtype::Int64 => "int64_t",
        other => {
            return Err(KernelError::Unsupported {
                reason: format!("no CUDA parameter type for {other:?}"),
            });
        }
    })
}

/// PTX target of a design: `mma.sync` with bf16 needs sm_80; the CUDA-core
/// kernels run from sm_75 (the oldest target NVRTC 13 accepts).
fn ptx_arch(kind: FusedKernel) -> &'static str {
    match kind {
        FusedKernel::TensorCore => "compute_80",
        FusedKernel::CudaCore => "compute_75",
    }
}

/// FNV-1a of `text` (names a source uniquely enough for a module cache).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The whole translation unit NVRTC compiles for one specialization: the
/// integer types, the header, then an `extern "C"` kernel whose parameters
/// are the inputs then the outputs (MLX's argument order) and whose body
/// starts with the template constants. Returns (entry point, source); the
/// entry point carries a hash of the source, so one name never stands for
/// two codes in MLX's module cache.
pub(super) fn cuda_source(
    key: &KernelKey,
    template: &[(String, TemplateArg)],
    input_dtypes: &[Dtype],
    output_dtypes: &[Dtype],
) -> Result<(String, String)> {
    let sig = signature(KernelBackend::Cuda, key);
    if input_dtypes.len() != sig.inputs.len() || output_dtypes.len() != sig.outputs.len() {
        return Err(KernelError::Input(format!(
            "{}: {} inputs / {} outputs given, {} / {} declared",
            sig.name,
            input_dtypes.len(),
            output_dtypes.len(),
            sig.inputs.len(),
            sig.outputs.len()
        )));
    }
    let mut params = Vec::with_capacity(sig.inputs.len() + sig.outputs.len());
    for (n, d) in sig.inputs.iter().zip(input_dtypes) {
        params.push(format!("    const {}* {n}", c_type(*d)?));
    }
    for (n, d) in sig.outputs.iter().zip(output_dtypes) {
        params.push(format!("    {}* {n}", c_type(*d)?));
    }
    let mut constants = String::new();
    for (n, a) in template {
        let v = match *a {
            TemplateArg::Int(v) => v.to_string(),
            TemplateArg::Bool(b) => i32::from(b).to_string(),
            TemplateArg::Dtype(d) => {
                return Err(KernelError::Unsupported {
                    reason: format!("dtype template argument {n} = {d:?}"),
                });
            }
        };
        constants.push_str(&format!("  constexpr int {n} = {v};\n"));
    }
    let body = format!(
        "(\n{}) {{\n{constants}\n{}\n}}\n",
        params.join(",\n"),
        sig.body
    );
    let prelude = "typedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\n\
                   typedef unsigned int uint32_t;\ntypedef int int32_t;\n\
                   typedef long long int64_t;\n\n";
    let hash = fnv1a(&format!("{prelude}{}{body}", sig.header));
    let entry = format!("{}_{hash:016x}", sig.name);
    let source = format!(
        "{prelude}{}\nextern \"C\" __global__ void {entry}{body}",
        sig.header
    );
    Ok((entry, source))
}

/// Adds one kernel launch to the graph: on CUDA with NVRTC at hand, our
/// own PTX (compiled once per specialization) through MLX's
/// `precompiled_cuda_kernel`; otherwise MLX's `cuda_kernel` /
/// `metal_kernel`.
fn run(
    cache: &Compiler,
    backend: KernelBackend,
    key: KernelKey,
    inputs: &[&Array],
    outputs: &[OutputSpec],
    config: &LaunchConfig,
) -> Result<Vec<Array>> {
    match (&cache.nvrtc, backend) {
        (Some(nvrtc), KernelBackend::Cuda) => {
            let in_types: Vec<Dtype> = inputs.iter().map(|a| a.dtype()).collect();
            let out_types: Vec<Dtype> = outputs.iter().map(|o| o.dtype).collect();
            let values = config
                .template
                .iter()
                .map(|(_, a)| match *a {
                    TemplateArg::Int(v) => v,
                    TemplateArg::Bool(b) => i32::from(b),
                    TemplateArg::Dtype(d) => d.code(),
                })
                .collect();
            let codes = in_types
                .iter()
                .chain(&out_types)
                .map(|d| d.code())
                .collect();
            let spec: Specialization = (key, values, codes);
            let cached = cache.ptx.borrow().get(&spec).cloned();
            let kernel = match cached {
                Some(k) => k,
                None => {
                    let (entry, source) =
                        cuda_source(&key, &config.template, &in_types, &out_types)?;
                    let started = std::time::Instant::now();
                    let ptx = nvrtc.compile_ptx(&entry, &source, ptx_arch(key.kind))?;
                    tracing::debug!(
                        entry,
                        ms = started.elapsed().as_secs_f64() * 1e3,
                        "fused kernel compiled"
                    );
                    let k = Rc::new(PrecompiledKernel::new(&entry, &ptx)?);
                    cache.ptx.borrow_mut().insert(spec, Rc::clone(&k));
                    k
                }
            };
            let shared = u32::try_from(key.shared_bytes).map_err(|_| KernelError::Unsupported {
                reason: "shared memory size exceeds u32".into(),
            })?;
            Ok(kernel.call(inputs, outputs, config, shared)?)
        }
        _ => Ok(kernel(cache, backend, key)?.call(inputs, outputs, config)?),
    }
}

/// Compiles, with `nvrtc` and without MLX, the kernels a call with `rows`
/// rows and these experts would launch on CUDA (the design `kind`; x and y
/// bf16 when `bf16`): their entry points. For CI on machines without a GPU.
pub fn compile_cuda_kernels(
    nvrtc: &Nvrtc,
    geometry: &FusedGeometry,
    kind: FusedKernel,
    rows: usize,
    experts: usize,
    bf16: bool,
) -> Result<Vec<String>> {
    let (k1, k2) = launches(KernelBackend::Cuda, kind, geometry, None, rows, experts);
    let n = slot_inputs(1);
    let act = if bf16 && kind == FusedKernel::TensorCore {
        Dtype::Bfloat16
    } else {
        Dtype::Float32
    };
    let slots = std::iter::repeat_n(Dtype::Uint8, n);
    let mut entries = Vec::new();
    for (stage, launch) in [(Stage::GateUp, k1), (Stage::Down, k2)] {
        let key = KernelKey {
            metal: false,
            kind,
            stage,
            slot_inputs: n,
            shared_bytes: launch.smem_floats * 4,
        };
        let tensor = kind == FusedKernel::TensorCore;
        let (ins, outs): (Vec<Dtype>, Vec<Dtype>) = match stage {
            Stage::GateUp if tensor => (
                [act, Dtype::Int64]
                    .into_iter()
                    .chain(slots.clone())
                    .collect(),
                vec![Dtype::Float32, Dtype::Uint32],
            ),
            Stage::GateUp => (
                [Dtype::Float32, Dtype::Int64]
                    .into_iter()
                    .chain(slots.clone())
                    .collect(),
                vec![Dtype::Float32],
            ),
            Stage::Down if tensor => (
                [Dtype::Float32, Dtype::Float32, Dtype::Int64, Dtype::Uint32]
                    .into_iter()
                    .chain(slots.clone())
                    .collect(),
                vec![act, Dtype::Float32],
            ),
            Stage::Down => (
                [Dtype::Float32, Dtype::Float32, Dtype::Int64]
                    .into_iter()
                    .chain(slots.clone())
                    .collect(),
                vec![Dtype::Float32],
            ),
        };
        let bf = tensor.then_some(act == Dtype::Bfloat16);
        let template = template(
            KernelBackend::Cuda,
            geometry,
            experts,
            rows,
            stage,
            &launch,
            bf,
        )?;
        let (entry, source) = cuda_source(&key, &template, &ins, &outs)?;
        nvrtc.compile_ptx(&entry, &source, ptx_arch(kind))?;
        entries.push(entry);
    }
    Ok(entries)
}

fn int(name: &str, v: usize) -> Result<(String, TemplateArg)> {
    let v = i32::try_from(v).map_err(|_| KernelError::Unsupported {
        reason: format!("{name} = {v} exceeds i32"),
    })?;
    Ok((name.to_string(), TemplateArg::Int(v)))
}

/// One launch's shape: which kernels, rows per warp, chunks per step and
/// the staged floats per block.
#[derive(Debug, Clone, Copy)]
struct Launch {
    kind: FusedKernel,
    rows_per_warp: i32,
    unroll: u32,
    smem_floats: usize,
}

/// Template arguments of a stage. CUDA reads the expert count from the grid
/// (so it is not a template argument there); the Metal kernels loop over
/// `EXPERTS`. `ROWS`, `BITS` and `SMEM_FLOATS` are unused by the tensor-core
/// kernels and left out for them, which instead take whether the activation
/// (`x` in K1, `y` in K2) is bf16 (`XBF16` / `YBF16`, from `bf16`).
fn template(
    backend: KernelBackend,
    g: &FusedGeometry,
    experts: usize,
    rows: usize,
    stage: Stage,
    launch: &Launch,
    bf16: Option<bool>,
) -> Result<Vec<(String, TemplateArg)>> {
    let f = match stage {
        Stage::GateUp => g.gate_up,
        Stage::Down => g.down,
    };
    let mut args = Vec::with_capacity(9);
    if backend == KernelBackend::Metal {
        args.push(int("EXPERTS", experts)?);
    }
    args.push(int("TOKENS", rows)?);
    args.push(int("HIDDEN", g.hidden)?);
    args.push(int("INTER", g.inter)?);
    args.push(int("GROUP", f.group_size.map_or(0, |v| v as usize))?);
    args.push(int("UNROLL", launch.unroll as usize)?);
    if launch.kind == FusedKernel::CudaCore || backend == KernelBackend::Metal {
        args.push(int("BITS", usize::from(f.bits))?);
        args.push(int("ROWS", launch.rows_per_warp as usize)?);
        args.push(int("SMEM_FLOATS", launch.smem_floats)?);
    }
    if let Some(b) = bf16 {
        let name = match stage {
            Stage::GateUp => "XBF16",
            Stage::Down => "YBF16",
        };
        args.push(int(name, usize::from(b))?);
    }
    Ok(args)
}

fn blocks(rows: usize, rows_per_block: i32) -> Result<i32> {
    let b = rows.div_ceil(rows_per_block as usize);
    i32::try_from(b)
        .ok()
        .and_then(|b| b.checked_mul(THREADS))
        .ok_or_else(|| KernelError::Unsupported {
            reason: format!("{rows} rows overflow the launch grid"),
        })
}

/// The slot inputs of a launch: the distinct byte arrays, padded by
/// repeating the first to [`slot_inputs`] arrays.
fn padded_slots<'a>(slots: &[&'a Array]) -> Vec<&'a Array> {
    let n = slot_inputs(slots.len());
    let mut v = slots.to_vec();
    if let Some(&first) = slots.first() {
        v.resize(n, first);
    }
    v
}

/// Adds one stage's launch to the graph: `first` (the stage's non-slot
/// inputs) then the padded slot inputs; one block row per expert
/// (`blockIdx.y`) except Metal's K2, which loops over the experts itself.
/// `bf16` (tensor-core kernels only): whether the activation is bf16.
#[allow(clippy::too_many_arguments)]
fn launch_stage(
    cache: &Compiler,
    backend: KernelBackend,
    g: &FusedGeometry,
    stage: Stage,
    launch: &Launch,
    first: &[&Array],
    slots: &[&Array],
    experts: usize,
    rows: usize,
    outputs: &[OutputSpec],
    bf16: Option<bool>,
) -> Result<Vec<Array>> {
    let slot_arrays = padded_slots(slots);
    let key = KernelKey {
        metal: backend == KernelBackend::Metal,
        kind: launch.kind,
        stage,
        slot_inputs: slot_arrays.len(),
        shared_bytes: launch.smem_floats * 4,
    };
    let mut inputs: Vec<&Array> = first.to_vec();
    inputs.extend_from_slice(&slot_arrays);
    let (out_rows, grid_y) = match stage {
        Stage::GateUp => (g.inter, experts as i32),
        Stage::Down if backend == KernelBackend::Metal => (g.hidden, 1),
        Stage::Down => (g.hidden, experts as i32),
    };
    let config = LaunchConfig {
        grid: [blocks(out_rows, WARPS * launch.rows_per_warp)?, grid_y, 1],
        threadgroup: [THREADS, 1, 1],
        template: template(backend, g, experts, rows, stage, launch, bf16)?,
        init_value: None,
    };
    run(cache, backend, key, &inputs, outputs, &config)
}

/// K1: `h [E, m, I]` for the rows of `x` (`[m, H]`, f32).
fn gate_up(
    cache: &Compiler,
    backend: KernelBackend,
    g: &FusedGeometry,
    launch: &Launch,
    x: &Array,
    offs: &Array,
    slots: &[&Array],
) -> Result<Array> {
    let (experts, rows) = (offs.dim(0)? as usize, x.dim(0)? as usize);
    let out = OutputSpec {
        shape: vec![experts as i32, rows as i32, g.inter as i32],
        dtype: Dtype::Float32,
    };
    let first = [x, offs];
    let mut r = launch_stage(
        cache,
        backend,
        g,
        Stage::GateUp,
        launch,
        &first,
        slots,
        experts,
        rows,
        &[out],
        None,
    )?;
    Ok(r.remove(0))
}

/// K2 from `h` (`[E, m, I]`) and weights (`[m, E]`, f32): CUDA returns the
/// per-expert weighted outputs summed in expert order by MLX, Metal the
/// kernel's own sum; `[m, H]` either way.
#[allow(clippy::too_many_arguments)]
fn down(
    cache: &Compiler,
    backend: KernelBackend,
    g: &FusedGeometry,
    launch: &Launch,
    h: &Array,
    weights: &Array,
    offs: &Array,
    slots: &[&Array],
) -> Result<Array> {
    let (experts, rows) = (offs.dim(0)? as usize, weights.dim(0)? as usize);
    let cuda = backend == KernelBackend::Cuda;
    let shape = if cuda {
        vec![experts as i32, rows as i32, g.hidden as i32]
    } else {
        vec![rows as i32, g.hidden as i32]
    };
    let out = OutputSpec {
        shape,
        dtype: Dtype::Float32,
    };
    let first = [h, weights, offs];
    let y = launch_stage(
        cache,
        backend,
        g,
        Stage::Down,
        launch,
        &first,
        slots,
        experts,
        rows,
        &[out],
        None,
    )?
    .remove(0);
    Ok(if cuda { y.sum(&[0], false)? } else { y })
}

/// Tensor-core K1: `h [E, m, I]` (f32) and K2's zeroed completion counters
/// from `x` (`[m, H]`, f32 or bf16).
fn gate_up_tensor(
    cache: &Compiler,
    g: &FusedGeometry,
    launch: &Launch,
    x: &Array,
    offs: &Array,
    slots: &[&Array],
) -> Result<(Array, Array)> {
    let (experts, rows) = (offs.dim(0)? as usize, x.dim(0)? as usize);
    let outs = [
        OutputSpec {
            shape: vec![experts as i32, rows as i32, g.inter as i32],
            dtype: Dtype::Float32,
        },
        OutputSpec {
            shape: vec![down_blocks(g)?],
            dtype: Dtype::Uint32,
        },
    ];
    let first = [x, offs];
    let mut r = launch_stage(
        cache,
        KernelBackend::Cuda,
        g,
        Stage::GateUp,
        launch,
        &first,
        slots,
        experts,
        rows,
        &outs,
        Some(x.dtype() == Dtype::Bfloat16),
    )?;
    let cnt = r.remove(1);
    Ok((r.remove(0), cnt))
}

/// Tensor-core K2's blocks (row ranges), one completion counter each.
fn down_blocks(g: &FusedGeometry) -> Result<i32> {
    Ok(blocks(g.hidden, WARPS * MMA_DOWN_ROWS)? / THREADS)
}

/// Tensor-core K2: `y [m, H]` in `dtype` (f32 or bf16), the experts' parts
/// summed in expert order inside the kernel.
#[allow(clippy::too_many_arguments)]
fn down_tensor(
    cache: &Compiler,
    g: &FusedGeometry,
    launch: &Launch,
    h: &Array,
    weights: &Array,
    offs: &Array,
    cnt: &Array,
    slots: &[&Array],
    dtype: Dtype,
) -> Result<Array> {
    let (experts, rows) = (offs.dim(0)? as usize, weights.dim(0)? as usize);
    let outs = [
        OutputSpec {
            shape: vec![rows as i32, g.hidden as i32],
            dtype,
        },
        OutputSpec {
            shape: vec![experts as i32, rows as i32, g.hidden as i32],
            dtype: Dtype::Float32,
        },
    ];
    let first = [h, weights, offs, cnt];
    Ok(launch_stage(
        cache,
        KernelBackend::Cuda,
        g,
        Stage::Down,
        launch,
        &first,
        slots,
        experts,
        rows,
        &outs,
        Some(dtype == Dtype::Bfloat16),
    )?
    .remove(0))
}

/// The launch shapes of K1 and K2 for `rows` rows.
fn launches(
    backend: KernelBackend,
    kind: FusedKernel,
    g: &FusedGeometry,
    tuning: Option<&FusedTuning>,
    rows: usize,
    experts: usize,
) -> (Launch, Launch) {
    match (backend, kind) {
        (KernelBackend::Cuda, FusedKernel::TensorCore) => {
            let (u1, u2) = tuning.map_or((MMA_DEFAULT_UNROLL, MMA_DEFAULT_UNROLL), |t| {
                (t.gate_up_unroll, t.down_unroll)
            });
            (
                Launch {
                    kind,
                    rows_per_warp: MMA_GATE_UP_ROWS,
                    unroll: u1,
                    smem_floats: rows * mma_staged_floats(g.hidden),
                },
                Launch {
                    kind,
                    rows_per_warp: MMA_DOWN_ROWS,
                    unroll: u2,
                    smem_floats: rows * mma_staged_floats(g.inter),
                },
            )
        }
        (KernelBackend::Cuda, FusedKernel::CudaCore) => {
            let t = tuning
                .copied()
                .unwrap_or_else(|| FusedTuning::for_rows(rows));
            (
                Launch {
                    kind,
                    rows_per_warp: t.gate_up_rows as i32,
                    unroll: t.gate_up_unroll,
                    smem_floats: rows * g.hidden,
                },
                Launch {
                    kind,
                    rows_per_warp: t.down_rows as i32,
                    unroll: t.down_unroll,
                    smem_floats: rows * g.inter,
                },
            )
        }
        (KernelBackend::Metal, _) => (
            Launch {
                kind: FusedKernel::CudaCore,
                rows_per_warp: METAL_GATE_UP_ROWS as i32,
                unroll: 1,
                smem_floats: rows * staged_floats(g.hidden, g.gate_up.bits),
            },
            Launch {
                kind: FusedKernel::CudaCore,
                rows_per_warp: METAL_DOWN_ROWS as i32,
                unroll: 1,
                smem_floats: experts * rows * staged_floats(g.inter, g.down.bits),
            },
        ),
    }
}

/// The fused forward (inputs already checked, geometry planned).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    cache: &Compiler,
    backend: KernelBackend,
    kind: FusedKernel,
    g: &FusedGeometry,
    tuning: Option<&FusedTuning>,
    x: &Array,
    experts: &[ExpertSlot<'_>],
    weights: &Array,
) -> Result<Array> {
    let to_f32 = |a: &Array| -> Result<Array> {
        Ok(if a.dtype() == Dtype::Float32 {
            a.clone()
        } else {
            a.astype(Dtype::Float32)?
        })
    };
    let tensor = kind == FusedKernel::TensorCore && backend == KernelBackend::Cuda;
    // The tensor-core kernels read f32 or bf16 activations as they are.
    let x_in = if tensor && matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16) {
        x.clone()
    } else {
        to_f32(x)?
    };
    let w32 = to_f32(weights)?;
    // Kernel inputs: each distinct byte array once (experts of one arena
    // share it), and per expert [input, gate w, gate s, up w, up s, down w,
    // down s, pad] as byte offsets into that input.
    let mut slots: Vec<&Array> = Vec::new();
    let mut offsets: Vec<i64> = Vec::with_capacity(experts.len() * 8);
    for e in experts {
        let input = match slots.iter().position(|a| std::ptr::eq(*a, e.bytes)) {
            Some(i) => i,
            None => {
                slots.push(e.bytes);
                slots.len() - 1
            }
        };
        offsets.push(input as i64);
        for p in e.projections {
            for v in [p.weight_offset, p.scale_offset] {
                let at = v
                    .checked_add(e.offset)
                    .and_then(|a| i64::try_from(a).ok())
                    .ok_or_else(|| KernelError::Unsupported {
                        reason: format!("slot offset {} + {v} exceeds i64", e.offset),
                    })?;
                offsets.push(at);
            }
        }
        offsets.push(0);
    }
    let n = experts.len() as i32;
    let offs = Array::from_slice(&offsets, &[n, 8])?;
    let rows = x.dim(0)? as usize;
    let hidden = g.hidden as i32;
    let mut parts = Vec::new();
    for start in (0..rows).step_by(g.rows_per_launch) {
        let m = g.rows_per_launch.min(rows - start);
        let (r0, r1) = (start as i32, (start + m) as i32);
        let (xc, wc) = if m == rows {
            (x_in.clone(), w32.clone())
        } else {
            (
                x_in.slice(&[r0, 0], &[r1, hidden], &[1, 1])?,
                w32.slice(&[r0, 0], &[r1, n], &[1, 1])?,
            )
        };
        if tensor {
            let (k1, k2) = launches(backend, kind, g, tuning, m, experts.len());
            let (h, cnt) = gate_up_tensor(cache, g, &k1, &xc, &offs, &slots)?;
            parts.push(down_tensor(
                cache,
                g,
                &k2,
                &h,
                &wc,
                &offs,
                &cnt,
                &slots,
                x_in.dtype(),
            )?);
            continue;
        }
        let per = match backend {
            KernelBackend::Cuda => experts.len(),
            KernelBackend::Metal => g.experts_per_down(m),
        };
        let (k1, _) = launches(backend, kind, g, tuning, m, experts.len());
        let h = gate_up(cache, backend, g, &k1, &xc, &offs, &slots)?;
        let mut y: Option<Array> = None;
        for e0 in (0..experts.len()).step_by(per) {
            let e1 = (e0 + per).min(experts.len());
            let (_, k2) = launches(backend, kind, g, tuning, m, e1 - e0);
            let part = if e0 == 0 && e1 == experts.len() {
                down(cache, backend, g, &k2, &h, &wc, &offs, &slots)?
            } else {
                let (a, b) = (e0 as i32, e1 as i32);
                let hg = h.slice(&[a, 0, 0], &[b, m as i32, g.inter as i32], &[1, 1, 1])?;
                let wg = wc.slice(&[0, a], &[m as i32, b], &[1, 1])?;
                let og = offs.slice(&[a, 0], &[b, 8], &[1, 1])?;
                down(cache, backend, g, &k2, &hg, &wg, &og, &slots)?
            };
            y = Some(match y {
                Some(acc) => acc.add(&part)?,
                None => part,
            });
        }
        if let Some(y) = y {
            parts.push(y);
        }
    }
    let y = match parts.len() {
        1 => parts.remove(0),
        _ => {
            let refs: Vec<&Array> = parts.iter().collect();
            mlx::concatenate(&refs, 0)?
        }
    };
    Ok(if y.dtype() == x.dtype() {
        y
    } else {
        y.astype(x.dtype())?
    })
}
