//! Decode on a GLM-5.2-shaped slice of the model with routed experts streamed
//! from disk, beside the per-token floor `missed bytes / read bandwidth`, and
//! the recorded routing replayed through the residency policy, LRU and
//! Belady's optimum.
//!
//! The container is written directly with the container writer
//! (`convert::writer`): GLM-5.2's real dimensions (hidden 6144; MLA with
//! q_lora 2048, kv_lora 512, 64 heads, qk 192 + 64, v 256; DSA indexer with
//! 32 heads × 128 and index_topk 2048; dense MLP 12288; 256 routed experts of
//! moe_intermediate 2048, top-8, one shared expert) but 3 layers (layer 0
//! dense, layers 1 and 2 MoE, all with their own indexer) and a 4096-token
//! vocabulary. Storage as the colibri converter lays it out: routed experts,
//! shared experts, attention and the dense MLP int4 g64; the indexer, the
//! embedding and `lm_head` int8 per row; norms, router weights and router
//! bias F32. Values are random: quantized codes uniform and zero-mean, scales chosen so a
//! weight has standard deviation about `1/sqrt(fan_in)` (embedding rows: 1,
//! so the fed token steers the residual stream), norms 1, router
//! weights uniform with that deviation. Two shards: `out-00000.safetensors`
//! (resident weights, 0.54 GB) and `out-00001.safetensors` (the routed
//! experts, 512 × 21,233,664 B = 10.87 GB). No tokenizer: the bench drives
//! [`Glm52Model::forward`] with ids directly.
//!
//! The directory is `GLM_BENCH_DIR` (default `/tmp/glm-stream-decode-slice`);
//! a container with the expected config, shard headers and sizes is reused
//! (contents are not checked: delete the directory after changing the
//! generator); nothing is deleted.
//!
//! `GLM_BENCH_KERNELS` pins the expert kernels (`auto`, `stock`, `fused`,
//! `fused-simt`; default `auto`).
//!
//! Run: a `GLM_BENCH_PROMPT`-token prompt (default 4) is prefilled, then
//! `GLM_BENCH_TOKENS` tokens (default 16) are decoded, one `forward` each.
//! The token fed at each step is drawn at random (seeded) rather than taken
//! from the logits: on random weights greedy decoding falls into repeating
//! one token, and every step then routes identically (a 94 % hit rate that
//! says nothing); `GLM_BENCH_GREEDY=1` feeds the argmax instead. The logits
//! of every step are checked finite either way. The pool is limited with the routed-expert pool limited to
//! `GLM_BENCH_BUDGET_GB` GB (default 1.5, a seventh of the expert bytes),
//! `GLM_BENCH_IO_THREADS` I/O threads (default 4), O_DIRECT reads. The
//! routing of the whole run is recorded ([`Glm52Model::set_routing_trace`]).
//! Printed: per-token time, hits, misses and bytes; decode tok/s, hit rate,
//! missed bytes per token; the read bandwidth of a plain sequential
//! O_DIRECT read of the experts shard (one thread, expert-sized requests,
//! `GLM_BENCH_SEQ_MB` MB, default 2048) measured before and after the decode;
//! the floor = missed bytes / bandwidth and time / floor. Then the recorded
//! trace is replayed through the policy, LRU and Belady at several
//! capacities; the rates are over the decode steps (the prefill's records
//! warm the pool but are not counted). The replay of the policy at the run's
//! own slot count must reproduce the run's counts (checked and printed).
//!
//! Routing comes from random router weights, so it is close to uniform:
//! real GLM routing has far more locality, and the hit rates here are a
//! lower bound on what the policies achieve on a real trace.
//!
//! **MTP** (`GLM_BENCH_MTP=1`): the container gets an MTP layer (index 3,
//! `num_nextn_predict_layers` 1) in a third shard, `out-mtp-00000.safetensors`
//! (9.97 GB: attention, indexer, shared expert, `eh_proj` [6144, 12288] and
//! 256 routed experts of 37,789,696 B, all int8 per row as Colibri stores
//! its MTP pass; norms 1). The plain shards are unchanged (a plain run on the
//! same directory renames the MTP shard to `*.parked` and an MTP run takes it
//! back). Instead of the decode above, four modes run through a `Session`,
//! each on a freshly opened model (cold pool, same budget): plain; MTP k = 1
//! with the adaptive draft policy; MTP k = 1 fixed; a set-rate drafter
//! (p = 0.8, k = 3) proposing the plain run's own tokens. The model's own
//! tokens are fed: greedy (every mode must reproduce plain's tokens;
//! random weights repeat some tokens under greedy), or seeded sampling at
//! `GLM_BENCH_TEMP` with one seed for all modes (outputs then differ but are
//! identically distributed). Per mode: pool slots (the MTP modes' slots hold
//! the larger int8 experts, so the same budget gives fewer slots), tokens
//! per forward, drafted, acceptance, decode tok/s, expert hit rate (whole
//! run, prefill included), expert bytes read per decoded token, the floor
//! = bytes per token / O_DIRECT bandwidth (same run) and time/floor.
//!
//! `cargo bench --bench decode_slice` (or the built binary with `--bench`).

