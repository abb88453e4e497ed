"""The model's two weight layouts compute the same model: stacked group weights run as a `lax.scan` (the CPU's
layout), per-group weights as a Python loop (the GPU's); and the fused input projections split for prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.api import load_model
from qwen35_jax.config import preset
from qwen35_jax.kernels.linear import linear_ref
from qwen35_jax.model import (
    FUSED_IN_PROJ_MAX_ROWS,
    MLP,
    Attention,
    GatedDeltaNet,
    _projections,
    fused_parts,
    layout_for_platform,
)

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 512, 90)]


def test_per_group_weights_compute_what_the_scan_does():
    """Chunked prefill then decode steps, which covers both sides' GDN states and the KV pages. Same operations in
    the same order per layer; only XLA's fusion and code-generation choices may differ: fp32 rounding, a few ulps of
    logits of std ~0.1-1, which the recurrent states carry forward. Measured under the test command's -O0 LLVM: 1.6e-6
    at most on one 2-core host, 6.8e-6 on an AMD EPYC one (XLA:CPU generates code for the host's vector units); so
    3e-5. A wrong weight or state would be off by ~0.1.
    Its own model: the GPU layout frees the stacked weights, which the session's `tiny_model` must keep."""
    model = load_model("tiny", dtype="float32")
    scan = model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    model.params = layout_for_platform(model.params, platform="gpu")
    assert isinstance(model.params["groups"], tuple) and len(model.params["groups"]) == 2
    per_group = model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    np.testing.assert_allclose(per_group, scan, atol=3e-5, rtol=0)


def test_layout_for_platform_splits_and_frees_the_stacked_weights_on_a_gpu_only():
    model = load_model("tiny", dtype="float32")
    stacked = jax.tree.leaves(model.params["groups"])
    assert layout_for_platform(model.params, platform="cpu") is model.params
    per_group = layout_for_platform(model.params, platform="gpu")
    assert all(x.is_deleted() for x in stacked)
    assert len(per_group["groups"]) == model.config.num_groups
    assert layout_for_platform(per_group, platform="gpu") is per_group


def test_gdn_in_proj_splits_for_prefill_sized_inputs():
    """Up to FUSED_IN_PROJ_MAX_ROWS rows the GDN in_proj is one product over the fused weight; above (prefill) it is
    two, the conv input and z in one and b and a in the other, which are exactly the separate products (the same dot
    products, bit for bit, XLA's CPU GEMM either way). One wider GEMM may block K differently on the CPU: a few fp32
    ulps (1e-5 relative on values ~30)."""
    cfg = preset("tiny")
    module = GatedDeltaNet(cfg, jnp.float32)
    module.in_proj.weight[...] = jax.random.normal(jax.random.key(0), module.in_proj.weight.shape)
    weight = np.asarray(module.in_proj.weight[...])
    qkvz = cfg.conv_dim + cfg.gdn_value_dim
    calls = []

    def counting_linear(x, w):
        calls.append(w.shape[0])
        return linear_ref(x, w)

    for rows, widths in (
        (FUSED_IN_PROJ_MAX_ROWS, [weight.shape[0]]),
        (FUSED_IN_PROJ_MAX_ROWS + 1, [qkvz, 2 * cfg.linear_num_value_heads]),
    ):
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size))
        calls.clear()
        product, ba, ba_col = module._in_projections(x, counting_linear)
        assert calls == widths, (rows, calls)
        got = np.concatenate(
            [np.asarray(product)[:, :qkvz], np.asarray(ba)[:, ba_col : ba_col + 2 * cfg.linear_num_value_heads]],
            axis=-1,
        )
        expected = np.concatenate([np.asarray(linear_ref(x, jnp.asarray(weight[:qkvz]))),
                                   np.asarray(linear_ref(x, jnp.asarray(weight[qkvz:])))], axis=-1)  # fmt: skip
        if rows > FUSED_IN_PROJ_MAX_ROWS:
            np.testing.assert_array_equal(got, expected)
        else:
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_attention_and_mlp_projections_are_one_product_at_prefill_sizes():
    """qkv_proj and gate_up_proj are one product over the fused weight at any row count: the attention inputs kernel
    reads q, k and v out of it in place (split products were merged back into one GEMM by XLA and then copied apart
    for the kernel), and the MLP's activation reads gate and up from it."""
    cfg = preset("tiny")
    calls = []

    def counting_linear(x, w):
        calls.append(w.shape[0])
        return linear_ref(x, w)

    x = jax.random.normal(jax.random.key(1), (FUSED_IN_PROJ_MAX_ROWS + 1, cfg.hidden_size))
    attention, mlp = Attention(cfg, jnp.float32), MLP(cfg, jnp.float32)
    for name, module in (("qkv_proj", attention.qkv_proj), ("gate_up_proj", mlp.gate_up_proj)):
        calls.clear()
        outs = _projections(cfg, name, module, x, counting_linear)
        widths = [width for _, width in fused_parts(cfg)[name]]
        assert calls == [sum(widths)], (name, calls)
        assert [out.shape[-1] for out in outs] == widths
