#!/usr/bin/env python3
"""Checks that a tiny checkpoint written by `glm_stream::tiny` loads in mlx-lm.

usage: check_tiny_loads.py HF_DIR

* builds `mlx_lm.models.glm_moe_dsa.Model` from config.json, loads every shard with
  `mx.load`, runs `sanitize` and `load_weights(strict=True)` (every parameter the
  model declares must be present with the right shape, and nothing extra);
* runs a forward pass long enough (> index_topk) to take the sparse indexer path and
  checks the logits are finite;
* loads tokenizer.json with `tokenizers` and round-trips text and special tokens;
* loads the tokenizer with transformers and renders the chat template.
Exits non-zero (with a message) on any failure.
"""
import glob
import json
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import glm_moe_dsa


def main(path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "glm_moe_dsa"
    assert "quantization_config" not in config
    args = glm_moe_dsa.ModelArgs.from_dict(config)
    model = glm_moe_dsa.Model(args)

    weights = {}
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(mx.load(shard))
    n = config["num_hidden_layers"]
    mtp = [k for k in weights if k.startswith(f"model.layers.{n}.")]
    for suffix in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                   "shared_head.norm.weight", "self_attn.indexer.wq_b.weight",
                   "self_attn.indexer.k_norm.bias", "mlp.gate.weight"):
        assert any(k.endswith(suffix) for k in mtp), f"MTP layer lacks {suffix}"
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    # load_weights checks names and shapes; also check no parameter stayed at init.
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(weights), set(params) ^ set(weights)
    # mlx's CPU GatherMM (the routed experts) only runs float32: upcast for the
    # forward pass (the load above already checked the stored dtypes load).
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())

    seq = args.index_topk + 5
    tokens = mx.array([[(7 * i + 3) % config["vocab_size"] for i in range(seq)]])
    logits = model(tokens)
    mx.eval(logits)
    assert logits.shape == (1, seq, config["vocab_size"]), logits.shape
    assert bool(mx.all(mx.isfinite(logits.astype(mx.float32)))), "non-finite logits"

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    text = "Hello, the world! héllo 你好"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text, tok.decode(enc.ids)
    assert max(enc.ids) < config["vocab_size"]
    assert tok.get_vocab_size() <= config["vocab_size"]
    for special in ("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"):
        ids = tok.encode(special).ids
        assert len(ids) == 1 and ids[0] == tok.token_to_id(special), (special, ids)
    eos = config["eos_token_id"]
    assert tok.id_to_token(eos[0]) == "<|endoftext|>"
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == eos

    import logging
    logging.disable(logging.WARNING)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(path)
    prompt = hf.apply_chat_template([{"role": "user", "content": "hi"}],
                                    tokenize=False, add_generation_prompt=True)
    assert prompt == "[gMASK]<sop><|user|>\nhi<|assistant|>\n", repr(prompt)
    ids = hf.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")], ids
    print(f"ok: {path}: {len(weights)} tensors after sanitize, logits {logits.shape}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
