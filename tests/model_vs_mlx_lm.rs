//! The crate's GLM-5.x forward pass against mlx-lm 0.32.2's `glm_moe_dsa` on
//! the same (dequantized) weights, float32 on the CPU.
//!
//! Each case generates a tiny random model, converts it, prefills a prompt
//! longer than `index_topk` (so the DSA sparse path runs in prefill and in
//! every decode step) and decodes with the KV cache, feeding the oracle's
//! greedy tokens so both sides see the same sequence. Every logits row must
//! satisfy `max|Δ| / max|ref| ≤ 1e-4`, and the crate's greedy token must
//! equal the oracle's wherever the oracle's top-1/top-2 gap exceeds
//! `1e-3 · max|ref|`. The models keep every router and indexer top-k cut gap
//! ≥ 1e-4 (asserted), so no selection can flip under f32 rounding.

mod common;

use common::tiny_model::{
    Fixture, argmax_gap, build, decode, oracle, prompt, row_rel_error, test_options,
};
use glm_stream::convert::{Bits, ConvertOptions};
use glm_stream::kernels::KernelFamily;
use glm_stream::model::{Glm52Model, ModelError, ModelOptions};
use glm_stream::tiny::TinyModelSpec;

const MAX_REL: f64 = 1e-4;
const MIN_CUT_GAP: f32 = 1e-4;

/// Runs prefill + `steps` decode steps on both sides and compares; returns
/// the largest row error.
fn compare(f: &Fixture, prompt_len: usize, steps: usize, salt: usize) -> f64 {
    let ids = prompt(prompt_len, f.spec.vocab_size, salt);
    let reference = oracle(&f.model, &ids, steps);
    assert_eq!(reference.rows.len(), prompt_len + steps - 1);
    let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
    let (rows, router_gap, index_gap, _) = decode(&mut model, &ids, &reference.tokens[..steps - 1]);
    assert!(
        router_gap >= MIN_CUT_GAP,
        "router cut gap {router_gap:e}: pick another seed"
    );
    if prompt_len > f.spec.index_topk {
        assert!(
            index_gap.is_finite() && index_gap >= MIN_CUT_GAP,
            "indexer cut gap {index_gap:e}: pick another seed"
        );
    }
    let mut worst = 0f64;
    for (i, (got, want)) in rows.iter().zip(&reference.rows).enumerate() {
        let rel = row_rel_error(got, want);
        assert!(rel <= MAX_REL, "row {i}: max|Δ|/max|ref| = {rel:e}");
        worst = worst.max(rel);
        if i + 1 >= prompt_len {
            let step = i + 1 - prompt_len;
            let (want_token, gap) = argmax_gap(want);
            assert_eq!(want_token, reference.tokens[step]);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            if gap > 1e-3 * scale {
                assert_eq!(argmax_gap(got).0, want_token, "greedy token of step {step}");
            }
        }
    }
    let stats = model.expert_stats();
    assert!(stats.hits + stats.misses > 0 && stats.bytes_read > 0);
    eprintln!(
        "prompt {prompt_len} + {steps} steps: worst row error {worst:e}, router gap {router_gap:e}, \
         indexer gap {index_gap:e}, experts {stats:?}"
    );
    worst
}

#[test]
fn per_row_int4_matches_mlx_lm_with_sparse_indexer() {
    let spec = TinyModelSpec::default();
    let f = build(
        &spec,
        101,
        &ConvertOptions {
            group_size: 0,
            ..ConvertOptions::default()
        },
        |_| {},
    );
    compare(&f, 14, 9, 1);
}

#[test]
fn grouped_int4_hidden_128_matches_mlx_lm() {
    let spec = TinyModelSpec {
        hidden_size: 128,
        num_hidden_layers: 3,
        n_routed_experts: 16,
        num_experts_per_tok: 4,
        moe_intermediate_size: 64,
        q_lora_rank: 64,
        kv_lora_rank: 64,
        num_attention_heads: 4,
        index_n_heads: 8,
        index_head_dim: 32,
        ..TinyModelSpec::default()
    };
    let f = build(
        &spec,
        202,
        &ConvertOptions {
            group_size: 64,
            ..ConvertOptions::default()
        },
        |_| {},
    );
    compare(&f, 16, 9, 2);
}

