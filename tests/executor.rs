//! The streamed executor against an independent all-resident reference.
//!
//! The reference dequantizes every expert with `ColibriContainer::dequantize`
//! (the container's own f32 decoder, no MLX) and computes
//! `Σ_k w_k · down(silu(gate x) ⊙ up x) + shared` on the host in f64.
//!
//! Tolerance: the executor works in f32. Each output element is a chain of
//! three dot products (widths ≤ 128) and a sum over ≤ top-k + 1 terms; the
//! f32 rounding of a length-n dot is at most γ_n = n·2⁻²⁴/(1−n·2⁻²⁴) times the
//! sum of the absolute terms, and MLX's affine dequantization `s·q + (−8s)`
//! differs from the decoder's `(q−8)·s` by at most an ulp of the row's largest
//! weight. The test computes, alongside the reference, a magnitude `mag` per
//! element: the first-order coefficient of all those roundings — each dot's
//! sum of absolute terms (plus 1/64 of row-max·‖x‖₁ for the dequantization
//! ulp), propagated through `silu(g) ⊙ u` (|silu′| ≤ 1.1) and the down
//! projection, times |w_k|, plus |shared|. It requires
//! `|streamed − reference| ≤ 4·10⁻⁵ · mag` (≈ 3·γ₁₂₈: one γ per stage); it
//! also reports the largest observed `error / mag`, which is far below it.

use glm_stream::container::ColibriContainer;
use glm_stream::convert::{Bits, ConvertOptions, convert_checkpoint};
use glm_stream::executor::{
    ExecutorError, ExecutorOptions, ProjectionKernel, StreamedExecutor, layouts_from_source,
};
use glm_stream::experts::{
    DirectUpload, ExpertError, ExpertSource, FileExpertSource, PolicyConfig, ResidencyManager,
    SlabConfig,
};
use glm_stream::kernels::{Environment, FusedGeometry, KernelError, KernelFamily, Path, select};
use glm_stream::mlx::{self, Array, Device};
use glm_stream::moe::{BatchPlan, Routes};
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const HIDDEN: usize = 128;
const INTER: usize = 64;
const EXPERTS: u32 = 16;
const TOP_K: usize = 4;
const MOE_LAYER: u32 = 1;
/// The MTP layer follows the `num_hidden_layers` main layers.
const MTP_LAYER: u32 = 2;
const TOLERANCE: f64 = 4e-5;

struct Model {
    _dir: tempfile::TempDir,
    c: ColibriContainer,
}

fn model(group_size: usize) -> Model {
    let spec = TinyModelSpec {
        hidden_size: HIDDEN,
        num_hidden_layers: 2,
        first_k_dense_replace: 1,
        n_routed_experts: EXPERTS as usize,
        num_experts_per_tok: TOP_K,
        moe_intermediate_size: INTER,
        ..TinyModelSpec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("hf"), dir.path().join("coli"));
    generate_hf_checkpoint(&src, &spec, 11, SourceDtype::F32).unwrap();
    let opts = ConvertOptions {
        group_size,
        ebits: Bits::Four,
        mtp_bits: Bits::Eight,
        progress: false,
        ..ConvertOptions::default()
    };
    convert_checkpoint(&src, &out, &opts).unwrap();
    let c = ColibriContainer::open(&out).unwrap();
    Model { _dir: dir, c }
}

/// Fails the reads of one expert while `fail` names it.
struct Flaky {
    inner: FileExpertSource,
    fail: Mutex<Option<(u32, u32)>>,
}

impl ExpertSource for Flaky {
    fn read_expert(&self, layer: u32, expert: u32, dst: &mut [u8]) -> Result<u64, ExpertError> {
        if *self.fail.lock().unwrap() == Some((layer, expert)) {
            dst[..64].fill(0xEE); // a partial write before failing
            return Err(ExpertError::ShortRead {
                layer,
                expert,
                path: "flaky".into(),
                offset: 0,
                end: 100,
                got_end: 50,
            });
        }
        self.inner.read_expert(layer, expert, dst)
    }
}

