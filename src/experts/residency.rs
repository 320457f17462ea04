//! Which experts stay in the slot pool, and the lease protocol around them.
//!
//! [`ResidencyPolicy`] is the pure bookkeeping (no MLX, no I/O): slot states,
//! LRU order, frequency pins learned from routing history, the run-time
//! budget and telemetry. [`ResidencyManager`] joins it with the slot memory
//! ([`SlabStore`]) and the I/O pool:
//!
//! 1. [`ResidencyManager::acquire`] leases a slot for each requested expert.
//!    Hits are passed to `on_resident` at once (so their compute can be
//!    submitted) while the misses load on I/O threads; each miss is passed to
//!    `on_resident` as it arrives.
//! 2. The caller evaluates the computations that read the slots, then calls
//!    [`Lease::release_fenced`], which synchronizes MLX before the slots may
//!    be reused. A slot is never reassigned while any lease holds it.
//!
//! Eviction: empty slots first, then the least recently used unpinned slot,
//! then (last resort) the least recently used pinned one. Pins are the most
//! frequently routed experts of the history, recomputed every
//! `repin_interval` recorded routes; the history persists in colibri's
//! `.coli_usage` format.
//!
//! How many pins adapts to the budget ([`ResidencyPolicy::pin_target`]). Let
//! `W` be one token's working set, learned from the requests (distinct layers
//! seen × the largest request). Recency (LRU) is worth something only while
//! the unpinned part of the pool still holds `W`: an expert reused by the
//! next token comes back after about `W` other requests. So
//!
//! * budget ≥ `W`: pin `pin_fraction · (budget − W)`, keeping at least `W`
//!   slots for LRU (at budget = `W` the policy is plain LRU);
//! * budget < `W`: LRU would thrash (every expert is evicted before its next
//!   use), so pin all but one request's worth of slots: frequency is the
//!   only signal left.
//!
//! Before any request `W` is unknown and `pin_fraction · budget` is pinned.

use super::reader::{IoPool, LoadDone, RawSlot};
use super::slab::{SlabConfig, SlabStore, SlotHandle};
use super::{ExpertError, ExpertSource, Result, SlotUpload};
use crate::mlx::{self, MlxError};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Policy parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Layers that have routed experts (ids are `0..layers`).
    pub layers: u32,
    /// Routed experts per layer.
    pub experts: u32,
    /// Slots in the pool.
    pub slots: usize,
    /// Share of the budget beyond one token's working set given to frequency
    /// pins (0 disables pinning); see the module docs.
    pub pin_fraction: f64,
    /// Recorded routing rows between pin recomputations.
    pub repin_interval: u64,
}

impl PolicyConfig {
    /// Three quarters of the budget beyond the working set pinned, pins recomputed every
    /// 64 routed rows.
    pub fn new(layers: u32, experts: u32, slots: usize) -> Self {
        Self {
            layers,
            experts,
            slots,
            pin_fraction: 0.75,
            repin_interval: 64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Empty,
    Loading,
    Ready,
}

#[derive(Debug, Clone)]
struct Slot {
    key: Option<(u32, u32)>,
    state: State,
    leases: u32,
    last_use: u64,
    quarantined: bool,
}

/// One leased expert as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyEntry {
    /// Expert id.
    pub expert: u32,
    /// Slot holding (or receiving) it.
    pub slot: u32,
    /// True when it was already resident.
    pub hit: bool,
}

/// A lease as the policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyLease {
    /// Lease id.
    pub id: u64,
    /// Layer.
    pub layer: u32,
    /// One entry per requested expert, in request order.
    pub entries: Vec<PolicyEntry>,
}

/// Counters and latency samples.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    /// Requested experts found resident.
    pub hits: u64,
    /// Requested experts that had to be loaded.
    pub misses: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// Loads that failed.
    pub failed_loads: u64,
    /// Resident experts dropped for another or for the budget.
    pub evictions: u64,
    per_layer: Vec<(u64, u64)>,
    latencies_us: Vec<u64>,
}

const MAX_LATENCY_SAMPLES: usize = 1 << 16;

