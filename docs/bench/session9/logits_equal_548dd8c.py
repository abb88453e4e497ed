"""Logits of the tiny model (fp32 and bf16; `ref` and `pallas` in interpret mode; chunked prefill then decode) to
an .npz, for comparing two builds bit for bit (session 9: 548dd8c against 08864aa, docs/performance.md)."""

import sys

import numpy as np

from qwen35_jax.api import load_model
from qwen35_jax.kernels import mixers

prompt = [int(t) for t in np.random.default_rng(7).integers(3, 512, 90)]
out = {}
for dtype in ("float32", "bfloat16"):
    m = load_model("tiny", dtype=dtype)
    for name in ("ref", "pallas"):
        m.kernels = mixers(name, interpret=(name == "pallas"))
        out[f"{dtype}_{name}"] = np.asarray(m.logits_incremental(prompt, chunk_sizes=[40, 30], decode_from=80))
np.savez(sys.argv[1], **out)