mod common;

use common::{BoxResult, EXPERT_BYTES, env_or, sequential_bandwidth};
use glm_stream::convert::writer::{ShardLayout, ShardWriter, TensorSpec};
use glm_stream::experts::replay::{belady, lru, replay_policy};
use glm_stream::experts::{PolicyConfig, RoutingTrace};
use glm_stream::generate::{
    DraftPolicyConfig, GenerateOptions, SamplingParams, Session, SetRateDrafter,
};
use glm_stream::kernels::KernelFamily;
use glm_stream::mlx;
use glm_stream::model::mtp::MtpDrafter;
use glm_stream::model::{Glm52Model, ModelOptions};
use glm_stream::quant::encode::QuantScheme;
use glm_stream::tiny::{SourceDtype, TinyModelSpec};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

const HIDDEN: usize = 6144;
const LAYERS: usize = 3;
const FIRST_DENSE: usize = 1;
const DENSE_INTER: usize = 12288;
const MOE_INTER: usize = 2048;
const EXPERTS: usize = 256;
const TOP_K: usize = 8;
const HEADS: usize = 64;
const Q_LORA: usize = 2048;
const KV_LORA: usize = 512;
const NOPE: usize = 192;
const ROPE: usize = 64;
const V_DIM: usize = 256;
const IDX_HEADS: usize = 32;
const IDX_DIM: usize = 128;
const IDX_TOPK: usize = 2048;
const VOCAB: usize = 4096;
const GROUP: usize = 64;
const EMBED: &str = "model.embed_tokens.weight";
const RESIDENT_SHARD: &str = "out-00000.safetensors";
const EXPERT_SHARD: &str = "out-00001.safetensors";
/// The MTP layer (resident weights and its int8 routed experts), written
/// only with `GLM_BENCH_MTP=1`.
const MTP_SHARD: &str = "out-mtp-00000.safetensors";
/// One MTP routed expert: three int8 per-row projections of 2048 × 6144 and
/// their F32 row scales.
const MTP_EXPERT_BYTES: u64 = 37_789_696;

/// How one tensor's values are generated.
#[derive(Debug, Clone, Copy)]
enum Gen {
    /// A quantized `[rows, cols]` weight.
    Quant {
        scheme: QuantScheme,
        rows: usize,
        cols: usize,
    },
    /// F32, all ones (norm weights).
    Ones,
    /// F32, uniform with standard deviation `std`.
    Uniform { std: f32 },
}

struct Tensor {
    name: String,
    /// Stored shape: `[bytes]` for a quantized weight, else the logical shape.
    shape: Vec<usize>,
    fill: Gen,
}

fn spec(mtp: bool) -> TinyModelSpec {
    TinyModelSpec {
        hidden_size: HIDDEN,
        num_hidden_layers: LAYERS,
        first_k_dense_replace: FIRST_DENSE,
        n_routed_experts: EXPERTS,
        num_experts_per_tok: TOP_K,
        n_shared_experts: 1,
        moe_intermediate_size: MOE_INTER,
        intermediate_size: DENSE_INTER,
        num_attention_heads: HEADS,
        q_lora_rank: Q_LORA,
        kv_lora_rank: KV_LORA,
        qk_nope_head_dim: NOPE,
        qk_rope_head_dim: ROPE,
        v_head_dim: V_DIM,
        index_n_heads: IDX_HEADS,
        index_head_dim: IDX_DIM,
        index_topk: IDX_TOPK,
        vocab_size: VOCAB,
        num_nextn_predict_layers: usize::from(mtp),
        max_position_embeddings: 4096,
        rope_theta: 8_000_000.0,
        ..TinyModelSpec::default()
    }
}