impl Telemetry {
    /// hits / (hits + misses); `None` before any request.
    pub fn hit_rate(&self) -> Option<f64> {
        rate(self.hits, self.misses)
    }

    /// Layer `layer`'s hit rate.
    pub fn layer_hit_rate(&self, layer: u32) -> Option<f64> {
        let &(h, m) = self.per_layer.get(layer as usize)?;
        rate(h, m)
    }

    /// The `p`-th percentile (0–100, nearest rank) of load latency over the
    /// last 65,536 loads.
    pub fn load_latency(&self, p: f64) -> Option<Duration> {
        if self.latencies_us.is_empty() || !(0.0..=100.0).contains(&p) {
            return None;
        }
        let mut v = self.latencies_us.clone();
        v.sort_unstable();
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        Some(Duration::from_micros(v[rank.clamp(1, v.len()) - 1]))
    }

    fn record_latency(&mut self, d: Duration) {
        if self.latencies_us.len() == MAX_LATENCY_SAMPLES {
            self.latencies_us.remove(0);
        }
        self.latencies_us
            .push(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }
}

fn rate(h: u64, m: u64) -> Option<f64> {
    (h + m > 0).then(|| h as f64 / (h + m) as f64)
}

/// Slot bookkeeping, eviction and routing history (no MLX, no I/O).
#[derive(Debug, Clone)]
pub struct ResidencyPolicy {
    cfg: PolicyConfig,
    slots: Vec<Slot>,
    map: HashMap<(u32, u32), u32>,
    leases: HashMap<u64, Vec<u32>>,
    usage: Vec<u64>,
    pinned: HashSet<(u32, u32)>,
    budget: usize,
    clock: u64,
    next_lease: u64,
    since_repin: u64,
    /// Layers seen in requests, and how many.
    seen_layers: Vec<bool>,
    seen_layer_count: usize,
    /// The most experts one request asked for.
    max_request: usize,
    telemetry: Telemetry,
}

impl ResidencyPolicy {
    /// An empty pool.
    pub fn new(cfg: PolicyConfig) -> Result<Self> {
        if cfg.layers == 0 || cfg.experts == 0 || cfg.slots == 0 || cfg.slots > u32::MAX as usize {
            return Err(ExpertError::Config(format!(
                "{} layers × {} experts with {} slots",
                cfg.layers, cfg.experts, cfg.slots
            )));
        }
        if !(0.0..=1.0).contains(&cfg.pin_fraction) {
            return Err(ExpertError::Config(format!(
                "pin fraction {} is outside 0..=1",
                cfg.pin_fraction
            )));
        }
        let n = cfg.layers as usize * cfg.experts as usize;
        Ok(Self {
            slots: vec![
                Slot {
                    key: None,
                    state: State::Empty,
                    leases: 0,
                    last_use: 0,
                    quarantined: false,
                };
                cfg.slots
            ],
            map: HashMap::new(),
            leases: HashMap::new(),
            usage: vec![0; n],
            pinned: HashSet::new(),
            budget: cfg.slots,
            clock: 0,
            next_lease: 1,
            since_repin: 0,
            seen_layers: vec![false; cfg.layers as usize],
            seen_layer_count: 0,
            max_request: 0,
            telemetry: Telemetry {
                per_layer: vec![(0, 0); cfg.layers as usize],
                ..Telemetry::default()
            },
            cfg,
        })
    }

