//! Container reader tests on small containers written into temp dirs: a valid
//! multi-shard GLM-shaped container, then one malformed input per error class.

#![recursion_limit = "256"]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use glm_stream::container::{
    ColibriContainer, ContainerError, ExpertProj, Glm52Config, TensorFamily, WeightFormat,
    routed_expert_coords,
};
use glm_stream::quant::{FormatError, FormatSource, QuantFormat, UnsupportedFormat};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;

use common::reference;

// Tiny glm_moe_dsa: hidden 128, 3 decoder layers (0 dense, 1-2 MoE), MTP layer 3.
fn tiny_config() -> serde_json::Value {
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 40, "hidden_size": 128, "intermediate_size": 96,
        "moe_intermediate_size": 67, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 8,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
        "attention_bias": false, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
        "indexer_types": ["full", "shared", "full"], "index_topk_freq": 2, "index_skip_topk_offset": 1,
        "num_nextn_predict_layers": 1, "eos_token_id": [7, 3], "tie_word_embeddings": false,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "some_unknown_field": {"x": 1}
    })
}

/// A tensor to write: name, dtype, shape, bytes.
struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Expected decode of a quantized weight.
struct Expect {
    format: QuantFormat,
    values: Vec<f32>,
}

struct Builder {
    rng: ChaCha8Rng,
    expect: HashMap<String, Expect>,
}

