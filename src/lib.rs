//! glm-stream: run GLM-5.x Mixture-of-Experts models (`glm_moe_dsa`) on MLX with the
//! routed experts streamed from SSD into a fixed pool of slab slots.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod container;
pub mod convert;
pub mod executor;
pub mod experts;
pub mod generate;
pub mod kernels;
pub mod mlx;
pub mod model;
pub mod moe;
pub mod quant;
pub mod resident;
pub mod tiny;