fn config_json(mtp: bool) -> BoxResult<String> {
    let mut c = spec(mtp).config_json(SourceDtype::Bf16);
    let obj = c.as_object_mut().ok_or("config is not an object")?;
    obj.insert(
        "indexer_types".into(),
        serde_json::json!(vec!["full"; LAYERS + usize::from(mtp)]),
    );
    Ok(serde_json::to_string_pretty(&c)?)
}

fn quant(out: &mut Vec<Tensor>, name: String, scheme: QuantScheme, rows: usize, cols: usize) {
    out.push(Tensor {
        shape: vec![scheme.weight_bytes(rows, cols)],
        name,
        fill: Gen::Quant { scheme, rows, cols },
    });
}

fn f32s(out: &mut Vec<Tensor>, name: String, shape: Vec<usize>, fill: Gen) {
    out.push(Tensor { name, shape, fill });
}

/// Every tensor of the slice: `(resident, routed experts, MTP layer)`. The
/// MTP layer (index `LAYERS`) is stored as Colibri stores its MTP pass:
/// every projection int8 per row (attention, indexer, shared expert, the
/// 256 routed experts and `eh_proj` `[6144, 12288]`), norms and the router
/// F32; its resident weights and routed experts share one shard.
fn tensors() -> (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>) {
    let int4 = QuantScheme::Int4Grouped { group_size: GROUP };
    let int8 = QuantScheme::Int8Row;
    let mut resident = Vec::new();
    let mut experts = Vec::new();
    quant(&mut resident, EMBED.into(), int8, VOCAB, HIDDEN);
    quant(&mut resident, "lm_head.weight".into(), int8, VOCAB, HIDDEN);
    f32s(
        &mut resident,
        "model.norm.weight".into(),
        vec![HIDDEN],
        Gen::Ones,
    );
    for l in 0..LAYERS {
        layer_tensors(l, int4, &mut resident, &mut experts);
    }
    let mut mtp_resident = Vec::new();
    let mut mtp_experts = Vec::new();
    layer_tensors(LAYERS, int8, &mut mtp_resident, &mut mtp_experts);
    let p = format!("model.layers.{LAYERS}.");
    for norm in ["enorm", "hnorm", "shared_head.norm"] {
        f32s(
            &mut mtp_resident,
            format!("{p}{norm}.weight"),
            vec![HIDDEN],
            Gen::Ones,
        );
    }
    quant(
        &mut mtp_resident,
        format!("{p}eh_proj.weight"),
        int8,
        HIDDEN,
        2 * HIDDEN,
    );
    mtp_resident.append(&mut mtp_experts);
    (resident, experts, mtp_resident)
}

/// Decoder layer `l`'s tensors: the indexer int8 per row, every other
/// projection `wq`; routed experts into `experts`, the rest into `r`.
fn layer_tensors(l: usize, wq: QuantScheme, r: &mut Vec<Tensor>, experts: &mut Vec<Tensor>) {
    let int8 = QuantScheme::Int8Row;
    let p = format!("model.layers.{l}.");
    f32s(
        r,
        format!("{p}input_layernorm.weight"),
        vec![HIDDEN],
        Gen::Ones,
    );
    f32s(
        r,
        format!("{p}post_attention_layernorm.weight"),
        vec![HIDDEN],
        Gen::Ones,
    );
    let a = format!("{p}self_attn.");
    quant(r, format!("{a}q_a_proj.weight"), wq, Q_LORA, HIDDEN);
    f32s(
        r,
        format!("{a}q_a_layernorm.weight"),
        vec![Q_LORA],
        Gen::Ones,
    );
    quant(
        r,
        format!("{a}q_b_proj.weight"),
        wq,
        HEADS * (NOPE + ROPE),
        Q_LORA,
    );
    quant(
        r,
        format!("{a}kv_a_proj_with_mqa.weight"),
        wq,
        KV_LORA + ROPE,
        HIDDEN,
    );
    f32s(
        r,
        format!("{a}kv_a_layernorm.weight"),
        vec![KV_LORA],
        Gen::Ones,
    );
    quant(
        r,
        format!("{a}kv_b_proj.weight"),
        wq,
        HEADS * (NOPE + V_DIM),
        KV_LORA,
    );
    quant(r, format!("{a}o_proj.weight"), wq, HIDDEN, HEADS * V_DIM);
    let i = format!("{a}indexer.");
    quant(
        r,
        format!("{i}wq_b.weight"),
        int8,
        IDX_HEADS * IDX_DIM,
        Q_LORA,
    );
    quant(r, format!("{i}wk.weight"), int8, IDX_DIM, HIDDEN);
    quant(
        r,
        format!("{i}weights_proj.weight"),
        int8,
        IDX_HEADS,
        HIDDEN,
    );
    f32s(r, format!("{i}k_norm.weight"), vec![IDX_DIM], Gen::Ones);
    f32s(
        r,
        format!("{i}k_norm.bias"),
        vec![IDX_DIM],
        Gen::Uniform { std: 0.02 },
    );
    let m = format!("{p}mlp.");
    if l < FIRST_DENSE {
        for proj in ["gate_proj", "up_proj"] {
            quant(r, format!("{m}{proj}.weight"), wq, DENSE_INTER, HIDDEN);
        }
        quant(r, format!("{m}down_proj.weight"), wq, HIDDEN, DENSE_INTER);
        return;
    }
    f32s(
        r,
        format!("{m}gate.weight"),
        vec![EXPERTS, HIDDEN],
        Gen::Uniform {
            std: 1.0 / (HIDDEN as f32).sqrt(),
        },
    );
    f32s(
        r,
        format!("{m}gate.e_score_correction_bias"),
        vec![EXPERTS],
        Gen::Uniform { std: 0.01 },
    );
    let s = format!("{m}shared_experts.");
    for proj in ["gate_proj", "up_proj"] {
        quant(r, format!("{s}{proj}.weight"), wq, MOE_INTER, HIDDEN);
    }
    quant(r, format!("{s}down_proj.weight"), wq, HIDDEN, MOE_INTER);
    for e in 0..EXPERTS {
        let x = format!("{m}experts.{e}.");
        for proj in ["gate_proj", "up_proj"] {
            quant(experts, format!("{x}{proj}.weight"), wq, MOE_INTER, HIDDEN);
        }
        quant(
            experts,
            format!("{x}down_proj.weight"),
            wq,
            HIDDEN,
            MOE_INTER,
        );
    }
}