impl Builder {
    fn new() -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(7),
            expect: HashMap::new(),
        }
    }

    /// A quantized weight in `format` with random bytes and scales: pushes the
    /// flat U8 blob and the F32 `.qs`, and records the reference decode.
    fn quant(&mut self, out: &mut Vec<T>, name: &str, format: QuantFormat) {
        let mut w = vec![0u8; format.weight_bytes()];
        self.rng.fill(&mut w[..]);
        let s: Vec<f32> = (0..format.scale_count())
            .map(|_| self.rng.random_range(1e-4f32..0.1) * 1.0001)
            .collect();
        let values = reference(
            format.bits,
            format.group_size.map(|g| g as usize),
            format.rows,
            format.cols,
            &w,
            &s,
        );
        self.expect
            .insert(name.to_owned(), Expect { format, values });
        out.push(T {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![w.len()],
            data: w,
        });
        out.push(T {
            name: format!("{name}.qs"),
            dtype: Dtype::F32,
            shape: vec![s.len()],
            data: s.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
    }

    fn f32(&mut self, out: &mut Vec<T>, name: &str, shape: &[usize]) {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .flat_map(|_| self.rng.random_range(-1f32..1.0).to_le_bytes())
            .collect();
        out.push(T {
            name: name.into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data,
        });
    }
}

fn write_shard(path: &Path, tensors: &[T], metadata: Option<HashMap<String, String>>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, metadata, path).unwrap();
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

/// Writes a raw shard: u64 LE header length, header text, data.
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

const L: &str = "model.layers";

/// The valid tiny container. Returns the temp dir and the expected decodes.
fn build_valid(with_params: bool) -> (tempfile::TempDir, HashMap<String, Expect>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_json(&d.join("config.json"), &tiny_config());
    write_json(
        &d.join("generation_config.json"),
        &json!({"eos_token_id": [3, 9], "bos_token_id": 1}),
    );
    if with_params {
        write_json(
            &d.join(".out-params.json"),
            &json!({"ebits": 4, "io_bits": 8, "xbits": 4, "group_size": 64, "n_layers": 3}),
        );
    }
    let mut b = Builder::new();
    let g64 = |o, i| QuantFormat::int4_grouped(o, i, 64);

    // Shard 0: embedding, head, final norm, dense layer 0.
    let mut s0 = Vec::new();
    b.quant(
        &mut s0,
        "model.embed_tokens.weight",
        QuantFormat::int8_row(40, 128),
    );
    b.quant(&mut s0, "lm_head.weight", QuantFormat::int8_row(40, 128));
    b.f32(&mut s0, "model.norm.weight", &[128]);
    b.quant(
        &mut s0,
        &format!("{L}.0.self_attn.q_a_proj.weight"),
        g64(32, 128),
    );
    b.quant(
        &mut s0,
        &format!("{L}.0.self_attn.q_b_proj.weight"),
        QuantFormat::int4_row(32, 32),
    );
    b.quant(
        &mut s0,
        &format!("{L}.0.self_attn.kv_a_proj_with_mqa.weight"),
        g64(24, 128),
    );
    b.quant(
        &mut s0,
        &format!("{L}.0.self_attn.kv_b_proj.weight"),
        QuantFormat::int4_row(48, 16),
    );
    b.quant(
        &mut s0,
        &format!("{L}.0.self_attn.o_proj.weight"),
        QuantFormat::int4_row(128, 32),
    );
    b.quant(
        &mut s0,
        &format!("{L}.0.mlp.gate_proj.weight"),
        g64(96, 128),
    );
    b.quant(&mut s0, &format!("{L}.0.mlp.up_proj.weight"), g64(96, 128));
    // I = 96: g48 and g64 both give 2 groups; the params settle it.
    b.quant(
        &mut s0,
        &format!("{L}.0.mlp.down_proj.weight"),
        g64(128, 96),
    );
    b.f32(&mut s0, &format!("{L}.0.input_layernorm.weight"), &[128]);
    let bf16: Vec<u8> = (0..128)
        .flat_map(|i| half::bf16::from_f32(i as f32 * 0.5).to_le_bytes())
        .collect();
    s0.push(T {
        name: format!("{L}.0.post_attention_layernorm.weight"),
        dtype: Dtype::BF16,
        shape: vec![128],
        data: bf16,
    });
    write_shard(&d.join("out-00000.safetensors"), &s0, None);

    // Shard 1: MoE layer 1 with indexer, layer 2 router only.
    let mut s1 = Vec::new();
    b.f32(&mut s1, &format!("{L}.1.mlp.gate.weight"), &[4, 128]);
    b.f32(
        &mut s1,
        &format!("{L}.1.mlp.gate.e_score_correction_bias"),
        &[4],
    );
    for e in 0..4 {
        // moe_inter 67: odd width for down_proj (I = 67: g48 and g64 collide too).
        b.quant(
            &mut s1,
            &format!("{L}.1.mlp.experts.{e}.gate_proj.weight"),
            g64(67, 128),
        );
        b.quant(
            &mut s1,
            &format!("{L}.1.mlp.experts.{e}.up_proj.weight"),
            g64(67, 128),
        );
        b.quant(
            &mut s1,
            &format!("{L}.1.mlp.experts.{e}.down_proj.weight"),
            g64(128, 67),
        );
    }
    b.quant(
        &mut s1,
        &format!("{L}.1.mlp.shared_experts.gate_proj.weight"),
        QuantFormat::int4_row(67, 128),
    );
    b.quant(
        &mut s1,
        &format!("{L}.1.mlp.shared_experts.down_proj.weight"),
        QuantFormat::int4_row(128, 67),
    );
    b.quant(
        &mut s1,
        &format!("{L}.1.self_attn.indexer.wq_b.weight"),
        QuantFormat::int8_row(32, 32),
    );
    b.quant(
        &mut s1,
        &format!("{L}.1.self_attn.indexer.wk.weight"),
        QuantFormat::int8_row(16, 128),
    );
    b.quant(
        &mut s1,
        &format!("{L}.1.self_attn.indexer.weights_proj.weight"),
        QuantFormat::int8_row(2, 128),
    );
    b.f32(
        &mut s1,
        &format!("{L}.1.self_attn.indexer.k_norm.weight"),
        &[16],
    );
    b.f32(
        &mut s1,
        &format!("{L}.1.self_attn.indexer.k_norm.bias"),
        &[16],
    );
    b.f32(&mut s1, &format!("{L}.2.mlp.gate.weight"), &[4, 128]);
    write_shard(&d.join("out-00001.safetensors"), &s1, None);

    // An empty shard (download mode can produce one), then the MTP shard.
    write_shard(&d.join("out-00002.safetensors"), &[], None);
    let mut m = Vec::new();
    b.quant(
        &mut m,
        &format!("{L}.3.eh_proj.weight"),
        QuantFormat::int8_row(128, 256),
    );
    b.f32(&mut m, &format!("{L}.3.enorm.weight"), &[128]);
    b.f32(&mut m, &format!("{L}.3.hnorm.weight"), &[128]);
    b.f32(&mut m, &format!("{L}.3.shared_head.norm.weight"), &[128]);
    b.quant(
        &mut m,
        &format!("{L}.3.self_attn.o_proj.weight"),
        QuantFormat::int8_row(128, 32),
    );
    for e in 0..4 {
        b.quant(
            &mut m,
            &format!("{L}.3.mlp.experts.{e}.gate_proj.weight"),
            QuantFormat::int8_row(67, 128),
        );
        b.quant(
            &mut m,
            &format!("{L}.3.mlp.experts.{e}.up_proj.weight"),
            QuantFormat::int8_row(67, 128),
        );
        b.quant(
            &mut m,
            &format!("{L}.3.mlp.experts.{e}.down_proj.weight"),
            QuantFormat::int8_row(128, 67),
        );
    }
    write_shard(&d.join("out-mtp-00000.safetensors"), &m, None);

    // Files that must be ignored.
    std::fs::write(d.join("out-00003.safetensors.tmp"), b"garbage, not a shard").unwrap();
    std::fs::write(d.join("out-00004.safetensors.bak-int4"), b"").unwrap();
    std::fs::create_dir(d.join("_meta")).unwrap();
    (dir, b.expect)
}

#[test]
fn valid_container_catalog_families_formats() {
    let (dir, expect) = build_valid(true);
    let c = ColibriContainer::open(dir.path()).unwrap();
    assert_eq!(
        c.catalog().shards.len(),
        4,
        "three shards plus the empty one; .tmp ignored"
    );
    assert_eq!(
        c.catalog()
            .shards
            .iter()
            .filter(|s| s.tensor_count == 0)
            .count(),
        1
    );
    assert_eq!(c.config().rope_theta(), Some(8e6));
    assert_eq!(c.eos_token_ids(), vec![3, 7, 9]);
    assert_eq!(
        c.params().main.as_ref().and_then(|p| p.group_size),
        Some(64)
    );

    // Offsets: every entry is inside its file and the data really is there.
    for e in c.catalog().tensors.values() {
        let shard = &c.catalog().shards[e.shard];
        assert!(
            e.offset >= 8 + shard.header_len && e.offset + e.len <= shard.file_size,
            "{}",
            e.name
        );
    }
    // `.qs` are not logical weights.
    assert!(c.weights().all(|w| !w.name.ends_with(".qs")));
    assert!(matches!(
        c.weight("lm_head.weight.qs"),
        Err(ContainerError::MissingTensor { .. })
    ));

    let fam = |n: &str| c.weight(n).unwrap().family;
    assert_eq!(fam("model.embed_tokens.weight"), TensorFamily::Embedding);
    assert_eq!(fam("lm_head.weight"), TensorFamily::LmHead);
    assert_eq!(fam("model.norm.weight"), TensorFamily::Norm);
    assert_eq!(
        fam(&format!("{L}.0.self_attn.kv_b_proj.weight")),
        TensorFamily::Attention
    );
    assert_eq!(
        fam(&format!("{L}.0.mlp.down_proj.weight")),
        TensorFamily::DenseMlp
    );
    assert_eq!(fam(&format!("{L}.1.mlp.gate.weight")), TensorFamily::Router);
    assert_eq!(
        fam(&format!("{L}.1.mlp.gate.e_score_correction_bias")),
        TensorFamily::RouterBias
    );
    assert_eq!(
        fam(&format!("{L}.1.mlp.shared_experts.down_proj.weight")),
        TensorFamily::SharedExpert
    );
    assert_eq!(
        fam(&format!("{L}.1.self_attn.indexer.k_norm.bias")),
        TensorFamily::Indexer
    );
    assert_eq!(
        fam(&format!("{L}.1.mlp.experts.2.up_proj.weight")),
        TensorFamily::RoutedExpert {
            layer: 1,
            expert: 2,
            proj: ExpertProj::Up
        }
    );
    assert_eq!(fam(&format!("{L}.3.eh_proj.weight")), TensorFamily::Mtp);
    assert_eq!(
        fam(&format!("{L}.3.mlp.experts.1.down_proj.weight")),
        TensorFamily::Mtp
    );
    assert_eq!(
        routed_expert_coords(&format!("{L}.3.mlp.experts.1.down_proj.weight")),
        Some((3, 1, ExpertProj::Down))
    );

    // Formats, and the params tie-breaker on I = 96 and I = 67.
    let down = c.weight(&format!("{L}.0.mlp.down_proj.weight")).unwrap();
    match &down.format {
        WeightFormat::Quantized(r) => {
            assert_eq!(r.format, QuantFormat::int4_grouped(128, 96, 64));
            assert_eq!(r.source, FormatSource::ParamsGroupSize);
        }
        other => panic!("{other:?}"),
    }
    let ln = c
        .weight(&format!("{L}.0.post_attention_layernorm.weight"))
        .unwrap();
    assert_eq!(
        ln.format,
        WeightFormat::Float {
            dtype: Dtype::BF16,
            shape: vec![128]
        }
    );

    // Every quantized weight: resolved format as written, dequantize == reference.
    assert_eq!(
        c.weights().filter(|w| w.quant_format().is_some()).count(),
        expect.len()
    );
    for (name, want) in &expect {
        let info = c.weight(name).unwrap();
        assert_eq!(info.quant_format(), Some(&want.format), "{name}");
        let (values, shape) = c.dequantize(name).unwrap();
        assert_eq!(shape, [want.format.rows, want.format.cols]);
        assert_eq!(values.len(), want.values.len());
        assert!(
            values
                .iter()
                .zip(&want.values)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }

    // Expert lookup (regular and MTP layer).
    let [g, u, dn] = c.expert(1, 3).unwrap();
    assert_eq!(
        (g.format_label(), u.format_label(), dn.format_label()),
        ("int4-g64".into(), "int4-g64".into(), "int4-g64".into())
    );
    let [g, ..] = c.expert(3, 0).unwrap();
    assert_eq!(g.format_label(), "int8-row");
    assert!(matches!(
        c.expert(1, 4),
        Err(ContainerError::MissingTensor { .. })
    ));
    drop(dir);
}

#[test]
fn row_gather_and_float_reads() {
    let (dir, expect) = build_valid(true);
    let c = ColibriContainer::open(dir.path()).unwrap();
    for name in [
        "model.embed_tokens.weight",
        &format!("{L}.1.mlp.experts.0.down_proj.weight"),
        &format!("{L}.0.mlp.down_proj.weight"),
    ] {
        let want = &expect[name];
        let cols = want.format.cols;
        let rows = [3usize, 0, want.format.rows - 1, 3];
        let (got, shape) = c.dequantize_rows(name, &rows).unwrap();
        assert_eq!(shape, [4, cols]);
        for (k, &r) in rows.iter().enumerate() {
            let a = &got[k * cols..(k + 1) * cols];
            let b = &want.values[r * cols..(r + 1) * cols];
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} row {r}"
            );
        }
        let err = c.dequantize_rows(name, &[want.format.rows]).unwrap_err();
        assert!(matches!(err, ContainerError::RowOutOfRange { .. }), "{err}");
    }
    let (v, shape) = c
        .dequantize(&format!("{L}.0.post_attention_layernorm.weight"))
        .unwrap();
    assert_eq!(shape, [1, 128]);
    assert_eq!(v[5], 2.5);
    let (row, _) = c
        .dequantize_rows(&format!("{L}.1.mlp.gate.weight"), &[2])
        .unwrap();
    let (all, shape) = c.dequantize(&format!("{L}.1.mlp.gate.weight")).unwrap();
    assert_eq!(shape, [4, 128]);
    assert_eq!(row, all[256..384]);
    let raw = c.read_tensor_bytes("lm_head.weight.qs").unwrap();
    assert_eq!(raw.len(), 40 * 4);
    assert!(matches!(
        c.read_tensor_bytes("nope"),
        Err(ContainerError::MissingTensor { .. })
    ));
}

