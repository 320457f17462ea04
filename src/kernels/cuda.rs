//! The CUDA sources of the fused expert kernels (compiled by MLX with NVRTC
//! on first use; see [`super::fused`] for the launch geometry).

use super::fused::KernelSources;

/// Helpers placed before the kernels (`glm_chunk_dot`, `glm_warp_sum`).
const HEADER: &str = include_str!("swiglu_header.cu");
/// K1: gate/up projections and SwiGLU, one expert per `blockIdx.y`.
const GATE_UP: &str = include_str!("swiglu_gate_up.cu");
/// K2: down projections and the routing-weighted sum over experts.
const DOWN: &str = include_str!("swiglu_down.cu");

/// Declares `slots[EXPERTS]` from the per-expert inputs `e0 … e{n-1}`.
fn slot_prologue(experts: usize) -> String {
    let list: Vec<String> = (0..experts).map(|e| format!("e{e}")).collect();
    format!(
        "const uint8_t* const slots[EXPERTS] = {{{}}};\n",
        list.join(", ")
    )
}

/// The CUDA kernel texts.
pub(super) const SOURCES: KernelSources = KernelSources {
    header: HEADER,
    gate_up: GATE_UP,
    down: DOWN,
    slot_prologue,
};
