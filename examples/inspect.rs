//! Inspect a Colibri container.
//!
//! ```text
//! cargo run --release --example inspect -- --model DIR
//! cargo run --release --example inspect -- --model DIR --dequantize NAME --out FILE.npy
//! ```
//!
//! The first form prints a summary (shards, families, formats, experts per layer,
//! config highlights). The second writes one logical `[O, I]` tensor as a float32
//! C-order `.npy` file. Errors go to stderr with exit code 1.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use glm_stream::container::{ColibriContainer, routed_expert_coords};

const USAGE: &str = "usage: inspect --model DIR [--dequantize NAME --out FILE.npy]";

struct Args {
    model: PathBuf,
    dequantize: Option<String>,
    out: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut model = None;
    let mut dequantize = None;
    let mut out = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--model" => model = Some(PathBuf::from(value("--model")?)),
            "--dequantize" => dequantize = Some(value("--dequantize")?),
            "--out" => out = Some(PathBuf::from(value("--out")?)),
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let model = model.ok_or_else(|| format!("--model is required\n{USAGE}"))?;
    if dequantize.is_some() != out.is_some() {
        return Err(format!("--dequantize and --out go together\n{USAGE}"));
    }
    Ok(Args {
        model,
        dequantize,
        out,
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let container = ColibriContainer::open(&args.model).map_err(|e| e.to_string())?;
    match (&args.dequantize, &args.out) {
        (Some(name), Some(out)) => {
            let (values, shape) = container.dequantize(name).map_err(|e| e.to_string())?;
            write_npy(out, &values, shape).map_err(|e| format!("{}: {e}", out.display()))?;
            println!(
                "wrote {name} [{}, {}] float32 to {}",
                shape[0],
                shape[1],
                out.display()
            );
            Ok(())
        }
        _ => {
            summary(&container);
            Ok(())
        }
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.3} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn summary(c: &ColibriContainer) {
    let cat = c.catalog();
    let shard_bytes: u64 = cat.shards.iter().map(|s| s.file_size).sum();
    let empty = cat.shards.iter().filter(|s| s.tensor_count == 0).count();
    println!("container {}", c.dir().display());
    println!(
        "shards: {} ({} bytes, {}; {} with no tensors); stored tensors: {}; logical weights: {}",
        cat.shards.len(),
        shard_bytes,
        gib(shard_bytes),
        empty,
        cat.tensors.len(),
        c.weight_count()
    );

    let cfg = c.config();
    println!(
        "config: {} hidden {} layers {} (+{} MTP) vocab {} heads {} q_lora {} kv_lora {} \
         qk {}+{} v {} experts {}x{} top-{} shared {} dense-first {} rope_theta {:?}",
        cfg.model_type,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_nextn_predict_layers,
        cfg.vocab_size,
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.n_routed_experts.unwrap_or(0),
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
        cfg.n_shared_experts.unwrap_or(0),
        cfg.first_k_dense_replace,
        cfg.rope_theta(),
    );
    let indexed: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.layer_has_indexer(l))
        .collect();
    println!("indexer layers ({}): {:?}", indexed.len(), indexed);
    println!("eos ids: {:?}", c.eos_token_ids());
    for (label, p) in [
        ("main", &c.params().main),
        ("mtp", &c.params().mtp),
        ("idx", &c.params().indexer),
    ] {
        if let Some(p) = p {
            println!(
                "params[{label}] from {}: group_size {:?}",
                p.source.display(),
                p.group_size
            );
        }
    }

    let mut families: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    let mut formats: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut experts: BTreeMap<usize, (usize, u64, BTreeMap<String, usize>)> = BTreeMap::new();
    for w in c.weights() {
        let bytes = w.stored_bytes();
        let f = families.entry(w.family.label()).or_default();
        f.0 += 1;
        f.1 += bytes;
        let label = w.format_label();
        let f = formats.entry(label.clone()).or_default();
        f.0 += 1;
        f.1 += bytes;
        if let Some((layer, expert, _)) = routed_expert_coords(&w.name) {
            let e = experts.entry(layer).or_default();
            e.0 = e.0.max(expert + 1);
            e.1 += bytes;
            *e.2.entry(label).or_default() += 1;
        }
    }
    println!("families:");
    for (name, (n, bytes)) in &families {
        println!(
            "  {name:<14} {n:>8} tensors {bytes:>16} bytes ({})",
            gib(*bytes)
        );
    }
    println!("formats:");
    for (name, (n, bytes)) in &formats {
        println!(
            "  {name:<14} {n:>8} tensors {bytes:>16} bytes ({})",
            gib(*bytes)
        );
    }
    println!("routed experts per layer (ids seen, bytes, formats of the projections):");
    for (layer, (n, bytes, fmts)) in &experts {
        let per = if *n > 0 { bytes / *n as u64 } else { 0 };
        println!("  layer {layer:>3}: {n:>4} experts, {bytes} bytes ({per} per expert), {fmts:?}");
    }
}

/// Writes a float32, C-order `.npy` (format version 1.0) of shape `[rows, cols]`.
fn write_npy(path: &Path, values: &[f32], shape: [usize; 2]) -> std::io::Result<()> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
        shape[0], shape[1]
    );
    // Magic (6) + version (2) + length (2) + header, padded with spaces and a
    // final newline to a multiple of 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let len = u16::try_from(header.len()).map_err(std::io::Error::other)?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for v in values {
        out.write_all(&v.to_le_bytes())?;
    }
    out.flush()
}