fn executor(m: &Model, slots: usize) -> (StreamedExecutor, Arc<Flaky>) {
    executor_with(m, slots, ExecutorOptions::default()).unwrap()
}

fn executor_with(
    m: &Model,
    slots: usize,
    options: ExecutorOptions,
) -> Result<(StreamedExecutor, Arc<Flaky>), ExecutorError> {
    let layers = [MOE_LAYER, MTP_LAYER];
    let source = FileExpertSource::from_container(&m.c, &layers, true).unwrap();
    let layouts = layouts_from_source(&source, &layers, EXPERTS).unwrap();
    let mut slab = SlabConfig::new(source.max_slot_bytes(), slots);
    slab.alignment = 4096;
    let flaky = Arc::new(Flaky {
        inner: source,
        fail: Mutex::new(None),
    });
    let manager = ResidencyManager::new(
        &slab,
        PolicyConfig::new(MTP_LAYER + 1, EXPERTS, slots),
        flaky.clone(),
        Arc::new(DirectUpload),
        2,
    )
    .unwrap();
    Ok((
        StreamedExecutor::with_options(manager, HIDDEN, layouts, options)?,
        flaky,
    ))
}

fn random_batch(rows: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Routes) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let shared: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.random_range(-0.05..0.05))
        .collect();
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    for _ in 0..rows {
        ids.extend(
            sample(&mut rng, EXPERTS as usize, TOP_K)
                .into_iter()
                .map(|e| e as u32),
        );
        weights.extend((0..TOP_K).map(|_| rng.random_range(0.1f32..1.5)));
    }
    (
        x,
        shared,
        Routes::new(TOP_K, EXPERTS, ids, weights).unwrap(),
    )
}

struct DenseExpert {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

fn dense_expert(c: &ColibriContainer, layer: u32, expert: u32) -> DenseExpert {
    let infos = c.expert(layer as usize, expert as usize).unwrap();
    let [gate, up, down] = infos.map(|i| c.dequantize(&i.name).unwrap());
    assert_eq!(gate.1, [INTER, HIDDEN]);
    assert_eq!(down.1, [HIDDEN, INTER]);
    DenseExpert {
        gate: gate.0,
        up: up.0,
        down: down.0,
    }
}

fn row_max(w: &[f32]) -> f64 {
    w.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())))
}

/// `(reference, mag)` per element, both `[rows, HIDDEN]`, in f64.
fn reference(
    c: &ColibriContainer,
    layer: u32,
    x: &[f32],
    shared: &[f32],
    routes: &Routes,
) -> (Vec<f64>, Vec<f64>) {
    let mut cache: HashMap<u32, DenseExpert> = HashMap::new();
    let rows = routes.rows();
    let mut out = vec![0f64; rows * HIDDEN];
    let mut mag = vec![0f64; rows * HIDDEN];
    for r in 0..rows {
        let xr = &x[r * HIDDEN..(r + 1) * HIDDEN];
        let x1: f64 = xr.iter().map(|v| f64::from(v.abs())).sum();
        for o in 0..HIDDEN {
            out[r * HIDDEN + o] = f64::from(shared[r * HIDDEN + o]);
            mag[r * HIDDEN + o] = f64::from(shared[r * HIDDEN + o].abs());
        }
        for (&e, &w) in routes.ids(r).iter().zip(routes.weights(r)) {
            let d = cache.entry(e).or_insert_with(|| dense_expert(c, layer, e));
            let mut h = vec![0f64; INTER];
            let mut hm = vec![0f64; INTER];
            for i in 0..INTER {
                let gw = &d.gate[i * HIDDEN..(i + 1) * HIDDEN];
                let uw = &d.up[i * HIDDEN..(i + 1) * HIDDEN];
                let dot = |w: &[f32]| -> f64 {
                    w.iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum()
                };
                let abs_dot = |w: &[f32]| -> f64 {
                    let terms: f64 = w
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from(a.abs()) * f64::from(b.abs()))
                        .sum();
                    terms + row_max(w) * x1 / 64.0
                };
                let (g, u) = (dot(gw), dot(uw));
                h[i] = g / (1.0 + (-g).exp()) * u;
                let silu = g / (1.0 + (-g).exp());
                // |h| (rounding of the down dot) plus the first-order effect of
                // the gate/up dots' rounding (|silu'| ≤ 1.1).
                hm[i] = h[i].abs() + 1.1 * abs_dot(gw) * u.abs() + silu.abs() * abs_dot(uw);
            }
            for o in 0..HIDDEN {
                let dw = &d.down[o * INTER..(o + 1) * INTER];
                let y: f64 = dw.iter().zip(&h).map(|(a, b)| f64::from(*a) * b).sum();
                out[r * HIDDEN + o] += f64::from(w) * y;
                let terms: f64 = dw
                    .iter()
                    .zip(&hm)
                    .map(|(a, b)| f64::from(a.abs()) * b)
                    .sum();
                mag[r * HIDDEN + o] +=
                    f64::from(w.abs()) * (terms + row_max(dw) * hm.iter().sum::<f64>() / 64.0);
            }
        }
    }
    (out, mag)
}