#[test]
fn without_params_the_first_group_candidate_wins() {
    // §3.3: with no params, I = 96 and I = 67 g64 tensors resolve as g48 (the
    // documented ambiguity); unambiguous tensors are unaffected.
    let (dir, _) = build_valid(false);
    let c = ColibriContainer::open(dir.path()).unwrap();
    let gs = |n: String| c.weight(&n).unwrap().quant_format().unwrap().group_size;
    assert_eq!(gs(format!("{L}.0.mlp.down_proj.weight")), Some(48));
    assert_eq!(
        gs(format!("{L}.1.mlp.experts.0.down_proj.weight")),
        Some(48)
    );
    assert_eq!(
        gs(format!("{L}.1.mlp.experts.0.gate_proj.weight")),
        Some(64)
    );
}

#[test]
fn params_from_progress_file() {
    let (dir, _) = build_valid(false);
    write_json(
        &dir.path().join(".out-progress.json"),
        &json!({"shards": {"a.safetensors": "out-00000.safetensors"}, "params": {"group_size": 64, "arch": "glm"}}),
    );
    let c = ColibriContainer::open(dir.path()).unwrap();
    let f = c
        .weight(&format!("{L}.0.mlp.down_proj.weight"))
        .unwrap()
        .quant_format()
        .copied();
    assert_eq!(f, Some(QuantFormat::int4_grouped(128, 96, 64)));
}