    /// Leases a slot for each of `experts` of `layer`. Nothing changes on error.
    pub fn acquire(&mut self, layer: u32, experts: &[u32]) -> Result<PolicyLease> {
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        for (i, &e) in experts.iter().enumerate() {
            self.check_key(layer, e)?;
            if experts[..i].contains(&e) {
                return Err(ExpertError::DuplicateRequest { layer, expert: e });
            }
            match self.map.get(&(layer, e)) {
                Some(&s) if self.slots[s as usize].state == State::Ready => hits.push((i, s)),
                Some(_) => return Err(ExpertError::Busy { layer, expert: e }),
                None => misses.push(i),
            }
        }
        let hit_slots: HashSet<u32> = hits.iter().map(|&(_, s)| s).collect();
        let victims = self.victims(misses.len(), &hit_slots);
        if victims.len() < misses.len() {
            return Err(ExpertError::PoolExhausted {
                layer,
                needed: misses.len(),
                available: victims.len(),
                slots: self.slots.len(),
                budget: self.budget,
            });
        }
        // Commit.
        self.clock += 1;
        self.max_request = self.max_request.max(experts.len());
        if let Some(seen) = self.seen_layers.get_mut(layer as usize) {
            if !*seen {
                *seen = true;
                self.seen_layer_count += 1;
            }
        }
        let mut entries = vec![
            PolicyEntry {
                expert: 0,
                slot: 0,
                hit: false
            };
            experts.len()
        ];
        for &(i, s) in &hits {
            let slot = &mut self.slots[s as usize];
            slot.leases += 1;
            slot.last_use = self.clock;
            entries[i] = PolicyEntry {
                expert: experts[i],
                slot: s,
                hit: true,
            };
        }
        for (&i, &s) in misses.iter().zip(&victims) {
            let slot = &mut self.slots[s as usize];
            if let Some(old) = slot.key.take() {
                self.map.remove(&old);
                self.telemetry.evictions += 1;
            }
            *slot = Slot {
                key: Some((layer, experts[i])),
                state: State::Loading,
                leases: 1,
                last_use: self.clock,
                quarantined: false,
            };
            self.map.insert((layer, experts[i]), s);
            entries[i] = PolicyEntry {
                expert: experts[i],
                slot: s,
                hit: false,
            };
        }
        self.telemetry.hits += hits.len() as u64;
        self.telemetry.misses += misses.len() as u64;
        let pl = &mut self.telemetry.per_layer[layer as usize];
        pl.0 += hits.len() as u64;
        pl.1 += misses.len() as u64;
        let id = self.next_lease;
        self.next_lease += 1;
        self.leases
            .insert(id, entries.iter().map(|e| e.slot).collect());
        Ok(PolicyLease { id, layer, entries })
    }

    /// Up to `n` slots to load into, best victim first.
    fn victims(&self, n: usize, exclude: &HashSet<u32>) -> Vec<u32> {
        let mut c: Vec<(u8, u64, u32)> = self
            .slots
            .iter()
            .enumerate()
            .take(self.budget)
            .filter(|(i, s)| {
                s.leases == 0
                    && !s.quarantined
                    && s.state != State::Loading
                    && !exclude.contains(&(*i as u32))
            })
            .map(|(i, s)| {
                let class = match s.key {
                    None => 0,
                    Some(k) if self.pinned.contains(&k) => 2,
                    Some(_) => 1,
                };
                (class, s.last_use, i as u32)
            })
            .collect();
        c.sort_unstable();
        c.into_iter().take(n).map(|(_, _, i)| i).collect()
    }

    /// Marks the load of `slot` under lease `id` finished. A failed load
    /// empties the slot and drops it from the lease.
    pub fn complete(&mut self, id: u64, slot: u32, ok: bool) -> Result<()> {
        let held = self
            .leases
            .get_mut(&id)
            .ok_or(ExpertError::UnknownLease(id))?;
        let s = slot as usize;
        let pos = held
            .iter()
            .position(|&x| x == slot)
            .filter(|_| self.slots.get(s).is_some_and(|x| x.state == State::Loading))
            .ok_or(ExpertError::SlotOutOfRange {
                slot,
                slots: self.slots.len(),
            })?;
        if ok {
            self.slots[s].state = State::Ready;
        } else {
            held.remove(pos);
            let st = &mut self.slots[s];
            if let Some(k) = st.key.take() {
                self.map.remove(&k);
            }
            st.state = State::Empty;
            st.leases = 0;
            self.telemetry.failed_loads += 1;
        }
        Ok(())
    }