/// The shard layout of `tensors` (quantized weights get their `.qs`) and
/// the generator of every stored tensor by name.
fn layout(tensors: &[Tensor]) -> BoxResult<(ShardLayout, HashMap<String, Gen>)> {
    let mut specs = Vec::new();
    let mut gens = HashMap::new();
    for t in tensors {
        match t.fill {
            Gen::Quant { scheme, rows, cols } => {
                specs.push(TensorSpec::new(t.name.clone(), Dtype::U8, t.shape.clone()));
                let qs = format!("{}.qs", t.name);
                specs.push(TensorSpec::new(
                    qs.clone(),
                    Dtype::F32,
                    vec![scheme.scale_count(rows, cols)],
                ));
                gens.insert(qs, t.fill);
            }
            Gen::Ones | Gen::Uniform { .. } => {
                specs.push(TensorSpec::new(t.name.clone(), Dtype::F32, t.shape.clone()));
            }
        }
        gens.insert(t.name.clone(), t.fill);
    }
    Ok((ShardLayout::new(specs)?, gens))
}

/// Writes one shard with random contents. A quantized weight's codes are
/// uniform over the symmetric range ([`symmetric_codes`]); its scales are about `1 / (σ_q · sqrt(cols))` (σ_q: the standard
/// deviation of a uniform code, 4.6 for int4 and 73.9 for int8), each
/// jittered by ±25 %.
fn write_shard(
    path: &Path,
    layout: &ShardLayout,
    gens: &HashMap<String, Gen>,
    seed: u64,
) -> BoxResult<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut w = ShardWriter::create(path, layout.clone())?;
    let mut buf = Vec::new();
    for e in layout.entries() {
        let n = e.end - e.begin;
        buf.resize(n, 0);
        let fill = gens
            .get(&e.spec.name)
            .ok_or_else(|| format!("no generator for {}", e.spec.name))?;
        let mut fill_f32 = |f: &mut dyn FnMut(&mut ChaCha8Rng) -> f32| {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&f(&mut rng).to_le_bytes());
            }
        };
        match (*fill, e.spec.dtype) {
            (Gen::Quant { scheme, .. }, Dtype::U8) => {
                rng.fill_bytes(&mut buf);
                symmetric_codes(scheme, &mut buf);
            }
            (Gen::Quant { scheme, cols, .. }, _) => {
                let sigma = match scheme {
                    QuantScheme::Int8Row => 73.9,
                    _ => 4.6,
                };
                // Embedding rows have deviation 1, so the token fed drives the
                // residual stream (and the routing) rather than being drowned
                // by the attention output.
                let fan_in = if e.spec.name.starts_with(EMBED) {
                    1.0
                } else {
                    cols as f32
                };
                let base = 1.0 / (sigma * fan_in.sqrt());
                fill_f32(&mut |r| base * r.random_range(0.75..1.25));
            }
            (Gen::Ones, _) => fill_f32(&mut |_| 1.0),
            (Gen::Uniform { std }, _) => {
                let a = std * 3f32.sqrt();
                fill_f32(&mut |r| r.random_range(-a..a));
            }
        }
        w.write(&e.spec.name, &buf)?;
    }
    w.finish()?;
    Ok(())
}

