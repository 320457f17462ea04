//! The CUDA sources of the fused expert kernels (compiled by MLX with NVRTC
//! on first use; see [`super::fused`] for the launch geometry).
//!
//! Two designs: the tensor-core kernels (`swiglu_mma_*.cu`, int4 gate/up and
//! down) and the CUDA-core kernels (`swiglu_*.cu`, int4 and int8; the design
//! the Metal twin follows line for line).

use super::fused::KernelSources;

/// The CUDA-core kernels: helpers, K1 (gate/up + SwiGLU), K2 (down).
pub(super) const SOURCES: KernelSources = KernelSources {
    header: include_str!("swiglu_header.cu"),
    gate_up: include_str!("swiglu_gate_up.cu"),
    down: include_str!("swiglu_down.cu"),
    slot_prologue,
};

/// The tensor-core int4 kernels (`mma.sync` m16n8k16, bf16 in, f32 out).
pub(super) const MMA_SOURCES: KernelSources = KernelSources {
    header: include_str!("swiglu_mma_header.cu"),
    gate_up: include_str!("swiglu_mma_gate_up.cu"),
    down: include_str!("swiglu_mma_down.cu"),
    slot_prologue,
};

/// Declares `slots[n]` from the slot inputs `e0 … e{n-1}`.
fn slot_prologue(inputs: usize) -> String {
    let list: Vec<String> = (0..inputs).map(|e| format!("e{e}")).collect();
    format!(
        "const uint8_t* const slots[{inputs}] = {{{}}};\n",
        list.join(", ")
    )
}
