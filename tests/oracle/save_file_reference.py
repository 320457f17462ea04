#!/usr/bin/env python3
"""Writes a reference safetensors file with `safetensors.numpy.save_file` (no metadata).

usage: save_file_reference.py OUT SPEC_JSON
SPEC_JSON is a list of [name, dtype, shape, fill_byte]; every byte of a tensor's data
is fill_byte. dtype is a safetensors dtype name numpy supports (F64 F32 F16 I64 I32
I16 I8 U8 ...).
"""
import json
import sys

import numpy as np
from safetensors.numpy import save_file

NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
      "I16": "<i2", "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4"}

out, spec = sys.argv[1], json.loads(sys.argv[2])
tensors = {}
for name, dtype, shape, fill in spec:
    dt = np.dtype(NP[dtype])
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    tensors[name] = np.frombuffer(bytes([fill]) * n, dtype=dt).reshape(shape)
save_file(tensors, out)
