#!/usr/bin/env python3
"""Reference logits from mlx-lm's `glm_moe_dsa` on a Colibri container.

usage: mlx_lm_logits.py MODEL_DIR --ids 1,2,3 [--steps G] --out LOGITS.npy

The container is dequantized to float32 by the independent numpy decoder
(`colibri_decode.py`), loaded into `mlx_lm.models.glm_moe_dsa.Model` on the CPU
in float32, and run as the crate's decode runs: one prefill pass over the P
prompt ids with a KV cache, then G greedy steps. LOGITS.npy holds
[P + G - 1, vocab] float32: row i < P is the logits after prompt position i,
row P - 1 + j after feeding generated token j (the last one is not fed). The
greedy tokens are printed as JSON on stdout.

As a check of the harness itself, the same ids are also run through the model
in one pass without a cache; both must agree (max |d| <= 1e-4 * max |ref|).
"""
import argparse
import json
import os
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import glm_moe_dsa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from colibri_decode import decode_container  # noqa: E402


def load_model(model_dir):
    cfg, tensors = decode_container(model_dir)
    args = glm_moe_dsa.ModelArgs.from_dict(cfg)
    model = glm_moe_dsa.Model(args)
    n = cfg["num_hidden_layers"]
    # mlx-lm's model has no MTP layer: drop layer >= n like its sanitize does.
    weights = {k: mx.array(v) for k, v in tensors.items()
               if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return cfg, model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--ids", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    mx.set_default_device(mx.cpu)
    cfg, model = load_model(a.model_dir)
    ids = [int(t) for t in a.ids.split(",")]
    assert ids and all(0 <= t < cfg["vocab_size"] for t in ids), "bad prompt ids"

    cache = mlx_cache.make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0]
    rows = [logits]
    generated = []
    for step in range(a.steps):
        nxt = int(mx.argmax(rows[-1][-1]).item())
        generated.append(nxt)
        if step + 1 < a.steps:
            rows.append(model(mx.array([[nxt]]), cache=cache)[0])
    out = np.array(mx.concatenate(rows, axis=0), dtype=np.float32)
    assert out.shape == (len(ids) + a.steps - 1, cfg["vocab_size"]), out.shape

    full = np.array(model(mx.array([ids + generated[:-1]]))[0], dtype=np.float32)
    err = np.abs(full - out).max() / max(np.abs(full).max(), 1e-30)
    assert err <= 1e-4, f"cached and uncached runs differ: {err}"
    np.save(a.out, out)
    print(json.dumps({"tokens": generated, "cache_vs_full_rel": float(err)}))


if __name__ == "__main__":
    main()