// ---------------------------------------------------------------- config

fn glm52_config() -> serde_json::Value {
    let types: Vec<&str> = (0..78)
        .map(|l| {
            if l < 3 || (l - 2) % 4 == 0 {
                "full"
            } else {
                "shared"
            }
        })
        .collect();
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": false, "eos_token_id": [154820, 154827, 154829],
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 6144, "index_head_dim": 128,
        "index_n_heads": 32, "index_share_for_mtp_iteration": true, "index_skip_topk_offset": 3,
        "index_topk": 2048, "index_topk_freq": 4, "indexer_rope_interleave": true, "indexer_types": types,
        "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 1048576,
        "model_type": "glm_moe_dsa", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 1, "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": false,
        "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 256, "vocab_size": 154880,
        "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    })
}

#[test]
fn glm52_config_shapes_and_schedules() {
    let cfg =
        Glm52Config::from_json_str(Path::new("config.json"), &glm52_config().to_string()).unwrap();
    let shape = |n: &str| cfg.logical_shape(n);
    assert_eq!(shape("model.embed_tokens.weight"), Some([154880, 6144]));
    assert_eq!(shape("lm_head.weight"), Some([154880, 6144]));
    assert_eq!(
        shape("model.layers.5.self_attn.q_a_proj.weight"),
        Some([2048, 6144])
    );
    assert_eq!(
        shape("model.layers.5.self_attn.q_b_proj.weight"),
        Some([16384, 2048])
    );
    assert_eq!(
        shape("model.layers.5.self_attn.kv_a_proj_with_mqa.weight"),
        Some([576, 6144])
    );
    assert_eq!(
        shape("model.layers.5.self_attn.kv_b_proj.weight"),
        Some([28672, 512])
    );
    assert_eq!(
        shape("model.layers.5.self_attn.o_proj.weight"),
        Some([6144, 16384])
    );
    assert_eq!(
        shape("model.layers.1.mlp.gate_proj.weight"),
        Some([12288, 6144])
    );
    assert_eq!(
        shape("model.layers.1.mlp.down_proj.weight"),
        Some([6144, 12288])
    );
    assert_eq!(
        shape("model.layers.9.mlp.shared_experts.up_proj.weight"),
        Some([2048, 6144])
    );
    assert_eq!(
        shape("model.layers.9.mlp.shared_experts.down_proj.weight"),
        Some([6144, 2048])
    );
    assert_eq!(
        shape("model.layers.9.mlp.experts.255.gate_proj.weight"),
        Some([2048, 6144])
    );
    assert_eq!(
        shape("model.layers.78.mlp.experts.0.down_proj.weight"),
        Some([6144, 2048])
    );
    assert_eq!(shape("model.layers.78.eh_proj.weight"), Some([6144, 12288]));
    assert_eq!(
        shape("model.layers.6.self_attn.indexer.wq_b.weight"),
        Some([4096, 2048])
    );
    assert_eq!(
        shape("model.layers.6.self_attn.indexer.wk.weight"),
        Some([128, 6144])
    );
    assert_eq!(
        shape("model.layers.6.self_attn.indexer.weights_proj.weight"),
        Some([32, 6144])
    );
    assert_eq!(shape("model.layers.6.mlp.gate.weight"), Some([256, 6144]));
    assert_eq!(shape("model.layers.6.input_layernorm.weight"), None);
    assert_eq!(shape("model.layers.x.mlp.gate_proj.weight"), None);

    assert!(
        !cfg.is_moe_layer(2) && cfg.is_moe_layer(3) && cfg.is_moe_layer(77) && cfg.is_moe_layer(78)
    );
    assert_eq!(cfg.mtp_layer_index(), Some(78));
    let full: Vec<usize> = (0..78).filter(|&l| cfg.layer_has_indexer(l)).collect();
    let want: Vec<usize> = [0, 1, 2].into_iter().chain((6..=74).step_by(4)).collect();
    assert_eq!(full, want);
    assert_eq!(full.len(), 21);
    assert!(!cfg.layer_has_indexer(78), "index_share_for_mtp_iteration");
    // Without indexer_types the freq/offset fallback gives the same schedule.
    let mut v = glm52_config();
    v.as_object_mut().unwrap().remove("indexer_types");
    let cfg2 = Glm52Config::from_json_str(Path::new("c.json"), &v.to_string()).unwrap();
    assert_eq!(
        (0..78)
            .filter(|&l| cfg2.layer_has_indexer(l))
            .collect::<Vec<_>>(),
        want
    );
    // GLM-5 (no IndexShare fields): every layer.
    v.as_object_mut().unwrap().remove("index_topk_freq");
    v.as_object_mut().unwrap().remove("index_skip_topk_offset");
    let cfg3 = Glm52Config::from_json_str(Path::new("c.json"), &v.to_string()).unwrap();
    assert!((0..78).all(|l| cfg3.layer_has_indexer(l)));
    assert_eq!(cfg.eos_token_ids(), vec![154820, 154827, 154829]);
}