#[test]
fn int8_matches_mlx_lm() {
    let spec = TinyModelSpec {
        index_n_heads: 12,
        index_topk: 6,
        ..TinyModelSpec::default()
    };
    let f = build(
        &spec,
        303,
        &ConvertOptions {
            ebits: Bits::Eight,
            ..ConvertOptions::default()
        },
        |_| {},
    );
    compare(&f, 12, 8, 3);
}

/// Without the `out-idx-*` shards every layer runs dense attention; while the
/// context stays within `index_topk` that is exactly what mlx-lm computes.
#[test]
fn container_without_indexer_runs_dense() {
    let spec = TinyModelSpec::default();
    let f = build(&spec, 404, &ConvertOptions::default(), |_| {});
    let (prompt_len, steps) = (5, 4);
    assert!(prompt_len + steps - 1 <= spec.index_topk);
    let ids = prompt(prompt_len, spec.vocab_size, 4);
    let reference = oracle(&f.model, &ids, steps);

    let stripped = f.dir.path().join("no-indexer");
    std::fs::create_dir(&stripped).unwrap();
    let mut removed = 0;
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("out-idx-") {
            removed += 1;
        } else {
            std::fs::copy(entry.path(), stripped.join(&name)).unwrap();
        }
    }
    assert!(removed > 0, "the converter wrote no indexer shard");
    let mut model = Glm52Model::open(&stripped, &test_options()).unwrap();
    assert!(matches!(
        model.layer_sparsity(0),
        Some(glm_stream::model::attention::Sparsity::Dense)
    ));
    let (rows, _, _, _) = decode(&mut model, &ids, &reference.tokens[..steps - 1]);
    for (i, (got, want)) in rows.iter().zip(&reference.rows).enumerate() {
        let rel = row_rel_error(got, want);
        assert!(rel <= MAX_REL, "row {i}: {rel:e}");
    }
    // Beyond index_topk it keeps running (dense over the whole context).
    let mut cache = model.new_cache();
    let long = prompt(spec.index_topk + 5, spec.vocab_size, 5);
    model.forward(&long, &mut cache, false).unwrap();
    model.forward(&[7], &mut cache, false).unwrap();
}

#[test]
fn bad_input_is_a_typed_error() {
    let spec = TinyModelSpec {
        max_position_embeddings: 16,
        ..TinyModelSpec::default()
    };
    let f = build(&spec, 505, &ConvertOptions::default(), |_| {});
    let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
    let mut cache = model.new_cache();
    let vocab = spec.vocab_size as u32;
    assert!(matches!(
        model.forward(&[1, vocab, 2], &mut cache, false),
        Err(ModelError::TokenOutOfRange { index: 1, id, .. }) if id == vocab
    ));
    assert!(matches!(
        model.forward(&[], &mut cache, false),
        Err(ModelError::EmptyInput)
    ));
    assert!(matches!(
        model.forward(&[1; 17], &mut cache, false),
        Err(ModelError::ContextOverflow {
            start: 0,
            end: 17,
            max: 16
        })
    ));
    assert_eq!(cache.len(), 0);
    model.forward(&[1; 10], &mut cache, false).unwrap();
    assert!(matches!(
        model.forward(&[1; 7], &mut cache, false),
        Err(ModelError::ContextOverflow {
            start: 10,
            end: 17,
            ..
        })
    ));
    assert_eq!(cache.len(), 10);
    model.forward(&[1; 6], &mut cache, true).unwrap();
    assert!(matches!(
        model.forward(&[1], &mut cache, false),
        Err(ModelError::ContextOverflow { start: 16, .. })
    ));
    // Without a fused backend on a GPU: a pinned `Fused` fails at open
    // (nothing half-built), and `Stock` is what `Auto` runs (same logits).
    let env = glm_stream::kernels::Environment::current();
    if env.fused_backend.is_none() || !env.gpu_default {
        let fused = Glm52Model::open(
            &f.model,
            &ModelOptions {
                kernel_family: KernelFamily::Fused,
                ..test_options()
            },
        );
        let message = fused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("fused"), "{message}");
        let logits = |family: KernelFamily| {
            let mut m = Glm52Model::open(
                &f.model,
                &ModelOptions {
                    kernel_family: family,
                    ..test_options()
                },
            )
            .unwrap();
            let mut c = m.new_cache();
            m.forward(&[1, 2, 3], &mut c, false).unwrap()
        };
        assert_eq!(logits(KernelFamily::Stock), logits(KernelFamily::Auto));
    }
    // Another architecture.
    let config = f.model.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("glm_moe_dsa", "deepseek_v32")).unwrap();
    assert!(matches!(
        Glm52Model::open(&f.model, &ModelOptions::default()),
        Err(ModelError::UnsupportedModelType { ref found, .. }) if found == "deepseek_v32"
    ));
}

