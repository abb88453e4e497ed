"""The attention layer's input kernel (`kernels.attention_inputs`: q/k norms, RoPE and the K/V page writes) against
its reference: in interpret mode on the CPU, lowered for the H200, and compiled on the GPU (`-m gpu`).

Tolerances: both sides compute the same fp32 expressions on the same bf16 values (the norm's scale, the products
with cos and sin) and round at the same points; they differ only in the order of the sum of squares (D fp32 terms),
a relative difference of a few fp32 ulps in the scale. A value that close to a bf16 rounding boundary can round the
other way: one bf16 step (2^-7 relative) in the normalised value, which the rotation carries into at most its two
products and their sum, so |dq| <= 2 * 2^-7 * (|x cos| + |x' sin|) + 2^-7 |q| at a rotated lane. Such flips are
rare (the check also bounds their share at 1%); a wrong partner lane, sign, table entry, weight without its +1 or
page slot moves values by O(1), far outside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.attention_inputs import (
    apply_rope,
    attention_inputs_pallas,
    attention_inputs_ref,
    split_qkv,
)
from qwen35_jax.kernels.residual_norm import rms_norm

EPS = 1e-6
STEP = 2.0**-7


def rope_tables(positions, rot: int, theta: float = 1e7):
    inv = 1.0 / (theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(jnp.bfloat16), jnp.sin(emb).astype(jnp.bfloat16)


def case(tokens, heads, kv_heads, dim, rot, *, pages=6, page_size=16, layers=2, seed=0):
    """(the fused qkv product, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset): distinct
    slots, and with more than one token the last is a padding token at the trash page 0."""
    keys = jax.random.split(jax.random.key(seed), 6)
    qkv = jax.random.normal(keys[0], (tokens, (2 * heads + 2 * kv_heads) * dim)).astype(jnp.bfloat16)
    q_norm, k_norm = ((0.2 * jax.random.normal(k, (dim,))).astype(jnp.bfloat16) for k in keys[1:3])
    cos, sin = rope_tables(jax.random.randint(keys[3], (tokens,), 0, 40000), rot)
    k_pages = jax.random.normal(keys[4], (layers, pages, page_size, kv_heads, dim)).astype(jnp.bfloat16)
    v_pages = jax.random.normal(keys[5], k_pages.shape).astype(jnp.bfloat16)
    slots = np.random.default_rng(seed).choice(np.arange(page_size, pages * page_size), tokens, replace=False)
    kv_page, kv_offset = slots // page_size, slots % page_size
    if tokens > 1:
        kv_page[-1] = 0  # a padding token: the trash page
    return qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, 1, jnp.asarray(kv_page), jnp.asarray(kv_offset)


def as64(x):
    return np.float64(np.float32(x))


def assert_close(got, want, bound, name):
    err = np.abs(as64(got) - as64(want))
    assert err.size, f"{name}: nothing compared"
    assert np.all(err <= bound), (
        f"{name}: max err {err.max():.3g} where the bound is {bound.flat[np.argmax(err - bound)]:.3g}"
    )
    assert np.mean(err > 0) < 0.01, f"{name}: {np.mean(err > 0):.1%} of values differ (rounding flips only)"


def rope_bound(normed, cos, sin, roped):
    """The module docstring's bound per lane of rope(normed): [N, heads, D]."""
    rot = cos.shape[-1]
    x, c, s = as64(normed), as64(cos)[:, None, :], as64(sin)[:, None, :]
    half = rot // 2
    partner = np.concatenate([x[..., half:rot], x[..., :half]], axis=-1)
    rotated = 2 * STEP * (np.abs(x[..., :rot] * c) + np.abs(partner * s)) + STEP * np.abs(as64(roped)[..., :rot])
    return np.concatenate([rotated, STEP * np.abs(x[..., rot:])], axis=-1) + 1e-6


