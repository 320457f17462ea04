//! Generator → converter → reader round trip.
//!
//! Error bound: the quantizer picks `q = round_ties_even(fl(w / s))` with
//! `|q| ≤ qmax`, so `|w/s − q| ≤ ½` before rounding of the division; the f32
//! division and the reader's `fl(q · s)` each add at most one rounding of a
//! value ≤ qmax·s in magnitude. Hence
//! `|w − ŵ| ≤ s·(½ + 2·qmax·2⁻²⁴)`; the test allows `s·(½ + 4·qmax·2⁻²⁴)`.
//! Unquantized tensors (norms, router, bias) must come back bit for bit.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use glm_stream::container::{ColibriContainer, TensorFamily, WeightFormat};
use glm_stream::convert::writer::{TensorSpec, write_shard};
use glm_stream::convert::{Bits, ConvertOptions, convert_checkpoint};
use glm_stream::quant::QuantFormat;
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint};
use safetensors::{Dtype, SafeTensors};

/// Every F32 tensor of an HF checkpoint directory.
fn read_f32_checkpoint(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = HashMap::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            assert_eq!(
                view.dtype(),
                Dtype::F32,
                "{name}: the generator was asked for F32"
            );
            let vals = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            out.insert(name, (view.shape().to_vec(), vals));
        }
    }
    out
}

fn scale_of(f: &QuantFormat, scales: &[f32], o: usize, i: usize) -> f32 {
    match f.group_size {
        None => scales[o],
        Some(gs) => scales[o * f.cols.div_ceil(gs as usize) + i / gs as usize],
    }
}

fn opts(group_size: usize) -> ConvertOptions {
    ConvertOptions {
        group_size,
        progress: false,
        ..ConvertOptions::default()
    }
}

/// Checks each weight of `container` against the source and returns how many
/// quantized tensors were checked.
fn check_against_source(
    container: &ColibriContainer,
    source: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) -> usize {
    let mut quantized = 0;
    for info in container.weights() {
        let (_, src) = source
            .get(&info.name)
            .unwrap_or_else(|| panic!("{} is not in the source", info.name));
        let (got, [rows, cols]) = container.dequantize(&info.name).unwrap();
        assert_eq!(got.len(), src.len(), "{}", info.name);
        match &info.format {
            WeightFormat::Float { .. } => {
                assert!(
                    got.iter().zip(src).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} must be copied exactly",
                    info.name
                );
            }
            WeightFormat::Quantized(r) => {
                quantized += 1;
                let f = &r.format;
                let qmax = if f.bits == 8 { 127.0 } else { 7.0 };
                let scales = container.read_scales(info).unwrap();
                for o in 0..rows {
                    for i in 0..cols {
                        let s = scale_of(f, &scales, o, i) as f64;
                        let bound = s * (0.5 + 4.0 * qmax * 2f64.powi(-24));
                        let d = (got[o * cols + i] as f64 - src[o * cols + i] as f64).abs();
                        assert!(
                            d <= bound,
                            "{} [{o},{i}]: |Δ| {d:e} > {bound:e} ({})",
                            info.name,
                            f.name()
                        );
                    }
                }
            }
        }
    }
    quantized
}

/// Writes the container's dequantized weights as an F32 HF checkpoint.
fn write_dequantized_checkpoint(container: &ColibriContainer, hf_dir: &Path, out: &Path) {
    fs::create_dir_all(out).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if hf_dir.join(f).exists() {
            fs::copy(hf_dir.join(f), out.join(f)).unwrap();
        }
    }
    let mut tensors = Vec::new();
    for info in container.weights() {
        let (vals, [rows, cols]) = container.dequantize(&info.name).unwrap();
        let shape = match &info.format {
            WeightFormat::Float { shape, .. } => shape.iter().map(|&d| d as usize).collect(),
            WeightFormat::Quantized(_) => vec![rows, cols],
        };
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((TensorSpec::new(&info.name, Dtype::F32, shape), bytes));
    }
    write_shard(&out.join("model-00001-of-00001.safetensors"), tensors).unwrap();
}