    /// Releases lease `id` (the caller has fenced its computations).
    pub fn release(&mut self, id: u64) -> Result<()> {
        let held = self
            .leases
            .remove(&id)
            .ok_or(ExpertError::UnknownLease(id))?;
        self.clock += 1;
        for s in held {
            let st = &mut self.slots[s as usize];
            st.leases = st.leases.saturating_sub(1);
            st.last_use = self.clock;
            if st.leases == 0 && st.state == State::Loading {
                // A load that never completed: its bytes are unknown.
                if let Some(k) = st.key.take() {
                    self.map.remove(&k);
                }
                st.state = State::Empty;
            }
        }
        self.enforce_budget();
        Ok(())
    }

    /// Takes lease `id`'s slots out of service for good (their computations
    /// could not be fenced, so their memory may still be read).
    pub fn quarantine(&mut self, id: u64) -> Result<()> {
        let held = self
            .leases
            .remove(&id)
            .ok_or(ExpertError::UnknownLease(id))?;
        for s in held {
            let st = &mut self.slots[s as usize];
            if let Some(k) = st.key.take() {
                self.map.remove(&k);
            }
            st.state = State::Empty;
            st.quarantined = true;
        }
        Ok(())
    }

    /// Changes how many slots may hold experts (clamped to 1..=slots). Slots
    /// past the budget are emptied once no lease holds them.
    pub fn set_budget(&mut self, slots: usize) {
        self.budget = slots.clamp(1, self.slots.len());
        self.enforce_budget();
        self.repin();
    }

    /// The current budget in slots.
    pub fn budget(&self) -> usize {
        self.budget
    }

    fn enforce_budget(&mut self) {
        for st in &mut self.slots[self.budget..] {
            if st.leases == 0 && st.state == State::Ready {
                if let Some(k) = st.key.take() {
                    self.map.remove(&k);
                }
                st.state = State::Empty;
                self.telemetry.evictions += 1;
            }
        }
    }

    /// Counts the routed experts of one row (or a batch, row-major) of `layer`.
    pub fn record_routes(&mut self, layer: u32, experts: &[u32]) -> Result<()> {
        for &e in experts {
            self.check_key(layer, e)?;
        }
        for &e in experts {
            self.usage[(layer * self.cfg.experts + e) as usize] += 1;
        }
        self.since_repin += 1;
        if self.since_repin >= self.cfg.repin_interval {
            self.repin();
        }
        Ok(())
    }

    /// One token's working set in slots as learned so far: distinct layers
    /// requested × the largest request (0 before any request).
    pub fn working_set(&self) -> usize {
        self.seen_layer_count.saturating_mul(self.max_request)
    }

    /// How many experts [`ResidencyPolicy::repin`] pins at the current budget
    /// (see the module docs).
    pub fn pin_target(&self) -> usize {
        let b = self.budget;
        let w = self.working_set();
        let f = self.cfg.pin_fraction;
        if f == 0.0 {
            0
        } else if w == 0 {
            (f * b as f64).floor() as usize
        } else if b >= w {
            (f * (b - w) as f64).floor() as usize
        } else {
            b.saturating_sub(self.max_request)
        }
    }

    /// Recomputes the pinned set: the most used experts, up to
    /// [`ResidencyPolicy::pin_target`] of them (ties: lower layer, lower
    /// expert).
    pub fn repin(&mut self) {
        self.since_repin = 0;
        let n = self.pin_target();
        let mut keys: Vec<(u64, usize)> = self
            .usage
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(i, &c)| (c, i))
            .collect();
        keys.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let e = self.cfg.experts as usize;
        self.pinned = keys
            .into_iter()
            .take(n)
            .map(|(_, i)| ((i / e) as u32, (i % e) as u32))
            .collect();
    }

    /// True when `(layer, expert)` is resident and loaded.
    pub fn is_resident(&self, layer: u32, expert: u32) -> bool {
        self.map
            .get(&(layer, expert))
            .is_some_and(|&s| self.slots[s as usize].state == State::Ready)
    }

    /// True when `(layer, expert)` is currently pinned.
    pub fn is_pinned(&self, layer: u32, expert: u32) -> bool {
        self.pinned.contains(&(layer, expert))
    }