def check(args, heads, kv_heads, out):
    """The kernel's (q, k, gate, k_pages, v_pages) against the reference's, within the bounds; the gate and V bit
    for bit; every page slot the step does not write is bit-identical."""
    qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset = args
    ref = attention_inputs_ref(*args, heads=heads, kv_heads=kv_heads, eps=EPS)
    q_gate, k_raw, v_raw = split_qkv(qkv, heads, kv_heads)
    dim = k_raw.shape[-1]
    q_bound = rope_bound(rms_norm(q_gate[..., :dim], q_norm, EPS), cos, sin, ref[0])
    k_bound = rope_bound(rms_norm(k_raw, k_norm, EPS), cos, sin, ref[1])
    assert_close(out[0], ref[0], q_bound, "q")
    assert_close(out[1], ref[1], k_bound, "k")
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(q_gate[..., dim:]))  # each head's second half
    written = np.zeros(k_pages.shape[:3], bool)
    written[layer, np.asarray(kv_page), np.asarray(kv_offset)] = True
    real = np.asarray(kv_page) != 0  # the padding token's write to the trash page is not compared
    for name, got, want, before in (("k_pages", out[3], ref[3], k_pages), ("v_pages", out[4], ref[4], v_pages)):
        np.testing.assert_array_equal(np.asarray(got)[~written], np.asarray(before)[~written], err_msg=name)
        rows = np.asarray(got)[layer, np.asarray(kv_page)[real], np.asarray(kv_offset)[real]]
        want_rows = np.asarray(want)[layer, np.asarray(kv_page)[real], np.asarray(kv_offset)[real]]
        bound = k_bound[real] if name == "k_pages" else np.zeros(want_rows.shape)
        assert_close(rows, want_rows, bound, name)
    v_rows = np.asarray(out[4])[layer, np.asarray(kv_page)[real], np.asarray(kv_offset)[real]]
    np.testing.assert_array_equal(v_rows, np.asarray(v_raw)[real])  # V as projected, bit for bit


def run_kernel(args, heads, kv_heads, interpret=True):
    fn = jax.jit(lambda *a: attention_inputs_pallas(*a, heads=heads, kv_heads=kv_heads, eps=EPS, interpret=interpret))
    return fn(*args)


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim, rot",
    [(3, 16, 4, 256, 64), (5, 4, 2, 64, 16), (2, 8, 8, 32, 32)],
    ids=["4b-heads", "small", "no-gqa-full-rotation"],
)
def test_fused_product_matches_ref(tokens, heads, kv_heads, dim, rot):
    args = case(tokens, heads, kv_heads, dim, rot)
    check(args, heads, kv_heads, run_kernel(args, heads, kv_heads))


def test_ref_is_norm_then_partial_rope():
    """The reference is HF's order: zero-centred RMSNorm of each head's query half, then RoPE on the first rot dims
    with rotate_half pairs; v goes to the pages untouched."""
    args = case(2, 4, 2, 64, 16, seed=5)
    q, k, gate, k_pages, v_pages = attention_inputs_ref(*args, heads=4, kv_heads=2, eps=EPS)
    q_gate, k_raw, v_raw = split_qkv(args[0], 4, 2)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(apply_rope(rms_norm(q_gate[..., :64], args[1], EPS),
                                                                       args[3], args[4])))  # fmt: skip
    normed = np.asarray(rms_norm(q_gate[..., :64], args[1], EPS))
    assert not np.array_equal(np.asarray(q[..., :16]), normed[..., :16])  # rotated
    np.testing.assert_array_equal(np.asarray(q[..., 16:]), normed[..., 16:])  # passed through
    np.testing.assert_array_equal(np.asarray(v_pages[1, args[8][0], args[9][0]]), np.asarray(v_raw[0]))
    np.testing.assert_array_equal(np.asarray(k_pages[1, args[8][0], args[9][0]]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(q_gate[..., 64:]))


def test_other_head_counts_take_the_reference():
    """Six heads (not a power of two: no Triton block) gives the reference's results, with no pallas_call."""
    args = case(2, 6, 2, 32, 16)
    jaxpr = jax.make_jaxpr(lambda *a: attention_inputs_pallas(*a, heads=6, kv_heads=2, eps=EPS))(*args)
    assert "pallas_call" not in str(jaxpr)
    check(args, 6, 2, run_kernel(args, 6, 2))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200_with_the_pages_aliased():
    """4B heads over the 4B page pools at 65536 pages (17 GB each, given abstractly): one program a token, the
    pools aliased in to out (operands 11 and 12 -> results 3 and 4)."""
    args = list(case(64, 16, 4, 256, 64))
    pages = jax.ShapeDtypeStruct((8, 65536, 16, 4, 256), jnp.bfloat16)
    args[5] = args[6] = pages
    text = lower_for_h200(lambda *a: attention_inputs_pallas(*a, heads=16, kv_heads=4, eps=EPS), *args).as_text()
    assert "attention_inputs" in text
    assert "output_operand_alias<output_tuple_indices = [3], operand_index = 11" in text
    assert "output_operand_alias<output_tuple_indices = [4], operand_index = 12" in text


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_gpu_compiled_matches_ref(tokens):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU; JAX runs on " + jax.default_backend())
    args = case(tokens, 16, 4, 256, 64, pages=2 * tokens // 16 + 4, seed=tokens)
    check(args, 16, 4, run_kernel(args, 16, 4, interpret=False))