// ---------------------------------------------------------------- bad inputs

/// A valid minimal container with config.json and the given extra files.
fn minimal_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &tiny_config());
    dir
}

fn open_err(dir: &Path) -> ContainerError {
    ColibriContainer::open(dir).expect_err("open should fail")
}

fn contains_all(err: &ContainerError, parts: &[&str]) {
    let msg = err.to_string();
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} should contain {p:?}");
    }
}

fn shard_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

#[test]
fn truncated_file() {
    let dir = minimal_dir();
    std::fs::write(shard_path(dir.path(), "out-00000.safetensors"), [1u8, 2, 3]).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(err, ContainerError::TruncatedFile { file_size: 3, .. }),
        "{err}"
    );
    contains_all(&err, &["out-00000.safetensors", "truncated"]);
}

#[test]
fn header_length_larger_than_file() {
    let dir = minimal_dir();
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(shard_path(dir.path(), "out-00000.safetensors"), bytes).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            ContainerError::HeaderTooLarge {
                header_len: 1000,
                file_size: 10,
                ..
            }
        ),
        "{err}"
    );
    contains_all(&err, &["out-00000.safetensors", "1000"]);
    // u64::MAX must not overflow anything.
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(shard_path(dir.path(), "out-00000.safetensors"), bytes).unwrap();
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::HeaderTooLarge { .. }
    ));
}