/// Makes uniform random codes zero-mean: the most negative code (int4 −8,
/// int8 −128) becomes 0. Plain uniform codes have mean −0.5, which gives
/// every projection a common rank-one component; through the layers it
/// grows until every token's hidden state, and so its routing, is the same.
fn symmetric_codes(scheme: QuantScheme, buf: &mut [u8]) {
    match scheme {
        QuantScheme::Int8Row => buf.iter_mut().filter(|b| **b == 0x80).for_each(|b| *b = 0),
        QuantScheme::Int4Row | QuantScheme::Int4Grouped { .. } => {
            for b in buf.iter_mut() {
                let (lo, hi) = (*b & 0x0f, *b >> 4);
                *b = if lo == 0 { 8 } else { lo } | (if hi == 0 { 8 } else { hi } << 4);
            }
        }
    }
}

/// True when the file at `path` starts with `layout`'s safetensors header.
fn same_header(path: &Path, layout: &ShardLayout) -> bool {
    use std::io::Read;
    let want = layout.header_bytes();
    let mut got = vec![0u8; want.len()];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut got))
        .is_ok_and(|()| got == want)
}

/// Writes the container into `dir` unless a complete one is already there
/// (the MTP shard only with `mtp`; a shard is reused when its size and
/// header match and `config.json` is this bench's, with or without MTP);
/// returns the experts shard and, with `mtp`, the MTP shard.
fn ensure_container(dir: &Path, mtp: bool) -> BoxResult<(PathBuf, Option<PathBuf>)> {
    std::fs::create_dir_all(dir)?;
    let (resident, experts, mtp_tensors) = tensors();
    let config = dir.join("config.json");
    let want_config = config_json(mtp)?;
    let known_configs = [config_json(false)?, config_json(true)?];
    let same_config = std::fs::read_to_string(&config).is_ok_and(|c| known_configs.contains(&c));
    let mut shards = vec![
        (RESIDENT_SHARD, &resident, 52u64),
        (EXPERT_SHARD, &experts, 53u64),
    ];
    if mtp {
        shards.push((MTP_SHARD, &mtp_tensors, 54u64));
        let parked = dir.join(format!("{MTP_SHARD}.parked"));
        if parked.exists() && !dir.join(MTP_SHARD).exists() {
            std::fs::rename(&parked, dir.join(MTP_SHARD))?;
        }
    }
    let (mut expert_path, mut mtp_path) = (PathBuf::new(), None);
    for (name, tensors, seed) in shards {
        let (layout, gens) = layout(tensors)?;
        let path = dir.join(name);
        let size = std::fs::metadata(&path).map(|m| m.len()).ok();
        if size == Some(layout.file_size()) && same_config && same_header(&path, &layout) {
            eprintln!(
                "reusing {} ({:.2} GB)",
                path.display(),
                layout.file_size() as f64 / 1e9
            );
        } else {
            eprintln!(
                "writing {} ({:.2} GB) …",
                path.display(),
                layout.file_size() as f64 / 1e9
            );
            let start = Instant::now();
            write_shard(&path, &layout, &gens, seed)?;
            eprintln!("written in {:.1} s", start.elapsed().as_secs_f64());
        }
        match name {
            EXPERT_SHARD => expert_path = path,
            MTP_SHARD => mtp_path = Some(path),
            _ => {}
        }
    }
    if !mtp {
        // A plain run on a directory an MTP run used: the MTP shard stays on
        // disk (it is not deleted) but must not be read as part of the model.
        let stale = dir.join(MTP_SHARD);
        if stale.exists() {
            let parked = dir.join(format!("{MTP_SHARD}.parked"));
            std::fs::rename(&stale, &parked)?;
            eprintln!("moved {} aside to {}", stale.display(), parked.display());
        }
    }
    std::fs::write(&config, want_config)?;
    Ok((expert_path, mtp_path))
}

fn argmax(logits: &[f32]) -> BoxResult<u32> {
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(format!("logit {i} is {}", logits[i]).into());
    }
    logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .ok_or_else(|| "empty logits".into())
}

