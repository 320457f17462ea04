//! The Metal twin of the CUDA kernels, a line-for-line translation for
//! `fast::metal_kernel` (simdgroups for warps, static threadgroup memory
//! sized by the `SMEM_FLOATS` template argument, hence the 32 KB limit the
//! selection applies).
//!
//! **Untested:** the project has no Mac; these sources have never been
//! compiled. They are selected only on macOS builds with the `metal` feature.

use super::fused::KernelSources;

const HEADER: &str = include_str!("swiglu_header.metal");
const GATE_UP: &str = include_str!("swiglu_gate_up.metal");
const DOWN: &str = include_str!("swiglu_down.metal");

/// Declares `slots[n]` from the slot inputs `e0 … e{n-1}` (at least
/// `EXPERTS` of them; padding repeats the first).
fn slot_prologue(inputs: usize) -> String {
    let list: Vec<String> = (0..inputs).map(|e| format!("e{e}")).collect();
    format!(
        "device const uint8_t* slots[{inputs}] = {{{}}};\n",
        list.join(", ")
    )
}

/// The Metal kernel texts.
pub(super) const SOURCES: KernelSources = KernelSources {
    header: HEADER,
    gate_up: GATE_UP,
    down: DOWN,
    slot_prologue,
};