    /// How many leases hold `slot`.
    pub fn lease_count(&self, slot: u32) -> u32 {
        self.slots.get(slot as usize).map_or(0, |s| s.leases)
    }

    /// Number of leases outstanding.
    pub fn open_leases(&self) -> usize {
        self.leases.len()
    }

    /// Routing count of `(layer, expert)`.
    pub fn usage(&self, layer: u32, expert: u32) -> u64 {
        if layer >= self.cfg.layers || expert >= self.cfg.experts {
            return 0;
        }
        self.usage[(layer * self.cfg.experts + expert) as usize]
    }

    /// Counters so far.
    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    fn telemetry_mut(&mut self) -> &mut Telemetry {
        &mut self.telemetry
    }

    /// Writes the routing history as `.coli_usage` text: a header
    /// `-1 <layers> <experts>`, then `<layer> <expert> <count>` for every
    /// non-zero count. Written to a temporary file and renamed into place.
    pub fn save_usage(&self, path: &Path) -> Result<()> {
        use std::fmt::Write as _;
        let mut text = format!("-1 {} {}\n", self.cfg.layers, self.cfg.experts);
        for (i, &c) in self.usage.iter().enumerate().filter(|(_, c)| **c > 0) {
            let e = self.cfg.experts as usize;
            let _ = writeln!(text, "{} {} {}", i / e, i % e, c);
        }
        let io = |source| ExpertError::UsageIo {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Replaces the routing history with the file's (and repins). Header
    /// lines (`-1 …`, `-2 …`) are checked or skipped; a malformed line or an
    /// out-of-range id fails and leaves the history unchanged.
    pub fn load_usage(&mut self, path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(path).map_err(|source| ExpertError::UsageIo {
            path: path.to_path_buf(),
            source,
        })?;
        let mut usage = vec![0u64; self.usage.len()];
        for (n, line) in text.lines().enumerate() {
            let bad = |message: String| ExpertError::UsageFile {
                path: path.to_path_buf(),
                line: n + 1,
                message,
            };
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.is_empty() {
                continue;
            }
            if f.len() != 3 {
                return Err(bad(format!("expected 3 fields, got {}", f.len())));
            }
            let tag: i64 = f[0]
                .parse()
                .map_err(|_| bad(format!("bad layer {:?}", f[0])))?;
            match tag {
                -1 => {
                    let dims: (Option<u32>, Option<u32>) = (f[1].parse().ok(), f[2].parse().ok());
                    if dims != (Some(self.cfg.layers), Some(self.cfg.experts)) {
                        return Err(bad(format!(
                            "history is for {} layers × {} experts, the model has {} × {}",
                            f[1], f[2], self.cfg.layers, self.cfg.experts
                        )));
                    }
                }
                -2 => {}
                t if t < 0 => return Err(bad(format!("unknown header tag {t}"))),
                _ => {
                    let layer = u32::try_from(tag).map_err(|_| bad("layer too large".into()))?;
                    let expert: u32 = f[1]
                        .parse()
                        .map_err(|_| bad(format!("bad expert {:?}", f[1])))?;
                    let count: u64 = f[2]
                        .parse()
                        .map_err(|_| bad(format!("bad count {:?}", f[2])))?;
                    if layer >= self.cfg.layers || expert >= self.cfg.experts {
                        return Err(bad(format!(
                            "layer {layer} expert {expert} is out of range"
                        )));
                    }
                    let c = &mut usage[(layer * self.cfg.experts + expert) as usize];
                    *c = c.saturating_add(count);
                }
            }
        }
        self.usage = usage;
        self.repin();
        Ok(())
    }

    fn check_key(&self, layer: u32, expert: u32) -> Result<()> {
        if layer >= self.cfg.layers || expert >= self.cfg.experts {
            return Err(ExpertError::UnknownExpert {
                layer,
                expert,
                layers: self.cfg.layers,
                experts: self.cfg.experts,
            });
        }
        Ok(())
    }
}

/// One leased expert: its slot at the generation it was loaded at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseEntry {
    /// Expert id.
    pub expert: u32,
    /// Slot and generation; views through it fail once the slot is reused.
    pub handle: SlotHandle,
    /// True when it was resident before the acquire.
    pub hit: bool,
}

/// Slots held for one layer's experts until [`Lease::release_fenced`].
/// Dropping a lease without releasing it fences and releases it too (or
/// quarantines its slots if the fence fails).
#[must_use = "a lease must be released after its computations are evaluated"]
pub struct Lease {
    id: u64,
    layer: u32,
    entries: Vec<LeaseEntry>,
    policy: Rc<RefCell<ResidencyPolicy>>,
    open: bool,
}

impl Lease {
    /// The layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Every leased expert (hits and loaded misses) in request order.
    pub fn entries(&self) -> &[LeaseEntry] {
        &self.entries
    }

