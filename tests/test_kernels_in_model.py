"""The Pallas kernel set slots into the model without touching it: the tiny model's logits with every
token mixer replaced by its Pallas kernel (interpret mode on the CPU) match the reference set's, on the
paths serving uses (full prefill, chunked prefill continuing from the caches, one-token decode).

Tolerance 1e-4 on fp32 logits of std ~0.1-1: each kernel matches its reference to ~1e-6 relative in
fp32 (their own tests), and these differences pass through 8 layers; a wrong state hand-off or mask
moves logits by more than 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_jax.kernels import mixers

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 512, 84)]  # two prompt chunks, then 4 decode steps


def test_pallas_set_matches_ref_in_the_model(tiny_model):
    ref = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    tiny_model.kernels = mixers("pallas", interpret=True)
    try:
        ours = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.kernels = mixers("ref")
    assert ours.shape == ref.shape == (len(PROMPT), tiny_model.config.vocab_size)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_pallas_is_the_gpu_default_and_refused_elsewhere(monkeypatch):
    from qwen35_jax.api import default_kernels
    from qwen35_jax.kernels import check_selectable, chunk_attention

    # The set also needs tokamax on a GPU (tests/test_kernels_chunk_attention.py); here it is taken as present.
    monkeypatch.setattr(chunk_attention, "tokamax_attention", lambda: None)
    assert default_kernels("gpu") == "pallas" and default_kernels("cpu") == "ref"
    check_selectable("pallas", "gpu")
    check_selectable("ref", "cpu")
    with pytest.raises(ValueError, match="--kernels pallas needs a GPU"):
        check_selectable("pallas", "cpu")
    with pytest.raises(ValueError, match="unknown kernel set"):
        check_selectable("triton", "gpu")


def lowered_4b_step(kernel_set, key, per_group: bool = False) -> str:
    """The text of the 4B step program for `key` (decode rows, prompt chunks, chunk tokens) with `kernel_set`,
    lowered for an abstract H200 (nothing allocated); per_group: the weights unstacked into per-group arrays."""
    import jax
    import jax.numpy as jnp
    from _lowering import lower_jitted_for_h200

    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.config import preset
    from qwen35_jax.model import abstract_model, unstack_groups
    from qwen35_jax.serving.runner import Buckets, Runner

    model_def, params = abstract_model(preset("4b"), jnp.bfloat16)
    if per_group:
        params = jax.eval_shape(unstack_groups, params)
    decode, chunks, tokens = key
    buckets = Buckets((max(decode, 1),), (max(chunks, 1),), (max(tokens, 64),))
    runner = Runner(model_def, params, kernel_set, CacheSpec(4, 16, 2), buckets, 256)
    return lower_jitted_for_h200(runner._jitted, *runner.lowering_args(key)).as_text()


@pytest.mark.parametrize("layout", ["stacked", "per_group"])
def test_each_kernel_is_lowered_once_per_program(layout):
    """A 4B unified step program lowered for an abstract H200 holds each Triton kernel once, however many
    layers call it (the kernels are nested jits; a bare pallas_call is lowered again at every call site,
    which made a per-group program take seconds to lower). Unified step: conv prefill + update, GDN
    prefill (3 kernels) + in-pool decode, the attention inputs, decode attention and its gated merge, the residual
    add + norm = 10 distinct kernels (68 rows: the weight products are XLA's); prefill attention is the
    reference's here, since tokamax's Mosaic GPU chunk kernel lowers only on a real GPU."""
    from qwen35_jax.kernels import REF

    kernel_set = mixers("pallas")._replace(prefill_attention=REF.prefill_attention)
    text = lowered_4b_step(kernel_set, (4, 1, 64), per_group=layout == "per_group")
    assert text.count("__gpu$xla.gpu.triton") == 10


def test_decode_kernels_let_the_next_kernel_launch_early():
    """A 4B batch-1 decode step lowered for an abstract H200: the weight products (`linear`, `norm_linear`), the GDN
    decode, the conv update and decode attention let the kernel after them launch from their entry
    (`griddepcontrol.launch_dependents`, `kernels.device.start_dependents`); the attention inputs and the lone
    residual norm do not. Each kernel is a private function of the lowered module, suffixed when lowered at
    several shapes."""
    import re

    text = lowered_4b_step(mixers("pallas"), (1, 0, 0))
    signals = {}
    for function in text.split("func.func private @")[1:]:
        if "__gpu$xla.gpu.triton" in function:
            name = re.sub(r"_\d+$", "", function.split("(")[0])
            signals.setdefault(name, set()).add("griddepcontrol.launch_dependents" in function)
    assert signals == {
        "linear_parts_pallas": {True},
        "norm_linear_pallas": {True},
        "gdn_decode_pool_gated_pallas": {True},
        "causal_conv1d_update_pool_pallas": {True},
        "paged_decode_attention_pallas": {True},
        "attention_inputs_pallas": {False},
        "residual_norm_pallas": {False},
    }
