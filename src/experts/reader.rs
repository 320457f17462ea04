//! The disk side: reading an expert's tensors into its slot.
//!
//! [`ExpertSource`] reads one expert into a byte slice (the slot);
//! [`FileExpertSource`] does it from shard files with the reads of a
//! [`SlotLayout`], through an O_DIRECT (Linux) / F_NOCACHE (macOS) descriptor
//! when asked. [`SlotUpload`] is the host→slot step: [`DirectUpload`] reads
//! straight into host-visible slot memory; a GPU build can stage through
//! pinned memory and copy instead.
//!
//! Reads run on a small pool of std threads (`IoPool`): expert reads are
//! blocking `pread`s of ~20 MB, so a handful of OS threads keeps several in
//! flight without an async runtime (tokio's file I/O would run the same
//! blocking calls on its own thread pool).

use super::layout::SlotLayout;
use super::slab::SlotHandle;
use super::{ExpertError, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Reads one expert into a slot's bytes.
pub trait ExpertSource: Send + Sync {
    /// Fills `dst` (a whole slot) with expert `(layer, expert)` and returns
    /// the bytes read from storage. Must fail (not panic) on short reads, OS
    /// errors and size mismatches.
    fn read_expert(&self, layer: u32, expert: u32, dst: &mut [u8]) -> Result<u64>;
}

/// Exclusive write access to one slot's bytes for the duration of a load.
#[derive(Debug)]
pub struct SlotTarget<'a> {
    bytes: &'a mut [u8],
    handle: SlotHandle,
}

impl<'a> SlotTarget<'a> {
    /// The slot bytes.
    pub fn bytes(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// The slot and generation being filled.
    pub fn handle(&self) -> SlotHandle {
        self.handle
    }
}

/// Moves an expert from storage into its slot.
pub trait SlotUpload: Send + Sync {
    /// Loads `(layer, expert)` from `source` into `target`; returns bytes read.
    fn upload(
        &self,
        source: &dyn ExpertSource,
        layer: u32,
        expert: u32,
        target: SlotTarget<'_>,
    ) -> Result<u64>;
}

/// Reads straight into the slot (unified / host-visible memory).
#[derive(Debug, Default, Clone, Copy)]
pub struct DirectUpload;

impl SlotUpload for DirectUpload {
    fn upload(
        &self,
        source: &dyn ExpertSource,
        layer: u32,
        expert: u32,
        mut target: SlotTarget<'_>,
    ) -> Result<u64> {
        source.read_expert(layer, expert, target.bytes())
    }
}

/// A slot's raw address, moved to an I/O thread. Only the residency manager
/// makes these, for slots it has just reassigned to a load.
pub(crate) struct RawSlot {
    ptr: *mut u8,
    len: usize,
    handle: SlotHandle,
}

// SAFETY: the pointer is into an MLX arena that the manager keeps alive until
// the I/O pool is joined, and the lease protocol gives the load exclusive use
// of these bytes (no lease holds the slot and no MLX computation reads it
// until the load completes), so moving the address to another thread cannot
// create a data race.
unsafe impl Send for RawSlot {}

impl RawSlot {
    /// # Safety
    /// `ptr..ptr+len` must be a slot just reassigned to one load: no lease
    /// holds it, no MLX computation reads it, nothing else writes it until the
    /// load's reply is received, and its memory outlives the [`IoPool`].
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize, handle: SlotHandle) -> Self {
        Self { ptr, len, handle }
    }
}

/// Result of one load.
pub(crate) struct LoadDone {
    pub expert: u32,
    pub handle: SlotHandle,
    pub result: Result<u64>,
    pub elapsed: Duration,
}

struct Job {
    slot: RawSlot,
    layer: u32,
    expert: u32,
    reply: Sender<LoadDone>,
}

/// A fixed pool of I/O threads. Dropping it joins the threads, so no write
/// into slot memory outlives the pool.
pub(crate) struct IoPool {
    tx: Option<Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl IoPool {
    pub(crate) fn new(
        threads: usize,
        source: Arc<dyn ExpertSource>,
        upload: Arc<dyn SlotUpload>,
    ) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            let source = Arc::clone(&source);
            let upload = Arc::clone(&upload);
            let h = std::thread::Builder::new()
                .name(format!("expert-io-{i}"))
                .spawn(move || worker(&rx, &*source, &*upload))
                .map_err(|e| ExpertError::Config(format!("cannot start I/O thread: {e}")))?;
            handles.push(h);
        }
        Ok(Self {
            tx: Some(tx),
            threads: handles,
        })
    }

    /// Queues a load; the result arrives on `reply`.
    pub(crate) fn submit(
        &self,
        slot: RawSlot,
        layer: u32,
        expert: u32,
        reply: Sender<LoadDone>,
    ) -> Result<()> {
        let tx = self.tx.as_ref().ok_or(ExpertError::PoolClosed)?;
        tx.send(Job {
            slot,
            layer,
            expert,
            reply,
        })
        .map_err(|_| ExpertError::PoolClosed)
    }
}