    /// Waits for all MLX work to finish, then releases the slots. If the wait
    /// fails, the slots are quarantined and the error returned.
    pub fn release_fenced(mut self) -> Result<()> {
        self.open = false;
        fenced_release(&self.policy, self.id)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.open {
            if let Err(e) = fenced_release(&self.policy, self.id) {
                tracing::warn!("dropping lease {}: {e}", self.id);
            }
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("layer", &self.layer)
            .field("entries", &self.entries)
            .finish()
    }
}

fn with_policy<T>(
    policy: &Rc<RefCell<ResidencyPolicy>>,
    f: impl FnOnce(&mut ResidencyPolicy) -> Result<T>,
) -> Result<T> {
    let mut p = policy
        .try_borrow_mut()
        .map_err(|_| ExpertError::Config("residency policy re-entered".into()))?;
    f(&mut p)
}

fn fenced_release(policy: &Rc<RefCell<ResidencyPolicy>>, id: u64) -> Result<()> {
    match mlx::synchronize() {
        Ok(()) => with_policy(policy, |p| p.release(id)),
        Err(e) => {
            let q = with_policy(policy, |p| p.quarantine(id));
            Err(match q {
                Ok(()) => e.into(),
                Err(c) => ExpertError::Cleanup {
                    error: Box::new(e.into()),
                    cleanup: Box::new(c),
                },
            })
        }
    }
}

/// The slot pool, its policy and its loader, driven from the MLX thread.
pub struct ResidencyManager {
    // Declared first so it drops first: joining the I/O threads guarantees
    // no write into slot memory outlives the store below.
    io: IoPool,
    store: SlabStore,
    policy: Rc<RefCell<ResidencyPolicy>>,
}

impl ResidencyManager {
    /// A pool of `slab.slots` slots loading from `source` through `upload`
    /// on `io_threads` threads. `policy.slots` is taken from `slab`.
    pub fn new(
        slab: &SlabConfig,
        mut policy: PolicyConfig,
        source: Arc<dyn ExpertSource>,
        upload: Arc<dyn SlotUpload>,
        io_threads: usize,
    ) -> Result<Self> {
        policy.slots = slab.slots;
        let policy = ResidencyPolicy::new(policy)?;
        let store = SlabStore::new(slab)?;
        let io = IoPool::new(io_threads, source, upload)?;
        Ok(Self {
            io,
            store,
            policy: Rc::new(RefCell::new(policy)),
        })
    }

    /// The slot memory (for views of leased slots).
    pub fn store(&self) -> &SlabStore {
        &self.store
    }