/// Rolling the cache back and replaying gives the same logits; a second
/// prefill chunk on a non-empty cache equals one-token steps; a prefill split
/// into passes equals one pass; the MTP weights can be loaded alongside; a
/// cache of another model is refused.
#[test]
fn cache_rollback_and_chunked_prefill_are_consistent() {
    let spec = TinyModelSpec::default();
    let f = build(&spec, 606, &ConvertOptions::default(), |_| {});
    let options = ModelOptions {
        include_mtp: true,
        ..test_options()
    };
    let mut model = Glm52Model::open(&f.model, &options).unwrap();
    let vocab = spec.vocab_size;
    let ids = prompt(14, vocab, 6);

    let mut cache = model.new_cache();
    let whole = model.forward(&ids, &mut cache, true).unwrap();
    model.set_prefill_chunk(5);
    let mut cache = model.new_cache();
    let split = model.forward(&ids, &mut cache, true).unwrap();
    assert_eq!(cache.len(), 14);
    for i in 0..ids.len() {
        let rel = row_rel_error(
            &split[i * vocab..(i + 1) * vocab],
            &whole[i * vocab..(i + 1) * vocab],
        );
        assert!(rel <= MAX_REL, "position {i}: {rel:e}");
    }
    let last = model.forward(&ids, &mut model.new_cache(), false).unwrap();
    assert_eq!(last.len(), vocab);
    assert!(row_rel_error(&last, &split[13 * vocab..]) <= MAX_REL);

    let mut cache = model.new_cache();
    model.forward(&ids[..10], &mut cache, false).unwrap();
    let chunk = model.forward(&ids[10..], &mut cache, true).unwrap();
    cache.truncate(10);
    assert_eq!(cache.len(), 10);
    for (j, &t) in ids[10..].iter().enumerate() {
        let row = model.forward(&[t], &mut cache, false).unwrap();
        let rel = row_rel_error(&row, &chunk[j * vocab..(j + 1) * vocab]);
        assert!(rel <= MAX_REL, "position {}: {rel:e}", 10 + j);
    }
    assert_eq!(cache.len(), 14);

    let other_spec = TinyModelSpec {
        num_hidden_layers: 2,
        ..TinyModelSpec::default()
    };
    let other = build(&other_spec, 607, &ConvertOptions::default(), |_| {});
    let other = Glm52Model::open(&other.model, &test_options()).unwrap();
    let mut foreign = other.new_cache();
    assert!(matches!(
        model.forward(&[1], &mut foreign, false),
        Err(ModelError::CacheMismatch(_))
    ));
}

/// The generation layer's greedy session over the model produces mlx-lm's
/// greedy tokens (through `LanguageModel`).
#[test]
fn greedy_session_reproduces_mlx_lm_tokens() {
    use glm_stream::generate::{GenerateOptions, Session};
    let spec = TinyModelSpec::default();
    let f = build(
        &spec,
        101,
        &ConvertOptions {
            group_size: 0,
            ..ConvertOptions::default()
        },
        |_| {},
    );
    let (prompt_len, steps) = (13, 6);
    let ids = prompt(prompt_len, spec.vocab_size, 10);
    let reference = oracle(&f.model, &ids, steps);
    let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
    let options = GenerateOptions {
        max_tokens: steps,
        ..GenerateOptions::default()
    };
    let session = Session::new(&mut model, None, &ids, options).unwrap();
    let got: Vec<u32> = session
        .map(|t| t.map(|t| t.id))
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(!got.is_empty());
    for (step, (&g, &want)) in got.iter().zip(&reference.tokens).enumerate() {
        let row = &reference.rows[prompt_len - 1 + step];
        let (_, gap) = argmax_gap(row);
        let scale = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        if gap <= 1e-3 * scale {
            break; // an ambiguous step: the sequences may part here
        }
        assert_eq!(g, want, "step {step}");
    }
}