struct Sample {
    ms: f64,
    hits: u64,
    misses: u64,
    bytes: u64,
}

fn main() -> BoxResult<()> {
    let dir = std::env::var_os("GLM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/glm-stream-decode-slice"));
    let prompt_len: usize = env_or("GLM_BENCH_PROMPT", 4).max(1);
    let tokens: usize = env_or("GLM_BENCH_TOKENS", 16).max(1);
    let greedy = std::env::var("GLM_BENCH_GREEDY").is_ok_and(|v| v == "1");
    let budget_gb: f64 = env_or("GLM_BENCH_BUDGET_GB", 1.5);
    let io_threads: usize = env_or("GLM_BENCH_IO_THREADS", 4);
    let seq_mb: u64 = env_or("GLM_BENCH_SEQ_MB", 2048);
    println!("mlx {} on {:?}", mlx::version(), mlx::default_device());

    let mtp = std::env::var("GLM_BENCH_MTP").is_ok_and(|v| v == "1");
    let (shard, _) = ensure_container(&dir, mtp)?;
    if mtp {
        return mtp_modes(
            &dir, &shard, prompt_len, tokens, budget_gb, io_threads, seq_mb,
        );
    }
    let expert_total = (FIRST_DENSE..LAYERS).count() as u64 * EXPERTS as u64 * EXPERT_BYTES;
    let opts = ModelOptions {
        ram_budget_bytes: Some((budget_gb * 1e9) as u64),
        io_threads,
        direct_io: true,
        include_mtp: false,
        kernel_family: kernel_family()?,
    };
    let open_start = Instant::now();
    let mut model = Glm52Model::open(&dir, &opts)?;
    let slots = model.expert_stats().slots;
    println!(
        "slice: {LAYERS} layers ({FIRST_DENSE} dense), hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, \
         vocab {VOCAB}; routed experts {:.2} GB; pool {slots} slots = {:.2} GB (budget {budget_gb} GB); \
         {io_threads} I/O threads, O_DIRECT; opened in {:.1} s",
        expert_total as f64 / 1e9,
        (slots as u64 * EXPERT_BYTES) as f64 / 1e9,
        open_start.elapsed().as_secs_f64()
    );

    let bw_before = sequential_bandwidth(&shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (before): {:.3} GB/s",
        bw_before / 1e9
    );

    model.set_routing_trace(true);
    let mut cache = model.new_cache();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let start = Instant::now();
    let logits = model.forward(&prompt, &mut cache, false)?;
    let mut argmax_id = argmax(&logits)?;
    let prefill_records = model.routing_trace().map_or(0, RoutingTrace::len);
    println!(
        "prefill {prompt_len} tokens: {:.1} ms (loads the resident weights)",
        start.elapsed().as_secs_f64() * 1e3
    );

    let mut samples = Vec::with_capacity(tokens);
    for t in 0..tokens {
        let fed = if greedy {
            argmax_id
        } else {
            rng.random_range(0..VOCAB as u32)
        };
        let before = model.expert_stats();
        let start = Instant::now();
        let logits = model.forward(&[fed], &mut cache, false)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        argmax_id = argmax(&logits)?;
        let after = model.expert_stats();
        let s = Sample {
            ms,
            hits: after.hits - before.hits,
            misses: after.misses - before.misses,
            bytes: after.bytes_read - before.bytes_read,
        };
        println!(
            "token {t:>3} (id {fed:>4}): {:>8.1} ms, {:>2} hits / {:>2} misses, {:>7.1} MB read, argmax {argmax_id}",
            s.ms,
            s.hits,
            s.misses,
            s.bytes as f64 / 1e6
        );
        samples.push(s);
    }
    let bw_after = sequential_bandwidth(&shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (after): {:.3} GB/s",
        bw_after / 1e9
    );
    let bw = 0.5 * (bw_before + bw_after);

    let n = samples.len() as f64;
    let total_s: f64 = samples.iter().map(|s| s.ms).sum::<f64>() / 1e3;
    let hits: u64 = samples.iter().map(|s| s.hits).sum();
    let misses: u64 = samples.iter().map(|s| s.misses).sum();
    let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
    let per_token_s = total_s / n;
    let bytes_per_token = bytes as f64 / n;
    let floor_s = bytes_per_token / bw;
    let hit_rate = hits as f64 / (hits + misses).max(1) as f64;
    println!(
        "summary over {tokens} decode tokens ({} MoE layers, top-{TOP_K}, {slots} slots): \
         {:.3} tok/s ({:.1} ms per token); hit rate {:.1}%; {:.1} MB missed per token \
         ({:.1} experts); read bandwidth {:.3} GB/s (sequential O_DIRECT, same run, before {:.3} / after {:.3}); \
         floor {:.1} ms per token; time/floor {:.2}",
        LAYERS - FIRST_DENSE,
        1.0 / per_token_s,
        per_token_s * 1e3,
        100.0 * hit_rate,
        bytes_per_token / 1e6,
        misses as f64 / n,
        bw / 1e9,
        bw_before / 1e9,
        bw_after / 1e9,
        floor_s * 1e3,
        per_token_s / floor_s
    );

    let trace = model
        .take_routing_trace()
        .ok_or("the slice has no routed experts")?;
    let policy = PolicyConfig::new(1, 1, 1);
    let own = replay_policy(&trace, slots, &policy)?;
    let (rh, rm) = own.counts_from(prefill_records);
    println!(
        "replay of the recorded trace ({} records, {} rows; decode = records {prefill_records}..) \
         through the policy at {slots} slots: {rh} hits / {rm} misses ({} the run's {hits} / {misses})",
        trace.len(),
        trace.rows(),
        if (rh, rm) == (hits, misses) {
            "reproduces"
        } else {
            "DIFFERS from"
        }
    );
    let all = (LAYERS - FIRST_DENSE) * EXPERTS;
    let mut capacities = vec![
        TOP_K,
        2 * TOP_K,
        32,
        slots / 2,
        slots,
        2 * slots,
        128,
        256,
        all,
    ];
    capacities.retain(|&c| c >= TOP_K && c <= all);
    capacities.sort_unstable();
    capacities.dedup();
    println!(
        "{:>6} {:>7} {:>8} {:>8} {:>8} {:>13} {:>10}",
        "slots", "% pool", "policy", "lru", "belady", "policy/belady", "lru/belady"
    );
    for c in capacities {
        let rate =
            |r: glm_stream::experts::ReplayResult| r.hit_rate_from(prefill_records).unwrap_or(0.0);
        let p = rate(replay_policy(&trace, c, &policy)?);
        let l = rate(lru(&trace, c)?);
        let b = rate(belady(&trace, c)?);
        let ratio = |x: f64| if b > 0.0 { x / b } else { f64::NAN };
        println!(
            "{c:>6} {:>6.1}% {:>7.2}% {:>7.2}% {:>7.2}% {:>13.3} {:>10.3}",
            100.0 * c as f64 / all as f64,
            100.0 * p,
            100.0 * l,
            100.0 * b,
            ratio(p),
            ratio(l)
        );
    }
    if let Ok(path) = std::env::var("GLM_BENCH_TRACE") {
        trace.save(Path::new(&path))?;
        println!("routing trace saved to {path}");
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Plain,
    Mtp { adaptive: bool },
    SetRate { rate: f64, k: usize },
}