#[test]
fn invalid_header_json() {
    let dir = minimal_dir();
    let p = shard_path(dir.path(), "out-00000.safetensors");
    for header in [
        "{\"a\": {\"dtype\": \"F32\", ",
        "[1, 2]",
        "{\"a\": {\"dtype\": \"F99\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
        "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
        "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 0]}}",
        "{\"__metadata__\": {\"k\": 5}}",
        "{\"__metadata__\": {\"colibri.fmt\": \"not json\"}}",
    ] {
        write_raw(&p, header, &[0u8; 8]);
        let err = open_err(dir.path());
        assert!(
            matches!(err, ContainerError::InvalidHeader { .. }),
            "{header}: {err}"
        );
        contains_all(&err, &["out-00000.safetensors"]);
    }
    std::fs::write(&p, [2u8, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFE]).unwrap();
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::InvalidHeader { .. }
    ));
}

#[test]
fn overlapping_offsets() {
    let dir = minimal_dir();
    let header = r#"{"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"model.layers.0.input_layernorm.weight":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#;
    write_raw(
        &shard_path(dir.path(), "out-00000.safetensors"),
        header,
        &[0u8; 24],
    );
    let err = open_err(dir.path());
    assert!(matches!(err, ContainerError::Overlap { .. }), "{err}");
    contains_all(
        &err,
        &[
            "out-00000.safetensors",
            "model.norm.weight",
            "input_layernorm",
            "0..16",
            "8..24",
        ],
    );
}