fn worker(rx: &Mutex<Receiver<Job>>, source: &dyn ExpertSource, upload: &dyn SlotUpload) {
    loop {
        let job = match rx.lock() {
            Ok(guard) => match guard.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
            Err(_) => return,
        };
        let start = Instant::now();
        let handle = job.slot.handle;
        // SAFETY: `RawSlot`s are made only by the residency manager for a slot
        // it has just reassigned to this load: no lease holds the slot, every
        // computation that read its previous contents was fenced before the
        // slot was released, and the manager waits for this job's reply before
        // handing the slot to anyone. The arena stays alive until the pool is
        // joined. So these bytes are exclusively ours for this call.
        let bytes = unsafe { std::slice::from_raw_parts_mut(job.slot.ptr, job.slot.len) };
        let target = SlotTarget { bytes, handle };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            upload.upload(source, job.layer, job.expert, target)
        }))
        .unwrap_or_else(|_| {
            Err(ExpertError::Layout {
                layer: job.layer,
                expert: job.expert,
                message: "the expert reader panicked".into(),
            })
        });
        // A closed reply channel means the acquirer is gone; nothing to do.
        let _ = job.reply.send(LoadDone {
            expert: job.expert,
            handle,
            result,
            elapsed: start.elapsed(),
        });
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One shard opened twice: buffered, and uncached (O_DIRECT / F_NOCACHE) when asked.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
}

/// Opens `path` for uncached reads: `O_DIRECT` on Linux, `F_NOCACHE` on macOS.
pub fn open_uncached(path: &Path) -> std::io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::fd::AsRawFd;
        let f = File::open(path)?;
        // SAFETY: fcntl on a descriptor we own, with an integer argument.
        let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
        if rc == -1 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(f)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        File::open(path)
    }
}

/// Reads `len` bytes at `offset` into `dst` (`dst.len() >= len`), retrying on
/// EINTR and continuing after partial reads. Returns the bytes read, which is
/// less than `len` only at end of file. With `direct`, stops at a read that
/// ends off the 4096 grid (end of file for O_DIRECT).
pub fn read_full_at(
    file: &File,
    offset: u64,
    dst: &mut [u8],
    direct: bool,
) -> std::io::Result<u64> {
    let mut done = 0usize;
    while done < dst.len() {
        match file.read_at(&mut dst[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                if direct && n % super::layout::DIRECT_ALIGN as usize != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done as u64)
}

/// Experts read from shard files with precomputed slot layouts.
#[derive(Debug)]
pub struct FileExpertSource {
    shards: Vec<Shard>,
    layouts: HashMap<(u32, u32), SlotLayout>,
    direct: bool,
}

impl FileExpertSource {
    /// Opens `files` (indexed by [`super::TensorExtent::file`]); with
    /// `direct`, also an uncached descriptor per file. A file system that
    /// refuses O_DIRECT (tmpfs) falls back to buffered reads; see
    /// [`FileExpertSource::is_direct`].
    pub fn open(
        files: &[PathBuf],
        layouts: HashMap<(u32, u32), SlotLayout>,
        direct: bool,
    ) -> Result<Self> {
        let mut shards = Vec::with_capacity(files.len());
        for path in files {
            let buffered = File::open(path).map_err(|source| ExpertError::Open {
                path: path.clone(),
                source,
            })?;
            let d = if direct {
                match open_uncached(path) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        tracing::warn!(
                            "{}: uncached reads unavailable ({e}); using buffered reads",
                            path.display()
                        );
                        None
                    }
                }
            } else {
                None
            };
            shards.push(Shard {
                path: path.clone(),
                buffered,
                direct: d,
            });
        }
        for ((layer, expert), l) in &layouts {
            let files = l.reads.iter().map(|r| r.file);
            if let Some(f) = files
                .chain(l.staged.iter().map(|r| r.file))
                .find(|&f| f >= shards.len())
            {
                return Err(ExpertError::Layout {
                    layer: *layer,
                    expert: *expert,
                    message: format!("read names file {f} of {}", shards.len()),
                });
            }
            let oob = l.staged.iter().any(|r| {
                r.pieces.iter().any(|p| {
                    p.slot_offset
                        .checked_add(p.len)
                        .is_none_or(|e| e > l.slot_bytes)
                        || p.read_offset
                            .checked_add(p.len)
                            .is_none_or(|e| e as u64 > r.min_len)
                })
            });
            if oob {
                return Err(ExpertError::Layout {
                    layer: *layer,
                    expert: *expert,
                    message: "a staged piece lies outside its read or the slot".into(),
                });
            }
        }
        Ok(Self {
            shards,
            layouts,
            direct,
        })
    }

    /// A source for every routed expert of `layers` in `container`, with the
    /// canonical layouts computed from its catalog.
    pub fn from_container(
        container: &crate::container::ColibriContainer,
        layers: &[u32],
        direct: bool,
    ) -> Result<Self> {
        let experts = container.config().n_routed_experts.unwrap_or(0) as u32;
        let mut layouts = HashMap::new();
        for &layer in layers {
            for expert in 0..experts {
                let ext = super::layout::extents_from_container(container, layer, expert)?;
                layouts.insert((layer, expert), SlotLayout::plan(layer, expert, &ext)?);
            }
        }
        let files: Vec<PathBuf> = container
            .catalog()
            .shards
            .iter()
            .map(|s| s.path.clone())
            .collect();
        Self::open(&files, layouts, direct)
    }

    /// True when every shard has an uncached descriptor.
    pub fn is_direct(&self) -> bool {
        self.direct && self.shards.iter().all(|s| s.direct.is_some())
    }

    /// The slot layout of `(layer, expert)`.
    pub fn layout(&self, layer: u32, expert: u32) -> Option<&SlotLayout> {
        self.layouts.get(&(layer, expert))
    }

    /// The largest slot any expert needs.
    pub fn max_slot_bytes(&self) -> usize {
        self.layouts
            .values()
            .map(|l| l.slot_bytes)
            .max()
            .unwrap_or(0)
    }
}