impl Mode {
    fn label(self) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Mtp { adaptive: true } => "mtp k=1 adaptive".into(),
            Self::Mtp { adaptive: false } => "mtp k=1 fixed".into(),
            Self::SetRate { rate, k } => format!("set-rate p={rate} k={k}"),
        }
    }
}

/// `GLM_BENCH_MTP=1`: plain decoding, MTP (k = 1, adaptive and fixed) and a
/// set-rate drafter (p = 0.8, k = 3, proposing the plain run's tokens), each
/// through a [`Session`] on a freshly opened model (cold pool, same budget),
/// feeding the model's own tokens: greedy by default, or seeded sampling at
/// `GLM_BENCH_TEMP` (same seed every mode).
fn mtp_modes(
    dir: &Path,
    shard: &Path,
    prompt_len: usize,
    tokens: usize,
    budget_gb: f64,
    io_threads: usize,
    seq_mb: u64,
) -> BoxResult<()> {
    let temperature: f32 = env_or("GLM_BENCH_TEMP", 0.0);
    let sampling = if temperature > 0.0 {
        SamplingParams {
            temperature,
            seed: 7,
            ..SamplingParams::greedy()
        }
    } else {
        SamplingParams::greedy()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let gen_opts = GenerateOptions {
        max_tokens: tokens + 1,
        sampling,
        ..GenerateOptions::default()
    };
    let bw_before = sequential_bandwidth(shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (before): {:.3} GB/s",
        bw_before / 1e9
    );
    let modes = [
        Mode::Plain,
        Mode::Mtp { adaptive: true },
        Mode::Mtp { adaptive: false },
        Mode::SetRate { rate: 0.8, k: 3 },
    ];
    let mut rows = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for mode in modes {
        let opts = ModelOptions {
            ram_budget_bytes: Some((budget_gb * 1e9) as u64),
            io_threads,
            direct_io: true,
            include_mtp: matches!(mode, Mode::Mtp { .. }),
            kernel_family: kernel_family()?,
        };
        let mut model = Glm52Model::open(dir, &opts)?;
        let slots = model.expert_stats().slots;
        let drafter = match mode {
            Mode::Mtp { .. } => Some(MtpDrafter::new(&mut model, 0)?),
            _ => None,
        };
        let session = Session::new(&mut model, None, &prompt, gen_opts.clone())?;
        let session = match (mode, drafter) {
            (Mode::Mtp { adaptive }, Some(d)) => {
                let policy = if adaptive {
                    DraftPolicyConfig::default()
                } else {
                    DraftPolicyConfig::fixed(1)
                };
                session.with_drafter(d, policy)?
            }
            (Mode::SetRate { rate, k }, _) => {
                let want = reference.clone().ok_or("plain runs first")?;
                let d = SetRateDrafter::new(prompt.len(), want, VOCAB, rate, 1);
                session.with_drafter(d, DraftPolicyConfig::fixed(k))?
            }
            _ => session,
        };
        let g = session.run(|_| std::ops::ControlFlow::Continue(()))?;
        let es = model.expert_stats();
        let same = match &reference {
            None => {
                reference = Some(g.tokens.clone());
                true
            }
            Some(want) => *want == g.tokens,
        };
        if !same && temperature <= 0.0 {
            return Err(format!("{} changed the greedy output", mode.label()).into());
        }
        println!(
            "{}: {} slots of {:.1} MB; tokens {:?}",
            mode.label(),
            slots,
            if matches!(mode, Mode::Mtp { .. }) {
                MTP_EXPERT_BYTES
            } else {
                EXPERT_BYTES
            } as f64
                / 1e6,
            g.tokens
        );
        rows.push((mode, g.stats, es.hits, es.misses, slots, same));
    }
    let bw_after = sequential_bandwidth(shard, seq_mb << 20)?;
    println!(
        "sequential O_DIRECT read (after): {:.3} GB/s",
        bw_after / 1e9
    );
    let bw = 0.5 * (bw_before + bw_after);
    println!(
        "{} sampling, {prompt_len}-token prompt, {tokens} decoded tokens; budget {budget_gb} GB; \
         read bandwidth {:.3} GB/s (before {:.3} / after {:.3})",
        if temperature > 0.0 {
            format!("seeded T={temperature}")
        } else {
            "greedy".into()
        },
        bw / 1e9,
        bw_before / 1e9,
        bw_after / 1e9
    );
    println!(
        "{:<20} {:>6} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>10} {:>8} {:>6}",
        "mode",
        "slots",
        "tok/fwd",
        "drafted",
        "accept",
        "dec tok/s",
        "hit rate",
        "MB/token",
        "floor ms",
        "t/floor",
        "same"
    );
    for (mode, s, hits, misses, slots, same) in rows {
        let decoded = s.generated_tokens.saturating_sub(1).max(1) as f64;
        let bytes = (s.plain_bytes + s.round_bytes) as f64 / decoded;
        let floor = bytes / bw;
        let per_token = s.decode.as_secs_f64() / decoded;
        println!(
            "{:<20} {:>6} {:>8.3} {:>8} {:>8} {:>10.3} {:>8.1}% {:>10.1} {:>10.1} {:>8.2} {:>6}",
            mode.label(),
            slots,
            s.tokens_per_forward().unwrap_or(f64::NAN),
            s.drafted,
            s.acceptance_rate()
                .map_or("-".into(), |a| format!("{a:.3}")),
            s.decode_tok_s(),
            100.0 * hits as f64 / (hits + misses).max(1) as f64,
            bytes / 1e6,
            floor * 1e3,
            per_token / floor,
            if same { "yes" } else { "no" }
        );
    }
    Ok(())
}

/// `GLM_BENCH_KERNELS` (`auto` by default; `stock`, `fused`, `fused-simt`):
/// how the routed experts are computed.
fn kernel_family() -> BoxResult<KernelFamily> {
    Ok(std::env::var("GLM_BENCH_KERNELS")
        .ok()
        .map(|v| v.parse::<KernelFamily>())
        .transpose()?
        .unwrap_or_default())
}
