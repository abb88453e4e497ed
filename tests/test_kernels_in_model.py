"""The Pallas kernel set slots into the model without touching it: the tiny model's logits with every
token mixer replaced by its Pallas kernel (interpret mode on the CPU) match the reference set's, on the
paths serving uses (full prefill, chunked prefill continuing from the caches, one-token decode).

Tolerance 1e-4 on fp32 logits of std ~0.1-1: each kernel matches its reference to ~1e-6 relative in
fp32 (their own tests), and these differences pass through 8 layers; a wrong state hand-off or mask
moves logits by more than 1e-2.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qwen35_jax.kernels import mixers

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 512, 90)]


@pytest.mark.parametrize("gdn_state", ["gather", "in_pool"])
def test_pallas_set_matches_ref_in_the_model(tiny_model, gdn_state):
    ref = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    original = tiny_model.model_def
    tiny_model.kernels = mixers("pallas", interpret=True)
    tiny_model.model_def = dataclasses.replace(original, gdn_state=gdn_state)
    try:
        ours = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.kernels, tiny_model.model_def = mixers("ref"), original
    assert ours.shape == ref.shape == (len(PROMPT), tiny_model.config.vocab_size)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_pallas_is_the_gpu_default_and_refused_elsewhere():
    from qwen35_jax.api import default_kernels
    from qwen35_jax.kernels import check_selectable

    assert default_kernels("gpu") == "pallas" and default_kernels("cpu") == "ref"
    check_selectable("pallas", "gpu")
    check_selectable("ref", "cpu")
    with pytest.raises(ValueError, match="--kernels pallas needs a GPU"):
        check_selectable("pallas", "cpu")
    with pytest.raises(ValueError, match="unknown kernel set"):
        check_selectable("triton", "gpu")
