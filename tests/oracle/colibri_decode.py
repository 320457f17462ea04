#!/usr/bin/env python3
"""An independent numpy decoder of Colibri containers, written from the spec
(docs/colibri-format.md §3.2-§3.3), for cross-checking the Rust reader and for
feeding mlx-lm the same float32 weights the crate uses.

usage: colibri_decode.py MODEL_DIR OUT.safetensors
  writes every logical weight, dequantized to float32 ([O, I] for quantized
  weights, the stored shape otherwise), with safetensors.numpy.save_file.
"""
import glob
import json
import os
import struct
import sys

import numpy as np


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def logical_shape(name, cfg):
    """[O, I] of a quantized weight from config.json (the U8 shape is ignored)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    moe, dense = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    shared = moe * (cfg.get("n_shared_experts") or 1)
    ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    table = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h)),
        ("lm_head.weight", (cfg["vocab_size"], h)),
        ("self_attn.q_a_proj.weight", (q_lora, h)),
        ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora)),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
        ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
        ("self_attn.o_proj.weight", (h, heads * v)),
        ("self_attn.indexer.wq_b.weight", (ih * ihd, q_lora)),
        ("self_attn.indexer.wk.weight", (ihd, h)),
        ("self_attn.indexer.weights_proj.weight", (ih, h)),
        ("mlp.shared_experts.gate_proj.weight", (shared, h)),
        ("mlp.shared_experts.up_proj.weight", (shared, h)),
        ("mlp.shared_experts.down_proj.weight", (h, shared)),
        ("eh_proj.weight", (h, 2 * h)),
    ]
    for suffix, shape in table:
        if name.endswith(suffix):
            return shape
    if ".mlp.experts." in name:
        return (h, moe) if name.endswith("down_proj.weight") else (moe, h)
    if name.endswith("mlp.down_proj.weight"):
        return (h, dense)
    if name.endswith("mlp.gate_proj.weight") or name.endswith("mlp.up_proj.weight"):
        return (dense, h)
    raise ValueError(f"{name}: no logical shape")


def group_size_hints(model_dir):
    """Group sizes recorded by the converter, per pass (main, mtp, idx)."""
    hints = {}
    for tag, stem in (("main", ".out"), ("mtp", ".out-mtp"), ("idx", ".out-idx")):
        for path, key in ((f"{stem}-params.json", None), (f"{stem}-progress.json", "params")):
            p = os.path.join(model_dir, path)
            if os.path.exists(p):
                with open(p) as f:
                    d = json.load(f)
                d = d[key] if key else d
                hints[tag] = d.get("group_size")
                break
    return hints


def decode(name, w, s, rows, cols, gs_hint):
    nb, ns = len(w), len(s)
    if nb == rows * cols:  # int8 per row: two's complement bytes times the row scale
        assert ns == rows, f"{name}: int8 needs one scale per row"
        q = w.view(np.int8).reshape(rows, cols).astype(np.float32)
        return q * s[:, None]
    rb = (cols + 1) // 2
    assert nb == rows * rb, f"{name}: {nb} bytes fit no format"
    b = w.reshape(rows, rb)
    nib = np.empty((rows, rb * 2), dtype=np.int32)
    nib[:, 0::2] = b & 0x0F  # low nibble = even column
    nib[:, 1::2] = b >> 4
    q = (nib[:, :cols] - 8).astype(np.float32)
    if ns == rows:
        return q * s[:, None]
    candidates = [g for g in (16, 32, 48, 64, 96, 128, 192, 256) if g <= cols]
    fits = [g for g in candidates if ns == rows * -(-cols // g)]
    gs = gs_hint if gs_hint in fits else fits[0]
    ng = -(-cols // gs)
    scale = np.repeat(s.reshape(rows, ng), gs, axis=1)[:, :cols]
    return q * scale


def decode_container(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hints = group_size_hints(model_dir)
    n_layers = cfg["num_hidden_layers"]
    raw = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        base, header = read_header(path)
        with open(path, "rb") as f:
            data = f.read()
        for name, t in header.items():
            lo, hi = t["data_offsets"]
            raw[name] = (t["dtype"], t["shape"], data[base + lo: base + hi], os.path.basename(path))
    out = {}
    for name, (dtype, shape, blob, fname) in raw.items():
        if name.endswith(".qs"):
            continue
        if name + ".qs" in raw:
            rows, cols = logical_shape(name, cfg)
            s = np.frombuffer(raw[name + ".qs"][2], dtype="<f4")
            w = np.frombuffer(blob, dtype=np.uint8)
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            tag = "idx" if ".indexer." in name and int(layer) < n_layers else (
                "mtp" if layer is not None and int(layer) >= n_layers else "main")
            out[name] = decode(name, w, s, rows, cols, hints.get(tag))
        else:
            assert dtype == "F32", f"{name}: unquantized tensors are F32 in the container"
            out[name] = np.frombuffer(blob, dtype="<f4").reshape(shape)
    return cfg, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def main(model_dir, out_path):
    from safetensors.numpy import save_file
    _, tensors = decode_container(model_dir)
    save_file(tensors, out_path)
    print(f"decoded {len(tensors)} tensors from {model_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
