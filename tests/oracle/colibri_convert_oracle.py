#!/usr/bin/env python3
"""Independent numpy implementation of the Colibri converter rules
(docs/colibri-format.md §1.1, §2, §3.2, §4), used as a byte-exact oracle for the Rust
converter. Writes only the weight shards (no bookkeeping files).

usage: colibri_convert_oracle.py --input HF_DIR --output OUT_DIR
       [--group-size 64] [--io-bits 8] [--ebits 4] [--mtp-bits 8]

Source shards are parsed by hand (numpy has no float8 type): BF16 via the upper half
of a float32, F16/F32 natively, F8_E4M3 through a 256-entry table built from the
format definition, times `<name>_scale_inv` broadcast over 128x128 blocks.
Output is written with `safetensors.numpy.save_file` (no metadata).
"""
import argparse
import json
import os
import re
import struct

import numpy as np
from safetensors.numpy import save_file

F32 = np.float32


def e4m3_lut():
    lut = np.zeros(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 7
        if e == 15 and m == 7:
            lut[b] = np.nan
        elif e == 0:
            lut[b] = sign * (m / 8.0) * 2.0 ** -6
        else:
            lut[b] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return lut.astype(F32)


LUT = e4m3_lut()


class Shard:
    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self.raw = f.read()
        (n,) = struct.unpack("<Q", self.raw[:8])
        header = json.loads(self.raw[8:8 + n])
        header.pop("__metadata__", None)
        self.header = header
        self.base = 8 + n

    def names(self):
        return sorted(self.header)

    def array(self, name):
        info = self.header[name]
        b, e = info["data_offsets"]
        buf = self.raw[self.base + b:self.base + e]
        shape = info["shape"]
        dt = info["dtype"]
        if dt == "F32":
            a = np.frombuffer(buf, dtype="<f4").astype(F32)
        elif dt == "F16":
            a = np.frombuffer(buf, dtype="<f2").astype(F32)
        elif dt == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(F32)
        elif dt == "F8_E4M3":
            a = LUT[np.frombuffer(buf, dtype=np.uint8)]
        else:
            raise SystemExit(f"unsupported dtype {dt} for {name} in {self.path}")
        return dt, a.reshape(shape)


def load_f32(shards, index, shard, name):
    dt, a = shard.array(name)
    if dt == "F8_E4M3":
        o, i = a.shape
        sname = name + "_scale_inv"
        _, s = shards[index[sname]].array(sname)
        full = np.repeat(np.repeat(s.astype(F32), 128, axis=0), 128, axis=1)[:o, :i]
        a = (a * full).astype(F32)
    return a


def quant_int8_row(w):
    amax = np.abs(w).max(axis=1, keepdims=True)
    s = np.maximum(amax / F32(127), F32(1e-8)).astype(F32)
    q = np.clip(np.rint(w / s), -128, 127).astype(np.int8)
    return q.view(np.uint8).reshape(-1), s.reshape(-1)


def pack_nibbles(q):
    n = (q.astype(np.int16) + 8).astype(np.uint8)
    if n.shape[1] % 2:
        n = np.concatenate([n, np.zeros((n.shape[0], 1), np.uint8)], axis=1)
    return (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def quant_int4_row(w):
    amax = np.abs(w).max(axis=1, keepdims=True)
    s = np.maximum(amax / F32(7), F32(1e-8)).astype(F32)
    q = np.clip(np.rint(w / s), -8, 7)
    return pack_nibbles(q), s.reshape(-1)


def quant_int4_grouped(w, gs):
    o, i = w.shape
    ng = -(-i // gs)
    padded = np.zeros((o, ng * gs), dtype=F32)
    padded[:, :i] = w
    amax = np.abs(padded).reshape(o, ng, gs).max(axis=2)
    s = np.maximum(amax / F32(7), F32(1e-8)).astype(F32)
    full = np.repeat(s, gs, axis=1)[:, :i]
    q = np.clip(np.rint(w / full), -8, 7)
    return pack_nibbles(q), s.reshape(-1)


def layer_of(name):
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def wanted(pass_, name, n_layers):
    if name.endswith("_scale_inv"):
        return False
    layer = layer_of(name)
    if pass_ == "main":
        skip = ("indexer", "eh_proj", "enorm", "hnorm", "shared_head")
        return (layer is None or layer < n_layers) and not any(s in name for s in skip)
    if pass_ == "mtp":
        return layer is not None and layer >= n_layers
    return layer is not None and layer < n_layers and ".self_attn.indexer." in name


def keep_f32(name, shape):
    return ("e_score_correction_bias" in name or name.endswith("mlp.gate.weight")
            or name.endswith("norm.weight") or not name.endswith(".weight")
            or len(shape) != 2)


def bits_for(pass_, name, args):
    if pass_ == "main":
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return args.io_bits
        return args.ebits
    if pass_ == "mtp":
        return args.mtp_bits
    return 8


def quantize(w, bits, gs):
    if bits >= 5:
        return quant_int8_row(w)
    if gs > 0:
        return quant_int4_grouped(w, gs)
    return quant_int4_row(w)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--io-bits", type=int, default=8)
    p.add_argument("--ebits", type=int, default=4)
    p.add_argument("--mtp-bits", type=int, default=8)
    args = p.parse_args()
    with open(os.path.join(args.input, "config.json")) as f:
        n_layers = json.load(f)["num_hidden_layers"]
    files = sorted(f for f in os.listdir(args.input) if f.endswith(".safetensors"))
    shards = [Shard(os.path.join(args.input, f)) for f in files]
    index = {n: k for k, s in enumerate(shards) for n in s.names()}
    os.makedirs(args.output, exist_ok=True)
    for pass_, prefix in (("main", "out-"), ("mtp", "out-mtp-"), ("idx", "out-idx-")):
        k = 0
        for shard in shards:
            names = [n for n in shard.names() if wanted(pass_, n, n_layers)]
            if not names:
                continue
            out = {}
            for name in names:
                w = load_f32(shards, index, shard, name)
                if keep_f32(name, w.shape):
                    out[name] = np.ascontiguousarray(w, dtype=F32)
                else:
                    q, s = quantize(w, bits_for(pass_, name, args), args.group_size)
                    out[name] = q
                    out[name + ".qs"] = s
            save_file(out, os.path.join(args.output, f"{prefix}{k:05d}.safetensors"))
            k += 1


if __name__ == "__main__":
    main()