/// Runs one batch through `ex` and checks it against the reference; returns
/// the largest `error / mag`.
fn check_batch(m: &Model, ex: &mut StreamedExecutor, layer: u32, rows: usize, seed: u64) -> f64 {
    check_batch_output(m, ex, layer, rows, seed).0
}

/// [`check_batch`], also returning the streamed output and the magnitudes.
fn check_batch_output(
    m: &Model,
    ex: &mut StreamedExecutor,
    layer: u32,
    rows: usize,
    seed: u64,
) -> (f64, Vec<f32>, Vec<f64>) {
    let (x, shared, routes) = random_batch(rows, seed);
    let (want, mag) = reference(&m.c, layer, &x, &shared, &routes);
    let xa = Array::from_slice(&x, &[rows as i32, HIDDEN as i32]).unwrap();
    let sa = Array::from_slice(&shared, &[rows as i32, HIDDEN as i32]).unwrap();
    let got = ex
        .forward_routes(layer, &xa, routes, EXPERTS, Some(&sa))
        .unwrap();
    assert_eq!(got.shape(), vec![rows as i32, HIDDEN as i32]);
    let got = got.to_vec::<f32>().unwrap();
    let mut worst = 0f64;
    for (i, ((&g, &w), &mg)) in got.iter().zip(&want).zip(&mag).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= TOLERANCE * mg,
            "layer {layer} rows {rows}: element {i}: streamed {g}, reference {w}, error {err:e} > {TOLERANCE:e} · {mg:e}"
        );
        worst = worst.max(err / mg);
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let mag_max = mag.iter().fold(0f64, |m, v| m.max(*v));
    let err_max = got
        .iter()
        .zip(&want)
        .fold(0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()));
    eprintln!(
        "layer {layer} rows {rows}: max|ref| {scale:e}, max mag {mag_max:e}, max error {err_max:e}"
    );
    (worst, got, mag)
}

fn open_leases(ex: &StreamedExecutor) -> usize {
    ex.manager().with_policy(|p| Ok(p.open_leases())).unwrap()
}

