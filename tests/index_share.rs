//! GLM-5.2 IndexShare (mlx-lm lacks it): "shared" layers carry no indexer
//! and reuse the top-k of the most recent "full" layer.
//!
//! The crate's decode is compared with an independent f64 host reference
//! (`common::reference_model`) that takes the per-layer kinds from an
//! explicit list. The reference is first checked against the crate on a
//! model where every layer has its own indexer (the crate is checked against
//! mlx-lm on such models in `model_vs_mlx_lm.rs`). Finally, an explicit
//! all-"full" `indexer_types` gives bit-identical logits to no
//! `indexer_types` at all.

mod common;

use std::path::Path;

use common::reference_model::{IndexKind, ReferenceModel};
use common::tiny_model::{Fixture, build, decode, prompt, row_rel_error, test_options};
use glm_stream::container::ColibriContainer;
use glm_stream::convert::ConvertOptions;
use glm_stream::model::Glm52Model;
use glm_stream::model::attention::Sparsity;
use glm_stream::tiny::TinyModelSpec;
use safetensors::SafeTensors;

const MAX_REL: f64 = 1e-4;
const MIN_CUT_GAP: f32 = 1e-4;

fn spec() -> TinyModelSpec {
    TinyModelSpec {
        num_hidden_layers: 5,
        first_k_dense_replace: 1,
        ..TinyModelSpec::default()
    }
}

/// Adds `indexer_types` to `dir/config.json`.
fn set_indexer_types(dir: &Path, kinds: &[IndexKind]) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let types: Vec<&str> = kinds
        .iter()
        .map(|k| match k {
            IndexKind::Full => "full",
            IndexKind::Shared | IndexKind::Dense => "shared",
        })
        .collect();
    config["indexer_types"] = serde_json::json!(types);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// Removes the indexer tensors of `layers` from the HF shards (and the index).
fn drop_indexers(hf: &Path, layers: &[usize]) {
    let doomed = |name: &str| {
        layers
            .iter()
            .any(|l| name.starts_with(&format!("model.layers.{l}.self_attn.indexer.")))
    };
    let mut dropped = 0;
    for entry in std::fs::read_dir(hf).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let all = st.tensors();
        let keep: Vec<_> = all.iter().filter(|(n, _)| !doomed(n)).cloned().collect();
        if keep.len() < all.len() {
            dropped += all.len() - keep.len();
            safetensors::serialize_to_file(keep, meta.metadata().clone(), &path).unwrap();
        }
    }
    assert_eq!(dropped, layers.len() * 5, "5 indexer tensors per layer");
    let index = hf.join("model.safetensors.index.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    json["weight_map"]
        .as_object_mut()
        .unwrap()
        .retain(|name, _| !doomed(name));
    std::fs::write(&index, serde_json::to_string(&json).unwrap()).unwrap();
}

/// Decodes `ids[..prompt_len]` then the rest one by one with the crate and
/// compares every row with the reference; returns the crate's rows.
fn check_against_reference(
    f: &Fixture,
    kinds: Vec<IndexKind>,
    ids: &[u32],
    prompt_len: usize,
) -> Vec<Vec<f32>> {
    let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
    for (l, kind) in kinds.iter().enumerate() {
        let sparsity = model.layer_sparsity(l).unwrap();
        match kind {
            IndexKind::Full => assert!(matches!(sparsity, Sparsity::Own(_)), "layer {l}"),
            IndexKind::Shared | IndexKind::Dense => {
                assert!(matches!(sparsity, Sparsity::Shared), "layer {l}")
            }
        }
    }
    let (rows, router_gap, index_gap, _) =
        decode(&mut model, &ids[..prompt_len], &ids[prompt_len..]);
    assert!(
        router_gap >= MIN_CUT_GAP,
        "router gap {router_gap:e}: pick another seed"
    );
    assert!(
        index_gap.is_finite() && index_gap >= MIN_CUT_GAP,
        "indexer gap {index_gap:e}: pick another seed"
    );
    let reference = ReferenceModel::new(ColibriContainer::open(&f.model).unwrap(), kinds);
    let want = reference.logits(ids);
    let mut worst = 0f64;
    for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
        let want32: Vec<f32> = want.iter().map(|v| *v as f32).collect();
        let rel = row_rel_error(got, &want32);
        assert!(rel <= MAX_REL, "row {i}: max|Δ|/max|ref| = {rel:e}");
        worst = worst.max(rel);
    }
    eprintln!("worst row error {worst:e}, router gap {router_gap:e}, indexer gap {index_gap:e}");
    rows
}

#[test]
fn shared_layers_reuse_the_last_full_layers_top_k() {
    use IndexKind::{Full, Shared};
    let kinds = vec![Full, Shared, Full, Shared, Shared];
    let shared_layers: Vec<usize> = (0..kinds.len()).filter(|&l| kinds[l] == Shared).collect();
    let spec = spec();
    let f = build(&spec, 707, &ConvertOptions::default(), |hf| {
        set_indexer_types(hf, &kinds);
        drop_indexers(hf, &shared_layers);
    });
    let container = ColibriContainer::open(&f.model).unwrap();
    for (l, kind) in kinds.iter().enumerate() {
        let name = format!("model.layers.{l}.self_attn.indexer.wq_b.weight");
        assert_eq!(container.weight(&name).is_ok(), *kind == Full, "{name}");
    }
    let ids = prompt(20, spec.vocab_size, 7);
    let rows = check_against_reference(&f, kinds.clone(), &ids, 13);

    // The reuse matters: with the shared layers attending densely instead,
    // the rows past index_topk come out clearly different.
    let dense: Vec<IndexKind> = kinds
        .iter()
        .map(|&k| if k == Shared { IndexKind::Dense } else { k })
        .collect();
    let contrast =
        ReferenceModel::new(ColibriContainer::open(&f.model).unwrap(), dense).logits(&ids);
    let sparse_rows = spec.index_topk..ids.len();
    let largest = sparse_rows
        .map(|i| {
            let w: Vec<f32> = contrast[i].iter().map(|v| *v as f32).collect();
            row_rel_error(&rows[i], &w)
        })
        .fold(0f64, f64::max);
    eprintln!("shared layers attending densely instead: row error up to {largest:e}");
    assert!(
        largest > 1e-2,
        "shared selection had no effect ({largest:e})"
    );
}

#[test]
fn reference_agrees_with_the_crate_when_every_layer_is_full() {
    let spec = spec();
    let f = build(&spec, 808, &ConvertOptions::default(), |_| {});
    let ids = prompt(18, spec.vocab_size, 8);
    check_against_reference(&f, vec![IndexKind::Full; spec.num_hidden_layers], &ids, 12);
}

#[test]
fn explicit_all_full_indexer_types_equal_the_default_path() {
    let spec = spec();
    let f = build(&spec, 909, &ConvertOptions::default(), |_| {});
    let ids = prompt(16, spec.vocab_size, 9);
    let run = || {
        let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
        decode(&mut model, &ids[..11], &ids[11..]).0
    };
    let default_rows = run();
    set_indexer_types(&f.model, &vec![IndexKind::Full; spec.num_hidden_layers]);
    let explicit_rows = run();
    assert_eq!(default_rows.len(), explicit_rows.len());
    for (i, (a, b)) in default_rows.iter().zip(&explicit_rows).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "row {i} differs");
    }
}
