//! Routed experts streamed from SSD into a fixed pool of slab slots.
//!
//! - [`layout`]: where each tensor of an expert sits in its slot and which
//!   file reads put it there.
//! - [`slab`]: the slot memory (MLX-owned arenas) and slot generations.
//! - [`reader`]: the disk side (O_DIRECT/F_NOCACHE reads, I/O threads).
//! - [`residency`]: which experts stay, the lease protocol, telemetry.
//! - [`trace`]: the routing of a run ([`RoutingTrace`]), saved as JSON lines.
//! - [`replay`]: a trace replayed through the policy, LRU and Belady's optimum.
//!
//! The protocol that makes writing slot memory from I/O threads sound: a slot
//! is written only while it is assigned to a load that no lease has been
//! handed yet; a slot is reassigned only when no lease holds it; a lease is
//! released only after the MLX computations that read it have completed
//! ([`residency::Lease::release_fenced`] synchronizes first).

pub mod layout;
pub mod reader;
pub mod replay;
pub mod residency;
pub mod slab;
pub mod trace;

pub use layout::ProjectionFormat;
pub use layout::{ExpertExtents, Projection, ScalePath, SlotLayout, TensorExtent};
pub use reader::{DirectUpload, ExpertSource, FileExpertSource, SlotTarget, SlotUpload};
pub use replay::ReplayResult;
pub use residency::{
    Lease, LeaseEntry, PolicyConfig, PolicyEntry, PolicyLease, ResidencyManager, ResidencyPolicy,
    Telemetry,
};
pub use slab::{SlabConfig, SlabStore, SlotHandle};
pub use trace::{LayerRouting, Request, RoutingTrace, TraceError};

use crate::mlx::MlxError;
use std::path::PathBuf;

/// An error from the streamed-experts subsystem. Every variant names what it
/// was doing (layer, expert, slot, file, byte range).
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    /// A configuration value is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A slot index past the pool.
    #[error("slot {slot} is out of range 0..{slots}")]
    SlotOutOfRange { slot: u32, slots: usize },
    /// A handle whose slot was reused since it was issued.
    #[error("slot {slot} generation {generation} is stale (now {current})")]
    StaleHandle {
        slot: u32,
        generation: u64,
        current: u64,
    },
    /// A view that does not fit in the slot.
    #[error("slot {slot}: bytes {offset}..{end} exceed the slot size {slot_bytes}")]
    OutOfSlot {
        slot: u32,
        offset: usize,
        end: usize,
        slot_bytes: usize,
    },
    /// A layer or expert id outside the model.
    #[error("layer {layer} expert {expert} is outside {layers} layers × {experts} experts")]
    UnknownExpert {
        layer: u32,
        expert: u32,
        layers: u32,
        experts: u32,
    },
    /// The same expert was asked for twice in one acquire.
    #[error("layer {layer}: expert {expert} requested twice in one acquire")]
    DuplicateRequest { layer: u32, expert: u32 },
    /// Not enough free slots for the misses of an acquire.
    #[error(
        "layer {layer}: {needed} slots needed, {available} available (pool {slots}, budget {budget})"
    )]
    PoolExhausted {
        layer: u32,
        needed: usize,
        available: usize,
        slots: usize,
        budget: usize,
    },
    /// An expert another lease is still loading.
    #[error("layer {layer} expert {expert} is being loaded by another lease")]
    Busy { layer: u32, expert: u32 },
    /// The lease is unknown (already released, or from another manager).
    #[error("lease {0} is not held")]
    UnknownLease(u64),
    /// An OS error while reading an expert.
    #[error("layer {layer} expert {expert}: reading {} bytes {offset}..{} failed: {source}", path.display(), offset + len)]
    Io {
        layer: u32,
        expert: u32,
        path: PathBuf,
        offset: u64,
        len: u64,
        source: std::io::Error,
    },
    /// The file ended before the expected bytes.
    #[error("layer {layer} expert {expert}: {} ended at byte {got_end} while reading {offset}..{end}", path.display())]
    ShortRead {
        layer: u32,
        expert: u32,
        path: PathBuf,
        offset: u64,
        end: u64,
        got_end: u64,
    },
    /// A tensor or read whose size differs from what the layout expects.
    #[error("layer {layer} expert {expert}: {what} is {actual} bytes, expected {expected}")]
    SizeMismatch {
        layer: u32,
        expert: u32,
        what: String,
        expected: u64,
        actual: u64,
    },
    /// A layout whose projections cannot be used by the kernels.
    #[error("layer {layer} expert {expert}: {message}")]
    Layout {
        layer: u32,
        expert: u32,
        message: String,
    },
    /// A shard could not be opened.
    #[error("opening {}: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The usage file could not be parsed.
    #[error("usage file {}: line {line}: {message}", path.display())]
    UsageFile {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// Reading or writing the usage file failed.
    #[error("usage file {}: {source}", path.display())]
    UsageIo {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The I/O threads are gone.
    #[error("the expert I/O pool has shut down")]
    PoolClosed,
    /// An MLX call failed.
    #[error(transparent)]
    Mlx(#[from] MlxError),
    /// An operation failed and its cleanup failed too; the slots involved are
    /// quarantined (never reused) rather than risked.
    #[error("{error}; cleanup also failed: {cleanup}")]
    Cleanup {
        error: Box<ExpertError>,
        cleanup: Box<ExpertError>,
    },
}

/// Result alias for this module.
pub type Result<T, E = ExpertError> = std::result::Result<T, E>;
