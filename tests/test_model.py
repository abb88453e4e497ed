"""The layer loop's two forms compute the same model: `scan` (the default) and `unrolled` (kept for GPU
A/B measurements of the scan's cost, docs/performance.md)."""

from __future__ import annotations

import dataclasses

import numpy as np

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 512, 90)]


def test_unrolled_layer_loop_equals_scan(tiny_model):
    scan = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    original = tiny_model.model_def
    tiny_model.model_def = dataclasses.replace(original, layer_loop="unrolled")
    try:
        unrolled = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.model_def = original
    # Same operations in the same order per layer; only XLA's fusion choices may differ (fp32 rounding).
    np.testing.assert_allclose(unrolled, scan, atol=1e-6, rtol=0)