impl ExpertSource for FileExpertSource {
    fn read_expert(&self, layer: u32, expert: u32, dst: &mut [u8]) -> Result<u64> {
        let layout = self
            .layouts
            .get(&(layer, expert))
            .ok_or(ExpertError::Layout {
                layer,
                expert,
                message: "no layout for this expert".into(),
            })?;
        if layout.slot_bytes > dst.len() {
            return Err(ExpertError::SizeMismatch {
                layer,
                expert,
                what: "slot".into(),
                expected: layout.slot_bytes as u64,
                actual: dst.len() as u64,
            });
        }
        let io_err = |shard: &Shard, offset: u64, len: u64| {
            let path = shard.path.clone();
            move |source| ExpertError::Io {
                layer,
                expert,
                path,
                offset,
                len,
                source,
            }
        };
        let short = |shard: &Shard, offset: u64, min_len: u64, got: u64| ExpertError::ShortRead {
            layer,
            expert,
            path: shard.path.clone(),
            offset,
            end: offset + min_len,
            got_end: offset + got,
        };
        let mut total = 0u64;
        for r in &layout.reads {
            let shard = &self.shards[r.file];
            let end = r.slot_offset + r.len as usize;
            // A 4096-rounded read may reach past the slot's used bytes; clip it
            // to the slot and require only the data bytes.
            let end_clipped = end.min(dst.len());
            let buf = &mut dst[r.slot_offset..end_clipped];
            let (file, direct) = shard.pick(r.direct_ok, buf);
            let got = read_full_at(file, r.offset, buf, direct)
                .map_err(io_err(shard, r.offset, r.len))?;
            if got < r.min_len {
                return Err(short(shard, r.offset, r.min_len, got));
            }
            total += got;
        }
        for r in &layout.staged {
            let shard = &self.shards[r.file];
            let len = usize::try_from(r.len).map_err(|_| ExpertError::Layout {
                layer,
                expert,
                message: format!("a staged read of {} bytes does not fit memory", r.len),
            })?;
            let got = SCRATCH.with(|cell| -> Result<u64> {
                let mut scratch = cell.borrow_mut();
                let buf = scratch.get(len);
                let (file, direct) = shard.pick(true, buf);
                let got = read_full_at(file, r.offset, buf, direct)
                    .map_err(io_err(shard, r.offset, r.len))?;
                if got < r.min_len {
                    return Err(short(shard, r.offset, r.min_len, got));
                }
                for p in &r.pieces {
                    dst[p.slot_offset..p.slot_offset + p.len]
                        .copy_from_slice(&buf[p.read_offset..p.read_offset + p.len]);
                }
                Ok(got)
            })?;
            total += got;
        }
        Ok(total)
    }
}

impl Shard {
    /// The descriptor for a read into `buf`: the uncached one when the read
    /// is direct-capable, the buffer is 4096-aligned in address and length,
    /// and the shard has one; the buffered one otherwise.
    fn pick(&self, direct_ok: bool, buf: &[u8]) -> (&File, bool) {
        let a = super::layout::DIRECT_ALIGN as usize;
        let aligned = (buf.as_ptr() as usize) % a == 0 && buf.len() % a == 0;
        match (&self.direct, direct_ok && aligned) {
            (Some(f), true) => (f, true),
            _ => (&self.buffered, false),
        }
    }
}

/// A reusable 4096-aligned buffer for staged reads (one per I/O thread).
#[derive(Default)]
struct Scratch {
    raw: Vec<u8>,
}

impl Scratch {
    /// An aligned `len`-byte window of the buffer, grown as needed.
    fn get(&mut self, len: usize) -> &mut [u8] {
        let a = super::layout::DIRECT_ALIGN as usize;
        if self.raw.len() < len + a {
            self.raw = vec![0; len + a];
        }
        let pad = self.raw.as_ptr().align_offset(a);
        &mut self.raw[pad..pad + len]
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}