fn run_model(group_size: usize, expect_gate: ProjectionKernel) {
    let m = model(group_size);
    // 3 slots < top-4: even a single row needs two waves; 5 rows need ≥ 4.
    let (mut ex, _) = executor(&m, 3);
    assert_eq!(ex.kernels(MOE_LAYER, 0).unwrap()[0], expect_gate);
    let mut worst = 0f64;
    for (rows, seed) in [(1, 1), (1, 1), (5, 2), (1, 3)] {
        let before = ex.telemetry().clone();
        worst = worst.max(check_batch(&m, &mut ex, MOE_LAYER, rows, seed));
        let t = ex.telemetry();
        assert!(
            t.waves - before.waves >= 2,
            "rows {rows}: several waves ran"
        );
        assert_eq!(open_leases(&ex), 0);
    }
    // The int8 MTP layer's experts through the 8-bit path.
    assert!(matches!(
        ex.kernels(MTP_LAYER, 0).unwrap()[0],
        ProjectionKernel::Affine { bits: 8, .. }
    ));
    worst = worst.max(check_batch(&m, &mut ex, MTP_LAYER, 5, 4));
    let t = ex.telemetry();
    assert_eq!(t.calls, 5);
    assert!(t.hits > 0 && t.misses > 0 && t.bytes_read > 0);
    assert_eq!(t.hits + t.misses, t.experts_computed);
    eprintln!("group size {group_size}: worst error/mag {worst:e}, telemetry {t:?}");
}

#[test]
fn int4_g64_and_int8_mtp_match_reference() {
    run_model(
        64,
        ProjectionKernel::Affine {
            bits: 4,
            group_size: 64,
            repeat: 1,
        },
    );
}

#[test]
fn int4_per_row_matches_reference() {
    run_model(
        0,
        ProjectionKernel::Affine {
            bits: 4,
            group_size: 64,
            repeat: 2,
        },
    );
}

#[test]
fn int4_g48_dense_fallback_matches_reference() {
    // 128 columns in groups of 48: a partial last group, so no MLX group size fits.
    run_model(48, ProjectionKernel::Dense);
}

