"""The layer loop's three forms compute the same model: `scan` (the default), `unrolled` and `unstacked`
(kept for GPU A/B measurements of the scan's cost, docs/performance.md); so does the fused gate/up MLP weight."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.config import preset
from qwen35_jax.kernels.linear import linear_ref
from qwen35_jax.model import fuse_weights, unstack_groups

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


def test_unstacked_layer_loop_equals_scan(tiny_model):
    scan = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    original_def, original_params = tiny_model.model_def, tiny_model.params
    tiny_model.model_def = dataclasses.replace(original_def, layer_loop="unstacked")
    tiny_model.params = unstack_groups(original_params)
    try:
        assert isinstance(tiny_model.params["groups"], tuple) and len(tiny_model.params["groups"]) == 2
        unstacked = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.model_def, tiny_model.params = original_def, original_params
    np.testing.assert_allclose(unstacked, scan, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer_loop", ["scan", "unstacked"])
def test_fused_mlp_equals_separate_gate_and_up(layer_loop):
    """fuse_weights(mlp=True): one [2 x intermediate, hidden] product, split, instead of two products over the same rows: each
    output is the same dot product (1e-6: only XLA's GEMM blocking may differ); the gate rows come first.
    A model of its own: the shared tiny model is fused in place by the engines built from it (the default)."""
    from qwen35_jax.api import load_model

    tiny_model = load_model("tiny", dtype="float32")
    separate = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    original_def, original_params = tiny_model.model_def, tiny_model.params
    try:
        fused_def, fused_params = fuse_weights(original_def, original_params, mlp=True)
        mlp = fused_params["groups"]["layers"][0]["mlp"]
        assert fused_def.fused_mlp and set(mlp) == {"gate_up_proj", "down_proj"}
        gate = original_params["groups"]["layers"][0]["mlp"]["gate_proj"]["weight"][...]
        np.testing.assert_array_equal(mlp["gate_up_proj"]["weight"][...][:, : gate.shape[1]], gate)
        if layer_loop == "unstacked":
            fused_def, fused_params = (
                dataclasses.replace(fused_def, layer_loop=layer_loop),
                unstack_groups(fused_params),
            )
        tiny_model.model_def, tiny_model.params = fused_def, fused_params
        fused = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.model_def, tiny_model.params = original_def, original_params
    np.testing.assert_allclose(fused, separate, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer_loop", ["scan", "unstacked"])
def test_fused_qkv_equals_separate_input_projections(layer_loop):
    """fuse_weights(qkv=True): each GDN layer's qkv, z, b, a weights as one `in_proj`, each attention layer's
    q, k, v as one `qkv_proj`, added to a model whose MLP is fused already (which stays fused); the rows keep the
    listed order. Each output is the same dot product as before, but XLA's CPU GEMM blocks K differently for a
    wider N: the products differ by a few fp32 ulps (measured 1.1e-5 on values ~30), which the GDN recurrence
    carries through 8 layers and 90 tokens to <= 2.7e-5 on logits of std ~0.1-1 (measured). Tolerance 1e-4, as
    for the Pallas set in the model (tests/test_kernels_in_model.py); a mis-ordered or mis-split weight moves
    logits by O(0.1)."""
    from qwen35_jax.api import load_model
    from qwen35_jax.model import FUSED_QKV

    model = load_model("tiny", dtype="float32")
    separate = model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    mlp_def, mlp_params = fuse_weights(model.model_def, model.params, mlp=True)
    fused_def, fused_params = fuse_weights(mlp_def, mlp_params, qkv=True)
    assert fused_def.fused_mlp and fused_def.fused_qkv
    layers = fused_params["groups"]["layers"]
    gdn, attention = layers[0]["linear_attn"], layers[len(layers) - 1]["self_attn"]
    assert "in_proj" in gdn and not set(FUSED_QKV["in_proj"]) & set(gdn)
    assert "qkv_proj" in attention and not set(FUSED_QKV["qkv_proj"]) & set(attention)
    assert "gate_up_proj" in layers[0]["mlp"]
    original = model.params["groups"]["layers"]
    z = original[0]["linear_attn"]["in_proj_z"]["weight"][...]
    rows = model.config.conv_dim
    np.testing.assert_array_equal(gdn["in_proj"]["weight"][...][:, rows : rows + z.shape[1]], z)
    if layer_loop == "unstacked":
        fused_def, fused_params = dataclasses.replace(fused_def, layer_loop=layer_loop), unstack_groups(fused_params)
    model.model_def, model.params = fused_def, fused_params
    fused = model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    np.testing.assert_allclose(fused, separate, atol=1e-4, rtol=0)


def test_fuse_weights_refuses_unstacked_params(tiny_model):
    with pytest.raises(ValueError, match="stacked"):
        fuse_weights(tiny_model.model_def, unstack_groups(tiny_model.params), mlp=True)


def test_unstacked_loop_refuses_stacked_params(tiny_model):
    original = tiny_model.model_def
    tiny_model.model_def = dataclasses.replace(original, layer_loop="unstacked")
    try:
        with pytest.raises(TypeError, match="unstack_groups"):
            tiny_model.logits(PROMPT[:8])
    finally:
        tiny_model.model_def = original


@pytest.mark.parametrize("layer_loop", ["scan", "unstacked"])
def test_in_pool_gdn_state_equals_gather(tiny_model, layer_loop):
    """gdn_state "in_pool" (decode rows' recurrent states updated in the slot pool) computes what "gather"
    does: chunked prefill, then decode steps, which is where the two differ. Same ops on the same values."""
    gather = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    original_def, original_params = tiny_model.model_def, tiny_model.params
    tiny_model.model_def = dataclasses.replace(original_def, layer_loop=layer_loop, gdn_state="in_pool")
    if layer_loop == "unstacked":
        tiny_model.params = unstack_groups(original_params)
    try:
        in_pool = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.model_def, tiny_model.params = original_def, original_params
    np.testing.assert_allclose(in_pool, gather, atol=1e-6, rtol=0)


def test_unstack_groups_can_free_the_stacked_weights():
    from qwen35_jax.api import load_model

    model = load_model("tiny", dtype="float32")
    stacked = jax.tree.leaves(model.params["groups"])
    kept = unstack_groups(model.params)
    assert not any(x.is_deleted() for x in stacked)
    freed = unstack_groups(model.params, delete_stacked=True)
    assert all(x.is_deleted() for x in stacked)
    for a, b in zip(jax.tree.leaves(kept["groups"]), jax.tree.leaves(freed["groups"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fused_input_projections_split_for_prefill_sized_inputs():
    """Up to FUSED_QKV_MAX_ROWS rows a fused input projection is one product over the fused weight; above (prefill) each
    part is its own product over the part's rows of the fused weight, so the outputs are exactly the unfused
    layer's (the same dot products, bit for bit, XLA's CPU GEMM either way), and the fused MLP stays one product."""
    from qwen35_jax.model import FUSED_QKV_MAX_ROWS, MLP, GatedDeltaNet, _projections

    cfg = preset("tiny")
    module = GatedDeltaNet(cfg, jnp.float32, fused=True)
    module.in_proj.weight[...] = jax.random.normal(jax.random.key(0), module.in_proj.weight.shape)
    widths = module._widths()
    bounds = np.cumsum(widths)[:-1]
    calls = []

    def counting_linear(x, w):
        calls.append(w.shape[0])
        return linear_ref(x, w)

    for rows, parts in ((FUSED_QKV_MAX_ROWS, [sum(widths)]), (FUSED_QKV_MAX_ROWS + 1, list(widths))):
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size))
        calls.clear()
        outs = _projections(module, "in_proj", widths, x, counting_linear)
        assert calls == parts, (rows, calls)
        for out, w in zip(outs, np.split(np.asarray(module.in_proj.weight[...]), bounds), strict=True):
            expected = linear_ref(x, jnp.asarray(w))
            if rows > FUSED_QKV_MAX_ROWS:
                np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
            else:  # one wider GEMM: CPU blocking may differ by a few ulps (test above)
                np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5, rtol=1e-5)
    mlp = MLP(cfg, jnp.float32, fused=True)
    calls.clear()
    _projections(mlp, "gate_up_proj", mlp.widths, x, counting_linear)  # x: the prefill-sized rows
    assert calls == [sum(mlp.widths)], calls