    /// Leases `experts` of `layer`. `on_resident` gets the store and first
    /// all hits (exactly once, possibly empty), then each batch of misses as
    /// their loads complete. On any failure (a load, or `on_resident`) the
    /// remaining loads are awaited, MLX is synchronized, the lease released
    /// (failed slots emptied, generations bumped) and the error returned.
    pub fn acquire<F>(&mut self, layer: u32, experts: &[u32], mut on_resident: F) -> Result<Lease>
    where
        F: FnMut(&SlabStore, &[LeaseEntry]) -> Result<(), MlxError>,
    {
        let pl = with_policy(&self.policy, |p| p.acquire(layer, experts))?;
        let (tx, rx) = std::sync::mpsc::channel::<LoadDone>();
        let mut entries: Vec<LeaseEntry> = Vec::with_capacity(experts.len());
        let mut hits = Vec::new();
        let mut pending = 0usize;
        let mut first_error: Option<ExpertError> = None;
        for e in &pl.entries {
            if e.hit {
                let entry = LeaseEntry {
                    expert: e.expert,
                    handle: self.store.current(e.slot)?,
                    hit: true,
                };
                hits.push(entry);
                continue;
            }
            let submitted = self
                .store
                .reassign(e.slot)
                .and_then(|h| self.store.raw_target(h).map(|t| (h, t)))
                .and_then(|(h, t)| {
                    // SAFETY: the slot was just reassigned to this load by the
                    // policy (no lease held it; its earlier readers were fenced
                    // before release), and `acquire` waits for the reply
                    // before returning, so the I/O thread writes it alone.
                    let raw = unsafe { RawSlot::new(t.0, t.1, h) };
                    self.io.submit(raw, layer, e.expert, tx.clone())
                });
            match submitted {
                Ok(()) => pending += 1,
                Err(err) => {
                    let _ = with_policy(&self.policy, |p| p.complete(pl.id, e.slot, false));
                    first_error.get_or_insert(err);
                }
            }
        }
        drop(tx);
        entries.extend_from_slice(&hits);
        if first_error.is_none() {
            if let Err(e) = on_resident(&self.store, &hits) {
                first_error = Some(e.into());
            }
        }
        while pending > 0 {
            let mut batch = Vec::new();
            let Ok(done) = rx.recv() else { break };
            let mut next = Some(done);
            while let Some(done) = next.take() {
                pending -= 1;
                let ok = done.result.is_ok();
                let slot = done.handle.slot;
                let recorded = with_policy(&self.policy, |p| {
                    let t = p.telemetry_mut();
                    t.record_latency(done.elapsed);
                    if let Ok(b) = &done.result {
                        t.bytes_read += b;
                    }
                    p.complete(pl.id, slot, ok)
                });
                match (done.result, recorded) {
                    (Ok(_), Ok(())) => batch.push(LeaseEntry {
                        expert: done.expert,
                        handle: done.handle,
                        hit: false,
                    }),
                    (Err(e), _) | (Ok(_), Err(e)) => {
                        first_error.get_or_insert(e);
                    }
                }
                if pending > 0 {
                    next = rx.try_recv().ok();
                }
            }
            entries.extend_from_slice(&batch);
            if first_error.is_none() && !batch.is_empty() {
                if let Err(e) = on_resident(&self.store, &batch) {
                    first_error = Some(e.into());
                }
            }
        }
        let lease = Lease {
            id: pl.id,
            layer,
            entries,
            policy: Rc::clone(&self.policy),
            open: true,
        };
        match first_error {
            None => Ok(lease),
            Some(error) => match lease.release_fenced() {
                Ok(()) => Err(error),
                Err(cleanup) => Err(ExpertError::Cleanup {
                    error: Box::new(error),
                    cleanup: Box::new(cleanup),
                }),
            },
        }
    }

    /// Counts one batch's routes of `layer` into the history.
    pub fn record_routes(&self, layer: u32, experts: &[u32]) -> Result<()> {
        with_policy(&self.policy, |p| p.record_routes(layer, experts))
    }

    /// Limits the pool to `bytes` of slot memory (at least one slot) at run time.
    pub fn set_budget_bytes(&self, bytes: usize) -> Result<()> {
        let slots = bytes / self.store.stride();
        with_policy(&self.policy, |p| {
            p.set_budget(slots);
            Ok(())
        })
    }

    /// A snapshot of the counters.
    pub fn telemetry(&self) -> Result<Telemetry> {
        with_policy(&self.policy, |p| Ok(p.telemetry().clone()))
    }

    /// Runs `f` on the policy (read-only inspection, usage files).
    pub fn with_policy<T>(&self, f: impl FnOnce(&mut ResidencyPolicy) -> Result<T>) -> Result<T> {
        with_policy(&self.policy, f)
    }
}

impl std::fmt::Debug for ResidencyManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidencyManager")
            .field("store", &self.store)
            .finish()
    }
}