#[test]
fn failed_load_mid_wave_leaves_pool_intact() {
    let m = model(64);
    let (mut ex, flaky) = executor(&m, 3);
    let (x, shared, routes) = random_batch(5, 9);
    let plan = BatchPlan::new(routes.clone(), EXPERTS, 3).unwrap();
    assert!(plan.wave_count() >= 3);
    // Fail the second expert of the second wave: the first wave completes,
    // the second has already leased (and maybe computed) its other experts.
    let victim = plan.waves().nth(1).unwrap()[1].expert;
    *flaky.fail.lock().unwrap() = Some((MOE_LAYER, victim));
    let xa = Array::from_slice(&x, &[5, HIDDEN as i32]).unwrap();
    let sa = Array::from_slice(&shared, &[5, HIDDEN as i32]).unwrap();
    let err = ex.forward(MOE_LAYER, &xa, &plan, Some(&sa)).unwrap_err();
    assert!(
        matches!(
            &err,
            ExecutorError::Residency {
                layer: MOE_LAYER,
                source: ExpertError::ShortRead { expert, .. }
            } if *expert == victim
        ),
        "{err}"
    );
    assert_eq!(open_leases(&ex), 0, "no lease left open");
    ex.manager()
        .with_policy(|p| {
            assert!(!p.is_resident(MOE_LAYER, victim));
            for s in 0..3 {
                assert_eq!(p.lease_count(s), 0);
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(ex.telemetry().calls, 0);
    // The fault clears: the same batch now succeeds and is correct.
    *flaky.fail.lock().unwrap() = None;
    check_batch(&m, &mut ex, MOE_LAYER, 5, 9);
    assert_eq!(open_leases(&ex), 0);
}

#[test]
fn bad_inputs_are_refused_before_any_lease() {
    let m = model(64);
    let (mut ex, _) = executor(&m, 3);
    let (x, _, routes) = random_batch(2, 5);
    let plan = BatchPlan::new(routes, EXPERTS, 3).unwrap();
    let wide = Array::from_slice(&x, &[1, 2 * HIDDEN as i32]).unwrap();
    assert!(matches!(
        ex.forward(MOE_LAYER, &wide, &plan, None),
        Err(ExecutorError::Input {
            layer: MOE_LAYER,
            ..
        })
    ));
    let one_row = Array::from_slice(&x[..HIDDEN], &[1, HIDDEN as i32]).unwrap();
    assert!(matches!(
        ex.forward(MOE_LAYER, &one_row, &plan, None),
        Err(ExecutorError::Input { .. })
    ));
    let xa = Array::from_slice(&x, &[2, HIDDEN as i32]).unwrap();
    let bad_shared = Array::from_slice(&x[..HIDDEN], &[1, HIDDEN as i32]).unwrap();
    assert!(matches!(
        ex.forward(MOE_LAYER, &xa, &plan, Some(&bad_shared)),
        Err(ExecutorError::Input { .. })
    ));
    // Layer 0 is dense: no expert layouts.
    assert!(matches!(
        ex.forward(0, &xa, &plan, None),
        Err(ExecutorError::MissingLayout { layer: 0, .. })
    ));
    assert_eq!(open_leases(&ex), 0);
    assert_eq!(ex.manager().telemetry().unwrap().misses, 0);
    // Without a shared output the result is the routed sum alone.
    let out = ex.forward(MOE_LAYER, &xa, &plan, None).unwrap();
    assert_eq!(out.shape(), vec![2, HIDDEN as i32]);
}

fn gpu_fused_available() -> bool {
    let e = Environment::current();
    e.fused_backend.is_some() && e.gpu_default
}

#[test]
fn tiny_model_layouts_fit_the_fused_kernels() {
    // The GPU test below needs the converted tiny model's slots to meet the
    // fused kernels' requirements (alignment, widths, group sizes); checked
    // here on the CPU with the pure planner.
    for group_size in [64, 0] {
        let m = model(group_size);
        let layers = [MOE_LAYER, MTP_LAYER];
        let source = FileExpertSource::from_container(&m.c, &layers, true).unwrap();
        for layer in layers {
            let layouts: Vec<_> = layouts_from_source(&source, &[layer], EXPERTS)
                .unwrap()
                .into_iter()
                .map(|(_, l)| l.projections)
                .collect();
            let plan = FusedGeometry::plan(&layouts, select::CUDA_SHARED_BYTES);
            assert!(plan.is_ok(), "group {group_size} layer {layer}: {plan:?}");
        }
    }
    // g48 (a partial last group) is not for the fused kernels.
    let m = model(48);
    let source = FileExpertSource::from_container(&m.c, &[MOE_LAYER], true).unwrap();
    let layouts: Vec<_> = layouts_from_source(&source, &[MOE_LAYER], EXPERTS)
        .unwrap()
        .into_iter()
        .map(|(_, l)| l.projections)
        .collect();
    assert!(FusedGeometry::plan(&layouts, select::CUDA_SHARED_BYTES).is_err());
}

#[test]
fn fused_family_is_checked_and_auto_picks_stock_off_the_gpu() {
    let m = model(64);
    let fused = ExecutorOptions {
        kernel_family: KernelFamily::Fused,
        ..ExecutorOptions::default()
    };
    if gpu_fused_available() {
        // On the GPU `Fused` builds, and refuses a format it cannot run.
        assert!(executor_with(&m, 3, fused).is_ok());
        let g48 = model(48);
        let err = executor_with(&g48, 3, fused).err().expect("g48 refused");
        assert!(
            matches!(
                &err,
                ExecutorError::KernelSetup {
                    family: KernelFamily::Fused,
                    source: KernelError::Unsupported { .. },
                    ..
                }
            ),
            "{err}"
        );
    } else {
        // Off the GPU, pinning `Fused` is a clear error at construction...
        let err = executor_with(&m, 3, fused).err().expect("Fused refused");
        assert!(
            matches!(
                &err,
                ExecutorError::KernelSetup {
                    family: KernelFamily::Fused,
                    source: KernelError::FusedUnavailable { .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("fused expert kernels unavailable"),
            "{err}"
        );
        // ...and so is switching an existing executor to it (nothing changes).
        let (mut ex, _) = executor(&m, 3);
        assert!(ex.set_options(fused).is_err());
        assert_eq!(ex.options(), ExecutorOptions::default());
    }
    // `Auto` (the default) and `Stock`: decode-sized calls take the stock
    // path off the GPU (and the fused one on it), larger ones always stock.
    for family in [KernelFamily::Auto, KernelFamily::Stock] {
        let options = ExecutorOptions {
            kernel_family: family,
            ..ExecutorOptions::default()
        };
        let (mut ex, _) = executor_with(&m, 3, options).unwrap();
        let fused_expected = family == KernelFamily::Auto && gpu_fused_available();
        let decode = ex.wave_path(MOE_LAYER, &[0, 1, 2], 1).unwrap();
        assert_eq!(
            matches!(decode, Path::Fused(_)),
            fused_expected,
            "{family:?}"
        );
        let big = options.fused_max_rows + 1;
        assert_eq!(ex.wave_path(MOE_LAYER, &[0, 1], big).unwrap(), Path::Stock);
        check_batch(&m, &mut ex, MOE_LAYER, 1, 21);
        let t = ex.telemetry();
        assert!(t.waves >= 2);
        if fused_expected {
            assert_eq!(t.fused_waves, t.waves);
        } else {
            assert_eq!(t.fused_waves, 0, "{family:?} ran fused off the GPU");
        }
        assert_eq!(open_leases(&ex), 0);
    }
}

/// The executor on the fused path against the same reference and against
/// the stock path (run on the CPU device, where MLX has every small-shape
/// kernel): int4 g64 and per-row, the int8 MTP layer, 1–5 rows, several
/// waves per call (3 slots < top-4), hits and misses. Same tolerance as the
/// stock tests: `|fused − reference| ≤ 4·10⁻⁵ · mag`, hence
/// `|fused − stock| ≤ 8·10⁻⁵ · mag`. Skipped without a fused backend on a
/// GPU default device.
#[test]
fn fused_executor_matches_stock_and_reference_on_the_gpu() {
    if !gpu_fused_available() {
        eprintln!("no fused backend on a GPU default device: executor GPU test skipped");
        return;
    }
    let fused = ExecutorOptions {
        kernel_family: KernelFamily::Fused,
        fused_max_rows: 8,
    };
    let stock = ExecutorOptions {
        kernel_family: KernelFamily::Stock,
        ..ExecutorOptions::default()
    };
    for group_size in [64, 0] {
        let m = model(group_size);
        let (mut ef, _) = executor_with(&m, 3, fused).unwrap();
        let mut worst = (0f64, 0f64);
        for (layer, rows, seed) in [
            (MOE_LAYER, 1, 31),
            (MOE_LAYER, 1, 31),
            (MOE_LAYER, 3, 32),
            (MOE_LAYER, 5, 33),
            (MTP_LAYER, 1, 34),
            (MTP_LAYER, 4, 35),
        ] {
            let before = ef.telemetry().clone();
            let (wf, yf, mag) = check_batch_output(&m, &mut ef, layer, rows, seed);
            let t = ef.telemetry();
            assert!(t.waves - before.waves >= 2);
            assert_eq!(t.fused_waves - before.fused_waves, t.waves - before.waves);
            assert_eq!(open_leases(&ef), 0);
            // The stock executor on the CPU device, same batch.
            mlx::set_default_device(Device::Cpu).unwrap();
            let ys = {
                let (mut es, _) = executor_with(&m, 3, stock).unwrap();
                check_batch_output(&m, &mut es, layer, rows, seed).1
            };
            mlx::set_default_device(Device::Gpu).unwrap();
            let mut diff = 0f64;
            for (i, ((&f, &s), &mg)) in yf.iter().zip(&ys).zip(&mag).enumerate() {
                let d = (f64::from(f) - f64::from(s)).abs();
                assert!(
                    d <= 2.0 * TOLERANCE * mg,
                    "group {group_size} layer {layer} rows {rows} element {i}: fused {f}, stock {s}"
                );
                diff = diff.max(d / mg);
            }
            worst = (worst.0.max(wf), worst.1.max(diff));
        }
        eprintln!(
            "group size {group_size}: fused executor worst error/mag vs reference {:e}, vs stock {:e}; telemetry {:?}",
            worst.0,
            worst.1,
            ef.telemetry()
        );
    }
}