/// Wide enough that int4 g64 tensors hold several groups per row (at the
/// default tiny widths one group covers a whole row).
fn wide_spec() -> TinyModelSpec {
    TinyModelSpec {
        hidden_size: 192,
        moe_intermediate_size: 128,
        intermediate_size: 320,
        q_lora_rank: 96,
        kv_lora_rank: 64,
        edge_rows: true,
        ..TinyModelSpec::default()
    }
}

fn round_trip(group_size: usize, seed: u64) {
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    let spec = wide_spec();
    generate_hf_checkpoint(&hf, &spec, seed, SourceDtype::F32).unwrap();
    let first = work.path().join("colibri");
    convert_checkpoint(&hf, &first, &opts(group_size)).unwrap();
    let container = ColibriContainer::open(&first).unwrap();
    let source = read_f32_checkpoint(&hf);

    // Every source tensor is in the container: the MTP layer and every DSA
    // indexer, the MTP layer's own indexer too.
    let mut names: Vec<&String> = source.keys().collect();
    names.sort();
    for name in names {
        assert!(
            container.weight(name).is_ok(),
            "{name} is missing from the container"
        );
    }
    let cfg = container.config();
    let mtp = cfg
        .mtp_layer_index()
        .expect("the tiny model has an MTP layer");
    for layer in 0..=mtp {
        let has = container
            .weight(&format!("model.layers.{layer}.self_attn.indexer.wk.weight"))
            .is_ok();
        assert_eq!(
            has,
            cfg.layer_has_indexer(layer) || layer == mtp,
            "indexer of layer {layer}"
        );
    }
    let experts = container
        .weights()
        .filter(|w| matches!(w.family, TensorFamily::RoutedExpert { .. }))
        .count();
    assert_eq!(
        experts,
        3 * spec.n_routed_experts * (spec.num_hidden_layers - spec.first_k_dense_replace)
    );

    let checked = check_against_source(&container, &source);
    assert!(checked > 50, "only {checked} quantized tensors");
    let grouped = container
        .weights()
        .filter(|w| matches!(&w.format, WeightFormat::Quantized(r) if r.format.group_size.is_some_and(|g| (g as usize) < r.format.cols)))
        .count();
    assert_eq!(
        grouped > 0,
        group_size > 0,
        "{grouped} tensors with several groups per row"
    );

    // Converting the dequantized weights again gives the same codes; scales
    // come back exact or within one ulp (fl(fl(qmax·s)/qmax) may differ from s).
    let second_hf = work.path().join("hf-dequantized");
    write_dequantized_checkpoint(&container, &hf, &second_hf);
    let second = work.path().join("colibri-2");
    convert_checkpoint(&second_hf, &second, &opts(group_size)).unwrap();
    let again = ColibriContainer::open(&second).unwrap();
    for info in container.weights() {
        let other = again.weight(&info.name).unwrap();
        assert_eq!(
            container.read_entry(&info.entry).unwrap(),
            again.read_entry(&other.entry).unwrap(),
            "{} codes",
            info.name
        );
        if info.scales.is_some() {
            let (a, b) = (
                container.read_scales(info).unwrap(),
                again.read_scales(other).unwrap(),
            );
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x.to_bits() as i64 - y.to_bits() as i64).abs() <= 1,
                    "{} scale {x} vs {y}",
                    info.name
                );
            }
        }
    }
}

#[test]
fn round_trip_int4_g64_with_int8_io_and_mtp() {
    round_trip(64, 11);
}

#[test]
fn round_trip_int4_per_row() {
    round_trip(0, 12);
}

#[test]
fn round_trip_all_int8() {
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    generate_hf_checkpoint(&hf, &TinyModelSpec::default(), 13, SourceDtype::F32).unwrap();
    let out = work.path().join("colibri");
    let o = ConvertOptions {
        ebits: Bits::Eight,
        ..opts(64)
    };
    convert_checkpoint(&hf, &out, &o).unwrap();
    let container = ColibriContainer::open(&out).unwrap();
    for info in container.weights() {
        if let WeightFormat::Quantized(r) = &info.format {
            assert_eq!(r.format.bits, 8, "{}", info.name);
        }
    }
    assert!(check_against_source(&container, &read_f32_checkpoint(&hf)) > 50);
}