#[test]
fn out_of_bounds_offsets() {
    let dir = minimal_dir();
    let header = r#"{"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    write_raw(
        &shard_path(dir.path(), "out-00000.safetensors"),
        header,
        &[0u8; 12],
    );
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            ContainerError::OutOfBounds {
                begin: 0,
                end: 16,
                data_len: 12,
                ..
            }
        ),
        "{err}"
    );
    contains_all(
        &err,
        &["out-00000.safetensors", "model.norm.weight", "0..16", "12"],
    );
}

/// One-weight shard: `lm_head.weight` U8 with `nb` bytes and a `.qs` of `qs_dtype`
/// with `ns` bytes.
fn one_weight(dir: &Path, nb: usize, ns: usize, qs_dtype: Dtype) {
    let elem = qs_dtype.bitsize() / 8;
    let tensors = [
        T {
            name: "lm_head.weight".into(),
            dtype: Dtype::U8,
            shape: vec![nb],
            data: vec![0x88; nb],
        },
        T {
            name: "lm_head.weight.qs".into(),
            dtype: qs_dtype,
            shape: vec![ns / elem],
            data: vec![0; ns],
        },
    ];
    write_shard(&dir.join("out-00000.safetensors"), &tensors, None);
}

#[test]
fn scales_of_wrong_size() {
    let dir = minimal_dir();
    one_weight(dir.path(), 40 * 128, 41 * 4, Dtype::F32);
    let err = open_err(dir.path());
    assert!(
        matches!(
            &err,
            ContainerError::Format {
                source: FormatError::ScaleCount {
                    format: "int8-row",
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
    contains_all(
        &err,
        &["out-00000.safetensors", "lm_head.weight", "164", "160"],
    );
}

#[test]
fn scales_of_wrong_dtype() {
    let dir = minimal_dir();
    one_weight(dir.path(), 40 * 128, 80 * 2, Dtype::F16);
    let err = open_err(dir.path());
    assert!(
        matches!(
            err,
            ContainerError::ScalesDtype {
                dtype: Dtype::F16,
                ..
            }
        ),
        "{err}"
    );
    contains_all(&err, &["out-00000.safetensors", "lm_head.weight", "F16"]);
}

#[test]
fn weight_bytes_matching_no_format() {
    let dir = minimal_dir();
    one_weight(dir.path(), 1000, 160, Dtype::F32);
    let err = open_err(dir.path());
    assert!(
        matches!(
            &err,
            ContainerError::Format {
                source: FormatError::NoMatch {
                    weight_bytes: 1000,
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
    contains_all(
        &err,
        &[
            "out-00000.safetensors",
            "lm_head.weight",
            "1000",
            "[40, 128]",
        ],
    );
}

#[test]
fn stamped_unsupported_format() {
    let dir = minimal_dir();
    let tensors = [
        T {
            name: "lm_head.weight".into(),
            dtype: Dtype::U8,
            shape: vec![40 * 128],
            data: vec![0; 40 * 128],
        },
        T {
            name: "lm_head.weight.qs".into(),
            dtype: Dtype::F32,
            shape: vec![40],
            data: vec![0; 160],
        },
    ];
    let meta = HashMap::from([(
        "colibri.fmt".to_owned(),
        r#"{"lm_head.weight":"fp8-e4m3-b128"}"#.to_owned(),
    )]);
    write_shard(
        &dir.path().join("out-00000.safetensors"),
        &tensors,
        Some(meta),
    );
    let err = open_err(dir.path());
    assert!(
        matches!(
            &err,
            ContainerError::Format {
                source: FormatError::Unsupported {
                    format: UnsupportedFormat::Fp8B128,
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
    contains_all(
        &err,
        &["unsupported format fp8-e4m3-b128", "lm_head.weight"],
    );
}

#[test]
fn missing_and_orphan_scales_and_bad_dtypes() {
    let dir = minimal_dir();
    let p = dir.path().join("out-00000.safetensors");
    write_shard(
        &p,
        &[T {
            name: "lm_head.weight".into(),
            dtype: Dtype::U8,
            shape: vec![4],
            data: vec![0; 4],
        }],
        None,
    );
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::MissingScales { .. }
    ));
    write_shard(
        &p,
        &[T {
            name: "lm_head.weight.qs".into(),
            dtype: Dtype::F32,
            shape: vec![1],
            data: vec![0; 4],
        }],
        None,
    );
    let err = open_err(dir.path());
    assert!(matches!(err, ContainerError::OrphanScales { .. }), "{err}");
    write_shard(
        &p,
        &[T {
            name: "x".into(),
            dtype: Dtype::I64,
            shape: vec![1],
            data: vec![0; 8],
        }],
        None,
    );
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::UnsupportedDtype { .. }
    ));
    // A quantized tensor whose name gives no logical shape.
    write_shard(
        &p,
        &[
            T {
                name: "mystery.weight".into(),
                dtype: Dtype::U8,
                shape: vec![4],
                data: vec![0; 4],
            },
            T {
                name: "mystery.weight.qs".into(),
                dtype: Dtype::F32,
                shape: vec![1],
                data: vec![0; 4],
            },
        ],
        None,
    );
    let err = open_err(dir.path());
    assert!(matches!(err, ContainerError::UnknownShape { .. }), "{err}");
    contains_all(&err, &["mystery.weight"]);
    // A float whose byte length disagrees with its shape (gaps are fine, sizes are not).
    write_raw(
        &p,
        r#"{"model.norm.weight":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#,
        &[0u8; 16],
    );
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::SizeMismatch {
            len: 16,
            expected: 12,
            ..
        }
    ));
}

#[test]
fn missing_config_field_and_files() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::MissingFile { .. }
    ));
    let mut cfg = tiny_config();
    cfg.as_object_mut().unwrap().remove("kv_lora_rank");
    write_json(&dir.path().join("config.json"), &cfg);
    let err = open_err(dir.path());
    assert!(
        matches!(&err, ContainerError::MissingConfigField { field, .. } if field == "kv_lora_rank"),
        "{err}"
    );
    contains_all(&err, &["config.json", "kv_lora_rank"]);
    let mut cfg = tiny_config();
    cfg.as_object_mut().unwrap().remove("rope_parameters");
    write_json(&dir.path().join("config.json"), &cfg);
    let err = open_err(dir.path());
    assert!(
        matches!(&err, ContainerError::MissingConfigField { field, .. } if field.contains("rope_theta"))
    );
    write_json(&dir.path().join("config.json"), &tiny_config());
    assert!(matches!(
        open_err(dir.path()),
        ContainerError::NoShards { .. }
    ));
}

#[test]
fn tensor_in_two_shards() {
    let dir = minimal_dir();
    let t = || {
        [T {
            name: "model.norm.weight".into(),
            dtype: Dtype::F32,
            shape: vec![2],
            data: vec![0; 8],
        }]
    };
    write_shard(&dir.path().join("out-00000.safetensors"), &t(), None);
    write_shard(&dir.path().join("out-mtp-00000.safetensors"), &t(), None);
    let err = open_err(dir.path());
    assert!(
        matches!(err, ContainerError::DuplicateTensor { .. }),
        "{err}"
    );
    contains_all(
        &err,
        &[
            "model.norm.weight",
            "out-00000.safetensors",
            "out-mtp-00000.safetensors",
        ],
    );
}

#[test]
fn zero_tensor_shard_and_tmp_files() {
    let dir = minimal_dir();
    write_shard(&dir.path().join("out-00000.safetensors"), &[], None);
    std::fs::write(dir.path().join("out-00001.safetensors.tmp"), [0xFFu8; 3]).unwrap();
    let c = ColibriContainer::open(dir.path()).unwrap();
    assert_eq!(c.catalog().shards.len(), 1);
    assert_eq!(c.weight_count(), 0);
}

#[test]
fn file_truncated_after_open_reports_range() {
    let (dir, _) = build_valid(true);
    let c = ColibriContainer::open(dir.path()).unwrap();
    let entry = c.tensor("lm_head.weight").unwrap().clone();
    let path = c.catalog().shards[entry.shard].path.clone();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(entry.offset + 10).unwrap();
    let err = c.dequantize("lm_head.weight").unwrap_err();
    assert!(matches!(err, ContainerError::ReadRange { .. }), "{err}");
    contains_all(
        &err,
        &[
            path.file_name().unwrap().to_str().unwrap(),
            &entry.offset.to_string(),
        ],
    );
}
